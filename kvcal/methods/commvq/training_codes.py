"""The value encoder's training codes: straight-through Gumbel-softmax codes over each group's 4 categories [C] and
the two code bits they stand for, with the torch reference and the fused Triton kernels side by side.

The reference (`gumbel_bits_reference`) is the chain the calibration always ran: Gumbel noise from uniform draws,
softmax over the 4 categories at temperature tau, the one-hot of the argmax with the softmax's gradient
(hard - soft.detach() + soft), and the bits (y0 + y2, y1 + y2) of the map 0 -> 10, 1 -> 01, 2 -> 11, 3 -> 00: about
18 torch operations forward and more backward, each a kernel over the logits' [L, M, groups, 4] float32 elements on
a GPU ([1, 512, 1024, 4] a step at Llama-3.1-8B shapes). `gumbel_bits_triton` does the same in one kernel
forward (reading the logits and the draws, writing the softmax for the backward and the bits) and one backward
(the softmax's gradient from the bits' gradient). It follows the reference's operations in order (float32, the
division by tau, the max-shifted softmax, the first maximum, (hard - soft) + soft, one addition per bit), so it
differs from it only by the rounding of exp and log: tests/kernel_cases.py checks both directions against the
reference under the Triton interpreter and on a GPU. The calibration runs the kernels on CUDA tensors and the
reference elsewhere (`gumbel_bits`)."""

from __future__ import annotations

import torch

from kvcal.quant.packing import launch_device

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

U_LOW, U_HIGH = 1e-10, 1 - 1e-7  # the uniform draws' clamp before -log(-log(u))
BLOCK_GROUPS = 256  # groups of 4 categories per program


def draw_uniform(shape, gen: torch.Generator, device) -> torch.Tensor:
    """The step's uniform draws [...] on the generator's device (a GPU generator on a GPU: no host-side draw and
    copy per step), moved to `device`."""
    return torch.rand(shape, generator=gen, device=gen.device).to(device)


def training_bits(onehot: torch.Tensor) -> torch.Tensor:
    """Code bits [..., 2 n_e] of (soft) one-hots [..., n_e, 4]: (y0 + y2, y1 + y2), the map 0 -> 10, 1 -> 01,
    2 -> 11, 3 -> 00 [C] (storage.CATEGORY_BITS) as sums, differentiable, with no table copied to the device."""
    y = onehot.unbind(-1)
    return torch.stack((y[0] + y[2], y[1] + y[2]), dim=-1).flatten(-2)


def gumbel_bits_reference(logits: torch.Tensor, u: torch.Tensor, tau: float) -> torch.Tensor:
    """gumbel_softmax(hard=True) [C] of logits [L, ..., 4] with the draws u [...] (one draw serves every layer L:
    each layer's training is its own optimisation, and a shared draw keeps a layer's result independent of which
    layers train beside it), then its bits [L, ..., 2 * groups]: forward the bits of the argmax, backward the
    softmax's gradient."""
    u = u.clamp(U_LOW, U_HIGH)
    soft = torch.softmax((logits - torch.log(-torch.log(u))) / tau, dim=-1)
    # one_hot(argmax) written as a scatter: F.one_hot validates its indices, a host sync on a GPU
    hard = torch.zeros_like(soft).scatter_(-1, soft.argmax(-1, keepdim=True), 1.0)
    return training_bits(hard - soft.detach() + soft)


