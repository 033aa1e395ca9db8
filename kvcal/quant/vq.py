"""Vector quantization with RoPE-commutative codebooks: the 2x2 block algebra, exact fast distances, greedy
residual encoding and soft EM.

Vectors are cut into 2-D pairs (the planes a RoPE rotation acts on). A codeword of one pair is the matrix
C = [[x, y], [-y, x]], which commutes with every 2-D rotation; in complex notation it is w = x + i y. A code
(a, b) of a group of g pairs selects, in every pair j of the group, the centre

    row 0 of C_a^j + row 1 of C_b^j = (x_a - y_b, y_a + x_b) = w_a^j + i w_b^j,

so a group has N^2 structured centres in R^{2g} built from only 2 N g parameters per stage. Residual stages
add the centres of successive codebooks. Layouts:

- `theta` of one stage: [N, g, 2] = (x, y) of codeword l for pair j; of a whole quantizer [G, R, N, g, 2].
- data: [..., g, 2] per group (pair j's two coordinates last), codes [..., 2] = (a, b).

Squared distances never form the N^2 x 2g centre matrix (the decomposition of the CommVQ digest, §3.5):

    |r - c_ab|^2 = |r|^2 + P_a + Q_b + G_ab,  P_a = sum_j |w_a^j|^2 - 2 <r^j, u_a^j>,
    Q_b = sum_j |w_b^j|^2 - 2 <r^j, J u_b^j>,  G_ab = 2 sum_j <u_a^j, J u_b^j>,  J(x, y) = (-y, x),

two [M, 2g] x [2g, N] products and one broadcast sum per chunk of points.

Every EM routine works on all groups of a layer at once ([G, ...] leading axis): one batched computation per
step instead of a loop over groups, the groups' early stopping tracked per group, so each group's result is
what fitting it alone gives (up to float rounding). Points are processed in chunks whose distance block
[G, chunk, N, N] holds at most `block_entries(device)` floats; no host sync inside the chunk loops. On a GPU
(float32) the E-step and the nearest-centre search are one Triton kernel instead (vq_kernels.py: the distance
block is never stored); these torch functions are its reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvcal.quant import vq_kernels

# entries of one chunk's distance block [G, chunk, N, N]: 4 MiB on the CPU (cache-sized, 256 points of one group at
# N = 64), 512 MiB on a GPU (thousands of points of all groups of a layer: few, large kernels)
CPU_BLOCK_ENTRIES = 1 << 20
GPU_BLOCK_ENTRIES = 1 << 27
DISTANCE_CHUNK = CPU_BLOCK_ENTRIES // (64 * 64)  # points per chunk of one group at N = 64 on the CPU


# an error within this relative margin of the best is a tie, not an improvement: at a hard k-means fixed point
# the error repeats up to rounding, and rounding (batched or not, CPU or GPU) must not decide whether EM goes on
TIE = 1e-12


def block_entries(device) -> int:
    return GPU_BLOCK_ENTRIES if torch.device(device).type == "cuda" else CPU_BLOCK_ENTRIES


def chunk_points(chunk: int | None, groups: int, per_point: int, device) -> int:
    """Points per chunk: `chunk` when given, else what fills the device's distance block."""
    if chunk is not None:
        return max(1, chunk)
    return max(1, block_entries(device) // max(1, groups * per_point))


# -- 2x2 block algebra -------------------------------------------------------------------------------------


def rotate_quarter(pairs: torch.Tensor) -> torch.Tensor:
    """J(x, y) = (-y, x) on the last axis (multiplication by i)."""
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1)


def block_matrix(theta: torch.Tensor) -> torch.Tensor:
    """The 2x2 matrices [[x, y], [-y, x]] of codewords [..., 2] -> [..., 2, 2] (the paper's Eq. 17 form)."""
    x, y = theta[..., 0], theta[..., 1]
    return torch.stack((torch.stack((x, y), -1), torch.stack((-y, x), -1)), -2)


