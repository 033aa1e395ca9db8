"""Triton kernels against their torch references.

CPU (CI): every kernel runs under TRITON_INTERPRET=1 at small shapes, in one subprocess (the interpreter is
chosen when @triton.jit decorates, so it must be set before kvcal's kernels are imported; a subprocess keeps
this independent of what other tests imported). GPU (`pytest -m gpu`): the same comparisons at
Llama-3.1-8B shapes (32 query heads, 8 KV heads, head_dim 128, rows of 1.5K to 32K tokens).

Tolerances (stated in tests/kernel_cases.py): quantize-and-pack kernels are bit-exact (outlier slots compared
as sets); decode attention ||out - ref|| / ||ref|| <= 1e-2 in bf16, 2e-3 in fp16 (fp32 accumulation; the output
itself is rounded to the query dtype), 1e-5 in fp32 (every operand fp32) and 1e-12 in fp64 (float64 dots and
softmax over keys and values dequantized in float32 exactly as the reference does).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernel_cases import (
    ATTENTION_CASES,
    GPU_CASES,
    OUTLIER_PASS_CASES,
    TOL,
    TOL_GPU,
    WINDOW_CACHE_METHODS,
    build_packed,
    build_step,
    cache_codecs,
    make_storage,
    run_attention_case,
    run_quantize_checks,
)

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def interpreted(interpreter_checks):
    """tests/kernel_cases.py's results under the Triton interpreter (a subprocess the collection started early)."""
    return interpreter_checks("tests.kernel_cases")


def test_word_alignment_hint_follows_strides_and_address():
    # the decode kernel tells Triton that code rows start on this many int32 words; the interpreter ignores the
    # hint, so a wrong value would only show on the GPU as misaligned vector loads: check the host rule here
    from kvcal.runtime.kernels import word_alignment

    def align(t):
        return word_alignment(t, t.stride()[:3])

    assert align(torch.zeros(2, 3, 5, 8, dtype=torch.int32)) == 4  # 2-bit rows at head_dim 128
    assert align(torch.zeros(2, 3, 5, 12, dtype=torch.int32)) == 4  # 3-bit
    assert align(torch.zeros(2, 3, 5, 6, dtype=torch.int32)) == 2  # 3-bit at head_dim 64
    assert align(torch.zeros(2, 3, 5, 3, dtype=torch.int32)) == 1
    buf = torch.zeros(2, 3, 5, 9, dtype=torch.int32)
    assert align(buf[..., 1:]) == 1  # 8-word rows, but a 9-word stride
    flat = torch.zeros(2 * 3 * 5 * 8 + 2, dtype=torch.int32)
    assert align(flat[2:].view(2, 3, 5, 8)) == 2  # rows 8 words apart from an address 8 bytes past alignment
    assert align(flat[1:-1].view(2, 3, 5, 8)) == 1


def _rtn(bits, lengths, hkv, d, tcap, **kw):
    storage = make_storage("rtn", bits, hkv, d, group=kw.pop("group", None))
    return storage, build_packed(storage, lengths, hkv, d, tcap=tcap, **kw)


def test_frag_kernel_takes_one_scale_per_token_and_head_only():
    """The fragment kernel applies to one scale per token and KV head with head_dim * bits >= 256 (so the frag cases
    above do run it), not to grouped scales, float32 queries or 2-bit head_dim 64."""
    from kvcal.methods.rtn.kernels import _frag_applies

    q = torch.zeros(3, 8, 64, dtype=torch.float16)
    q128 = torch.zeros(3, 8, 128, dtype=torch.float16)
    assert _frag_applies(q, _rtn(4, [5, 0, 9], 2, 64, 10)[1], 4, 4)
    assert _frag_applies(q128, _rtn(2, [5, 0, 9], 2, 128, 10)[1], 2, 4)
    assert not _frag_applies(q, _rtn(2, [5, 0, 9], 2, 64, 10)[1], 2, 4)
    assert _frag_applies(q, _rtn(4, [5, 0, 9], 2, 64, 11)[1], 4, 4)
    assert not _frag_applies(q, _rtn(4, [5, 0, 9], 2, 64, 10, group=32)[1], 4, 4)
    assert not _frag_applies(q.float(), _rtn(4, [5, 0, 9], 2, 64, 10)[1], 4, 4)
    assert not _frag_applies(q, _rtn(4, [5, 0, 9], 2, 64, 10)[1], 4, 9)  # GQA groups of more than 8 heads