if triton is not None:

    @triton.jit
    def _gumbel_bits_fwd(logits_ptr, u_ptr, soft_ptr, bits_ptr, n_groups, layer_groups, tau,
                         u_low, u_high, BLOCK: tl.constexpr):
        """Program i: groups [i BLOCK, (i + 1) BLOCK) of the flattened logits [L * layer_groups, 4]; the draws
        [layer_groups, 4] are shared by the layers."""
        g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        c = tl.arange(0, 4)
        live = g < n_groups
        offs = g[:, None] * 4 + c[None, :]
        x = tl.load(logits_ptr + offs, mask=live[:, None], other=0.0).to(tl.float32)
        u = tl.load(u_ptr + (g % layer_groups)[:, None] * 4 + c[None, :], mask=live[:, None], other=0.5)
        u = tl.minimum(tl.maximum(u, u_low), u_high)
        z = (x - tl.log(-tl.log(u))) / tau
        e = tl.exp(z - tl.max(z, axis=1)[:, None])
        soft = e / tl.sum(e, axis=1)[:, None]
        first = tl.argmax(soft, axis=1, tie_break_left=True)
        hard = (c[None, :] == first[:, None]).to(tl.float32)
        y = (hard - soft) + soft
        # one addition per bit (the other terms are zeros, exact)
        b0 = tl.sum(tl.where((c == 0)[None, :] | (c == 2)[None, :], y, 0.0), axis=1)
        b1 = tl.sum(tl.where((c == 1)[None, :] | (c == 2)[None, :], y, 0.0), axis=1)
        tl.store(soft_ptr + offs, soft, mask=live[:, None])
        tl.store(bits_ptr + g * 2, b0, mask=live)
        tl.store(bits_ptr + g * 2 + 1, b1, mask=live)

    @triton.jit
    def _gumbel_bits_bwd(soft_ptr, grad_bits_ptr, grad_ptr, n_groups, tau, BLOCK: tl.constexpr):
        """The logits' gradient from the bits' gradient: the categories' gradient (b0 -> y0, y2; b1 -> y1, y2), the
        softmax's backward soft * (gy - sum(gy soft)), then the division by tau's."""
        g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        c = tl.arange(0, 4)
        live = g < n_groups
        offs = g[:, None] * 4 + c[None, :]
        soft = tl.load(soft_ptr + offs, mask=live[:, None], other=0.0)
        g0 = tl.load(grad_bits_ptr + g * 2, mask=live, other=0.0).to(tl.float32)[:, None]
        g1 = tl.load(grad_bits_ptr + g * 2 + 1, mask=live, other=0.0).to(tl.float32)[:, None]
        cc = c[None, :]
        gy = tl.where(cc == 0, g0, tl.where(cc == 1, g1, tl.where(cc == 2, g0 + g1, 0.0)))
        dot = tl.sum(gy * soft, axis=1)[:, None]
        grad = (soft * (gy - dot)) / tau
        tl.store(grad_ptr + offs, grad.to(grad_ptr.dtype.element_ty), mask=live[:, None])


class _GumbelBits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, u, tau):
        logits = logits.contiguous()
        layer_groups = u.numel() // 4
        n_groups = logits.numel() // 4
        soft = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        bits = torch.empty((*logits.shape[:-2], 2 * logits.shape[-2]), dtype=torch.float32, device=logits.device)
        with launch_device(logits):
            _gumbel_bits_fwd[(triton.cdiv(n_groups, BLOCK_GROUPS),)](
                logits, u.contiguous(), soft, bits, n_groups, layer_groups, float(tau), U_LOW, U_HIGH,
                BLOCK=BLOCK_GROUPS)
        ctx.save_for_backward(soft)
        ctx.tau, ctx.dtype = float(tau), logits.dtype
        return bits

    @staticmethod
    def backward(ctx, grad_bits):
        (soft,) = ctx.saved_tensors
        n_groups = soft.numel() // 4
        grad = torch.empty(soft.shape, dtype=ctx.dtype, device=soft.device)
        with launch_device(soft):
            _gumbel_bits_bwd[(triton.cdiv(n_groups, BLOCK_GROUPS),)](
                soft, grad_bits.contiguous(), grad, n_groups, ctx.tau, BLOCK=BLOCK_GROUPS)
        return grad, None, None


def gumbel_bits_triton(logits: torch.Tensor, u: torch.Tensor, tau: float) -> torch.Tensor:
    """gumbel_bits_reference in two fused kernels (forward, backward); logits [L, ..., 4] float32 or 16-bit (the
    gradient in their dtype), u [...] float32."""
    if logits.shape[1:] != u.shape or logits.shape[-1] != 4:
        raise ValueError(f"gumbel_bits_triton: logits {tuple(logits.shape)} and draws {tuple(u.shape)}")
    return _GumbelBits.apply(logits, u, tau)


def gumbel_bits(logits: torch.Tensor, tau: float, gen: torch.Generator) -> torch.Tensor:
    """The training codes' bits of logits [L, M, groups, 4] with the step's draws from `gen`: the fused kernels on
    CUDA tensors, the torch reference elsewhere."""
    u = draw_uniform(logits.shape[1:], gen, logits.device)
    if logits.is_cuda:
        return gumbel_bits_triton(logits, u, tau)
    return gumbel_bits_reference(logits, u, tau)
