"""`kvcal eval ppl` end to end: resolve what to evaluate, load data, run, build the JSON record."""

from __future__ import annotations

from pathlib import Path

from kvcal.accounting import bits_per_element
from kvcal.artifact import load_artifact
from kvcal.data import check_text, load_eval_windows
from kvcal.determinism import deterministic_algorithms
from kvcal.errors import KvcalError
from kvcal.eval.ppl import (
    PROTOCOLS,
    check_tail_decode,
    decoded_nll,
    effective_fp_window,
    fp_keys_per_query,
    scored_tokens,
    simulated_nll,
)
from kvcal.eval.simulate import tail_layout
from kvcal.methods.registry import artifact_method, build_method, parse_sets, storages_for_artifact
from kvcal.models import artifact_model, check_model_args, load_model
from kvcal.models.dims import check_context
from kvcal.progress import progress_bar
from kvcal.recipes import changed_keys, changed_suffix, resolve
from kvcal.runtime.cache import backend_ran
from kvcal.version import __version__, software_versions

MODES = ("simulate", "decode")


def evaluate_ppl_command(model, artifact_paths, method_name, recipe, sets, dataset, data_dir, seqlen, nsamples,
                         protocol, prompt_len, batch_size, dtype, device, mode="simulate", backend="packed",
                         deterministic: bool = False, prefix_len: int | None = None,
                         block_len: int | None = None, device_map=None, max_memory=None,
                         fp_window: int | None = None, compress_local: bool = False) -> list[dict]:
    """One record per artifact (or one for --method/--recipe); the model and the windows are loaded once.
    deterministic: the whole evaluation, model load included, in torch's deterministic mode (kvcal.determinism).
    fp_window: the full-precision allowance every setting runs under (None: each method's own window)."""
    with deterministic_algorithms(deterministic):
        records = _evaluate_ppl(model, artifact_paths, method_name, recipe, sets, dataset, data_dir, seqlen, nsamples,
                                protocol, prompt_len, batch_size, dtype, device, mode, backend, prefix_len, block_len,
                                device_map, max_memory, fp_window, compress_local)
    for record in records:
        record["deterministic"] = deterministic
    return records


