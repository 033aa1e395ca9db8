"""Static look at XQuant's tensor-core decode kernels (kvcal/methods/xquant/kernels.py) without a GPU: each
configuration compiled for sm_90 on the CPU (triton.compile with a GPUTarget; the bundled cuobjdump), printing
ptxas's registers and stack (spills) per thread, shared memory, and the instruction mix of the main loop's SASS
(the key product's chunk loop; the value kernel's token loop). Llama-3.1-8B shapes, 2 bits, fp16 operands:

    python benchmarks/xquant_kernel_sass.py
    python benchmarks/xquant_kernel_sass.py --configs '[{"kernel": "scores", "hb": 2, "block_t": 64, "warps": 8}]'
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402

from benchmarks.sass import compile_sass, loop_mix  # noqa: E402
from kvcal.methods.xquant import kernels as X  # noqa: E402

CONFIGS = [
    {"kernel": "scores", "hb": 1, "block_t": 128, "warps": 8},
    {"kernel": "scores", "hb": 2, "block_t": 128, "warps": 8},
    {"kernel": "scores", "hb": 2, "block_t": 64, "warps": 8},
    {"kernel": "scores", "hb": 1, "block_t": 128, "warps": 16},
    {"kernel": "scores", "hb": 1, "block_t": 64, "warps": 4},
    {"kernel": "scores", "hb": 1, "block_t": 128, "warps": 8, "staged": 1},
    {"kernel": "values", "block_t": 64, "vc": 128, "warps": 4},
    {"kernel": "values", "block_t": 64, "vc": 256, "warps": 4},
    {"kernel": "values", "block_t": 64, "vc": 256, "warps": 8},
]


KEEP = ("LDG", "LDGSTS", "STS", "LDS", "LDSM", "LDL", "STL", "HGMMA", "HMMA", "FFMA", "I2FP", "F2FP", "BAR")


def run(cfg: dict) -> dict:
    cfg = dict(cfg)
    kind = cfg.pop("kernel")
    warps, stages, maxnreg = cfg.pop("warps", 4), cfg.pop("stages", 3), cfg.pop("maxnreg", None)
    bits, width, d, hkv, hq = cfg.pop("bits", 2), cfg.pop("width", 1024), 128, 8, 32
    g = hq // hkv
    if kind == "scores":
        hb, bt, chunk = cfg.pop("hb", 1), cfg.pop("block_t", 128), cfg.pop("chunk", 64)
        types = dict(codes_ptr="*i32", sc_ptr="*fp16", zc_ptr="*fp16", ko_ptr="*fp16", zs_ptr="*fp16", rk_ptr="*fp16",
                     bias_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32", len_ptr="*i32", q_ptr="*fp16",
                     out_ptr="*fp32", QSCALE="fp32")
        consts = dict(BITS=bits, RW=width, TDIV=128, CDIV=1, OUTLIER=0, STAGED=int(cfg.pop("staged", 0)), HAS_BIAS=0,
                      D=d, G=g, GP=max(triton.next_power_of_2(g), triton.next_power_of_2(-(-16 // hb))), HB=hb,
                      BLOCK_T=bt, CHUNK=chunk, INTERP=False, PREC=16)
        fn = X._scores_tc_kernel
    else:
        types = dict(codes_ptr="*i32", sc_ptr="*fp16", zc_ptr="*fp16", s_ptr="*fp32", len_ptr="*i32",
                     lat_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32")
        consts = dict(BITS=bits, RW=width, CDIV=128, HQ=hq, HQP=max(triton.next_power_of_2(hq), 16),
                      BLOCK_T=cfg.pop("block_t", 64), VC=cfg.pop("vc", 128), INTERP=False, PREC=16)
        fn = X._values_tc_kernel
    if cfg:
        raise ValueError(f"unknown keys {sorted(cfg)}")
    registers, stack, shared, sass = compile_sass(fn, types, consts, warps, stages, maxnreg)
    mix = loop_mix(sass, KEEP)
    return {"registers": registers, "stack_bytes": stack, "shared_bytes": shared,
            "loop": {k: v for k, v in mix.items() if v or k == "instructions"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", help="JSON list of configurations (default: CONFIGS)")
    args = parser.parse_args()
    for cfg in json.loads(args.configs) if args.configs else CONFIGS:
        print(json.dumps(cfg), json.dumps(run(cfg)), flush=True)


if __name__ == "__main__":
    main()
