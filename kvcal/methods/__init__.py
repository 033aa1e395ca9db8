"""KV-cache compression methods: one folder each (kvcal/methods/<name>/), registered by name."""

from kvcal.methods.base import FlushPolicy, Method, Storage, Storages
from kvcal.methods.registry import all_methods, build_method, method_class

__all__ = ["FlushPolicy", "Method", "Storage", "Storages", "all_methods", "build_method", "method_class"]
