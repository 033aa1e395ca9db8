"""Run-to-run reproducible results on the GPU: torch's deterministic mode for the length of a command.

kvcal's decode kernels read torch's flag: with `torch.use_deterministic_algorithms(True)` KVQuant's value residuals
(fp16 and bf16 queries) are summed in int64 fixed point instead of with float32 atomics, whose run-dependent order
made two decodes of smollm2-135m differ by up to 0.7% (float16) and 1.7% (bfloat16) in perplexity. Every other kvcal
kernel is deterministic already.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch


@contextmanager
def deterministic_algorithms(enabled: bool = True):
    """torch.use_deterministic_algorithms(enabled) inside the block, the previous setting after it. warn_only: a
    torch op without a deterministic implementation warns instead of failing the command. cuBLAS reads
    CUBLAS_WORKSPACE_CONFIG when it creates its first handle, so enter this before the model's first matmul on
    the GPU (a value the user set is kept)."""
    was, was_warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn_only)
