"""Triton building blocks below every kernel (the quantizers' and the decode kernels'), with no method names in them:
dot products of rounded operands exact in float32 and float64 (`dot`, `operand`, `mma_operand`), regrouping of a
tile's head columns (`regroup`), and the head sizes the decode kernels take (`head_dim_unsupported`, which load_model
checks). Same semantics under TRITON_INTERPRET=1."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def head_dim_unsupported(d: int) -> str | None:
    """Why the decode kernels cannot take heads of d channels (None: they can). load_model refuses such a model."""
    if d < 32 or d & (d - 1):
        return f"head_dim {d} (a power of two >= 32 is supported)"
    return None


if triton is not None:

    @triton.jit
    def dot(a, b, INTERP: tl.constexpr):
        # Triton's interpreter multiplies bf16 operands as raw integers (3.6 and 3.9): upcast there
        # (exact: the tensor cores also multiply bf16/fp16 exactly and accumulate in fp32).
        if a.dtype == tl.float64:
            # float64 inputs (an exactness mode, not a fast path): products and sums on the FP64 units.
            # Triton 3.6's float64 tl.dot fails to compile on these operand layouts ("fp64 don't support
            # largeK MMA") and gave wrong sums in a 1-warp N=4 test on the H100, so no tensor cores here.
            return tl.sum(a[:, :, None] * b[None, :, :], 1)
        elif INTERP:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif a.dtype == tl.float32:  # float32 inputs: exact products, no TF32
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def operand(x, PREC: tl.constexpr):
        """A rounded dot operand: fp16 for fp16/bf16 inputs (PREC 16; bf16 queries are converted: exact in
        fp16's range), float32 / float64 for float32 / float64 inputs (PREC 32 / 64: nothing rounded beyond
        the input's own precision)."""
        if PREC == 64:
            return x.to(tl.float64)
        elif PREC == 32:
            return x.to(tl.float32)
        else:
            return x.to(tl.float16)

    @triton.jit
    def mma_operand(x, PREC: tl.constexpr, INTERP: tl.constexpr):
        """operand for a dot operand built in registers from packed codes. On the GPU an fp16 operand also goes
        through an opaque identity (one mov per register pair): Triton 3.6 picks the operands' kWidth from
        the narrowest type in their backward slice of pure elementwise/view ops and halves it when a tl.join
        is in it, so unpacked codes got kWidth 4, whose A operand is read back from shared memory with 64-bit
        loads and register moves instead of ldmatrix. A non-pure inline asm ends that slice (kWidth 2). SASS
        for sm_90, int4 decode main loop: 815 -> 627 instructions per 32-token tile, the 161 IMAD.MOV gone."""
        y = operand(x, PREC)
        if INTERP or PREC != 16:  # the interpreter has no inline asm; fp32/fp64 operands are not affected
            return y
        else:
            return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [y], dtype=tl.float16, is_pure=False,
                                             pack=2)

    @triton.jit
    def regroup(x, SRC: tl.constexpr, DST: tl.constexpr, N: tl.constexpr):
        """Columns [N, SRC] -> [N, DST] keeping columns < min(SRC, DST) (columns >= G must be zero)."""
        if SRC == DST:
            return x
        elif SRC > DST:
            return tl.sum(tl.reshape(x, (N, SRC // DST, DST)), 1)
        else:
            r = tl.arange(0, DST // SRC)
            y = tl.where((r == 0)[None, :, None], tl.broadcast_to(x[:, None, :], (N, DST // SRC, SRC)), 0.0)
            return tl.reshape(y, (N, DST))
