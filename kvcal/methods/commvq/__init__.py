"""CommVQ: kvcal/methods/commvq/ (method.py: the config and its registration; calibrate.py: the fits; storage.py:
the codec and packed storage; packing.py: the bit streams; kernels.py: the Triton kernels)."""

from kvcal.methods.commvq.method import CommVQ

__all__ = ["CommVQ"]
