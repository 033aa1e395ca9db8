"""XQuant's decode kernels against their torch reference (XQuantStorage.attend_reference), on packed latents written
by the storage's own torch reference from random attention inputs: run under TRITON_INTERPRET=1 on the CPU by
tests/test_xquant.py (small shapes, a subprocess: the interpreter is chosen when kernels are decorated) and natively
on the GPU at Llama-3.1-8B shapes (marked gpu)."""

from __future__ import annotations

import torch

from kvcal.quant.rope import RopeSpec
from kvcal.runtime import kernels as K
from kvcal.runtime.decode import FullPrecision, merge_reference
from kvcal.runtime.storage import Packed, SharedState

TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-5, torch.float64: 1e-12}

# (name, variant, bits, dtype, options): options hidden, hkv, d, hq, lengths, tcap, nfp, outlier, bias, group_tokens,
# group_channels, softcap (the model's score soft-cap, Gemma 2), and the kernels' knobs (KNOBS)
CASES = [
    ("svd2_fp16", "svd", 2, torch.float16, {}),
    ("svd3_outlier_bias_bf16", "svd", 3, torch.bfloat16, {"outlier": True, "bias": True}),
    ("svd4_outlier_fp32", "svd", 4, torch.float32, {"outlier": True}),
    ("svd8_no_fp_fp16", "svd", 8, torch.float16, {"nfp": 0}),
    ("svd2_outlier_bias_fp64", "svd", 2, torch.float64, {"outlier": True, "bias": True}),
    ("svd16_raw_fp32", "svd", 16, torch.float32, {}),
    ("x2_bias_fp16", "x", 2, torch.float16, {"bias": True, "hq": 8}),
    ("x3_fp64", "x", 3, torch.float64, {}),
    # several value splits (an empty row in some), and smollm2's 192-wide latents
    ("svd2_splits4_outlier_bias_bf16", "svd", 2, torch.bfloat16, {"num_splits": 4, "outlier": True, "bias": True}),
    ("svd2_width192_fp64", "svd", 2, torch.float64, {"hkv": 3, "d": 64, "hq": 9, "hidden": 256,
                                                     "group_channels": 64}),
    # the knobs: two KV heads per scores program, 32-token tiles and chunks, several value splits (a split
    # over several tiles: the online softmax's rescaling), fp16 latents staged first
    ("svd2_tc_knobs_outlier_bias_fp64", "svd", 2, torch.float64,
     {"outlier": True, "bias": True, "hkv": 4, "heads_per_program": 2, "block_t": 32, "chunk": 32,
      "value_chunk": 32, "value_block_t": 16, "num_splits": 2, "lengths": (40, 0, 72, 64)}),
    ("svd2_tc_knobs_fp16", "svd", 2, torch.float16,
     {"heads_per_program": 2, "block_t": 32, "chunk": 32, "num_splits": 3, "hq": 8}),
    ("svd4_staged_outlier_bias_fp64", "svd", 4, torch.float64,
     {"outlier": True, "bias": True, "staged_latents": True, "heads_per_program": 2, "num_splits": 3}),
    ("x2_staged_fp32", "x", 2, torch.float32, {"staged_latents": True, "num_splits": 2}),
    # key blocks at least as long as the scores' token tile (one scale and zero vector per tile), 8 bits in x
    ("svd4_keyblocks16_outlier_bias_fp64", "svd", 4, torch.float64,
     {"outlier": True, "bias": True, "group_tokens": 16, "block_t": 16, "lengths": (48, 0, 80), "num_splits": 2}),
    ("svd2_keyblocks32_bf16", "svd", 2, torch.bfloat16,
     {"group_tokens": 32, "block_t": 16, "heads_per_program": 2, "lengths": (64, 96, 32)}),
    ("x8_groups32_fp64", "x", 8, torch.float64, {"group_channels": 32, "chunk": 32, "value_chunk": 32}),
    ("svd2_width192_splits_bf16", "svd", 2, torch.bfloat16,
     {"hkv": 3, "d": 64, "hq": 9, "hidden": 256, "group_channels": 64, "outlier": True, "bias": True,
      "chunk": 64, "value_chunk": 64, "num_splits": 2}),
    # Gemma 2's score soft-cap (cap 2: the scores reach the tanh's curved part), in the scores kernel and the fp part
    ("svd2_outlier_bias_softcap_bf16", "svd", 2, torch.bfloat16, {"outlier": True, "bias": True, "softcap": 2.0}),
    ("x2_splits_softcap_fp64", "x", 2, torch.float64, {"num_splits": 3, "softcap": 2.0}),
]


