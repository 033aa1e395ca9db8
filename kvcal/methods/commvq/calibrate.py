"""CommVQ's calibration: what a layer learns from its captured activations (citations as in method.py).

- Keys: the residual codebooks of each group, fitted by soft EM on unit keys (weighted by kappa^2) with the official
  temperature schedule scaled to the model (§3.5, §8 items 8-9), all groups of a layer in one batched EM
  (quant/vq.fit_residual_groups).
- Values: the encoder and codebook of the learned additive code [C] (§3.2), trained per layer with straight-through
  Gumbel codes (tau 1), AdamW as the official code, and the official loss 1/2 MSE(v_hat, v) + MSE of the attention
  output after o_proj (§8 item 4).

The functions take the settings as plain values (KeyFit, ValueFit: what CommVQ reads from its config and the model's
shapes) and tensors; every random draw comes from a generator seeded by (seed, layer, ...), never the global RNG.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcal.errors import KvcalError
from kvcal.methods.commvq.storage import (
    VALUE_EPS,
    decode_values,
    encode_values,
    normalize_values,
    pair_channels,
    value_logits,
)
from kvcal.models.devmap import device_scope
from kvcal.progress import progress_bar
from kvcal.quant import vq
from kvcal.quant.rope import apply_rope, rope_cos_sin
from kvcal.quant.uniform import fake_quant_groups

HELD_OUT_VALUE_TOKENS = 32768  # tokens of the held-out windows used for value diagnostics (a cap)
ATTENTION_CACHE_BYTES = 1 << 30  # attention weights of the value loss's blocks kept per layer (CPU)
ATTENTION_CACHE_BYTES_GPU = 8 << 30  # on a GPU: all blocks of 64 x 1024 tokens at Llama-3.1-8B shapes (~4 GB)


def derived_seed(*parts) -> int:
    """A stable seed for a (seed, layer, group, stage, ...) tuple: no global RNG, the same on every machine."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(derived_seed(*parts))



@dataclass(frozen=True)
class KeyFit:
    """The key codebooks' settings for one model: N' codewords per pair and stage, `stages` residual stages over
    `groups` groups of `group_pairs` RoPE pairs, the EM budget, the temperature of each stage's first step, and the
    code bits of the scalar reference the diagnostics compare with."""

    bits: int
    codes: int
    stages: int
    groups: int
    group_pairs: int
    train_vectors: int
    em_steps: int
    em_tol: float
    temperatures: tuple[float, ...]


@dataclass(frozen=True)
class ValueFit:
    """The value coder's settings for one model: n_e `groups` of 2 code bits, the encoder's hidden width, the loss
    ("attention" or "mse"), the AdamW budget and schedule, the Gumbel temperature, and the code bits of the scalar
    reference the diagnostics compare with."""

    bits: int
    groups: int
    hidden: int
    loss: str
    steps: int
    batch_tokens: int
    attn_tokens: int
    lr: float
    weight_decay: float
    warmup: int
    gumbel_tau: float


