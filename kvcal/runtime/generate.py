"""`kvcal.load_cache` and `kvcal generate`: the compressed cache in transformers' generate()."""

from __future__ import annotations

from kvcal.accounting import bits_per_element, kv_elements
from kvcal.errors import KvcalError
from kvcal.runtime.cache import KvcalCache


def as_loaded(model):
    """A LoadedModel for a model kvcal loaded, or for any supported transformers model (adapter installed)."""
    from kvcal.models import LoadedModel, ModelDims
    from kvcal.models.adapter import install_adapter

    if isinstance(model, LoadedModel):
        return model
    existing = getattr(model, "_kvcal_loaded", None)
    if existing is not None:
        return existing
    dims = ModelDims.from_config(model.config)
    name = getattr(model.config, "_name_or_path", None) or type(model).__name__
    loaded = LoadedModel(name, model, None, dims, {"unverified": True})
    install_adapter(loaded)
    model._kvcal_loaded = loaded
    return loaded


def load_cache(artifact, model, backend: str = "packed", capacity: int = 0, step_graphs: bool = True,
               **runtime) -> KvcalCache:
    """A fresh compressed cache for `model` (a kvcal LoadedModel or a transformers model) from an
    artifact (path or Artifact). Pass it as `model.generate(..., cache=cache)` (transformers >= 5.24;
    `past_key_values=cache` before: kvcal.models.adapter.cache_kwargs gives the installed spelling). On CUDA each
    layer replays its one-token decode step from a CUDA graph (`step_graphs`, see KvcalCache). Other keyword
    arguments override the method's runtime fields (e.g. `key_outlier_capacity=16` for kvquant)."""
    from kvcal.artifact import Artifact, check_model, load_artifact
    from kvcal.methods import build_method
    from kvcal.methods.registry import runtime_overrides

    art = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
    loaded = as_loaded(model)
    check_model(art, loaded, artifact if not isinstance(artifact, Artifact) else "artifact",
                identity=not loaded.source.get("unverified"))
    method = build_method(art.method, {**art.config, **runtime_overrides(art.method, runtime)})
    codec = method.build_codec(art.tensors, loaded.dims)
    return KvcalCache(codec, loaded.dims.num_layers, backend, capacity, step_graphs=step_graphs)


def generate_text(prompt: str, model_name, artifact_path, method_name, sets, max_new_tokens: int, dtype, device,
                  backend: str = "packed", mode: str = "auto", device_map=None, max_memory=None) -> dict:
    """Greedy continuation of `prompt` with the compressed cache (mode: see runtime.graph.greedy_decode; 'auto'
    replays decode steps from a CUDA graph on CUDA where the codec's steps are static, else runs them eagerly)."""
    from kvcal.artifact import load_artifact
    from kvcal.methods.registry import codec_for_artifact
    from kvcal.models import artifact_model, load_model
    from kvcal.recipes import resolve
    from kvcal.runtime.graph import DECODE_MODES, greedy_decode

    if max_new_tokens <= 0:
        raise KvcalError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    if mode not in DECODE_MODES:
        raise KvcalError(f"unknown decode mode '{mode}' (one of {', '.join(DECODE_MODES)})")
    art = None
    if artifact_path is not None:
        art = load_artifact(artifact_path)
        model_name = model_name or artifact_model(art.header["model"], artifact_path)
    loaded = load_model(model_name or "smollm2-135m", dtype, device, device_map=device_map, max_memory=max_memory)
    if art is not None:
        method, codec = codec_for_artifact(art, loaded, artifact_path, sets)
    else:
        method, _, _ = resolve(method_name or "fp16", None, sets)
        if method.needs_artifact():
            raise KvcalError(f"method {method.name} needs an artifact: run `kvcal calibrate --method {method.name}` "
                             "and pass it with --artifact")
        codec = method.build_codec({}, loaded.dims)
    if loaded.tokenizer is None:
        raise KvcalError(f"{loaded.name} has no tokenizer")
    ids = loaded.tokenizer(prompt, return_tensors="pt").input_ids.to(loaded.device)
    cache = KvcalCache(codec, loaded.dims.num_layers, backend, capacity_hint=ids.shape[1] + max_new_tokens)
    result = greedy_decode(loaded, cache, ids, max_new_tokens, loaded.tokenizer.eos_token_id, mode)
    new_tokens = result["tokens"][0]
    timed, seconds = result["timed_steps"], result["decode_seconds"]
    if not timed:
        speed = "decode: no step after the prefill"
    else:
        plural = "s" if timed > 1 else ""
        speed = f"decode: {timed} step{plural} in {seconds:.2f} s ({timed / seconds:.1f} tokens/s, {result['mode']})"
        if result["warmup_steps"]:
            what = {"cuda-graph": ", with kernel compilation and graph capture"}.get(
                result["mode"], ", with kernel compilation" if ids.is_cuda else "")
            speed += f"; not counted: the first {result['warmup_steps']} steps ({result['warmup_seconds']:.2f} s{what})"
    gpus = [d for d in loaded.devices if d.type == "cuda"]
    if gpus:  # what the model, the cache and decoding held at most on each GPU
        import torch

        peaks = [torch.cuda.max_memory_allocated(d) / (1 << 30) for d in gpus]
        speed += (f"; peak GPU memory {peaks[0]:.2f} GiB" if len(gpus) == 1 else
                  f"; peak GPU memory {' + '.join(f'{p:.2f}' for p in peaks)} GiB ({', '.join(map(str, gpus))})")
    tokens = int(cache.get_seq_length())
    allocated, used = cache.nbytes()
    fp16 = 2 * kv_elements(loaded.dims, tokens)
    predicted = bits_per_element(method, loaded.dims, tokens).bits_per_element
    text = loaded.tokenizer.decode(new_tokens, skip_special_tokens=True)
    if backend == "dequantized" and not codec.lossless:
        summary = (f"{method.name} through the dequantized reference cache: the values the codec reconstructs, held "
                   f"in {loaded.dtype} (no memory saving); the method's storage is {predicted:.2f} bits/element "
                   f"for {tokens} tokens; {speed}")
        return {"text": text, "summary": summary, "cache_bytes": None, "fp16_bytes": fp16, "tokens": tokens,
                "mode": result["mode"]}
    summary = f"{size_summary(method.name, codec, loaded, cache, tokens, predicted)}; {speed}"
    return {"text": text, "summary": summary, "cache_bytes": used, "fp16_bytes": fp16, "tokens": tokens,
            "mode": result["mode"], **cache.held()}


