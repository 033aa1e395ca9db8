"""kvcal: offline calibration and a compressed runtime for the KV cache of decoder LLMs."""

__version__ = "0.1.0"