def _inputs(gen, n, hidden, device):
    x = torch.randn(n, 1, hidden, generator=gen, device=device)
    x[..., : hidden // 16] *= 4.0  # a few large channels, as post-norm X has
    return x


def make_case(variant, bits, dtype, *, hidden=96, hkv=2, d=32, hq=None, lengths=(40, 0, 72), tcap=None, nfp=19,
              outlier=False, bias=False, group_tokens=8, group_channels=16, seed=0, device="cpu", **_):
    """(storage, packed, q, fp): a storage with random factors (svd) or weights (x), `lengths[b]` tokens of random
    attention inputs in row b written by its torch reference, a query and a full-precision part."""
    from kvcal.methods.xquant.calibrate import thin_svd
    from kvcal.methods.xquant.storage import XQuantStorage
    from kvcal.models.adapter import KVProjection

    gen = torch.Generator(device="cpu").manual_seed(seed)
    d_kv = hkv * d
    w_k, w_v = torch.randn(d_kv, hidden, generator=gen) / hidden**0.5, torch.randn(d_kv, hidden, generator=gen) / hidden**0.5
    factors = {}
    if variant == "svd":
        for side, w in (("k", w_k), ("v", w_v)):
            u, r, _, _ = thin_svd(w.T)
            factors[f"{side}.U"], factors[f"{side}.R"] = u, r
    storage = XQuantStorage(variant, bits, group_tokens, group_channels, 0, factors, outlier, hidden)
    b_k = torch.randn(d_kv, generator=gen) if bias else None
    b_v = torch.randn(d_kv, generator=gen) if bias else None
    storage.bind(KVProjection(w_k.to(device), None if b_k is None else b_k.to(device), w_v.to(device),
                              None if b_v is None else b_v.to(device), False))
    storage.to(device)
    tcap = tcap or max(lengths)
    batch = len(lengths)
    buffers = {name: torch.zeros(spec.shape, dtype=spec.dtype, device=device)
               for name, spec in storage.buffers(batch, tcap, hkv, d).items()}
    inv_freq = RopeSpec(head_dim=d, theta=500000.0, rope_type="llama3", factor=8.0).inv_freq(device)
    cos, sin = SharedState().rope_tables(inv_freq, tcap + 8)
    packed = Packed(buffers, torch.tensor(lengths, dtype=torch.int32, device=device), hkv, d, tcap, 3, cos, sin,
                    inv_freq)  # slot 0 at position 3 (as after 3 sinks)
    for b, n in enumerate(lengths):
        if n:
            storage.write_reference(packed, _inputs(gen, n, hidden, "cpu").to(device), None,
                                    torch.full((n,), b, dtype=torch.int64, device=device),
                                    torch.arange(n, device=device))
    hq = hq or 2 * hkv
    q = torch.randn(batch, hq, d, generator=gen).to(device=device, dtype=dtype)
    fp = None
    if nfp:
        fp = FullPrecision(torch.randn(batch, hkv, nfp, d, generator=gen).to(device=device, dtype=dtype),
                           torch.randn(batch, hkv, nfp, d, generator=gen).to(device=device, dtype=dtype),
                           torch.rand(batch, nfp, generator=gen).to(device) > 0.3)
    return storage, packed, q, fp


KNOBS = ("block_t", "chunk", "heads_per_program", "staged_latents", "value_block_t", "value_chunk", "num_splits")


def run_case(case, device="cpu", **shape) -> float:
    """Largest relative error per (row, query head) of the kernels' output (with the case's KNOBS) against the
    reference's."""
    name, variant, bits, dtype, options = case
    options = {**options, **shape}
    storage, packed, q, fp = make_case(variant, bits, dtype, device=device, **options)
    scale = q.shape[-1] ** -0.5
    ref = merge_reference(storage.attend_reference(q, packed, scale, fp), q.shape[0], q.dtype)
    if options.get("softcap") is not None:  # the model's score soft-cap, on the packed latents and the fp part
        packed.softcap = options["softcap"]
        capped = merge_reference(storage.attend_reference(q, packed, scale, fp), q.shape[0], q.dtype)
        assert _rel_err(capped, ref) > 0.05, f"{name}: the cap must change this case's output"  # teeth
        ref = capped
    assert storage.supports_triton(q, packed) is None, storage.supports_triton(q, packed)
    knobs = {k: options[k] for k in KNOBS if k in options}
    out = K.merge_triton(storage.attend_triton(q, packed, scale, fp, **knobs), q)
    if not torch.isfinite(out.float()).all():
        return float("nan")
    return _rel_err(out, ref)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest ||out - ref|| / ||ref|| over the [B, Hq] rows of [B, Hq, D] outputs."""
    out, ref = out.double(), ref.double()
    return float(((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max())


WRITE_CASES = [  # (name, variant, bits, options): widths the quantize kernels take only in pieces (head_split)
    ("write_svd2_width192_outlier", "svd", 2, {"hkv": 3, "d": 64, "hidden": 256, "group_channels": 64,
                                               "outlier": True}),
    ("write_svd4_width192", "svd", 4, {"hkv": 3, "d": 64, "hidden": 256, "group_channels": 64}),
    ("write_x2_hidden192", "x", 2, {"hkv": 2, "d": 32, "hidden": 192, "group_channels": 64}),
]


def write_checks(device="cpu") -> dict:
    """The storage's Triton write (write_triton, in pieces) against its torch reference on the same tokens: every
    buffer equal, bit for bit."""
    out = {}
    for name, variant, bits, options in WRITE_CASES:
        storage, packed, _, _ = make_case(variant, bits, torch.float32, device=device, lengths=(40, 24), **options)
        assert storage.head_split() is not None, name
        mine = {n: torch.zeros_like(t) for n, t in packed.buffers.items()}
        gen = torch.Generator(device="cpu").manual_seed(5)
        x = _inputs(gen, 64, options["hidden"], "cpu").to(device)
        rows = torch.tensor([0] * 40 + [1] * 24, device=device)
        slots = torch.cat([torch.arange(40), torch.arange(24)]).to(device)
        ref = {n: torch.zeros_like(t) for n, t in packed.buffers.items()}
        import dataclasses

        storage.write_reference(dataclasses.replace(packed, buffers=ref), x, None, rows, slots)
        storage.write_triton(dataclasses.replace(packed, buffers=mine), x, None, rows, slots)
        out[name] = all(torch.equal(mine[n], ref[n]) for n in ref) and any(t.any() for t in ref.values())
    return out


CROSS_LAYER_CASES = [  # (name, xquant config over tiny groups): the cross-layer storage's decode kernels
    ("cl_svd2", dict(variant="svd", cross_layer=True, base_layer=0, bits=2)),
    ("cl_x2_base1", dict(variant="x", cross_layer=True, base_layer=1, hp_layers=1, bits=2)),
]
# (name, case, cap): a case again on the llama model with its scores soft-capped as Gemma 2's (s -> cap tanh(s / cap)),
# the cap small enough for these random models' scores to reach the tanh's curved part
CROSS_LAYER_SOFTCAP = ("cl_svd2_softcap", "cl_svd2", 0.5)


def cross_layer_checks(device: str = "cpu") -> dict:
    """XQuant-CL through kvcal's packed cache with Triton kernels (the chain of X^ rebuilt per step, the decode
    kernels on it) against the same cache on the torch references: random 3-layer llama and qwen2 (k/v bias) models
    with the tiny models' shapes but head_dim 32 (the kernels' smallest), float64, a 21-token prefill of two rows (one
    left-padded) and 6 decode steps; the largest absolute difference of the logits. CROSS_LAYER_SOFTCAP runs on the
    llama model with a score soft-cap (ModelDims.attn_softcap, which the adapter and the cache apply to every layer's
    scores), checked to move the references' logits far more than the tolerance."""
    import dataclasses

    from benchmarks.decode_parity import patch_rmsnorm
    from kvcal.methods import build_method
    from kvcal.models import LoadedModel, ModelDims
    from kvcal.models.adapter import forward_with_cache, install_adapter
    from kvcal.models.tiny import build_random_model, byte_tokenizer, tiny_config
    from kvcal.runtime.cache import KvcalCache

    out = {}
    ids = torch.randint(0, 256, (2, 27), generator=torch.Generator().manual_seed(7)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    for family in ("llama", "qwen2"):
        base = {k: v for k, v in tiny_config(family).to_dict().items() if k != "layer_types"}
        config = type(tiny_config(family))(**{**base, "head_dim": 32, "num_hidden_layers": 3})
        loaded = LoadedModel(f"small-{family}", build_random_model(config, torch.float64, device), byte_tokenizer(),
                             ModelDims.from_config(config))
        # transformers' RMSNorm rounds to float32 even in a float64 model: on a GPU it turns the kernels' 1e-16
        # differences (another summation order) into float32 roundings of 1e-7 in the logits
        patch_rmsnorm(loaded.model)
        install_adapter(loaded)
        dims = loaded.dims
        runs = [(name, name, None) for name, _ in CROSS_LAYER_CASES]
        if family == "llama":
            runs.append(CROSS_LAYER_SOFTCAP)
        references = {}  # the references' logits per case, uncapped
        for name, case, softcap in runs:
            config = dict(CROSS_LAYER_CASES)[case]
            loaded.adapter.dims = dataclasses.replace(dims, attn_softcap=softcap)
            method = build_method("xquant", {"group_tokens": 8, "group_channels": 16, **config})
            tensors, _ = method.calibrate(loaded, None)
            logits = []
            for options in (dict(kernels=True), dict(backend="reference")):
                cache = KvcalCache(method.build_storages(tensors, loaded.dims), loaded.dims.num_layers, **options)
                with torch.inference_mode():
                    steps = [forward_with_cache(loaded.model, ids[:, :21], cache, attention_mask=mask[:, :21]).logits]
                    for t in range(21, 27):
                        steps.append(forward_with_cache(loaded.model, ids[:, t:t + 1], cache,
                                                        attention_mask=mask[:, :t + 1]).logits[:, -1:])
                logits.append(torch.cat(steps, 1)[:, 20:])
            assert type(cache.storages[1]).__name__ == "XQuantChainStorage", name
            assert cache.layers[1].softcap == softcap, name
            if softcap is None:
                references[case] = logits[1]
            else:  # teeth: the cap moves the logits by far more than the kernels' tolerance (1e-9)
                moved = float((logits[1] - references[case]).abs().max())
                assert moved > 1e-2, f"{name}: the cap moved the logits by {moved} only"
            out[f"{name}@{family}"] = float((logits[0] - logits[1]).abs().max())
        loaded.adapter.dims = dims
    return out


def main():  # pragma: no cover - run in a subprocess by tests/test_xquant.py
    import json
    import time

    t0 = time.time()
    out = {case[0]: run_case(case) for case in CASES}
    out.update(write_checks())
    out.update(cross_layer_checks())
    out["seconds"] = time.time() - t0
    print("XQUANT_KERNELS " + json.dumps(out))


if __name__ == "__main__":
    main()
