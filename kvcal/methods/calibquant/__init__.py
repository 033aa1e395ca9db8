"""CalibQuant: kvcal/methods/calibquant/ (method.py: the config and its registration)."""

from kvcal.methods.calibquant.method import CalibQuant

__all__ = ["CalibQuant"]
