"""A knob sweep of one storage's decode kernel against bf16 SDPA in the same process (Llama-3.1-8B attention shapes by
default: 32 query heads, 8 KV heads, d 128), each configuration also checked against the storage's torch reference.

    python benchmarks/sweep_decode.py --recipe calibquant-1bit --context 32768 --batch 8 --batch 1 \\
        --grid '[{}, {"block_t": 64, "num_warps": 4}]' --json results/bench/sweep.json

A grid entry is a dict of the storage's attend_triton keyword arguments; the key "kernel": "before" runs the kernel
module given by --before (an earlier version of the method's kernels.py, for before/after timings on one card).
Times: CUDA-graph replays, median, L2 flushed (kvcal.runtime.bench.time_device); GB/s counts the bytes a step must
read (packed buffers, the full-precision window, the query and output).

Without a GPU, `--sass` compiles CalibQuant's two decode kernels for sm_90 (Triton's bundled ptxas and cuobjdump) at
the benchmark's shapes (1-bit by default, --bits) and prints, per grid entry (block_t, num_warps, num_stages, fp_kernel
-> HAS_FP 0), registers and spills a thread, shared memory, and the SASS instruction counts of each loop (the tile
loops: whole tiles, then the partial one) with the main classes:

    python benchmarks/sweep_decode.py --sass --grid '[{}, {"fp_kernel": false}]' \
        --before <earlier kvcal/methods/calibquant/kernels.py> --json results/bench/calibquant-decode-sass-sm90-1bit.json
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys

import torch

from kvcal.bench import storage_for
from kvcal.runtime import kernels as K
from kvcal.runtime.bench import packed_bytes, random_packed, time_device, time_sdpa
from kvcal.runtime.decode import FullPrecision, merge_reference


def rel_err(out, ref) -> float:
    """The largest ||out - ref|| / ||ref|| over the (row, head) output vectors."""
    out, ref = out.double(), ref.double()
    return float(((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max())


def load_before(path: str):
    spec = importlib.util.spec_from_file_location("before_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["before_kernels"] = mod
    spec.loader.exec_module(mod)
    return mod


SASS_CLASSES = ("LOP3", "SHF", "SGXT", "I2F", "IMAD", "PRMT", "HMMA", "HGMMA", "STS", "LDS", "LDSM", "MUFU", "SHFL",
                "FMNMX", "FSEL", "FMUL", "FFMA", "BAR")


def _sass_loops(sass: str) -> list[dict]:
    """Each backward branch's loop (over 60 instructions): its length and its counts of SASS_CLASSES."""
    import collections
    import re

    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           (re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    at = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at and i - at[int(m.group(1), 16)] > 60:
            body = ins[at[int(m.group(1), 16)]:i + 1]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in body)
            loops.append({"instructions": len(body), **{k: ops[k] for k in SASS_CLASSES if ops[k]}})
    return loops


