"""Where CommVQ's decode time goes on a GPU (docs/commvq.md, "Measured on the H100"): one decode step per layer at
Llama-3.1-8B shapes (bf16, 128-token window, as `kvcal bench decode`), the full kernels beside timing-only variants
of the same kernels (attend_triton's `probe`: constant key codes, no key gathers, no value mass, no key pass) and
knob settings, bf16 SDPA in the same process; then each compiled kernel's shared memory, registers and spills.

    PYTHONPATH=. python benchmarks/commvq_breakdown.py [--recipes commvq-1bit] [--contexts 32768] [--batches 1 8]
        [--configs '[["two-pass", {}], ["fp32 codewords", {"fp16_codewords": false}]]' | --configs score_dot]

--configs score_dot: the key pass's epilogue options (attend_triton's score_dot: "sum", "mma" (tf32x3 tensor cores),
"fma" (Triton's FMA dot); score_dot_n: the dot's query heads, 16 or 4), each in full and without the key gathers,
beside the two passes without the key pass: the epilogue's cost is "no key gathers" - "no key pass".

    PYTHONPATH=. python benchmarks/commvq_breakdown.py --sm90 [--recipes commvq-1bit commvq-2bit]

--sm90 (no GPU needed): compiles the key pass for sm_90 (Triton's compiler and its bundled ptxas and cuobjdump) at
each score_dot setting, 32-token tiles on 4 warps and 16 on 2, and prints registers, spills, shared memory and
static SASS counts (shuffles, barriers, HMMA, FFMA, shared loads and stores).
"""

from __future__ import annotations

import argparse
import json

import torch

from kvcal import bench as cases
from kvcal.runtime import bench

CONFIGS = [
    ["two-pass", {}],
    ["two-pass, fp32 codewords", {"fp16_codewords": False}],
    ["two-pass, const codes", {"probe": "const_codes"}],
    ["two-pass, no key gathers", {"probe": "no_gathers"}],
    ["two-pass, no value mass", {"probe": "no_value_mass"}],
    ["two-pass, no key pass", {"probe": "no_key_pass"}],
]

SCORE_DOTS = [("sum", None), ("mma", None), ("fma", None), ("mma", 4), ("fma", 4)]
SCORE_DOT_CONFIGS = [["two-pass, no key pass", {"probe": "no_key_pass"}]] + [
    [f"two-pass, score_dot {sd}" + (f" n{n}" if n else "") + probe_name,
     {"score_dot": sd, **({"score_dot_n": n} if n else {}), **probe}]
    for sd, n in SCORE_DOTS for probe_name, probe in (("", {}), (", no key gathers", {"probe": "no_gathers"}))]


def compiled_kernels() -> list[dict]:
    """Shared memory, registers and spills of every compiled CommVQ decode kernel (Triton's per-device caches)."""
    from kvcal.methods.commvq import kernels as C

    out = []
    for fn in (C._key_scores_kernel, C._value_mass_kernel, C._codebook_kernel):
        for cache in getattr(fn, "device_caches", {}).values():
            for kernel in cache[0].values():
                meta = kernel.metadata
                out.append({"kernel": fn.__name__, "shared": meta.shared, "num_warps": meta.num_warps,
                            "n_regs": getattr(kernel, "n_regs", None), "n_spills": getattr(kernel, "n_spills", None),
                            **_constexprs(fn, kernel)})
    return out


def _constexprs(fn, kernel) -> dict:
    """A few of the compiled kernel's constexprs (which knob setting it is), where this Triton keeps them."""
    try:
        consts = kernel.src.constants
        names = {(i,): name for i, name in enumerate(fn.arg_names)}
        named = {names.get(k, k): v for k, v in consts.items()}
        return {k: named[k] for k in ("GP", "BLOCK_T", "R", "SCORE_DOT", "PROBE") if k in named}
    except Exception:  # noqa: BLE001 - a Triton without these attributes: the row stays as it was
        return {}


