"""KIVI: kvcal/methods/kivi/ (method.py: the config and its registration)."""

from kvcal.methods.kivi.method import KIVI

__all__ = ["KIVI"]
