"""Decode-attention benchmark (`kvcal bench decode`): per-layer time of one decode step at Llama-3.1-8B attention
shapes, bf16 PyTorch SDPA against each method's packed storage and Triton kernel (any registered method, from a recipe
or an artifact), in the same process, with the bandwidth each kernel achieves from the bytes it must read.

Speed does not depend on the values, so caches are random (each storage fills its own buffers: random code words,
random fp16 scales, random outlier positions; learned methods without an artifact get random tables from
Method.synthetic_tensors); nothing is ever timed on zeros. Times are medians of triton.testing.do_bench, which
flushes the L2 cache before every call (by zeroing 256 MB; `flush="read"` sums the buffer instead, leaving clean
lines), so each call reads its cache from HBM; by default the call is replayed from a CUDA graph, so the time is the
GPU's (see time_device). Every cache keeps a full-precision window of `window` tokens; the rest of the context is
packed.
"""

from __future__ import annotations

import platform
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvcal.models.attention import NEG, remapped_attention
from kvcal.runtime import kernels as K
from kvcal.runtime.decode import FullPrecision
from kvcal.runtime.storage import Packed, SharedState, Storage


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def random_packed(storage, batch: int, heads: int, dim: int, tokens: int, *, device="cuda", seed: int = 0,
                  inv_freq: torch.Tensor | None = None) -> Packed:
    """A Packed of `tokens` random compressed tokens per row in `storage`'s own buffers (storage.fill_synthetic),
    keys stored before RoPE placed after the storage's sinks (RoPE tables from inv_freq)."""
    storage.check(heads, dim)
    storage.to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    buffers = {name: torch.empty(spec.shape, dtype=spec.dtype, device=device)
               for name, spec in storage.buffers(batch, tokens, heads, dim).items()}
    lengths = torch.full((batch,), tokens, dtype=torch.int32, device=device)
    offset = storage.policy.sink
    cos = sin = None
    if storage.keys_pre_rope:
        cos, sin = SharedState().rope_tables(inv_freq.to(device), offset + tokens)
    packed = Packed(buffers, lengths, heads, dim, tokens, offset, cos, sin,
                    inv_freq.to(device) if inv_freq is not None else None)
    storage.fill_synthetic(packed, gen)
    return packed


def packed_bytes(storage, packed: Packed) -> int:
    """Bytes of the compressed tokens a decode step must read: the storage's buffers, plus its per-layer tables
    (RoPE tables are read a row per tile and not counted)."""
    static = sum(_nbytes(t) for t in getattr(storage, "tables", {}).values())
    return sum(_nbytes(t) for t in packed.buffers.values()) + _nbytes(packed.lengths) + static


def copy_bandwidth(device="cuda", nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    import triton.testing  # triton is Linux-only: this module imports without it (its timings need it)

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _sdpa(q4, k, v):
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
    back (measured in docs/runtime.md)."""
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
    GPU's alone. Without a graph, the host side of a decode-attention call (as long as the kernel or longer,
    docs/runtime.md) overlaps the kernel only as long as do_bench's L2 flush keeps the GPU busy, so eager
    timings vary from pass to pass.
    flush: "write" (do_bench's: the flush buffer is zeroed, leaving the L2 dirty) or "read" (_read_flush_bench)."""
    import triton.testing  # Linux-only, as in copy_bandwidth

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


def naive_attention(storage, packed: Packed, q: torch.Tensor, fp: FullPrecision | None, scale: float,
                    masked: bool = True) -> torch.Tensor:
    """What a user writes without a fused kernel: dequantize every row of the packed cache in torch (Storage.read,
    keys after RoPE, in q's dtype), append the full-precision window, and attend with SDPA. q [B, Hq, D] ->
    [B, Hq, D]. Rows must hold the same number of tokens (the benchmark's caches do). masked=False skips the window's
    validity mask (the benchmark's windows are full: SDPA then runs its flash kernel)."""
    rows = [storage.read(packed, b, q.dtype) for b in range(packed.batch)]
    k, v = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])  # [B, Hkv, T, D]
    mask = None
    if fp is not None:
        k, v = torch.cat([k, fp.k.to(q.dtype)], 2), torch.cat([v, fp.v.to(q.dtype)], 2)
        if masked:
            kept = torch.ones(q.shape[0], k.shape[2] - fp.k.shape[2], dtype=torch.bool, device=q.device)
            mask = torch.cat([kept, fp.valid], 1)[:, None, None, :]
    if type(storage).remap_scores is Storage.remap_scores:
        out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale,
                                                               enable_gqa=True)
        return out[:, :, 0]
    # a storage that remaps the compressed keys' scores (CalibQuant's logit remap): the softmax written out
    bias = torch.zeros((), device=q.device) if mask is None else torch.where(mask, 0.0, NEG)
    compressed = torch.arange(k.shape[2], device=q.device) < rows[0][0].shape[1]
    return remapped_attention(q[:, :, None], k, v, bias, compressed, scale, storage.remap_scores)[:, :, 0]


