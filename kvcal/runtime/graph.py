"""Decode steps replayed from a CUDA graph, and the greedy loop `kvcal generate` runs on them.

A graph replays fixed kernels on fixed buffers, so a step must not depend on host-side state that changes
from step to step: the cache's static steps (`KvcalCache.begin_static`) read and write device-side positions
only, and the step's inputs (token ids, positions) live in buffers updated in place between replays.
"""

from __future__ import annotations

import time
import warnings

import torch

from kvcal.errors import KvcalError
from kvcal.models.adapter import forward_with_cache


class GraphPool:
    """What the StepGraphs of one cache's layers share: one CUDA-graph memory pool, and one stream per device that
    their captures run on. torch's caching allocator reuses a freed block only for allocations on the stream that
    freed it, so with a capture stream per layer no layer's capture could reuse another's temporaries, and the pool
    held every layer's temporaries at once (KVQuant's key-outlier scores, 200 MiB a layer at 49 rows of 32K on
    Llama-3.1-8B shapes), which cut the largest batch (docs/runtime.md)."""

    def __init__(self):
        self._handles: dict[int, object] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}

    def handle(self, device: torch.device):
        """The memory pool of the graphs on `device` (one per device: the layers of a split model replay on theirs)."""
        index = _index(device)
        if index not in self._handles:
            self._handles[index] = torch.cuda.graph_pool_handle()
        return self._handles[index]

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The capture stream on `device` (made on first use; on a full GPU making it can run out of memory)."""
        index = _index(device)
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        return self._streams[index]


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class StepGraph:
    """One cache layer's decode step, replayed from a CUDA graph while eager decoding (transformers' `generate()`,
    `kvcal eval ppl --mode decode`) runs the rest of the model in Python.

    Launching a packed layer's kernels from Python costs the host more than the GPU spends on them (docs/runtime.md), and eager
    decoding is bound by the host. A layer's static step (device-side positions only, `PackedLayer._attend_static`)
    is the same launches every step while its buffers stay put, so it is recorded once and replayed: the host
    then copies the step's inputs into the graph's buffers and launches one graph.

    `key` names everything the recorded launches depend on (the buffers' generation, shapes, dtypes, torch's
    deterministic mode). A new key runs its first step eagerly, since that step may compile Triton kernels,
    which must not happen during a capture, and records at the next step. The graphs of one cache share
    `shared` (a GraphPool: one memory pool, captured on one stream): each layer's temporaries are dead once its
    replay is done and layers replay one after another on one stream, so they can reuse the same memory (torch's
    rule for sharing a pool). A graph is kept until its successor is recorded: torch releases a pool once no graph
    uses it, and cannot record into it again (an internal assertion). The output is the graph's buffer, which the
    layer's next replay overwrites: callers use it before the next step.

    A recording that runs out of GPU memory is given up: that key's steps are launched instead, as without step
    graphs, and torch's cache is emptied. During a capture torch cannot hand its cached blocks back to the driver,
    and a graph's pool needs memory of its own, so a capture can fail where the launched step fits (with memory in
    torch's cache, a capture can run out of memory where the same allocation launched eagerly does not)."""

    def __init__(self, shared: GraphPool):
        self.shared = shared
        self.key = None
        self.current = False  # whether `graph` was recorded under `key`
        self.graph = None
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.out = None
        self.failed_key = None  # the key whose recording ran out of memory: launched until the key changes
        # abandoned recordings, kept until the next one succeeds: a pool released by its last graph cannot be reused
        self.failed: list[torch.cuda.CUDAGraph] = []
        self.records = self.replays = self.failed_records = 0  # (tests, diagnostics)

    def __call__(self, fn, key, *inputs: torch.Tensor) -> torch.Tensor:
        if key != self.key:
            self.key, self.current = key, False
            return fn(*inputs)
        if key == self.failed_key:
            return fn(*inputs)
        # streams, captures and replays belong to the current device: the layer's (a model split over GPUs)
        with torch.cuda.device(inputs[0].device):
            if not self.current and not self._record(fn, inputs):
                self.failed_key = key
                torch.cuda.empty_cache()  # the failed capture's blocks, for the launched step
                return fn(*inputs)
            for static, t in zip(self.inputs, inputs):
                static.copy_(t.detach())
            self.graph.replay()
            self.replays += 1
            return self.out

    def _record(self, fn, inputs: tuple[torch.Tensor, ...]) -> bool:
        """Record fn on copies of `inputs`; False where the GPU ran out of memory (nothing ran: a capture only
        records)."""
        static = tuple(t.detach().clone() for t in inputs)  # no autograd history kept across steps
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream()
        side = None
        try:
            # captures run off the current stream (torch.cuda.graph does the same), on the cache's one capture
            # stream (on a full GPU even making it runs out of memory)
            side = self.shared.stream(inputs[0].device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                # capture_begin/end rather than torch.cuda.graph: that also synchronizes the device, collects
                # garbage and empties torch's cache at every capture, which would cost more than the steps saved
                graph.capture_begin(pool=self.shared.handle(inputs[0].device))
                try:
                    out = fn(*static)
                except BaseException:
                    try:
                        with warnings.catch_warnings():  # torch warns that the abandoned graph is empty
                            warnings.simplefilter("ignore")
                            graph.capture_end()
                    except RuntimeError:  # a capture the failure invalidated: the first error is the one to see
                        pass
                    raise
                graph.capture_end()
        except RuntimeError as err:  # OutOfMemoryError is one
            if not out_of_memory(err):
                raise
            self.failed.append(graph)
            self.failed_records += 1
            return False
        finally:
            if side is not None:
                current.wait_stream(side)
        self.records += 1
        self.graph, self.inputs, self.out, self.current = graph, static, out, True
        self.failed.clear()  # the new graph holds the pool now
        return True


def out_of_memory(err: BaseException) -> bool:
    """Whether `err` is the GPU running out of memory: torch's OutOfMemoryError, or a RuntimeError with CUDA's
    message (a Triton launch that must load its kernel into a full GPU raises "Triton Error [CUDA]: out of memory")."""
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError) and "out of memory" in str(err))


