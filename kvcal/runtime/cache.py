"""KvcalCache: a transformers `Cache` whose layers hold K/V compressed the way a codec says.

Pass it as `past_key_values` to a model loaded by kvcal (its attention adapter routes every layer's
attention here). Two backends:

- "packed" (the runtime): codes bit-packed in int32 words plus fp16 parameters and outliers, per row of
  the batch; decode attention reads them through fused Triton kernels on CUDA (torch references
  elsewhere, kvcal/runtime/ops.py). Left padding is never stored: each row holds its own tokens, so a
  padded batch computes what each sequence computes alone.
- "dequantized" (a reference for tests): keeps the reconstructed values in plain tensors.

Both follow the same protocol. Prefill (the first call, several tokens): attention over the
full-precision prompt, then the prompt is compressed in bulk as far as the codec's FlushPolicy allows.
Decode (one token per call): the token is appended, the oldest tokens are flushed one block at a time
while the policy allows, then attention runs. Sinks and the recent residual stay in full precision.
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvcal.errors import KvcalError
from kvcal.models.attention import attention, decode_attention_masked
from kvcal.quant.nonuniform import range_params
from kvcal.quant.rope import apply_rope, rope_cos_sin
from kvcal.runtime import ops
from kvcal.runtime.attention import PackedKV
from kvcal.runtime.graph import GraphPool, StepGraph
from kvcal.runtime.packing import words_per_vector


class _LayerBase(DynamicLayer):
    """transformers' Cache API (the mask builder and generate() ask for lengths)."""

    def __init__(self, codec, layer_idx: int):
        super().__init__()
        self.codec = codec
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


class DequantizedLayer(_LayerBase):
    """Reference backend: stores what dequantization gives, one tensor for the whole sequence."""

    def __init__(self, codec, layer_idx: int):
        super().__init__(codec, layer_idx)
        self.compressed = 0
        self.k_src = self.v_src = self.cos = self.sin = self.k_seen = self.v_seen = None

    def append(self, inp) -> None:
        k_rot = apply_rope(inp.k_pre, inp.cos, inp.sin)
        k_src = inp.k_pre if self.codec.keys_pre_rope else k_rot
        new = (k_src, inp.v, inp.cos, inp.sin, k_rot, inp.v.clone())
        if self.k_src is None:
            self.k_src, self.v_src, self.cos, self.sin, self.k_seen, self.v_seen = new
        else:
            old = (self.k_src, self.v_src, self.cos, self.sin, self.k_seen, self.v_seen)
            dims = (2, 2, 1, 1, 2, 2)
            self.k_src, self.v_src, self.cos, self.sin, self.k_seen, self.v_seen = (
                torch.cat([a, b], dim=d) for a, b, d in zip(old, new, dims))
        self.length += inp.k_pre.shape[2]
        self.is_initialized = True

    def flush(self) -> None:
        policy = self.codec.policy
        while self.compressed < policy.compressed_count(self.length):
            start = policy.sink + self.compressed
            end = start + policy.block
            k_hat = self.codec.quantize_keys(self.layer_idx, self.k_src[:, :, start:end])
            v_hat = self.codec.quantize_values(self.layer_idx, self.v_src[:, :, start:end])
            if self.codec.keys_pre_rope:
                k_hat = apply_rope(k_hat, self.cos[:, start:end], self.sin[:, start:end])
            self.k_seen[:, :, start:end] = k_hat
            self.v_seen[:, :, start:end] = v_hat
            self.compressed += policy.block

    def attend(self, inp) -> torch.Tensor:
        q = apply_rope(inp.q, inp.cos, inp.sin)
        prefill = self.length == 0 and inp.q.shape[2] > 1
        self.append(inp)
        if prefill:  # full-precision prompt attention, then bulk compression
            out = attention(q, self.k_seen, self.v_seen, inp.mask, inp.scale)
            self.flush()
            return out
        self.flush()
        return attention(q, self.k_seen, self.v_seen, inp.mask, inp.scale)


def _left_padding(mask: torch.Tensor | None, batch: int, length: int) -> list[int]:
    """Leading masked tokens per row, read off the prefill mask's last query row."""
    if mask is None:
        return [0] * batch
    last = mask[:, 0, -1, :length] if mask.dim() == 4 else mask[None, -1, :length].expand(batch, -1)
    valid = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
    pads = []
    for row in valid.cpu():
        pad = int((~row).long().cumprod(0).sum())
        if not bool(row[pad:].all()):
            raise KvcalError("KvcalCache supports left padding only (a row has masked tokens after valid ones)")
        pads.append(pad)
    return pads


