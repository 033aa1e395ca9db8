"""KVQuant's calibration: from captured pre-RoPE keys, values and their Fisher information, each layer's key ranges
(percentiles per channel) and nuq tables for keys and values (weighted k-means in the normalized domain, with the
Q-Norm correction of the decode table)."""

from __future__ import annotations

import torch

from kvcal.errors import KvcalError
from kvcal.methods.kvquant.storage import key_round_trip
from kvcal.models.devmap import device_scope
from kvcal.progress import progress_bar
from kvcal.quant.kmeans import weighted_kmeans
from kvcal.quant.nonuniform import (
    dequantize_lut_dynamic,
    nearest_level,
    outlier_bounds,
    quantile,
    quantize_lut_dynamic,
    range_params,
)
from kvcal.quant.rope import apply_rope, rope_cos_sin


def fit_tables(loaded, store, *, bits: int, outliers: float, sink: int, weighting: str, datatype: str,
               use_qnorm: bool, key_granularity: str, value_scope: str, pre_rope: bool, key_per_side: int,
               value_per_side: int, kmeans_inits: int, kmeans_iters: int, seed: int):
    """(tensors, info): every layer's tables (on the CPU) and per-layer diagnostics. key_per_side: outliers per side
    of a token's key vector (key_granularity=per_token); value_per_side: of a value vector (the token's, or one KV
    head's with value_scope=head)."""
    dims = loaded.dims
    positions = store.token_positions
    keep_rows = positions >= sink  # the sink tokens never enter calibration
    if int(keep_rows.sum()) < 2:
        raise KvcalError(f"kvquant sink={sink} leaves {int(keep_rows.sum())} calibration tokens in total: use a "
                         "longer --seqlen")
    # how a table is learned, for keys and values alike
    learn = {"bits": bits, "weighting": weighting, "datatype": datatype, "use_qnorm": use_qnorm, "seed": seed,
             "kmeans_inits": kmeans_inits, "kmeans_iters": kmeans_iters}
    tensors, info = {}, {"key_outlier_rate": [], "fisher_err_k": [], "fisher_err_v": []}
    with progress_bar("kvquant: fitting datatypes", dims.num_layers) as advance:
        for i in range(dims.num_layers):
            def fit(i=i):
                device = loaded.layer_device(i)  # each layer's fit runs where that layer is
                with device_scope(device):
                    return fit_layer(i, store, device, keep_rows, positions, loaded, outliers=outliers,
                                     key_granularity=key_granularity, value_scope=value_scope, pre_rope=pre_rope,
                                     key_per_side=key_per_side, value_per_side=value_per_side, learn=learn)

            # each finished layer is checkpointed (kvcal/calib/checkpoint.py): a resumed run starts after it
            layer_tensors, numbers = store.checkpoints.layer("tables", i, fit)
            tensors.update({f"layers.{i}.{name}": t for name, t in layer_tensors.items()})
            for name, value in numbers.items():
                info[name].append(value)
            advance()
    return tensors, info


def fit_layer(i, store, device, keep_rows, positions, loaded, *, outliers: float, key_granularity: str,
              value_scope: str, pre_rope: bool, key_per_side: int, value_per_side: int, learn: dict):
    """Layer i's tables (named without the layer prefix) and its numbers (key_outlier_rate, fisher_err_k,
    fisher_err_v); `learn`: the keyword arguments of fit_dynamic that say how a table is learned."""
    dims = loaded.dims
    data = {name: t.to(device) for name, t in store.layer(i).items()}
    k = data["k"]
    if not pre_rope:
        k = rotate_rows(k, positions.to(device), loaded.adapter.inv_freq_on(device), dims)
    k, v = k[keep_rows], data["v"][keep_rows]
    fk = data["fisher_k"][keep_rows] if "fisher_k" in data else None
    fv = data["fisher_v"][keep_rows] if "fisher_v" in data else None
    key_tables, k_rate, k_err = fit_keys(k, fk, key_per_side, outliers, key_granularity, **learn)
    if value_scope == "head":  # each (token, head) is a vector of its own
        v, fv = (None if x is None else x.reshape(-1, dims.head_dim) for x in (v, fv))
    value_tables, _, v_err = fit_dynamic(v, fv, value_per_side, **learn)
    layer_tensors = {**key_tables, **{f"v.{n}": t for n, t in value_tables.items()}}
    return layer_tensors, {"key_outlier_rate": round(k_rate, 5), "fisher_err_k": k_err, "fisher_err_v": v_err}