def first_compressed_length(policy) -> int:
    """The fewest tokens a row's cache holds before its policy compresses any (sinks, then the window, then a whole
    block; a bulk policy: a prompt one token longer than its sinks and window)."""
    return policy.sink + policy.residual + (1 if policy.bulk else policy.block)


def size_summary(name: str, codec, loaded, cache, tokens: int, predicted: float) -> str:
    """The cache's size line: the compressed part and the full-precision part (held in the model's dtype, float32 on a
    CPU: more than fp16 would take) apart, so a short sequence that sits wholly in the window is not read as a ratio."""
    dims = loaded.dims
    dtype = str(loaded.dtype).removeprefix("torch.")
    allocated, used = cache.nbytes()
    held = cache.held()
    fp16 = 2 * kv_elements(dims, tokens)

    def mib(nbytes) -> str:
        return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"

    def ratio(reference, nbytes) -> str:
        r = reference / max(nbytes, 1)
        return f"{r:.1f}x smaller" if r >= 1 else f"{1 / r:.1f}x larger"

    if codec.lossless:
        return f"{name}: no compression: {tokens} tokens in {mib(used)} ({dtype} K/V; fp16 would take {mib(fp16)})"
    if held["compressed_tokens"] == 0:
        policy = codec.policy
        if policy.bulk:
            when = (f"compresses a prompt's tokens past its {policy.sink} sinks and newest {policy.residual} (a prompt "
                    f"of {first_compressed_length(policy)} tokens or more)")
        else:
            when = (f"compresses once {first_compressed_length(policy)} tokens are cached (sinks {policy.sink}, window "
                    f"{policy.residual}, blocks of {policy.block})")
        return (f"{name}: nothing compressed yet: all {tokens} tokens are in the full-precision part ({mib(used)} in "
                f"{dtype}; fp16 would take {mib(fp16)}); {name} {when}")
    n_c, n_fp = held["compressed_tokens"], held["fp_tokens"]
    c_bytes = held["compressed_bytes"]
    c_bits = 8 * c_bytes / kv_elements(dims, n_c)
    measured = 8 * used / kv_elements(dims, tokens)
    return (f"{name} ({dtype}): compressed part {n_c} tokens in {mib(c_bytes)} ({c_bits:.2f} bits/element, "
            f"{ratio(2 * kv_elements(dims, n_c), c_bytes)} than fp16); full-precision part {n_fp} tokens "
            f"in {mib(held['fp_bytes'])} ({dtype}); whole cache {mib(used)} for {tokens} tokens ({measured:.2f} "
            f"bits/element; accounting predicts {predicted:.2f}, fp16 slots counted as fp16; {mib(allocated)} "
            f"allocated) vs fp16 {mib(fp16)}: {ratio(fp16, used)}")
