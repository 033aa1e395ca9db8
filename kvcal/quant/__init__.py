"""Shared numerics: RoPE, uniform quantizers, bit packing, weighted k-means. Methods import from here."""