class _Launched(Exception):
    """Raised by a stand-in kernel: which kernel the dispatch launched, with its keyword arguments."""


class _StandIn:
    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            consts = kwargs.get("C")  # the split-K skeleton's launch: the method's constants by name
            raise _Launched(self.name, {**kwargs, **(consts._asdict() if consts is not None else {})})

        return launch


def _launched(monkeypatch, module, storage, q, packed, fp, **kw):
    """Name and constexpr arguments of the kernel a storage's attend_triton launches (kernels stubbed): "tile" for the
    split-K skeleton (runtime.kernels.split_k_kernel), "frag" for a fragment kernel."""
    from kvcal.runtime import kernels as K

    monkeypatch.setattr(K, "split_k_kernel", _StandIn("tile"))
    if hasattr(module, "_frag_decode_kernel"):
        monkeypatch.setattr(module, "_frag_decode_kernel", _StandIn("frag"))
    with pytest.raises(_Launched) as info:
        storage.attend_triton(q, packed, 0.125, fp, **kw)
    return info.value.args


def _kvquant(lengths, tcap, **kw):
    storage = make_storage("kvquant", 4, 2, 64, kcap=3, per_side=2, **kw)
    return storage, build_packed(storage, lengths, 2, 64, tcap=tcap)


def test_kvquant_residuals_inside_the_kernel_for_float32_and_float64(monkeypatch):
    """fp16 and bf16 run KVQuant's sparse residuals as passes around the tile kernel (KCORR, SAVE_S); float32 and
    float64 add them inside it (KCAP, VCAP), as the reference does and without the value pass's atomics, whose
    run-dependent order made two float32 decodes of smollm2-135m on an H100 differ by up to 2.5% in perplexity."""
    import kvcal.methods.kvquant.kernels as KQ

    monkeypatch.setattr(KQ, "key_outlier_scores_triton", lambda *args: None)  # runs before the (stubbed) kernel
    storage, packed = _kvquant([40, 33], 48)
    for dtype, inside in ((torch.float16, False), (torch.bfloat16, False), (torch.float32, True),
                          (torch.float64, True)):
        q, fp = build_step(2, 8, 2, 64, 5, dtype)
        name, kw = _launched(monkeypatch, KQ, storage, q, packed, fp)
        where = (kw["KCAP"], kw["VCAP"], kw["KCORR"], kw["SAVE_S"])
        assert name == "tile" and where == ((3, 4, 0, 0) if inside else (0, 0, 1, 1)), (dtype, where)


def test_value_pass_sums_in_fixed_point_in_deterministic_mode(monkeypatch):
    """fp16 / bf16 KVQuant decoding sums the value residuals in float32 by default and in int64 fixed point (integer
    atomics: the same sums in any order) under torch.use_deterministic_algorithms(True); the partials carry that
    buffer and its unit to the merge."""
    import kvcal.methods.kvquant.kernels as KQ
    from kvcal.runtime import kernels as K

    calls = []
    monkeypatch.setattr(KQ, "key_outlier_scores_triton", lambda *args: None)
    monkeypatch.setattr(K, "split_k_kernel", type("K", (), {"__getitem__": lambda self, grid: lambda *a, **k: None})())
    monkeypatch.setattr(KQ, "value_outlier_sums_triton", lambda *args: calls.append((args[7].dtype, args[8])))
    storage, packed = _kvquant([40, 33], 48)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        for deterministic in (False, True):
            torch.use_deterministic_algorithms(deterministic)
            sums = torch.int64 if deterministic else torch.float32
            for dtype in (torch.float16, torch.bfloat16):
                calls.clear()
                q, fp = build_step(2, 8, 2, 64, 5, dtype)
                parts = storage.attend_triton(q, packed, 0.125, fp)
                assert calls == [(sums, 28)] and parts.extra.dtype == sums, (dtype, deterministic, calls)
                assert parts.extra_unit == 2.0**-28
        # the pass and the merge get the same fraction bits (fewer on long rows: here forced down)
        monkeypatch.setattr(KQ, "FIXED_BITS", 20)
        calls.clear()
        parts = storage.attend_triton(q, packed, 0.125, fp)
        assert calls == [(torch.int64, 20)] and parts.extra_unit == 2.0**-20, calls
    finally:
        torch.use_deterministic_algorithms(was)


