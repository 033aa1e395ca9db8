"""`kvcal bench generate`: decode throughput and memory of the compressed cache at long context.

The cache of every row is filled with `context` synthetic tokens (random codes and parameters, exactly
the buffers a prefill would leave; the weights are random too, so values do not matter for speed),
then `steps` greedy decode steps run through the real model, cache and kernels: eagerly (a Python
forward per step, as generate() runs it; each packed layer replays its own step from a CUDA graph,
runtime.graph.StepGraph), eagerly with every kernel launched from Python ('eager-launch'), or replayed
from one captured CUDA graph of the whole step (no host work per step; settings whose steps are static).
Reported per setting, mode and batch: decode tokens/s, the cache's bytes
against what bits per element predicts, the process's peak GPU memory beyond the weights, and the largest
batch that fits.
"""

from __future__ import annotations

import gc
import time

import torch

from kvcal.accounting import bits_per_element, kv_elements
from kvcal.errors import KvcalError
from kvcal.models.adapter import forward_with_cache
from kvcal.runtime.cache import KvcalCache
from kvcal.runtime.graph import GraphDecoder, out_of_memory


def eager_decode_seconds(loaded, cache, batch: int, steps: int, generator) -> float:
    """Seconds for `steps` decode steps (after 2 warm-up steps)."""
    vocab = loaded.model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, 1), device=loaded.device, generator=generator)
    with torch.inference_mode():
        for _ in range(2):
            forward_with_cache(loaded.model, ids, cache)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            logits = forward_with_cache(loaded.model, ids, cache).logits
            ids = logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _decode_steps_graph(loaded, cache, batch: int, steps: int, generator) -> float:
    """Seconds for `steps` decode steps replayed from one CUDA graph (after the warm-up and the capture)."""
    vocab = loaded.model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, 1), device=loaded.device, generator=generator)
    decoder = GraphDecoder(loaded, cache, ids)
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(steps):
        decoder.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - begin
    cache.end_static()
    return seconds


MODES = {"eager": "eager", "eager-launch": "eager-launch", "graph": "cuda-graph"}  # option -> record's mode


def run_case(loaded, name: str, method, storages, batch: int, context: int, steps: int, mode: str = "eager") -> dict:
    """One timed case in `mode` (a MODES key). 'graph' replays a captured decode step (settings whose steps can be
    static; the caller checks capture_refusal first)."""
    weights = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    graph = mode == "graph"
    cache = KvcalCache(storages, loaded.dims.num_layers, step_graphs=mode == "eager")
    cache.fill_synthetic(batch, context, loaded.dims, loaded.dtype, loaded.device, headroom=steps + 8)
    generator = torch.Generator(device=loaded.device).manual_seed(1)
    if graph:
        seconds = _decode_steps_graph(loaded, cache, batch, steps, generator)
    else:
        seconds = eager_decode_seconds(loaded, cache, batch, steps, generator)
    allocated, used = cache.nbytes()
    tokens = cache.get_seq_length()
    predicted = batch * bits_per_element(method, loaded.dims, tokens).bits_per_element * kv_elements(loaded.dims, tokens) / 8
    record = {
        "codec": name, "mode": MODES[mode], "batch": batch, "context": context, "steps": steps,
        "tokens_per_s": batch * steps / seconds, "ms_per_step": 1000 * seconds / steps,
        "cache_bytes": used, "cache_bytes_allocated": allocated, "cache_bytes_predicted": predicted,
        "cache_vs_prediction": used / predicted, "peak_bytes_beyond_weights": torch.cuda.max_memory_allocated() - weights,
    }
    del cache
    torch.cuda.empty_cache()
    return record


def capture_refusal(loaded, storages) -> str | None:
    """Why decode steps of `storages` cannot be captured in a CUDA graph (None when they can): a tiny synthetic
    cache is asked, so the answer is the storages', not a batch size's."""
    if storages.graph_refusal:
        return storages.graph_refusal
    cache = KvcalCache(storages, loaded.dims.num_layers)
    cache.fill_synthetic(1, 256, loaded.dims, loaded.dtype, loaded.device, headroom=1)
    try:
        cache.begin_static()
    except KvcalError as err:
        return str(err)
    return None


def run_case_or_oom(*args, **kwargs) -> tuple[dict | None, str | None]:
    """run_case(*args, **kwargs) -> (record, None), or (None, the error's first line) where the GPU ran out of
    memory (other errors propagate). The failed case's memory is handed back to the driver before returning:
    after the except block, since until then its traceback holds the case's tensors. Otherwise torch keeps it
    cached, and what cannot come out of torch's cache (a Triton module load, a CUDA graph's pool) can run out of
    memory in the next case, even at batch 1 (rtn-int4 at batch 1 after fp16's search). The
    garbage collector runs first, for the failed case's objects that only a reference cycle still holds."""
    try:
        return run_case(*args, **kwargs), None
    except RuntimeError as err:  # OutOfMemoryError is one
        if not out_of_memory(err):
            raise
        text = str(err).strip()
        message = text.splitlines()[0] if text else type(err).__name__
    gc.collect()  # a frame that holds its own exception makes a cycle with the traceback: only the collector frees it
    torch.cuda.empty_cache()
    return None, message


def largest_batch(loaded, name: str, method, storages, context: int, candidates: list[int],
                  tried: list[tuple[int, bool, str | None]] | None = None, steps: int = 1,
                  modes: tuple[str, ...] = ("eager",)) -> tuple[int, list[dict]]:
    """Largest batch at which every mode in `modes` fills its cache and decodes `steps` timed steps (run_case:
    after 2 warm-up steps) without running out of memory, and the records of that batch's try (its throughput).
    The try at a batch runs the same cases a timed run of those steps and modes would, because at the largest batch
    a few MiB decide: a search that decoded fewer steps, or one mode, can find batches where the timed run runs out
    of memory. `candidates` (ascending)
    are tried in turn up to the first that fails, then the batches between the last fit and that one are bisected,
    so the answer is exact to one row (memory use grows with the batch). Each try is appended to `tried` as (batch,
    fits, the failed mode and its error's first line, or None)."""
    found: dict[int, list[dict]] = {}

    def fits(batch: int) -> bool:
        records, failure = [], None
        for mode in modes:
            record, error = run_case_or_oom(loaded, name, method, storages, batch, context, steps, mode=mode)
            if record is None:
                failure = f"{MODES[mode]}: {error}"
                break
            records.append(record)
        if failure is None:
            found[batch] = records
        if tried is not None:
            tried.append((batch, failure is None, failure))
        return failure is None

    best, failed = 0, None
    for batch in candidates:
        if not fits(batch):
            failed = batch
            break
        best = batch
    while failed is not None and failed - best > 1:
        middle = (best + failed) // 2
        if fits(middle):
            best = middle
        else:
            failed = middle
    return best, found.get(best, [])