def bench_inputs(storage, batch, hq, hkv, dim, tokens, window, dtype, device, inv_freq):
    """The random packed cache (tokens - window packed tokens a row), queries and full window of a timed step."""
    window = min(window, tokens)
    packed = random_packed(storage, batch, hkv, dim, tokens - window, device=device, inv_freq=inv_freq)
    gen = torch.Generator(device=device).manual_seed(2)
    q = torch.randn(batch, hq, dim, device=device, dtype=dtype, generator=gen)
    fp = FullPrecision(torch.randn(batch, hkv, window, dim, device=device, dtype=dtype, generator=gen),
                       torch.randn(batch, hkv, window, dim, device=device, dtype=dtype, generator=gen),
                       torch.ones(batch, window, dtype=torch.bool, device=device))
    return packed, q, fp if window else None


def time_naive(storage, batch, hq, hkv, dim, tokens, *, window=128, dtype=torch.bfloat16, device="cuda",
               warmup=25, rep=100, graph: bool = True, flush: str = "write", inv_freq=None, log=print):
    """Median time (us) of naive_attention over the same cache as time_storage, and whether it ran from a CUDA graph
    (a storage whose `read` synchronises the host cannot be captured: it is then timed eagerly, and the log says so)."""
    packed, q, fp = bench_inputs(storage, batch, hq, hkv, dim, tokens, window, dtype, device, inv_freq)
    packed.host_lengths = (tokens - min(window, tokens),) * batch

    def step():
        return naive_attention(storage, packed, q, fp, dim**-0.5, masked=False)

    try:
        return time_device(step, warmup, rep, graph, flush) * 1e3, graph
    except RuntimeError as exc:
        if not graph:
            raise
        log(f"{type(storage).__name__}: the naive step cannot be captured in a CUDA graph "
            f"({str(exc).splitlines()[0][:120]}); timed eagerly")
        torch.cuda.synchronize()
        return time_device(step, warmup, rep, False, flush) * 1e3, False


def time_storage(storage, batch, hq, hkv, dim, tokens, *, window=128, dtype=torch.bfloat16, device="cuda",
                 warmup=25, rep=100, graph: bool = True, flush: str = "write", inv_freq=None, **options):
    """Median time (us) of one decode step over `tokens` tokens (tokens - window packed in `storage`, window in full
    precision) through the storage's Triton kernel and the merge, and the bytes it must read. options: the storage
    kernel's tuning knobs (its attend_triton's keyword arguments)."""
    packed, q, fp = bench_inputs(storage, batch, hq, hkv, dim, tokens, window, dtype, device, inv_freq)
    scale = dim**-0.5
    reason = K.unsupported(q) or storage.supports_triton(q, packed)
    if reason:
        raise RuntimeError(f"{type(storage).__name__}: no Triton kernel for this shape ({reason})")

    def step():
        return K.merge_triton(storage.attend_triton(q, packed, scale, fp, **options), q)

    out = step()
    if not torch.isfinite(out.float()).all():
        raise RuntimeError(f"{type(storage).__name__}: non-finite output")
    ms = time_device(step, warmup, rep, graph, flush)
    window_bytes = 0 if fp is None else _nbytes(fp.k) + _nbytes(fp.v) + _nbytes(fp.valid)
    nbytes = packed_bytes(storage, packed) + window_bytes + 2 * _nbytes(q)
    return ms * 1e3, nbytes