def test_fixed_point_bits_keep_int64_sums_from_overflowing():
    """A split's fixed-point sum of n terms below 2^16 stays below 2^63: 28 fraction bits up to 2^19 tokens, one
    fewer per doubling beyond."""
    from kvcal.methods.kvquant.kernels import FIXED_BITS, fixed_point_bits

    assert FIXED_BITS == 28
    assert fixed_point_bits(0) == fixed_point_bits(1) == fixed_point_bits(2**19) == 28
    assert fixed_point_bits(2**19 + 1) == fixed_point_bits(2**20) == 27
    assert fixed_point_bits(2**24) == 23
    for n in (2**19, 2**20 + 7, 2**25):
        assert n * 2**16 * 2 ** fixed_point_bits(n) <= 2**63


def test_frag_dispatch_rules(monkeypatch):
    """From FRAG_MIN_ROWS (row, KV head) pairs the fragment kernel is the default; a tile-kernel knob or frag=False
    selects the tile kernel, frag=True forces the fragment kernel below the threshold; its code words are vector
    loads only where every lane's words are aligned for them."""
    import kvcal.methods.rtn.kernels as R

    storage, packed = _rtn(4, [40, 33], 8, 64, 48)  # 2 rows x 8 KV heads = 16 pairs
    q, fp = build_step(2, 32, 8, 64, 5, torch.float16)
    assert _launched(monkeypatch, R, storage, q, packed, fp)[0] == "tile"  # below the threshold
    assert _launched(monkeypatch, R, storage, q, packed, fp, frag=True)[0] == "frag"
    monkeypatch.setattr(R, "FRAG_MIN_ROWS", 16)
    name, kwargs = _launched(monkeypatch, R, storage, q, packed, fp)
    assert name == "frag" and kwargs["VEC"] == 1  # D 64 x 4 bits: 2 words per lane, 8-byte aligned rows
    assert kwargs["ROW_CLAMP"] == 1 and kwargs["maxnreg"] == 168  # 48 rows: not whole 32-token tiles; 4-bit cap
    assert kwargs["PDL"] == 0  # griddepcontrol only on sm_90+ GPUs
    assert kwargs["SCALE_WORDS"] == 0  # scales as vectors only without row clamps
    whole = _rtn(4, [40, 33], 8, 64, 64)[1]
    kwargs = _launched(monkeypatch, R, storage, q, whole, fp)[1]
    assert kwargs["ROW_CLAMP"] == 0 and kwargs["SCALE_WORDS"] == 1
    # scale rows one fp16 off the 8-byte alignment of a lane's four tokens: per-token loads
    odd = torch.zeros(2, 2, 8, 65, 1, dtype=torch.float16)[..., 1:, :]
    shifted = type(whole)({**whole.buffers, "k_scale": odd[0], "k_zero": odd[1]}, whole.lengths, 8, 64, 64)
    assert _launched(monkeypatch, R, storage, q, shifted, fp)[1]["SCALE_WORDS"] == 0
    assert _launched(monkeypatch, R, storage, q, packed, fp, frag_vector=False)[1]["VEC"] == 0
    for knob in ({"block_t": 16}, {"num_warps": 2}, {"num_stages": 3}, {"prefetch": 0}, {"frag": False}):
        assert _launched(monkeypatch, R, storage, q, packed, fp, **knob)[0] == "tile", knob
    # rows starting one word off the 8-byte alignment a lane's two-word load needs: scalar loads
    codes = torch.zeros(2, 8, 48, 9, dtype=torch.int32)[..., 1:]
    shifted = type(packed)({**packed.buffers, "k_codes": codes}, packed.lengths, 8, 64, 48)
    name, kwargs = _launched(monkeypatch, R, storage, q, shifted, fp)
    assert name == "frag" and kwargs["VEC"] == 0


