"""Decode-attention benchmark (`kvcal bench decode`): per-layer time of one decode step at Llama-3.1-8B
attention shapes, fp16/bf16 PyTorch SDPA against kvcal's packed-cache kernel for each codec and bit width,
in the same process, with the bandwidth each kernel achieves from the bytes it must read.

Speed does not depend on the values, so caches are random (random code words, random fp16 scales, random
outlier positions); nothing is ever timed on zeros. Times are medians of triton.testing.do_bench, which
flushes the L2 cache before every call (by zeroing 256 MB; `flush="read"` sums the buffer instead, leaving clean
lines), so each call reads its cache from HBM; by default the call is replayed from a CUDA graph, so the time is the
GPU's (see time_device).

Codecs (the shapes the runtime stores):
  int<b>:  affine_channels keys and values, one fp16 (scale, zero) per token, head and group of head_dim
  kivi<b>: affine_tokens keys (per channel, blocks of 32 tokens), affine_channels values in groups of 32
  nuq<b>:  lut_static keys stored before RoPE (rotated in the kernel) with 21 outliers per token over all
           heads (about 2x KVQuant's 1% of C = 1024), lut_dynamic values with 6 outliers per side
Each codec keeps a full-precision window of `window` tokens (the rest of the context is packed).
"""

from __future__ import annotations

import platform
import statistics
import time

import torch

from kvcal.runtime.attention import DEFAULTS as KERNEL_DEFAULTS
from kvcal.runtime.attention import PackedKV, decode_attention_triton
from kvcal.runtime.packing import words_per_vector

CODECS = ("int", "kivi", "nuq")
KIVI_BLOCK = 32
KIVI_VALUE_GROUP = 32
NUQ_KEY_CAPACITY = 3  # per token and KV head: kvquant's default ceil(2 x 1% x 128) at head_dim 128
NUQ_VALUE_PER_SIDE = 6


