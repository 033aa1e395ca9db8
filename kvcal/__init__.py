"""kvcal: offline calibration and a compressed runtime for the KV cache of decoder LLMs.

    import kvcal
    cache = kvcal.load_cache("artifacts/smollm2-135m/kvquant-nuq4-1pct.safetensors", model)
    model.generate(input_ids, cache=cache)  # transformers >= 5.24; past_key_values=cache before

The functions below import what they need when called: every `import kvcal.<module>` runs this file first
(kvcal.cli's `--help` and one-line input errors included), so it stays free of torch and transformers.
"""

from kvcal.version import __version__, software_versions

__all__ = ["__version__", "load_cache", "load_model", "software_versions"]


def load_cache(artifact, model, backend: str = "packed", capacity: int = 0):
    """See kvcal.generate.load_cache."""
    from kvcal.generate import load_cache as _load_cache

    return _load_cache(artifact, model, backend, capacity)


def load_model(name: str, dtype: str = "float32", device: str = "cpu", device_map=None, max_memory=None):
    """See kvcal.models.load_model (device_map: 'auto' or an explicit map spreads the layers over several GPUs)."""
    from kvcal.models import load_model as _load_model

    return _load_model(name, dtype, device, device_map=device_map, max_memory=max_memory)