def test_commvq_score_dot_knob_is_checked():
    """attend_triton refuses an unknown score_dot and a dot width that is not a power of two, before launching
    anything."""
    from kvcal.errors import KvcalError
    from kvcal.methods.commvq.kernels import attend_triton

    storage = make_storage("commvq", 1, 2, 64)
    packed = build_packed(storage, [5], 2, 64)
    q = build_step(1, 8, 2, 64, 0, torch.float32)[0]
    with pytest.raises(KvcalError, match="score_dot must be one of"):
        attend_triton(q, packed, 0.125, None, storage, score_dot="wgmma")
    with pytest.raises(KvcalError, match="score_dot_n must be a power of two, got 12"):
        attend_triton(q, packed, 0.125, None, storage, score_dot="fma", score_dot_n=12)


def test_interpreted_quantize_and_pack_bit_exact(interpreted):
    res = interpreted["quantize"]
    bad = [k for k, ok in res.items() if not ok]
    assert not bad, f"differ from the reference: {bad}"
    # every format x bits x dtype ran, 4 of them CommVQ writes, 20 the 1-bit uniform formats (a check that stopped
    # running would lower the count)
    assert len(res) == 192


def _training_codes_ok(res: dict, grad_tol: dict) -> list:
    """The keys of run_training_code_checks' results out of bounds: no flipped category (a GPU may flip one near-tie
    in 10^5), the bits equal up to float32 rounding of (hard - soft) + soft, the gradient within grad_tol[dtype]."""
    bad = []
    for key, value in res.items():
        dtype = key.split("_")[0]
        limit = (1e-5 if key.endswith("_argmax_differs") else 2.5e-7 if key.endswith("_bits")
                 else grad_tol[dtype])
        if not value <= limit:
            bad.append((key, value))
    return bad


def test_interpreted_training_code_kernels_match_the_reference(interpreted):
    """CommVQ's fused Gumbel-code kernels (forward bits, backward gradient) against the torch chain they replace."""
    res = interpreted["training"]
    assert len(res) == 12  # 2 dtypes x 2 temperatures x (argmax, bits, gradient)
    # bf16 logits: the gradient is rounded to bf16 after float32 arithmetic that may differ by an ulp (2^-8 relative)
    assert not _training_codes_ok(res, {"float32": 1e-6, "bfloat16": 2 ** -7})


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles kernels: not under the interpreter")
@pytest.mark.parametrize("dtype", ["bf16", "fp64"])
def test_soft_capped_full_precision_kernel_compiles_for_sm90(dtype):
    """The score soft-cap (runtime/kernels.soft_cap, Gemma 2: in the split-K skeleton and the full-precision kernels)
    compiles for sm_90 in the generic full-precision kernel, bf16 and float64 queries, and changes its code (the
    *_softcap_* interpreter cases check its numbers; the interpreter runs what the compiler may refuse)."""
    from benchmarks.sass import compile_sass
    from kvcal.runtime import kernels as K

    q, acc = f"*{dtype}", "*fp32" if dtype == "bf16" else "*fp64"
    types = dict(q_ptr=q, fk_ptr=q, fv_ptr=q, fval_ptr="*i8", m_ptr=acc, l_ptr=acc, acc_ptr=acc, qk_scale="fp32")
    consts = dict(D=128, G=4, GPF=16, BLOCK_F=16, INTERP=False, WAIT_PRIOR=0)
    capped = compile_sass(K._fp_kernel, types, {**consts, "CAP": 50 * K.LOG2E}, 1, 2, None)
    plain = compile_sass(K._fp_kernel, types, {**consts, "CAP": 0.0}, 1, 2, None)
    assert 0 < capped[0] <= 255 and capped[3] != plain[3]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles kernels: not under the interpreter")