def _evaluate_ppl(model, artifact_paths, method_name, recipe, sets, dataset, data_dir, seqlen, nsamples,
                  protocol, prompt_len, batch_size, dtype, device, mode, backend, prefix_len=None,
                  block_len=None, device_map=None, max_memory=None, fp_window=None,
                  compress_local=False) -> list[dict]:
    if mode not in MODES:
        raise KvcalError(f"unknown mode '{mode}' (choose from {', '.join(MODES)})")
    if protocol not in PROTOCOLS:
        raise KvcalError(f"unknown protocol '{protocol}' (choose from {', '.join(PROTOCOLS)})")
    if seqlen < 2:
        raise KvcalError(f"--seqlen must be at least 2, got {seqlen}")
    if nsamples is not None and nsamples <= 0:
        raise KvcalError(f"--nsamples must be positive, got {nsamples}")
    if protocol == "prefill-decode":
        prompt_len = seqlen // 2 if prompt_len is None else prompt_len
        if not 1 <= prompt_len <= seqlen - 2:
            raise KvcalError(f"--prompt-len must be in [1, seqlen-2], got {prompt_len}")
    elif prompt_len is not None:
        raise KvcalError("--prompt-len applies to --protocol prefill-decode only")
    else:
        prompt_len = 0
    if protocol == "tail":
        prefix_len, block_len = tail_layout(seqlen, prefix_len, block_len)
        prompt_len = prefix_len + block_len
    elif prefix_len is not None or block_len is not None:
        raise KvcalError("--prefix-len and --block-len apply to --protocol tail only")
    else:
        prefix_len = 0
    backend_ran(backend, "cpu")  # a one-line error for an unknown backend, before any loading
    if backend != "packed" and mode != "decode":
        raise KvcalError("--backend applies to --mode decode only")
    artifact_paths = list(artifact_paths or [])
    if artifact_paths and (method_name or recipe):
        raise KvcalError("give either --artifact or --method/--recipe, not both")
    if fp_window is not None and fp_window < 0:
        raise KvcalError(f"--fp-window must be >= 0, got {fp_window}")
    if fp_window is not None and "fp_window" in parse_sets(sets):
        raise KvcalError("give the full-precision allowance once: --fp-window or --set fp_window, not both")
    artifacts = [load_artifact(path) for path in artifact_paths]
    if artifacts:
        model = model or artifact_model(artifacts[0].header["model"], artifact_paths[0])
        for art in artifacts:  # what each setting cannot honour is refused before the model loads
            check_protocol(artifact_method(art, sets, fp_window), protocol, mode, prefix_len, block_len, fp_window)
    else:
        method, tag, _ = resolve(method_name, recipe, sets)
        if method.needs_artifact():
            raise KvcalError(
                f"method {method.name} ({tag}) needs an artifact: run `kvcal calibrate --method {method.name}` "
                "and pass it with --artifact"
            )
        if fp_window is not None:
            method = method.with_fp_window(fp_window)
        check_protocol(method, protocol, mode, prefix_len, block_len, fp_window)
    check_model_args(model or "smollm2-135m", dtype, device)
    check_text(dataset, "eval", data_dir)  # a missing dataset fails here, before the model loads
    loaded = load_model(model or "smollm2-135m", dtype, device, device_map=device_map, max_memory=max_memory)
    check_context(loaded, seqlen, "--seqlen")
    check_compress_local(compress_local, mode, loaded)
    targets = []  # (method, storages, setting, artifact record)
    for path, art in zip(artifact_paths, artifacts):
        m, storages = storages_for_artifact(art, loaded, path, sets, fp_window)
        # a runtime --set names itself in the setting, as on a recipe (records of two settings never share a name)
        runtime = artifact_method(art, sets)
        changed = changed_suffix(runtime, changed_keys(build_method(art.method, art.config), runtime))
        targets.append((m, storages, protocol_setting(Path(path).stem + changed, fp_window),
                        {"path": str(path), "tensor_hash": art.header["tensor_hash"]}))
    if not artifacts:
        method = method.for_model(loaded.dims)  # model-dependent defaults resolved (the record states them)
        method.check_model(loaded.dims)
        setting = tag if tag.startswith(method.name) else f"{method.name}-{tag}"
        targets.append((method, method.build_storages({}, loaded.dims), protocol_setting(setting, fp_window), None))
    if protocol == "tail" and mode == "decode":  # every setting's cache checked before the first is evaluated
        for m, storages, _, _ in targets:
            check_tail_decode(storages, prefix_len, effective_fp_window(m, protocol, fp_window))
    text, windows = load_eval_windows(loaded.tokenizer, dataset, data_dir, seqlen, nsamples)
    return [ppl_record(loaded, method, storages, setting + ("-compress-local" if compress_local else ""),
                       artifact_record, text, windows, dtype, protocol, prompt_len, batch_size, mode, backend, prefix_len,
                       fp_window, compress_local)
            for method, storages, setting, artifact_record in targets]


def check_compress_local(compress_local: bool, mode: str, loaded=None) -> None:
    """One-line refusal of --compress-local, once the model is loaded, on a model without sliding-window layers (the
    simulation and the packed cache both honour it; the packed cache refuses a storage it cannot window when it
    builds the layer)."""
    if compress_local and loaded is not None and not loaded.dims.hybrid:
        raise KvcalError(f"--compress-local applies to models with sliding-window layers (Gemma 2 and 3); "
                         f"{loaded.name} has none")


def protocol_setting(setting: str, fp_window: int | None) -> str:
    """A setting's name under a named full-precision allowance (records of both allowances never share a name)."""
    return setting if fp_window is None else f"{setting}-fp{fp_window}"


def check_protocol(method, protocol: str, mode: str, prefix_len: int, block_len: int, fp_window: int | None) -> None:
    """One-line refusal, before any model loads, of a protocol this setting cannot run: the method's own (a bulk-only
    storages outside `tail`), and under `tail` an allowance that leaves nothing of the block. A decode-mode tail whose
    cache would not keep what the simulation keeps needs the storages: check_tail_decode, once the model is loaded
    and before any setting is evaluated."""
    method.check_protocol(protocol)
    if protocol != "tail" or not fp_window:
        return
    if fp_window >= block_len:
        raise KvcalError(f"--fp-window {fp_window} keeps the whole tail protocol's block of {block_len} tokens in "
                         "full precision: pass a longer --block-len")


