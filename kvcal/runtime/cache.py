"""KvcalCache: a transformers `Cache` whose layers hold K/V compressed the way a method's storages say, whatever the
method.

Pass it to a model loaded by kvcal (as `cache=` or `past_key_values=`, whichever the installed transformers takes:
kvcal.models.adapter.cache_kwargs); the attention adapter routes every layer's attention here. Each layer's tokens
live in its `Storage` (runtime/storage.py): the method's own buffers, written and read by its Triton kernels on CUDA
(a storage whose kernel cannot take a call raises one line: no silent fallback) and by their torch references
elsewhere. Backends: "packed" (the runtime) and "reference" (the torch references everywhere, CUDA included: for
checks, for inputs a kernel does not take, and for the ablations' reconstruction storages). Left padding is never
stored: each row holds its own tokens, so a padded batch computes what each sequence computes alone.

Prefill (the first call, several tokens): attention over the full-precision prompt, then the prompt is compressed in
bulk as far as the storage's FlushPolicy allows. Decode (one token per call): the token is appended, the oldest tokens
are flushed one block at a time while the policy allows, then attention runs. Sinks and the recent residual stay in
full precision, here, in the generic part of the cache. A `bulk` policy (FlushPolicy.bulk) compresses each row's
prompt tokens after its sinks once, in one write, after the prefill, and keeps every later token in full precision
(the full-precision part then grows as decoding proceeds). Two layer classes share `CacheLayer`: `PackedLayer` (a
storage plus the full-precision part; on a sliding-window layer with --compress-local, a window that masks and drops
what leaves it) and `LosslessLayer` (the fp16 baseline's plain K/V).
"""

from __future__ import annotations

import functools
import math

import torch
import transformers
from transformers.cache_utils import Cache, DynamicLayer

from kvcal.errors import KvcalError
from kvcal.models.attention import attention, decode_attention_masked
from kvcal.models.loaded import LOCAL
from kvcal.quant.rope import apply_rope
from kvcal.runtime.decode import FullPrecision, decode_attention, one_cpu_thread
from kvcal.runtime.graph import GraphPool, StepGraph
from kvcal.runtime.storage import Packed, SharedState

BACKENDS = ("packed", "reference")


def backend_ran(backend: str, device) -> str:
    """What a decode through `backend` on `device` runs, as records state it: the storages' Triton kernels (packed on
    CUDA) or their torch references (packed elsewhere, or reference)."""
    if backend not in BACKENDS:
        raise KvcalError(f"unknown cache backend '{backend}' ({', '.join(BACKENDS)})")
    return "packed-triton" if backend == "packed" and torch.device(device).type == "cuda" else "packed-reference"


