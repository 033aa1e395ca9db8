"""Static look at SKVQ's decode kernel (kvcal/methods/skvq/kernels.py) beside RTN int2's (its split-K tile kernel
and its fragment kernel) without a GPU: each storage's attend_triton is called on CPU tensors at Llama-3.1-8B shapes
(8 KV heads of 128 channels, 32 bf16 query heads, batch 8, a 128-token full-precision window) with a stand-in
driver that reports an sm_90 target; the launch's own signature, constants and specializations are caught by
Triton's jit cache hook (nothing runs) and compiled for sm_90 on the CPU (triton.compile; the bundled cuobjdump).
Printed per kernel: ptxas's registers and stack (spills) per thread, shared memory, and the instruction mix of the
main loop's SASS (the longest backward branch's body: one token tile, per warp), with warp instructions per token
(the body's count x warps / tokens per tile).

    python benchmarks/skvq_kernel_sass.py
    python benchmarks/skvq_kernel_sass.py --configs '[{"method": "skvq", "groups": 8, "param_dtype": "fp8"}]'
    python benchmarks/skvq_kernel_sass.py --configs '[{"method": "skvq", "knobs": {"block_t": 32, "num_warps": 4}}]'
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from benchmarks.sass import TARGET, Sm90Driver, cubin_report, loops, opcodes  # noqa: E402

# skvq-k2v2-g32-w128 on Llama-3.1-8B: 1024 channels per layer in 32 k-means groups; rtn-int2: one group per head
CONFIGS = [
    {"method": "skvq", "bits": 2, "v_bits": 2, "groups": 32},
    {"method": "skvq", "bits": 2, "v_bits": 2, "groups": 8},
    {"method": "skvq", "bits": 2, "v_bits": 2, "groups": 32, "param_dtype": "fp8"},
    {"method": "skvq", "bits": 2, "v_bits": 1.5, "groups": 32},
    {"method": "rtn", "bits": 2, "frag": False},
    {"method": "rtn", "bits": 2},
]


def caught_launches(call) -> list:
    """(kernel, signature, constexprs, attrs, options) of every Triton launch `call()` makes: JITFunction.run
    specializes the arguments as for a launch on the stand-in sm_90 driver, then the cache hook (set here) ends it
    before any compile or launch."""
    from triton.runtime import jit

    caught = []
    orig_call_hook = jit.JITFunction._call_hook

    def sentinel(**kw):
        return True

    def call_hook(self, hook_fn, key, signature, target, device, constexprs, options, configs, warmup):
        if hook_fn is sentinel:
            caught.append((self, signature, constexprs, configs[0], options))
            return True  # skip the compile and the launch
        return orig_call_hook(self, hook_fn, key, signature, target, device, constexprs, options, configs, warmup)

    old_driver = driver._active
    driver.set_active(Sm90Driver())
    knobs.runtime.jit_cache_hook = sentinel
    jit.JITFunction._call_hook = call_hook
    try:
        call()
    finally:
        jit.JITFunction._call_hook = orig_call_hook
        knobs.runtime.jit_cache_hook = None
        driver._active = old_driver
    return caught


def compile_sass(fn, signature, constexprs, attrs, options):
    """(registers, stack bytes, shared bytes, SASS) of the kernel compiled for TARGET."""
    k = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs), target=TARGET,
                       options=options.__dict__)
    registers, stack, sass = cubin_report(k.asm["cubin"])
    return registers, stack, k.metadata.shared, sass


KEEP = ("LDG", "LDS", "LDSM", "STS", "SHFL", "LDL", "STL", "HMMA", "HGMMA", "FFMA", "FMUL", "FADD", "HFMA2", "HMUL2",
        "F2FP", "I2F", "I2FP", "F2I", "LOP3", "SHF", "PRMT", "IMAD", "IADD3", "SEL", "FSEL", "ISETP", "FSETP", "MUFU",
        "BAR", "MOV")


def mix(body: list[str]) -> dict:
    ops = opcodes(body)
    return {"instructions": len(body), **{k: ops[k] for k in KEEP if ops[k]},
            "other": len(body) - sum(ops[k] for k in KEEP)}


def launch(cfg: dict):
    """The attend_triton call of cfg at Llama-3.1-8B shapes (batch 8, 8 KV heads, 32 query heads, bf16, a
    128-token window) on CPU tensors."""
    from tests.kernel_cases import build_packed, build_step, make_storage

    cfg = dict(cfg)
    method = cfg.pop("method")
    bits = cfg.pop("bits", 2)
    batch, hkv, hq, d, tokens = 8, 8, 32, 128, cfg.pop("tokens", 64)
    knobs_ = cfg.pop("knobs", {})
    if method == "skvq":
        storage = make_storage("skvq", bits, hkv, d, v_bits=cfg.pop("v_bits", 2.0), groups=cfg.pop("groups", 32),
                               param_dtype=cfg.pop("param_dtype", "fp16"), sink=5)
    else:
        storage = make_storage("rtn", bits, hkv, d)
        if cfg.pop("frag", True) is False:
            knobs_ = {"frag": False, **knobs_}
    if cfg:
        raise ValueError(f"unknown keys {sorted(cfg)}")
    # tcap 1024: code and parameter rows with the strides of a real cache (multiples of 16 where a 32K one has them)
    packed = build_packed(storage, [tokens] * batch, hkv, d, tcap=1024)
    q, fp = build_step(batch, hq, hkv, d, 128, torch.bfloat16)
    scale = d ** -0.5
    return lambda: storage.attend_triton(q, packed, scale, fp, num_splits=16, **knobs_)


def run(cfg: dict) -> list[dict]:
    out = []
    seen = set()
    for fn, sig, consts, attrs, opts in caught_launches(launch(cfg)):
        name = fn.__name__
        if name in seen or name == "_fp_kernel":
            continue
        seen.add(name)
        registers, stack, shared, sass = compile_sass(fn, sig, consts, attrs, opts)
        bodies = loops(sass)
        block_t = next((v for k, v in consts.items() if fn.arg_names[k[0]] == "BLOCK_T"), None)
        body = mix(bodies[0]) if bodies else {}
        row = {"kernel": name, "warps": opts.num_warps, "block_t": block_t, "registers": registers,
               "stack_bytes": stack, "shared_bytes": shared, "loop": body}
        if body and block_t:  # the loop's instructions are each warp's: x warps for the program's
            row["warp_instructions_per_token"] = round(body["instructions"] * opts.num_warps / block_t, 1)
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", help="JSON list of configurations (default: CONFIGS)")
    args = parser.parse_args()
    for cfg in json.loads(args.configs) if args.configs else CONFIGS:
        for row in run(cfg):
            print(json.dumps(cfg), json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
