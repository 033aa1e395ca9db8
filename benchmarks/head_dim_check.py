"""Every decode kernel's GPU case (tests/kernel_cases.GPU_CASES) at other head shapes than Llama-3.1-8B's, against
the torch references: the relative error per case, or the first line of the error where a kernel cannot take the
shape (compile failure, out of shared memory). Gemma 3's 256-channel heads by default.

    python benchmarks/head_dim_check.py --shape 256,4,8 --shape 256,1,4 --json head-dim-256.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.kernel_cases import GPU_CASES, TOL_GPU, run_attention_case  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", action="append", help="head_dim,kv_heads,query_heads (repeatable)")
    parser.add_argument("--case", action="append", help="only cases whose name contains this (repeatable)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in (args.shape or ["256,4,8"])]
    rows = []
    for shape in shapes:
        for case in GPU_CASES:
            if args.case and not any(c in case[0] for c in args.case):
                continue
            t0 = time.time()
            try:
                err, error = run_attention_case(case, small=False, device="cuda", shape=shape), None
            except Exception as exc:  # noqa: BLE001 - recorded, the next case runs
                err, error = None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            tol = TOL_GPU[case[3]]
            ok = err is not None and err == err and err <= tol
            rows.append({"shape": list(shape), "case": case[0], "method": case[1], "dtype": str(case[3]),
                         "rel_err": err, "tol": tol, "ok": ok, "error": error, "seconds": round(time.time() - t0, 1)})
            print(f"{shape} {case[0]:<40s} {'ok ' if ok else 'BAD'} err={err} {error or ''}", flush=True)
            torch.cuda.empty_cache()
    args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                     "rows": rows}, indent=1))
    print(f"{sum(r['ok'] for r in rows)} of {len(rows)} ok")


if __name__ == "__main__":
    main()
