"""KV-cache compression methods: one file each, registered by name."""

from kvcal.methods.base import Codec, FlushPolicy, Method
from kvcal.methods.registry import all_methods, build_method, method_class

__all__ = ["Codec", "FlushPolicy", "Method", "all_methods", "build_method", "method_class"]
