"""SKVQ's calibration, per layer and separately for K and V: the channel layout (k-means over each channel's
(min, max) on the calibration tokens, clusters as quantization groups) and the clip ratios (a grid search that
minimises the MSE of the attention output after o_proj)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcal.errors import KvcalError
from kvcal.methods.skvq.storage import ChannelQuantizer, GroupLayout
from kvcal.models.adapter import attention_modules
from kvcal.models.devmap import device_scope
from kvcal.progress import progress_bar
from kvcal.quant.kmeans import weighted_kmeans
from kvcal.quant.rope import apply_rope, rope_cos_sin

CLIP_STEP = 0.01
KMEANS_N_INIT = 10  # [code]: sklearn KMeans(n_init=10)


def clip_grid(lowest: float) -> tuple[float, ...]:
    """alpha in {1.00, 0.99, ..., lowest} (rec #8 with lowest = 0.80; the paper gives no grid). Descending,
    so that on a tie the search keeps the weaker clip."""
    return tuple(round(1.0 - CLIP_STEP * i, 2) for i in range(round((1.0 - lowest) / CLIP_STEP) + 1))


CLIP_GRID = clip_grid(0.8)


class AttentionOutputError:
    """The clip search objective of one layer ([paper] §3.1): MSE of the attention output after o_proj
    when K and/or V are fake-quantized, against the full-precision output (rec #9).

    Every layer sees full-precision inputs (captured from the unquantized model, so errors do not
    propagate across layers), every non-sink token is quantized (window 0: independent of W), and
    only a subset is used for speed: the first `windows` calibration windows and `queries` query
    positions spread evenly over each, each query attending causally to all keys of its window.

    The search calls `probabilities` once per key candidate and `loss` once per (keys, values) pair, so a
    value search over a fixed key reconstruction costs one matmul per candidate.
    """

    def __init__(self, rows: dict[str, torch.Tensor], positions: torch.Tensor, module, dims, inv_freq,
                 sink: int, windows: int, queries: int):
        starts = torch.nonzero(positions == 0).flatten().tolist()
        length = (starts[1] if len(starts) > 1 else positions.numel()) - starts[0]
        if length <= sink:
            raise KvcalError(f"calibration windows of {length} tokens leave nothing to quantize after {sink} sinks")
        device = module.o_proj.weight.device
        n = min(windows, len(starts))
        kv_heads, head_dim = dims.num_kv_heads, dims.head_dim

        def heads(name: str, num_heads: int) -> torch.Tensor:  # [N, H*D] rows -> [n, H, T, D]
            t = rows[name][: n * length].to(device, torch.float32)
            return t.reshape(n, length, num_heads, head_dim).transpose(1, 2)

        self.k, self.v = heads("k", kv_heads), heads("v", kv_heads)
        self.cos, self.sin = rope_cos_sin(inv_freq.to(device), torch.arange(length, device=device)[None], torch.float32)
        self.sink, self.scale = sink, module.scaling
        picked = torch.linspace(sink, length - 1, min(queries, length - sink), device=device).round().long().unique()
        q = apply_rope(heads("q", dims.num_heads), self.cos, self.sin)[:, :, picked]
        # GQA as in transformers' repeat_kv: query head j reads KV head j // (Hq / Hkv). Queries are laid out
        # [n, Hkv, Hq/Hkv * nq, D] so that one batched matmul per KV head covers its query heads.
        self.q = q.reshape(n, kv_heads, -1, head_dim)
        self.query_heads, self.num_queries = dims.num_heads, picked.numel()
        causal = torch.arange(length, device=device)[None, :] <= picked[:, None]  # [nq, T]
        self.blocked = ~causal.repeat(dims.num_heads // kv_heads, 1)
        self.weight = module.o_proj.weight.detach().to(torch.float32)
        bias = module.o_proj.bias
        self.bias = None if bias is None else bias.detach().to(torch.float32)
        self.reference = self._output(self.probabilities(self.k), self.v)

    @property
    def tokens(self) -> dict:
        return {"windows": self.k.shape[0], "queries_per_window": self.num_queries, "keys_per_window": self.k.shape[2]}

    def quantize(self, x: torch.Tensor, quantizer: ChannelQuantizer, alpha: torch.Tensor) -> torch.Tensor:
        out = quantizer.apply(x, alpha)
        out[:, :, : self.sink] = x[:, :, : self.sink]  # sinks are never quantized
        return out

    def probabilities(self, k_pre: torch.Tensor) -> torch.Tensor:
        """Attention weights [n, Hkv, Hq/Hkv * nq, T] of the picked queries over pre-RoPE keys."""
        scores = self.q @ apply_rope(k_pre, self.cos, self.sin).transpose(-1, -2) * self.scale
        return torch.softmax(scores.masked_fill(self.blocked, float("-inf")), dim=-1)

    def _output(self, probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, head_dim = v.shape[0], v.shape[-1]
        out = (probs @ v).reshape(n, self.query_heads, self.num_queries, head_dim)
        return F.linear(out.transpose(1, 2).flatten(2), self.weight, self.bias)

    def loss(self, probs: torch.Tensor, v: torch.Tensor) -> float:
        return float(F.mse_loss(self._output(probs, v), self.reference))


def grid_search(loss, alpha: torch.Tensor, grid: tuple[float, ...], groups: list[int] | None = None,
                ) -> tuple[torch.Tensor, list[float]]:
    """Try every grid value for the given groups (all of them at once if None) and keep the best.

    Returns the updated alpha and the loss at each grid point. The first minimum wins, i.e. the largest
    ratio among equal losses.
    """
    losses = []
    for value in grid:
        trial = alpha.clone()
        trial[groups if groups is not None else slice(None)] = value
        losses.append(loss(trial))
    best = min(range(len(grid)), key=losses.__getitem__)
    alpha = alpha.clone()
    alpha[groups if groups is not None else slice(None)] = grid[best]
    return alpha, losses



def fit_layouts_and_clips(loaded, store, *, k_bits: float, v_bits: float, group_size: int, num_groups: int,
                          reorder: bool, clip: str, clip_value: float, clip_min: float, param_dtype: str, sink: int,
                          clip_windows: int, clip_queries: int, seed: int, warning: str | None):
    """(tensors, info): every layer's channel layouts (perm, group_offsets) and clip ratios for K and V, the clip
    search's loss curves, and the calibration's numbers (`warning`: the config's warning for this model, recorded)."""
    dims = loaded.dims
    positions = store.token_positions
    # Channel statistics leave out the sink positions: those tokens are never quantized, and the
    # first tokens carry extreme values that would skew the ranges (rec #1; the [code] uses all).
    stats_rows = positions >= sink
    if not stats_rows.any():
        raise KvcalError(f"skvq sink={sink} covers every calibration token: use a longer --seqlen")
    modules = attention_modules(loaded.model)
    tensors, alphas, group_sizes, search = {}, {"k": [], "v": []}, {"k": [], "v": []}, None
    def fit(i):
        """Layer i's tensors (named without the layer prefix) and numbers."""
        rows = store.layer(i)
        quantizers = {}
        for kind, bits in (("k", k_bits), ("v", v_bits)):
            layout = channel_layout(rows[kind][stats_rows], dims.kv_channels, group_size, num_groups, reorder, seed)
            quantizers[kind] = ChannelQuantizer(layout, torch.ones(layout.num_groups), bits, param_dtype)
        curves, numbers = {}, {"search": None}
        if clip in ("layer", "group"):  # on the layer's device (where its o_proj is)
            with device_scope(loaded.layer_device(i)):
                objective = AttentionOutputError(rows, positions, modules[i], dims, loaded.adapter.inv_freq,
                                                 sink, clip_windows, clip_queries)
                curves = search_clips(objective, quantizers["k"], quantizers["v"], clip, clip_min)
            numbers["search"] = objective.tokens
        elif clip == "global":
            for q in quantizers.values():
                q.alpha = torch.full_like(q.alpha, clip_value)
        layer_tensors = {}
        for kind, q in quantizers.items():
            layer_tensors[f"{kind}.perm"] = q.layout.perm.to(torch.int32)
            layer_tensors[f"{kind}.group_offsets"] = q.layout.offsets.to(torch.int32)
            layer_tensors[f"{kind}.clip"] = q.alpha.clone()
            if kind in curves:
                layer_tensors[f"{kind}.clip_loss"] = torch.tensor(curves[kind], dtype=torch.float32)
            numbers[f"alpha_{kind}"] = [round(a, 2) for a in q.alpha.tolist()]
            numbers[f"sizes_{kind}"] = q.layout.sizes
        return layer_tensors, numbers

    with progress_bar("skvq: channel layouts and clips", dims.num_layers) as advance:
        for i in range(dims.num_layers):
            # each finished layer is checkpointed (kvcal/calib/checkpoint.py): a resumed run starts after it
            layer_tensors, numbers = store.checkpoints.layer("layouts", i, lambda i=i: fit(i))
            tensors.update({f"layers.{i}.{name}": t for name, t in layer_tensors.items()})
            for kind in ("k", "v"):
                alphas[kind].append(numbers[f"alpha_{kind}"])
                group_sizes[kind].append(numbers[f"sizes_{kind}"])
            search = numbers["search"] if numbers["search"] is not None else search
            advance()
    info = {
        "warning": warning,
        "kmeans": {"features": "per-channel (min, max), sink positions excluded", "n_init": KMEANS_N_INIT,
                   "seed": seed} if reorder else None,
        "group_sizes_k": group_sizes["k"],
        "group_sizes_v": group_sizes["v"],
        "clip_k": alphas["k"],
        "clip_v": alphas["v"],
    }
    if search is not None:
        info["clip_search"] = {"grid": list(clip_grid(clip_min)),
                               "objective": "attention output MSE after o_proj",
                               "quantized": "all non-sink tokens (window 0)", **search}
    return tensors, info


def channel_layout(rows: torch.Tensor, channels: int, group_size: int, num_groups: int, reorder: bool,
                   seed: int) -> GroupLayout:
    """The channel groups of one tensor kind from its calibration rows [N, C]: `num_groups` k-means clusters of the
    channels' (min, max), or (reorder false) consecutive channels in groups of group_size."""
    if not reorder:
        return GroupLayout.contiguous(channels, group_size)
    # [code]: features = each channel's raw global (min, max) over the calibration tokens.
    features = torch.stack([rows.amin(0), rows.amax(0)], dim=1)
    result = weighted_kmeans(features, num_groups, seed=seed, n_init=KMEANS_N_INIT)
    return GroupLayout.from_clusters(result.labels.cpu(), result.centers.cpu())


def search_clips(objective: AttentionOutputError, k_quant: ChannelQuantizer, v_quant: ChannelQuantizer, clip: str,
                 clip_min: float) -> dict[str, list[float]]:
    """Per layer, alpha_K and alpha_V searched separately on the grid 1.00, 0.99, ..., clip_min (rec #7; the paper
    says per group, the [code] uses one hand-set ratio): alpha_K with V in full precision, then alpha_V with K
    quantized at the chosen alpha_K. clip=group then refines group by group (coordinate descent, one sweep, K then V,
    both quantized). Sets the quantizers' alpha; returns the per-layer loss curves."""
    k, v, grid = objective.k, objective.v, clip_grid(clip_min)

    def key_loss(alpha, v_hat):
        return objective.loss(objective.probabilities(objective.quantize(k, k_quant, alpha)), v_hat)

    def value_loss(alpha, probs):
        return objective.loss(probs, objective.quantize(v, v_quant, alpha))

    k_quant.alpha, k_curve = grid_search(lambda a: key_loss(a, v), k_quant.alpha, grid)
    probs = objective.probabilities(objective.quantize(k, k_quant, k_quant.alpha))
    v_quant.alpha, v_curve = grid_search(lambda a: value_loss(a, probs), v_quant.alpha, grid)
    if clip == "group":
        v_hat = objective.quantize(v, v_quant, v_quant.alpha)
        for g in range(k_quant.layout.num_groups):
            k_quant.alpha, _ = grid_search(lambda a: key_loss(a, v_hat), k_quant.alpha, grid, [g])
        probs = objective.probabilities(objective.quantize(k, k_quant, k_quant.alpha))
        for g in range(v_quant.layout.num_groups):
            v_quant.alpha, _ = grid_search(lambda a: value_loss(a, probs), v_quant.alpha, grid, [g])
    return {"k": k_curve, "v": v_curve}
