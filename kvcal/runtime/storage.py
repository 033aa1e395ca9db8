"""The storage protocol: the one per-layer interface of a method, for the part of the KV cache it compresses.

A method builds one `Storage` per decoder layer (`Method.build_storages`, a `Storages` tuple); the packed cache
(runtime/cache.py), the simulation (eval/simulate.py) and the benchmarks all go through these objects.

The generic cache (runtime/cache.py) owns everything methods share: the layers, batch rows and left padding,
growth, the full-precision parts (sinks and the recent window, left by the rule the storage's FlushPolicy
declares), CUDA step graphs, and one `SharedState` per cache. A `Storage` owns the rest, for one layer:

- `buffers(batch, capacity)`: the per-token buffers it needs, as `BufferSpec`s (shape, dtype, token axis); the
  cache allocates them, grows them along the token axis and counts their bytes. Per-layer constants (tables,
  calibrated ranges, factors) stay on the storage object (`to(device)` moves them once).
- `write(packed, keys, values, rows, slots)`: compress and pack tokens into given slots (torch reference and
  Triton kernel of the method, one signature).
- `attend(q, packed, scale, fp)`: decode attention of one query per row over the packed tokens, returning softmax
  `Partials` that `runtime.decode.merge` combines with the full-precision part's (torch reference and Triton kernel
  side by side, one signature). Whatever the method needs besides a K-hat and a V-hat (a logit remap, a table of q
  against a codebook, a rematerialization) happens here.
- `read(packed, row)`: the dequantized keys (after RoPE) and values of one row (the reference attention, tests and
  debugging).

- `reconstruct(k, v)` (or `rematerialize(x, proj, state)` for storages of source "x"): the simulation's view of a
  block of tokens, by default a round trip through `write` and `read` (one numerics path for both).
- `remap_scores(scores, compressed)`: what the method does to the scores of compressed keys (the identity unless
  `remaps_scores`: CalibQuant's logit remap, eviction's dropped keys).

An ablation whose format the packed kernels do not hold gets a `ReconstructionStorage`: its reconstruction kept in
plain buffers, torch only (the reference backend).

Shapes and dtypes of the buffers, and what a token costs, are the storage's business; the runtime never looks
inside them. Tokens reach `write` in the storage's key space: after RoPE, or before it for `keys_pre_rope`
storages, which rotate keys at attention time (slot i of a row sits at position `packed.pos_offset + i`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcal.quant.rope import apply_rope, rope_cos_sin
from kvcal.runtime.decode import partials_from_rows, with_fp_reference


@dataclass(frozen=True)
class FlushPolicy:
    """Which tokens a storage leaves in full precision, as a function of how many the cache holds.

    Tokens [0, sink) stay full precision forever. After them, tokens are compressed in aligned blocks
    of `block` tokens, but only once at least `residual` newer tokens exist. So with n tokens cached,
    `compressed_count(n)` tokens after the sinks are compressed and the rest are full precision.
    RTN: (0, 0, 1). KIVI: (0, R, G). SKVQ: (S, W, 1). KVQuant: (n_sink, 0, 1).

    `bulk` (CalibQuant's regime): a prompt's tokens after the sinks, but for its newest `residual`, are compressed
    once, in one write of the whole span (one block of its own length, per row), right after the full-precision
    prefill; every later token stays full precision, so that part grows without bound. `compressed_count(n)` is then
    what a prefill of n tokens compresses (n - sink - residual), and nothing is ever flushed token by token (so `full_precision_mask`, the token-by-token
    rule, does not describe it: the gptq simulation refuses such codecs).
    """

    sink: int = 0
    residual: int = 0
    block: int = 1
    bulk: bool = False

    def compressed_count(self, n: int) -> int:
        if self.bulk:
            return max(0, n - self.sink - self.residual)
        return self.block * (max(0, n - self.sink - self.residual) // self.block)

    def compressed_span(self, n: int) -> tuple[int, int]:
        """[start, end) of the compressed tokens when the cache holds n tokens."""
        return self.sink, self.sink + self.compressed_count(n)

    def full_precision_mask(self, length: int, prompt_len: int = 0, device=None) -> torch.Tensor:
        """Bool [T, T]: entry (i, j) is True when query i sees key j in full precision.

        Query i runs with i + 1 tokens cached (gptq protocol: the token itself is already in the cache).
        Queries before `prompt_len` are the full-precision prefill of the prefill-decode protocol.
        """
        n = torch.arange(1, length + 1, device=device)
        compressed = self.block * torch.clamp(n - self.sink - self.residual, min=0).div(
            self.block, rounding_mode="floor"
        )
        j = torch.arange(length, device=device)[None, :]
        fp = (j < self.sink) | (j >= self.sink + compressed[:, None])
        if prompt_len:
            fp[:prompt_len] = True
        return fp

    @property
    def direct(self) -> bool:
        """Every token is compressed as it arrives (no residual, blocks of one): a decode step packs its token
        straight into the next slot instead of passing through the full-precision ring."""
        return self.residual == 0 and self.block == 1 and not self.bulk


@dataclass(frozen=True)
class BufferSpec:
    """One per-token buffer of a storage: its shape for the batch and capacity asked for, its dtype, and the axis
    along which tokens lie (the cache grows it there)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    token_axis: int

    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class SharedState:
    """One per cache, handed to every layer's storage: RoPE tables that all layers share (one table of the longest
    length asked for, not one per layer: 32 copies of 32K x 128 x 2 floats would be 1 GiB on an 8B model) and the
    objects a method keeps across layers (`state(cls)`: XQuant's cross-layer chain)."""

    _states: dict = field(default_factory=dict)  # class -> its one instance in this cache
    # (device, frequencies) -> (cos, sin): one table per device of a split model and per RoPE of the model (Gemma 3's
    # local layers rotate by another base)
    _tables: dict = field(default_factory=dict)

    def state(self, cls):
        """This cache's one instance of `cls` (made with cls() on first use): what a method's storages share across
        layers, typed by the class that holds it."""
        found = self._states.get(cls)
        if found is None:
            found = self._states[cls] = cls()
        return found

    def rope_tables(self, inv_freq: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [positions >= length, D] in float32 (rope_cos_sin's: cos/sin(position * inv_freq), the two
        halves duplicated), on inv_freq's device."""
        # the adapter keeps one frequency tensor per RoPE and device (Adapter.inv_freq_on), which every layer of that
        # RoPE passes: its address names it
        key = (inv_freq.device, inv_freq.data_ptr())
        found = self._tables.get(key)
        if found is None or found[0].shape[0] < length:
            positions = torch.arange(length, device=inv_freq.device)[None]
            cos, sin = rope_cos_sin(inv_freq, positions, torch.float32)
            found = self._tables[key] = (cos[0], sin[0])
        return found


@dataclass
class Packed:
    """One layer's packed tokens for the whole batch, as a storage sees them: row b holds `lengths[b]` tokens in
    slots [0, lengths[b]) of every buffer (left padding is never stored, so rows differ in length)."""

    buffers: dict[str, torch.Tensor]
    lengths: torch.Tensor  # [B] int32 on the device, kept in step with the host's counts
    heads: int  # KV heads
    dim: int  # head_dim
    capacity: int  # slots per row in every buffer
    pos_offset: int = 0  # position of slot 0 (the sinks come first)
    rope_cos: torch.Tensor | None = None  # [Tmax, D] float32, for keys_pre_rope storages (else None)
    rope_sin: torch.Tensor | None = None
    inv_freq: torch.Tensor | None = None  # [D / 2] float32: the tables are cos/sin(position * inv_freq)
    shared: SharedState | None = None
    # the row lengths as the host knows them, where it does (benchmarks): `length` then reads no device tensor, so
    # `Storage.read` can be captured in a CUDA graph
    host_lengths: tuple[int, ...] | None = None
    softcap: float | None = None  # the model's score soft-cap, s -> softcap tanh(s / softcap) (Gemma 2), else None
    # a compressed sliding-window layer (--compress-local): [B] int32 on the device, the first slot of each row that
    # the next query attends to (the slots before it have left the model's window; the cache drops them in whole
    # blocks); None: every slot is attended to
    first: torch.Tensor | None = None
    host_first: tuple[int, ...] | None = None  # `first` as the host knows it (the references read it)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.buffers[name]

    def length(self, row: int) -> int:
        """Tokens in row `row` (from host_lengths when set, else lengths[row], a host sync on a GPU)."""
        return self.host_lengths[row] if self.host_lengths is not None else int(self.lengths[row])

    def first_slot(self, row: int) -> int:
        """The first slot of row `row` that attention sees (0 but in a compressed sliding-window layer)."""
        if self.first is None:
            return 0
        return self.host_first[row] if self.host_first is not None else int(self.first[row])

    def visible(self, rows: list) -> list:
        """The references' rows (k, v) [H, T_b, D] each (or None), less the slots before each row's first_slot."""
        if self.first is None:
            return rows
        return [kv if kv is None else (kv[0][:, self.first_slot(b):], kv[1][:, self.first_slot(b):])
                for b, kv in enumerate(rows)]

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def rotate_keys(self, k: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """Keys [H, T, D] of one row stored before RoPE -> after RoPE at positions pos_offset + slot."""
        pos = slice(self.pos_offset, self.pos_offset + k.shape[1])
        k = k.to(dtype)
        return apply_rope(k[None], self.rope_cos[None, pos].to(dtype), self.rope_sin[None, pos].to(dtype))[0]


class Storage:
    """Packed storage of the tokens one layer's method compresses (see the module docstring).

    Subclasses declare `policy` and `keys_pre_rope`, and implement `buffers`, `write_reference`, `read`, and
    where they have kernels `write_triton` / `attend_triton` (same signatures as the references). `attend_reference`
    defaults to plain attention over what `read` returns; a method whose attention is not "softmax(q K-hat) V-hat"
    overrides it. `supports_triton(q, packed)` says why a Triton kernel cannot run (None: it can).
    """

    policy: FlushPolicy = FlushPolicy()
    keys_pre_rope: bool = False  # compressed keys live before RoPE (rotated at attention time)
    # what `write` takes of each token: "kv", its keys (in the storage's key space) and values [M, H, D]; "x", the
    # layer's attention inputs [M, 1, hidden] (a storage that rebuilds keys and values from them)
    source: str = "kv"
    lossless: bool = False  # nothing is compressed (the fp16 baseline: the cache keeps plain K/V)
    # why this storage's decode steps are not captured in CUDA graphs (None: they are, where the kernels run)
    graph_refusal: str | None = None
    remaps_scores: bool = False  # remap_scores is not the identity
    # non-empty for a storage that compresses a span only as a whole (its statistics span the block it is given):
    # no token-by-token flush rule, so the tail protocol only; the string says why, as the one-line refusal
    bulk_only: str = ""
    holds_format: bool = True  # the buffers hold the method's format (False: a reconstruction, not its bytes)
    # why the packed cache cannot hold this storage as a sliding window (--compress-local: the slots before a row's
    # Packed.first masked, whole units dropped from the front), completing "--compress-local: <Storage> ..."; None: it can
    window_refusal: str | None = None

    # ---- the simulation's view ------------------------------------------------------------------------------------
    def reconstruct(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k (in the key space: before RoPE for keys_pre_rope) and v [B, Hkv, T, D], T a multiple of policy.block ->
        the reconstructed k and v, same shapes and dtypes. Default: a round trip through this storage's torch
        reference (write, then read); a storage whose published math the buffers cannot hold exactly overrides it."""
        return round_trip(self, k, v)

    def rematerialize(self, x: torch.Tensor, proj, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Storages of source "x": x [B, T, hidden], the attention inputs of a span compressed together -> the keys
        (before RoPE) and values [B, Hkv, T, D] attention sees of them. `proj` is the layer's AttentionInputs
        (`proj.project(xk, xv)`, `proj.finish(k_lin, v_lin)`); `state` is one dict per batch row passed to every
        layer in order for the same span (a method working across layers keeps what it needs there)."""
        raise NotImplementedError(f"{type(self).__name__} compresses keys and values, not X")

    def remap_scores(self, scores: torch.Tensor, compressed: torch.Tensor) -> torch.Tensor:
        """scores [B, Hq, Tq, Tk] (q.k x scale, before the mask), compressed bool broadcastable to them: True where
        the query sees that key compressed -> the scores the softmax takes (entries where compressed is False come
        back unchanged). Default: the identity."""
        return scores

    def bind(self, projection) -> None:
        """Called once per cache layer, before the first write, with the layer's K and V projections
        (models.adapter.KVProjection): source "x" storages take what they rebuild keys and values with; a
        storage that cannot use them raises KvcalError (one line)."""

    # ---- buffers ------------------------------------------------------------------------------------------------
    def buffers(self, batch: int, capacity: int, heads: int, dim: int) -> dict[str, BufferSpec]:
        raise NotImplementedError

    def to(self, device) -> Storage:
        """Move per-layer constants to `device` (once, before the first write)."""
        return self

    def bytes_per_token(self, heads: int, dim: int) -> float:
        """Bytes one token of one row costs in this storage's buffers (what memory accounting counts)."""
        specs = self.buffers(1, 64, heads, dim)
        return sum(spec.nbytes() for spec in specs.values()) / 64

    def check(self, heads: int, dim: int) -> None:
        """Raise KvcalError when this storage cannot hold a layer of these shapes (called once, at allocation)."""

    # ---- write ----------------------------------------------------------------------------------------------------
    def write(self, packed: Packed, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
              slots: torch.Tensor, kernel: bool) -> None:
        """Compress tokens keys/values [M, H, D] into slot slots[m] of row rows[m] (int64 device tensors [M]); a
        storage of source "x" gets the attention inputs [M, 1, hidden] as `keys` and None as `values`. The M
        tokens are runs of `policy.block` consecutive slots of one row each (a `bulk` policy: one run, a row's whole
        prompt span after its sinks, from slot 0). `kernel`: the Triton kernel (CUDA)
        rather than the torch reference; kernels read rows and slots as plain int64 arrays, so they are made
        contiguous here: an expanded index of stride 0 would be read past its one element)."""
        if kernel:
            self.write_triton(packed, keys, values, rows.contiguous(), slots.contiguous())
        else:
            self.write_reference(packed, keys, values, rows, slots)

    def write_reference(self, packed, keys, values, rows, slots) -> None:
        raise NotImplementedError

    def write_triton(self, packed, keys, values, rows, slots) -> None:
        raise NotImplementedError

    def kernel_refusal(self) -> str | None:
        """Why this storage has no Triton kernels at all (None: it has both, write and attend): a packed cache on CUDA
        refuses it in one line at its first token rather than fall back to the torch references."""
        for name in ("write_triton", "attend_triton"):
            if getattr(type(self), name) is getattr(Storage, name):
                return f"{type(self).__name__} has no Triton {name.removesuffix('_triton')} kernel"
        return None

    # ---- read -----------------------------------------------------------------------------------------------------
    def read(self, packed: Packed, row: int, dtype=torch.float32, rotate: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values of row `row`: [H, lengths[row], D] each, in `dtype`. Keys after RoPE, or, with
        rotate=False, in the storage's key space (what `write` received: the simulation rotates them itself)."""
        raise NotImplementedError

    # ---- attend ---------------------------------------------------------------------------------------------------
    def attend_reference(self, q: torch.Tensor, packed: Packed, scale: float, fp):
        """Partials of the queries q [B, Hq, D] (after RoPE) over the packed tokens, then over the full-precision part
        `fp` (runtime.decode.FullPrecision, or None), from `read` (float32, float64 for float64 queries)."""
        compute = torch.promote_types(q.dtype, torch.float32)
        rows = [self.read(packed, b, compute) if int(packed.lengths[b]) else None for b in range(packed.batch)]
        return with_fp_reference(partials_from_rows(q, packed.visible(rows), scale, packed.heads,
                                                    softcap=packed.softcap), q, fp, scale, packed.softcap)

    def attend_triton(self, q: torch.Tensor, packed: Packed, scale: float, fp):
        """attend_reference's partials from the method's kernel: the packed splits and the full-precision part's
        (taken into the kernel's own launch with runtime.kernels.fp_segment, or by kernels.fp_partials_into)."""
        raise NotImplementedError

    def supports_triton(self, q: torch.Tensor, packed: Packed) -> str | None:
        """None when attend_triton can take these inputs, else why not (one line)."""
        if type(self).attend_triton is Storage.attend_triton:
            return f"{type(self).__name__} has no Triton decode kernel"
        return None

    # ---- benchmarks -----------------------------------------------------------------------------------------------
    def fill_synthetic(self, packed: Packed, generator: torch.Generator) -> None:
        """Random contents in every buffer, as after a prefill of random tokens (speed and memory benchmarks: nothing
        is ever timed on zeros). Integer buffers get random bits, floating ones small positive values; storages whose
        buffers hold indices override it."""
        for t in packed.buffers.values():
            if t.dtype.is_floating_point:
                t.uniform_(0.01, 0.05, generator=generator)
            else:
                t.random_(generator=generator)


def round_trip(storage: Storage, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write k, v [B, H, T, D] into fresh buffers of `storage` through its torch reference, read them back (keys in
    the storage's key space, not rotated)."""
    batch, heads, length, dim = k.shape
    storage.check(heads, dim)
    storage = storage.to(k.device)
    buffers = {name: torch.zeros(spec.shape, dtype=spec.dtype, device=k.device)
               for name, spec in storage.buffers(batch, length, heads, dim).items()}
    lengths = torch.full((batch,), length, dtype=torch.int32, device=k.device)
    packed = Packed(buffers, lengths, heads, dim, length)
    rows = torch.arange(batch, device=k.device).repeat_interleave(length)
    slots = torch.arange(length, device=k.device).repeat(batch)
    storage.write_reference(packed, k.transpose(1, 2).reshape(-1, heads, dim),
                            v.transpose(1, 2).reshape(-1, heads, dim), rows, slots)
    compute = torch.promote_types(k.dtype, torch.float32)
    read = [storage.read(packed, b, compute, rotate=False) for b in range(batch)]
    return (torch.stack([r[0] for r in read]).to(k.dtype), torch.stack([r[1] for r in read]).to(v.dtype))


def runs(rows: torch.Tensor, slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """The runs of consecutive slots of one row in a write's (rows, slots): (row, first slot, [start, end) of the
    tokens) each, read on the host."""
    r, s = rows.tolist(), slots.tolist()
    found, start = [], 0
    for m in range(1, len(r) + 1):
        if m == len(r) or r[m] != r[m - 1] or s[m] != s[m - 1] + 1:
            found.append((r[start], s[start], start, m))
            start = m
    return found


class ReconstructionStorage(Storage):
    """A storage that keeps what `reconstruct` (or, for source "x", `rematerialize`) gives back, in plain float64
    buffers [B, Hkv, T, D]: the torch-only storage of an ablation whose format the packed kernels do not hold. Its
    buffers are not the format's bytes (`kvcal bench` refuses it; bits per element come from the method's
    footprint), and it has no Triton kernels (backend reference). Subclasses set the class attributes and implement
    reconstruct (or rematerialize). Each run of a write is one span compressed together, as in the simulation."""

    refusal = "an ablation kept as its reconstruction (torch only)"
    holds_format = False

    def __init__(self):
        self.proj = None

    def bind(self, projection) -> None:
        self.proj = projection

    def buffers(self, batch, capacity, heads, dim):
        spec = BufferSpec((batch, heads, capacity, dim), torch.float64, 2)
        return {"k": spec, "v": spec}

    def kernel_refusal(self) -> str | None:
        return f"{type(self).__name__} is {self.refusal}"

    def write_reference(self, packed, keys, values, rows, slots):
        for row, slot, a, b in runs(rows, slots):
            if self.source == "x":  # one rematerialize state per row, shared by the cache's layers
                if self.proj is None or packed.shared is None:
                    raise RuntimeError(f"{type(self).__name__} rebuilds K and V inside a KvcalCache (bind, then write)")
                state = packed.shared.state(RematerializeRows).setdefault(row, {})
                k_hat, v_hat = self.rematerialize(keys[a:b, 0][None], self.proj, state)
            else:
                k_hat, v_hat = self.reconstruct(keys[a:b].transpose(0, 1)[None], values[a:b].transpose(0, 1)[None])
            packed["k"][row, :, slot:slot + b - a] = k_hat[0].to(torch.float64)
            packed["v"][row, :, slot:slot + b - a] = v_hat[0].to(torch.float64)

    def read(self, packed, row, dtype=torch.float32, rotate=True):
        t = packed.length(row)
        k, v = packed["k"][row, :, :t], packed["v"][row, :, :t]
        if rotate and self.keys_pre_rope:
            k = packed.rotate_keys(k, torch.float64)
        return k.to(dtype), v.to(dtype)

    def attend_reference(self, q, packed, scale, fp):
        compute = torch.promote_types(q.dtype, torch.float32)
        rows = [self.read(packed, b, compute) if int(packed.lengths[b]) else None for b in range(packed.batch)]
        remap = self.remap_scores if self.remaps_scores else None
        return with_fp_reference(partials_from_rows(q, packed.visible(rows), scale, packed.heads, remap,
                                                    packed.softcap), q, fp, scale, packed.softcap)


class RematerializeRows(dict):
    """Row -> the rematerialize state of that row (ReconstructionStorage of source "x"), one per cache."""


class Storages(tuple):
    """One Storage per decoder layer, what `Method.build_storages` returns and the cache and the simulation take.
    The layers share what the cache schedules by: the flush policy, the key space, the source, losslessness and the
    bulk-only refusal (checked here)."""

    def __new__(cls, storages):
        storages = tuple(storages)
        if not storages:
            raise ValueError("Storages needs one storage per layer")
        first = storages[0]
        for s in storages[1:]:
            if (s.policy, s.keys_pre_rope, s.source, s.lossless, s.bulk_only, s.remaps_scores) != (
                    first.policy, first.keys_pre_rope, first.source, first.lossless, first.bulk_only,
                    first.remaps_scores):
                raise ValueError(f"layers of one model need one flush policy and key space: {type(s).__name__} "
                                 f"differs from {type(first).__name__}")
        return super().__new__(cls, storages)

    # on a model with sliding-window layers (Gemma 2/3): whether the local layers hold the method's format too
    # (`--compress-local`) or keep their window of exact tokens (the default)
    compress_local: bool = False

    policy = property(lambda self: self[0].policy)
    keys_pre_rope = property(lambda self: self[0].keys_pre_rope)
    source = property(lambda self: self[0].source)
    lossless = property(lambda self: self[0].lossless)
    remaps_scores = property(lambda self: self[0].remaps_scores)
    bulk_only = property(lambda self: self[0].bulk_only)
    graph_refusal = property(lambda self: next((s.graph_refusal for s in self if s.graph_refusal), None))

    def kernel_refusal(self) -> str | None:
        """Why some layer has no Triton kernels (None: all have)."""
        for storage in self:
            refusal = storage.kernel_refusal()
            if refusal:
                return refusal
        return None