def record_head(method, setting: str, artifact_record: dict | None, loaded, dtype: str) -> dict:
    """The fields every eval record starts with: what ran, on which model, in which dtype, where."""
    return {"method": method.name, "setting": setting, "config": method.config(), "artifact": artifact_record,
            "model": loaded.identity, "dtype": dtype, "device": loaded.device_label}


def ppl_record(loaded, method, storages, setting: str, artifact_record: dict | None, text, windows, dtype: str,
               protocol: str = "gptq", prompt_len: int = 0, batch_size: int = 1, mode: str = "simulate",
               backend: str = "packed", prefix_len: int = 0, fp_window: int | None = None,
               compress_local: bool = False) -> dict:
    """Evaluate one setting on the windows and return `kvcal eval ppl`'s JSON record (without its command). Under the
    tail protocol prompt_len is the full-precision prefill S + P and prefix_len is S. fp_window: the allowance named
    (--fp-window; the method already carries it), None for each method's own window. compress_local: a hybrid
    model's sliding-window layers hold the method's format too (the simulation and the packed cache)."""
    storages.compress_local = compress_local
    allowance = effective_fp_window(method, protocol, fp_window)
    # decode mode advances per decoded token (a batch of long windows takes minutes), simulate per window
    total, unit = ((scored_tokens(windows, protocol, prompt_len), "tokens") if mode == "decode"
                   else (windows.shape[0], "windows"))
    with progress_bar(f"ppl {setting} ({protocol}, {mode}; {unit})", total) as advance:
        if mode == "decode":
            result = decoded_nll(loaded, storages, windows, protocol, prompt_len, batch_size, backend, advance,
                                 prefix_len=prefix_len, fp_window=allowance)
        else:
            result = simulated_nll(loaded, storages, windows, protocol, prompt_len, batch_size, advance, prefix_len,
                                   fp_window=allowance)
    bits = bits_per_element(method, loaded.dims, compress_local=compress_local)
    return {
        **record_head(method, setting, artifact_record, loaded, dtype),
        "dataset": text.provenance,
        "protocol": protocol,
        "prompt_len": prompt_len,
        **({"tail_layout": {"prefix": prefix_len, "block": prompt_len - prefix_len,
                            "tail": int(windows.shape[1]) - prompt_len,
                            "scored_targets_per_window": int(windows.shape[1]) - prompt_len - 1}}
           if protocol == "tail" else {}),
        "fp_window": allowance,
        "fp_window_named": fp_window is not None,
        "fp_keys_per_query": round(fp_keys_per_query(storages, int(windows.shape[1]), protocol, prompt_len, prefix_len,
                                                     allowance), 3),
        "mode": mode,
        "backend": backend_ran(backend, loaded.device) if mode == "decode" else "simulation",
        "seqlen": int(windows.shape[1]),
        "nsamples": int(windows.shape[0]),
        "tokens": result.tokens,
        "nll": result.nll,
        "ppl": result.ppl,
        "bits_per_element": bits.bits_per_element,
        "bits": bits.to_dict(),
        # the same count at the evaluated window's length: what the cache held at its end (an eviction budget or an
        # fp16 window weighs more in a shorter window)
        "bits_at_seqlen": bits_per_element(method, loaded.dims, int(windows.shape[1]),
                                           compress_local).bits_per_element,
        **({"compress_local": True} if compress_local else {}),
        "kvcal_version": __version__,
        "software": software_versions(),
    }


def compare_with_fp16(loaded, artifact, path, dataset, data_dir, seqlen, nsamples, dtype: str) -> list[dict]:
    """`kvcal eval ppl` records of fp16 and of the artifact on the dataset's evaluation split (gptq protocol)."""
    check_context(loaded, seqlen, "--seqlen")
    text, windows = load_eval_windows(loaded.tokenizer, dataset, data_dir, seqlen, nsamples)
    fp16 = build_method("fp16")
    method = build_method(artifact.method, artifact.config)
    record = {"path": str(path), "tensor_hash": artifact.header["tensor_hash"]}
    return [ppl_record(loaded, fp16, fp16.build_storages({}, loaded.dims), "fp16", None, text, windows, dtype),
            ppl_record(loaded, method, method.build_storages(artifact.tensors, loaded.dims), Path(path).stem, record, text,
                       windows, dtype)]
