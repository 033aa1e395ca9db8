"""XQuant: kvcal/methods/xquant/ (method.py: the config and its registration; calibrate.py: the SVDs of the projection
weights; storage.py: the codec and the packed storages; kernels.py: the packed storage's Triton kernels)."""

from kvcal.methods.xquant.method import XQuant

__all__ = ["XQuant"]
