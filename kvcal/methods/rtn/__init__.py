"""RTN: kvcal/methods/rtn/ (method.py: the config and its registration; storage.py: the codec and
storage; kernels.py: the Triton kernels)."""

from kvcal.methods.rtn.method import RTN

__all__ = ["RTN"]