class GraphDecoder:
    """Greedy decode steps of `loaded.model` over `cache`, replayed from one captured CUDA graph.

    `ids` [B, 1] are the next input tokens (every row at the same position: no padding). Construction runs
    `warmup` eager steps on the same static path (off the default stream, as torch.cuda.graphs asks; they
    compile the Triton kernels and are real decode steps: they consume and emit tokens), then records one step
    without running it. capture=False runs the identical static steps eagerly (comparisons; CPU). With
    `record`, the tokens each step chooses are kept in `emitted` (device tensors [B, 1], no synchronization)."""

    def __init__(self, loaded, cache, ids: torch.Tensor, capture: bool = True, warmup: int = 2, record: bool = False):
        self.model, self.cache = loaded.model, cache
        start = cache.get_seq_length()
        self.ids = ids.clone()
        self.position_ids = torch.full((ids.shape[0], 1), start, dtype=torch.long, device=ids.device)
        self.cache_position = torch.full((1,), start, dtype=torch.long, device=ids.device)
        self.graph = None
        self.emitted: list[torch.Tensor] | None = [] if record else None
        with torch.inference_mode():  # the cache's buffers are inference tensors
            cache.begin_static()
            if capture:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(warmup):
                        self._advance(self._forward())
                torch.cuda.current_stream().wait_stream(side)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self.logits = self._forward()
            else:
                for _ in range(warmup):
                    self._advance(self._forward())

    def _forward(self) -> torch.Tensor:
        return forward_with_cache(self.model, self.ids, self.cache, position_ids=self.position_ids,
                                  cache_position=self.cache_position).logits

    def _advance(self, logits: torch.Tensor) -> None:
        self.ids.copy_(logits[:, -1:].argmax(-1))
        self.position_ids.add_(1)
        self.cache_position.add_(1)
        self.cache.advance_static()
        if self.emitted is not None:
            self.emitted.append(self.ids.clone())

    def step(self) -> torch.Tensor:
        """One decode step; returns its logits [B, 1, vocab] (the graph's buffer: the next step overwrites it)."""
        if self.cache.static_room() < 1:
            raise KvcalError("the cache's preallocated buffers are full (static steps cannot grow them)")
        with torch.inference_mode():
            if self.graph is None:
                logits = self._forward()
            else:
                self.graph.replay()
                logits = self.logits
            self._advance(logits)
        return logits


DECODE_MODES = ("auto", "eager", "graph", "static")
WARMUP_STEPS = 2  # decode steps timed apart from the rest: they compile the step's kernels (and precede a capture)


