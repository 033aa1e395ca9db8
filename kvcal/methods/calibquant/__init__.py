"""CalibQuant: kvcal/methods/calibquant/ (method.py: the config and its registration; calibrate.py: the tau grid search;
storage.py: the codec and the packed storage; kernels.py: the packed storage's Triton kernels)."""

from kvcal.methods.calibquant.method import CalibQuant

__all__ = ["CalibQuant"]
