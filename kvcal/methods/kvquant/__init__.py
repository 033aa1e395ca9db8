"""KVQuant: kvcal/methods/kvquant/ (method.py: the config and its registration; calibrate.py: the tables learned
from captured activations; storage.py: the codec, the packed storage and their torch quantizers; kernels.py: the
Triton kernels)."""

from kvcal.methods.kvquant.method import KVQuant

__all__ = ["KVQuant"]
