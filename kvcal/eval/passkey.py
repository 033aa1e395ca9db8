"""`kvcal eval passkey`: passkey retrieval (a random 5-digit key hidden in repeated filler at a given depth; the
model is asked to repeat it, greedy).

The prompt is built from token ids, piece by piece (header, filler sentences, the needle, the question), so its
length is exactly the asked token count: the filler is the five filler sentences cycled, cut to the tokens left
(the last filler sentence may be cut short), and the needle goes in at the sentence boundary nearest to
depth x (filler tokens).

Modes:
- decode: the prompt is prefilled in full precision into kvcal's cache (compressed as the method's storage does),
  then `max_new_tokens` are decoded greedily through the cache; correct when the key's digits appear in the text.
- simulate: one whole-window forward of prompt + answer under the prefill-decode simulation (SimulatedAttention with
  prompt_len = the prompt: prompt queries attend in full precision, as the cache's prefill does; the answer's
  queries see the keys/values as the cache would hold them). The answer " <key>" is teacher-forced and the trial is
  correct when every answer token is the greedy argmax at its position, i.e. when greedy decoding would emit
  exactly the key first. One forward per trial instead of one per generated token (generating through whole-window
  forwards would cost max_new_tokens forwards); stricter than decode's "appears in the text" only in that the key
  must come first.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from kvcal.accounting import bits_per_element
from kvcal.artifact import load_artifact
from kvcal.errors import KvcalError
from kvcal.eval.run import protocol_setting, record_head
from kvcal.eval.simulate import SimulatedAttention
from kvcal.methods.registry import artifact_method, storages_for_artifact
from kvcal.models import artifact_model, check_model_args, load_model
from kvcal.progress import progress_bar
from kvcal.recipes import resolve
from kvcal.runtime.cache import KvcalCache, backend_ran
from kvcal.runtime.graph import greedy_decode
from kvcal.version import __version__, software_versions

HEADER = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the important information there.")
FILLER = (" The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.", " There and back again.")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
MODES = ("decode", "simulate")
DEFAULT_DEPTHS = (0, 25, 50, 75, 100)
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)


def passkey(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def build_prompt(tokenizer, length: int, depth: float, key: str) -> dict:
    """{'ids' [length], 'answer' (ids of " key"), 'needle_start' (token index), 'filler_sentences_before',
    'filler_sentences' (whole ones), 'filler_tokens'}. One-line error when the length cannot hold the header, needle
    and question."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    head = bos + _ids(tokenizer, HEADER)
    needle = _ids(tokenizer, NEEDLE.format(key=key))
    question = _ids(tokenizer, QUESTION)
    n_fill = length - len(head) - len(needle) - len(question)
    if n_fill < 1:
        raise KvcalError(f"a passkey prompt of {length} tokens cannot hold the header, the needle and the question "
                         f"({length - n_fill + 1} tokens at least with this tokenizer)")
    sentences = [_ids(tokenizer, s) for s in FILLER]
    fill, bounds = [], [0]  # bounds: token offsets where a whole sentence ends (0: before the first)
    i = 0
    while len(fill) < n_fill:
        s = sentences[i % len(sentences)]
        fill.extend(s)
        if len(fill) <= n_fill:
            bounds.append(len(fill))
        i += 1
    fill = fill[:n_fill]
    target = depth / 100 * n_fill
    cut = min(range(len(bounds)), key=lambda b: (abs(bounds[b] - target), b))
    at = bounds[cut]
    ids = head + fill[:at] + needle + fill[at:] + question
    assert len(ids) == length
    return {"ids": ids, "answer": _ids(tokenizer, " " + key), "needle_start": len(head) + at,
            "filler_sentences_before": cut, "filler_sentences": len(bounds) - 1, "filler_tokens": n_fill}


