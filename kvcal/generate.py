"""`kvcal.load_cache` and `kvcal generate`: the compressed cache of an artifact or a method in transformers'
generate() (the method-free runtime parts are in kvcal/runtime/generate.py)."""

from __future__ import annotations

import torch

from kvcal.accounting import bits_per_element, kv_elements
from kvcal.artifact import Artifact, check_model, load_artifact
from kvcal.errors import KvcalError
from kvcal.methods.registry import build_method, runtime_overrides, storages_for_artifact
from kvcal.models import artifact_model, as_loaded, load_model
from kvcal.models.dims import context_length
from kvcal.recipes import resolve
from kvcal.runtime.cache import KvcalCache
from kvcal.runtime.generate import size_summary
from kvcal.runtime.graph import DECODE_MODES, greedy_decode


def load_cache(artifact, model, backend: str = "packed", capacity: int = 0, step_graphs: bool = True,
               **runtime) -> KvcalCache:
    """A fresh compressed cache for `model` (a kvcal LoadedModel or a transformers model) from an
    artifact (path or Artifact). Pass it as `model.generate(..., cache=cache)` (transformers >= 5.24;
    `past_key_values=cache` before: kvcal.models.adapter.cache_kwargs gives the installed spelling). On CUDA each
    layer replays its one-token decode step from a CUDA graph (`step_graphs`, see KvcalCache). Other keyword
    arguments override the method's runtime fields (e.g. `key_outlier_capacity=16` for kvquant)."""
    art = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
    loaded = as_loaded(model)
    check_model(art, loaded, artifact if not isinstance(artifact, Artifact) else "artifact",
                identity=not loaded.source.get("unverified"))
    method = build_method(art.method, {**art.config, **runtime_overrides(art.method, runtime)})
    storages = method.build_storages(art.tensors, loaded.dims)
    return KvcalCache(storages, loaded.dims.num_layers, backend, capacity, step_graphs=step_graphs)


def generate_text(prompt: str, model_name, artifact_path, method_name, sets, max_new_tokens: int, dtype, device,
                  backend: str = "packed", mode: str = "auto", device_map=None, max_memory=None) -> dict:
    """Greedy continuation of `prompt` with the compressed cache (mode: see runtime.graph.greedy_decode; 'auto'
    replays decode steps from a CUDA graph on CUDA where the storages' steps are static, else runs them eagerly)."""
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
        method, storages = storages_for_artifact(art, loaded, artifact_path, sets)
    else:
        method, _, _ = resolve(method_name or "fp16", None, sets)
        if method.needs_artifact():
            raise KvcalError(f"method {method.name} needs an artifact: run `kvcal calibrate --method {method.name}` "
                             "and pass it with --artifact")
        storages = method.build_storages({}, loaded.dims)
    if loaded.tokenizer is None:
        raise KvcalError(f"{loaded.name} has no tokenizer")
    ids = loaded.tokenizer(prompt, return_tensors="pt").input_ids.to(loaded.device)
    limit = context_length(loaded.model.config)  # positions past it are untrained, as eval ppl and passkey refuse
    if limit is not None and ids.shape[1] + max_new_tokens > limit:
        room = limit - ids.shape[1]
        raise KvcalError(f"the prompt's {ids.shape[1]} tokens and --max-new-tokens {max_new_tokens} exceed "
                         f"{loaded.name}'s context of {limit} tokens" +
                         (f": use --max-new-tokens {room} or less" if room > 0 else ""))
    cache = KvcalCache(storages, loaded.dims.num_layers, backend, capacity_hint=ids.shape[1] + max_new_tokens)
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
        peaks = [torch.cuda.max_memory_allocated(d) / (1 << 30) for d in gpus]
        speed += (f"; peak GPU memory {peaks[0]:.2f} GiB" if len(gpus) == 1 else
                  f"; peak GPU memory {' + '.join(f'{p:.2f}' for p in peaks)} GiB ({', '.join(map(str, gpus))})")
    tokens = int(cache.get_seq_length())
    allocated, used = cache.nbytes()
    fp16 = 2 * kv_elements(loaded.dims, tokens)
    predicted = bits_per_element(method, loaded.dims, tokens).bits_per_element
    text = loaded.tokenizer.decode(new_tokens, skip_special_tokens=True)
    summary = f"{size_summary(method.name, storages, loaded, cache, tokens, predicted)}; {speed}"
    return {"text": text, "new_tokens": [int(t) for t in new_tokens], "summary": summary, "cache_bytes": used,
            "fp16_bytes": fp16, "tokens": tokens, "mode": result["mode"], **cache.held()}
