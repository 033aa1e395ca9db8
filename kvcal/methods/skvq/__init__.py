"""SKVQ: kvcal/methods/skvq/ (method.py: the config and its registration; calibrate.py: channel layouts and clip
ratios from captured activations; storage.py: the codec, the packed storage and their torch quantizers; kernels.py:
the Triton kernels)."""

from kvcal.methods.skvq.method import SKVQ

__all__ = ["SKVQ"]
