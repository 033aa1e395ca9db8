"""`kvcal eval ppl` end to end: resolve what to evaluate, load data, run, build the JSON record."""

from __future__ import annotations

from pathlib import Path

from kvcal import __version__
from kvcal.accounting import bits_per_element
from kvcal.artifact import load_artifact
from kvcal.data import eval_windows, load_text, tokenize
from kvcal.errors import KvcalError
from kvcal.eval.ppl import PROTOCOLS, simulated_nll
from kvcal.progress import progress_bar


def evaluate_ppl_command(model, artifact_path, method_name, recipe, sets, dataset, data_dir, seqlen, nsamples,
                         protocol, prompt_len, batch_size, dtype, device) -> dict:
    from kvcal.methods.registry import codec_for_artifact
    from kvcal.models import load_model
    from kvcal.recipes import resolve

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
    else:
        prompt_len = 0
    art = None
    if artifact_path is not None:
        if method_name or recipe or sets:
            raise KvcalError("give either --artifact or --method/--recipe, not both")
        art = load_artifact(artifact_path)
        model = model or art.header["model"]["name"]
    else:
        method, tag, _ = resolve(method_name, recipe, sets)
        if method.learns:
            raise KvcalError(
                f"method {method.name} learns from calibration data: run `kvcal calibrate --method {method.name}` "
                "and pass the artifact with --artifact"
            )
    loaded = load_model(model or "smollm2-135m", dtype, device)
    if art is not None:
        method, codec = codec_for_artifact(art, loaded, artifact_path)
        setting = Path(artifact_path).stem
    else:
        method.check_model(loaded.dims)
        codec = method.build_codec({}, loaded.dims)
        setting = tag
    text = load_text(dataset, "eval", data_dir)
    windows = eval_windows(tokenize(loaded.tokenizer, text.text), seqlen, nsamples)
    with progress_bar(f"ppl {method.name} ({protocol})", windows.shape[0]) as advance:
        result = simulated_nll(loaded, codec, windows, protocol, prompt_len, batch_size, advance)
    bits = bits_per_element(method, loaded.dims)
    return {
        "method": method.name,
        "setting": setting,
        "config": method.config(),
        "artifact": None if art is None else {"path": str(artifact_path), "tensor_hash": art.header["tensor_hash"]},
        "model": loaded.identity,
        "dtype": dtype,
        "device": str(loaded.device),
        "dataset": text.provenance,
        "protocol": protocol,
        "prompt_len": prompt_len,
        "mode": "simulated",
        "seqlen": seqlen,
        "nsamples": int(windows.shape[0]),
        "tokens": result.tokens,
        "nll": result.nll,
        "ppl": result.ppl,
        "bits_per_element": bits.bits_per_element,
        "bits": bits.to_dict(),
        "kvcal_version": __version__,
    }