def window_bounds(positions: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) rows of each calibration window (a window starts where the position is 0)."""
    starts = torch.nonzero(positions == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        raise KvcalError("commvq: the captured tokens do not start a window at position 0")
    ends = starts[1:] + [positions.numel()]
    return list(zip(starts, ends))


def held_out_windows(count: int, fraction: float, seed: int) -> set[int]:
    """The held-out windows: round(fraction x count), at least 1 when fraction > 0, chosen by the seed."""
    if fraction <= 0:
        return set()
    n = max(1, int(fraction * count + 0.5))
    if n >= count:
        raise KvcalError(f"commvq holdout={fraction:g} leaves no training window of the {count} calibration windows "
                         "(use more --nsamples or holdout=0)")
    return set(torch.randperm(count, generator=generator(seed, "holdout"))[:n].tolist())


def rows_of(windows, held: set[int], want_held: bool) -> torch.Tensor:
    parts = [torch.arange(s, e) for j, (s, e) in enumerate(windows) if (j in held) == want_held]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def key_scalar_mse(k: torch.Tensor, bits: int, dims, group: int = 32) -> float:
    """The KIVI-style reference at the same code bits: keys per channel over groups of `group` consecutive
    tokens, asymmetric min/max, fp16 scale and zero (digest §9's quality gate)."""
    x = k.to(torch.float32)
    return float((fake_quant_groups(x.T.contiguous(), bits, -1, group).T - x).square().mean())


def value_scalar_mse(v: torch.Tensor, bits: int, group: int = 32) -> float:
    """KIVI-style values at the same code bits: per token, groups of `group` channels (Table 11's baseline)."""
    group = group if v.shape[-1] % group == 0 else v.shape[-1]
    return float((fake_quant_groups(v, bits, -1, group) - v).square().mean())


def init_value_params(v: torch.Tensor, groups: int, hidden: int, gen: torch.Generator, device) -> dict:
    """Encoder parameters: torch's nn.Linear / nn.LayerNorm initialisation from a seeded generator, the codebook
    N(0, 1) as the official `torch.randn`, the frozen scale = mean |v| per channel [C] (training/make_scale.py;
    plus eps, the same in encode and decode where the code divides by scale + 1e-6 and multiplies by scale)."""
    channels = v.shape[-1]

    def uniform(shape, fan_in):
        bound = 1 / math.sqrt(fan_in)
        return (torch.rand(shape, generator=gen) * 2 - 1) * bound

    params = {
        "codebook": torch.randn(2 * groups, channels, generator=gen),
        "ln_weight": torch.ones(channels),
        "ln_bias": torch.zeros(channels),
        "fc1_weight": uniform((hidden, channels), channels),
        "fc1_bias": uniform((hidden,), channels),
        "fc2_weight": uniform((4 * groups, hidden), hidden),
        "fc2_bias": uniform((4 * groups,), hidden),
    }
    params = {n: t.to(device).requires_grad_(True) for n, t in params.items()}
    params["channel_scale"] = v.abs().mean(0).detach() + VALUE_EPS
    return params


def gumbel_hard(logits: torch.Tensor, tau: float, gen: torch.Generator) -> torch.Tensor:
    """gumbel_softmax(hard=True) [C] with a seeded generator: one-hot forward, softmax gradient. The noise is
    drawn on the generator's device (a GPU generator on a GPU: no host-side draw and copy per step)."""
    u = torch.rand(logits.shape, generator=gen, device=gen.device).to(logits.device).clamp_(1e-10, 1 - 1e-7)
    soft = torch.softmax((logits - torch.log(-torch.log(u))) / tau, dim=-1)
    # one_hot(argmax) written as a scatter: F.one_hot validates its indices, a host sync on a GPU
    hard = torch.zeros_like(soft).scatter_(-1, soft.argmax(-1, keepdim=True), 1.0)
    return hard - soft.detach() + soft


def training_bits(onehot: torch.Tensor) -> torch.Tensor:
    """category_bits for training: bits (y0 + y2, y1 + y2) of the map 0 -> 10, 1 -> 01, 2 -> 11, 3 -> 00 [C], as
    sums instead of a product with the map's table (no table copied to the device every step)."""
    y = onehot.unbind(-1)
    return torch.stack((y[0] + y[2], y[1] + y[2]), dim=-1).flatten(-2)


def reconstruct_training(params, x: torch.Tensor, tau: float, gen: torch.Generator) -> torch.Tensor:
    """Training-time decode of value rows x [M, C] through straight-through Gumbel codes [C]."""
    unit, rho0 = normalize_values(x, params["channel_scale"])
    logits = value_logits(params, unit, params["codebook"].shape[0] // 2)
    u = training_bits(gumbel_hard(logits, tau, gen)) @ params["codebook"]
    return params["channel_scale"] * ((rho0 + VALUE_EPS) / (u.norm(dim=-1) + VALUE_EPS))[:, None] * u


class AttentionOutputLoss:
    """The official value loss's second term on one layer [C]: MSE of o_proj(attention) with quantized values
    against the full-precision one, queries and keys unquantized. Blocks of `block` query tokens of a window;
    the block's queries attend causally to all keys of the window up to the block's end, with the values of
    the block quantized and those before it exact (the official code quantizes every value of a sequence;
    blocks keep the cost bounded on a CPU, digest §9). The difference of outputs is linear in v_hat - v:
    o_proj(P_block (v_hat - v)_block), bias cancelled."""

    def __init__(self, data, windows, module, loaded, block: int, device, cache_bytes: int | None = None):
        dims = loaded.dims
        on_gpu = torch.device(device).type == "cuda"
        # on a GPU the layer's queries and keys move once (in their captured dtype), not one block per step
        self.q, self.k = (data["q"].to(device), data["k"].to(device)) if on_gpu else (data["q"], data["k"])
        if cache_bytes is None:
            cache_bytes = ATTENTION_CACHE_BYTES_GPU if on_gpu else ATTENTION_CACHE_BYTES
        self.dims, self.device = dims, device
        self.inv_freq = loaded.adapter.inv_freq_on(torch.device(device))
        self.scale = float(module.scaling)
        self.weight = module.o_proj.weight.detach().to(device, torch.float32)
        self.blocks = [(s, b, min(b + block, e - s)) for s, e in windows for b in range(0, e - s, block)]
        # the weights of a block never change: kept once computed, up to a memory budget
        self.cache: dict[int, torch.Tensor] = {}
        self.cache_budget, self.cached_bytes = cache_bytes, 0

    def rows(self, index: int) -> torch.Tensor:
        return torch.arange(*self.span(index))

    def span(self, index: int) -> tuple[int, int]:
        """[first, end) rows of the block (consecutive)."""
        start, b0, b1 = self.blocks[index]
        return start + b0, start + b1

    def probabilities(self, index: int) -> torch.Tensor:
        """Attention weights [Hkv, rep * L, L] of the block's queries over the block's keys (full softmax)."""
        if index in self.cache:
            return self.cache[index]
        probs = self._probabilities(index)
        nbytes = probs.numel() * probs.element_size()
        if self.cached_bytes + nbytes <= self.cache_budget:
            self.cache[index] = probs
            self.cached_bytes += nbytes
        return probs

    def _probabilities(self, index: int) -> torch.Tensor:
        dims = self.dims
        start, b0, b1 = self.blocks[index]
        d, hkv = dims.head_dim, dims.num_kv_heads
        q = self.q[start + b0 : start + b1].to(self.device, torch.float32).view(1, b1 - b0, dims.num_heads, d)
        k = self.k[start : start + b1].to(self.device, torch.float32).view(1, b1, hkv, d)
        cos, sin = rope_cos_sin(self.inv_freq, torch.arange(b1, device=self.device)[None], torch.float32)
        q = apply_rope(q.transpose(1, 2), cos[:, b0:], sin[:, b0:])[0]  # [Hq, L, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)[0]  # [Hkv, b1, D]
        q = q.reshape(hkv, -1, d)  # [Hkv, rep * L, D]: query head j reads KV head j // rep
        scores = q @ k.transpose(1, 2) * self.scale
        query_pos = torch.arange(b0, b1, device=self.device).repeat(dims.num_heads // hkv)
        blocked = torch.arange(b1, device=self.device)[None, :] > query_pos[:, None]
        return torch.softmax(scores.masked_fill(blocked, float("-inf")), dim=-1)[..., b0:]

    def loss(self, probs: torch.Tensor, diff: torch.Tensor) -> torch.Tensor:
        """diff [L, C] = v_hat - v of the block -> mean squared o_proj output difference."""
        dims = self.dims
        length = diff.shape[0]
        per_head = diff.view(length, dims.num_kv_heads, dims.head_dim).transpose(0, 1)  # [Hkv, L, D]
        out = (probs @ per_head).view(dims.num_heads, length, dims.head_dim)
        return F.linear(out.transpose(0, 1).reshape(length, -1), self.weight).square().mean()


def learning_rate(fit: ValueFit, step: int) -> float:
    """Linear warmup then cosine to 0 ([C] WarmupCosineLR of the 1-bit script; the warmup is capped at a fifth of
    a short budget so that it ends)."""
    warmup = min(fit.warmup, fit.steps // 5)
    if step < warmup:
        return fit.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, fit.steps - warmup)
    return fit.lr * 0.5 * (1 + math.cos(math.pi * progress))


def training_state(params, optimizer, gen, noise, tail) -> dict[str, torch.Tensor]:
    """What train_value_coder needs to continue from a step as if never stopped: the parameters, AdamW's moments and
    step counts, the generators' states and the tail loss so far."""
    state = {f"param.{n}": t for n, t in params.items() if n != "channel_scale"}
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                state[f"opt.{index}.{key}"] = value
            index += 1
    state["gen"] = gen.get_state()
    if noise is not gen:
        state["noise"] = noise.get_state()
    state["tail"] = tail
    return state


def restore_training(saved: dict[str, torch.Tensor], params, optimizer, gen, noise, tail) -> None:
    """training_state's tensors back into the live objects (AdamW places its step counts as it does for any
    state_dict)."""
    with torch.no_grad():
        for n, t in params.items():
            if n != "channel_scale":
                t.copy_(saved[f"param.{n}"])
        tail.copy_(saved["tail"])
    sd = optimizer.state_dict()
    for index in range(sum(len(g["params"]) for g in optimizer.param_groups)):
        prefix = f"opt.{index}."
        entry = {n[len(prefix):]: t for n, t in saved.items() if n.startswith(prefix)}
        if entry:
            sd["state"][index] = entry
    optimizer.load_state_dict(sd)
    gen.set_state(saved["gen"])
    if noise is not gen:
        noise.set_state(saved["noise"])


def train_value_coder(params, v, train_rows, attention, fit: ValueFit, gen, advance, checkpoints=None,
                      name: str = "") -> float:
    """AdamW on the encoder and codebook of one layer [C]: lr fit.lr (1e-3), weight decay fit.weight_decay (0.1) on
    weights and codebook (none on biases and LayerNorm, as the HF Trainer groups them), betas (0.9, 0.95), grad-norm
    clip 1.0, the learning rate of `learning_rate` at each step.
    Returns the mean training loss of the last tenth of the steps.

    On a GPU: the Gumbel noise comes from a GPU generator seeded from `gen` (deterministic per seed; the batch
    picks stay on `gen`), AdamW is the fused kernel, and nothing syncs the host inside the loop (the tail loss
    is summed on the device). On the CPU everything draws from `gen`, as before.

    checkpoints (kvcal/calib/checkpoint.Checkpoints): the training state is saved there as entry `name` whenever it
    is due, and a saved state is continued from (the same parameters, bit for bit, as an uninterrupted run)."""
    trainable = [t for n, t in params.items() if n != "channel_scale"]
    decay = [params[n] for n in ("codebook", "fc1_weight", "fc2_weight")]
    no_decay = [params[n] for n in ("ln_weight", "ln_bias", "fc1_bias", "fc2_bias")]
    on_gpu = v.device.type == "cuda"
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": fit.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=fit.lr,
                                  betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if on_gpu else {}))
    noise = gen
    if on_gpu:
        noise = torch.Generator(device=v.device).manual_seed(derived_seed(gen.initial_seed(), "gumbel"))
    tail, tail_start = torch.zeros((), device=v.device), fit.steps - max(1, fit.steps // 10)
    per_step = max(1, fit.batch_tokens // fit.attn_tokens)
    first = 0
    saved = checkpoints.load(name) if checkpoints is not None else None
    if saved is not None:
        restore_training(saved[0], params, optimizer, gen, noise, tail)
        first = int(saved[1]["step"])
        advance(first)
    with torch.enable_grad():
        for step in range(first, fit.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(fit, step)
            if attention is not None:
                picks = torch.randint(len(attention.blocks), (per_step,), generator=gen).tolist()
                loss = 0.0
                for index in picks:
                    lo, hi = attention.span(index)
                    x = v[lo:hi]
                    v_hat = reconstruct_training(params, x, fit.gumbel_tau, noise)
                    with torch.no_grad():
                        probs = attention.probabilities(index)
                    loss = loss + (0.5 * F.mse_loss(v_hat, x) + attention.loss(probs, v_hat - x)) / len(picks)
            else:
                pick = torch.randint(train_rows.numel(), (fit.batch_tokens,), generator=gen)
                x = v[train_rows[pick.to(train_rows.device)]]
                loss = F.mse_loss(reconstruct_training(params, x, fit.gumbel_tau, noise), x)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            if step >= tail_start:
                tail += loss.detach()
            advance()
            if checkpoints is not None and step + 1 < fit.steps and checkpoints.due():
                checkpoints.save(name, training_state(params, optimizer, gen, noise, tail), {"step": step + 1})
    for t in trainable:
        t.requires_grad_(False)
    return float(tail) / (fit.steps - tail_start)


# -- one layer, one model --------------------------------------------------------------------------------


def fit_keys(k: torch.Tensor, train_rows, held_rows, layer: int, dims, device, advance, fit: KeyFit, seed: int):
    """Codebooks of one layer: theta [G, R, N, g, 2] and diagnostics."""
    n_train = min(fit.train_vectors, train_rows.numel())
    pick = train_rows[torch.randperm(train_rows.numel(), generator=generator(seed, layer, "keys"))[:n_train]]
    # held-out vectors: 10% of the total (1/9 of the training count), from the held-out windows [D §8 item 10]
    n_held = min(held_rows.numel(), math.ceil(n_train / 9))
    held_pick = held_rows[torch.randperm(held_rows.numel(), generator=generator(seed, layer, "held"))[:n_held]]
    channels = pair_channels(dims.num_kv_heads, dims.head_dim, fit.group_pairs)

    def prepare(rows):
        x = k[rows].to(device, torch.float32)
        norms = x.norm(dim=-1)
        unit = x / norms.clamp_min(torch.finfo(x.dtype).tiny)[:, None]
        return unit[:, channels.to(device)], norms.square()  # [M, G, g, 2], kappa^2

    train, train_w = prepare(pick)
    held, held_w = prepare(held_pick)
    # all groups of the layer in one batched EM (vq.fit_residual_groups): each group's own seed and stopping
    theta, fits, stage_mse = vq.fit_residual_groups(
        train.transpose(0, 1).contiguous(), train_w, held.transpose(0, 1).contiguous(), held_w, fit.codes,
        fit.stages, fit.em_steps, list(fit.temperatures),
        lambda grp, r: generator(seed, layer, grp, r), fit.em_tol,
        init_temperature=fit.temperatures[0] / 1e-3, on_stage=advance)
    steps = [[f.steps for f in group] for group in fits]
    hard_steps = [[f.hard_steps for f in group] for group in fits]
    max_weight = [[round(f.max_weight, 4) for f in group] for group in fits]
    groups = len(stage_mse)
    per_stage = [sum(m[r] for m in stage_mse) / groups for r in range(len(stage_mse[0]))]
    return theta, {
        "stage_mse_groups": stage_mse,
        "stage_mse": [round(m, 8) if math.isfinite(m) else None for m in per_stage],  # None: nothing held out
        "scalar_mse": round(key_scalar_mse(k[held_rows[: 32 * (held_rows.numel() // 32)]].to(device), fit.bits,
                                           dims), 8) if held_rows.numel() >= 32 else None,
        "em_steps": steps,
        "hard_steps": hard_steps,
        "max_weight": max_weight,
        "vectors": {"train": int(n_train), "held_out": int(n_held)},
    }


def fit_values(data, windows, held, module, loaded, layer, device, advance, fit: ValueFit, seed: int,
               checkpoints=None):
    """The value encoder and codebook of one layer (a dict of tensors named as VALUE_PARAMS) and diagnostics; the
    training state checkpointed as `values.<layer>.state` (train_value_coder)."""
    v = data["v"].to(device, torch.float32)
    train_windows = [w for j, w in enumerate(windows) if j not in held]
    train_rows = torch.cat([torch.arange(s, e) for s, e in train_windows]).to(device)
    params = init_value_params(v[train_rows], fit.groups, fit.hidden, generator(seed, layer, "value-init"), device)
    attention = None
    if fit.loss == "attention":
        attention = AttentionOutputLoss(data, train_windows, module, loaded, fit.attn_tokens, device)
    losses = train_value_coder(params, v, train_rows, attention, fit, generator(seed, layer, "value-train"), advance,
                               checkpoints, f"values.{layer}.state")
    held_rows = torch.cat([torch.arange(s, e) for j, (s, e) in enumerate(windows) if j in held]
                          or [train_rows.cpu()])[:HELD_OUT_VALUE_TOKENS].to(device)
    with torch.no_grad():
        x = v[held_rows]
        bits, rho = encode_values(x, params)
        mse = float((decode_values(bits, rho, params) - x).square().mean())
        categories = bits.view(-1, bits.shape[-1] // 2, 2)
        code = categories[..., 0] * 2 + categories[..., 1]  # 10 -> 2, 01 -> 1, 11 -> 3, 00 -> 0
        used = F.one_hot(code.long(), 4).amax(0)  # [n_e, 4] categories seen per group
        live = float((used.sum(-1) >= 3).float().mean())
        used_rows = float((bits.amax(0) > 0).float().mean())
        info = {"mse": round(mse, 8), "scalar_mse": round(value_scalar_mse(x, fit.bits), 8),
                "scalar_mse_token": round(value_scalar_mse(x, fit.bits, x.shape[-1]), 8),
                "train_loss": round(losses, 8), "live_groups": round(live, 4), "used_rows": round(used_rows, 4)}
        if attention is not None and held:
            info.update(held_out_attention(data, windows, held, module, loaded, params, device, fit.attn_tokens,
                                           fit.bits))
    return params, info


def held_out_attention(data, windows, held, module, loaded, params, device, block: int, bits: int) -> dict:
    """Attention-output error after o_proj on the held-out windows (values quantized block by block, at most 8
    blocks), for the learned code and for the per-token group-32 scalar quantizer at the same code bits."""
    held_windows = [w for j, w in enumerate(windows) if j in held]
    probe = AttentionOutputLoss(data, held_windows, module, loaded, block, device, cache_bytes=0)
    ours, scalar = [], []
    for index in range(min(8, len(probe.blocks))):
        x = data["v"][probe.rows(index)].to(device, torch.float32)
        probs = probe.probabilities(index)
        ours.append(float(probe.loss(probs, decode_values(*encode_values(x, params), params) - x)))
        group = 32 if x.shape[-1] % 32 == 0 else x.shape[-1]
        scalar.append(float(probe.loss(probs, fake_quant_groups(x, bits, -1, group) - x)))
    return {"attn_mse": round(sum(ours) / len(ours), 8), "attn_scalar_mse": round(sum(scalar) / len(scalar), 8)}


def resumable(checkpoints, stage: str, index: int, fit, advance, units: int):
    """Layer `index` of `stage` from the checkpoints if an interrupted run finished it (its `units` of progress
    counted at once), else fitted and saved."""
    fitted = []

    def run():
        fitted.append(True)
        return fit()

    out = checkpoints.layer(stage, index, run)
    if not fitted:
        advance(units)
    return out


def calibrate_layers(loaded, store, keys: KeyFit, values: ValueFit, holdout: float, seed: int):
    """Every layer's key codebooks, then every layer's value coder, each fitted where its layer is, from the captured
    activations of `store` (windows starting at position 0, a `holdout` fraction of them held out for the
    diagnostics). Returns the artifact's tensors and the per-layer diagnostics (windows, key_*, value_* lists). Each
    finished layer, and the value training in progress, is checkpointed in `store.checkpoints`."""
    from kvcal.models.adapter import attention_modules  # transformers: loaded when a model is calibrated

    dims = loaded.dims
    positions = store.token_positions
    windows = window_bounds(positions)
    held = held_out_windows(len(windows), holdout, seed)
    train_rows, held_rows = rows_of(windows, held, False), rows_of(windows, held, True)
    if train_rows.numel() == 0:
        raise KvcalError("commvq: no calibration tokens left for training after the held-out windows")
    groups, stages = keys.groups, keys.stages
    checkpoints = store.checkpoints
    modules = attention_modules(loaded.model) if values.loss == "attention" else None
    tensors, keys_info, values_info = {}, [], []
    with progress_bar(f"commvq: key codebooks (EM, {groups} groups x {stages} stages)",
                      dims.num_layers * groups * stages) as advance:
        for i in range(dims.num_layers):
            def fit_layer(i=i):
                device = loaded.layer_device(i)  # each layer's fit runs where that layer is
                with device_scope(device):
                    theta, info = fit_keys(store.layer(i)["k"], train_rows, held_rows, i, dims, device, advance, keys,
                                           seed)
                return {"theta": theta, "stage_mse": torch.tensor(info.pop("stage_mse_groups"),
                                                                  dtype=torch.float32)}, info

            fitted, info = resumable(checkpoints, "keys", i, fit_layer, advance, groups * stages)
            tensors[f"layers.{i}.k.theta"] = fitted["theta"]
            tensors[f"layers.{i}.k.pair_channels"] = pair_channels(
                dims.num_kv_heads, dims.head_dim, keys.group_pairs).to(torch.int32)
            tensors[f"layers.{i}.k.stage_mse"] = fitted["stage_mse"]
            keys_info.append(info)
    with progress_bar(f"commvq: value encoders ({values.steps} steps per layer)",
                      dims.num_layers * values.steps) as advance:
        for i in range(dims.num_layers):
            def fit_layer(i=i):
                module = modules[i] if modules is not None else None
                device = loaded.layer_device(i)
                with device_scope(device):
                    return fit_values(store.layer(i), windows, held, module, loaded, i, device, advance, values, seed,
                                      checkpoints)

            params, info = resumable(checkpoints, "values", i, fit_layer, advance, values.steps)
            checkpoints.drop(f"values.{i}.state")  # the finished layer replaces its training state
            for name, t in params.items():
                tensors[f"layers.{i}.v.{name}"] = t
            values_info.append(info)
    return tensors, {
        "windows": {"train": len(windows) - len(held), "held_out": len(held)},
        "key_stage_mse": [layer["stage_mse"] for layer in keys_info],  # held-out, per layer and stage
        "key_scalar_mse": [layer["scalar_mse"] for layer in keys_info],
        "key_em_steps": [layer["em_steps"] for layer in keys_info],
        "key_hard_steps": [layer["hard_steps"] for layer in keys_info],
        "key_max_weight": [layer["max_weight"] for layer in keys_info],
        "key_vectors": keys_info[0]["vectors"] if keys_info else None,
        "value_mse": [layer["mse"] for layer in values_info],  # held-out
        "value_scalar_mse": [layer["scalar_mse"] for layer in values_info],  # per token, groups of 32 channels
        "value_scalar_mse_token": [layer["scalar_mse_token"] for layer in values_info],  # one group per token
        "value_train_loss": [layer["train_loss"] for layer in values_info],
        "value_attn_mse": [layer.get("attn_mse") for layer in values_info],  # held-out o_proj output error
        "value_attn_scalar_mse": [layer.get("attn_scalar_mse") for layer in values_info],
        "value_live_groups": [layer["live_groups"] for layer in values_info],
        "value_used_rows": [layer["used_rows"] for layer in values_info],
    }
