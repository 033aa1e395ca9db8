"""Evict: kvcal/methods/evict/ (method.py: the config and its registration)."""

from kvcal.methods.evict.method import Evict

__all__ = ["Evict"]
