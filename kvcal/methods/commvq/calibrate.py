"""CommVQ's calibration: what a layer learns from its captured activations (citations as in method.py).

- Keys: the residual codebooks of each group, fitted by soft EM on unit keys (weighted by kappa^2) with the official
  temperature schedule scaled to the model (§3.5, §8 items 8-9), all groups of a layer in one batched EM
  (quant/vq.fit_residual_groups).
- Values: the encoder and codebook of the learned additive code [C] (§3.2), trained with straight-through Gumbel codes
  (tau 1), AdamW as the official code, and the official loss 1/2 MSE(v_hat, v) + MSE of the attention output after
  o_proj (§8 item 4). The layers' coders train together, their parameters stacked [L, ...] (as many layers per chunk
  as memory holds): a small model's step is bound by kernel launches, and one launch serves every layer. Each
  layer's loss, gradient clip and AdamW update are its own; the random draws are shared, so a layer trains the same
  whichever layers train beside it (up to float rounding).

The functions take the settings as plain values (KeyFit, ValueFit: what CommVQ reads from its config and the model's
shapes) and tensors; every random draw comes from a generator seeded by (seed, layer, ...) or, for what the layers share, (seed, stage),
never the global RNG.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcal.errors import KvcalError
from kvcal.methods.commvq.storage import (
    LN_EPS,
    VALUE_EPS,
    decode_values,
    encode_values,
    normalize_values,
    pair_channels,
)
from kvcal.methods.commvq.training_codes import gumbel_bits
from kvcal.models.adapter import attention_modules
from kvcal.models.devmap import run_per_device
from kvcal.progress import progress_bar, stderr_console
from kvcal.quant import vq
from kvcal.quant.rope import apply_rope, rope_cos_sin
from kvcal.quant.uniform import fake_quant_groups

HELD_OUT_VALUE_TOKENS = 32768  # tokens of the held-out windows used for value diagnostics (a cap)
ATTENTION_CACHE_BYTES = 1 << 30  # attention weights of the value loss's blocks kept, for all layers trained together
ATTENTION_CACHE_BYTES_GPU = 8 << 30  # on a GPU (the rest is recomputed per step, batched over the layers)
VALUE_CHUNK_BYTES_CPU = 4 << 30  # on the CPU: memory of the layers whose value coders train together
# Layers train stacked while a step of the stack stays under this many FLOPs (value_step_flops): stacking pays while
# a step is bound by kernel launches, not arithmetic (smollm2-135m's 30 layers stack; a Llama-3.1-8B-shaped layer's
# step is already arithmetic: docs/commvq.md has the measurements that place the threshold).
VALUE_STACK_FLOPS = 100e9


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
    precision: str = "float32"  # "bfloat16": the step's forward under bf16 autocast; "tf32": matmuls as TF32
    graphs: bool = False  # on a GPU, each training step replays one CUDA graph (train_value_coders)


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


def stacked_logits(params, unit: torch.Tensor, groups: int) -> torch.Tensor:
    """storage.value_logits for L layers at once: parameters [L, ...], unit [L, M, C] -> [L, M, n_e, 4]."""
    h = F.layer_norm(unit, (unit.shape[-1],), eps=LN_EPS) * params["ln_weight"][:, None] + params["ln_bias"][:, None]
    h = F.gelu(torch.baddbmm(params["fc1_bias"][:, None], h, params["fc1_weight"].transpose(1, 2)))
    return torch.baddbmm(params["fc2_bias"][:, None], h, params["fc2_weight"].transpose(1, 2)).unflatten(-1, (groups, 4))


def reconstruct_training(params, x: torch.Tensor, tau: float, gen: torch.Generator) -> torch.Tensor:
    """Training-time decode of value rows x [L, M, C] of L layers through straight-through Gumbel codes [C]."""
    scale = params["channel_scale"][:, None]
    unit, rho0 = normalize_values(x, scale)
    logits = stacked_logits(params, unit, params["codebook"].shape[1] // 2)
    u = gumbel_bits(logits, tau, gen) @ params["codebook"]  # the fused kernels on a GPU
    return scale * ((rho0 + VALUE_EPS) / (u.norm(dim=-1) + VALUE_EPS))[..., None] * u


class AttentionOutputLoss:
    """The official value loss's second term [C], for L layers at once: MSE of o_proj(attention) with quantized
    values against the full-precision one, queries and keys unquantized. Blocks of `block` query tokens of a window;
    the block's queries attend causally to all keys of the window up to the block's end, with the values of the
    block quantized and those before it exact (the official code quantizes every value of a sequence; blocks keep
    the cost bounded, digest §9). The difference of outputs is linear in v_hat - v: o_proj(P_block (v_hat -
    v)_block), bias cancelled. q [L, N, Hq D] and k [L, N, C] as captured, o_proj weights [L, H, Hq D]."""

    def __init__(self, q, k, weight, windows, loaded, scale: float, block: int, device,
                 cache_bytes: int | None = None):
        dims = loaded.dims
        on_gpu = torch.device(device).type == "cuda"
        # on a GPU the layers' queries and keys move once (in their captured dtype), not one block per step
        self.q, self.k = (q.to(device), k.to(device)) if on_gpu else (q, k)
        if cache_bytes is None:
            cache_bytes = ATTENTION_CACHE_BYTES_GPU if on_gpu else ATTENTION_CACHE_BYTES
        self.dims, self.device, self.scale = dims, device, scale
        self.inv_freq = loaded.adapter.inv_freq_on(torch.device(device))
        self.weight = weight.to(device, torch.float32)
        self.blocks = [(s, b, min(b + block, e - s)) for s, e in windows for b in range(0, e - s, block)]
        # the weights of a block never change: kept once computed, up to a memory budget
        self.cache: dict[int, torch.Tensor] = {}
        self.cache_budget, self.cached_bytes = cache_bytes, 0

    def span(self, index: int) -> tuple[int, int]:
        """[first, end) rows of the block (consecutive)."""
        start, b0, b1 = self.blocks[index]
        return start + b0, start + b1

    def probabilities(self, index: int) -> torch.Tensor:
        """Attention weights [L, Hkv, rep * Lb, Lb] of the block's queries over the block's keys (full softmax)."""
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
        d, hkv, layers = dims.head_dim, dims.num_kv_heads, self.q.shape[0]
        q = self.q[:, start + b0 : start + b1].to(self.device, torch.float32).view(layers, b1 - b0, dims.num_heads, d)
        k = self.k[:, start : start + b1].to(self.device, torch.float32).view(layers, b1, hkv, d)
        cos, sin = rope_cos_sin(self.inv_freq, torch.arange(b1, device=self.device)[None], torch.float32)
        q = apply_rope(q.transpose(1, 2), cos[:, b0:], sin[:, b0:])  # [L, Hq, Lb, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [L, Hkv, b1, D]
        q = q.reshape(layers, hkv, -1, d)  # [L, Hkv, rep * Lb, D]: query head j reads KV head j // rep
        scores = q @ k.transpose(-1, -2) * self.scale
        query_pos = torch.arange(b0, b1, device=self.device).repeat(dims.num_heads // hkv)
        blocked = torch.arange(b1, device=self.device)[None, :] > query_pos[:, None]
        return torch.softmax(scores.masked_fill(blocked, float("-inf")), dim=-1)[..., b0:]

    def loss(self, probs: torch.Tensor, diff: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """diff [L, Lb, C] = v_hat - v of the block -> [L] mean squared o_proj output differences (`layer`: probs
        and diff [1, ...] of that layer alone)."""
        dims = self.dims
        weight = self.weight if layer is None else self.weight[layer : layer + 1]
        layers, length = diff.shape[:2]
        per_head = diff.view(layers, length, dims.num_kv_heads, dims.head_dim).transpose(1, 2)  # [L, Hkv, Lb, D]
        out = (probs @ per_head).view(layers, dims.num_heads, length, dims.head_dim)
        out = out.transpose(1, 2).reshape(layers, length, -1)
        return torch.bmm(out, weight.transpose(1, 2)).square().mean(dim=(1, 2))


def learning_rate(fit: ValueFit, step: int) -> float:
    """Linear warmup then cosine to 0 ([C] WarmupCosineLR of the 1-bit script; the warmup is capped at a fifth of
    a short budget so that it ends)."""
    warmup = min(fit.warmup, fit.steps // 5)
    if step < warmup:
        return fit.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, fit.steps - warmup)
    return fit.lr * 0.5 * (1 + math.cos(math.pi * progress))


def clip_per_layer(tensors: list[torch.Tensor], max_norm: float) -> None:
    """clip_grad_norm_ for each layer of stacked parameters [L, ...]: the 2-norm of a layer's gradients over all of
    `tensors`, scaled by max_norm / (norm + 1e-6) where that is below 1, as torch clips one layer's parameters."""
    norms = torch.stack([t.grad.flatten(1).norm(dim=1) for t in tensors]).norm(dim=0)  # [L]
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for t in tensors:
        t.grad.mul_(coef.view(-1, *([1] * (t.dim() - 1))))


