"""FP16: kvcal/methods/fp16/ (method.py: the config and its registration)."""

from kvcal.methods.fp16.method import FP16

__all__ = ["FP16"]