def random_packed(codec: str, bits: int, batch: int, hkv: int, dim: int, tokens: int, *, device="cuda",
                  seed: int = 0, pos_offset: int = 0, value_per_head: bool = False) -> PackedKV:
    """A PackedKV of `tokens` random compressed tokens per row in the codec's layout (nuq with
    value_per_head: kvquant's value_scope=head layout, one (scale, zero) and 1 + 1 outliers per token and head)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def words(n):
        return torch.randint(-(2**31), 2**31 - 1, (batch, hkv, tokens, n), dtype=torch.int32, device=device,
                             generator=gen)

    def fp16(*shape, lo=0.01, hi=0.1):
        return (torch.rand(*shape, device=device, generator=gen) * (hi - lo) + lo).half()

    w = words_per_vector(dim, bits)
    spec = dict(head_dim=dim, lengths=torch.full((batch,), tokens, dtype=torch.int32, device=device),
                key_bits=bits, value_bits=bits, k_codes=words(w), v_codes=words(w))
    if codec == "int":
        spec.update(key_format="affine_channels", k_scale=fp16(batch, hkv, tokens, 1),
                    k_zero=fp16(batch, hkv, tokens, 1, lo=-1, hi=0), value_format="affine_channels",
                    v_scale=fp16(batch, hkv, tokens, 1), v_zero=fp16(batch, hkv, tokens, 1, lo=-1, hi=0))
    elif codec == "kivi":
        blocks = -(-tokens // KIVI_BLOCK)
        groups = dim // KIVI_VALUE_GROUP
        spec.update(key_format="affine_tokens", key_block=KIVI_BLOCK, k_scale=fp16(batch, hkv, blocks, dim),
                    k_zero=fp16(batch, hkv, blocks, dim, lo=-1, hi=0), value_format="affine_channels",
                    v_scale=fp16(batch, hkv, tokens, groups), v_zero=fp16(batch, hkv, tokens, groups, lo=-1, hi=0))
    elif codec == "nuq":
        from kvcal.quant.rope import RopeSpec, rope_cos_sin

        c = hkv * dim
        levels = torch.sort(torch.rand(1 << bits, device=device, generator=gen) * 2 - 1).values
        rope = RopeSpec(head_dim=dim, theta=500000.0, rope_type="llama3", factor=8.0)
        cos, sin = rope_cos_sin(rope.inv_freq(device), torch.arange(pos_offset + tokens, device=device)[None],
                                torch.float32)
        head_base = torch.arange(hkv, device=device)[:, None] * dim  # slots per (token, head), global channels
        kidx = torch.randint(0, dim, (batch, tokens, hkv, NUQ_KEY_CAPACITY), device=device, generator=gen) + head_base
        kidx[..., NUQ_KEY_CAPACITY // 2 + 1:] = -1  # ~half the capacity used, as with 1% outliers
        heads = (hkv,) if value_per_head else ()
        vcap = 2 if value_per_head else 2 * NUQ_VALUE_PER_SIDE  # per_side_outliers(1%, 128) = 1 per head
        vidx = torch.randint(0, dim if value_per_head else c, (batch, tokens, *heads, vcap), device=device, generator=gen)
        if value_per_head:
            vidx += torch.arange(hkv, device=device)[:, None] * dim
        spec.update(key_format="lut_static", k_scale=torch.rand(c, device=device, generator=gen) + 0.5,
                    k_zero=torch.randn(c, device=device, generator=gen) * 0.1, k_table=levels,
                    k_out_idx=kidx.to(torch.int16), k_out_val=torch.randn(batch, tokens, hkv, NUQ_KEY_CAPACITY,
                                                                           device=device, generator=gen).half(),
                    value_format="lut_dynamic", v_table=levels.clone(), v_scale=fp16(batch, *heads, tokens),
                    v_zero=fp16(batch, *heads, tokens, lo=-0.1, hi=0.1), v_out_idx=vidx.to(torch.int16),
                    v_out_val=torch.randn(batch, tokens, *heads, vcap, device=device, generator=gen).half(),
                    rope_cos=cos[0], rope_sin=sin[0], pos_offset=pos_offset, rope_inv_freq=rope.inv_freq(device))
    else:
        raise ValueError(f"unknown codec {codec!r} (known: {', '.join(CODECS)})")
    return PackedKV(**spec)


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def packed_bytes(kv: PackedKV) -> int:
    """Bytes of the compressed tokens a decode step must read: codes, scales/zeros, outliers (tables and
    per-channel ranges are per layer, counted too; RoPE tables are read a row per tile and not counted)."""
    parts = (kv.k_codes, kv.v_codes, kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero, kv.k_table, kv.v_table,
             kv.k_out_idx, kv.k_out_val, kv.v_out_idx, kv.v_out_val, kv.lengths)
    return sum(_nbytes(t) for t in parts)


def copy_bandwidth(device="cuda", nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    import triton.testing

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _sdpa(q4, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
            return out, backend.name.lower()
        except RuntimeError:
            continue
    return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True), "default"


FLUSHES = ("write", "read")


def _read_flush_bench(fn, warmup_ms: float, rep_ms: float) -> float:
    """do_bench's loop with a read-only L2 flush: summing a 256 MB buffer evicts the cache and leaves it holding
    clean lines, as a decode step finds it after the previous layer's GEMMs (which read weights and write little).
    do_bench's own flush zeroes that buffer, leaving 50 MB of dirty lines that the timed call then pays to write
    back (H100, 32K x 8: 9.2 us for int4 and 11.3 us for SDPA; results/bench/decode-read-flush-h100-80gb-hbm3.json
    against decode-h100-80gb-hbm3.json)."""
    buf = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        buf.sum()
        fn()
    end.record()
    torch.cuda.synchronize()
    est = start.elapsed_time(end) / 5
    n_warmup, n_rep = max(1, int(warmup_ms / est)), max(1, int(rep_ms / est))
    for _ in range(n_warmup):
        buf.sum()
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    for i in range(n_rep):
        buf.sum()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def time_device(fn, warmup=25, rep=100, graph=True, flush: str = "write") -> float:
    """Median time of fn() in ms (triton.testing.do_bench, L2 flushed before every call). graph=True replays
    fn captured in a CUDA graph, as the decode loop runs it (`kvcal generate --graph`): the time is then the
    GPU's alone. Without a graph, the host side of a decode-attention call (about 220 us on the H100 machine,
    benchmarks/host_overhead.py) overlaps the kernel only as long as do_bench's L2 flush keeps the GPU busy:
    the int4 kernel (~141-149 us replayed) read 150 to 368 us from one eager pass to the next.
    flush: "write" (do_bench's: the flush buffer is zeroed, leaving the L2 dirty) or "read" (_read_flush_bench)."""
    import triton.testing

    if flush not in FLUSHES:
        raise ValueError(f"flush must be one of {FLUSHES}, got {flush!r}")
    bench = (triton.testing.do_bench if flush == "write"
             else lambda f, warmup, rep, return_mode: _read_flush_bench(f, warmup, rep))
    if not graph:
        return bench(fn, warmup=warmup, rep=rep, return_mode="median")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and allocate outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench(g.replay, warmup=warmup, rep=rep, return_mode="median")


def time_sdpa(batch, hq, hkv, dim, tokens, dtype=torch.bfloat16, device="cuda", warmup=25, rep=100, graph=True,
              flush: str = "write"):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(batch, hq, 1, dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(batch, hkv, tokens, dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(batch, hkv, tokens, dim, device=device, dtype=dtype, generator=gen)
    _, backend = _sdpa(q, k, v)
    name = {"flash_attention": SDPBackend.FLASH_ATTENTION, "efficient_attention": SDPBackend.EFFICIENT_ATTENTION}

    def step():
        if backend in name:
            with sdpa_kernel(name[backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    ms = time_device(step, warmup, rep, graph, flush)
    nbytes = _nbytes(q) * 2 + _nbytes(k) + _nbytes(v)
    return ms * 1e3, nbytes, backend


def time_kvcal(codec, bits, batch, hq, hkv, dim, tokens, *, window=128, dtype=torch.bfloat16, device="cuda",
               warmup=25, rep=100, kv: PackedKV | None = None, graph: bool = True, flush: str = "write", **options):
    """Median time (us) of one decode step over `tokens` tokens (tokens - window packed + window fp), and
    the bytes it must read. `kv` replaces the random cache of the codec (e.g. one with parts removed)."""
    window = min(window, tokens)
    if kv is None:
        kv = random_packed(codec, bits, batch, hkv, dim, tokens - window, device=device)
    gen = torch.Generator(device=device).manual_seed(2)
    q = torch.randn(batch, hq, dim, device=device, dtype=dtype, generator=gen)
    fk = torch.randn(batch, hkv, window, dim, device=device, dtype=dtype, generator=gen)
    fv = torch.randn(batch, hkv, window, dim, device=device, dtype=dtype, generator=gen)
    valid = torch.ones(batch, window, dtype=torch.bool, device=device)
    scale = dim**-0.5
    out = decode_attention_triton(q, kv, fk, fv, valid, scale, **options)
    if not torch.isfinite(out.float()).all():
        raise RuntimeError(f"{codec}{bits}: non-finite output")
    ms = time_device(lambda: decode_attention_triton(q, kv, fk, fv, valid, scale, **options), warmup, rep, graph,
                     flush)
    nbytes = packed_bytes(kv) + _nbytes(fk) + _nbytes(fv) + _nbytes(valid) + 2 * _nbytes(q)
    return ms * 1e3, nbytes


def run_decode_bench(contexts=(4096, 16384, 32768, 131072), batches=(1, 8, 32), codecs=CODECS, bits=(4, 3, 2),
                     hq: int = 32, hkv: int = 8, dim: int = 128, window: int = 128, dtype=torch.bfloat16,
                     device="cuda", warmup: int = 25, rep: int = 100, options: dict | None = None,
                     log=print, graph: bool = True, flush: str = "write") -> dict:
    """Benchmark grid; returns a JSON-ready dict (device, versions, copy bandwidth, one row per
    (context, batch, method)). options: {codec or codec+bits: kwargs for decode_attention_triton}."""
    import triton

    options = options or {}
    dev = torch.device(device)
    props = torch.cuda.get_device_properties(dev)
    copy = copy_bandwidth(dev)
    log(f"{props.name}: device-to-device copy {copy:.0f} GB/s (read + write)")
    free = torch.cuda.mem_get_info(dev)[0]
    rows = []
    for tokens in contexts:
        for batch in batches:
            sdpa_bytes = 2 * batch * hkv * tokens * dim * torch.finfo(dtype).bits // 8
            if 3 * sdpa_bytes > free:
                log(f"skip context {tokens} batch {batch}: {sdpa_bytes / 1e9:.1f} GB of fp16 K/V")
                continue
            us, nbytes, backend = time_sdpa(batch, hq, hkv, dim, tokens, dtype, device, warmup, rep, graph, flush)
            base = dict(context=tokens, batch=batch)
            rows.append(dict(base, method="sdpa", bits=16, backend=backend, us=us, bytes=nbytes,
                             gbps=nbytes / us / 1e3, pct_copy=100 * nbytes / us / 1e3 / copy, speedup=1.0))
            log(f"ctx {tokens:6d} batch {batch:2d} sdpa ({backend}) {us:8.1f} us {nbytes / us / 1e3:7.0f} GB/s")
            torch.cuda.empty_cache()
            for codec in codecs:
                for b in bits:
                    opts = dict(options.get(codec, {}), **options.get(f"{codec}{b}", {}))
                    t0 = time.time()
                    kus, kbytes = time_kvcal(codec, b, batch, hq, hkv, dim, tokens, window=window, dtype=dtype,
                                             device=device, warmup=warmup, rep=rep, graph=graph, flush=flush,
                                             **opts)
                    gbps = kbytes / kus / 1e3
                    rows.append(dict(base, method=codec, bits=b, us=kus, bytes=kbytes, gbps=gbps,
                                     pct_copy=100 * gbps / copy, speedup=us / kus, options=opts))
                    log(f"ctx {tokens:6d} batch {batch:2d} {codec}{b:<2d} {kus:8.1f} us {gbps:7.0f} GB/s "
                        f"{100 * gbps / copy:5.1f}% of copy  x{us / kus:5.2f} vs sdpa  ({time.time() - t0:.1f} s)")
                    torch.cuda.empty_cache()
    return dict(
        device=props.name, sm_count=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), dtype=str(dtype).replace("torch.", ""), hq=hq, hkv=hkv, head_dim=dim,
        window=window, copy_gbps=copy,
        flush=flush,
        timing=("triton.testing.do_bench median (L2 flushed before each call by zeroing 256 MB)" if flush == "write"
                else "median as do_bench, the L2 flushed before each call by reading 256 MB (left clean)")
               + (" of a CUDA graph replay (GPU time only)" if graph else ", eager calls (host launch cost included)"),
        kernel_defaults={k: dict(zip(("block_t", "num_warps", "num_stages", "max_registers"), v))
                         for k, v in KERNEL_DEFAULTS.items()},
        codecs={"int": "affine_channels keys+values, group=head_dim",
                "kivi": f"affine_tokens keys (block {KIVI_BLOCK}) + affine_channels values (group {KIVI_VALUE_GROUP})",
                "nuq": f"lut_static pre-RoPE keys ({NUQ_KEY_CAPACITY} outlier slots/token/head) + lut_dynamic values "
                       f"({NUQ_VALUE_PER_SIDE} outliers/side)"},
        rows=rows,
    )


def format_table(result: dict, context: int | None = None, batch: int | None = None) -> str:
    """Markdown table of the rows (optionally one context / batch)."""
    lines = ["| context | batch | method | us | GB/s | % of copy | x vs SDPA |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if (context and r["context"] != context) or (batch and r["batch"] != batch):
            continue
        name = "sdpa bf16" if r["method"] == "sdpa" else f"{r['method']}{r['bits']}"
        lines.append(f"| {r['context']} | {r['batch']} | {name} | {r['us']:.1f} | {r['gbps']:.0f} | "
                     f"{r['pct_copy']:.0f} | {r['speedup']:.2f} |")
    return "\n".join(lines)


def device_slug(name: str) -> str:
    return "-".join(w for w in "".join(c if c.isalnum() else " " for c in name.lower()).split() if w != "nvidia")


__all__ = ["run_decode_bench", "format_table", "random_packed", "packed_bytes", "copy_bandwidth", "time_sdpa",
           "time_kvcal", "time_device", "device_slug"]