def training_state(params, optimizer, gen, noise, tail) -> dict[str, torch.Tensor]:
    """What train_value_coders needs to continue from a step as if never stopped: the parameters, AdamW's moments and
    step counts, the generators' states and the tail losses so far."""
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


GRAPH_WARMUP_STEPS = 3  # eager training steps (on a side stream) before a value step's CUDA graph is recorded
# One CUDA graph is recorded at a time in the process: before it records, torch.cuda.graph synchronizes the device
# and empties the caching allocator (of every device), neither of which may happen during another GPU's recording
# (run_per_device's threads)
GRAPH_RECORDING = threading.Lock()


@contextlib.contextmanager
def matmul_precision(precision: str):
    """float32 matrix products on a GPU's tensor cores as TF32 inside the block ("tf32"), torch's setting restored
    after it; other precisions leave it as it is. On a CPU the setting does nothing (float32 products)."""
    if precision != "tf32":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def train_value_coders(params, v, train_rows, attention, fit: ValueFit, seed: int, advance, checkpoints=None,
                       name: str = "") -> torch.Tensor:
    """AdamW on the encoders and codebooks of L layers at once [C], parameters stacked [L, ...] (one launch of each
    operation for every layer: a small model's step is bound by launches, not arithmetic): lr fit.lr (1e-3), weight
    decay fit.weight_decay (0.1) on weights and codebook (none on biases and LayerNorm, as the HF Trainer groups
    them), betas (0.9, 0.95), each layer's gradient norm clipped at 1.0 (clip_per_layer), the learning rate of
    `learning_rate` at each step. The sum of the layers' losses is minimised: each layer's gradient is its own loss's.
    v [L, N, C]. Returns the mean training loss of the last tenth of the steps, per layer [L].

    The random draws are shared by the layers (the blocks or rows of each step from a generator seeded by `seed`, the
    Gumbel noise from another: on a GPU a GPU generator), so a layer trains the same whichever layers train beside
    it, up to float rounding. Nothing syncs the host inside the loop (the tail loss is summed on the device).

    checkpoints (kvcal/calib/checkpoint.Checkpoints): the training state is saved there as entry `name` whenever it
    is due, and a saved state is continued from (the same parameters, bit for bit, as an uninterrupted run).

    fit.precision "bfloat16" runs each step's forward (encoder, Gumbel codes, decode, the attention loss's products)
    under torch.autocast to bf16; parameters, AdamW state and the loss's sums stay float32. "tf32" keeps float32
    tensors and lets a GPU's matrix products round their inputs to TF32 (matmul_precision).

    fit.graphs on a GPU: after GRAPH_WARMUP_STEPS eager steps, one training step (forward, backward, clipping, AdamW)
    is recorded as a CUDA graph on static copies of a step's data and replayed for every later step, the host only
    drawing the step's blocks or rows, copying them in and setting the learning rate (a device tensor, AdamW
    `capturable`). The same draws in the same order as without graphs (the Gumbel generator is registered with the
    graph). On a CPU the later steps read the same static buffers, launched: the result of training without graphs."""
    trainable = [t for n, t in params.items() if n != "channel_scale"]
    decay = [params[n] for n in ("codebook", "fc1_weight", "fc2_weight")]
    no_decay = [params[n] for n in ("ln_weight", "ln_bias", "fc1_bias", "fc2_bias")]
    on_gpu = v.device.type == "cuda"
    capture = fit.graphs and on_gpu  # CUDA graphs recorded and replayed (a CPU takes the static path, launched)
    if fit.graphs and attention is not None and len({b1 - b0 for _, b0, b1 in attention.blocks}) > 1:
        raise KvcalError(f"commvq value_graphs needs attention blocks of one length: calibration windows a multiple of "
                         f"value_attn_tokens ({fit.attn_tokens})")
    lr = torch.tensor(fit.lr, device=v.device) if capture else fit.lr  # a graph reads the rate from the device
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": fit.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr,
                                  betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if on_gpu else {}),
                                  **({"capturable": True} if capture else {}))
    gen = generator(seed, "value-train")
    noise = gen
    if on_gpu:
        noise = torch.Generator(device=v.device).manual_seed(derived_seed(seed, "gumbel"))
    layers = v.shape[0]
    tail, tail_start = torch.zeros(layers, device=v.device), fit.steps - max(1, fit.steps // 10)
    per_step = max(1, fit.batch_tokens // fit.attn_tokens)
    first = 0
    saved = checkpoints.load(name) if checkpoints is not None else None
    if saved is not None:
        restore_training(saved[0], params, optimizer, gen, noise, tail)
        first = int(saved[1]["step"])
        advance(first * layers)
        if capture:  # the graph reads the rate from the one tensor the host sets
            for group in optimizer.param_groups:
                group["lr"] = lr

    def forward():
        if fit.precision == "bfloat16":
            return torch.autocast(v.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def draw() -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """A step's training data: (value rows [L, Lb, C], attention weights) of each block, or (rows, None)."""
        if attention is None:
            pick = torch.randint(train_rows.numel(), (fit.batch_tokens,), generator=gen)
            return [(v[:, train_rows[pick.to(train_rows.device)]], None)]
        batch = []
        for index in torch.randint(len(attention.blocks), (per_step,), generator=gen).tolist():
            lo, hi = attention.span(index)
            with torch.no_grad():
                batch.append((v[:, lo:hi], attention.probabilities(index)))
        return batch

    def update(batch) -> torch.Tensor:
        """One training step on `batch` (gradients None before it); returns the step's loss per layer [L]."""
        if attention is None:
            (x, _), = batch
            with forward():
                v_hat = reconstruct_training(params, x, fit.gumbel_tau, noise)
            loss = (v_hat.float() - x).square().mean(dim=(1, 2))
        else:
            loss = 0.0
            for x, probs in batch:
                with forward():
                    v_hat = reconstruct_training(params, x, fit.gumbel_tau, noise)
                    diff = v_hat - x
                    term = attention.loss(probs, diff)
                mse = diff.float().square().mean(dim=(1, 2))
                loss = loss + (0.5 * mse + term.float()) / len(batch)
        loss.sum().backward()
        clip_per_layer(trainable, 1.0)
        optimizer.step()
        return loss.detach()

    graph, static, static_loss = None, None, None
    side = torch.cuda.Stream(v.device) if capture else None
    with torch.enable_grad(), matmul_precision(fit.precision):
        for step in range(first, fit.steps):
            rate = learning_rate(fit, step)
            if capture:
                lr.fill_(rate)
            else:
                for group in optimizer.param_groups:
                    group["lr"] = rate
            batch = draw()
            if fit.graphs and step >= first + GRAPH_WARMUP_STEPS:
                # the static path: the step's data copied into the buffers the graph reads (on a CPU the same
                # buffers feed a launched step: what the copies put there is what the step would have read)
                if static is None:
                    static = [(x.clone(), None if p is None else p.clone()) for x, p in batch]
                    if capture:  # record (nothing runs), then replay below
                        optimizer.zero_grad(set_to_none=True)
                        graph = torch.cuda.CUDAGraph()
                        graph.register_generator_state(noise)
                        # thread_local: another GPU's thread (run_per_device) may allocate or launch meanwhile
                        # on this device's side stream: torch.cuda.graph's default capture stream is made once,
                        # on whichever device first records, and another device's graph recorded there is empty
                        with GRAPH_RECORDING, torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                            static_loss = update(static)
                for (sx, sp), (x, p) in zip(static, batch):
                    sx.copy_(x)
                    if sp is not None:
                        sp.copy_(p)
                if capture:
                    graph.replay()
                    loss = static_loss
                else:
                    optimizer.zero_grad(set_to_none=True)
                    loss = update(static)
            elif capture:  # the warm-up steps, off the current stream as torch asks before a capture
                side.wait_stream(torch.cuda.current_stream(v.device))
                with torch.cuda.stream(side):
                    optimizer.zero_grad(set_to_none=True)
                    loss = update(batch)
                torch.cuda.current_stream(v.device).wait_stream(side)
            else:
                optimizer.zero_grad(set_to_none=True)
                loss = update(batch)
            if step >= tail_start:
                tail += loss
            advance(layers)
            if checkpoints is not None and step + 1 < fit.steps and checkpoints.due():
                checkpoints.save(name, training_state(params, optimizer, gen, noise, tail), {"step": step + 1})
    for t in trainable:
        t.requires_grad_(False)
        t.grad = None
    return tail / (fit.steps - tail_start)


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


def value_layer_bytes(loaded, rows: int, fit: ValueFit) -> int:
    """Device memory one layer takes in a stacked value training: its values in float32, with the attention loss its
    queries and keys (float32 when moved per block) and o_proj, the parameters with their gradients and AdamW
    moments, and a step's activations."""
    dims = loaded.dims
    channels, q_width = dims.kv_channels, dims.num_heads * dims.head_dim
    total = rows * channels * 4
    if fit.loss == "attention":
        total += rows * (q_width + channels) * 4 + dims.hidden_size * q_width * 4
    params = 2 * fit.groups * channels + 2 * channels + fit.hidden * (channels + 1) + 4 * fit.groups * (fit.hidden + 1)
    tokens = max(fit.batch_tokens, fit.attn_tokens)
    return total + 4 * params * 4 + tokens * (8 * fit.hidden + 32 * fit.groups + 8 * channels) * 4


def value_step_flops(loaded, fit: ValueFit) -> float:
    """FLOPs of one layer's value step, forward and backward: the encoder (C -> hidden -> 4 n_e) on the step's tokens
    and, with the attention loss, o_proj and its input gradient."""
    dims = loaded.dims
    tokens = max(fit.batch_tokens, fit.attn_tokens)
    flops = 6 * tokens * (dims.kv_channels * fit.hidden + fit.hidden * 4 * fit.groups)
    if fit.loss == "attention":
        flops += 4 * tokens * dims.num_heads * dims.head_dim * dims.hidden_size
    return float(flops)


def value_chunks(loaded, layers: list[int], per_layer_bytes: int, per_layer_flops: float = 0.0) -> list[list[int]]:
    """The layers trained together: consecutive layers on one device, as many as half of the device's free memory
    (VALUE_CHUNK_BYTES_CPU on the CPU) holds and while a stacked step stays under VALUE_STACK_FLOPS (one layer at
    least)."""
    chunks = []
    by_flops = max(1, int(VALUE_STACK_FLOPS // per_layer_flops)) if per_layer_flops > 0 else len(layers)
    for i in layers:
        device = loaded.layer_device(i)
        if device.type == "cuda":
            budget = torch.cuda.mem_get_info(device)[0] // 2
        else:
            budget = VALUE_CHUNK_BYTES_CPU
        most = min(by_flops, max(1, budget // max(1, per_layer_bytes)))
        if chunks and loaded.layer_device(chunks[-1][-1]) == device and len(chunks[-1]) < most and \
                chunks[-1][-1] == i - 1:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


def fit_values(store, layers: list[int], windows, held, modules, loaded, device, advance, fit: ValueFit, seed: int,
               checkpoints=None) -> list[tuple[dict, dict]]:
    """The value encoders and codebooks of `layers` (on `device`), trained together (train_value_coders): for each
    layer a dict of tensors named as VALUE_PARAMS and its diagnostics. The training state is checkpointed as
    `values.<first>-<last>.state`."""
    data = [store.layer(i, ("v", "q", "k") if fit.loss == "attention" else ("v",)) for i in layers]
    v = torch.stack([d["v"].to(device, torch.float32) for d in data])
    train_windows = [w for j, w in enumerate(windows) if j not in held]
    train_rows = torch.cat([torch.arange(s, e) for s, e in train_windows]).to(device)
    per_layer = [init_value_params(v[j, train_rows], fit.groups, fit.hidden, generator(seed, i, "value-init"),
                                   device) for j, i in enumerate(layers)]
    params = {n: torch.stack([p[n].detach() for p in per_layer]).requires_grad_(n != "channel_scale")
              for n in per_layer[0]}
    attention, scale, q, k, weight = None, 1.0, None, None, None
    if fit.loss == "attention":
        q = torch.stack([d["q"] for d in data])
        k = torch.stack([d["k"] for d in data])
        weight = torch.stack([modules[i].o_proj.weight.detach().to(device, torch.float32) for i in layers])
        scale = float(modules[layers[0]].scaling)
        attention = AttentionOutputLoss(q, k, weight, train_windows, loaded, scale, fit.attn_tokens, device)
    losses = train_value_coders(params, v, train_rows, attention, fit, seed, advance, checkpoints,
                                f"values.{layers[0]}-{layers[-1]}.state").tolist()
    del attention
    held_rows = torch.cat([torch.arange(s, e) for j, (s, e) in enumerate(windows) if j in held]
                          or [train_rows.cpu()])[:HELD_OUT_VALUE_TOKENS].to(device)
    probe = None
    if fit.loss == "attention" and held:
        held_windows = [w for j, w in enumerate(windows) if j in held]
        probe = AttentionOutputLoss(q, k, weight, held_windows, loaded, scale, fit.attn_tokens, device, cache_bytes=0)
    results = []
    with torch.no_grad():
        layer_params = [{n: t[j] for n, t in params.items()} for j in range(len(layers))]
        attn = held_out_attention(probe, v, layer_params, fit.bits) if probe is not None else None
        for j in range(len(layers)):
            x = v[j, held_rows]
            bits, rho = encode_values(x, layer_params[j])
            mse = float((decode_values(bits, rho, layer_params[j]) - x).square().mean())
            categories = bits.view(-1, bits.shape[-1] // 2, 2)
            code = categories[..., 0] * 2 + categories[..., 1]  # 10 -> 2, 01 -> 1, 11 -> 3, 00 -> 0
            used = F.one_hot(code.long(), 4).amax(0)  # [n_e, 4] categories seen per group
            live = float((used.sum(-1) >= 3).float().mean())
            used_rows = float((bits.amax(0) > 0).float().mean())
            info = {"mse": round(mse, 8), "scalar_mse": round(value_scalar_mse(x, fit.bits), 8),
                    "scalar_mse_token": round(value_scalar_mse(x, fit.bits, x.shape[-1]), 8),
                    "train_loss": round(losses[j], 8), "live_groups": round(live, 4), "used_rows": round(used_rows, 4)}
            if attn is not None:
                info.update(attn[j])
            results.append(({n: t.clone() for n, t in layer_params[j].items()}, info))
    return results


def held_out_attention(probe: AttentionOutputLoss, v, layer_params: list[dict], bits: int) -> list[dict]:
    """Attention-output error after o_proj of each layer on the held-out windows (values quantized block by block, at
    most 8 blocks), for the learned code and for the per-token group-32 scalar quantizer at the same code bits. A
    block's attention weights are computed once for all layers."""
    ours, scalar = [[] for _ in layer_params], [[] for _ in layer_params]
    for index in range(min(8, len(probe.blocks))):
        lo, hi = probe.span(index)
        probs = probe.probabilities(index)
        for j, params in enumerate(layer_params):
            x = v[j, lo:hi]
            ours[j].append(float(probe.loss(probs[j : j + 1], (decode_values(*encode_values(x, params), params) - x)[None],
                                            j)[0]))
            group = 32 if x.shape[-1] % 32 == 0 else x.shape[-1]
            scalar[j].append(float(probe.loss(probs[j : j + 1], (fake_quant_groups(x, bits, -1, group) - x)[None], j)[0]))
    return [{"attn_mse": round(sum(o) / len(o), 8), "attn_scalar_mse": round(sum(s) / len(s), 8)}
            for o, s in zip(ours, scalar)]


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


def shared_progress(advance, lock: threading.Lock, stop):
    """`advance` for one device's thread of run_per_device: counted under the lock the threads share, and the point
    where the thread stops (stop() raises) once another device failed or Ctrl-C came."""
    def step(n=1):
        stop()
        with lock:
            advance(n)

    return step


def calibrate_layers(loaded, store, keys: KeyFit, values: ValueFit, holdout: float, seed: int):
    """Every layer's key codebooks, then every layer's value coder, each fitted where its layer is, from the captured
    activations of `store` (windows starting at position 0, a `holdout` fraction of them held out for the
    diagnostics). Returns the artifact's tensors and the per-layer diagnostics (windows, key_*, value_* lists). Each
    finished layer, and the value training in progress, is checkpointed in `store.checkpoints`."""
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
    lock = threading.Lock()  # the progress bars, shared by the devices' threads
    with progress_bar(f"commvq: key codebooks (EM, {groups} groups x {stages} stages)",
                      dims.num_layers * groups * stages) as advance:
        fitted_keys = {}

        def fit_key_layer(i, stop):  # on the layer's device (run_per_device): the GPUs of a split model at once
            progress = shared_progress(advance, lock, stop)

            def fit_layer():
                theta, info = fit_keys(store.layer(i, ("k",))["k"], train_rows, held_rows, i, dims,
                                       loaded.layer_device(i), progress, keys, seed)
                return {"theta": theta, "stage_mse": torch.tensor(info.pop("stage_mse_groups"),
                                                                  dtype=torch.float32)}, info

            fitted_keys[i] = resumable(checkpoints, "keys", i, fit_layer, progress, groups * stages)

        run_per_device(list(range(dims.num_layers)), loaded.layer_device, fit_key_layer)
        for i in range(dims.num_layers):
            fitted, info = fitted_keys[i]
            tensors[f"layers.{i}.k.theta"] = fitted["theta"]
            tensors[f"layers.{i}.k.pair_channels"] = pair_channels(
                dims.num_kv_heads, dims.head_dim, keys.group_pairs).to(torch.int32)
            tensors[f"layers.{i}.k.stage_mse"] = fitted["stage_mse"]
            keys_info.append(info)
    with progress_bar(f"commvq: value encoders ({values.steps} steps per layer)",
                      dims.num_layers * values.steps) as advance:
        fitted, todo = {}, []
        for i in range(dims.num_layers):  # layers an interrupted run finished
            saved = checkpoints.load(f"values.{i}")
            if saved is None:
                todo.append(i)
            else:
                fitted[i] = saved
                advance(values.steps)
        per_layer = value_layer_bytes(loaded, positions.numel(), values)

        def train(chunk, stop):
            results = fit_values(store, chunk, windows, held, modules, loaded, loaded.layer_device(chunk[0]),
                                 shared_progress(advance, lock, stop), values, seed, checkpoints)
            for i, (params, info) in zip(chunk, results):
                fitted[i] = checkpoints.keep(f"values.{i}", params, info)
            checkpoints.drop(f"values.{chunk[0]}-{chunk[-1]}.state")  # the finished layers replace it

        cpu_layers = [i for i in todo if loaded.layer_device(i).type != "cuda"]
        if cpu_layers and (values.graphs or values.precision == "tf32"):
            stderr_console.print(f"note: commvq value_graphs and value_precision=tf32 act on a GPU only: the value coders "
                                 f"of {len(cpu_layers)} layers on the CPU train as float32 steps, launched",
                                 highlight=False)
        # the chunks of a model split over GPUs train on every GPU at once; TF32 is set once here, for every thread
        with matmul_precision(values.precision):
            run_per_device(value_chunks(loaded, todo, per_layer, value_step_flops(loaded, values)),
                           lambda chunk: loaded.layer_device(chunk[0]), train)
        for i in range(dims.num_layers):
            params, info = fitted[i]
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
