"""XQuant: kvcal/methods/xquant/ (method.py: the config and its registration)."""

from kvcal.methods.xquant.method import XQuant

__all__ = ["XQuant"]