def pair_centres(theta: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Centres w_a + i w_b of one stage for codes (a, b) [...]: theta [N, g, 2] -> [..., g, 2]."""
    return theta[a] + rotate_quarter(theta[b])


def group_centres(theta: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """pair_centres per group: theta [G, N, g, 2], codes a, b [G, M] -> [G, M, g, 2]."""
    grp = torch.arange(theta.shape[0], device=theta.device)[:, None]
    return theta[grp, a] + rotate_quarter(theta[grp, b])


def decode_residual(theta: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Sum over stages of the centres: theta [G, R, N, g, 2], codes [..., G, R, 2] (any integer dtype, first R'
    <= R stages) -> [..., G, g, 2] in theta's dtype. All groups at once, one gather per stage."""
    groups, stages = codes.shape[-3], codes.shape[-2]
    flat = codes.reshape(-1, groups, stages, 2).long()
    grp = torch.arange(groups, device=theta.device)[None, :]
    out = torch.zeros(flat.shape[0], groups, theta.shape[-2], 2, dtype=theta.dtype, device=theta.device)
    for r in range(stages):
        out += theta[grp, r, flat[:, :, r, 0]] + rotate_quarter(theta[grp, r, flat[:, :, r, 1]])
    return out.reshape(*codes.shape[:-3], groups, theta.shape[-2], 2)


@dataclass
class StageTables:
    """What distances to the N^2 centres of one stage need, for theta [..., N, g, 2] (leading axes: groups):
    u [..., N, 2g] (codewords, pairs interleaved), ju = J u, sq [..., N] = sum_j |w^j|^2, cross [..., N, N] = G_ab."""

    u: torch.Tensor
    ju: torch.Tensor
    sq: torch.Tensor
    cross: torch.Tensor

    @classmethod
    def of(cls, theta: torch.Tensor) -> StageTables:
        u = theta.flatten(-2)
        ju = rotate_quarter(theta).flatten(-2)
        return cls(u, ju, theta.square().sum((-1, -2)), 2 * u @ ju.transpose(-1, -2))


def _pq(points: torch.Tensor, t: StageTables):
    """The [..., M, N] terms of squared_distances: (|r|^2 + P_a, Q_b)."""
    p = (points.square().sum(-1)[..., None] + t.sq[..., None, :]) - 2 * (points @ t.u.transpose(-1, -2))
    return p, t.sq[..., None, :] - 2 * (points @ t.ju.transpose(-1, -2))


def squared_distances(points: torch.Tensor, point_sq: torch.Tensor, t: StageTables) -> torch.Tensor:
    """|r - c_ab|^2 [..., M, N, N] (a, b) of points [..., M, 2g] (|r|^2 = point_sq [..., M]), clamped at 0
    (rounding). |r|^2 joins the small [M, N] term, so the big block is written once and updated once."""
    p = (point_sq[..., None] + t.sq[..., None, :]) - 2 * (points @ t.u.transpose(-1, -2))
    q = t.sq[..., None, :] - 2 * (points @ t.ju.transpose(-1, -2))
    d2 = p[..., :, None] + q[..., None, :]
    d2 += t.cross[..., None, :, :]
    return d2.clamp_(min=0)


def nearest_codes_groups(points: torch.Tensor, theta: torch.Tensor, chunk: int | None = None):
    """Greedy nearest centre of one stage for every group: points [G, M, g, 2], theta [G, N, g, 2] ->
    (a [G, M], b [G, M], squared distance [G, M])."""
    groups, m = points.shape[0], points.shape[1]
    n = theta.shape[-3]
    flat = points.reshape(groups, m, -1)
    tables = StageTables.of(theta)
    if use_kernel(points, n) and m:
        best, index = vq_kernels.e_step_blocks(*_pq(flat, tables), tables.cross, None)[:2]
        return index // n, index % n, best
    step = chunk_points(chunk, groups, n * n, points.device)
    a, b, best = [], [], []
    for start in range(0, m, step):
        part = flat[:, start : start + step]
        d2 = squared_distances(part, part.square().sum(-1), tables).view(groups, part.shape[1], -1)
        value, index = d2.min(-1)
        a.append(index // n)
        b.append(index % n)
        best.append(value)
    if not a:
        empty = torch.zeros(groups, 0, dtype=torch.long, device=points.device)
        return empty, empty, torch.zeros(groups, 0, dtype=points.dtype, device=points.device)
    return torch.cat(a, 1), torch.cat(b, 1), torch.cat(best, 1)


def nearest_codes(points: torch.Tensor, theta: torch.Tensor, chunk: int | None = None):
    """Greedy nearest centre of one stage: points [M, g, 2], theta [N, g, 2] -> (a [M], b [M], squared distance [M])."""
    a, b, best = nearest_codes_groups(points[None], theta[None], chunk)
    return a[0], b[0], best[0]


def encode_residual(x: torch.Tensor, theta: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Greedy residual encoding: x [M, G, g, 2], theta [G, R, N, g, 2] -> codes [M, G, R, 2] (int64). Stage r
    picks the nearest centre to what the earlier stages left; all groups at once."""
    groups, stages = theta.shape[0], theta.shape[1]
    codes = torch.zeros(x.shape[0], groups, stages, 2, dtype=torch.long, device=x.device)
    residual = x.to(theta.dtype).transpose(0, 1).contiguous()  # [G, M, g, 2]
    for r in range(stages):
        a, b, _ = nearest_codes_groups(residual, theta[:, r], chunk)
        codes[:, :, r, 0], codes[:, :, r, 1] = a.T, b.T
        residual -= group_centres(theta[:, r], a, b)
    return codes


# -- EM ----------------------------------------------------------------------------------------------------


@dataclass
class EStats:
    """Sufficient statistics of one E-step and the hard-assignment error at the current codebook. Batched over
    groups (counts [G, N, N], rhs [G, 2N, g], hard_sse and max_weight tensors [G] on the device) or, from
    `e_step`, one group (counts [N, N], rhs [2N, g], floats)."""

    counts: torch.Tensor  # n_ab = sum_i W_i,ab
    rhs: torch.Tensor  # rows 0..N-1 for x_l, N..2N-1 for y_l
    hard_sse: float | torch.Tensor  # sum_i weight_i * min_ab |r_i - c_ab|^2
    max_weight: float | torch.Tensor  # mean over points of max_ab W_i,ab (1 for hard steps)


def _accumulate(stats_counts, stats_rhs, weights_flat: torch.Tensor, part: torch.Tensor, n: int):
    """Add the soft assignments W [c, N*N] of points part [c, g, 2] to counts and right-hand sides (one group)."""
    stats_counts += weights_flat.sum(0).view(n, n)
    w3 = weights_flat.view(-1, n, n)
    _accumulate_marginals(stats_rhs, w3.sum(2), w3.sum(1), part, n)


def _accumulate_marginals(rhs, wa: torch.Tensor, wb: torch.Tensor, part: torch.Tensor, n: int):
    """rhs(x_l) += sum_i W^A_il k_x + W^B_il k_y; rhs(y_l) += sum_i W^A_il k_y - W^B_il k_x, with the marginals
    W^A_il = sum_b W_i,lb and W^B_il = sum_a W_i,al ([..., c, N]) of points part [..., c, g, 2]."""
    px, py = part[..., 0], part[..., 1]
    wat, wbt = wa.transpose(-1, -2), wb.transpose(-1, -2)
    rhs[..., :n, :] += wat @ px + wbt @ py
    rhs[..., n:, :] += wat @ py - wbt @ px


def use_kernel(points: torch.Tensor, n_codes: int) -> bool:
    """The fused Triton E-step (vq_kernels) on a GPU for float32 and N <= 128 (a program holds an N x N tile in
    registers); torch elsewhere (the CPU, float64 checks, 129-256 codewords per pair)."""
    if not (points.is_cuda and points.dtype == torch.float32 and n_codes <= 128):
        return False
    return vq_kernels.triton is not None


def _exp_(x: torch.Tensor) -> torch.Tensor:
    """exp in place of arguments <= 0. On the CPU the arguments are floored at -87 first: exp of the far
    centres (arguments down to -1e5 at the low temperatures) would be float32 denormals, which the CPU computes
    ~10x slower; e^-87 = 1.6e-38 is below the float32 resolution of the weight sums (the nearest centre weighs 1)."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        x.clamp_(min=-87.0)
    return x.exp_()


def e_step_groups(points: torch.Tensor, weights: torch.Tensor, theta: torch.Tensor, temperature: float | None,
                  chunk: int | None = None) -> EStats:
    """Assignments of points [G, M, g, 2] to the N^2 centres of theta [G, N, g, 2], all groups at once: soft,
    W = softmax(-|r - c|/T) over the L2 distance (not squared, as the official code's cdist), or hard
    (temperature None). `weights` [M] weigh the hard error only (kappa^2: the error in the keys' own units).

    The soft weights are exp(-(|r - c| - min |r - c|)/T) normalised by their sum Z: the same softmax (its max
    subtracted exactly), the nearest centre's weight is 1/Z (the max weight, no gather), and 1/Z is folded into
    the sums instead of dividing the block. The hard error and max weight stay on the device (no sync)."""
    groups, m, g = points.shape[0], points.shape[1], points.shape[2]
    n = theta.shape[-3]
    dtype, device = points.dtype, points.device
    counts = torch.zeros(groups, n * n, dtype=dtype, device=device)
    rhs = torch.zeros(groups, 2 * n, g, dtype=dtype, device=device)
    sse = torch.zeros(groups, dtype=torch.float64, device=device)
    max_weight = torch.zeros(groups, dtype=dtype, device=device)
    tables = StageTables.of(theta)
    flat = points.reshape(groups, m, -1)
    weights = weights.to(device, dtype)
    if use_kernel(points, n):
        # the fused kernel (vq_kernels): no [G, M, N, N] block at all, only the [G, M, N] terms
        best, _, wa, wb, inv_z, kernel_counts = vq_kernels.e_step_blocks(*_pq(flat, tables), tables.cross, temperature)
        _accumulate_marginals(rhs, wa, wb, points, n)
        sse = (best * weights).sum(-1, dtype=torch.float64)
        return EStats(kernel_counts, rhs, sse, inv_z.sum(-1) / max(1, m))
    step = chunk_points(chunk, groups, n * n, device)
    for start in range(0, m, step):
        part, part_flat = points[:, start : start + step], flat[:, start : start + step]
        c = part.shape[1]
        d2 = squared_distances(part_flat, part_flat.square().sum(-1), tables)  # [G, c, N, N]
        best, index = d2.view(groups, c, -1).min(-1)
        sse += (best * weights[start : start + step]).sum(-1, dtype=torch.float64)
        if temperature is None:
            wa = torch.nn.functional.one_hot(index // n, n).to(dtype)
            wb = torch.nn.functional.one_hot(index % n, n).to(dtype)
            counts += (wa.transpose(1, 2) @ wb).view(groups, -1)
            max_weight += c
        else:
            w = _exp_(d2.sqrt_().sub_(best.sqrt()[..., None, None]).mul_(-1.0 / temperature))  # nearest: exp(0) = 1
            wa, wb = w.sum(-1), w.sum(-2)  # [G, c, N]
            inv_z = wa.sum(-1).reciprocal_()  # [G, c]
            counts += (inv_z[:, None, :] @ w.view(groups, c, -1))[:, 0]
            wa *= inv_z[..., None]
            wb *= inv_z[..., None]
            max_weight += inv_z.sum(-1)
        _accumulate_marginals(rhs, wa, wb, part, n)
    return EStats(counts.view(groups, n, n), rhs, sse, max_weight / max(1, m))


def e_step(points: torch.Tensor, weights: torch.Tensor, theta: torch.Tensor, temperature: float | None,
           chunk: int | None = None) -> EStats:
    """e_step_groups of one group: points [M, g, 2], theta [N, g, 2] -> counts [N, N], rhs [2N, g], floats."""
    s = e_step_groups(points[None], weights, theta[None], temperature, chunk)
    return EStats(s.counts[0], s.rhs[0], float(s.hard_sse[0]), float(s.max_weight[0]))


def soft_stats_to_points(points: torch.Tensor, centres: torch.Tensor, temperature: float,
                         chunk: int | None = None) -> EStats:
    """E-step of points [G, M, g, 2] against N^2 arbitrary (unstructured) centres [G, N*N, 2g], centre a*N + b
    standing for code (a, b): the official initialisation (random data points as centres, then one M-step).
    Statistics only (hard_sse and max_weight NaN)."""
    groups, m, g = points.shape[0], points.shape[1], points.shape[2]
    n = math.isqrt(centres.shape[-2])
    dtype, device = points.dtype, points.device
    counts = torch.zeros(groups, n * n, dtype=dtype, device=device)
    rhs = torch.zeros(groups, 2 * n, g, dtype=dtype, device=device)
    flat = points.reshape(groups, m, -1)
    centre_sq = centres.square().sum(-1)
    step = chunk_points(chunk, groups, n * n, device)
    for start in range(0, m, step):
        part, part_flat = points[:, start : start + step], flat[:, start : start + step]
        c = part.shape[1]
        d2 = torch.baddbmm(centre_sq[:, None, :], part_flat, centres.transpose(1, 2), alpha=-2)
        d2 += part_flat.square().sum(-1)[..., None]
        dist = d2.clamp_(min=0).sqrt_()  # [G, c, N*N]
        w = _exp_(dist.sub_(dist.amin(-1, keepdim=True)).mul_(-1.0 / temperature))
        w3 = w.view(groups, c, n, n)
        wa, wb = w3.sum(-1), w3.sum(-2)
        inv_z = wa.sum(-1).reciprocal_()
        counts += (inv_z[:, None, :] @ w)[:, 0]
        wa *= inv_z[..., None]
        wb *= inv_z[..., None]
        _accumulate_marginals(rhs, wa, wb, part, n)
    nan = torch.full((groups,), float("nan"), device=device)
    return EStats(counts.view(groups, n, n), rhs, nan, nan)


def m_step(stats: EStats, count_eps: float = 1e-8, ridge: float = 1e-6) -> torch.Tensor:
    """Closed-form weighted least squares for the codewords: theta [..., N, g, 2] minimising
    sum_i sum_ab W_i,ab |k_i - (w_a + i w_b)|^2, all g pairs at once (they share the assignments); batched over
    leading group axes of counts [..., N, N] and rhs [..., 2N, g].

    Normal equations in (x; y) block order: [[D, K], [K^T, D]] (x; y) = rhs with D = diag(n^A + n^B),
    n^A_l = sum_b n_lb, n^B_l = sum_a n_al, K[l, m] = n_ml - n_lm (digest §3.5, the structure of T^T S T of
    the paper's Eq. 33). Counts get +1e-8 as in the official code, the system a ridge of 1e-6 trace/dim (digest
    §8 item 9). Solved in float64 (2N x 2N systems: negligible next to the E-step); solve_ex without its error
    check, which would sync a GPU every step (the ridge keeps the system regular)."""
    n = stats.counts.shape[-1]
    counts = stats.counts.double() + count_eps
    diag = torch.diag_embed(counts.sum(-1) + counts.sum(-2))
    k = counts.transpose(-1, -2) - counts
    system = torch.cat([torch.cat([diag, k], -1), torch.cat([k.transpose(-1, -2), diag], -1)], -2)
    trace = system.diagonal(dim1=-2, dim2=-1).sum(-1)
    eye = torch.eye(2 * n, dtype=system.dtype, device=system.device)
    system = system + (ridge * trace / (2 * n))[..., None, None] * eye
    solution, _ = torch.linalg.solve_ex(system, stats.rhs.double())
    return torch.stack((solution[..., :n, :], solution[..., n:, :]), dim=-1).to(stats.rhs.dtype)


@dataclass
class StageFit:
    theta: torch.Tensor  # [N, g, 2], the best codebook by hard error on the training points
    steps: int  # E-steps run (the initial one at T = 1 included)
    hard_steps: int  # of which hard k-means steps after the soft ones stalled
    train_mse: float  # weighted hard error per element at theta
    max_weight: float  # mean max soft weight at the last soft step
    history: list[float] = field(default_factory=list)  # hard training error per E-step


def _select(stats: EStats, index: torch.Tensor | None) -> EStats:
    if index is None:
        return stats
    return EStats(stats.counts[index], stats.rhs[index], stats.hard_sse[index], stats.max_weight[index])


def fit_stage_groups(points: torch.Tensor, weights: torch.Tensor, n_codes: int, steps: int, temperature: float,
                     generators: list[torch.Generator], tol: float = 1e-3, init_temperature: float = 1.0,
                     chunk: int | None = None) -> list[StageFit]:
    """Soft EM for one stage's commutative codebook of every group (Alg. 1 / the official `run_em_algorithm`):
    points [G, M, g, 2], one generator per group. Each group follows its own path (the batched E- and M-steps
    run on the groups still active, with their own soft/hard phase); the result of a group is the one its
    own fit would give.

    - Init (official code): N^2 random training points as unstructured centres, one very soft E-step at
      `init_temperature`, one M-step (a near-mean start that the constraint projects onto the family).
    - Step s of `steps`: T = temperature * (1e-2)^(s / (steps - 1)), the official exponential decay
      1e-3 -> 1e-5 over the step budget; the caller scales `temperature` per stage and model.
    - The codebook with the lowest hard error is kept (official rule). When a soft step does not improve it
      and the increase is below `tol` (relative; the code's 1e-5 is absolute in its key units) the soft phase
      stops and hard k-means steps continue from the best codebook while they improve (digest §8 item 8).
    `weights` [M] weigh the hard error (kappa^2); assignments and the M-step are unweighted, as in the code.
    One host sync per step (the hard errors that decide the stopping)."""
    groups, m = points.shape[0], points.shape[1]
    if m == 0:
        raise ValueError("fit_stage needs at least one point")
    device = points.device
    flat = points.reshape(groups, m, -1)
    picks = torch.stack([torch.randint(m, (n_codes * n_codes,), generator=gen) for gen in generators]).to(device)
    centres = flat[torch.arange(groups, device=device)[:, None], picks]  # [G, N^2, 2g]
    theta = m_step(soft_stats_to_points(points, centres, init_temperature, chunk))
    elements = m * points.shape[2] * 2
    best_sse = [float("inf")] * groups
    best_theta = theta.clone()
    hard, done = [False] * groups, [False] * groups
    e_steps, hard_steps = [1] * groups, [0] * groups
    max_weight = [float("nan")] * groups
    history: list[list[float]] = [[] for _ in range(groups)]

    def run_e(which: list[int], th: torch.Tensor, t: float | None) -> EStats:
        index = None if len(which) == groups else torch.tensor(which, device=device)
        pts = points if index is None else points[index]
        return e_step_groups(pts, weights, th if index is None else th[index], t, chunk)

    for step in range(steps):
        active = [j for j in range(groups) if not done[j]]
        if not active:
            break
        t = temperature * 1e-2 ** (step / max(1, steps - 1))
        soft = [j for j in active if not hard[j]]
        hardg = [j for j in active if hard[j]]
        parts = [(soft, run_e(soft, theta, t))] if soft else []
        if hardg:
            parts.append((hardg, run_e(hardg, theta, None)))
        order = [j for which, _ in parts for j in which]
        stats = EStats(*(torch.cat([getattr(s, f) for _, s in parts]) for f in ("counts", "rhs", "hard_sse",
                                                                                 "max_weight")))
        sse, weights_max = stats.hard_sse.tolist(), stats.max_weight.tolist()
        update, restart = [], []  # groups that take an M-step; of them, those that restart from the best codebook
        for pos, j in enumerate(order):
            e_steps[j] += 1
            hard_steps[j] += hard[j]
            history[j].append(sse[pos] / elements)
            if not hard[j]:
                max_weight[j] = weights_max[pos]
            if sse[pos] < best_sse[j] * (1 - TIE):
                best_sse[j] = sse[pos]
                best_theta[j] = theta[j]
            elif hard[j]:
                done[j] = True  # hard steps no longer help
                continue
            elif sse[pos] - best_sse[j] < tol * best_sse[j]:
                hard[j] = True  # soft plateau: hard k-means steps from the best codebook
                restart.append(pos)
            update.append(pos)
        if restart:
            again = run_e([order[pos] for pos in restart], best_theta, None)
            for f in ("counts", "rhs"):
                getattr(stats, f)[torch.tensor(restart, device=device)] = getattr(again, f)
            for pos in restart:
                e_steps[order[pos]] += 1
                hard_steps[order[pos]] += 1
        if update:
            rows = torch.tensor(update, device=device)
            targets = torch.tensor([order[pos] for pos in update], device=device)
            theta[targets] = m_step(_select(stats, rows))
    else:
        # the last M-step's codebook is scored too (groups whose hard steps did not stop them)
        last = [j for j in range(groups) if not done[j]]
        if last:
            final = run_e(last, theta, None).hard_sse.tolist()
            for pos, j in enumerate(last):
                e_steps[j] += 1
                history[j].append(final[pos] / elements)
                if final[pos] < best_sse[j] * (1 - TIE):
                    best_sse[j] = final[pos]
                    best_theta[j] = theta[j]
    return [StageFit(best_theta[j], e_steps[j], hard_steps[j], best_sse[j] / elements, max_weight[j], history[j])
            for j in range(groups)]


def fit_stage(points: torch.Tensor, weights: torch.Tensor, n_codes: int, steps: int, temperature: float,
              generator: torch.Generator, tol: float = 1e-3, init_temperature: float = 1.0,
              chunk: int | None = None) -> StageFit:
    """fit_stage_groups of one group: points [M, g, 2]."""
    return fit_stage_groups(points[None], weights, n_codes, steps, temperature, [generator], tol, init_temperature,
                            chunk)[0]


def fit_residual_groups(train: torch.Tensor, train_weights: torch.Tensor, held: torch.Tensor,
                        held_weights: torch.Tensor, n_codes: int, stages: int, steps: int, temperatures: list[float],
                        generator_for: Callable[[int, int], torch.Generator], tol: float = 1e-3,
                        init_temperature: float = 1.0, chunk: int | None = None,
                        on_stage: Callable[[int], None] | None = None):
    """Residual stages of every group at once: train [G, M, g, 2] and held-out [G, H, g, 2] points. Stage r fits
    the residual the earlier stages leave on the training points (greedy encoding, as at inference) with the
    generator `generator_for(group, r)` and temperature r. Returns (theta [G, R, N, g, 2], fits [G][R],
    held-out weighted MSE per element [G][R] after each stage). `on_stage(G)` after each stage."""
    groups = train.shape[0]
    residual, held_residual = train.clone(), held.clone()
    thetas, fits, held_mse = [], [], []
    held_elements = max(1, held.shape[1] * held.shape[2] * 2)
    hw = held_weights.to(held.device, held.dtype)[None, :, None, None]
    for r in range(stages):
        stage = fit_stage_groups(residual, train_weights, n_codes, steps, temperatures[r],
                                 [generator_for(j, r) for j in range(groups)], tol, init_temperature, chunk)
        theta = torch.stack([f.theta for f in stage])
        thetas.append(theta)
        fits.append(stage)
        a, b, _ = nearest_codes_groups(residual, theta, chunk)
        residual -= group_centres(theta, a, b)
        if held.shape[1]:
            a, b, _ = nearest_codes_groups(held_residual, theta, chunk)
            held_residual -= group_centres(theta, a, b)
            held_mse.append((hw * held_residual.square()).sum((1, 2, 3), dtype=torch.float64) / held_elements)
        else:
            held_mse.append(torch.full((groups,), float("nan"), dtype=torch.float64))
        if on_stage is not None:
            on_stage(groups)
    mse = torch.stack([m.cpu() for m in held_mse], 1).tolist()  # [G][R]
    return torch.stack(thetas, 1), [[fits[r][j] for r in range(stages)] for j in range(groups)], mse


def fit_residual(train: torch.Tensor, train_weights: torch.Tensor, held: torch.Tensor, held_weights: torch.Tensor,
                 n_codes: int, stages: int, steps: int, temperatures: list[float],
                 generator_for: Callable[[int], torch.Generator], tol: float = 1e-3, init_temperature: float = 1.0,
                 chunk: int | None = None, on_stage: Callable[[], None] | None = None):
    """fit_residual_groups of one group: train [M, g, 2], held [H, g, 2] -> (theta [R, N, g, 2], fits, held MSE [R])."""
    theta, fits, mse = fit_residual_groups(train[None], train_weights, held[None], held_weights, n_codes, stages,
                                           steps, temperatures, lambda _, r: generator_for(r), tol, init_temperature,
                                           chunk, None if on_stage is None else lambda _: on_stage())
    return theta[0], fits[0], mse[0]
