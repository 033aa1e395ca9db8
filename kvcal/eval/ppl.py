"""Perplexity (the README's Conventions): non-overlapping windows, PPL = exp(mean NLL) over counted tokens.

Protocols:
- gptq: every key/value is compressed as it enters the cache; query t sees key j as token-by-token
  decoding would (full precision where the method keeps it so at step t). All seqlen-1 targets count.
- prefill-decode: the first `prompt_len` tokens are a full-precision prefill, compressed in bulk
  afterwards; the rest are decoded one by one. Only the predictions made by decode steps count
  (targets prompt_len+1 .. seqlen-1).
- tail (CalibQuant's regime, any method): a full-precision prefix of S tokens, a block of P tokens compressed in
  bulk after the full-precision prefill of the S + P tokens, then a full-precision tail scored teacher-forced
  (kvcal.eval.simulate.TailAttention). `prompt_len` is S + P (the prefill) and `prefix_len` is S; only the tail's
  predictions count (targets S+P+1 .. seqlen-1: target S+P is the exact prefill's prediction). Decode mode runs it
  through the cache for storages whose policy compresses the prompt in bulk (FlushPolicy.bulk) with S sinks.

The full-precision allowance (`--fp-window W`, docs/conventions.md) is carried by the method setting (its own window
set to W) under gptq and prefill-decode; under tail it keeps the newest W tokens of the prefill out of the block,
for every method alike (the block compressed is [S, S + P - W)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcal.errors import KvcalError
from kvcal.eval.simulate import SimulatedAttention, TailAttention, tail_layout
from kvcal.models.adapter import forward_with_cache
from kvcal.runtime.cache import KvcalCache

PROTOCOLS = ("gptq", "prefill-decode", "tail")


@dataclass
class NllSum:
    nll: float = 0.0
    tokens: int = 0

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")


def effective_fp_window(method, protocol: str, named: int | None) -> int:
    """The full-precision allowance a record states: the one named (--fp-window), else the method's own window
    under gptq and prefill-decode, and 0 under tail (whose prefix and tail are the protocol's, every method alike)."""
    if named is not None:
        return named
    return 0 if protocol == "tail" else method.own_fp_window()


def fp_keys_per_query(storages, length: int, protocol: str = "gptq", prompt_len: int = 0, prefix_len: int = 0,
                      fp_window: int = 0) -> float:
    """Mean number of keys a scored query sees in full precision (or, for a method that drops tokens, at all) in a
    window of `length`: what the allowance and the method's format (sinks, unfinished blocks) give it, so rows
    of one table can be checked for equal footing."""
    start = first_target(protocol, prompt_len) - 1  # the first scored query
    queries = torch.arange(start, length - 1)
    if storages.lossless:
        return float((queries + 1).double().mean())
    if protocol == "tail":
        compressed = prompt_len - prefix_len - fp_window
        return float((queries + 1 - compressed).double().mean())
    mask = storages.policy.full_precision_mask(length, prompt_len if protocol == "prefill-decode" else 0)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return float((mask & causal)[queries].sum(1).double().mean())


def first_target(protocol: str, prompt_len: int) -> int:
    """Index of the first target token that counts."""
    return prompt_len + 1 if protocol in ("prefill-decode", "tail") else 1


def scored_tokens(windows: torch.Tensor, protocol: str = "gptq", prompt_len: int = 0) -> int:
    """How many target tokens the windows [N, T] score under `protocol` (the unit of decoded_nll's progress)."""
    return windows.shape[0] * (windows.shape[1] - first_target(protocol, prompt_len))


def sequence_nll(logits: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Summed NLL of targets ids[:, start:] under logits[:, start-1:-1], computed in float32 (float64
    for float64 logits)."""
    pred = logits[:, start - 1 : -1].to(torch.promote_types(logits.dtype, torch.float32))
    targets = ids[:, start:].to(logits.device)  # a split model's logits may come out on another device
    return F.cross_entropy(pred.reshape(-1, pred.shape[-1]), targets.reshape(-1), reduction="sum")


def simulated_nll(loaded, storages, windows: torch.Tensor, protocol: str = "gptq", prompt_len: int = 0,
                  batch_size: int = 1, progress=None, prefix_len: int = 0, fp_window: int = 0) -> NllSum:
    """NLL of the windows through the simulation of `storages` under `protocol` (whole-window forwards, no cache);
    tail: `prompt_len` = S + P, `prefix_len` = S, the newest `fp_window` tokens of the prefill kept out of the block
    (gptq and prefill-decode: the storages' own policy carries the allowance)."""
    if protocol == "tail":
        handler = TailAttention(storages, prefix_len, prompt_len - prefix_len, fp_window)
    else:
        handler = SimulatedAttention(storages, prompt_len if protocol == "prefill-decode" else 0)
    start = first_target(protocol, prompt_len)
    total = NllSum()
    with torch.inference_mode(), loaded.adapter.use(handler):
        for i in range(0, windows.shape[0], batch_size):
            batch = windows[i : i + batch_size].to(loaded.device)
            logits = loaded.model(batch, use_cache=False).logits
            total.nll += sequence_nll(logits, batch, start).item()
            total.tokens += batch[:, start:].numel()
            if progress is not None:
                progress(batch.shape[0])
    return total


def check_tail_decode(storages, prefix_len: int, fp_window: int) -> None:
    """One-line refusal of a decode-mode tail protocol whose cache would not keep what the simulation keeps: the
    storages must compress the prompt in bulk, with the prefix as their sinks and the allowance as their window."""
    if storages.lossless:
        return
    policy = storages.policy
    if not policy.bulk:
        raise KvcalError("the tail protocol runs in decode mode only for storages that compress the prompt in bulk "
                         "(calibquant with group_tokens=0); use --mode simulate")
    if policy.sink != prefix_len:
        raise KvcalError(f"the tail protocol's prefix of {prefix_len} tokens differs from the storages' {policy.sink} "
                         f"full-precision sinks: pass --prefix-len {policy.sink} (or --set sink={prefix_len})")
    if policy.residual != fp_window:
        raise KvcalError(f"the tail protocol keeps the newest {fp_window} prefill tokens in full precision but the "
                         f"method keeps {policy.residual}: pass --fp-window {policy.residual}")


def decoded_nll(loaded, storages, windows: torch.Tensor, protocol: str = "gptq", prompt_len: int = 0,
                batch_size: int = 1, backend: str = "packed", progress=None, step_graphs: bool = True,
                prefix_len: int = 0, fp_window: int = 0) -> NllSum:
    """NLL through the real cache, teacher-forced one token at a time (after a full-precision prefill
    of `prompt_len` tokens for prefill-decode). Counts the same targets as `simulated_nll`. `progress(n)` is
    called after every step with the tokens it scored (a batch's rows; scored_tokens(...) in all), since one batch
    of long windows can take minutes. `step_graphs=False` launches every packed layer's kernels from Python
    instead of replaying each layer's step from a CUDA graph (KvcalCache's option; the same logits). tail: the cache
    prefills S + P tokens and compresses [S, S + P) in bulk (the storages' policy must be bulk with S = prefix_len
    sinks), then decodes the tail."""
    if protocol == "tail":
        check_tail_decode(storages, prefix_len, fp_window)
    start = first_target(protocol, prompt_len) - 1  # tokens prefilled; the first decoded step scores the next one
    total = NllSum()
    with torch.inference_mode():
        for i in range(0, windows.shape[0], batch_size):
            batch = windows[i : i + batch_size].to(loaded.device)
            cache = KvcalCache(storages, loaded.dims.num_layers, backend, capacity_hint=batch.shape[1],
                               step_graphs=step_graphs)
            if start:
                forward_with_cache(loaded.model, batch[:, :start], cache)
            # summed on the device, read once per batch: an .item() per token would sync every step
            nll = torch.zeros((), dtype=torch.float64, device=loaded.device)
            for t in range(start, batch.shape[1] - 1):
                logits = forward_with_cache(loaded.model, batch[:, t : t + 1], cache).logits[:, -1]
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                # a split model's logits may come out on another device than its input's
                nll += F.cross_entropy(logits, batch[:, t + 1].to(logits.device), reduction="sum").to(nll.device)
                total.tokens += batch.shape[0]
                if progress is not None:
                    progress(batch.shape[0])
            cache.check_holds(batch.shape[1] - 1)  # every token but the last was fed
            total.nll += nll.item()
    return total


class TailObjective:
    """What a calibration that scores its candidate settings by perplexity runs (CalibQuant's tau search), on the
    model being calibrated: the tail protocol's default layout and the mean NLL per scored target of windows through
    the simulation of given storages under it."""

    def __init__(self, loaded):
        self.loaded = loaded

    def layout(self, seqlen: int) -> tuple[int, int]:
        return tail_layout(seqlen)

    def nll(self, storages, windows: torch.Tensor, prefix: int, block: int) -> float:
        total = simulated_nll(self.loaded, storages, windows, "tail", prefix + block, prefix_len=prefix)
        return total.nll / total.tokens