@pytest.mark.parametrize("method", ["commvq", "xquant"])
def test_soft_capped_score_passes_compile_for_sm90(method):
    """The score passes that write their scores out, CommVQ's key pass and XQuant's scores kernel, compile for sm_90
    with the score soft-cap at bf16 queries and the launch's default tiles (Llama-3.1-8B heads; CommVQ at 1 bit: 11
    stages of 64 codes), and the cap changes their code (the *_softcap_* interpreter cases check its numbers)."""
    from benchmarks.sass import compile_sass
    from kvcal.runtime import kernels as K

    if method == "commvq":
        from kvcal.methods.commvq import kernels as C

        fn, warps, stages = C._key_scores_kernel, C.KEY_WARPS, 2
        types = dict(q_ptr="*bf16", len_ptr="*i32", kc_ptr="*i32", kn_ptr="*fp16", th_ptr="*fp16", cos_ptr="*fp32",
                     sin_ptr="*fp32", s_ptr="*fp32", qk_scale_hi="fp32", qk_scale_lo="fp32")
        consts = dict(D=128, G=4, GP=4, R=11, NCODE=64, IB=6, NPH=1, GPAIRS=64, WK=33, BLOCK_T=C.KEY_BLOCK_T,
                      TILES=C.KEY_TILES, PROBE=0, SCORE_DOT=0, INTERP=False)
    else:
        from kvcal.methods.xquant import kernels as X

        fn, warps, stages = X._scores_tc_kernel, 8, 2
        types = dict(codes_ptr="*i32", sc_ptr="*fp16", zc_ptr="*fp16", ko_ptr="*fp16", zs_ptr="*fp16", rk_ptr="*fp16",
                     bias_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32", len_ptr="*i32", q_ptr="*fp16",
                     out_ptr="*fp32", QSCALE="fp32")
        consts = dict(BITS=2, RW=1024, TDIV=128, CDIV=1, OUTLIER=0, STAGED=0, HAS_BIAS=0, D=128, G=4, GP=16, HB=1,
                      BLOCK_T=128, CHUNK=64, INTERP=False, PREC=16)
    capped = compile_sass(fn, types, {**consts, "CAP": 50 * K.LOG2E}, warps, stages, None)
    plain = compile_sass(fn, types, {**consts, "CAP": 0.0}, warps, stages, None)
    assert 0 < capped[0] <= 255 and capped[2] <= 232 * 1024 and capped[3] != plain[3]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
def test_interpreted_decode_attention(interpreted, case):
    err = interpreted["attention"][case[0]]
    assert err == err and err <= TOL[case[3]], f"{case[0]}: relative error {err}"


def test_interpreted_outlier_passes(interpreted):
    # float32 sums of a few products per slot, in another order than the references' (measured up to 3e-8)
    res = interpreted["outliers"]
    assert len(res) == 3 * len(OUTLIER_PASS_CASES)
    bad = {k: v for k, v in res.items() if not v <= 1e-6}
    assert not bad, f"differ from the reference: {bad}"


@pytest.mark.parametrize("codec", [c[0] for c in cache_codecs()])
def test_interpreted_cache_decode_matches_the_references(interpreted, codec):
    """Every registered method with a packed storage: a model decoding through KvcalCache with every op on its Triton
    kernel (fp16, interpreter) gives the logits the torch references give: largest error per (row, step) measured
    1.1e-3 (rtn4) to 5.7e-3 (kvquant4_outliers); a kernel seeing one packed token less gave 0.7."""
    err = interpreted["cache"][codec]
    if err is None:
        pytest.skip(f"{codec} at its test_config has no packed storage yet (simulation and reference cache only)")
    assert err == err and err <= 2e-2, f"{codec}: relative error {err}"