def sm90_compile(recipes) -> list[dict]:
    """The key pass compiled for sm_90 on this machine (no GPU) per recipe, score_dot setting and tile (see the
    module docstring): registers and spills (ptxas -v), shared memory, static SASS instruction counts."""
    import collections
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvcal.methods.commvq import kernels as C
    from kvcal.models import ModelDims
    from kvcal.models.tiny import llama31_8b_config

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next(p for p in (os.path.join(tools, "ptxas-blackwell"), os.path.join(tools, "ptxas")) if os.path.exists(p))
    dims = ModelDims.from_config(llama31_8b_config())
    fn = C._key_scores_kernel
    pointer = {"q_ptr": "*bf16", "len_ptr": "*i32", "kc_ptr": "*i32", "kn_ptr": "*fp16", "s_ptr": "*fp32"}
    rows = []
    for recipe in recipes:
        (_, _, storages), = cases.bench_cases([recipe], [], dims)
        st = storages[0]
        hkv, d, group = 8, 128, 4
        wk = st.buffers(1, 1, hkv, d)["k_codes"].shape[-1]
        for sd, n in SCORE_DOTS:
            code = C.SCORE_DOTS[sd]
            for bt, warps in ((32, 4), (16, 2)):
                const = dict(D=d, G=group, GP=max(group, n or C.SCORE_DOT_N) if code else group, R=st.stages,
                             NCODE=st.codes, IB=st.index_bits, NPH=st.groups // hkv, GPAIRS=st.group_pairs, WK=wk,
                             BLOCK_T=bt, TILES=1, PROBE=0, SCORE_DOT=code, INTERP=0)
                sig = {a: "constexpr" if a in const else pointer.get(a, "*fp32") if a.endswith("_ptr")
                       else "fp32" if a.startswith("qk_scale") else "i32" for a in fn.arg_names}
                k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                                   options={"num_warps": warps})
                with tempfile.TemporaryDirectory() as tmp:
                    ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
                    with open(ptx, "w") as f:
                        f.write(k.asm["ptx"])
                    with open(cubin, "wb") as f:
                        f.write(k.asm["cubin"])
                    info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "k.o")],
                                          capture_output=True, text=True).stderr
                    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin],
                                          capture_output=True, text=True).stdout
                ops = collections.Counter(m.group(1) for m in re.finditer(
                    r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass))
                regs = re.search(r"Used (\d+) registers", info)
                spill = re.search(r"(\d+) bytes spill stores", info)
                row = {"recipe": recipe, "score_dot": sd, "score_dot_n": const["GP"], "block_t": bt, "num_warps": warps,
                       "registers": int(regs.group(1)) if regs else None,
                       "spill_bytes": int(spill.group(1)) if spill else None, "shared_bytes": k.metadata.shared,
                       "sass": sum(ops.values()),
                       **{op: ops[op] for op in ("SHFL", "BAR", "HMMA", "FFMA", "LDS", "STS", "LDG")}}
                rows.append(row)
                print("SM90", json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", nargs="+", default=["commvq-1bit"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[32768])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--configs", default=None, help="JSON list of [name, attend_triton knobs], or score_dot")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sm90", action="store_true", help="compile the key pass for sm_90 only (no GPU needed)")
    args = ap.parse_args()
    if args.sm90:
        rows = sm90_compile(args.recipes)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"sm90": rows}, f, indent=1)
        return
    configs = (SCORE_DOT_CONFIGS if args.configs == "score_dot" else json.loads(args.configs) if args.configs
               else CONFIGS)
    out = {"device": torch.cuda.get_device_name(), "rows": []}
    for tokens in args.contexts:
        for batch in args.batches:
            us, _, backend = bench.time_sdpa(batch, 32, 8, 128, tokens, rep=args.rep)
            out["rows"].append({"context": tokens, "batch": batch, "case": f"sdpa bf16 ({backend})", "us": round(us, 1)})
            print(f"{tokens}x{batch} sdpa bf16: {us:.1f} us", flush=True)
            for recipe in args.recipes:
                storage, inv_freq = cases.storage_for(recipe)
                for name, knobs in configs:
                    try:
                        us, _ = bench.time_storage(storage, batch, 32, 8, 128, tokens, inv_freq=inv_freq, rep=args.rep,
                                                   **knobs)
                    except Exception as exc:  # a knob setting that does not compile or fit: say so, go on
                        print(f"{tokens}x{batch} {recipe} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                        continue
                    out["rows"].append({"context": tokens, "batch": batch, "recipe": recipe, "case": name,
                                        "knobs": knobs, "us": round(us, 1)})
                    print(f"{tokens}x{batch} {recipe} {name}: {us:.1f} us", flush=True)
                    torch.cuda.empty_cache()
    out["kernels"] = compiled_kernels()
    for k in out["kernels"]:
        print("KERNEL", json.dumps(k))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
