"""How a decode step divides a row's packed tokens among its NSPLIT split programs: each split takes an equal share
rounded up to whole tiles, computed from the row's own length inside the kernel (no host sync; rows differ in
length). Split s covers tokens [s share, min((s + 1) share, length)); a split past the row's end is empty.

One definition for the decode kernels (attention.py, attention_frag.py), the value-outlier pass that must find a
token's split, and its torch reference.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - split_share still works
    triton = None


def split_share(length: int, num_splits: int, block_t: int) -> int:
    """Tokens per split of a row of `length` packed tokens (0 when the row is empty)."""
    per_split = -(-length // num_splits)
    return -(-per_split // block_t) * block_t


if triton is not None:

    @triton.jit
    def split_share_tl(length, NSPLIT, TILE: tl.constexpr):
        """split_share inside a kernel."""
        return tl.cdiv(tl.cdiv(length, NSPLIT), TILE) * TILE