@pytest.mark.parametrize("codec", WINDOW_CACHE_METHODS)
def test_interpreted_compressed_windows_match_the_references(interpreted, codec):
    """--compress-local through the kernels (the split-K skeleton's and CommVQ's value pass take the first visible slot
    per row, Packed.first) on a Gemma 3 with 8-token windows, float32: the kernels' logits equal the torch references'
    (measured 3e-7 for KVQuant to 5e-5 for KIVI, whose 2-bit codes can round the other way at a bound; kernels that
    ignore the first slot gave 0.31 to 0.96)."""
    err = interpreted["cache_window"][codec]
    assert err == err and err <= 1e-3, f"{codec}: relative error {err}"


def test_interpreted_soft_capped_gemma2_cache_decode_matches_the_references(interpreted):
    """A float32 Gemma 2 (a sliding-window layer, then a global one, score soft-cap 1) decoding through KvcalCache
    with CommVQ's and XQuant's kernels gives the torch references' logits: measured 3.6e-7 (commvq) and 3.0e-7
    (xquant) per (row, step), where the same kernels without the cap on the packed tokens gave 0.20 and 0.54, and
    the references without the cap move the logits by 0.57 and 0.78."""
    from tests.kernel_cases import SOFTCAP_CACHE_METHODS

    res = interpreted["cache_softcap"]
    assert sorted(res) == sorted(SOFTCAP_CACHE_METHODS)
    for method, (err, moved) in res.items():
        assert moved > 0.1, f"{method}: the cap moves the logits by {moved} only"  # teeth
        assert err == err and err <= 1e-5, f"{method}: relative error {err}"


# ---- GPU (Llama-3.1-8B shapes) -------------------------------------------------------------------------


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_decode_attention(case):
    err = run_attention_case(case, small=False, device="cuda")
    assert err == err and err <= TOL_GPU[case[3]], f"{case[0]}: relative error {err}"


@pytest.mark.gpu
@gpu
def test_gpu_outlier_passes():
    from tests.kernel_cases import run_outlier_pass_checks

    res = run_outlier_pass_checks(device="cuda", small=False)
    bad = {k: v for k, v in res.items() if not v <= 1e-5}
    assert len(res) == 3 * len(OUTLIER_PASS_CASES) and not bad, bad


@pytest.mark.gpu
@gpu
def test_gpu_quantize_bit_exact():
    res = run_quantize_checks(device="cuda", n=4099, h=8, d=128)
    bad = [k for k, ok in res.items() if not ok]
    assert not bad, f"differ from the reference: {bad}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(1, 512, 1024), (30, 64, 96)], ids=["llama-3.1-8b", "smollm2-stacked"])
def test_gpu_training_code_kernels_match_the_reference(shape):
    from tests.kernel_cases import run_training_code_checks

    res = run_training_code_checks(device="cuda", shape=shape)
    assert not _training_codes_ok(res, {"float32": 1e-6, "bfloat16": 2 ** -7}), res


@pytest.mark.gpu
@gpu
def test_gpu_cache_uses_the_kernels_and_refuses_what_they_cannot_take():
    """On CUDA the packed cache runs each storage's Triton kernel (no fallback to the torch reference: a call the
    kernel cannot take raises one line, unless the reference backend was asked for)."""
    from kvcal.errors import KvcalError
    from kvcal.runtime.decode import decode_attention, merge_reference
    from tests.kernel_cases import rel_err

    storage = make_storage("rtn", 4, 8, 128)
    packed = build_packed(storage, [100, 64], 8, 128, device="cuda")
    q, fp = build_step(2, 32, 8, 128, 16, torch.bfloat16, device="cuda")
    out = decode_attention(q, storage, packed, fp, 128**-0.5, kernels=True)
    ref = merge_reference(storage.attend_reference(q, packed, 128**-0.5, fp), 2, q.dtype)
    assert rel_err(out, ref, per_head=True) <= TOL[torch.bfloat16]
    odd = make_storage("rtn", 5, 8, 128)  # 5-bit codes: no kernel unpacks them
    packed = build_packed(odd, [100, 64], 8, 128, device="cuda")
    with pytest.raises(KvcalError, match="no Triton decode kernel.*5-bit codes.*backend='reference'"):
        decode_attention(q, odd, packed, fp, 128**-0.5, kernels=True)
