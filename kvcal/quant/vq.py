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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

DISTANCE_CHUNK = 256  # points per chunk: a chunk's distance block is [chunk, N, N] floats (4 MiB at N = 64)


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


def decode_residual(theta: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Sum over stages of the centres: theta [G, R, N, g, 2], codes [..., G, R, 2] (any integer dtype, first R'
    <= R stages) -> [..., G, g, 2] in theta's dtype."""
    groups, stages = codes.shape[-3], codes.shape[-2]
    flat = codes.reshape(-1, groups, stages, 2).long()
    out = torch.zeros(flat.shape[0], groups, theta.shape[-2], 2, dtype=theta.dtype, device=theta.device)
    for grp in range(groups):
        for r in range(stages):
            out[:, grp] += pair_centres(theta[grp, r], flat[:, grp, r, 0], flat[:, grp, r, 1])
    return out.reshape(*codes.shape[:-3], groups, theta.shape[-2], 2)


@dataclass
class StageTables:
    """What distances to the N^2 centres of one stage need: u [N, 2g] (codewords, pairs interleaved), ju = J u,
    sq [N] = sum_j |w^j|^2, cross [N, N] = G_ab."""

    u: torch.Tensor
    ju: torch.Tensor
    sq: torch.Tensor
    cross: torch.Tensor

    @classmethod
    def of(cls, theta: torch.Tensor) -> StageTables:
        n = theta.shape[0]
        u = theta.reshape(n, -1)
        ju = rotate_quarter(theta).reshape(n, -1)
        return cls(u, ju, theta.square().sum((1, 2)), 2 * u @ ju.T)


def squared_distances(points: torch.Tensor, point_sq: torch.Tensor, t: StageTables) -> torch.Tensor:
    """|r - c_ab|^2 [M, N, N] (a, b) of points [M, 2g] (|r|^2 = point_sq [M]), clamped at 0 (rounding)."""
    p = torch.addmm(t.sq, points, t.u.T, alpha=-2)
    q = torch.addmm(t.sq, points, t.ju.T, alpha=-2)
    d2 = p[:, :, None] + q[:, None, :]
    d2 += t.cross
    d2 += point_sq[:, None, None]
    return d2.clamp_(min=0)


def nearest_codes(points: torch.Tensor, theta: torch.Tensor, chunk: int = DISTANCE_CHUNK):
    """Greedy nearest centre of one stage: points [M, g, 2], theta [N, g, 2] -> (a [M], b [M], squared distance [M])."""
    n = theta.shape[0]
    flat = points.reshape(points.shape[0], -1)
    tables = StageTables.of(theta)
    a, b, best = [], [], []
    for start in range(0, flat.shape[0], chunk):
        part = flat[start : start + chunk]
        d2 = squared_distances(part, part.square().sum(1), tables).view(part.shape[0], -1)
        value, index = d2.min(1)
        a.append(index // n)
        b.append(index % n)
        best.append(value)
    if not a:
        empty = torch.zeros(0, dtype=torch.long, device=points.device)
        return empty, empty, torch.zeros(0, dtype=points.dtype, device=points.device)
    return torch.cat(a), torch.cat(b), torch.cat(best)


def encode_residual(x: torch.Tensor, theta: torch.Tensor, chunk: int = DISTANCE_CHUNK) -> torch.Tensor:
    """Greedy residual encoding: x [M, G, g, 2], theta [G, R, N, g, 2] -> codes [M, G, R, 2] (int64). Stage r
    picks the nearest centre to what the earlier stages left."""
    groups, stages = theta.shape[0], theta.shape[1]
    codes = torch.zeros(x.shape[0], groups, stages, 2, dtype=torch.long, device=x.device)
    for grp in range(groups):
        residual = x[:, grp].to(theta.dtype).clone()
        for r in range(stages):
            a, b, _ = nearest_codes(residual, theta[grp, r], chunk)
            codes[:, grp, r, 0], codes[:, grp, r, 1] = a, b
            residual -= pair_centres(theta[grp, r], a, b)
    return codes


# -- EM for one group and stage ----------------------------------------------------------------------------


@dataclass
class EStats:
    """Sufficient statistics of one E-step and the hard-assignment error at the current codebook."""

    counts: torch.Tensor  # [N, N] n_ab = sum_i W_i,ab
    rhs: torch.Tensor  # [2N, g]: rows 0..N-1 for x_l, N..2N-1 for y_l
    hard_sse: float  # sum_i weight_i * min_ab |r_i - c_ab|^2
    max_weight: float  # mean over points of max_ab W_i,ab (1 for hard steps)


def _accumulate(stats_counts, stats_rhs, weights_flat: torch.Tensor, part: torch.Tensor, n: int):
    """Add the soft assignments W [c, N*N] of points part [c, g, 2] to counts and right-hand sides."""
    stats_counts += weights_flat.sum(0).view(n, n)
    w3 = weights_flat.view(-1, n, n)
    wa, wb = w3.sum(2), w3.sum(1)  # marginals: W^A_il = sum_b W_i,lb and W^B_il = sum_a W_i,al
    px, py = part[..., 0], part[..., 1]
    # rhs(x_l) = sum_i W^A_il k_x + W^B_il k_y; rhs(y_l) = sum_i W^A_il k_y - W^B_il k_x
    stats_rhs[:n] += wa.T @ px + wb.T @ py
    stats_rhs[n:] += wa.T @ py - wb.T @ px


def e_step(points: torch.Tensor, weights: torch.Tensor, theta: torch.Tensor, temperature: float | None,
           chunk: int = DISTANCE_CHUNK) -> EStats:
    """Assignments of points [M, g, 2] to the N^2 centres of theta [N, g, 2]: soft, W = softmax(-|r - c|/T) over
    the L2 distance (not squared, as the official code's cdist), or hard (temperature None). `weights` [M]
    weigh the hard error only (kappa^2: the error in the keys' own units)."""
    n, g = theta.shape[0], theta.shape[1]
    counts = torch.zeros(n, n, dtype=points.dtype, device=points.device)
    rhs = torch.zeros(2 * n, g, dtype=points.dtype, device=points.device)
    tables = StageTables.of(theta)
    flat = points.reshape(points.shape[0], -1)
    sse, max_weight = 0.0, 0.0
    for start in range(0, flat.shape[0], chunk):
        part, part_flat = points[start : start + chunk], flat[start : start + chunk]
        d2 = squared_distances(part_flat, part_flat.square().sum(1), tables).view(part.shape[0], -1)
        best, index = d2.min(1)
        sse += float((weights[start : start + chunk] * best).sum())
        if temperature is None:
            counts.view(-1).index_add_(0, index, torch.ones_like(best))
            a, b = index // n, index % n
            rhs[:n].index_add_(0, a, part[..., 0]).index_add_(0, b, part[..., 1])
            rhs[n:].index_add_(0, a, part[..., 1]).index_add_(0, b, -part[..., 0])
            max_weight += part.shape[0]
        else:
            w = torch.softmax(d2.sqrt_().mul_(-1.0 / temperature), dim=1)
            max_weight += float(w.gather(1, index[:, None]).sum())
            _accumulate(counts, rhs, w, part, n)
    return EStats(counts, rhs, sse, max_weight / max(1, points.shape[0]))


def soft_stats_to_points(points: torch.Tensor, centres: torch.Tensor, temperature: float,
                         chunk: int = DISTANCE_CHUNK) -> EStats:
    """E-step against N^2 arbitrary (unstructured) centres [N*N, 2g], centre a*N + b standing for code (a, b):
    the official initialisation (random data points as centres, then one M-step)."""
    n = math.isqrt(centres.shape[0])
    g = centres.shape[1] // 2
    counts = torch.zeros(n, n, dtype=points.dtype, device=points.device)
    rhs = torch.zeros(2 * n, g, dtype=points.dtype, device=points.device)
    flat = points.reshape(points.shape[0], -1)
    centre_sq = centres.square().sum(1)
    for start in range(0, flat.shape[0], chunk):
        part, part_flat = points[start : start + chunk], flat[start : start + chunk]
        d2 = torch.addmm(centre_sq, part_flat, centres.T, alpha=-2).add_(part_flat.square().sum(1)[:, None])
        w = torch.softmax(d2.clamp_(min=0).sqrt_().mul_(-1.0 / temperature), dim=1)
        _accumulate(counts, rhs, w, part, n)
    return EStats(counts, rhs, float("nan"), float("nan"))


def m_step(stats: EStats, count_eps: float = 1e-8, ridge: float = 1e-6) -> torch.Tensor:
    """Closed-form weighted least squares for the codewords: theta [N, g, 2] minimising
    sum_i sum_ab W_i,ab |k_i - (w_a + i w_b)|^2, all g pairs at once (they share the assignments).

    Normal equations in (x; y) block order: [[D, K], [K^T, D]] (x; y) = rhs with D = diag(n^A + n^B),
    n^A_l = sum_b n_lb, n^B_l = sum_a n_al, K[l, m] = n_ml - n_lm (digest §3.5, the structure of T^T S T of
    the paper's Eq. 33). Counts get +1e-8 as in the official code, the system a ridge of 1e-6 trace/dim (digest
    §8 item 9). Solved in float64."""
    n = stats.counts.shape[0]
    counts = stats.counts.double() + count_eps
    diag = torch.diag(counts.sum(1) + counts.sum(0))
    k = counts.T - counts
    system = torch.cat([torch.cat([diag, k], 1), torch.cat([k.T, diag], 1)], 0)
    system += ridge * torch.trace(system) / (2 * n) * torch.eye(2 * n, dtype=system.dtype, device=system.device)
    solution = torch.linalg.solve(system, stats.rhs.double())
    return torch.stack((solution[:n], solution[n:]), dim=-1).to(stats.rhs.dtype)


@dataclass
class StageFit:
    theta: torch.Tensor  # [N, g, 2], the best codebook by hard error on the training points
    steps: int  # E-steps run (the initial one at T = 1 included)
    hard_steps: int  # of which hard k-means steps after the soft ones stalled
    train_mse: float  # weighted hard error per element at theta
    max_weight: float  # mean max soft weight at the last soft step
    history: list[float] = field(default_factory=list)  # hard training error per E-step


def fit_stage(points: torch.Tensor, weights: torch.Tensor, n_codes: int, steps: int, temperature: float,
              generator: torch.Generator, tol: float = 1e-3, init_temperature: float = 1.0,
              chunk: int = DISTANCE_CHUNK) -> StageFit:
    """Soft EM for one stage's commutative codebook (Alg. 1 / the official `run_em_algorithm`).

    - Init (official code): N^2 random training points as unstructured centres, one very soft E-step at
      `init_temperature`, one M-step (a near-mean start that the constraint projects onto the family).
    - Step s of `steps`: T = temperature * (1e-2)^(s / (steps - 1)), the official exponential decay
      1e-3 -> 1e-5 over the step budget; the caller scales `temperature` per stage and model.
    - The codebook with the lowest hard error is kept (official rule). When a soft step does not improve it
      and the increase is below `tol` (relative; the code's 1e-5 is absolute in its key units) the soft phase
      stops and hard k-means steps continue from the best codebook while they improve (digest §8 item 8).
    `weights` [M] weigh the hard error (kappa^2); assignments and the M-step are unweighted, as in the code."""
    m = points.shape[0]
    if m == 0:
        raise ValueError("fit_stage needs at least one point")
    pick = torch.randint(m, (n_codes * n_codes,), generator=generator).to(points.device)
    theta = m_step(soft_stats_to_points(points, points.reshape(m, -1)[pick], init_temperature, chunk))
    elements = m * points.shape[1] * 2
    best_sse, best_theta = float("inf"), theta
    hard, e_steps, hard_steps, max_weight, history = False, 1, 0, float("nan"), []
    for step in range(steps):
        t = None if hard else temperature * 1e-2 ** (step / max(1, steps - 1))
        stats = e_step(points, weights, theta, t, chunk)
        e_steps += 1
        hard_steps += hard
        history.append(stats.hard_sse / elements)
        if not hard:
            max_weight = stats.max_weight
        if stats.hard_sse < best_sse:
            best_sse, best_theta = stats.hard_sse, theta
        elif hard:
            break  # hard steps no longer help
        elif stats.hard_sse - best_sse < tol * best_sse:
            # soft plateau: hard k-means steps from the best codebook
            hard = True
            stats = e_step(points, weights, best_theta, None, chunk)
            e_steps += 1
            hard_steps += 1
        theta = m_step(stats)
    else:
        final = e_step(points, weights, theta, None, chunk)  # the last M-step's codebook is scored too
        e_steps += 1
        history.append(final.hard_sse / elements)
        if final.hard_sse < best_sse:
            best_sse, best_theta = final.hard_sse, theta
    return StageFit(best_theta, e_steps, hard_steps, best_sse / elements, max_weight, history)


def fit_residual(train: torch.Tensor, train_weights: torch.Tensor, held: torch.Tensor, held_weights: torch.Tensor,
                 n_codes: int, stages: int, steps: int, temperatures: list[float],
                 generator_for: Callable[[int], torch.Generator], tol: float = 1e-3, init_temperature: float = 1.0,
                 chunk: int = DISTANCE_CHUNK, on_stage: Callable[[], None] | None = None):
    """Residual stages of one group: train [M, g, 2] and held-out [H, g, 2] points. Stage r fits the residual the
    earlier stages leave on the training points (greedy encoding, as at inference) with its own generator and
    temperature. Returns (theta [R, N, g, 2], fits, held-out weighted MSE per element after each stage)."""
    residual, held_residual = train.clone(), held.clone()
    thetas, fits, held_mse = [], [], []
    held_elements = max(1, held.shape[0] * held.shape[1] * 2)
    for r in range(stages):
        fit = fit_stage(residual, train_weights, n_codes, steps, temperatures[r], generator_for(r), tol,
                        init_temperature, chunk)
        thetas.append(fit.theta)
        fits.append(fit)
        a, b, _ = nearest_codes(residual, fit.theta, chunk)
        residual -= pair_centres(fit.theta, a, b)
        if held.shape[0]:
            a, b, _ = nearest_codes(held_residual, fit.theta, chunk)
            held_residual -= pair_centres(fit.theta, a, b)
            held_mse.append(float((held_weights[:, None, None] * held_residual.square()).sum()) / held_elements)
        else:
            held_mse.append(float("nan"))
        if on_stage is not None:
            on_stage()
    return torch.stack(thetas), fits, held_mse
