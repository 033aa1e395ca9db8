"""Packed caches built with each storage's torch reference, and the kernel checks on them: tests/test_kernels.py runs
them under the Triton interpreter (CPU, small shapes) and, marked gpu, natively at Llama-3.1-8B shapes.

Every check compares a storage's Triton kernel with its torch reference (same signature): there is no fallback
between the two, so a kernel that cannot take a case fails it."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from kvcal.models.adapter import forward_with_cache
from kvcal.quant.rope import RopeSpec
from kvcal.runtime import kernels as K
from kvcal.runtime.decode import FullPrecision, fp_partials_reference, merge_reference
from kvcal.runtime.kernels import split_share
from kvcal.runtime.storage import Packed, SharedState


def _keys(gen, n, h, d, device):
    x = torch.randn(n, h, d, generator=gen, device=device)
    x[..., : d // 16] *= 4.0  # a few large channels, as real keys have
    return x


def method_cases() -> dict:
    """{method name: its cases module (kvcal/methods/<name>/cases.py)} for every registered method that has one: each
    method declares its own storages with random parameters and the cases of its kernels."""
    from kvcal.methods.registry import all_methods

    found = {}
    for name in sorted(all_methods()):
        module = f"kvcal.methods.{name}.cases"
        if importlib.util.find_spec(module) is not None:
            found[name] = importlib.import_module(module)
    return found


def make_storage(method: str, bits, hkv: int, d: int, **kw):
    """A storage of `method` with random parameters (its cases module's random_storage; the keywords are its own)."""
    return method_cases()[method].random_storage(bits, hkv, d, **kw)


def build_packed(storage, lengths, hkv: int, d: int, *, tcap: int | None = None, poison: bool = False,
                 misaligned_scales: bool = False, seed: int = 0, device="cpu") -> Packed:
    """`lengths[b]` random tokens in row b of the storage's buffers, written by its torch reference (a few large key
    channels, as real keys have).
    poison (rtn): the scale and zero rows past each row's length hold inf and nan, its code rows random words (a
    kernel that reads them must not let them reach the output).
    misaligned_scales (rtn): the same scales and zeros in buffers whose rows start one fp16 past an 8-byte boundary
    (the fragment kernel then loads them one token at a time, not as 8-byte vectors)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    batch = len(lengths)
    tcap = tcap or max(max(lengths), 1)
    storage.to(device)
    buffers = {name: torch.zeros(spec.shape, dtype=spec.dtype, device=device)
               for name, spec in storage.buffers(batch, tcap, hkv, d).items()}
    cos = sin = inv_freq = None
    sink = storage.policy.sink
    if storage.keys_pre_rope:
        inv_freq = RopeSpec(head_dim=d, theta=500000.0, rope_type="llama3", factor=8.0).inv_freq(device)
        cos, sin = SharedState().rope_tables(inv_freq, sink + tcap + 8)
    packed = Packed(buffers, torch.tensor(lengths, dtype=torch.int32, device=device), hkv, d, tcap, sink, cos, sin,
                    inv_freq)
    for b, n in enumerate(lengths):
        if n:
            rows = torch.full((n,), b, dtype=torch.int64, device=device)
            storage.write_reference(packed, _keys(gen, n, hkv, d, device),
                                    torch.randn(n, hkv, d, generator=gen, device=device), rows,
                                    torch.arange(n, device=device))
    if poison:
        for b, n in enumerate(lengths):
            for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
                buffers[name][b, :, n:] = float("inf") if name.endswith("scale") else float("nan")
            for name in ("k_codes", "v_codes"):
                codes = buffers[name]
                codes[b, :, n:] = torch.randint(-2**31, 2**31 - 1, codes[b, :, n:].shape, generator=gen,
                                                device=device, dtype=torch.int64).to(torch.int32)
    if misaligned_scales:
        def shifted(t):
            buf = torch.empty(*t.shape[:-2], t.shape[-2] + 1, t.shape[-1], dtype=t.dtype, device=device)[..., 1:, :]
            return buf.copy_(t)

        for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
            buffers[name] = shifted(buffers[name])
    return packed


def build_step(batch: int, hq: int, hkv: int, d: int, nfp: int, dtype, *, seed: int = 1, device="cpu", qscale=1.0):
    """Query and full-precision part for one decode step (some fp slots invalid; None without slots)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = (torch.randn(batch, hq, d, generator=gen, device=device) * qscale).to(dtype)
    fp_k = torch.randn(batch, hkv, nfp, d, generator=gen, device=device).to(dtype)
    fp_v = torch.randn(batch, hkv, nfp, d, generator=gen, device=device).to(dtype)
    valid = torch.rand(batch, nfp, generator=gen, device=device) > 0.3
    return q, (FullPrecision(fp_k, fp_v, valid) if nfp else None)


def rel_err(out: torch.Tensor, ref: torch.Tensor, per_head: bool = False) -> float:
    """||out - ref|| / ||ref||; per_head: the largest of it over the [batch, heads] rows of [B, H, D] outputs (one
    norm over everything would hide an error confined to one row or head: a dropped token moves one head's output
    by 4e-2 to 6e-2 but the whole tensor's by less than the bf16 tolerance)."""
    out, ref = out.double(), ref.double()
    if per_head:
        return float(((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max())
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


# ---- the checks (run under TRITON_INTERPRET=1 on CPU by tests/test_kernels.py, natively on the GPU) -----------

# bf16 rounds the output itself (2^-9) and the kernel rounds P * scale and dequantized keys to fp16;
# measured errors: ~4e-3 (bf16), ~4e-4 (fp16); the interpreter cases' largest per (row, query head): 5.2e-3 (bf16),
# 1.2e-3 (fp16), 2.5e-6 (fp32), 2.3e-15 (fp64). Tolerances on ||out - ref|| / ||ref|| (rel_err):
# float32 inputs keep every operand in float32 (IEEE dots, no TF32): only summation order differs.
# float64 inputs: float64 dots and softmax; dequantization in float32 as the reference's.
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5, torch.float64: 1e-12}
# the GPU cases (Llama-3.1-8B shapes, up to 32763 tokens a row), per (row, query head): the largest of 128 rows, so
# above the whole-output error the tolerances above were set for; measured on an H100, largest per dtype: fp16 3.0e-3
# (nuq2 without outliers; 2.2e-3 nuq4 with them), float32 1.03e-5 (int4), bf16 and float64 within TOL
# (nuq2 without outliers; 2.2e-3 nuq4 with them), float32 1.03e-5 (int4), bf16 and float64 within TOL. KVQuant's caches as
# its storage writes them (tables and keys drawn apart): nuq4 fp16 4.4e-3 to 5.1e-3 over four draws, bf16 5.2e-3 to
# 5.7e-3, float32 1e-6 to 2e-6 (H100): the lookup-table path's fp16 rounding of keys (three roundings per key)
TOL_GPU = {**TOL, torch.float16: 6e-3, torch.float32: 2e-5}

# (name, method, bits, dtype, storage and cache kwargs, kernel kwargs, step kwargs): the generic full-precision kernel
# alone (method None), then every method's own cases
ATTENTION_CASES = [("fp_only_bf16", None, 4, torch.bfloat16, {}, {}, {}),
                   ("fp_only_softcap_fp16", None, 4, torch.float16, {}, {}, {"softcap": 2.0})] + [
    (name, method, *rest) for method, cases in method_cases().items() for name, *rest in cases.ATTENTION]
GPU_CASES = [("fp_only_fp16", None, 4, torch.float16, {}, {}, {})] + [
    (name, method, *rest) for method, cases in method_cases().items() for name, *rest in cases.GPU_ATTENTION]
PACKED_KEYS = ("poison", "misaligned_scales")  # cache kwargs for build_packed; the rest are the storage's


def run_attention_case(case, *, small=True, device="cpu", shape: tuple[int, int, int] | None = None):
    """Kernel vs reference for one case; returns the relative error. shape (head_dim, KV heads, query heads) replaces
    the large case's Llama-3.1-8B heads (e.g. Gemma 3's 256-channel heads)."""
    name, method, bits, dtype, cache_kw, kernel_kw, step_kw = case
    cases = method_cases()[method] if method is not None else None
    if small:
        d, hkv, lengths, tcap, nfp = step_kw.get("d", 64), 2, step_kw.get("lengths", [37, 0, 70]), step_kw.get("tcap", 80), 19
        kernel_kw = {"num_splits": 2, "block_t": 16, **kernel_kw}
        if method is not None and hasattr(cases, "small_kernel_kwargs"):
            kernel_kw = cases.small_kernel_kwargs(kernel_kw)
    else:  # Llama-3.1-8B attention shapes, odd lengths, batch 4
        d, hkv, lengths, tcap, nfp = 128, 8, [4097, 32763, 1500, 16001], 32768, 128
        if method is not None and hasattr(cases, "gpu_block"):  # rows of whole key blocks / range groups
            block = cases.gpu_block(cache_kw)
            lengths = [n // block * block for n in lengths]
    hq = step_kw.get("hq", 4 * hkv if small else 32)
    if small and "hq" in step_kw:
        hq = step_kw["hq"] if step_kw["hq"] != 2 else hkv
    if shape is not None and not small:
        d, hkv, hq = shape
    nfp = step_kw.get("nfp", nfp)
    q, fp = build_step(len(lengths), hq, hkv, d, nfp, dtype, device=device)
    scale = d**-0.5
    softcap = step_kw.get("softcap")  # the model's score soft-cap (Gemma 2), on the packed cache and the fp part
    if method is None:  # the full-precision part alone: the generic kernel
        ref = merge_reference(fp_partials_reference(q, fp, scale, softcap), len(lengths), q.dtype)
        if softcap is not None:  # teeth: the cap changes the output of these scores
            assert rel_err(merge_reference(fp_partials_reference(q, fp, scale), len(lengths), q.dtype), ref) > 0.05
        out = K.merge_triton(K.fp_partials_triton(q, fp, scale, softcap), q)
        return rel_err(out, ref, per_head=True)
    storage = cases.random_storage(bits, hkv, d, device=device,
                                   **{k: v for k, v in cache_kw.items() if k not in PACKED_KEYS})
    packed = build_packed(storage, lengths, hkv, d, tcap=tcap, device=device,
                          **{k: v for k, v in cache_kw.items() if k in PACKED_KEYS})
    ref = merge_reference(storage.attend_reference(q, packed, scale, fp), len(lengths), q.dtype)
    if softcap is not None:
        packed.softcap = softcap
        capped = merge_reference(storage.attend_reference(q, packed, scale, fp), len(lengths), q.dtype)
        assert rel_err(ref, capped) > 0.05, f"{name}: the cap must change this case's output"  # teeth
        ref = capped
    assert storage.supports_triton(q, packed) is None, f"{name}: {storage.supports_triton(q, packed)}"
    if hasattr(cases, "check_case"):
        cases.check_case(name, storage, q, packed, bits, kernel_kw)
    chunk = K.REDUCE_CHUNK
    deterministic = torch.are_deterministic_algorithms_enabled()
    K.REDUCE_CHUNK = step_kw.get("reduce_chunk", chunk)
    torch.use_deterministic_algorithms(step_kw.get("deterministic", deterministic))
    try:
        out = K.merge_triton(storage.attend_triton(q, packed, scale, fp, **kernel_kw), q)
    finally:
        K.REDUCE_CHUNK = chunk
        torch.use_deterministic_algorithms(deterministic)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if not torch.isfinite(out.float()).all():
        return float("nan")
    return rel_err(out, ref, per_head=True)  # per (row, query head): an error in one head must not hide in the rest


# (name, bits, storage kwargs): KVQuant's outlier passes on their own, against their torch references
OUTLIER_PASS_CASES = [
    ("nuq4_sink3", 4, {"kcap": 3, "per_side": 2, "sink": 3}),
    ("nuq3", 3, {"kcap": 2, "per_side": 1}),
    ("nuq2_values_per_head", 2, {"kcap": 1, "per_side": 2, "value_per_head": True}),
    ("nuq4_tables_only", 4, {"kcap": 3, "per_side": 2, "sink": 5, "inv_freq": False}),
]


def run_outlier_pass_checks(device="cpu", small=True) -> dict:
    """The key pass's score terms and the value pass's additions to given partials against the references:
    {name: relative error}. A slot that one side dropped or misplaced moves them by O(1)."""
    from kvcal.methods.kvquant import kernels as O  # noqa: N812

    if small:
        d, hkv, hq, lengths, tcap, nsplit, block_t = 64, 2, 8, [37, 0, 70], 80, 3, 16
    else:
        d, hkv, hq, lengths, tcap, nsplit, block_t = 128, 8, 32, [4097, 32763, 1500, 16001], 32768, 33, 16
    group, gp = hq // hkv, 1 << (hq // hkv - 1).bit_length()
    res = {}
    for name, bits, storage_kw in OUTLIER_PASS_CASES:
        storage_kw = dict(storage_kw)
        tables_only = not storage_kw.pop("inv_freq", True)  # the key pass reads the tables instead of computing angles
        storage = make_storage("kvquant", bits, hkv, d, device=device, **storage_kw)
        kv = build_packed(storage, lengths, hkv, d, tcap=tcap, device=device)
        inv_freq = None if tables_only else kv.inv_freq
        q = build_step(len(lengths), hq, hkv, d, 1, torch.bfloat16, device=device)[0]
        gen = torch.Generator(device=device).manual_seed(2)
        rows = len(lengths) * hkv
        scores = torch.randn(rows, tcap, gp, generator=gen, device=device) * 4
        ref, fast = scores.clone(), scores.clone()
        args = (q, kv["k_out_idx"], kv["k_out_val"], kv.lengths, kv.rope_cos, kv.rope_sin, kv.pos_offset)
        O.key_outlier_scores_ref(*args, ref, inv_freq)
        O.key_outlier_scores_triton(*args, fast, inv_freq)
        valid = torch.arange(tcap, device=device)[None, :] < kv.lengths.repeat_interleave(hkv)[:, None]
        moved = float((ref - scores)[valid][..., :group].norm() / scores[valid].norm())  # the terms are not all zero
        res[f"key_{name}"] = float((fast - ref)[valid][..., :group].norm() / (ref - scores)[valid].norm()) \
            if moved > 1e-3 else float("nan")
        # each split's max, as the decode kernel leaves it
        m_part = torch.zeros(rows, nsplit + 1, group, device=device)
        for b, n in enumerate(lengths):
            if n:
                share = split_share(n, nsplit, block_t)
                for s in range(nsplit):
                    seg = scores[b * hkv:(b + 1) * hkv, s * share:min(n, (s + 1) * share), :group]
                    if seg.numel():
                        m_part[b * hkv:(b + 1) * hkv, s] = seg.amax(1)
        sums = [torch.zeros(rows, nsplit + 1, d, gp, device=device) for _ in range(2)]
        slots = (kv["v_out_idx"], kv["v_out_val"], kv.lengths, nsplit, block_t)
        O.value_outlier_sums_ref(scores, m_part, *slots, sums[0])
        O.value_outlier_sums_triton(scores, m_part, *slots, sums[1])
        # int64 fixed-point sums (torch's deterministic mode: order-independent)
        fixed = torch.zeros(sums[0].shape, dtype=torch.int64, device=device)
        O.value_outlier_sums_triton(scores, m_part, *slots, fixed)
        fixed = fixed.double() * 2.0**-O.FIXED_BITS
        ref_sums, fast_sums, fixed_sums = (x[..., :group] for x in (*sums, fixed))  # columns >= G are padding
        for key, got in ((f"value_{name}", fast_sums), (f"value_fixed_{name}", fixed_sums)):
            res[key] = float((got - ref_sums).norm() / ref_sums.norm()) if ref_sums.norm() > 1e-3 else float("nan")
    return res


def run_quantize_checks(device="cpu", n=8, h=3, d=64, seed=0) -> dict:
    """Bit-exact comparisons of every quantize and pack kernel with its reference; returns {name: ok}."""
    from kvcal.quant import nonuniform as N  # noqa: N812
    from kvcal.quant import nonuniform_kernels as NK  # noqa: N812
    from kvcal.quant import packing as P  # noqa: N812
    from kvcal.quant import uniform as U  # noqa: N812
    from kvcal.quant import uniform_kernels as UK  # noqa: N812

    gen = torch.Generator(device=device).manual_seed(seed)
    res = {}
    for bits in (1, 2, 3, 4, 8):
        c = torch.randint(0, 1 << bits, (n, h, d), generator=gen, device=device)
        w = P.pack_codes(c, bits)
        res[f"pack{bits}"] = torch.equal(P.pack_codes_triton(c, bits), w)
        res[f"unpack{bits}"] = torch.equal(P.unpack_codes_triton(w, bits, d), c)
        res[f"unpack_mma{bits}"] = torch.equal(P.unpack_codes_mma_triton(w, bits, d), c)
        # at head_dim 128 unpack_mma reorders whole words (4 and 2 bits; see its comment): columns map back through
        # mma_channels, checked against the torch unpacking
        c128 = torch.randint(0, 1 << bits, (n, 128), generator=gen, device=device)
        res[f"unpack_mma{bits}_d128"] = torch.equal(P.unpack_codes_mma_triton(P.pack_codes(c128, bits), bits, 128), c128)
        if bits <= 4:  # lookup-table operands (nuq): table values in fp16, by warp shuffles on the GPU
            table = torch.randn(1 << bits, generator=gen, device=device) * 3
            for cc in (c, c128):
                ref = table.half().float()[cc]
                res[f"unpack_lut{bits}_d{cc.shape[-1]}"] = torch.equal(
                    P.unpack_lut_triton(P.pack_codes(cc, bits), bits, cc.shape[-1], table), ref)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):  # all that the cache may hold
        x = (torch.randn(n, h, d, generator=gen, device=device) * 3).to(dtype)
        x[0, 0, :8] = 0.0  # a constant group: scale 0
        for bits in (2, 3, 4):
            tag = f"{str(dtype)[6:]}_b{bits}"
            for group in (d, 32):
                a, b = U.quantize_per_token(x, bits, group), UK.quantize_per_token_triton(x, bits, group)
                res[f"per_token_{tag}_g{group}"] = all(torch.equal(u, v) for u, v in zip(a, b))
            for block in (n, max(2, n // 4)):  # one block, several at once (a prompt's keys)
                blocks = x[: n // block * block]
                a = U.quantize_per_channel(blocks, bits, block)
                b = UK.quantize_per_channel_triton(blocks, bits, block)
                res[f"per_channel_{tag}_block{block}"] = all(torch.equal(u, v) for u, v in zip(a, b))
            levels = torch.sort(torch.rand(1 << bits, generator=gen, device=device) * 2 - 1).values
            c = h * d
            lo = torch.randn(c, generator=gen, device=device) * 0.5 - 1.5
            hi = lo + 3 + torch.rand(c, generator=gen, device=device)
            a = N.quantize_lut_static(x, lo, hi, levels, levels + 0.01, bits, 5)
            b = NK.quantize_lut_static_triton(x, lo, hi, levels, levels + 0.01, bits, 5)
            res[f"lut_static_{tag}"] = torch.equal(a[0], b[0]) and _same_outliers(x, a[1], a[2], b[1], b[2])
            for per_head in (False, True):
                a = N.quantize_lut_dynamic(x, levels, levels * 0.9, bits, 2, per_head)
                b = NK.quantize_lut_dynamic_triton(x, levels, levels * 0.9, bits, 2, per_head)
                res[f"lut_dynamic_{tag}{'_per_head' if per_head else ''}"] = all(
                    torch.equal(u, v) for u, v in zip(a[:3], b[:3])) and _same_outliers(x, a[3], a[4], b[3], b[4])
        for bits in (2, 4):
            res.update(_into_checks(x, bits, gen, f"{str(dtype)[6:]}_b{bits}"))
        res.update(_one_bit_checks(x, gen, f"{str(dtype)[6:]}_b1"))
        res.update(_skvq_write_checks(x, gen, str(dtype)[6:]))
    res.update(_commvq_write_checks(gen, device))
    return res


def _one_bit_checks(x, gen, tag: str) -> dict:
    """The uniform formats at 1 bit (rtn-1, kivi-1): per token over a head and over groups of 32 channels (a group of
    zeros: scale 0), per channel over blocks of tokens, and the per-token write into a cache's rows and slots (buffers
    start random, rows out of order, slots scattered)."""
    from kvcal.quant import uniform as U  # noqa: N812
    from kvcal.quant import uniform_kernels as UK  # noqa: N812
    from kvcal.quant.packing import words_per_vector

    n, h, d = x.shape
    dev = x.device
    x = x.clone()
    x[1, 0, :32] = 0.0
    res = {}
    for group in (d, 32):
        a, b = U.quantize_per_token(x, 1, group), UK.quantize_per_token_triton(x, 1, group)
        res[f"per_token_{tag}_g{group}"] = all(torch.equal(u, v) for u, v in zip(a, b))
    for block in (n, max(2, n // 4)):
        blocks = x[: n // block * block]
        a, b = U.quantize_per_channel(blocks, 1, block), UK.quantize_per_channel_triton(blocks, 1, block)
        res[f"per_channel_{tag}_block{block}"] = all(torch.equal(u, v) for u, v in zip(a, b))
    rows_n, tcap = 3, n + 4
    rows = torch.arange(n, device=dev) % rows_n
    slots = (torch.arange(n, device=dev) * 5 + 1) % tcap
    codes = torch.randint(-(2**31), 2**31 - 1, (rows_n, h, tcap, words_per_vector(d, 1)), generator=gen, device=dev,
                          dtype=torch.int64).to(torch.int32)
    scale, zero = (torch.randn(rows_n, h, tcap, d // 32, generator=gen, device=dev).half() for _ in range(2))
    ref, fast = (codes, scale, zero), tuple(t.clone() for t in (codes, scale, zero))
    U.quantize_per_token_into(x, 1, 32, *ref, rows, slots)
    UK.quantize_per_token_into_triton(x, 1, 32, *fast, rows, slots)
    res[f"per_token_into_{tag}"] = all(torch.equal(u, v) for u, v in zip(ref, fast))
    return res


def _commvq_write_checks(gen, device, n: int = 9) -> dict:
    """CommVQ's write_triton (the nearest-code key kernel, the value encoder's torch ops) against write_reference:
    every buffer bit-exact, tokens scattered over rows and slots, for float32 and float64 keys (random keys: no
    near-ties of distances), 3-bit index fields (8 codes) and 4-bit ones (12 codes, groups of 8 pairs)."""
    from kvcal.runtime.storage import Packed

    res = {}
    for name, bits, kw in (("c8", 2, {}), ("c12_g8", 1, {"codes": 12, "group_pairs": 8, "stages": 2})):
        storage = make_storage("commvq", bits, 2, 64, device=device, **kw).to(device)
        for dtype in (torch.float32, torch.float64):
            keys = _keys(gen, n, 2, 64, device).to(dtype)
            values = torch.randn(n, 2, 64, generator=gen, device=device).to(dtype)
            rows = torch.arange(n, device=device) % 3
            slots = (torch.arange(n, device=device) * 5 + 1) % (n + 4)
            made = []
            for kernel in (False, True):
                buffers = {k: torch.full(spec.shape, 7, dtype=spec.dtype, device=device)
                           for k, spec in storage.buffers(3, n + 4, 2, 64).items()}
                packed = Packed(buffers, torch.zeros(3, dtype=torch.int32, device=device), 2, 64, n + 4)
                storage.write(packed, keys, values, rows, slots, kernel)
                made.append(buffers)
            res[f"commvq_write_{name}_{str(dtype)[6:]}"] = all(torch.equal(made[0][k], made[1][k]) for k in made[0])
    return res


SKVQ_WRITES = [  # (key bits, storage kwargs)
    (2, {"v_bits": 1.5}),  # base-3 ternary values, fp16 parameters
    (4, {"v_bits": 3.0, "param_dtype": "fp8", "groups": 3}),
    (1.5, {"v_bits": 8.0, "ternary_storage": "2bit", "groups": 7}),
]


def _skvq_write_checks(x, gen, tag: str) -> dict:
    """SKVQ's write kernel leaves its buffers as its torch reference does, bit for bit (rows out of order, slots
    scattered; buffers start random)."""
    n, h, d = x.shape
    dev = x.device
    rows_n, tcap = 3, n + 4
    rows = torch.arange(n, device=dev) % rows_n
    slots = (torch.arange(n, device=dev) * 5 + 1) % tcap
    res = {}
    for bits, kw in SKVQ_WRITES + [(2, {"param_dtype": "fp8", "small": True})]:
        kw = dict(kw)
        scaled = x * 0.003 if kw.pop("small", False) else x  # fp8 parameters in e4m3's subnormal range
        storage = make_storage("skvq", bits, h, d, device=dev, **kw).to(dev)
        specs = storage.buffers(rows_n, tcap, h, d)
        ref = {}
        for name, spec in specs.items():
            t = torch.randint(0, 120, spec.shape, generator=gen, device=dev, dtype=torch.int64)
            ref[name] = t.to(torch.uint8).view(spec.dtype) if spec.dtype == torch.float8_e4m3fn else t.to(spec.dtype)
        fast = {k: v.clone() for k, v in ref.items()}
        lengths = torch.zeros(rows_n, dtype=torch.int32, device=dev)
        values = torch.randn(n, h, d, generator=gen, device=dev).to(x.dtype)
        storage.write_reference(Packed(ref, lengths, h, d, tcap), scaled, values, rows, slots)
        storage.write_triton(Packed(fast, lengths, h, d, tcap), scaled, values, rows, slots)
        same = all(torch.equal(ref[k].view(torch.uint8) if ref[k].dtype == torch.float8_e4m3fn else ref[k],
                               fast[k].view(torch.uint8) if fast[k].dtype == torch.float8_e4m3fn else fast[k])
                   for k in ref)
        small = "_small" if scaled is not x else ""
        res[f"skvq_write_{tag}_k{bits:g}_{'_'.join(f'{k}{v}' for k, v in kw.items())}{small}"] = same
    return res


def _into_checks(x, bits: int, gen, tag: str) -> dict:
    """The *_into kernels write each token into its (row, slot) of cache-layout buffers exactly as the reference
    does, and touch nothing else (buffers start random). Token n goes to row rows[n], slot slots[n]: rows out of
    order, slots scattered (one decode step passes the cache's lengths as slots)."""
    from kvcal.quant import nonuniform as N  # noqa: N812
    from kvcal.quant import nonuniform_kernels as NK  # noqa: N812
    from kvcal.quant import uniform as U  # noqa: N812
    from kvcal.quant import uniform_kernels as UK  # noqa: N812
    from kvcal.quant.packing import words_per_vector

    n, h, d = x.shape
    dev = x.device
    rows_n, tcap = 3, n + 4
    rows = torch.arange(n, device=dev) % rows_n
    slots = (torch.arange(n, device=dev) * 5 + 1) % tcap  # distinct (row, slot) pairs for n <= tcap
    w = words_per_vector(d, bits)
    levels = torch.sort(torch.rand(1 << bits, generator=gen, device=dev) * 2 - 1).values
    lo = torch.randn(h * d, generator=gen, device=dev) * 0.5 - 1.5
    hi = lo + 3 + torch.rand(h * d, generator=gen, device=dev)

    def buffers(specs):
        made = {}
        for name, (shape, dtype) in specs.items():
            if dtype == torch.int32:
                made[name] = torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, device=dev, dtype=torch.int64).to(dtype)
            elif dtype == torch.int16:
                made[name] = torch.randint(-1, h * d, shape, generator=gen, device=dev).to(dtype)
            else:
                made[name] = torch.randn(shape, generator=gen, device=dev).to(dtype)
        return made, {k: v.clone() for k, v in made.items()}

    def same(a, b, outliers=()):
        plain = all(torch.equal(a[k], b[k]) for k in a if k not in outliers)
        if not outliers:
            return plain
        ia, va, ib, vb = (t[rows, slots] for t in (a[outliers[0]], a[outliers[1]], b[outliers[0]], b[outliers[1]]))
        untouched = [torch.ones_like(a[k], dtype=torch.bool) for k in outliers]
        for m in untouched:
            m[rows, slots] = False
        rest = all(torch.equal(a[k][m], b[k][m]) for k, m in zip(outliers, untouched))
        return plain and rest and _same_outliers(x, ia, va, ib, vb)

    res = {}
    codes = ((rows_n, h, tcap, w), torch.int32)
    ref, fast = buffers({"codes": codes, "scale": ((rows_n, h, tcap, 2), torch.float16),
                         "zero": ((rows_n, h, tcap, 2), torch.float16)})
    U.quantize_per_token_into(x, bits, d // 2, *ref.values(), rows, slots)
    UK.quantize_per_token_into_triton(x, bits, d // 2, *fast.values(), rows, slots)
    res[f"per_token_into_{tag}"] = same(ref, fast)
    one_row = torch.ones(1, dtype=torch.int64, device=dev).expand(n)  # stride 0, as a prompt's row index
    ref, fast = buffers({"codes": codes, "scale": ((rows_n, h, tcap, 1), torch.float16),
                         "zero": ((rows_n, h, tcap, 1), torch.float16)})
    U.quantize_per_token_into(x, bits, d, *ref.values(), one_row, torch.arange(n, device=dev))
    UK.quantize_per_token_into_triton(x, bits, d, *fast.values(), one_row, torch.arange(n, device=dev))
    res[f"per_token_into_one_row_{tag}"] = same(ref, fast)
    ref, fast = buffers({"codes": codes, "idx": ((rows_n, tcap, h, 3), torch.int16),
                         "val": ((rows_n, tcap, h, 3), torch.float16)})
    N.quantize_lut_static_into(x, lo, hi, levels, levels + 0.01, bits, 3, *ref.values(), rows, slots)
    NK.quantize_lut_static_into_triton(x, lo, hi, levels, levels + 0.01, bits, 3, *fast.values(), rows, slots)
    res[f"lut_static_into_{tag}"] = same(ref, fast, ("idx", "val"))
    for per_head in (False, True):
        heads = (h,) if per_head else ()
        scale = ((rows_n, *heads, tcap), torch.float16)
        slots_shape = (rows_n, tcap, *heads, 4)
        ref, fast = buffers({"codes": codes, "scale": scale, "zero": scale, "idx": (slots_shape, torch.int16),
                             "val": (slots_shape, torch.float16)})
        N.quantize_lut_dynamic_into(x, levels, levels * 0.9, bits, 2, per_head, *ref.values(), rows, slots)
        NK.quantize_lut_dynamic_into_triton(x, levels, levels * 0.9, bits, 2, per_head, *fast.values(), rows, slots)
        res[f"lut_dynamic_into_{tag}{'_per_head' if per_head else ''}"] = same(ref, fast, ("idx", "val"))
    return res


def _same_outliers(x, ia, va, ib, vb) -> bool:
    """Equal outlier lists up to the order of slots and ties: each kept slot is compared by the input value
    at its channel and its residual, so two channels holding equal values may trade places (torch.topk
    and the kernel break ties differently; with bf16/fp16 inputs ties are common)."""
    if ia is None or ib is None:
        return ia is None and ib is None
    rows = x.reshape(x.shape[0], -1).float()
    ia, va, ib, vb = (t.flatten(1) for t in (ia, va, ib, vb))  # key slots [N, H, cap]: compare per token

    def canon(i, v):
        xv = torch.where(i >= 0, rows.gather(1, i.long().clamp_min(0)), torch.full_like(v, -1e30, dtype=torch.float32))
        v = v.float()
        order = torch.sort(v, dim=-1, stable=True).indices
        xv, v = xv.gather(1, order), v.gather(1, order)
        order = torch.sort(xv, dim=-1, stable=True).indices
        return xv.gather(1, order), v.gather(1, order)

    (xa, ra), (xb, rb) = canon(ia, va), canon(ib, vb)
    return torch.equal(xa, xb) and torch.equal(ra, rb)


# ---- the real cache through the Triton kernels (interpreter): KvcalCache's buffers, the storages' write kernels and
# decode attention, against the same model decoding with the torch references

def cache_codecs() -> list[tuple[str, str, dict]]:
    """(name, method, config) of every registered method with a packed storage, at its test_config (the registry
    drives these checks, as it drives tests/test_contract.py), then the further settings each method's cases module
    lists in CACHE_CONFIGS."""
    from kvcal.methods.registry import all_methods

    cases = [(name, name, dict(cls.test_config)) for name, cls in sorted(all_methods().items()) if name != "fp16"]
    for method, module in method_cases().items():
        cases += [(name, method, config) for name, config in getattr(module, "CACHE_CONFIGS", [])]
    return cases


def _cache_model(dtype):
    """One layer, 4 query heads over 2 KV heads of 64 channels (the kernels' smallest head_dim), random weights."""
    from kvcal.models import as_loaded
    from kvcal.models.tiny import build_random_model, tiny_config

    config = tiny_config("llama")
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads = 256, 4, 2
    config.head_dim, config.num_hidden_layers = 64, 1
    return as_loaded(build_random_model(config, dtype, "cpu"))


def _decode_logits(loaded, codec, ids, prompt: int, kernels: bool):
    """Logits of the decode steps after a prompt of `prompt` tokens, every storage op through its Triton kernel
    (kernels=True, forced on the CPU) or its torch reference."""
    from kvcal.runtime.cache import KvcalCache

    cache = KvcalCache(codec, loaded.dims.num_layers, kernels=kernels)
    with torch.inference_mode():
        forward_with_cache(loaded.model, ids[:, :prompt], cache)
        steps = [forward_with_cache(loaded.model, ids[:, t : t + 1], cache).logits for t in range(prompt, ids.shape[1])]
    return torch.cat(steps, 1).double()


def _codec(loaded, method, calibration: torch.Tensor):
    """The method's storages for `loaded`: calibrated on `calibration` (captured activations) when it learns, from
    the weights alone when it needs an artifact but learns nothing from activations (XQuant's SVD factors)."""
    from kvcal.calib.capture import capture

    tensors = {}
    if method.learns:
        with capture(loaded, calibration, method.capture_needs()) as store:
            tensors = method.calibrate(loaded, store)[0]
    elif method.needs_artifact():
        tensors = method.calibrate(loaded, None)[0]
    return method.build_storages(tensors, loaded.dims)


def run_cache_checks(dtype=torch.float16) -> dict:
    """Largest relative error of a decode step's logits (per row and step) through the Triton kernels against the
    torch references, per codec: batch 2, a 30-token prompt, 10 decode steps."""
    from kvcal.methods import build_method

    loaded = _cache_model(dtype)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    calibration = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, method_name, config in cache_codecs():
        codec = _codec(loaded, build_method(method_name, config), calibration)
        if codec.kernel_refusal():
            out[name] = None  # no Triton kernels (a reconstruction storage): nothing to run through kernels
            continue
        ref = _decode_logits(loaded, codec, ids, 30, kernels=False)
        fast = _decode_logits(loaded, codec, ids, 30, kernels=True)
        out[name] = float(((fast - ref).norm(dim=-1) / ref.norm(dim=-1)).max())
    return out


# methods whose decode kernels the soft-capped cache check runs (Gemma 2; every other method's kernels meet the cap in
# their *_softcap_* attention cases), and the cap: small enough for the random model's scores to reach the tanh's
# curved part
SOFTCAP_CACHE_METHODS = ("commvq", "xquant")
SOFTCAP_CACHE_CAP = 1.0


def _gemma2_cache_model(softcap: float):
    """Gemma 2 with a sliding-window layer (window 8) then a global one, 4 query heads over 2 KV heads of 64 channels
    (the kernels' smallest head_dim), score soft-cap `softcap`, random float32 weights."""
    from kvcal.models import as_loaded
    from kvcal.models.loaded import mask_implementation
    from kvcal.models.tiny import build_random_model, tiny_config

    config = tiny_config("gemma2")
    config.hidden_size, config.head_dim, config.query_pre_attn_scalar = 256, 64, 64
    config.attn_logit_softcapping = softcap
    model = build_random_model(config, torch.float32, "cpu", attn_implementation=mask_implementation("gemma2"))
    return as_loaded(model)


def run_softcap_cache_checks() -> dict:
    """{method: (error, moved)}: a float32 Gemma 2 (_gemma2_cache_model) decoding through KvcalCache at the method's
    test_config, every op of its global layer on the Triton kernels, against the torch references (largest relative
    error of a step's logits per row and step: batch 2, a 30-token prompt, 10 decode steps), and how far the
    references' logits move when the model's scores are not capped (the cap's effect, which the error must stay far
    below)."""
    import dataclasses

    from kvcal.methods import build_method
    from kvcal.methods.registry import all_methods

    loaded = _gemma2_cache_model(SOFTCAP_CACHE_CAP)
    dims = loaded.dims
    assert dims.attn_softcap == SOFTCAP_CACHE_CAP and dims.hybrid
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    calibration = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(0))

    def relative(a, b):
        return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())

    out = {}
    for name in SOFTCAP_CACHE_METHODS:
        codec = _codec(loaded, build_method(name, dict(all_methods()[name].test_config)), calibration)
        ref = _decode_logits(loaded, codec, ids, 30, kernels=False)
        fast = _decode_logits(loaded, codec, ids, 30, kernels=True)
        loaded.adapter.dims = dataclasses.replace(dims, attn_softcap=None)  # the same model, its scores not capped
        try:
            plain = _decode_logits(loaded, codec, ids, 30, kernels=False)
        finally:
            loaded.adapter.dims = dims
        out[name] = (relative(fast, ref), relative(plain, ref))
    return out


# methods whose kernels take a compressed sliding window's first slot (Packed.first): the split-K skeleton's and
# CommVQ's (its value-mass pass)
WINDOW_CACHE_METHODS = ("commvq", "kivi", "kvquant", "rtn", "skvq")


def run_window_cache_checks(dtype=torch.float32) -> dict:
    """{method: relative error}: --compress-local on a Gemma 3 of two sliding-window layers (window 8) and a global
    one, 4 query heads over 2 KV heads of 64 channels, float32 (fp16 rounding through three layers of this random model
    reaches 4e-2 and would hide a kernel that sees one token too many), strict (no full-precision window), decoding
    through KvcalCache with every op on the Triton kernels against the torch references (largest relative error of a step's logits per
    row and step: batch 2, a 30-token prompt, 10 decode steps; the local layers drop and mask what leaves the window,
    KIVI in blocks whose first slots the kernel masks)."""
    from kvcal.methods import build_method
    from kvcal.methods.registry import all_methods
    from kvcal.models import as_loaded
    from kvcal.models.loaded import mask_implementation
    from kvcal.models.tiny import build_random_model, tiny_config

    config = tiny_config("gemma3")
    config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads = 256, 64, 4, 2
    config.query_pre_attn_scalar = 64
    loaded = as_loaded(build_random_model(config, dtype, "cpu", attn_implementation=mask_implementation("gemma3")))
    assert loaded.dims.hybrid and loaded.dims.sliding_window < 30
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    calibration = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(0))
    out = {}
    for name in WINDOW_CACHE_METHODS:
        codec = _codec(loaded, build_method(name, dict(all_methods()[name].test_config)).with_fp_window(0),
                       calibration)
        codec.compress_local = True
        ref = _decode_logits(loaded, codec, ids, 30, kernels=False)
        fast = _decode_logits(loaded, codec, ids, 30, kernels=True)
        out[name] = float(((fast - ref).norm(dim=-1) / ref.norm(dim=-1)).max())
    return out


def run_training_code_checks(device="cpu", shape=(2, 9, 20)) -> dict:
    """CommVQ's fused training-code kernels (kvcal/methods/commvq/training_codes.py) against their torch reference,
    logits [L, M, groups, 4] (the L layers share the draws; (2, 9, 20): two programs of 256 groups, the draws' rows
    wrapping inside one), float32 and bf16 logits, tau 1 and 0.5: the fraction of groups whose argmax differs (exp
    and log may round differently on a GPU: a near-tie can flip), the bits' largest difference elsewhere, and the
    logits' gradient's largest difference relative to its largest entry."""
    from kvcal.methods.commvq.training_codes import gumbel_bits_reference, gumbel_bits_triton

    gen = torch.Generator(device=device).manual_seed(3)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for tau in (1.0, 0.5):
            logits = (torch.randn(*shape, 4, generator=gen, device=device) * 2).to(dtype)
            u = torch.rand(*shape[1:], 4, generator=gen, device=device)
            weight = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen, device=device)
            made = []
            for fn in (gumbel_bits_reference, gumbel_bits_triton):
                x = logits.clone().requires_grad_(True)
                bits = fn(x, u, tau)
                (bits * weight).sum().backward()
                made.append((bits.detach().view(*shape, 2), x.grad.float()))
            (ref, ref_grad), (fast, fast_grad) = made
            same = (ref.round() == fast.round()).all(-1)  # the groups whose category agrees
            tag = f"{str(dtype)[6:]}_tau{tau:g}"
            out[f"{tag}_argmax_differs"] = float(1 - same.float().mean())
            out[f"{tag}_bits"] = float((ref - fast).abs()[same].max())
            rows = same.unsqueeze(-1).expand_as(ref_grad)
            out[f"{tag}_grad"] = float((ref_grad - fast_grad).abs()[rows].max() / ref_grad.abs().max())
    return out


def main():  # pragma: no cover - run in a subprocess by tests/test_kernels.py
    import json
    import sys
    import time

    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    out = {}
    t0 = time.time()
    if which in ("all", "quantize"):
        out["quantize"] = run_quantize_checks()
    if which in ("all", "attention"):
        out["attention"] = {case[0]: run_attention_case(case) for case in ATTENTION_CASES}
    if which in ("all", "outliers"):
        out["outliers"] = run_outlier_pass_checks()
    if which in ("all", "training"):
        out["training"] = run_training_code_checks()
    if which in ("all", "cache"):
        out["cache"] = run_cache_checks()
        out["cache_softcap"] = run_softcap_cache_checks()
        out["cache_window"] = run_window_cache_checks()
    out["seconds"] = time.time() - t0
    print("KERNEL_CHECKS " + json.dumps(out))


if __name__ == "__main__":
    main()