class CacheLayer(DynamicLayer):
    """One layer of a KvcalCache: transformers' Cache API (the mask builder and generate() ask for lengths) and what
    the cache asks of its layers: `attend`, static decode steps (CUDA graphs) and memory accounting."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.length = 0  # tokens per row, padding included (what transformers' mask expects)

    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query, *args) -> tuple[int, int]:
        # transformers >= 5.10 passes the query length; earlier 5.x releases the query's cache_position tensor
        query_length = query.shape[0] if isinstance(query, torch.Tensor) else int(query)
        return self.length + query_length, 0

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("KvcalCache layers are driven by kvcal's attention adapter, not Cache.update")

    def attend(self, inp) -> torch.Tensor:
        raise NotImplementedError

    def static_refusal(self) -> str | None:
        raise NotImplementedError

    def begin_static(self) -> None:
        raise NotImplementedError

    def advance_static(self) -> None:
        raise NotImplementedError

    def static_room(self) -> int:
        raise NotImplementedError

    def reserve_static(self, steps: int) -> None:
        raise NotImplementedError

    def fill_synthetic(self, batch, tokens, heads, dim, dtype, device, inv_freq, headroom=0, generator=None,
                       hidden=0) -> None:
        raise NotImplementedError

    def nbytes(self) -> tuple[int, int]:
        raise NotImplementedError

    def held(self) -> dict[str, int]:
        raise NotImplementedError


def _left_padding(mask: torch.Tensor | None, batch: int, length: int, windowed: bool = False) -> list[int]:
    """Leading masked tokens per row, read off the prefill mask's last query row, or off its diagonal (`windowed`: a
    sliding-window layer's last query row also masks the tokens before its window; a real token always sees itself,
    a padding token is masked)."""
    if mask is None:
        return [0] * batch
    if windowed:
        last = mask[:, 0, :, :length].diagonal(dim1=-2, dim2=-1) if mask.dim() == 4 else \
            mask[:length, :length].diagonal()[None].expand(batch, -1)
    else:
        last = mask[:, 0, -1, :length] if mask.dim() == 4 else mask[None, -1, :length].expand(batch, -1)
    valid = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
    pads = []
    for row in valid.cpu():
        pad = int((~row).long().cumprod(0).sum())
        if not bool(row[pad:].all()):
            raise KvcalError("KvcalCache supports left padding only (a row has masked tokens after valid ones)")
        pads.append(pad)
    return pads


class PackedLayer(CacheLayer):
    """One layer: the storage's packed tokens plus the full-precision part. Row b holds its sinks, `compressed[b]`
    packed tokens, and a residual ring of the most recent ones."""

    GROWTH = 1.125  # buffers grow by 1/8 (bounded over-allocation, so memory tracks bits per element)
    # a compressed sliding window drops at least this many tokens at once from its front: its buffers move once every
    # WINDOW_DROP steps, not at every step, for at most WINDOW_DROP - 1 tokens more than the window
    WINDOW_DROP = 16
    static_steps_on_cpu = False  # eager one-token steps as static steps on a CPU too (tests run CUDA's path there)

    def __init__(self, layer_idx: int, storage, kernels: bool | None, capacity_hint: int = 0,
                 shared: SharedState | None = None, window: int | None = None):
        super().__init__(layer_idx)
        self.storage = storage
        # a compressed sliding-window layer (--compress-local): each query attends to its `window` newest tokens; the
        # older ones are masked (Packed.first, the fp part's validity) and dropped in whole units (_slide)
        self.window = window
        self.shift = 0  # packed tokens dropped from the front of every row (slot 0 holds row token sink + shift)
        self.softcap = None  # the model's score soft-cap (Gemma 2), taken from the layer's first inputs
        self.policy = storage.policy
        self.keys_pre_rope = storage.keys_pre_rope
        self.kernels_asked = kernels  # None: Triton kernels on CUDA, torch references elsewhere
        self.capacity_hint = capacity_hint
        self.shared = shared or SharedState()
        self.buffers: dict[str, torch.Tensor] = {}
        self.compressed: list[int] = []  # packed tokens per row
        self.count: list[int] = []  # valid tokens per row (sinks + packed + residual)
        self.ring_start: list[int] = []
        self.ring_count: list[int] = []
        self.static = False  # static decode steps (KvcalCache.begin_static): what a CUDA graph replays
        self.graph_pool: GraphPool | None = None  # set by KvcalCache(step_graphs=True): eager steps replay a graph
        self.step_graph: StepGraph | None = None
        self.generation = 0  # bumped whenever the buffers are replaced: a recorded step graph then records again
        self._packed: Packed | None = None  # the storage's view of the buffers, made again when they grow

    # ---- allocation -------------------------------------------------------------------------------------------
    def _init(self, batch: int, heads: int, dim: int, dtype, device, inv_freq, hidden: int = 0) -> None:
        self.batch, self.heads, self.dim = batch, heads, dim
        self.dtype, self.device = dtype, device
        self.kernels = (torch.device(device).type == "cuda") if self.kernels_asked is None else self.kernels_asked
        self.storage.check(heads, dim)
        refusal = self.storage.kernel_refusal() if self.kernels else None
        if refusal:
            raise KvcalError(f"{refusal}: run its torch reference on purpose with backend='reference' (--backend "
                             "reference)")
        self.storage.to(device)
        # a bulk policy's full-precision part grows (_grow_fp): its "ring" never wraps (ring_start stays 0)
        self.ring_capacity = 16 if self.policy.bulk else self.policy.residual + self.policy.block
        fp_slots = self.policy.sink + self.ring_capacity
        z = dict(device=self.device)
        self.fp_k = torch.zeros(batch, heads, fp_slots, dim, dtype=self.dtype, **z)  # post-RoPE
        self.fp_v = torch.zeros_like(self.fp_k)
        # what the storage compresses of each token, kept until it is flushed: its keys (in the storage's key space:
        # the post-RoPE keys themselves unless pre-RoPE) and values, or for source "x" storages the attention
        # inputs X [B, 1, slots, hidden]
        if self.storage.source == "x":
            self.fp_src = None
            self.fp_sources = [torch.zeros(batch, 1, fp_slots, hidden, dtype=self.dtype, **z)]
        else:
            self.fp_src = torch.zeros_like(self.fp_k) if self.keys_pre_rope else self.fp_k
            self.fp_sources = [self.fp_src, self.fp_v]
        self.fp_valid = torch.zeros(batch, fp_slots, dtype=torch.bool, **z)
        self.compressed = [0] * batch
        self.count = [0] * batch
        self.ring_start = [0] * batch
        self.ring_count = [0] * batch
        self.ring_on_device = False  # whether ring_start_dev / ring_count_dev mirror the two lists above
        # The per-row bookkeeping above lives on the host (it decides what to flush); the device copies
        # below mirror what kernels need, updated in place, so a decode step never waits on a
        # host-to-device copy (each such copy synchronizes the stream and stalls the CPU's kernel queue).
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=self.device)  # packed tokens per row
        self._true = torch.ones(batch, dtype=torch.bool, device=self.device)
        self.index_tensors: dict[tuple, torch.Tensor] = {}
        self.inv_freq = inv_freq.to(self.device) if self.keys_pre_rope else None
        self.rope_cos = self.rope_sin = None
        self.capacity = 0
        if self.window is not None:
            self._init_window(batch)
        self._grow(max(self.capacity_hint, 16))

    def _init_window(self, batch: int) -> None:
        """A compressed sliding-window layer's state: the first visible slot per row (host and device), the sink
        slots already masked, and the unit in which tokens are dropped: the policy's block and every buffer's tokens
        per index along its token axis (a unit's tokens leave the buffers together), and WINDOW_DROP."""
        p = self.policy
        name = type(self.storage).__name__
        if p.bulk:
            raise KvcalError(f"--compress-local: {name} compresses a prompt in bulk and keeps every later token in "
                             "full precision, so its sliding-window layers cannot hold a bounded window")
        if self.storage.window_refusal:
            raise KvcalError(f"--compress-local: {name} {self.storage.window_refusal}")
        if self.storage.source == "x":
            raise KvcalError(f"--compress-local: {name} rebuilds keys and values from the layer inputs across "
                             "layers; the packed cache does not window it (the simulation does)")
        unit = math.lcm(p.block, self.WINDOW_DROP)
        probe = 4096 * p.block
        for spec in self.storage.buffers(1, probe, self.heads, self.dim).values():
            per_index = probe // spec.shape[spec.token_axis]
            unit = math.lcm(unit, per_index)
        self.drop_unit = unit
        self.first = [0] * batch
        self.first_dev = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self.sinks_masked = [0] * batch

    def _grow(self, needed: int) -> None:
        block = self.policy.block
        cap = max(needed, int(self.capacity * self.GROWTH) + 1)
        cap = -(-cap // block) * block  # whole blocks
        for name, spec in self.storage.buffers(self.batch, cap, self.heads, self.dim).items():
            new = torch.zeros(spec.shape, dtype=spec.dtype, device=self.device)
            old = self.buffers.get(name)
            if old is not None:
                axis = spec.token_axis
                new.narrow(axis, 0, old.shape[axis]).copy_(old)
            self.buffers[name] = new
        self.capacity = cap
        self.generation += 1
        if self.keys_pre_rope:  # tables may be longer than this layer needs (the kernels bound their reads)
            self.rope_cos, self.rope_sin = self.shared.rope_tables(self.inv_freq, self.policy.sink + self.shift + cap)
        self._packed = Packed(self.buffers, self.lengths, self.heads, self.dim, self.capacity,
                              self.policy.sink + self.shift, self.rope_cos, self.rope_sin, self.inv_freq, self.shared,
                              softcap=self.softcap)
        if self.window is not None:
            self._packed.first, self._packed.host_first = self.first_dev, tuple(self.first)

    # ---- a compressed sliding-window layer -----------------------------------------------------------------------
    def _slide(self) -> None:
        """Before a query attends: mask what has left each row's window (the next query sees its row's `window`
        newest tokens: row tokens from count - window on), then drop the packed tokens every row has left behind, in
        whole drop units, from the front of the buffers (slot 0 then holds a later token: pre-RoPE keys rotate from
        pos_offset = sink + shift)."""
        sink = self.policy.sink
        for b in range(self.batch):
            lo = max(0, self.count[b] - self.window)  # the row's oldest visible token
            masked = min(sink, lo)
            if masked > self.sinks_masked[b]:
                self.fp_valid[b, self.sinks_masked[b]:masked] = False
                self.sinks_masked[b] = masked
            self.first[b] = min(max(0, lo - sink - self.shift), self.compressed[b])
            # the residual ring's oldest tokens (row tokens sink + shift + compressed on) may have left the window too,
            # before they are flushed: masked, their sources kept for the flush
            gone = min(lo - sink - self.shift - self.compressed[b], self.ring_count[b])
            if gone > 0:
                slots = [sink + (self.ring_start[b] + i) % self.ring_capacity for i in range(gone)]
                self.fp_valid[b, slots] = False
        drop = min(self.first) // self.drop_unit * self.drop_unit
        if drop:
            self._drop_front(drop)
        self.first_dev.copy_(torch.tensor(self.first, dtype=torch.int32), non_blocking=True)
        self._packed.host_first = tuple(self.first)

    def _drop_front(self, drop: int) -> None:
        """Drop the `drop` oldest packed tokens of every row (a multiple of drop_unit, all of them outside every row's
        window): each buffer moves its later slots to the front along its token axis."""
        for name, spec in self.storage.buffers(self.batch, self.capacity, self.heads, self.dim).items():
            buf, axis = self.buffers[name], spec.token_axis
            n = drop * buf.shape[axis] // self.capacity  # the buffer's indices for those tokens
            keep = buf.shape[axis] - n
            buf.narrow(axis, 0, keep).copy_(buf.narrow(axis, n, keep).clone())
        self.lengths -= drop
        for b in range(self.batch):
            self.compressed[b] -= drop
            self.first[b] -= drop
        self.shift += drop
        self._packed.pos_offset = self.policy.sink + self.shift
        if self.keys_pre_rope:
            self.rope_cos, self.rope_sin = self.shared.rope_tables(self.inv_freq,
                                                                   self._packed.pos_offset + self.capacity)
            self._packed.rope_cos, self._packed.rope_sin = self.rope_cos, self.rope_sin

    def _grow_fp(self, ring_needed: int) -> None:
        """Bulk policies: room for `ring_needed` full-precision tokens after the sinks (the ring never wraps there, so
        growing it keeps every slot in place)."""
        if ring_needed <= self.ring_capacity:
            return
        cap = max(ring_needed, int(self.ring_capacity * self.GROWTH) + 1)
        slots = self.policy.sink + cap

        moved = {}
        for t in [self.fp_k, self.fp_v, *self.fp_sources]:
            if id(t) not in moved:
                new = t.new_zeros(*t.shape[:2], slots, *t.shape[3:])
                new[:, :, : t.shape[2]] = t
                moved[id(t)] = new
        self.fp_k, self.fp_v = moved[id(self.fp_k)], moved[id(self.fp_v)]
        self.fp_sources = [moved[id(t)] for t in self.fp_sources]
        if self.fp_src is not None:
            self.fp_src = moved[id(self.fp_src)]
        valid = self.fp_valid.new_zeros(self.fp_valid.shape[0], slots)
        valid[:, : self.fp_valid.shape[1]] = self.fp_valid
        self.fp_valid = valid
        self.ring_capacity = cap
        self.generation += 1  # new tensors: a recorded step graph records again

    def packed(self) -> Packed:
        return self._packed

    def _index(self, values) -> torch.Tensor:
        """Device int64 tensor of `values`, made once per distinct tuple. Decode steps cycle through
        few distinct slot patterns (ring positions, row sets), so after warm-up this costs no copy."""
        key = tuple(values)
        found = self.index_tensors.get(key)
        if found is None:
            if len(self.index_tensors) > 4096:
                self.index_tensors.clear()
            found = self.index_tensors[key] = torch.tensor(key, dtype=torch.int64, device=self.device)
        return found

    # ---- storage ----------------------------------------------------------------------------------------------
    def _store(self, sources, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Compress tokens (the storage's sources, [M, H, D] keys and values or [M, 1, hidden] inputs) into row
        rows[m], slot slots[m] (device int64 tensors; runs of the policy's block of consecutive slots of one row
        each)."""
        try:
            keys, values = sources if len(sources) == 2 else (sources[0], None)  # source "x": X alone
            self.storage.write(self.packed(), keys, values, rows, slots, self.kernels)
        except ValueError as err:  # a write kernel that cannot take these shapes
            raise KvcalError(f"{type(self.storage).__name__}: {err}; run the torch reference on purpose with "
                             "backend='reference' (--backend reference)") from err

    def _keep(self, b, slots, src, k_rot, v, tokens) -> None:
        """Full-precision slots `slots` of row b take tokens `tokens` (attention's keys and values, and the sources)."""
        self.fp_k[b, :, slots] = k_rot[b, :, tokens]
        self.fp_v[b, :, slots] = v[b, :, tokens]
        for buf, s in zip(self.fp_sources, src):
            buf[b, :, slots] = s[b, :, tokens]
        self.fp_valid[b, slots] = True

    def _prefill_row(self, b: int, pad: int, src, k_rot, v) -> None:
        """Store row b's valid prompt tokens [pad, T) in bulk: sinks, packed span, then the residual ring. src: the
        storage's sources [B, H, T, C] each (token axis 2)."""
        sink, total = self.policy.sink, k_rot.shape[2] - pad
        n_sink = min(sink, total)
        packed = self.policy.compressed_count(total)
        self._keep(b, slice(0, n_sink), src, k_rot, v, slice(pad, pad + n_sink))
        if packed:
            span = slice(pad + sink, pad + sink + packed)
            if packed > self.capacity:
                self._grow(packed)
            self._pack([b], [s[b, :, span].transpose(0, 1)[None] for s in src])
            self.compressed[b] = packed
            self.lengths[b] = packed
        n_rest = total - n_sink - packed
        self._keep(b, slice(sink, sink + n_rest), src, k_rot, v, slice(pad + n_sink + packed, pad + total))
        self.ring_start[b], self.ring_count[b], self.count[b] = 0, n_rest, total

    def _append_step(self, src, k_rot, v) -> None:
        """Append one token per row (k_rot, v [B, H, D]; the sources [B, H, C] each) to its sinks or its residual
        ring, all rows at once."""
        sink = self.policy.sink
        slots = []
        for b in range(self.batch):
            if self.count[b] < sink:
                slots.append(self.count[b])
            else:
                if self.ring_count[b] == self.ring_capacity:
                    if not self.policy.bulk:
                        raise RuntimeError("residual ring overflow: flush was not called")
                    self._grow_fp(self.ring_capacity + 1)
                slots.append(sink + (self.ring_start[b] + self.ring_count[b]) % self.ring_capacity)
                self.ring_count[b] += 1
            self.count[b] += 1
        rows = self._index(range(self.batch))
        slot = self._index(slots)
        self._keep_step(rows, slot, src, k_rot, v)
        self.fp_valid[rows, slot] = True
        self.ring_on_device = False

    def _keep_step(self, rows, slot, src, k_rot, v) -> None:
        """Slot slot[b] of every row b takes its token (device index tensors)."""
        self.fp_k[rows, :, slot] = k_rot
        self.fp_v[rows, :, slot] = v
        for buf, s in zip(self.fp_sources, src):
            if buf is not self.fp_k and buf is not self.fp_v:
                buf[rows, :, slot] = s

    def _flush_rows(self) -> None:
        """Pack the oldest residual block of every row that the policy allows to (at most one per step)."""
        block, sink = self.policy.block, self.policy.sink
        if self.policy.bulk:  # compressed at the prefill only
            return
        # (compressed counts the tokens the buffers hold: a compressed sliding-window layer has dropped `shift`)
        rows = [b for b in range(self.batch)
                if self.compressed[b] + self.shift < self.policy.compressed_count(self.count[b])]
        if not rows:
            return
        needed = max(self.compressed[b] for b in rows) + block
        if needed > self.capacity:
            self._grow(needed)
        slots = self._index([sink + (self.ring_start[b] + i) % self.ring_capacity
                             for b in rows for i in range(block)]).view(len(rows), block)
        row_idx = self._index(rows)[:, None]
        self._pack(rows, [s[row_idx, :, slots] for s in self.fp_sources])  # [R, block, H, C] each
        self.fp_valid[row_idx, slots] = False
        self.lengths[row_idx[:, 0]] += block
        for b in rows:
            self.ring_start[b] = (self.ring_start[b] + block) % self.ring_capacity
            self.ring_count[b] -= block
            self.compressed[b] += block
        self.ring_on_device = False

    def _pack(self, rows: list[int], sources) -> None:
        """Compress the sources' tokens [R, N, H, C] of rows `rows` (N a multiple of the block) into their next
        slots."""
        nrows, count = sources[0].shape[:2]
        row_ids = self._index(rows)
        start = self.lengths[row_ids].long()  # packed tokens so far: the rows' next free slots
        slot = (start[:, None] + torch.arange(count, device=self.device)[None]).reshape(-1)  # [R*N]
        row = row_ids.repeat_interleave(count)  # contiguous: the write kernels index it as an array
        self._store([s.reshape(nrows * count, *s.shape[2:]) for s in sources], row, slot)

    def _full_precision(self) -> FullPrecision:
        return FullPrecision(self.fp_k, self.fp_v, self.fp_valid)

    def _decode(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        packed = self.packed() if self.buffers else None
        return decode_attention(q, self.storage, packed, self._full_precision(), scale, self.kernels, self.softcap)

    # ---- attention --------------------------------------------------------------------------------------------
    def attend(self, inp) -> torch.Tensor:
        batch, _, length, _ = inp.q.shape
        if self.length == 0:
            adapter = inp.module._kvcal_binding[0]
            self.softcap = inp.softcap  # before _init, which makes the layer's Packed
            self._init(batch, inp.k_pre.shape[1], inp.k_pre.shape[3], inp.v.dtype, inp.v.device,
                       adapter.inv_freq_on(inp.v.device, self.layer_idx),  # the layer's RoPE (Gemma 3: local ones)
                       inp.x.shape[-1])
            self.storage.bind(inp.kv_projection())
        # on CUDA a static step launches fewer kernels than the host ring (and replays as a graph); on a CPU the host
        # ring is cheaper: it writes a block only when the block flushes, not the oldest block at every step
        if (length == 1 and not self.static and (inp.q.is_cuda or self.static_steps_on_cpu)
                and self.static_refusal() is None):
            return self._eager_static_step(inp)
        q = apply_rope(inp.q, inp.cos, inp.sin)
        k_rot = apply_rope(inp.k_pre, inp.cos, inp.sin)
        src = self._sources(inp.k_pre, k_rot, inp.v, inp.x)
        if self.length == 0 and length > 1:  # prefill: full-precision attention, then bulk compression
            out = attention(q, k_rot, inp.v, inp.mask, inp.scale, inp.softcap)
            for b, pad in enumerate(_left_padding(inp.mask, batch, length, self.window is not None)):
                self._prefill_row(b, pad, src, k_rot, inp.v)
            self.length = length
            if self.window is not None:
                self._slide()
            return out
        if self.static:
            return self._attend_static(q, src, k_rot, inp.v, inp.scale)
        outs = []
        for t in range(length):  # decode, one token at a time (several tokens are decoded in sequence)
            self._append_step([s[:, :, t] for s in src], k_rot[:, :, t], inp.v[:, :, t])
            self._flush_rows()
            self.length += 1
            if self.window is not None:
                self._slide()
            outs.append(self._decode(q[:, :, t], inp.scale))
        return outs[0][:, :, None] if length == 1 else torch.stack(outs, dim=2)

    def _sources(self, k_pre, k_rot, v, x) -> list[torch.Tensor]:
        """What the storage compresses of these tokens, [B, H, T, C] each: its keys and values, or X [B, 1, T, hidden]
        for source "x" storages."""
        if self.storage.source == "x":
            return [x[:, None]]
        return [k_pre if self.keys_pre_rope else k_rot, v]

    def _eager_static_step(self, inp) -> torch.Tensor:
        """An eager one-token decode step taken as a static step (then advance_static). On CUDA with step graphs it
        is replayed from this layer's StepGraph, RoPE included: the host launches one graph and copies five inputs
        instead of a dozen torch ops and the storage's kernels."""
        self.reserve_static(1)
        self._mirror_ring()
        step = functools.partial(self._rotated_static_step, scale=inp.scale)
        inputs = (inp.q, inp.k_pre, inp.v, inp.cos, inp.sin, inp.x)
        if self.graph_pool is None or not inp.q.is_cuda:
            out = step(*inputs)
        else:
            if self.step_graph is None:
                self.step_graph = StepGraph(self.graph_pool)
            ring = getattr(self, "ring_start_dev", None)
            key = (self.generation, tuple(inp.q.shape), tuple(inp.k_pre.shape), inp.q.dtype, inp.scale,
                   torch.are_deterministic_algorithms_enabled(),
                   None if ring is None else (ring.data_ptr(), self.ring_count_dev.data_ptr()))
            out = self.step_graph(step, key, *inputs)
        self.advance_static()
        return out

    def _rotated_static_step(self, q, k_pre, v, cos, sin, x, *, scale: float) -> torch.Tensor:
        """_attend_static from the unrotated query and key."""
        k_rot = apply_rope(k_pre, cos, sin)
        return self._attend_static(apply_rope(q, cos, sin), self._sources(k_pre, k_rot, v, x), k_rot, v, scale)

    # ---- static decode steps (CUDA graphs) --------------------------------------------------------------------
    def static_refusal(self) -> str | None:
        """Why this layer cannot take static decode steps now, or None. A static step must not depend on
        host-side state that changes from step to step (a captured graph replays fixed kernels and indices)."""
        if self.window is not None:
            return ("a compressed sliding-window layer (--compress-local) moves its window on the host: its decode "
                    "steps run eagerly")
        if not self.buffers or min(self.count) < self.policy.sink:
            return "a row does not hold its sink tokens yet (static steps start after the prefill)"
        return None

    def _mirror_ring(self) -> None:
        """Device copies of the ring positions, which static steps read and move in place (advance_static moves
        the lists alike); refreshed after the host-side ring path moved them (a host-to-device copy)."""
        if self.policy.direct or self.ring_on_device:
            return
        start = torch.tensor(self.ring_start, dtype=torch.int64, device=self.device)
        count = torch.tensor(self.ring_count, dtype=torch.int64, device=self.device)
        if getattr(self, "ring_start_dev", None) is not None and self.ring_start_dev.shape == start.shape:
            self.ring_start_dev.copy_(start)  # in place: the tensors keep their addresses
            self.ring_count_dev.copy_(count)
        else:
            self.ring_start_dev, self.ring_count_dev = start, count
        self.ring_on_device = True

    def begin_static(self) -> None:
        self.static = True  # the device mirror `lengths` is already what the kernels read
        self._mirror_ring()

    def _capacity_for(self, steps: int) -> int:
        """Packed slots that `steps` more static steps need. A ring step writes a whole block from slot lengths[b]
        (_ring_step_static), where lengths[b] <= max(0, n - 1 - sink - residual) for a row holding n tokens after the
        step (a direct step writes one slot: block 1, residual 0)."""
        p = self.policy
        if p.bulk:  # decode steps never pack
            return max(self.compressed, default=0)
        return max(self.count) + steps + p.block - 1 - p.sink - p.residual

    def static_room(self) -> int:
        """Static steps left before the packed buffers (a bulk policy: the full-precision part) are full (they cannot
        grow inside a graph)."""
        if self.policy.bulk:
            return self.ring_capacity - max(self.ring_count)
        return self.capacity - self._capacity_for(0)

    def reserve_static(self, steps: int) -> None:
        """Grow the buffers now (outside any graph) so that `steps` static steps fit."""
        if self.buffers and self.policy.bulk:
            self._grow_fp(max(self.ring_count) + steps)
        elif self.buffers and self._capacity_for(steps) > self.capacity:
            self._grow(self._capacity_for(steps))

    def _attend_static(self, q, src, k_rot, v, scale) -> torch.Tensor:
        """One decode step on device-side positions only: no host-side index, no host-to-device copy, the same
        kernels every step. Policies that compress every token at once (residual 0, block 1) pack the token
        straight into slot lengths[b] (equal to the ring path, whose ring would only ever hold that token); the
        others go through the ring (_ring_step_static). Host counters move in advance_static()."""
        if q.shape[2] != 1:
            raise KvcalError("static decode steps take one token per row")
        if self.policy.direct:
            self._store([s[:, :, 0] for s in src], self._index(range(self.batch)), self.lengths.long())
            self.lengths += 1
        elif self.policy.bulk:  # the token joins the full-precision part (never wraps: ring_start is 0)
            rows = self._index(range(self.batch))
            slot = self.policy.sink + self.ring_count_dev
            self._keep_step(rows, slot, [s[:, :, 0] for s in src], k_rot[:, :, 0], v[:, :, 0])
            self.fp_valid[rows, slot] = self._true
            self.ring_count_dev += 1
        else:
            self._ring_step_static([s[:, :, 0] for s in src], k_rot[:, :, 0], v[:, :, 0])
        return self._decode(q[:, :, 0], scale)[:, :, None]

    def _ring_step_static(self, src, k_rot, v) -> None:
        """_append_step then _flush_rows with the ring positions on the device, whatever the storage: append the token
        to its row's ring; write every row's oldest block into slots [lengths[b], lengths[b] + block) with the
        storage's own write; count it (and drop it from the ring) only in the rows whose ring is full. A row that does
        not flush writes past its length, into slots no kernel reads and its next flush overwrites (_capacity_for
        keeps them allocated; the ring's slots hold earlier tokens or zeros, so those codes are finite)."""
        p, ring = self.policy, self.ring_capacity
        rows = self._index(range(self.batch))
        slot = p.sink + (self.ring_start_dev + self.ring_count_dev) % ring
        self._keep_step(rows, slot, src, k_rot, v)
        self.fp_valid[rows, slot] = self._true  # a device tensor: a Python True is a copy from the host
        flush = self.ring_count_dev + 1 >= p.residual + p.block  # [B]: what _flush_rows decides on the host
        offsets = self._index(range(p.block))
        oldest = p.sink + (self.ring_start_dev[:, None] + offsets[None]) % ring  # [B, block], oldest first
        self._store([s[rows[:, None], :, oldest].reshape(self.batch * p.block, *s.shape[1:2], s.shape[3])
                     for s in self.fp_sources], rows.repeat_interleave(p.block),
                    (self.lengths.long()[:, None] + offsets[None]).reshape(-1))
        self.fp_valid[rows[:, None], oldest] = self.fp_valid[rows[:, None], oldest] & ~flush[:, None]
        moved = flush.to(torch.int64) * p.block
        self.lengths += moved.to(self.lengths.dtype)
        self.ring_start_dev.copy_((self.ring_start_dev + moved) % ring)
        self.ring_count_dev += 1 - moved

    def advance_static(self) -> None:
        """The host counters after one static step (what the device did, replayed in Python)."""
        block, direct = self.policy.block, self.policy.direct
        for b in range(self.batch):
            self.count[b] += 1
            if not direct:
                self.ring_count[b] += 1
                if not self.policy.bulk and self.compressed[b] < self.policy.compressed_count(self.count[b]):
                    self.ring_start[b] = (self.ring_start[b] + block) % self.ring_capacity
                    self.ring_count[b] -= block
                    self.compressed[b] += block
            else:
                self.compressed[b] += 1
        self.length += 1

    def fill_synthetic(self, batch: int, tokens: int, heads: int, dim: int, dtype, device, inv_freq,
                       headroom: int = 0, generator=None, hidden: int = 0) -> None:
        """Fill with `tokens` tokens per row of random contents, as after a prefill (for speed and memory benchmarks:
        decoding then runs through the real buffers and kernels; the storage fills its own buffers)."""
        self._init(batch, heads, dim, dtype, device, inv_freq, hidden)
        packed = self.policy.compressed_count(tokens)
        self.count = [tokens] * batch
        self._grow(max(packed, self._capacity_for(headroom)))  # room for `headroom` steps, static ones included
        self.storage.fill_synthetic(self.packed(), generator)
        fp_tokens = tokens - packed
        if self.policy.bulk:  # the full-precision part takes the decoded tokens
            self._grow_fp(fp_tokens - min(self.policy.sink, tokens) + headroom)
        self.fp_k[:, :, :fp_tokens].normal_(generator=generator)
        self.fp_v[:, :, :fp_tokens].normal_(generator=generator)
        self.fp_valid[:, :fp_tokens] = True
        sinks = min(self.policy.sink, tokens)
        self.compressed = [packed] * batch
        self.lengths.fill_(packed)
        self.ring_start = [0] * batch
        self.ring_count = [fp_tokens - sinks] * batch
        self.ring_on_device = False
        self.length = tokens

    def nbytes(self) -> tuple[int, int]:
        """(allocated, used) bytes of this layer's per-token storage: packed buffers and full-precision
        slots. `used` counts the packed slots and fp slots that hold tokens."""
        if not self.buffers:
            return 0, 0
        packed = sum(t.numel() * t.element_size() for t in self.buffers.values())
        fp_tensors = {id(t): t for t in [self.fp_k, self.fp_v, *self.fp_sources]}.values()
        fp_alloc = sum(t.numel() * t.element_size() for t in fp_tensors)
        held = self.held()
        return packed + fp_alloc, held["compressed_bytes"] + held["fp_bytes"]

    def held(self) -> dict[str, int]:
        """What this layer's tokens take, by part: the packed slots that hold tokens and the full-precision slots
        that hold tokens (sinks, the window, an unflushed block), with the token counts of each (all rows)."""
        if not self.buffers:
            return {"compressed_tokens": 0, "compressed_bytes": 0, "fp_tokens": 0, "fp_bytes": 0}
        packed = sum(t.numel() * t.element_size() for t in self.buffers.values())
        fp_slot = 2 * self.heads * self.dim * self.fp_k.element_size()  # one token's K and V
        fp_tokens = int(self.fp_valid.sum())
        return {"compressed_tokens": sum(self.compressed),
                "compressed_bytes": int(packed * sum(self.compressed) / (self.batch * self.capacity)),
                "fp_tokens": fp_tokens, "fp_bytes": fp_slot * fp_tokens}


class LosslessLayer(CacheLayer):
    """The fp16 baseline: full-precision K/V in preallocated buffers that grow by 1/8 (no copy of the whole
    cache at every step, unlike concatenation)."""

    def __init__(self, layer_idx: int, capacity_hint: int = 0, window: int | None = None):
        super().__init__(layer_idx)
        self.capacity_hint = capacity_hint
        self.window = window  # a sliding-window layer (hybrid models): the newest `window` tokens are attended to
        self.kept = 0  # tokens in the buffers: all of them, or a window layer's newest window - 1 between steps
        self.k_buf = self.v_buf = None
        self.static = False
        self.filled = self.positions = None  # static steps: tokens held (device [1]) and slot positions

    def _reserve(self, needed: int, like: torch.Tensor) -> None:
        if self.k_buf is not None and needed <= self.k_buf.shape[2]:
            return
        current = 0 if self.k_buf is None else self.k_buf.shape[2]
        cap = max(needed, int(current * PackedLayer.GROWTH) + 1, self.capacity_hint)
        b, h, _, d = like.shape
        k_new = like.new_empty(b, h, cap, d)
        v_new = like.new_empty(b, h, cap, d)
        if self.k_buf is not None:
            k_new[:, :, : self.kept] = self.k_buf[:, :, : self.kept]
            v_new[:, :, : self.kept] = self.v_buf[:, :, : self.kept]
        self.k_buf, self.v_buf = k_new, v_new

    def attend(self, inp) -> torch.Tensor:
        q, k = apply_rope(inp.q, inp.cos, inp.sin), apply_rope(inp.k_pre, inp.cos, inp.sin)
        if self.static:
            return self._attend_static(q, k, inp.v, inp.scale, inp.softcap)
        new = k.shape[2]
        self._reserve(self.kept + new, k)
        self.k_buf[:, :, self.kept : self.kept + new] = k
        self.v_buf[:, :, self.kept : self.kept + new] = inp.v
        self.length += new
        self.kept += new
        self.is_initialized = True
        end, mask = self.kept, inp.mask
        if isinstance(mask, torch.Tensor) and self.kept < self.length:
            # transformers' mask spans every position [0, length); the buffers hold the newest `kept` of them
            mask = mask[..., self.length - self.kept : self.length]
        # a sliding-window layer's window is in the mask transformers builds for it
        out = attention(q, self.k_buf[:, :, :end], self.v_buf[:, :, :end], mask, inp.scale, inp.softcap)
        if self.window is not None and self.kept > self.window - 1:
            # the next token attends to itself and the window - 1 before it: older ones are dropped
            keep = self.window - 1
            for buf in (self.k_buf, self.v_buf):
                buf[:, :, :keep] = buf[:, :, self.kept - keep : self.kept].clone()
            self.kept = keep
        return out

    # ---- static decode steps (CUDA graphs): the fp16 baseline as a static cache does it
    def static_refusal(self) -> str | None:
        return None if self.k_buf is not None else "the cache is empty (static steps start after the prefill)"

    def begin_static(self) -> None:
        # the masked slots get probability 0, but 0 x (an inf or nan bit pattern of uninitialized memory) is
        # nan: clear them (the GPU test gave nan logits in one test order before this)
        self.k_buf[:, :, self.kept :].zero_()
        self.v_buf[:, :, self.kept :].zero_()
        self.filled = torch.full((1,), self.kept, dtype=torch.long, device=self.k_buf.device)
        self.positions = torch.arange(self.k_buf.shape[2], device=self.k_buf.device)
        self.static = True

    def static_room(self) -> int:
        return self.k_buf.shape[2] - self.kept

    def reserve_static(self, steps: int) -> None:
        if self.k_buf is not None:
            self._reserve(self.kept + steps, self.k_buf)

    def _attend_static(self, q, k, v, scale, softcap=None) -> torch.Tensor:
        """Write at slot `filled` (device) and attend over the whole preallocated buffer with the slots past it
        masked: shapes that do not change from step to step, as transformers' StaticCache does (every row has
        the same length here: the benchmark's synthetic fill, no padding)."""
        if q.shape[2] != 1:
            raise KvcalError("static decode steps take one token per row")
        self.k_buf.index_copy_(2, self.filled, k)
        self.v_buf.index_copy_(2, self.filled, v)
        self.filled += 1
        valid = self.positions < self.filled
        if self.window is not None:  # the new token sees itself and the window - 1 before it
            valid &= self.positions >= self.filled - self.window
        return decode_attention_masked(q, self.k_buf, self.v_buf, valid, scale, softcap)

    def advance_static(self) -> None:
        self.length += 1
        self.kept += 1

    def held(self) -> dict[str, int]:
        rows = 0 if self.k_buf is None else self.k_buf.shape[0]
        return {"compressed_tokens": 0, "compressed_bytes": 0, "fp_tokens": self.kept * rows,
                "fp_bytes": self.nbytes()[1]}

    def nbytes(self) -> tuple[int, int]:
        if self.k_buf is None:
            return 0, 0
        per_token = 2 * self.k_buf[:, :, :1].numel() * self.k_buf.element_size()
        return per_token * self.k_buf.shape[2], per_token * self.kept

    def fill_synthetic(self, batch, tokens, heads, dim, dtype, device, inv_freq, headroom=0, generator=None,
                       hidden=0):
        like = torch.empty(batch, heads, 1, dim, dtype=dtype, device=device)
        kept = tokens if self.window is None else min(tokens, self.window - 1)  # what a prefill leaves between steps
        self._reserve(kept + headroom, like)
        self.k_buf[:, :, :kept].normal_(generator=generator)
        self.v_buf[:, :, :kept].normal_(generator=generator)
        self.length, self.kept = tokens, kept
        self.is_initialized = True


class KvcalCache(Cache):
    """Pass to a model loaded by kvcal (its adapter routes attention here), built from a method's `Storages` (one
    per layer).

    backend: "packed" (each layer's storage; its Triton kernels on CUDA, torch references elsewhere) or "reference"
    (the storages' torch references everywhere). step_graphs (CUDA): each layer's eager one-token decode step is
    replayed from a CUDA graph (runtime.graph.StepGraph), which removes most of the host cost of its launches; the
    results are those of the same launches run eagerly. False launches them from Python every step. kernels: None
    runs the Triton kernels on CUDA and the torch references elsewhere; True forces the kernels (the CPU under
    TRITON_INTERPRET=1, for tests)."""

    def __init__(self, storages, num_layers: int, backend: str = "packed", capacity_hint: int = 0,
                 step_graphs: bool = True, kernels: bool | None = None):
        if backend not in BACKENDS:
            raise KvcalError(f"unknown cache backend '{backend}' ({', '.join(BACKENDS)})")
        if len(storages) != num_layers:
            raise KvcalError(f"{len(storages)} storages for a model of {num_layers} layers")
        self.shared = SharedState()
        if storages.bulk_only and not storages.policy.bulk:
            raise KvcalError(storages.bulk_only)
        if storages.lossless:
            layers = [LosslessLayer(i, capacity_hint) for i in range(num_layers)]
        else:
            kernels = False if backend == "reference" else kernels
            layers = [PackedLayer(i, s, kernels, capacity_hint, self.shared) for i, s in enumerate(storages)]
            # step graphs replay the Triton kernels only: the torch references synchronize with the host (lengths
            # read per row), which a capture forbids
            pool = GraphPool() if step_graphs and kernels is not False and storages.graph_refusal is None else None
            for layer in layers:
                layer.graph_pool = pool
        super().__init__(layers=layers)
        self.storages = storages
        self.backend = backend
        self.capacity_hint = capacity_hint

    def kvcal_attend(self, inp) -> torch.Tensor:
        layer = self.layers[inp.layer_idx]
        binding = getattr(inp.module, "_kvcal_binding", None)  # None: a benchmark's bare inputs
        if layer.length == 0 and binding is not None:  # a layer's first tokens: its policy, before it stores any
            layer = self._layer_policy(inp.layer_idx, binding[0].dims)
        if inp.q.shape[2] == 1 and inp.q.device.type == "cpu":  # a decode step on a CPU: small ops, one thread
            with one_cpu_thread():
                return layer.attend(inp)
        return layer.attend(inp)

    def _layer_policy(self, i: int, dims):
        """On a model with sliding-window layers (Gemma 2/3), a local layer keeps its window of exact tokens (a
        LosslessLayer with the window), or with storages.compress_local the method's storage as a window (a
        PackedLayer with the window), and a global layer the method's storage. Soft-capped scores (Gemma 2) reach
        the storages' decode kernels and torch references as Packed.softcap (a kernel that does not apply the cap
        refuses it in one line); a storage that remaps its scores itself (CalibQuant) is refused on such a model, as
        in the simulation."""
        if dims.attn_softcap is not None and self.storages.remaps_scores:
            raise KvcalError(f"a method that remaps attention scores (CalibQuant) on {dims.family}, whose scores are "
                             "soft-capped, is not supported yet (the simulation refuses it too)")
        if not dims.hybrid:
            return self.layers[i]
        if dims.layer_types[i] == LOCAL:
            old = self.layers[i]
            if self.storages.compress_local and isinstance(old, PackedLayer):  # the method's format, windowed
                self.layers[i] = PackedLayer(i, old.storage, old.kernels_asked, self.capacity_hint, self.shared,
                                             window=dims.sliding_window)
            else:
                self.layers[i] = LosslessLayer(i, self.capacity_hint, dims.sliding_window)
        return self.layers[i]

    def graph_refusal(self) -> str | None:
        """Why this cache's decode steps cannot be captured in a CUDA graph, or None: the torch references read each
        row's length on the host every step, which a capture forbids (they still run static steps eagerly)."""
        if self.storages.graph_refusal:
            return self.storages.graph_refusal
        # a hybrid model's local layers are LosslessLayers (no kernels to ask for): the packed layers decide
        if not self.storages.lossless and any(getattr(layer, "kernels_asked", None) is False for layer in self.layers):
            return "the torch references (backend reference) synchronize with the host at every step"
        return None

    def check_holds(self, tokens: int) -> None:
        """Raise one line unless every layer holds `tokens` tokens per row (padding included): a model call that
        did not reach this cache (a transformers release passing it under another name) must not go unnoticed."""
        held = sorted({layer.length for layer in self.layers})
        if held != [tokens]:
            raise KvcalError(f"the KV cache holds {'/'.join(map(str, held))} tokens per row after {tokens} were fed: "
                             f"the model (transformers {transformers.__version__}) ran without kvcal's cache")

    # ---- static decode steps: what a CUDA graph can capture and replay (kvcal bench generate)
    def begin_static(self) -> None:
        """From now on a decode step reads and writes only device-side positions, so one captured step
        replays correctly at every later length. The caller moves the host-side counters with
        advance_static() after each step (a replayed graph runs no Python) and checks static_room()."""
        for i, layer in enumerate(self.layers):
            reason = layer.static_refusal()
            if reason:
                raise KvcalError(f"no static decode steps (CUDA graphs) for {type(self.storages[i]).__name__}: layer "
                                 f"{i}: {reason}")
        for layer in self.layers:
            layer.begin_static()

    def end_static(self) -> None:
        for layer in self.layers:
            layer.static = False

    def advance_static(self) -> None:
        for layer in self.layers:
            layer.advance_static()

    def static_room(self) -> int:
        return min(layer.static_room() for layer in self.layers)

    def reserve_static(self, steps: int) -> None:
        """Grow every layer's buffers now so that `steps` static steps fit (a graph cannot grow them)."""
        for layer in self.layers:
            layer.reserve_static(steps)

    def fill_synthetic(self, batch: int, tokens: int, dims, dtype, device, headroom: int = 0, seed: int = 0):
        """Every layer holds `tokens` random tokens per row (see PackedLayer.fill_synthetic), under the layer policy a
        prefill applies: a hybrid model's sliding-window layers keep their window of exact tokens."""
        generator = torch.Generator(device=device).manual_seed(seed)
        inv_freq = dims.rope.inv_freq(device)
        for i in range(len(self.layers)):
            layer = self._layer_policy(i, dims) if self.layers[i].length == 0 else self.layers[i]
            layer.fill_synthetic(batch, tokens, dims.num_kv_heads, dims.head_dim, dtype, device, inv_freq,
                                 headroom, generator, dims.hidden_size)

    def nbytes(self) -> tuple[int, int]:
        """(allocated, used) bytes of the per-token cache over all layers."""
        sizes = [layer.nbytes() for layer in self.layers]
        return sum(s[0] for s in sizes), sum(s[1] for s in sizes)

    def held(self) -> dict[str, int]:
        """The used bytes by part, summed over layers: the compressed part (packed slots) and the full-precision part
        (in the cache's dtype), with their tokens per layer (all rows). A lossless cache is all full precision."""
        parts = {"compressed_tokens": 0, "compressed_bytes": 0, "fp_tokens": 0, "fp_bytes": 0}
        for layer in self.layers:
            for key, value in layer.held().items():
                parts[key] += value
        layers = max(1, len(self.layers))
        parts["compressed_tokens"] //= layers
        parts["fp_tokens"] //= layers
        return parts
