"""CommVQ: kvcal/methods/commvq/ (method.py: the config and its registration)."""

from kvcal.methods.commvq.method import CommVQ

__all__ = ["CommVQ"]
