"""SKVQ: kvcal/methods/skvq/ (method.py: the config and its registration)."""

from kvcal.methods.skvq.method import SKVQ

__all__ = ["SKVQ"]