def greedy_decode(loaded, cache, prompt_ids: torch.Tensor, max_new_tokens: int, eos: int | None = None,
                  mode: str = "auto") -> dict:
    """Greedy continuation of `prompt_ids` [B, T] (no padding) through `cache`: what generate(do_sample=False)
    computes, token for token. mode: 'eager' (a Python forward per step, as generate() runs it), 'graph' (decode
    steps replayed from a CUDA graph; a one-line error where the cache cannot take static steps), 'static' (the
    graph's steps run eagerly: CPU, comparisons), 'auto' (graph on CUDA where the cache allows it, else eager).
    Stops after max_new_tokens or once every row has emitted `eos` (tokens after a row's eos are dropped).
    Returns {'tokens' [B, n] (n <= max_new_tokens), 'mode', 'warmup_seconds', 'warmup_steps', 'decode_seconds',
    'timed_steps'}:
    the first WARMUP_STEPS decode steps after the prefill compile the step's Triton kernels (and, replayed, come
    before the capture), so they and the capture are timed apart ('warmup_seconds'); 'decode_seconds' times the
    'timed_steps' steps after them (all steps, warmup included, when there are no others)."""
    if mode not in DECODE_MODES:
        raise KvcalError(f"unknown decode mode '{mode}' (one of {', '.join(DECODE_MODES)})")
    if max_new_tokens <= 0:
        raise KvcalError(f"max_new_tokens must be positive, got {max_new_tokens}")
    cuda = prompt_ids.is_cuda
    if mode == "graph" and not cuda:
        raise KvcalError("CUDA-graph decoding needs a CUDA device (--device cuda), or pass --no-graph")
    with torch.inference_mode():
        logits = forward_with_cache(loaded.model, prompt_ids, cache).logits
        tokens = [logits[:, -1:].argmax(-1)]
    _sync(cuda)
    start = time.perf_counter()
    steps = max_new_tokens - 1
    warm = min(WARMUP_STEPS, steps)
    warmed = None  # (time, steps done) once the warmup steps are done

    def mark_warm():
        nonlocal warmed
        if warmed is None and len(tokens) - 1 >= warm:
            _sync(cuda)
            warmed = (time.perf_counter(), len(tokens) - 1)

    decoder = None
    refusal = cache.graph_refusal() if hasattr(cache, "graph_refusal") else None
    split = len(loaded.devices) > 1
    if mode == "graph" and split:
        raise KvcalError(f"CUDA-graph decoding captures the whole step on one GPU and the model spans "
                         f"{loaded.device_label}; pass --no-graph (each layer still replays its own step from a CUDA "
                         "graph on its GPU)")
    if mode == "graph" and refusal:
        raise KvcalError(f"CUDA-graph decoding: {refusal}; pass --no-graph")
    # a split model decodes eagerly: its layers' own step graphs, each on its GPU
    if steps and (mode in ("graph", "static") or (mode == "auto" and cuda and not split)):
        capture = mode != "static" and steps > warm and refusal is None  # auto: the same static steps, eagerly
        try:
            cache.reserve_static(steps)
            decoder = GraphDecoder(loaded, cache, tokens[0], capture=capture, warmup=warm, record=True)
        except KvcalError:
            if mode != "auto":
                raise
            cache.end_static()
    if decoder is not None:
        used = "cuda-graph" if decoder.graph is not None else "static"
        tokens += decoder.emitted
        mark_warm()  # the warmup steps and the capture
        while len(tokens) <= steps and not _all_ended(tokens, eos):
            decoder.step()
            tokens.append(decoder.emitted[-1])
        cache.end_static()
    else:
        used = "eager"
        with torch.inference_mode():
            mark_warm()
            while len(tokens) <= steps and not _all_ended(tokens, eos):
                logits = forward_with_cache(loaded.model, tokens[-1], cache).logits
                tokens.append(logits[:, -1:].argmax(-1))
                mark_warm()
    _sync(cuda)
    end, done = time.perf_counter(), len(tokens) - 1
    cache.check_holds(prompt_ids.shape[1] + done)  # the prompt and every emitted token but the last were fed
    if warmed is None or done == warmed[1]:  # no step after the warmup: time them all
        warmed = (start, 0)
    return {"tokens": _cut_after_eos(torch.cat(tokens, 1), eos), "mode": used, "warmup_seconds": warmed[0] - start,
            "warmup_steps": warmed[1], "decode_seconds": end - warmed[0], "timed_steps": done - warmed[1]}


def _sync(cuda: bool) -> None:
    """Wait for every GPU (a split model's layers run on several)."""
    if cuda:
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)


def _all_ended(tokens: list[torch.Tensor], eos: int | None) -> bool:
    """Whether every row has emitted eos (one host synchronization per step, as generate() makes)."""
    if eos is None:
        return False
    return bool((torch.cat(tokens, 1) == eos).any(1).all())


def _cut_after_eos(tokens: torch.Tensor, eos: int | None) -> torch.Tensor:
    """Drop the columns after the last row's first eos; a row that ended earlier is padded with eos, as
    generate() pads with its pad token (here: eos)."""
    if eos is None:
        return tokens
    hit = tokens == eos
    ended = hit.cumsum(1) > 0
    after = ended & ~(hit & (hit.cumsum(1) == 1))  # strictly after each row's first eos
    tokens = torch.where(after, torch.full_like(tokens, eos), tokens)
    if bool(ended.all(0).any()):
        last = int(ended.all(0).nonzero()[0])
        tokens = tokens[:, : last + 1]
    return tokens