class RopeTables:
    """cos/sin [positions, D] in float32 for keys stored before RoPE, shared by every layer of one cache
    (all layers rotate alike): one table of the longest length asked for, not one per layer (32 copies of
    32K x 128 x 2 floats would be 1 GiB on an 8B model)."""

    def __init__(self):
        self.cos = self.sin = None

    def get(self, inv_freq: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos is None or self.cos.shape[0] < length or self.cos.device != inv_freq.device:
            positions = torch.arange(length, device=inv_freq.device)[None]
            cos, sin = rope_cos_sin(inv_freq, positions, torch.float32)
            self.cos, self.sin = cos[0], sin[0]
        return self.cos, self.sin


class PackedLayer(_LayerBase):
    """Packed storage of one layer. Row b holds sinks, `compressed[b]` packed tokens, and a residual ring."""

    GROWTH = 1.125  # buffers grow by 1/8 (bounded over-allocation, so memory tracks bits per element)

    def __init__(self, codec, layer_idx: int, capacity_hint: int = 0, rope_tables: RopeTables | None = None):
        super().__init__(codec, layer_idx)
        self.rope_tables = rope_tables or RopeTables()
        self.key_format, self.value_format = codec.runtime_formats(layer_idx)
        self.policy = codec.policy
        self.capacity_hint = capacity_hint
        self.buffers: dict[str, torch.Tensor] = {}
        self.compressed: list[int] = []  # packed tokens per row
        self.count: list[int] = []  # valid tokens per row (sinks + packed + residual)
        self.ring_start: list[int] = []
        self.ring_count: list[int] = []
        self.static = False  # static decode steps (KvcalCache.begin_static): what a CUDA graph replays
        self.graph_pool: GraphPool | None = None  # set by KvcalCache(step_graphs=True): eager steps replay a graph
        self.step_graph: StepGraph | None = None
        self.generation = 0  # bumped whenever the buffers are replaced: a recorded step graph then records again

    # ---- allocation ---------------------------------------------------------------------------------
    def _init(self, batch: int, heads: int, dim: int, dtype, device, inv_freq) -> None:
        self.batch, self.heads, self.dim = batch, heads, dim
        self.dtype, self.device = dtype, device
        for part, fmt in (("key", self.key_format), ("value", self.value_format)):
            if fmt.kind == "affine_channels" and dim % fmt.group:
                raise KvcalError(f"the packed runtime stores {part} groups inside one head: group_size {fmt.group} "
                                 f"must divide head_dim {dim} (simulation accepts it: --mode simulate)")
        self.ring_capacity = self.policy.residual + self.policy.block
        fp_slots = self.policy.sink + self.ring_capacity
        z = dict(device=self.device)
        self.fp_k = torch.zeros(batch, heads, fp_slots, dim, dtype=self.dtype, **z)  # post-RoPE
        self.fp_v = torch.zeros_like(self.fp_k)
        # keys in the codec's key space, for flushing (the post-RoPE keys themselves unless pre-RoPE)
        self.fp_src = torch.zeros_like(self.fp_k) if self.codec.keys_pre_rope else self.fp_k
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
        self.index_tensors: dict[tuple, torch.Tensor] = {}
        kf, vf = self.key_format, self.value_format
        for name in ("lo", "hi", "encode", "decode"):
            if getattr(kf, name) is not None:
                self.buffers["k_" + name] = getattr(kf, name).to(self.device, torch.float32)
        for name in ("encode", "decode"):
            if getattr(vf, name) is not None:
                self.buffers["v_" + name] = getattr(vf, name).to(self.device, torch.float32)
        if kf.kind == "lut_static":  # the kernel reads the calibrated range as zero and scale
            self.buffers["k_lut_zero"], self.buffers["k_lut_scale"] = range_params(self.buffers["k_lo"],
                                                                                   self.buffers["k_hi"])
        if self.codec.keys_pre_rope:
            self.inv_freq = inv_freq.to(self.device)
        self.capacity = 0
        self._grow(max(self.capacity_hint, 16))

    def _shapes(self, cap: int) -> dict[str, tuple[tuple, torch.dtype]]:
        b, h, d = self.batch, self.heads, self.dim
        kf, vf = self.key_format, self.value_format
        shapes = {
            "k_codes": ((b, h, cap, words_per_vector(d, kf.bits)), torch.int32),
            "v_codes": ((b, h, cap, words_per_vector(d, vf.bits)), torch.int32),
        }
        if kf.kind == "affine_channels":
            shapes["k_scale"] = shapes["k_zero"] = ((b, h, cap, d // kf.group), torch.float16)
        elif kf.kind == "affine_tokens":
            shapes["k_scale"] = shapes["k_zero"] = ((b, h, cap // kf.block, d), torch.float16)
        elif kf.capacity:
            shapes["k_out_idx"] = ((b, cap, h, kf.capacity), torch.int16)  # slots per token and head
            shapes["k_out_val"] = ((b, cap, h, kf.capacity), torch.float16)
        if vf.kind == "affine_channels":
            shapes["v_scale"] = shapes["v_zero"] = ((b, h, cap, d // vf.group), torch.float16)
        else:
            heads = (h,) if vf.per_head else ()
            shapes["v_scale"] = shapes["v_zero"] = ((b, *heads, cap), torch.float16)
            if vf.per_side:
                shapes["v_out_idx"] = ((b, cap, *heads, 2 * vf.per_side), torch.int16)
                shapes["v_out_val"] = ((b, cap, *heads, 2 * vf.per_side), torch.float16)
        return shapes

    def _grow(self, needed: int) -> None:
        block = self.policy.block
        cap = max(needed, int(self.capacity * self.GROWTH) + 1)
        cap = -(-cap // block) * block  # whole key blocks
        token_axis = {"k_codes": 2, "v_codes": 2, "k_scale": 2, "k_zero": 2, "v_scale": 2, "v_zero": 2,
                      "k_out_idx": 1, "k_out_val": 1, "v_out_idx": 1, "v_out_val": 1}
        if self.key_format.kind != "affine_channels":
            token_axis["k_scale"] = token_axis["k_zero"] = 2
        if self.value_format.kind == "lut_dynamic" and not self.value_format.per_head:
            token_axis["v_scale"] = token_axis["v_zero"] = 1
        for name, (shape, dtype) in self._shapes(cap).items():
            new = torch.zeros(shape, dtype=dtype, device=self.device)
            old = self.buffers.get(name)
            if old is not None:
                axis = token_axis[name]
                new.narrow(axis, 0, old.shape[axis]).copy_(old)
            self.buffers[name] = new
        self.capacity = cap
        self.generation += 1
        if self.codec.keys_pre_rope:  # tables may be longer than this layer needs (the kernel bounds reads)
            self.rope_cos, self.rope_sin = self.rope_tables.get(self.inv_freq, self.policy.sink + cap)

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

    # ---- storage ------------------------------------------------------------------------------------
    def _prefill_row(self, b: int, pad: int, k_src, k_rot, v) -> None:
        """Store row b's valid prompt tokens [pad, T) in bulk: sinks, packed span, then the residual ring."""
        sink, total = self.policy.sink, k_src.shape[2] - pad
        n_sink = min(sink, total)
        packed = self.policy.compressed_count(total)
        tokens = slice(pad, pad + n_sink)
        self.fp_k[b, :, :n_sink] = k_rot[b, :, tokens]
        self.fp_src[b, :, :n_sink] = k_src[b, :, tokens]
        self.fp_v[b, :, :n_sink] = v[b, :, tokens]
        self.fp_valid[b, :n_sink] = True
        if packed:
            span = slice(pad + sink, pad + sink + packed)
            if packed > self.capacity:
                self._grow(packed)
            self._pack([b], k_src[b, :, span].transpose(0, 1)[None], v[b, :, span].transpose(0, 1)[None])
            self.compressed[b] = packed
            self.lengths[b] = packed
        rest = slice(pad + n_sink + packed, pad + total)
        n_rest = total - n_sink - packed
        ring = slice(sink, sink + n_rest)
        self.fp_k[b, :, ring] = k_rot[b, :, rest]
        self.fp_src[b, :, ring] = k_src[b, :, rest]
        self.fp_v[b, :, ring] = v[b, :, rest]
        self.fp_valid[b, ring] = True
        self.ring_start[b], self.ring_count[b], self.count[b] = 0, n_rest, total
        self.ring_on_device = False

    def _append_step(self, k_src, k_rot, v) -> None:
        """Append one token per row ([B, H, D] each) to its sinks or its residual ring, all rows at once."""
        sink = self.policy.sink
        slots = []
        for b in range(self.batch):
            if self.count[b] < sink:
                slots.append(self.count[b])
            else:
                if self.ring_count[b] == self.ring_capacity:
                    raise RuntimeError("residual ring overflow: flush was not called")
                slots.append(sink + (self.ring_start[b] + self.ring_count[b]) % self.ring_capacity)
                self.ring_count[b] += 1
            self.count[b] += 1
        rows = self._index(range(self.batch))
        slot = self._index(slots)
        self.fp_k[rows, :, slot] = k_rot
        if self.fp_src is not self.fp_k:
            self.fp_src[rows, :, slot] = k_src
        self.fp_v[rows, :, slot] = v
        self.fp_valid[rows, slot] = True
        self.ring_on_device = False

    def _flush_rows(self) -> None:
        """Pack the oldest residual block of every row that the policy allows to (at most one per step)."""
        block, sink = self.policy.block, self.policy.sink
        rows = [b for b in range(self.batch) if self.compressed[b] < self.policy.compressed_count(self.count[b])]
        if not rows:
            return
        needed = max(self.compressed[b] for b in rows) + block
        if needed > self.capacity:
            self._grow(needed)
        slots = self._index([sink + (self.ring_start[b] + i) % self.ring_capacity
                             for b in rows for i in range(block)]).view(len(rows), block)
        row_idx = self._index(rows)[:, None]
        self._pack(rows, self.fp_src[row_idx, :, slots], self.fp_v[row_idx, :, slots])  # [R, block, H, D]
        self.fp_valid[row_idx, slots] = False
        self.lengths[row_idx[:, 0]] += block
        for b in rows:
            self.ring_start[b] = (self.ring_start[b] + block) % self.ring_capacity
            self.ring_count[b] -= block
            self.compressed[b] += block
        self.ring_on_device = False

    def _pack(self, rows: list[int], k_src: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize tokens [R, N, H, D] of rows `rows` (N a multiple of the block) into their next slots."""
        nrows, count = k_src.shape[:2]
        row_ids = self._index(rows)
        start = self.lengths[row_ids].long()  # packed tokens so far: the rows' next free slots
        slot = (start[:, None] + torch.arange(count, device=self.device)[None]).reshape(-1)  # [R*N]
        row = row_ids[:, None].expand(-1, count).reshape(-1)
        self._store(k_src.reshape(nrows * count, self.heads, self.dim), v.reshape(nrows * count, self.heads, self.dim),
                    row, slot, nrows)

    def _store(self, keys: torch.Tensor, values: torch.Tensor, row: torch.Tensor, slot: torch.Tensor, nrows: int):
        """Quantize tokens [M, H, D] into row row[m], slot slot[m] of the buffers (device index tensors). The M
        tokens are nrows runs of consecutive slots of one row each. On CUDA each side is one kernel that writes
        straight into the buffers, except KIVI's keys (prompts and host-side flushes): their blocks of
        consecutive slots are quantized at once, then written with index writes."""
        kf, vf, buf = self.key_format, self.value_format, self.buffers
        if kf.kind == "affine_channels":
            ops.quantize_affine_channels_into(keys, kf.bits, kf.group, buf["k_codes"], buf["k_scale"], buf["k_zero"],
                                              row, slot)
        elif kf.kind == "affine_tokens":  # every run is whole key blocks: one (scale, zero) per block
            count = keys.shape[0] // nrows
            codes, scale, zero = ops.quantize_affine_token_blocks(keys, kf.bits, kf.block)
            block_idx = (slot // kf.block).reshape(nrows, count)[:, :: kf.block].reshape(-1)
            block_row = row.reshape(nrows, count)[:, :: kf.block].reshape(-1)
            buf["k_scale"][block_row, :, block_idx] = scale.reshape(-1, self.heads, self.dim)
            buf["k_zero"][block_row, :, block_idx] = zero.reshape(-1, self.heads, self.dim)
            buf["k_codes"][row, :, slot] = codes
        else:
            ops.quantize_lut_static_into(keys, buf["k_lo"], buf["k_hi"], buf["k_encode"], buf["k_decode"], kf.bits,
                                         kf.capacity, buf["k_codes"], buf.get("k_out_idx"), buf.get("k_out_val"), row,
                                         slot)
        if vf.kind == "affine_channels":
            ops.quantize_affine_channels_into(values, vf.bits, vf.group, buf["v_codes"], buf["v_scale"],
                                              buf["v_zero"], row, slot)
        else:
            ops.quantize_lut_dynamic_into(values, buf["v_encode"], buf["v_decode"], vf.bits, vf.per_side,
                                          vf.per_head, buf["v_codes"], buf["v_scale"], buf["v_zero"],
                                          buf.get("v_out_idx"), buf.get("v_out_val"), row, slot)

    def packed(self) -> PackedKV:
        kf, vf, buf = self.key_format, self.value_format, self.buffers
        kv = PackedKV(
            head_dim=self.dim, lengths=self.lengths, key_format=kf.kind, key_bits=kf.bits, k_codes=buf["k_codes"],
            k_scale=buf.get("k_scale"), k_zero=buf.get("k_zero"), value_format=vf.kind, value_bits=vf.bits,
            v_codes=buf["v_codes"], v_scale=buf["v_scale"], v_zero=buf["v_zero"], key_block=kf.block,
            k_out_idx=buf.get("k_out_idx"), k_out_val=buf.get("k_out_val"), v_table=buf.get("v_decode"),
            v_out_idx=buf.get("v_out_idx"), v_out_val=buf.get("v_out_val"),
        )
        if kf.kind == "lut_static":
            kv.k_table = buf["k_decode"]
            kv.k_zero, kv.k_scale = buf["k_lut_zero"], buf["k_lut_scale"]
            kv.rope_cos, kv.rope_sin, kv.pos_offset = self.rope_cos, self.rope_sin, self.policy.sink
            kv.rope_inv_freq = self.inv_freq
        return kv

    # ---- attention ----------------------------------------------------------------------------------
    def attend(self, inp) -> torch.Tensor:
        batch, _, length, _ = inp.q.shape
        if self.length == 0:
            adapter = inp.module._kvcal_binding[0]
            self._init(batch, inp.k_pre.shape[1], inp.k_pre.shape[3], inp.v.dtype, inp.v.device, adapter.inv_freq)
        if length == 1 and not self.static and self._static_eager_steps():  # fewer kernels than the host-side ring
            return self._eager_static_step(inp)
        q = apply_rope(inp.q, inp.cos, inp.sin)
        k_rot = apply_rope(inp.k_pre, inp.cos, inp.sin)
        k_src = inp.k_pre if self.codec.keys_pre_rope else k_rot
        if self.length == 0 and length > 1:  # prefill: full-precision attention, then bulk compression
            out = attention(q, k_rot, inp.v, inp.mask, inp.scale)
            for b, pad in enumerate(_left_padding(inp.mask, batch, length)):
                self._prefill_row(b, pad, k_src, k_rot, inp.v)
            self.length = length
            return out
        if self.static:
            return self._attend_static(q, k_src, k_rot, inp.v, inp.scale)
        outs = []
        for t in range(length):  # decode, one token at a time (several tokens are decoded in sequence)
            self._append_step(k_src[:, :, t], k_rot[:, :, t], inp.v[:, :, t])
            self._flush_rows()
            self.length += 1
            outs.append(ops.decode_attention(q[:, :, t], self.packed(), self.fp_k, self.fp_v, self.fp_valid,
                                             inp.scale))
        return outs[0][:, :, None] if length == 1 else torch.stack(outs, dim=2)

    def _eager_static_step(self, inp) -> torch.Tensor:
        """An eager one-token decode step taken as a static step (then advance_static). On CUDA with step graphs it
        is replayed from this layer's StepGraph, RoPE included: the host launches one graph and copies five inputs
        instead of a dozen torch ops and the runtime's kernels."""
        self.reserve_static(1)
        self._mirror_ring()
        step = functools.partial(self._rotated_static_step, scale=inp.scale)
        inputs = (inp.q, inp.k_pre, inp.v, inp.cos, inp.sin)
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

    def _rotated_static_step(self, q, k_pre, v, cos, sin, *, scale: float) -> torch.Tensor:
        """_attend_static from the unrotated query and key."""
        k_rot = apply_rope(k_pre, cos, sin)
        return self._attend_static(apply_rope(q, cos, sin), k_pre if self.codec.keys_pre_rope else k_rot, k_rot, v,
                                   scale)

    # ---- static decode steps (CUDA graphs) ------------------------------------------------------------
    def static_refusal(self) -> str | None:
        """Why this layer cannot take static decode steps now, or None. A static step must not depend on
        host-side state that changes from step to step (a captured graph replays fixed kernels and indices)."""
        if not self.buffers or min(self.count) < self.policy.sink:
            return "a row does not hold its sink tokens yet (static steps start after the prefill)"
        if not self._direct_steps() and not self._ring_steps():
            return (f"static steps through a residual ring (residual {self.policy.residual}, block "
                    f"{self.policy.block}) are implemented for KIVI's formats only (post-RoPE affine_tokens keys, "
                    f"affine_channels values), not {self.key_format.kind} / {self.value_format.kind}")
        return None

    def _direct_steps(self) -> bool:
        """Whether a decode step may pack its token straight into slot lengths[b] (what static steps do): the
        policy compresses every token at once and every row holds its sinks, so the ring would only ever
        hold the token being packed."""
        return self.policy.residual == 0 and self.policy.block == 1 and min(self.count) >= self.policy.sink

    def _ring_steps(self) -> bool:
        """Whether the device-side ring step (runtime/ring.py) handles this layer: KIVI's formats, keys after RoPE."""
        kinds = (self.key_format.kind, self.value_format.kind)
        return kinds == ("affine_tokens", "affine_channels") and self.fp_src is self.fp_k

    def _static_eager_steps(self) -> bool:
        """Whether eager decode steps take the static path too (one token per row, then advance_static): it
        launches fewer kernels than _append_step + _flush_rows and gives the same cache."""
        return self.static_refusal() is None

    def _mirror_ring(self) -> None:
        """Device copies of the ring positions, which static steps read and move in place (advance_static moves
        the lists alike); refreshed after the host-side ring path moved them (a host-to-device copy)."""
        if self._direct_steps() or self.ring_on_device:
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
        """Packed slots that `steps` more static steps need. A ring step may write a whole block from slot
        lengths[b] (runtime/ring.py), where lengths[b] <= max(0, n - 1 - sink - residual) for a row holding n
        tokens after the step (a direct step writes one slot: block 1, residual 0)."""
        p = self.policy
        return max(self.count) + steps + p.block - 1 - p.sink - p.residual

    def static_room(self) -> int:
        """Static steps left before the packed buffers are full (they cannot grow inside a graph)."""
        return self.capacity - self._capacity_for(0)

    def reserve_static(self, steps: int) -> None:
        """Grow the buffers now (outside any graph) so that `steps` static steps fit."""
        if self.buffers and self._capacity_for(steps) > self.capacity:
            self._grow(self._capacity_for(steps))

    def _attend_static(self, q, k_src, k_rot, v, scale) -> torch.Tensor:
        """One decode step on device-side positions only: no host-side index, no host-to-device copy, the same
        kernels every step. Policies that compress every token at once (residual 0, block 1) pack the token
        straight into slot lengths[b] (equal to the ring path, whose ring would only ever hold that token);
        the others go through the ring as eager steps do (_ring_step_static). Host counters move in
        advance_static()."""
        if q.shape[2] != 1:
            raise KvcalError("static decode steps take one token per row")
        if self._direct_steps():
            self._store(k_src[:, :, 0], v[:, :, 0], self._index(range(self.batch)), self.lengths, self.batch)
            self.lengths += 1
        else:
            self._ring_step_static(k_rot[:, :, 0], v[:, :, 0])
        out = ops.decode_attention(q[:, :, 0], self.packed(), self.fp_k, self.fp_v, self.fp_valid, scale)
        return out[:, :, None]

    def _ring_step_static(self, k_rot, v) -> None:
        """_append_step then _flush_rows with the ring positions on the device (runtime/ring.py: one kernel
        for the step, one for the counters on CUDA)."""
        kf, vf, buf = self.key_format, self.value_format, self.buffers
        ops.ring_step(k_rot, v, self.fp_k, self.fp_v, self.fp_valid, self.ring_start_dev, self.ring_count_dev,
                      self.lengths, buf["k_codes"], buf["k_scale"], buf["k_zero"], buf["v_codes"], buf["v_scale"],
                      buf["v_zero"], sink=self.policy.sink, residual=self.policy.residual, block=self.policy.block,
                      key_bits=kf.bits, value_bits=vf.bits, value_group=vf.group)

    def advance_static(self) -> None:
        """The host counters after one static step (what the device did, replayed in Python)."""
        block, direct = self.policy.block, self._direct_steps()
        for b in range(self.batch):
            self.count[b] += 1
            if not direct:
                self.ring_count[b] += 1
                if self.compressed[b] < self.policy.compressed_count(self.count[b]):
                    self.ring_start[b] = (self.ring_start[b] + block) % self.ring_capacity
                    self.ring_count[b] -= block
                    self.compressed[b] += block
            else:
                self.compressed[b] += 1
        self.length += 1

    def fill_synthetic(self, batch: int, tokens: int, heads: int, dim: int, dtype, device, inv_freq,
                       headroom: int = 0, generator=None) -> None:
        """Fill with `tokens` tokens per row of random codes and parameters, as after a prefill (for speed and
        memory benchmarks: decoding then runs through the real buffers and kernels). Every outlier slot is used
        (a prefill leaves some key slots empty): the most work a decode step can have."""
        self._init(batch, heads, dim, dtype, device, inv_freq)
        packed = self.policy.compressed_count(tokens)
        self.count = [tokens] * batch
        self._grow(max(packed, self._capacity_for(headroom)))  # room for `headroom` steps, static ones included
        for name, t in self.buffers.items():
            if name in self.STATIC:
                continue
            if name.endswith("codes"):
                t.random_(generator=generator)
            elif name.endswith("out_idx") and t.dim() == 4:  # slots per (token, KV head): channels of that head
                t.random_(0, dim, generator=generator)
                t += (torch.arange(heads, device=device, dtype=t.dtype) * dim)[:, None]
            elif name.endswith("out_idx"):  # slots per token over all heads
                t.random_(0, heads * dim, generator=generator)
            else:  # scales, zeros, outlier residuals: small positive values
                t.uniform_(0.01, 0.05, generator=generator)
        fp_tokens = tokens - packed
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

    # per layer, not per token
    STATIC = ("k_lo", "k_hi", "k_encode", "k_decode", "v_encode", "v_decode", "k_lut_zero", "k_lut_scale")

    def nbytes(self) -> tuple[int, int]:
        """(allocated, used) bytes of this layer's per-token storage: packed buffers and full-precision
        slots. `used` counts the packed slots and fp slots that hold tokens."""
        if not self.buffers:
            return 0, 0
        packed = sum(t.numel() * t.element_size() for name, t in self.buffers.items() if name not in self.STATIC)
        fp_tensors = [self.fp_k, self.fp_v] + ([self.fp_src] if self.fp_src is not self.fp_k else [])
        fp_alloc = sum(t.numel() * t.element_size() for t in fp_tensors)
        fp_slot = 2 * self.heads * self.dim * self.fp_k.element_size()  # one token's K and V
        used = packed * sum(self.compressed) / (self.batch * self.capacity) + fp_slot * int(self.fp_valid.sum())
        return packed + fp_alloc, int(used)


class LosslessLayer(_LayerBase):
    """fp16 'codec': full-precision K/V in preallocated buffers that grow by 1/8 (no copy of the whole
    cache at every step, unlike concatenation)."""

    def __init__(self, codec, layer_idx: int, capacity_hint: int = 0):
        super().__init__(codec, layer_idx)
        self.capacity_hint = capacity_hint
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
            k_new[:, :, : self.length] = self.k_buf[:, :, : self.length]
            v_new[:, :, : self.length] = self.v_buf[:, :, : self.length]
        self.k_buf, self.v_buf = k_new, v_new

    def attend(self, inp) -> torch.Tensor:
        q, k = apply_rope(inp.q, inp.cos, inp.sin), apply_rope(inp.k_pre, inp.cos, inp.sin)
        if self.static:
            return self._attend_static(q, k, inp.v, inp.scale)
        new = k.shape[2]
        self._reserve(self.length + new, k)
        self.k_buf[:, :, self.length : self.length + new] = k
        self.v_buf[:, :, self.length : self.length + new] = inp.v
        self.length += new
        self.is_initialized = True
        end = self.length
        return attention(q, self.k_buf[:, :, :end], self.v_buf[:, :, :end], inp.mask, inp.scale)

    # ---- static decode steps (CUDA graphs): the fp16 baseline as a static cache does it
    def static_refusal(self) -> str | None:
        return None if self.k_buf is not None else "the cache is empty (static steps start after the prefill)"

    def begin_static(self) -> None:
        # the masked slots get probability 0, but 0 x (an inf or nan bit pattern of uninitialized memory) is
        # nan: clear them (the GPU test gave nan logits in one test order before this)
        self.k_buf[:, :, self.length :].zero_()
        self.v_buf[:, :, self.length :].zero_()
        self.filled = torch.full((1,), self.length, dtype=torch.long, device=self.k_buf.device)
        self.positions = torch.arange(self.k_buf.shape[2], device=self.k_buf.device)
        self.static = True

    def static_room(self) -> int:
        return self.k_buf.shape[2] - self.length

    def reserve_static(self, steps: int) -> None:
        if self.k_buf is not None:
            self._reserve(self.length + steps, self.k_buf)

    def _attend_static(self, q, k, v, scale) -> torch.Tensor:
        """Write at slot `filled` (device) and attend over the whole preallocated buffer with the slots past it
        masked: shapes that do not change from step to step, as transformers' StaticCache does (every row has
        the same length here: the benchmark's synthetic fill, no padding)."""
        if q.shape[2] != 1:
            raise KvcalError("static decode steps take one token per row")
        self.k_buf.index_copy_(2, self.filled, k)
        self.v_buf.index_copy_(2, self.filled, v)
        self.filled += 1
        return decode_attention_masked(q, self.k_buf, self.v_buf, self.positions < self.filled, scale)

    def advance_static(self) -> None:
        self.length += 1

    def nbytes(self) -> tuple[int, int]:
        if self.k_buf is None:
            return 0, 0
        per_token = 2 * self.k_buf[:, :, :1].numel() * self.k_buf.element_size()
        return per_token * self.k_buf.shape[2], per_token * self.length

    def fill_synthetic(self, batch, tokens, heads, dim, dtype, device, inv_freq, headroom=0, generator=None):
        like = torch.empty(batch, heads, 1, dim, dtype=dtype, device=device)
        self._reserve(tokens + headroom, like)
        self.k_buf[:, :, :tokens].normal_(generator=generator)
        self.v_buf[:, :, :tokens].normal_(generator=generator)
        self.length = tokens
        self.is_initialized = True


class KvcalCache(Cache):
    """Pass as `past_key_values` to a model loaded by kvcal (its adapter routes attention here).

    step_graphs (packed backend, CUDA): each layer's eager one-token decode step is replayed from a CUDA graph
    (runtime.graph.StepGraph), which removes most of the host cost of its launches; the results are those of the
    same launches run eagerly. False launches them from Python every step."""

    def __init__(self, codec, num_layers: int, backend: str = "packed", capacity_hint: int = 0,
                 step_graphs: bool = True):
        if codec.lossless:
            layers = [LosslessLayer(codec, i, capacity_hint) for i in range(num_layers)]
        elif backend == "dequantized":
            layers = [DequantizedLayer(codec, i) for i in range(num_layers)]
        elif backend == "packed":
            if not hasattr(codec, "runtime_formats"):
                raise KvcalError(f"{type(codec).__name__} has no packed runtime yet: use the dequantized reference cache "
                                 "(--backend dequantized) or the simulation (--mode simulate)")
            rope_tables = RopeTables()
            layers = [PackedLayer(codec, i, capacity_hint, rope_tables) for i in range(num_layers)]
            pool = GraphPool() if step_graphs else None
            for layer in layers:
                layer.graph_pool = pool
        else:
            raise KvcalError(f"unknown cache backend '{backend}' (packed or dequantized)")
        super().__init__(layers=layers)
        self.codec = codec
        self.backend = backend

    def kvcal_attend(self, inp) -> torch.Tensor:
        return self.layers[inp.layer_idx].attend(inp)

    def check_holds(self, tokens: int) -> None:
        """Raise one line unless every layer holds `tokens` tokens per row (padding included): a model call that
        did not reach this cache (a transformers release passing it under another name) must not go unnoticed."""
        held = sorted({layer.length for layer in self.layers})
        if held != [tokens]:
            import transformers

            raise KvcalError(f"the KV cache holds {'/'.join(map(str, held))} tokens per row after {tokens} were fed: "
                             f"the model (transformers {transformers.__version__}) ran without kvcal's cache")

    # ---- static decode steps: what a CUDA graph can capture and replay (kvcal bench generate)
    def begin_static(self) -> None:
        """From now on a decode step reads and writes only device-side positions, so one captured step
        replays correctly at every later length. The caller moves the host-side counters with
        advance_static() after each step (a replayed graph runs no Python) and checks static_room()."""
        for i, layer in enumerate(self.layers):
            reason = layer.static_refusal() if hasattr(layer, "static_refusal") else "dequantized reference backend"
            if reason:
                raise KvcalError(f"no static decode steps (CUDA graphs) for {type(self.codec).__name__}: layer {i}: "
                                 f"{reason}")
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
            if hasattr(layer, "reserve_static"):  # the others are refused by begin_static
                layer.reserve_static(steps)

    def fill_synthetic(self, batch: int, tokens: int, dims, dtype, device, headroom: int = 0, seed: int = 0):
        """Every layer holds `tokens` random tokens per row (see PackedLayer.fill_synthetic)."""
        generator = torch.Generator(device=device).manual_seed(seed)
        inv_freq = dims.rope.inv_freq(device)
        for layer in self.layers:
            layer.fill_synthetic(batch, tokens, dims.num_kv_heads, dims.head_dim, dtype, device, inv_freq,
                                 headroom, generator)

    def nbytes(self) -> tuple[int, int]:
        """(allocated, used) bytes of the per-token cache over all layers."""
        sizes = [layer.nbytes() for layer in self.layers if hasattr(layer, "nbytes")]
        return sum(s[0] for s in sizes), sum(s[1] for s in sizes)
