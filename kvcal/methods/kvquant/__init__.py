"""KVQuant: kvcal/methods/kvquant/ (method.py: the config and its registration)."""

from kvcal.methods.kvquant.method import KVQuant

__all__ = ["KVQuant"]
