"""Evict: kvcal/methods/evict/ (method.py: the config and its registration; storage.py: the codec and
storage; no kernels of its own)."""

from kvcal.methods.evict.method import Evict

__all__ = ["Evict"]
