"""Static look at KVQuant's decode kernels beside RTN int4's, without a GPU: the real host functions
(kvquant.kernels.attend_triton, rtn's attend_triton) are called on CPU tensors at Llama-3.1-8B shapes (8 KV heads of
128, 32 query heads, bf16, 128-token window) with a stand-in Triton driver that compiles every launch for sm_90
(GPUTarget("cuda", 90, 32)) instead of running it. For each kernel it prints ptxas's registers and stack (spills) per
thread, shared memory, and the instruction mix of the main loop's SASS (the bundled cuobjdump; the longest loop, as
benchmarks/sass.py finds it: one 16-token tile of KVQuant's lookup-table path, one 32-token
tile of RTN's fragment kernel), then the bytes each packed token reads or writes per KV head, by stream:

    python benchmarks/kvquant_kernel_sass.py
    python benchmarks/kvquant_kernel_sass.py --recipes nuq4 --json out.json

The host's choices that depend on the device (prefetch eligibility, the split count) are set as on an sm_90 GPU with
132 SMs; the codes are zeros (nothing runs)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.runtime import driver as _driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from benchmarks.sass import Sm90Driver, cubin_report, instructions, loop_mix  # noqa: E402
from kvcal.runtime import kernels as K  # noqa: E402

SMS = 132
BATCH, HKV, HQ, D, TCAP, WINDOW = 8, 8, 32, 128, 32768, 128
SPLITS = 16 * SMS // (BATCH * HKV)  # split_count's default: 16 programs per SM over the (row, KV head) pairs


COMPILED: list[tuple[str, object, tuple]] = []
_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    if kernel is not None:
        COMPILED.append((self.fn.__name__, kernel, grid if isinstance(grid, tuple) else ()))
    return kernel


def sass_of(kernel) -> dict:
    registers, stack, sass = cubin_report(kernel.asm["cubin"])
    return {"registers": registers, "stack_bytes": stack, "shared_bytes": kernel.metadata.shared,
            "warps": kernel.metadata.num_warps, "sass_total": len(instructions(sass)), "loop": loop_mix(sass, LOOP_OPS)}


LOOP_OPS = ("LDG", "LDGSTS", "STS", "LDS", "LDSM", "LDL", "STL", "STG", "HMMA", "SHFL", "PRMT", "SHF", "LOP3", "IMAD",
            "HFMA2", "HMUL2", "FMUL", "FFMA", "FADD", "F2FP", "MUFU", "BAR")


def _step(dtype=torch.bfloat16):
    from kvcal.runtime.decode import FullPrecision

    q = torch.zeros(BATCH, HQ, D, dtype=dtype)
    fp = FullPrecision(torch.zeros(BATCH, HKV, WINDOW, D, dtype=dtype), torch.zeros(BATCH, HKV, WINDOW, D, dtype=dtype),
                       torch.ones(BATCH, WINDOW, dtype=torch.bool))
    return q, fp


def _packed(storage):
    from kvcal.quant.rope import RopeSpec
    from kvcal.runtime.storage import Packed, SharedState

    buffers = {name: torch.zeros(spec.shape, dtype=spec.dtype)
               for name, spec in storage.buffers(BATCH, TCAP, HKV, D).items()}
    cos = sin = inv_freq = None
    if storage.keys_pre_rope:
        inv_freq = RopeSpec(head_dim=D, theta=500000.0, rope_type="llama3", factor=8.0).inv_freq("cpu")
        cos, sin = SharedState().rope_tables(inv_freq, storage.policy.sink + TCAP + 8)
    return Packed(buffers, torch.full((BATCH,), TCAP, dtype=torch.int32), HKV, D, TCAP, storage.policy.sink, cos, sin,
                  inv_freq)


def kvquant_storage(bits: int):
    """KVQuant's recipe at Llama-3.1-8B shapes: 1% outliers, key slots ceil(2 x 1% x 128) = 3 per token and head,
    value slots 2 x (floor(0.5% x 1024) + 1) = 12 per token over all heads, per-token value ranges."""
    from kvcal.methods.kvquant.cases import random_storage

    return random_storage(bits, HKV, D, kcap=3, per_side=6)


def bytes_per_token(name: str, storage=None) -> dict:
    """Bytes read (and written) per packed token and KV head at these shapes, by stream (DRAM or L2 alike)."""
    g = HQ // HKV
    if name == "rtn-int4":
        return {"key codes": D * 4 // 8, "value codes": D * 4 // 8, "key scale+zero (fp16)": 4,
                "value scale+zero (fp16)": 4}
    bits = storage.bits
    kcap, vslots = storage.capacity, 2 * storage.value_per_side
    return {
        "key codes": D * bits // 8, "value codes": D * bits // 8,
        "value scale+zero (fp16, per token over all heads)": 4 / HKV,
        "key pass: key slots (int16 index + fp16)": 4 * kcap,
        "key pass: score terms written (float32 x GP)": 4 * g,
        "decode kernel: score terms read (float32 x GP)": 4 * g,
        "decode kernel: scores written for the value pass": 4 * g,
        "decode kernel: RoPE cos/sin rows of R(-p0), one per 16-token tile (float32, 2 x D/2)": 2 * (D // 2) * 4 / 16,
        "value pass: value slots (int16 + fp16, per token over all heads)": 4 * vslots / HKV,
        "value pass: scores read (float32 x GP per slot)": 4 * g * vslots / HKV,
        "value pass: atomics (float32 x GP per slot)": 4 * g * vslots / HKV,
    }


def run(recipe: str) -> dict:
    COMPILED.clear()
    q, fp = _step()
    if recipe == "rtn-int4":
        from kvcal.methods.rtn.cases import random_storage

        storage = random_storage(4, HKV, D)
        packed = _packed(storage)
        storage.attend_triton(q, packed, D**-0.5, fp, num_splits=SPLITS)
        info = bytes_per_token("rtn-int4")
    else:
        storage = kvquant_storage(int(recipe[3:]))
        packed = _packed(storage)
        storage.attend_triton(q, packed, D**-0.5, fp, num_splits=SPLITS)
        info = bytes_per_token(recipe, storage)
    kernels = {}
    for name, kernel, grid in COMPILED:
        s = sass_of(kernel)
        s["grid"] = list(grid)
        kernels[name if name not in kernels else f"{name}#{len(kernels)}"] = s
    return {"recipe": recipe, "kernels": kernels, "bytes_per_token_and_head": info,
            "bytes_total": round(sum(info.values()), 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipes", nargs="*", default=["rtn-int4", "nuq4", "nuq2"])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    _driver.set_active(Sm90Driver())
    JITFunction.run = _compile_only
    K.sm90_or_newer = lambda device: True  # prefetch and dependent launches as on an sm_90 GPU
    results = []
    for recipe in args.recipes:
        r = run(recipe)
        results.append(r)
        print(f"== {recipe}: {r['bytes_total']} bytes per token and KV head")
        for name, s in r["kernels"].items():
            print(f"  {name} grid {s['grid']}: {s['registers']} registers, {s['stack_bytes']} B stack, "
                  f"{s['shared_bytes']} B shared, {s['warps']} warps, {s['sass_total']} SASS instructions")
            print(f"    main loop: {json.dumps(s['loop'])}")
        for k, v in r["bytes_per_token_and_head"].items():
            print(f"    {v:7.2f} B  {k}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
