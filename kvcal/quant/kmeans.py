"""Weighted k-means in torch (CPU or GPU), shared by KVQuant (1-D datatypes) and SKVQ (channel clusters).

k-means++ initialisation with sample weights, Lloyd iterations, best of `n_init` runs by weighted
inertia, all driven by one seeded generator so the same inputs give the same centroids.

One-dimensional data (KVQuant: millions of normalized activations per layer) takes a fast exact path:
the points are sorted once with prefix sums of w, w*x and w*x^2 (float64). A cluster of sorted centroids
is then a contiguous range of the sorted points, found by binary search of the midpoints, and its
weight, mean and cost come from the prefix sums, so each Lloyd step costs O(k log N), not O(N k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

INIT_SAMPLE = 50_000  # points seen by k-means++ initialisation on large inputs


@dataclass
class KMeansResult:
    centers: torch.Tensor  # [k, d] (sorted ascending when d == 1)
    labels: torch.Tensor  # [N]
    inertia: float  # sum_i w_i * ||x_i - c_{label_i}||^2
    iterations: int


def _assign(points: torch.Tensor, centers: torch.Tensor, chunk: int = 1 << 20):
    """Nearest center index and squared distance for every point."""
    if points.shape[1] == 1:
        order = torch.argsort(centers[:, 0])
        sorted_c = centers[order, 0]
        mids = (sorted_c[1:] + sorted_c[:-1]) / 2
        idx = torch.searchsorted(mids, points[:, 0].contiguous())
        labels = order[idx]
        return labels, (points[:, 0] - centers[labels, 0]) ** 2
    labels, dist = [], []
    for start in range(0, points.shape[0], chunk):
        d2 = torch.cdist(points[start : start + chunk], centers).pow(2)
        m = d2.min(dim=1)
        labels.append(m.indices)
        dist.append(m.values)
    return torch.cat(labels), torch.cat(dist)


def _weighted_choice(probs: torch.Tensor, generator: torch.Generator) -> int:
    # Inverse-CDF sampling: works for any number of points (torch.multinomial stops at 2**24).
    cdf = torch.cumsum(probs.to(torch.float64), 0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1].cpu()
    return int(torch.searchsorted(cdf, u.to(cdf.device)).clamp(max=probs.numel() - 1))


def _sqdist(points: torch.Tensor, center: torch.Tensor) -> torch.Tensor:
    if points.shape[1] == 1:  # a reduction over a dimension of size 1 is needlessly slow
        return (points[:, 0] - center[0]) ** 2
    return ((points - center) ** 2).sum(1)


def _kmeans_pp(points, weights, k, generator):
    """Greedy k-means++ (as scikit-learn): each new center is the best of 2 + log(k) D^2-weighted draws."""
    trials = 2 + int(math.log(k))
    centers = torch.empty(k, points.shape[1], dtype=points.dtype, device=points.device)
    centers[0] = points[_weighted_choice(weights, generator)]
    closest = _sqdist(points, centers[0])
    for i in range(1, k):
        score = weights * closest
        best = None
        for _ in range(trials):
            idx = _weighted_choice(score if float(score.sum()) > 0 else weights, generator)
            candidate = torch.minimum(closest, _sqdist(points, points[idx]))
            potential = float((weights * candidate).sum())
            if best is None or potential < best[0]:
                best = (potential, idx, candidate)
        _, idx, closest = best
        centers[i] = points[idx]
    return centers


def _lloyd(points, weights, centers, max_iter, tol):
    k, inertia, it = centers.shape[0], float("inf"), 0
    for it in range(1, max_iter + 1):
        labels, d2 = _assign(points, centers)
        new_inertia = float((weights * d2).sum())
        wsum = torch.zeros(k, dtype=points.dtype, device=points.device).index_add_(0, labels, weights)
        wx = torch.zeros_like(centers).index_add_(0, labels, points * weights[:, None])
        empty = wsum <= 0
        centers = torch.where(empty[:, None], centers, wx / wsum.clamp_min(torch.finfo(points.dtype).tiny)[:, None])
        if empty.any():  # move empty clusters to the points that cost the most
            far = torch.topk(weights * d2, int(empty.sum())).indices
            centers[empty] = points[far]
        converged = inertia - new_inertia <= tol * max(new_inertia, 1e-30)
        inertia = new_inertia
        if converged:
            break
    labels, d2 = _assign(points, centers)
    return centers, labels, float((weights * d2).sum()), it


class _Sorted1D:
    """Sorted points with float64 prefix sums: O(log N) cluster statistics for any interval."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor):
        order = torch.argsort(x)
        self.x = x[order]
        ws = w[order].to(torch.float64)
        xs = self.x.to(torch.float64)
        zero = torch.zeros(1, dtype=torch.float64, device=x.device)
        self.cw = torch.cat([zero, torch.cumsum(ws, 0)])
        self.cwx = torch.cat([zero, torch.cumsum(ws * xs, 0)])
        self.cwxx = torch.cat([zero, torch.cumsum(ws * xs * xs, 0)])

    def stats(self, centers: torch.Tensor):
        """Sorted centers [k] -> per-cluster (weight, weighted sum, cost) of the nearest-center partition."""
        mids = (centers[1:] + centers[:-1]) / 2
        inner = torch.searchsorted(self.x, mids.to(self.x.dtype), right=True)
        n = self.x.new_tensor([self.x.numel()], dtype=torch.int64)
        bounds = torch.cat([torch.zeros_like(n), inner, n])
        w = self.cw[bounds[1:]] - self.cw[bounds[:-1]]
        wx = self.cwx[bounds[1:]] - self.cwx[bounds[:-1]]
        wxx = self.cwxx[bounds[1:]] - self.cwxx[bounds[:-1]]
        c = centers.to(torch.float64)
        cost = (wxx - 2 * c * wx + c * c * w).clamp_min(0)
        return w, wx, cost


