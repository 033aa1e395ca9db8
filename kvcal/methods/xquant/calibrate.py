"""XQuant's calibration (the method: kvcal/methods/xquant/method.py), data-free (§2.7): thin SVDs of the key and
value projection weights in float64, signs normalized, R recomputed from the stored float32 U, the reconstruction
error recorded; the predicted Key outlier channel (App. B); the cross-layer variants' basis of [W_k | W_v]."""

from __future__ import annotations

import torch

from kvcal.errors import KvcalError
from kvcal.methods.xquant.storage import DELTA, PLAIN

OUTLIER_TOP_K = 8  # App. B: the Key outlier channel predicted among the top-k of |B_k^T[0, :]|
MAX_RECON_ERROR = 1e-5  # ||U R - W|| / ||W|| of every stored factorization (digest §8.2 unit test)


def thin_svd(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """w [d, r] (paper orientation: K = X w) -> U [d, r'] float32 with orthonormal columns, R [r', r] float32,
    singular values [r'] and ||U R - w|| / ||w||, r' = min(d, r). The SVD runs in float64; each column of U has its
    largest-magnitude entry positive (a deterministic sign: it does not change U R); R = U^T w from the stored U,
    so that U R matches w as closely as float32 U allows."""
    w64 = w.to(torch.float64)
    u, s, _ = torch.linalg.svd(w64, full_matrices=False)
    pivot = u.abs().argmax(0)
    sign = torch.sign(u[pivot, torch.arange(u.shape[1])])
    u32 = (u * torch.where(sign == 0, 1.0, sign)).to(torch.float32)
    r32 = (u32.to(torch.float64).T @ w64).to(torch.float32)
    error = float(torch.linalg.norm(u32.double() @ r32.double() - w64) / torch.linalg.norm(w64).clamp_min(1e-300))
    return u32, r32, s, error


def svd_factors(weights, roles: list[str], base_repr: str) -> tuple[dict[str, torch.Tensor], dict]:
    """weights: (W_k, W_v) per layer (HF [out, in]), roles: each layer's role (XQuant.layer_plan), base_repr: the
    cross-layer base's ("latent": it gets the [W_k | W_v] basis too) -> (the artifact's tensors, its info). Plain
    layers: U, R, S of W_k and of W_v and the predicted Key outlier channels; delta layers (and a latent base): U, S
    of [W_k | W_v]."""
    tensors, errors = {}, {}
    for i, (w_k, w_v) in enumerate(weights):
        role = roles[i]
        # HF weights are [out, in]: the paper's W (K = X W) is their transpose
        if role == PLAIN:
            for side, w in (("k", w_k), ("v", w_v)):
                u, r, s, err = thin_svd(w.T)
                tensors.update({f"layers.{i}.{side}.U": u, f"layers.{i}.{side}.R": r,
                                f"layers.{i}.{side}.S": s.to(torch.float32)})
                errors[f"layers.{i}.{side}"] = err
            top = min(OUTLIER_TOP_K, tensors[f"layers.{i}.k.R"].shape[1])
            # App. B: the Key channel j with the largest |B_k^T[0, j]| (R_k's row 0 is sigma_0 B_k^T[0, :])
            tensors[f"layers.{i}.k.outlier_pred"] = tensors[f"layers.{i}.k.R"][0].abs().topk(top).indices.to(
                torch.int32)
        elif role == DELTA or base_repr == "latent":
            u, _, s, err = thin_svd(torch.cat([w_k, w_v], 0).T)  # [W_k | W_v]; its R is not needed (§2.5)
            tensors.update({f"layers.{i}.x.U": u, f"layers.{i}.x.S": s.to(torch.float32)})
            # the factorization that matters: U U^T [W_k | W_v] = [W_k | W_v]
            w = torch.cat([w_k, w_v], 0).T.double()
            ud = u.double()
            errors[f"layers.{i}.x"] = float(torch.linalg.norm(ud @ (ud.T @ w) - w) / torch.linalg.norm(w))
    worst = max(errors.values(), default=0.0)
    if worst > MAX_RECON_ERROR:
        name = max(errors, key=errors.get)
        raise KvcalError(f"xquant: the SVD of {name} reconstructs its weight to {worst:.2e} relative error "
                         f"(more than {MAX_RECON_ERROR:g}): the weights are not finite or not float")
    info = {"svd": {"dtype": "float64", "stored": "float32", "sign": "largest-magnitude entry of each U column "
                    "positive", "max_relative_error": worst, "relative_error": errors}}
    return tensors, info