def fit_keys(k, fisher, per_side: int, outliers: float, key_granularity: str, *, bits: int, weighting: str,
             datatype: str, use_qnorm: bool, seed: int, kmeans_inits: int, kmeans_iters: int):
    """Key tables {"k.lo", "k.hi", "k.encode", "k.decode"} (per channel: ranges at the outlier percentiles), the
    fraction of elements outside the ranges, and the Fisher-weighted error; per token: as fit_dynamic."""
    learn = {"datatype": datatype, "use_qnorm": use_qnorm, "seed": seed, "kmeans_inits": kmeans_inits,
             "kmeans_iters": kmeans_iters}
    if key_granularity == "per_token":
        tables, rate, err = fit_dynamic(k, fisher, per_side, bits=bits, weighting=weighting, **learn)
        return {f"k.{n}": t for n, t in tables.items()}, rate, err
    tail = outliers / 2
    lo = quantile(k, tail, dim=0) if outliers else k.amin(0)
    hi = quantile(k, 1 - tail, dim=0) if outliers else k.amax(0)
    zero, scale = range_params(lo, hi)
    xn = (k - zero) / scale
    inside = xn.abs() <= 1
    weights = fisher_weights(fisher, scale.expand_as(k), weighting, datatype)
    encode, decode = datatype_tables(xn[inside], None if weights is None else weights[inside], bits, **learn)
    tables = {"k.lo": lo, "k.hi": hi, "k.encode": encode, "k.decode": decode}
    k_hat = key_round_trip(k[:, None], {f"k_{n}": t for n, t in (("lo", lo), ("hi", hi), ("encode", encode),
                                                                  ("decode", decode))},
                           bits, key_granularity, outliers, True, 0)[:, 0]
    return tables, float((~inside).float().mean()), fisher_err(fisher, k, k_hat)


def fit_dynamic(x, fisher, per_side: int, *, bits: int, weighting: str, datatype: str, use_qnorm: bool, seed: int,
                kmeans_inits: int, kmeans_iters: int):
    """Tables {"encode", "decode"} of vectors x [N, C] quantized with their own ranges (per_side outliers at each
    end kept exact), the outlier fraction and the Fisher-weighted error."""
    lo, hi, outlier = outlier_bounds(x, per_side, dim=-1)
    zero, scale = range_params(lo, hi)
    xn = (x - zero) / scale
    inside = ~outlier
    weights = fisher_weights(fisher, scale.expand_as(x), weighting, datatype)
    encode, decode = datatype_tables(xn[inside], None if weights is None else weights[inside], bits, datatype=datatype,
                                     use_qnorm=use_qnorm, seed=seed, kmeans_inits=kmeans_inits,
                                     kmeans_iters=kmeans_iters)
    codes, s, z, idx, val = quantize_lut_dynamic(x[:, None], encode, decode, bits, per_side,
                                                 residual_dtype=torch.float64)
    x_hat = dequantize_lut_dynamic(codes, s, z, decode, bits, x.shape[-1], idx, val)[:, 0]
    return {"encode": encode, "decode": decode}, float(outlier.float().mean()), fisher_err(fisher, x, x_hat)


def fisher_weights(fisher, scale, weighting: str, datatype: str):
    """k-means weights: F * s^2 (fisher_scale), F (fisher) or none (also for the int datatype)."""
    if weighting == "none" or datatype != "nuq":
        return None
    if fisher is None:
        raise KvcalError("kvquant: Fisher information was not captured")
    return fisher * scale**2 if weighting == "fisher_scale" else fisher


def datatype_tables(values: torch.Tensor, weights: torch.Tensor | None, bits: int, *, datatype: str, use_qnorm: bool,
                    seed: int, kmeans_inits: int, kmeans_iters: int):
    """(encode, decode) tables [2^bits]: sorted levels (weighted k-means of the normalized values, or uniform for the
    int datatype), and the Q-Norm-corrected copy."""
    levels = 1 << bits
    if datatype == "int":
        encode = torch.linspace(-1, 1, levels, device=values.device)
    else:
        encode = weighted_kmeans(values, levels, weights, seed=seed, n_init=kmeans_inits,
                                 max_iter=kmeans_iters).centers[:, 0]
    decode = encode.clone()
    if use_qnorm:
        # Match mean and std of the rounded values to the originals (per-matrix, unweighted, [S] eq. 3).
        rounded = encode[nearest_level(values.clamp(-1, 1), encode)]
        a = values.std() / rounded.std().clamp_min(1e-12)
        decode = (encode - rounded.mean()) * a + values.mean()
    return encode, decode


def fisher_err(fisher, x, x_hat) -> float:
    """Sum of F * (x - Q(x))^2 over the calibration elements (per-layer sensitivity, for diagnostics)."""
    if fisher is None:
        return float(((x - x_hat) ** 2).sum())
    return float((fisher * (x - x_hat) ** 2).sum())


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B, T, H*D] (one row per token, channels in projection order)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def rotate_rows(rows: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, dims) -> torch.Tensor:
    """Apply RoPE to token rows [N, C] at their positions [N] (for the post-RoPE ablation)."""
    cos, sin = rope_cos_sin(inv_freq, positions[None], torch.float32)
    x = rows.view(1, -1, dims.num_kv_heads, dims.head_dim).transpose(1, 2)
    return to_rows(apply_rope(x, cos, sin))[0]