def _lloyd_1d(data: _Sorted1D, points, weights, centers, max_iter, tol):
    c = torch.sort(centers[:, 0]).values.to(torch.float64)
    inertia, it = float("inf"), 0
    for it in range(1, max_iter + 1):
        w, wx, cost = data.stats(c)
        new_inertia = float(cost.sum())
        empty = w <= 0
        c = torch.where(empty, c, wx / w.clamp_min(1e-300))
        if empty.any():  # move empty clusters to the points that cost the most
            _, d2 = _assign(points, c[:, None].to(points.dtype))
            far = torch.topk(weights * d2, int(empty.sum())).indices
            c[empty] = points[far, 0].to(torch.float64)
        c = torch.sort(c).values
        converged = inertia - new_inertia <= tol * max(new_inertia, 1e-30)
        inertia = new_inertia
        if converged:
            break
    # Labels are computed once, for the best run (see weighted_kmeans); the cost comes from prefix sums.
    return c.to(points.dtype)[:, None], None, float(data.stats(c)[2].sum()), it


def weighted_kmeans(points: torch.Tensor, k: int, weights: torch.Tensor | None = None, seed: int = 0,
                    n_init: int = 3, max_iter: int = 100, tol: float = 1e-6) -> KMeansResult:
    """Cluster `points` [N] or [N, d] into k clusters minimising sum_i w_i ||x_i - c||^2."""
    if points.dim() == 1:
        points = points[:, None]
    points = points.to(torch.float32)
    weights = torch.ones(points.shape[0], device=points.device) if weights is None else weights.to(points)
    if points.shape[0] < k:
        raise ValueError(f"k-means needs at least k={k} points, got {points.shape[0]}")
    generator = torch.Generator().manual_seed(seed)
    sorted_1d = _Sorted1D(points[:, 0], weights) if points.shape[1] == 1 else None
    best = None
    for _ in range(n_init):
        if points.shape[0] > INIT_SAMPLE:
            # k-means++ on a uniform subsample (its weights kept); Lloyd then runs on every point.
            pick = torch.randint(points.shape[0], (INIT_SAMPLE,), generator=generator).to(points.device)
            centers = _kmeans_pp(points[pick], weights[pick], k, generator)
        else:
            centers = _kmeans_pp(points, weights, k, generator)
        if sorted_1d is not None:
            centers, labels, inertia, iters = _lloyd_1d(sorted_1d, points, weights, centers, max_iter, tol)
        else:
            centers, labels, inertia, iters = _lloyd(points, weights, centers, max_iter, tol)
        if best is None or inertia < best.inertia:
            best = KMeansResult(centers, labels, inertia, iters)
    if points.shape[1] == 1:  # sorted centroids (the 1-D path keeps them sorted), labels to match
        best.labels = _assign(points, best.centers)[0]
    return best
