"""kvcal: offline calibration and a compressed runtime for the KV cache of decoder LLMs.

    import kvcal
    cache = kvcal.load_cache("artifacts/smollm2-135m/kvquant-nuq4-1pct.safetensors", model)
    model.generate(input_ids, cache=cache)  # transformers >= 5.24; past_key_values=cache before
"""

__version__ = "0.1.0"


def load_cache(artifact, model, backend: str = "packed", capacity: int = 0):
    """See kvcal.runtime.generate.load_cache."""
    from kvcal.generate import load_cache as _load_cache

    return _load_cache(artifact, model, backend, capacity)


def load_model(name: str, dtype: str = "float32", device: str = "cpu", device_map=None, max_memory=None):
    """See kvcal.models.load_model (device_map: 'auto' or an explicit map spreads the layers over several GPUs)."""
    from kvcal.models import load_model as _load_model

    return _load_model(name, dtype, device, device_map=device_map, max_memory=max_memory)


def software_versions() -> dict:
    """The versions a measured number depends on, for its record: the same command and code gave quantized
    perplexities that differ between installations by up to 2.8% (rtn int2; fp16 by 3e-8; README, Baselines)."""
    import platform

    import numpy
    import torch
    import transformers

    versions = {"kvcal": __version__, "python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "numpy": numpy.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency; the record still says what it can
        pass
    return versions