def sass_rows(grid, args) -> list[dict]:
    """Compile the decode kernels of the current module (and --before's) for sm_90 per grid entry (see the module
    docstring)."""
    import os
    import re
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvcal.methods.calibquant import kernels as current

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next(p for p in (os.path.join(tools, "ptxas-blackwell"), os.path.join(tools, "ptxas")) if os.path.exists(p))
    pointer = {"q_ptr": "*bf16", "fk_ptr": "*bf16", "fv_ptr": "*bf16", "len_ptr": "*i32", "kc_ptr": "*i32",
               "vc_ptr": "*i32", "count_ptr": "*i64", "fval_ptr": "*u8"}
    modules = [("after", current)] + ([("before", load_before(args.before))] if args.before else [])
    rows = []
    for knobs in grid:
        for which, mod in modules:
            new = hasattr(mod, "_alignment")
            bt, warps = knobs.get("block_t", 32), knobs.get("num_warps", 1)
            const = dict(D=args.dim, G=args.hq // args.hkv, GP=max(16, args.hq // args.hkv), BITS=args.bits, GROUP=0,
                         BLOCK_T=bt, PREC=16, INTERP=0)
            if new:
                const.update(MMA=int(knobs.get("mma", True)), ALIGN=4)
            has_fp = int(not (new and knobs.get("fp_kernel", True)))
            attend = dict(const, GPF=16, SP=64, REMAP=1, HAS_FP=has_fp, BLOCK_F=16)
            opts = {"num_warps": warps, **({"num_stages": knobs["num_stages"]} if "num_stages" in knobs else {})}
            cap = knobs.get("range_registers", getattr(mod, "RANGE_REGISTERS", 0) if warps == 1 else 0)
            for name, fn, c in (("pass 1", mod._range_kernel, const), ("pass 2", mod._attend_kernel, attend)):
                if name == "pass 1" and new and cap:
                    opts = {**opts, "maxnreg": cap}
                else:
                    opts = {k: v for k, v in opts.items() if k != "maxnreg"}
                sig = {a: "constexpr" if a in c else pointer.get(a, "*fp32") if a.endswith("_ptr")
                       else "fp32" if a.startswith("scale") else "i32" for a in fn.arg_names}
                k = triton.compile(ASTSource(fn, sig, c), target=GPUTarget("cuda", 90, 32), options=opts)
                path = f"/tmp/sweep_decode_{os.getpid()}"
                with open(path + ".ptx", "w") as f:
                    f.write(k.asm["ptx"])
                with open(path + ".cubin", "wb") as f:
                    f.write(k.asm["cubin"])
                info = subprocess.run([ptxas, "-arch=sm_90a", "-v", path + ".ptx", "-o", path + ".o"],
                                      capture_output=True, text=True).stderr
                sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", path + ".cubin"],
                                      capture_output=True, text=True).stdout
                regs = re.search(r"Used (\d+) registers", info)
                spill = re.search(r"(\d+) bytes spill stores", info)
                row = {"kernel": which, "knobs": knobs, "pass": name, "bits": args.bits,
                       "registers": int(regs.group(1)) if regs else None,
                       "spill_bytes": int(spill.group(1)) if spill else None, "shared_bytes": k.metadata.shared,
                       "loops": _sass_loops(sass)}
                rows.append(row)
                print(f"{which:>6} {json.dumps(knobs):<48} {name}: {row['registers']} registers, "
                      f"{row['spill_bytes']} B spilled, {row['shared_bytes']} B shared; loops "
                      + "; ".join(", ".join(f"{k} {v}" for k, v in lp.items()) for lp in row["loops"]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", action="append", default=[])
    ap.add_argument("--grid", default="[{}]", help="JSON list of knob dicts")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--flush", default="write")
    ap.add_argument("--before", default=None, help="path of an earlier kernels.py for grid entries 'kernel: before'")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sass", action="store_true", help="compile for sm_90 and count instructions (no GPU needed)")
    ap.add_argument("--bits", type=int, default=1)
    args = ap.parse_args()
    grid = json.loads(args.grid)
    if args.sass:
        rows = sass_rows(grid, args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
        return
    batches = args.batch or [8]
    dtype = torch.bfloat16
    rows = []
    print(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    for batch in batches:
        sdpa_us, sdpa_bytes, backend = time_sdpa(batch, args.hq, args.hkv, args.dim, args.context, flush=args.flush)
        print(f"batch {batch} x {args.context}: SDPA ({backend}) {sdpa_us:.1f} us, "
              f"{sdpa_bytes / sdpa_us / 1e3:.0f} GB/s", flush=True)
        rows.append({"recipe": "sdpa", "batch": batch, "context": args.context, "us": sdpa_us,
                     "gbps": sdpa_bytes / sdpa_us / 1e3})
        for recipe in args.recipe:
            storage, inv = storage_for(recipe)
            window = min(args.window, args.context)
            packed = random_packed(storage, batch, args.hkv, args.dim, args.context - window, inv_freq=inv)
            gen = torch.Generator(device="cuda").manual_seed(2)
            q = torch.randn(batch, args.hq, args.dim, device="cuda", dtype=dtype, generator=gen)
            fp = FullPrecision(
                torch.randn(batch, args.hkv, window, args.dim, device="cuda", dtype=dtype, generator=gen),
                torch.randn(batch, args.hkv, window, args.dim, device="cuda", dtype=dtype, generator=gen),
                torch.ones(batch, window, dtype=torch.bool, device="cuda"))
            scale = args.dim**-0.5
            nbytes = (packed_bytes(storage, packed) + 2 * fp.k.numel() * 2 + fp.valid.numel() + 2 * q.numel() * 2)
            ref = None
            if not args.no_check:
                ref = merge_reference(storage.attend_reference(q, packed, scale, fp), batch, q.dtype)
            # the method's kernels module (kvcal/methods/<name>/kernels.py), beside its storage.py
            module = importlib.import_module(type(storage).__module__.rsplit(".", 1)[0] + ".kernels")
            for knobs in grid:
                knobs = dict(knobs)
                which = knobs.pop("kernel", "after")
                saved = None
                if which == "before":
                    if not args.before:
                        continue
                    saved = module.attend_triton
                    module.attend_triton = load_before(args.before).attend_triton

                def step(knobs=knobs, storage=storage, q=q, packed=packed, scale=scale, fp=fp):
                    return K.merge_triton(storage.attend_triton(q, packed, scale, fp, **knobs), q)

                try:
                    out = step()
                    err = rel_err(out, ref) if ref is not None else None
                    us = time_device(step, flush=args.flush) * 1e3
                except Exception as exc:  # a configuration that does not compile: report it, keep sweeping
                    print(f"  {recipe} {which} {knobs}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    rows.append({"recipe": recipe, "batch": batch, "kernel": which, "knobs": knobs,
                                 "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
                    continue
                finally:
                    if saved is not None:
                        module.attend_triton = saved
                row = {"recipe": recipe, "batch": batch, "context": args.context, "window": window, "kernel": which,
                       "knobs": knobs, "us": us, "gbps": nbytes / us / 1e3, "x_sdpa": sdpa_us / us, "rel_err": err}
                rows.append(row)
                print(f"  {recipe:>16} {which:>6} {json.dumps(knobs):<60} {us:8.1f} us {row['gbps']:6.0f} GB/s "
                      f"{row['x_sdpa']:5.2f}x SDPA  err {err if err is None else f'{err:.2e}'}", flush=True)
            del ref
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "flush": args.flush, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
