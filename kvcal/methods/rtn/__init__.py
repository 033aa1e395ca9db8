"""RTN: kvcal/methods/rtn/ (method.py: the config and its registration)."""

from kvcal.methods.rtn.method import RTN

__all__ = ["RTN"]
