"""CalibQuant's calibration (the method: kvcal/methods/calibquant/method.py): the grid search of the score remap's
global tau = (tau1, tau2) [P] minimizing the mean NLL of held-out calibration windows under the tail protocol (§7.1),
ties toward smaller tau2 - tau1 (§7.1), then smaller tau1. Sources as in method.py: [P] the paper, [D] the digest
(papers/calibquant.md), its §7 item N as "§7.N"."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcal.errors import KvcalError
from kvcal.methods.base import Storages
from kvcal.methods.calibquant.storage import remap_counts
from kvcal.methods.fp16.method import LosslessStorage
from kvcal.progress import progress_bar


def layout(objective, seqlen: int, group_tokens: int) -> tuple[int, int]:
    """The tail protocol's (prefix, block) on calibration windows of `seqlen` (its defaults, objective.layout; the
    block rounded down to whole groups of `group_tokens`, 0: one group)."""
    prefix, block = objective.layout(seqlen)
    if group_tokens:
        block -= block % group_tokens
        if block == 0:
            raise KvcalError(f"calibquant: calibration windows of {seqlen} tokens hold no {group_tokens}-token "
                             "group in the tail protocol's block: use a longer --seqlen")
    return prefix, block


def search_tau(objective, windows: torch.Tensor, grid: list[float], prefix: int, block: int,
               storages_with_tau: Callable[[float, float], Storages], uncalibrated: Storages) -> dict:
    """Every (tau1, tau2) of grid x grid through `storages_with_tau` (storages that count the remap's remapped and
    clamped query rows: remap_counts), then `uncalibrated` (no remap) and fp16, each the tail protocol's mean NLL on
    the windows (`objective`: the calibration store's, kvcal.eval.ppl.TailObjective). -> {"table": [len(grid),
    len(grid)] float64 (rows tau1, columns tau2),
    "clamped": the fraction of remapped rows whose slope was clamped, same shape, "uncalibrated_nll", "fp16_nll"}."""
    table = torch.zeros(len(grid), len(grid), dtype=torch.float64)
    clamped = torch.zeros_like(table)
    with progress_bar(f"calibquant tau grid ({len(grid)}x{len(grid)})", len(grid) ** 2 + 2) as advance:
        for i, t1 in enumerate(grid):
            for j, t2 in enumerate(grid):
                storages = storages_with_tau(t1, t2)
                table[i, j] = objective.nll(storages, windows, prefix, block)
                rows, clamps = remap_counts(storages)
                clamped[i, j] = clamps / max(rows, 1)
                advance(1)
        uncalibrated_nll = objective.nll(uncalibrated, windows, prefix, block)
        advance(1)
        fp16 = Storages([LosslessStorage()] * objective.loaded.dims.num_layers)
        exact = objective.nll(fp16, windows, prefix, block)
        advance(1)
    return {"table": table, "clamped": clamped, "uncalibrated_nll": uncalibrated_nll, "fp16_nll": exact}


def choose_tau(table: torch.Tensor, grid: list[float]) -> tuple[int, int]:
    """(i, j) of the smallest objective; ties toward smaller tau2 - tau1 (§7.1), then smaller tau1."""
    cells = [(float(table[i, j]), grid[j] - grid[i], grid[i], i, j) for i in range(len(grid)) for j in range(len(grid))]
    best = min(cells)
    return best[3], best[4]