def check_grid(lengths, depths, trials, max_new_tokens, mode, flags: str = "--") -> None:
    """One-line refusal of a grid `run_passkey` cannot run, naming the options as `flags` + name (`kvcal eval passkey`:
    --lengths; `kvcal search`: --passkey-lengths). lengths None: a default the caller settles later (not checked)."""
    if mode not in MODES:
        raise KvcalError(f"unknown {'mode' if flags == '--' else flags + 'mode'} '{mode}' (choose from {', '.join(MODES)})")
    if lengths is not None:
        if not lengths:
            raise KvcalError(f"{flags}lengths: give at least one length")
        for n in lengths:
            if n < 2:
                raise KvcalError(f"{flags}lengths must be at least 2 tokens, got {n}")
        if len(set(lengths)) < len(lengths):
            raise KvcalError(f"{flags}lengths: each length once (the grid's rows), got {list(lengths)}")
    if not depths:
        raise KvcalError(f"{flags}depths: give at least one depth")
    if len(set(depths)) < len(depths):
        raise KvcalError(f"{flags}depths: each depth once (the grid's columns), got {list(depths)}")
    for d in depths:
        if not 0 <= d <= 100:
            raise KvcalError(f"{flags}depths are percentages in [0, 100], got {d}")
    if trials < 1:
        raise KvcalError(f"{flags}trials must be positive, got {trials}")
    if max_new_tokens < 1:
        raise KvcalError(f"{flags}max-new-tokens must be positive, got {max_new_tokens}")


def decode_trial(loaded, storages, ids: list[int], max_new_tokens: int, backend: str = "packed") -> list[int]:
    """Greedy tokens after the prompt `ids`, through kvcal's cache (full-precision prefill, then decode steps)."""
    prompt = torch.tensor([ids], device=loaded.device)
    cache = KvcalCache(storages, loaded.dims.num_layers, backend, capacity_hint=len(ids) + max_new_tokens)
    result = greedy_decode(loaded, cache, prompt, max_new_tokens, None, "auto")
    return result["tokens"][0].tolist()


def simulate_trial(loaded, storages, ids: list[int], answer: list[int]) -> list[int]:
    """Greedy argmax at each answer position of one teacher-forced forward of prompt + answer under the prefill-decode
    simulation (prompt_len = len(ids))."""
    window = torch.tensor([ids + answer], device=loaded.device)
    with torch.inference_mode(), loaded.adapter.use(SimulatedAttention(storages, len(ids))):
        logits = loaded.model(window, use_cache=False).logits[0, len(ids) - 1 : -1]
    return logits.argmax(-1).tolist()


def run_passkey(loaded, storages, lengths, depths, trials: int, seed: int = 0, mode: str = "decode",
                max_new_tokens: int = 8, backend: str = "packed", label: str = "passkey") -> list[dict]:
    """One cell per (length, depth): {'length', 'depth', 'trials', 'correct', 'accuracy', 'results': [{key,
    needle_start, output, correct}]}."""
    check_grid(lengths, depths, trials, max_new_tokens, mode)
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise KvcalError(f"{loaded.name} has no tokenizer")
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    for n in lengths:
        if limit and n + max_new_tokens > limit:
            raise KvcalError(f"--lengths {n} + {max_new_tokens} new tokens exceeds {loaded.name}'s "
                             f"max_position_embeddings ({limit})")
    cells = []
    with progress_bar(f"passkey {label} ({mode}; trials)", len(lengths) * len(depths) * trials) as advance:
        for n in lengths:
            for d in depths:
                results = []
                for t in range(trials):
                    rng = random.Random(f"{seed}-{n}-{d}-{t}")
                    key = passkey(rng)
                    prompt = build_prompt(tokenizer, n, d, key)
                    if mode == "decode":
                        out = decode_trial(loaded, storages, prompt["ids"], max_new_tokens, backend)
                        text = tokenizer.decode(out, skip_special_tokens=True)
                        correct = key in text
                    else:
                        out = simulate_trial(loaded, storages, prompt["ids"], prompt["answer"])
                        text = tokenizer.decode(out, skip_special_tokens=True)
                        correct = out == prompt["answer"]
                    results.append({"key": key, "needle_start": prompt["needle_start"], "output": text,
                                    "correct": bool(correct)})
                    advance(1)
                right = sum(r["correct"] for r in results)
                cells.append({"length": n, "depth": d, "trials": trials, "correct": right,
                              "accuracy": right / trials, "results": results})
    return cells


