"""KIVI: kvcal/methods/kivi/ (method.py: the config and its registration; storage.py: the codec and
storage; kernels.py: the Triton kernels)."""

from kvcal.methods.kivi.method import KIVI

__all__ = ["KIVI"]