def run_decode_bench(cases, dims, contexts=(4096, 16384, 32768, 131072), batches=(1, 8, 32),
                     window: int = 128, dtype=torch.bfloat16, device="cuda", warmup: int = 25, rep: int = 100,
                     options: dict | None = None, log=print, graph: bool = True, flush: str = "write",
                     naive: bool = True) -> dict:
    """Benchmark grid over `cases`, a list of (name, storages, bits per element), at the shapes of `dims` (the model's
    ModelDims: `kvcal bench decode` passes Llama-3.1-8B's). Returns a JSON-ready dict (device, versions, copy
    bandwidth, one row per (context, batch, case)). options: {case name: tuning knobs of its storage kernel}.
    naive: also time each case's naive step (naive_attention: dequantize the whole cache in torch, then SDPA) on the
    same cache, in the same run (`naive_us`, `naive_graph`, `x_vs_naive` = naive_us / us)."""
    import triton  # Linux-only, as in copy_bandwidth

    hq, hkv, dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
    inv_freq = dims.rope.inv_freq(device)
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
            for name, storages, bits in cases:
                opts = options.get(name, {})
                t0 = time.time()
                kus, kbytes = time_storage(storages[0], batch, hq, hkv, dim, tokens, window=window, dtype=dtype,
                                           device=device, warmup=warmup, rep=rep, graph=graph, flush=flush,
                                           inv_freq=inv_freq, **opts)
                gbps = kbytes / kus / 1e3
                row = dict(base, method=name, bits=round(bits, 3), backend="kvcal-triton", us=kus, bytes=kbytes,
                           gbps=gbps, pct_copy=100 * gbps / copy, speedup=us / kus, options=opts)
                vs_naive = ""
                if naive:
                    torch.cuda.empty_cache()
                    nus, graphed = time_naive(storages[0], batch, hq, hkv, dim, tokens, window=window, dtype=dtype,
                                              device=device, warmup=warmup, rep=rep, graph=graph, flush=flush,
                                              inv_freq=inv_freq, log=log)
                    row.update(naive_us=nus, naive_graph=graphed, x_vs_naive=nus / kus)
                    vs_naive = f"  x{nus / kus:6.2f} vs naive ({nus:.1f} us{'' if graphed else ', eager'})"
                rows.append(row)
                log(f"ctx {tokens:6d} batch {batch:2d} {name:<20s} {kus:8.1f} us {gbps:7.0f} GB/s "
                    f"{100 * gbps / copy:5.1f}% of copy  x{us / kus:5.2f} vs sdpa{vs_naive}  ({time.time() - t0:.1f} s)")
                torch.cuda.empty_cache()
    return dict(
        device=props.name, sm_count=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), dtype=str(dtype).replace("torch.", ""), hq=hq, hkv=hkv, head_dim=dim,
        window=window, copy_gbps=copy, flush=flush, backend="kvcal-triton (every storage's own kernel)",
        timing=("triton.testing.do_bench median (L2 flushed before each call by zeroing 256 MB)" if flush == "write"
                else "median as do_bench, the L2 flushed before each call by reading 256 MB (left clean)")
               + (" of a CUDA graph replay (GPU time only)" if graph else ", eager calls (host launch cost included)"),
        cases=[name for name, _, _ in cases],
        naive=("each case's naive step, timed the same way: every row of the packed cache dequantized by the "
               "storage's torch `read` (keys after RoPE, in the query dtype), the window appended, SDPA") if naive
        else None,
        rows=rows,
    )


def format_table(result: dict, context: int | None = None, batch: int | None = None) -> str:
    """Markdown table of the rows (optionally one context / batch)."""
    naive = any("naive_us" in r for r in result["rows"])
    lines = ["| context | batch | method | us | GB/s | % of copy | x vs SDPA |" + (" naive us | x vs naive |" if naive
                                                                            else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|" if naive else "")]
    for r in result["rows"]:
        if (context and r["context"] != context) or (batch and r["batch"] != batch):
            continue
        name = "sdpa bf16" if r["method"] == "sdpa" else r["method"]
        line = (f"| {r['context']} | {r['batch']} | {name} | {r['us']:.1f} | {r['gbps']:.0f} | "
                f"{r['pct_copy']:.0f} | {r['speedup']:.2f} |")
        if naive:
            line += (f" {r['naive_us']:.1f}{'' if r['naive_graph'] else ' (eager)'} | {r['x_vs_naive']:.2f} |"
                     if "naive_us" in r else " | |")
        lines.append(line)
    return "\n".join(lines)


def device_slug(name: str) -> str:
    return "-".join(w for w in "".join(c if c.isalnum() else " " for c in name.lower()).split() if w != "nvidia")


__all__ = ["run_decode_bench", "format_table", "naive_attention", "time_naive", "random_packed", "packed_bytes", "copy_bandwidth", "time_sdpa",
           "time_storage", "time_device", "device_slug"]