def passkey_record(loaded, method, storages, setting: str, artifact_record, dtype: str, lengths, depths, trials: int,
                   seed: int = 0, mode: str = "decode", max_new_tokens: int = 8, backend: str = "packed",
                   fp_window: int | None = None) -> dict:
    """fp_window: the allowance named (--fp-window; the method already carries it), None for the method's own."""
    cells = run_passkey(loaded, storages, lengths, depths, trials, seed, mode, max_new_tokens, backend, setting)
    bits = bits_per_element(method, loaded.dims)
    return {
        "kind": "passkey",
        **record_head(method, setting, artifact_record, loaded, dtype),
        "fp_window": method.own_fp_window() if fp_window is None else fp_window,
        "fp_window_named": fp_window is not None,
        "mode": mode,
        "backend": backend_ran(backend, loaded.device) if mode == "decode" else "simulation",
        "lengths": list(lengths),
        "depths": list(depths),
        "trials": trials,
        "seed": seed,
        "max_new_tokens": max_new_tokens,
        "accuracy": sum(c["correct"] for c in cells) / sum(c["trials"] for c in cells),
        "cells": cells,
        "bits_per_element": bits.bits_per_element,
        "bits": bits.to_dict(),
        "kvcal_version": __version__,
        "software": software_versions(),
    }


def evaluate_passkey_command(model, artifact_path, method_name, recipe, sets, lengths, depths, trials, seed, mode,
                             max_new_tokens, backend, dtype, device, device_map=None, max_memory=None,
                             fp_window: int | None = None) -> dict:
    check_grid(lengths or DEFAULT_LENGTHS, depths, trials, max_new_tokens, mode)
    backend_ran(backend, "cpu")
    if backend != "packed" and mode != "decode":
        raise KvcalError("--backend applies to --mode decode only")
    if artifact_path and (method_name or recipe):
        raise KvcalError("give either --artifact or --method/--recipe, not both")
    art = load_artifact(artifact_path) if artifact_path else None
    if art is not None:
        model = model or artifact_model(art.header["model"], artifact_path)
        artifact_method(art, sets, fp_window)  # what the setting cannot honour is refused before the model loads
    else:
        method, tag, _ = resolve(method_name or ("fp16" if not recipe else None), recipe, sets)
        if method.needs_artifact():
            raise KvcalError(f"method {method.name} ({tag}) needs an artifact: run `kvcal calibrate --method "
                             f"{method.name}` and pass it with --artifact")
        if fp_window is not None:
            method = method.with_fp_window(fp_window)
    check_model_args(model or "smollm2-135m", dtype, device)
    loaded = load_model(model or "smollm2-135m", dtype, device, device_map=device_map, max_memory=max_memory)
    if art is not None:
        method, storages = storages_for_artifact(art, loaded, artifact_path, sets, fp_window)
        setting = protocol_setting(Path(artifact_path).stem, fp_window)
        artifact_record = {"path": str(artifact_path), "tensor_hash": art.header["tensor_hash"]}
    else:
        method = method.for_model(loaded.dims)  # model-dependent defaults resolved (the record states them)
        method.check_model(loaded.dims)
        setting = protocol_setting(tag if tag.startswith(method.name) else f"{method.name}-{tag}", fp_window)
        storages = method.build_storages({}, loaded.dims)
        artifact_record = None
    if not lengths:  # the defaults, the longest cut to what the model's positions hold with the generated tokens
        limit = getattr(loaded.model.config, "max_position_embeddings", None) or DEFAULT_LENGTHS[-1]
        if limit - max_new_tokens < 2:
            raise KvcalError(f"--max-new-tokens {max_new_tokens} leaves no prompt within {loaded.name}'s context "
                             f"({limit} positions)")
        lengths = sorted({min(n, limit - max_new_tokens) for n in DEFAULT_LENGTHS})
    return passkey_record(loaded, method, storages, setting, artifact_record, dtype, lengths, depths, trials, seed, mode,
                          max_new_tokens, backend, fp_window)
