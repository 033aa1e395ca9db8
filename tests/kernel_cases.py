"""Random packed caches built with the reference quantizers, and the kernel checks on them: tests/test_kernels.py runs
them under the Triton interpreter (CPU, small shapes) and, marked gpu, natively at Llama-3.1-8B shapes."""

from __future__ import annotations

import dataclasses
import warnings

import torch

from kvcal.models.adapter import forward_with_cache
from kvcal.quant.rope import RopeSpec, rope_cos_sin
from kvcal.runtime import quantize as Q  # noqa: N812
from kvcal.runtime.attention import PackedKV
from kvcal.runtime.packing import words_per_vector
from kvcal.runtime.splits import split_share


def _keys(gen, n, h, d, device):
    x = torch.randn(n, h, d, generator=gen, device=device)
    x[..., : d // 16] *= 4.0  # a few large channels, as real keys have
    return x


def build_cache(codec: str, bits: int, lengths, hkv: int, d: int, *, tcap: int | None = None, group: int | None = None,
                key_block: int = 32, kcap: int = 0, per_side: int = 0, pre_rope: bool = False, pos_offset: int = 0,
                value_per_head: bool = False, poison: bool = False, misaligned_scales: bool = False, seed: int = 0,
                device="cpu") -> PackedKV:
    """codec: 'int' (affine_channels keys and values, `group` channels per scale, default d), 'kivi'
    (affine_tokens keys in blocks of key_block tokens, affine_channels values in groups of 32 or `group`),
    'nuq' (lut_static keys with kcap outlier slots per token and head, lut_dynamic values with per_side outliers per side, per token
    or, with value_per_head, per token and head).
    pre_rope: keys stored before RoPE (rotated at attention time from float32 cos/sin tables).
    poison ('int'): the scale and zero rows past each row's length hold inf and nan, its code rows random words (a
    kernel that reads them must not let them reach the output).
    misaligned_scales ('int'): the same scales and zeros in buffers whose rows start one fp16 past an 8-byte boundary
    (the fragment kernel then loads them one token at a time, not as 8-byte vectors)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    batch = len(lengths)
    tcap = tcap or max(max(lengths), 1)
    c = hkv * d
    kw = vw = words_per_vector(d, bits)
    kc = torch.zeros(batch, hkv, tcap, kw, dtype=torch.int32, device=device)
    vc = torch.zeros(batch, hkv, tcap, vw, dtype=torch.int32, device=device)
    spec = dict(head_dim=d, lengths=torch.tensor(lengths, dtype=torch.int32, device=device), key_bits=bits,
                value_bits=bits, k_codes=kc, v_codes=vc, pos_offset=pos_offset)
    if codec == "int":
        kg = vg = d // (group or d)
        spec.update(key_format="affine_channels", value_format="affine_channels")
        ks = torch.zeros(batch, hkv, tcap, kg, dtype=torch.float16, device=device)
    elif codec == "kivi":
        vg = d // (group or 32)
        spec.update(key_format="affine_tokens", value_format="affine_channels", key_block=key_block)
        ks = torch.zeros(batch, hkv, -(-tcap // key_block), d, dtype=torch.float16, device=device)
    else:
        spec.update(key_format="lut_static", value_format="lut_dynamic")
        levels = 1 << bits
        enc = torch.sort(torch.rand(levels, generator=gen, device=device) * 2 - 1).values
        enc[0], enc[-1] = -1.0, 1.0
        venc = torch.sort(torch.rand(levels, generator=gen, device=device) * 2 - 1).values
        spec.update(k_table=enc + 0.01, v_table=venc.clone())
        sample = _keys(gen, 256, hkv, d, device).reshape(256, c)
        lo, hi = sample.quantile(0.01, dim=0), sample.quantile(0.99, dim=0)
        spec.update(k_zero=(hi + lo) / 2, k_scale=(hi - lo) / 2)
        ks = None
    kz = None if ks is None else torch.zeros_like(ks)
    if codec != "nuq":
        spec.update(k_scale=ks, k_zero=kz)
        vs = torch.zeros(batch, hkv, tcap, vg, dtype=torch.float16, device=device)
    else:
        vs = torch.zeros(batch, *((hkv,) if value_per_head else ()), tcap, dtype=torch.float16, device=device)
    vz = torch.zeros_like(vs)
    spec.update(v_scale=vs, v_zero=vz)
    if codec == "nuq" and kcap:
        spec.update(k_out_idx=torch.full((batch, tcap, hkv, kcap), -1, dtype=torch.int16, device=device),
                    k_out_val=torch.zeros(batch, tcap, hkv, kcap, dtype=torch.float16, device=device))
    if codec == "nuq" and per_side:
        slots = (batch, tcap, *((hkv,) if value_per_head else ()), 2 * per_side)
        spec.update(v_out_idx=torch.full(slots, -1, dtype=torch.int16, device=device),
                    v_out_val=torch.zeros(slots, dtype=torch.float16, device=device))
    if pre_rope:
        rope = RopeSpec(head_dim=d, theta=500000.0, rope_type="llama3", factor=8.0)
        positions = torch.arange(pos_offset + tcap + 8, device=device)[None]
        cos, sin = rope_cos_sin(rope.inv_freq(device), positions, torch.float32)
        spec.update(rope_cos=cos[0], rope_sin=sin[0], rope_inv_freq=rope.inv_freq(device))
    kv = PackedKV(**spec)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        xk = _keys(gen, n, hkv, d, device)
        xv = torch.randn(n, hkv, d, generator=gen, device=device)
        if codec == "int":
            codes, s, z = Q.quantize_affine_channels(xk, bits, d // kg)
            kc[b, :, :n], ks[b, :, :n], kz[b, :, :n] = codes.transpose(0, 1), s.transpose(0, 1), z.transpose(0, 1)
        elif codec == "kivi":
            for i, t0 in enumerate(range(0, n, key_block)):
                codes, s, z = Q.quantize_affine_tokens(xk[t0 : t0 + key_block], bits)
                kc[b, :, t0 : t0 + codes.shape[0]] = codes.transpose(0, 1)
                ks[b, :, i], kz[b, :, i] = s, z
        else:
            lo, hi = kv.k_zero - kv.k_scale, kv.k_zero + kv.k_scale
            codes, idx, val = Q.quantize_lut_static(xk, lo, hi, enc, kv.k_table, bits, kcap)
            kc[b, :, :n] = codes.transpose(0, 1)
            if kcap:
                kv.k_out_idx[b, :n], kv.k_out_val[b, :n] = idx, val
        if codec == "nuq":
            codes, s, z, idx, val = Q.quantize_lut_dynamic(xv, venc, kv.v_table, bits, per_side, value_per_head)
            vc[b, :, :n] = codes.transpose(0, 1)
            if value_per_head:
                vs[b, :, :n], vz[b, :, :n] = s.transpose(0, 1), z.transpose(0, 1)
            else:
                vs[b, :n], vz[b, :n] = s, z
            if per_side:
                kv.v_out_idx[b, :n], kv.v_out_val[b, :n] = idx, val
        else:
            codes, s, z = Q.quantize_affine_channels(xv, bits, d // vg)
            vc[b, :, :n], vs[b, :, :n], vz[b, :, :n] = codes.transpose(0, 1), s.transpose(0, 1), z.transpose(0, 1)
    if poison:
        for b, n in enumerate(lengths):
            ks[b, :, n:], kz[b, :, n:], vs[b, :, n:], vz[b, :, n:] = float("inf"), float("nan"), float("-inf"), float("nan")
            for codes in (kc, vc):
                codes[b, :, n:] = torch.randint(-2**31, 2**31 - 1, codes[b, :, n:].shape, generator=gen, device=device,
                                                dtype=torch.int64).to(torch.int32)
    if misaligned_scales:
        def shifted(t):
            buf = torch.empty(*t.shape[:-2], t.shape[-2] + 1, t.shape[-1], dtype=t.dtype, device=device)[..., 1:, :]
            return buf.copy_(t)

        kv = dataclasses.replace(kv, k_scale=shifted(ks), k_zero=shifted(kz), v_scale=shifted(vs), v_zero=shifted(vz))
    return kv


def build_step(batch: int, hq: int, hkv: int, d: int, nfp: int, dtype, *, seed: int = 1, device="cpu", qscale=1.0):
    """Query and full-precision segment for one decode step (some fp slots invalid)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = (torch.randn(batch, hq, d, generator=gen, device=device) * qscale).to(dtype)
    fp_k = torch.randn(batch, hkv, nfp, d, generator=gen, device=device).to(dtype)
    fp_v = torch.randn(batch, hkv, nfp, d, generator=gen, device=device).to(dtype)
    valid = torch.rand(batch, nfp, generator=gen, device=device) > 0.3
    return q, fp_k, fp_v, valid


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
TOL_GPU = {**TOL, torch.float16: 4e-3, torch.float32: 2e-5}

# (name, codec, bits, dtype, cache kwargs, kernel kwargs, step kwargs)
ATTENTION_CASES = [
    ("int4_bf16", "int", 4, torch.bfloat16, {}, {}, {}),
    # attention_frag's register-fragment kernel (rtn layout: one scale per token and head), asked for explicitly
    # (its default needs 64 (row, KV head) pairs): head_dim 64 and 128, GQA groups of 4 and 3, with the fp segment
    ("int4_frag_bf16", "int", 4, torch.bfloat16, {}, {"frag": True}, {}),
    # 45 full-precision tokens: three programs of the fp launch (FRAG_FP_CHUNK 16 tokens each), the last partial
    ("int2_frag_d128_fp16", "int", 2, torch.float16, {}, {"frag": True}, {"d": 128, "nfp": 45}),
    ("int4_frag_d128_g3_fp16", "int", 4, torch.float16, {}, {"frag": True}, {"d": 128, "hq": 6}),
    # buffers of whole 32-token tiles (the kernel then clamps tiles, not rows), one row filling them: its last tile
    # is read from the clamped tile start (where the look-ahead past the end is clamped too; an out-of-bounds read
    # would only show as a fault on a GPU). Per-token scales are then loaded without masks: the rows past a length
    # hold inf and nan here, which must not reach the output (0 x inf); rows of whole tiles only (64) and one token
    ("int4_frag_whole_tiles_bf16", "int", 4, torch.bfloat16, {"poison": True}, {"frag": True},
     {"tcap": 96, "lengths": [96, 0, 70]}),
    ("int2_frag_whole_tiles_d128_fp16", "int", 2, torch.float16, {"poison": True}, {"frag": True},
     {"d": 128, "tcap": 96, "lengths": [33, 1, 64]}),
    # the same with scale rows off the 8-byte alignment: the scales come as one 2-byte load per token (SCALE_WORDS 0)
    ("int4_frag_whole_tiles_misaligned_scales_fp16", "int", 4, torch.float16, {"poison": True, "misaligned_scales": True},
     {"frag": True}, {"tcap": 96, "lengths": [96, 0, 70]}),
    # a row of one token (one tile, nearly all masked) and a row filling the whole buffer (tcap 80: its last tile
    # runs past the buffer's end and must be masked, not read)
    ("int4_len1_full_bf16", "int", 4, torch.bfloat16, {}, {}, {"lengths": [1, 80, 33]}),
    ("nuq4_len1_full_outliers_fp16", "nuq", 4, torch.float16, {"kcap": 3, "per_side": 2, "pre_rope": True}, {},
     {"lengths": [1, 80, 33]}),
    ("int3_g32_fp16", "int", 3, torch.float16, {"group": 32}, {}, {}),
    ("int2_bf16", "int", 2, torch.bfloat16, {}, {}, {}),
    ("int4_g16_generic_fp16", "int", 4, torch.float16, {"group": 16}, {"generic_keys": True}, {}),
    ("int4_prerope_bf16", "int", 4, torch.bfloat16, {"pre_rope": True, "pos_offset": 5}, {}, {}),
    ("kivi4_b16_bf16", "kivi", 4, torch.bfloat16, {"key_block": 16}, {}, {}),
    ("kivi3_block_t64_fp16", "kivi", 3, torch.float16, {}, {"block_t": 64}, {}),  # runs 32-token tiles
    ("kivi2_b24_generic_bf16", "kivi", 2, torch.bfloat16, {"key_block": 24}, {}, {}),
    ("nuq4_prerope_outliers_bf16", "nuq", 4, torch.bfloat16, {"kcap": 3, "per_side": 2, "pre_rope": True,
                                                              "pos_offset": 3}, {}, {}),
    ("nuq3_prerope_table_fp16", "nuq", 3, torch.float16, {"kcap": 9, "per_side": 1, "pre_rope": True}, {"rope_mode": "table"}, {}),
    ("nuq2_plain_bf16", "nuq", 2, torch.bfloat16, {"kcap": 1, "per_side": 1}, {}, {}),
    # 12 value-outlier slots per token
    ("nuq2_value_slots12_fp16", "nuq", 2, torch.float16, {"kcap": 3, "per_side": 6, "pre_rope": True}, {}, {}),
    ("nuq4_vhead_prerope_fp16", "nuq", 4, torch.float16, {"kcap": 2, "per_side": 1, "pre_rope": True,
                                                         "value_per_head": True}, {}, {}),
    # key outliers only (the value pass does not run), and tiles loaded in their own iteration (lut_ahead off)
    ("nuq3_key_outliers_fp16", "nuq", 3, torch.float16, {"kcap": 3, "pre_rope": True, "pos_offset": 2}, {}, {}),
    ("nuq4_not_ahead_outliers_bf16", "nuq", 4, torch.bfloat16, {"kcap": 3, "per_side": 2, "pre_rope": True},
     {"lut_ahead": False}, {}),
    # the float32 generic path, which lut_mma replaced for fp16/bf16 lookup-table caches (still used for float32,
    # rope_mode="table" and codes of more than 4 bits)
    ("nuq4_prerope_generic_fp16", "nuq", 4, torch.float16, {"kcap": 3, "per_side": 2, "pre_rope": True},
     {"lut_mma": False}, {}),
    # head_dim 128 on the small shapes: the code-word order of packing.unpack_mma (chosen against shared-memory
    # bank conflicts) only differs from the natural order there (at 64 the natural order is already conflict-free)
    ("int4_d128_bf16", "int", 4, torch.bfloat16, {}, {}, {"d": 128}),
    ("int2_d128_fp16", "int", 2, torch.float16, {}, {}, {"d": 128}),
    ("kivi4_d128_bf16", "kivi", 4, torch.bfloat16, {"key_block": 16}, {}, {"d": 128}),
    ("nuq4_d128_fp16", "nuq", 4, torch.float16, {"kcap": 3, "per_side": 2, "pre_rope": True}, {}, {"d": 128}),
    ("int4_mha_fp16", "int", 4, torch.float16, {}, {}, {"hq": 2}),
    ("int4_g8_bf16", "int", 4, torch.bfloat16, {}, {}, {"hq": 16}),
    ("int4_no_fp_segment_bf16", "int", 4, torch.bfloat16, {}, {}, {"nfp": 0}),
    ("int4_many_splits_bf16", "int", 4, torch.bfloat16, {}, {"num_splits": 9, "block_t": 16}, {}),
    # more partials than the reduction merges per step (REDUCE_CHUNK, 256 by default, set to 32 here): two steps,
    # with the value pass's sums
    ("nuq4_splits40_outliers_fp16", "nuq", 4, torch.float16, {"kcap": 3, "per_side": 2, "pre_rope": True},
     {"num_splits": 40}, {"reduce_chunk": 32}),
    # torch's deterministic mode: the value pass sums in int64 fixed point
    ("nuq4_deterministic_outliers_fp16", "nuq", 4, torch.float16, {"kcap": 3, "per_side": 2, "pre_rope": True,
                                                                   "pos_offset": 3}, {}, {"deterministic": True}),
    ("nuq2_vhead_deterministic_bf16", "nuq", 2, torch.bfloat16, {"kcap": 2, "per_side": 1, "pre_rope": True,
                                                                 "value_per_head": True}, {}, {"deterministic": True}),
    ("fp_only_bf16", None, 4, torch.bfloat16, {}, {}, {}),
    ("int3_fp32", "int", 3, torch.float32, {}, {}, {}),
    ("kivi4_b16_fp32", "kivi", 4, torch.float32, {"key_block": 16}, {}, {}),
    ("nuq4_prerope_outliers_fp32", "nuq", 4, torch.float32, {"kcap": 3, "per_side": 2, "pre_rope": True,
                                                             "pos_offset": 3}, {}, {}),
    ("int3_fp64", "int", 3, torch.float64, {}, {}, {}),
    ("kivi4_b16_fp64", "kivi", 4, torch.float64, {"key_block": 16}, {}, {}),
    ("nuq4_prerope_outliers_fp64", "nuq", 4, torch.float64, {"kcap": 3, "per_side": 2, "pre_rope": True,
                                                             "pos_offset": 3}, {}, {}),
    ("nuq3_plain_fp64", "nuq", 3, torch.float64, {"kcap": 2, "per_side": 1}, {}, {}),
    ("nuq3_vhead_fp64", "nuq", 3, torch.float64, {"kcap": 2, "per_side": 1, "value_per_head": True}, {}, {}),
]


def run_attention_case(case, *, small=True, device="cpu"):
    """Kernel vs reference for one case; returns the relative error."""
    from kvcal.runtime.attention import decode_attention_ref, decode_attention_triton

    name, codec, bits, dtype, cache_kw, kernel_kw, step_kw = case
    if small:
        d, hkv, lengths, tcap, nfp = step_kw.get("d", 64), 2, step_kw.get("lengths", [37, 0, 70]), step_kw.get("tcap", 80), 19
        kernel_kw = {"num_splits": 2, "block_t": 16, **kernel_kw}
    else:  # Llama-3.1-8B attention shapes, odd lengths, batch 4
        d, hkv, lengths, tcap, nfp = 128, 8, [4097, 32763, 1500, 16001], 32768, 128
    hq = step_kw.get("hq", 4 * hkv if small else 32)
    if small and "hq" in step_kw:
        hq = step_kw["hq"] if step_kw["hq"] != 2 else hkv
    nfp = step_kw.get("nfp", nfp)
    kv = None if codec is None else build_cache(codec, bits, lengths, hkv, d, tcap=tcap, device=device, **cache_kw)
    q, fk, fv, valid = build_step(len(lengths), hq, hkv, d, nfp, dtype, device=device)
    scale = d**-0.5
    ref = decode_attention_ref(q, kv, fk, fv, valid, scale)
    if kernel_kw.get("frag") and kv is not None:  # an explicit frag case must reach the fragment kernel, not the tile one
        from kvcal.runtime.attention import _frag_applies

        assert _frag_applies(q, kv, hq // hkv), f"{name}: the fragment kernel does not take this cache"
    from kvcal.runtime import attention

    chunk = attention.REDUCE_CHUNK
    deterministic = torch.are_deterministic_algorithms_enabled()
    with warnings.catch_warnings():  # a fallback to the reference would compare the reference with itself
        warnings.filterwarnings("error", message="decode_attention_triton")
        attention.REDUCE_CHUNK = step_kw.get("reduce_chunk", chunk)
        torch.use_deterministic_algorithms(step_kw.get("deterministic", deterministic))
        try:
            out = decode_attention_triton(q, kv, fk, fv, valid, scale, **kernel_kw)
        finally:
            attention.REDUCE_CHUNK = chunk
            torch.use_deterministic_algorithms(deterministic)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if not torch.isfinite(out.float()).all():
        return float("nan")
    return rel_err(out, ref, per_head=True)  # per (row, query head): an error in one head must not hide in the rest


# (name, bits, cache kwargs): the outlier passes (attention_outliers) on their own, against their torch references
OUTLIER_PASS_CASES = [
    ("nuq4_prerope_pos3", 4, {"kcap": 3, "per_side": 2, "pre_rope": True, "pos_offset": 3}),
    ("nuq3_post_rope", 3, {"kcap": 2, "per_side": 1}),
    ("nuq2_values_per_head", 2, {"kcap": 1, "per_side": 2, "pre_rope": True, "value_per_head": True}),
    ("nuq4_tables_only", 4, {"kcap": 3, "per_side": 2, "pre_rope": True, "pos_offset": 5, "inv_freq": False}),
]


def run_outlier_pass_checks(device="cpu", small=True) -> dict:
    """The key pass's score terms and the value pass's additions to given partials against the references:
    {name: relative error}. A slot that one side dropped or misplaced moves them by O(1)."""
    from kvcal.runtime import attention_outliers as O  # noqa: N812

    if small:
        d, hkv, hq, lengths, tcap, nsplit, block_t = 64, 2, 8, [37, 0, 70], 80, 3, 16
    else:
        d, hkv, hq, lengths, tcap, nsplit, block_t = 128, 8, 32, [4097, 32763, 1500, 16001], 32768, 33, 16
    group, gp = hq // hkv, 1 << (hq // hkv - 1).bit_length()
    res = {}
    for name, bits, cache_kw in OUTLIER_PASS_CASES:
        cache_kw = dict(cache_kw)
        tables_only = not cache_kw.pop("inv_freq", True)  # the key pass reads the tables instead of computing angles
        kv = build_cache("nuq", bits, lengths, hkv, d, tcap=tcap, device=device, **cache_kw)
        if tables_only:
            kv = dataclasses.replace(kv, rope_inv_freq=None)
        q = build_step(len(lengths), hq, hkv, d, 1, torch.bfloat16, device=device)[0]
        gen = torch.Generator(device=device).manual_seed(2)
        rows = len(lengths) * hkv
        scores = torch.randn(rows, tcap, gp, generator=gen, device=device) * 4
        ref, fast = scores.clone(), scores.clone()
        args = (q, kv.k_out_idx, kv.k_out_val, kv.lengths, kv.rope_cos, kv.rope_sin, kv.pos_offset)
        O.key_outlier_scores_ref(*args, ref, kv.rope_inv_freq)
        O.key_outlier_scores_triton(*args, fast, kv.rope_inv_freq)
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
        O.value_outlier_sums_ref(scores, m_part, kv.v_out_idx, kv.v_out_val, kv.lengths, nsplit, block_t, sums[0])
        O.value_outlier_sums_triton(scores, m_part, kv.v_out_idx, kv.v_out_val, kv.lengths, nsplit, block_t, sums[1])
        # int64 fixed-point sums (torch's deterministic mode: order-independent)
        fixed = torch.zeros(sums[0].shape, dtype=torch.int64, device=device)
        O.value_outlier_sums_triton(scores, m_part, kv.v_out_idx, kv.v_out_val, kv.lengths, nsplit, block_t, fixed)
        fixed = fixed.double() * 2.0**-O.FIXED_BITS
        ref_sums, fast_sums, fixed_sums = (x[..., :group] for x in (*sums, fixed))  # columns >= G are padding
        for key, got in ((f"value_{name}", fast_sums), (f"value_fixed_{name}", fixed_sums)):
            res[key] = float((got - ref_sums).norm() / ref_sums.norm()) if ref_sums.norm() > 1e-3 else float("nan")
    return res


def run_quantize_checks(device="cpu", n=7, h=3, d=64, seed=0) -> dict:
    """Bit-exact comparisons of every quantize kernel with its reference; returns {name: ok}."""
    from kvcal.runtime import packing as P

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
                a, b = Q.quantize_affine_channels(x, bits, group), Q.quantize_affine_channels_triton(x, bits, group)
                res[f"affine_channels_{tag}_g{group}"] = all(torch.equal(u, v) for u, v in zip(a, b))
            a, b = Q.quantize_affine_tokens(x, bits), Q.quantize_affine_tokens_triton(x, bits)
            res[f"affine_tokens_{tag}"] = all(torch.equal(u, v) for u, v in zip(a, b))
            block = max(2, n // 4)  # several blocks at once (a prompt's keys, a static step's block per row)
            blocks = x[: n // block * block]
            a = Q.quantize_affine_token_blocks(blocks, bits, block)
            b = Q.quantize_affine_token_blocks_triton(blocks, bits, block)
            res[f"affine_token_blocks_{tag}"] = all(torch.equal(u, v) for u, v in zip(a, b))
            levels = torch.sort(torch.rand(1 << bits, generator=gen, device=device) * 2 - 1).values
            c = h * d
            lo = torch.randn(c, generator=gen, device=device) * 0.5 - 1.5
            hi = lo + 3 + torch.rand(c, generator=gen, device=device)
            a = Q.quantize_lut_static(x, lo, hi, levels, levels + 0.01, bits, 5)
            b = Q.quantize_lut_static_triton(x, lo, hi, levels, levels + 0.01, bits, 5)
            res[f"lut_static_{tag}"] = torch.equal(a[0], b[0]) and _same_outliers(x, a[1], a[2], b[1], b[2])
            for per_head in (False, True):
                a = Q.quantize_lut_dynamic(x, levels, levels * 0.9, bits, 2, per_head)
                b = Q.quantize_lut_dynamic_triton(x, levels, levels * 0.9, bits, 2, per_head)
                res[f"lut_dynamic_{tag}{'_per_head' if per_head else ''}"] = all(
                    torch.equal(u, v) for u, v in zip(a[:3], b[:3])) and _same_outliers(x, a[3], a[4], b[3], b[4])
        for bits in (2, 4):
            res.update(_into_checks(x, bits, gen, f"{str(dtype)[6:]}_b{bits}"))
    for dtype in (torch.float16, torch.bfloat16):
        for sink, residual, bits in ((0, 4, 2), (1, 0, 4), (2, 4, 3)):
            res[f"ring_step_{str(dtype)[6:]}_s{sink}_r{residual}_b{bits}"] = _ring_checks(dtype, sink, residual, bits,
                                                                                       gen, device)
    return res


def _ring_checks(dtype, sink: int, residual: int, bits: int, gen, device, batch=3, h=2, d=64, block=4) -> bool:
    """runtime.ring: the step kernel leaves every buffer as the torch reference does after each of 9 steps from
    random buffers, with rows at different ring positions (each flushes at a different step; residual 0: the
    block holds the token just appended)."""
    from kvcal.runtime import ring

    ring_len, tcap = residual + block, 6 * block  # room for 3 flushes past the last lengths + a block
    w = words_per_vector(d, bits)

    def rand_int(shape, high):
        return torch.randint(0, high, shape, generator=gen, device=device)

    state = {
        "fp_k": torch.randn(batch, h, sink + ring_len, d, generator=gen, device=device).to(dtype),
        "fp_v": torch.randn(batch, h, sink + ring_len, d, generator=gen, device=device).to(dtype),
        "fp_valid": rand_int((batch, sink + ring_len), 2).bool(),
        "ring_start": rand_int((batch,), ring_len),
        "ring_count": torch.tensor([ring_len - 1, ring_len - 3, max(residual - 1, 0)], device=device)[:batch],
        "lengths": torch.tensor([0, block, 2 * block], dtype=torch.int32, device=device)[:batch],
        "k_codes": rand_int((batch, h, tcap, w), 2**30).to(torch.int32),
        "k_scale": torch.randn(batch, h, tcap // block, d, generator=gen, device=device).half(),
        "k_zero": torch.randn(batch, h, tcap // block, d, generator=gen, device=device).half(),
        "v_codes": rand_int((batch, h, tcap, w), 2**30).to(torch.int32),
        "v_scale": torch.randn(batch, h, tcap, d // 32, generator=gen, device=device).half(),
        "v_zero": torch.randn(batch, h, tcap, d // 32, generator=gen, device=device).half(),
    }
    ref, fast = state, {k: t.clone() for k, t in state.items()}
    start_lengths = state["lengths"].clone()
    settings = dict(sink=sink, residual=residual, block=block, key_bits=bits, value_bits=bits, value_group=32)
    same = True
    for _ in range(9):  # compared after every step
        k = (torch.randn(batch, h, d, generator=gen, device=device) * 2).to(dtype)
        v = torch.randn(batch, h, d, generator=gen, device=device).to(dtype)
        ring.ring_step(k, v, *ref.values(), **settings)
        ring.ring_step_triton(k, v, *fast.values(), **settings)
        same = same and all(torch.equal(ref[name], fast[name]) for name in state)
    flushed = (ref["lengths"] > start_lengths).all()  # every row packed at least one block
    return bool(flushed) and same


def _into_checks(x, bits: int, gen, tag: str) -> dict:
    """The *_into kernels write each token into its (row, slot) of cache-layout buffers exactly as the reference
    does, and touch nothing else (buffers start random). Token n goes to row rows[n], slot slots[n]: rows out of
    order, slots scattered (one decode step passes the cache's lengths as slots)."""
    n, h, d = x.shape
    dev = x.device
    rows_n, tcap = 3, n + 4
    rows = torch.arange(n, device=dev) % rows_n
    slots = (torch.arange(n, device=dev) * 5 + 1) % tcap  # distinct (row, slot) pairs for n <= tcap
    slots = slots.to(torch.int32)
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
        ia, va, ib, vb = (t[rows.long(), slots.long()] for t in (a[outliers[0]], a[outliers[1]], b[outliers[0]],
                                                                  b[outliers[1]]))
        untouched = [torch.ones_like(a[k], dtype=torch.bool) for k in outliers]
        for m in untouched:
            m[rows.long(), slots.long()] = False
        rest = all(torch.equal(a[k][m], b[k][m]) for k, m in zip(outliers, untouched))
        return plain and rest and _same_outliers(x, ia, va, ib, vb)

    res = {}
    codes = ((rows_n, h, tcap, w), torch.int32)
    ref, fast = buffers({"codes": codes, "scale": ((rows_n, h, tcap, 2), torch.float16),
                         "zero": ((rows_n, h, tcap, 2), torch.float16)})
    Q.quantize_affine_channels_into(x, bits, d // 2, *ref.values(), rows, slots)
    Q.quantize_affine_channels_into_triton(x, bits, d // 2, *fast.values(), rows, slots)
    res[f"affine_channels_into_{tag}"] = same(ref, fast)
    one_row = torch.ones(1, dtype=torch.int64, device=dev).expand(n)  # stride 0, as a prompt's row index
    ref, fast = buffers({"codes": codes, "scale": ((rows_n, h, tcap, 1), torch.float16),
                         "zero": ((rows_n, h, tcap, 1), torch.float16)})
    Q.quantize_affine_channels_into(x, bits, d, *ref.values(), one_row, torch.arange(n, device=dev))
    Q.quantize_affine_channels_into_triton(x, bits, d, *fast.values(), one_row, torch.arange(n, device=dev))
    res[f"affine_channels_into_one_row_{tag}"] = same(ref, fast)
    ref, fast = buffers({"codes": codes, "idx": ((rows_n, tcap, h, 3), torch.int16),
                         "val": ((rows_n, tcap, h, 3), torch.float16)})
    Q.quantize_lut_static_into(x, lo, hi, levels, levels + 0.01, bits, 3, *ref.values(), rows, slots)
    Q.quantize_lut_static_into_triton(x, lo, hi, levels, levels + 0.01, bits, 3, *fast.values(), rows, slots)
    res[f"lut_static_into_{tag}"] = same(ref, fast, ("idx", "val"))
    for per_head in (False, True):
        heads = (h,) if per_head else ()
        scale = ((rows_n, *heads, tcap), torch.float16)
        slots_shape = (rows_n, tcap, *heads, 4)
        ref, fast = buffers({"codes": codes, "scale": scale, "zero": scale, "idx": (slots_shape, torch.int16),
                             "val": (slots_shape, torch.float16)})
        Q.quantize_lut_dynamic_into(x, levels, levels * 0.9, bits, 2, per_head, *ref.values(), rows, slots)
        Q.quantize_lut_dynamic_into_triton(x, levels, levels * 0.9, bits, 2, per_head, *fast.values(), rows, slots)
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


# ---- the real cache through the Triton kernels (interpreter): KvcalCache's buffers, the quantize-into and ring kernels
# and decode attention, against the same model decoding with the torch references

CACHE_CODECS = [
    ("rtn4", "rtn", {"bits": 4}),
    ("kivi2_ring", "kivi", {"bits": 2, "group_size": 8, "residual": 8}),  # the ring flushes blocks during decode
    ("kvquant4_outliers", "kvquant", {"bits": 4, "outliers": 0.05}),
    ("kvquant3_vhead", "kvquant", {"bits": 3, "outliers": 0.05, "value_scope": "head"}),
]


def _cache_model(dtype):
    """One layer, 4 query heads over 2 KV heads of 64 channels (the kernels' smallest head_dim), random weights."""
    from kvcal.models.tiny import build_random_model, tiny_config
    from kvcal.runtime.generate import as_loaded

    config = tiny_config("llama")
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads = 256, 4, 2
    config.head_dim, config.num_hidden_layers = 64, 1
    return as_loaded(build_random_model(config, dtype, "cpu"))


def _decode_logits(loaded, codec, ids, prompt: int, fast: bool):
    """Logits of the decode steps after a prompt of `prompt` tokens. fast: every op through its Triton kernel, and
    any torch reference that has a Triton twin raises (a silent fallback would compare the reference with itself)."""
    import contextlib
    from unittest import mock

    from kvcal.runtime import attention, ops, quantize, ring
    from kvcal.runtime.cache import KvcalCache

    with contextlib.ExitStack() as stack:
        if fast:
            stack.enter_context(mock.patch.object(ops, "use_triton", lambda t: True))
            references = [(module, name[: -len("_triton")]) for module in (quantize, ring, attention) for name in dir(module)
                          if name.endswith("_triton") and hasattr(module, name[: -len("_triton")])]
            for module, name in references + [(attention, "decode_attention_ref")]:
                def refuse(*args, _name=name, **kwargs):
                    raise AssertionError(f"{_name}: fell back to the torch reference")
                stack.enter_context(mock.patch.object(module, name, refuse))
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("error", message="decode_attention_triton")
        cache = KvcalCache(codec, loaded.dims.num_layers)
        with torch.inference_mode():
            forward_with_cache(loaded.model, ids[:, :prompt], cache)
            steps = [forward_with_cache(loaded.model, ids[:, t : t + 1], cache).logits
                     for t in range(prompt, ids.shape[1])]
    return torch.cat(steps, 1).double()


def run_cache_checks(dtype=torch.float16) -> dict:
    """Largest relative error of a decode step's logits (per row and step) through the Triton kernels against the
    torch references, per codec: batch 2, a 30-token prompt, 10 decode steps."""
    from kvcal.calib.capture import capture
    from kvcal.methods import build_method

    loaded = _cache_model(dtype)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    store = None
    out = {}
    for name, method_name, config in CACHE_CODECS:
        method = build_method(method_name, config)
        tensors = {}
        if method.learns:
            if store is None:
                store = capture(loaded, torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(0)),
                                {"k", "v", "fisher"})
            tensors = method.calibrate(loaded, store)[0]
        codec = method.build_codec(tensors, loaded.dims)
        ref = _decode_logits(loaded, codec, ids, 30, fast=False)
        fast = _decode_logits(loaded, codec, ids, 30, fast=True)
        out[name] = float(((fast - ref).norm(dim=-1) / ref.norm(dim=-1)).max())
    if store is not None:
        store.close()
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
    if which in ("all", "cache"):
        out["cache"] = run_cache_checks()
    out["seconds"] = time.time() - t0
    print("KERNEL_CHECKS " + json.dumps(out))


if __name__ == "__main__":
    main()
