"""Every method on equal footing (docs/results.md "Equal footing"): each setting's perplexity under the same
full-precision allowances (--fp-window 0: strict; --fp-window 128), with one model load and one set of windows.

Baselines run from their recipes; calibrated settings from the artifacts in --artifacts (named <recipe>.safetensors,
written by `kvcal calibrate --recipe ... --out-dir DIR`; a missing one is skipped and said). gptq rows for every
setting that has a token-by-token rule, tail rows (CalibQuant's regime) for CalibQuant with fp16 and the scalar and
eviction baselines beside it. Each record is the one `kvcal eval ppl` writes (kvcal.eval.run.ppl_record) and carries
that command, which reproduces it alone; a setting a window cannot hold is refused by the method and listed.

    python benchmarks/equal_footing.py --model smollm2-135m --nsamples 16 --seqlen 2048 --device cuda \
        --artifacts artifacts/smollm2-135m --out results/equal-footing/smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path

from kvcal.artifact import load_artifact
from kvcal.cli import write_json_atomic
from kvcal.data import load_eval_windows
from kvcal.determinism import deterministic_algorithms
from kvcal.errors import KvcalError
from kvcal.eval.run import check_protocol, ppl_record, protocol_setting
from kvcal.eval.simulate import tail_layout
from kvcal.methods.registry import artifact_method, storages_for_artifact
from kvcal.models import load_model
from kvcal.recipes import resolve

BASELINES = ["fp16", "rtn-int4", "rtn-int2", "rtn-int1", "kivi-4bit", "kivi-2bit", "kivi-1bit", "evict-4bit",
             "evict-2bit", "evict-1bit"]
CALIBRATED = ["kvquant-nuq4-1pct", "kvquant-nuq2-1pct", "skvq-k4v4-g32-w128", "skvq-k2v2-g32-w128",
              "xquant-svd-4bit-r128", "xquant-svd-2bit", "xquant-cl-svd-2bit", "commvq-2bit", "commvq-1bit"]
TAIL = ["fp16", "rtn-int2", "kivi-2bit", "kvquant-nuq2-1pct", "commvq-1bit",
        "calibquant-2bit", "calibquant-1bit"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--artifacts", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--windows", type=int, nargs="+", default=[0, 128])
    parser.add_argument("--only", nargs="*", default=None, help="settings to run (default: all)")
    parser.add_argument("--protocols", nargs="+", default=["gptq", "tail"])
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with deterministic_algorithms(True):
        loaded = load_model(args.model, args.dtype, args.device)
        text, windows = load_eval_windows(loaded.tokenizer, "wikitext2", args.data_dir, args.seqlen, args.nsamples)
        skipped = []
        for protocol in args.protocols:
            names = BASELINES + CALIBRATED if protocol == "gptq" else TAIL
            for name in names:
                if args.only is not None and name not in args.only:
                    continue
                for window in args.windows:
                    why = run_one(args, loaded, text, windows, protocol, name, window)
                    if why:
                        skipped.append({"setting": name, "protocol": protocol, "fp_window": window, "why": why})
                        print(f"skipped {name} ({protocol}, --fp-window {window}): {why}", flush=True)
        write_json_atomic(args.out / "skipped.json", skipped)


def run_one(args, loaded, text, windows, protocol: str, name: str, window: int) -> str | None:
    prompt_len = prefix_len = 0
    flags = ["--protocol", protocol] if protocol != "gptq" else []
    if protocol == "tail":
        prefix_len, block_len = tail_layout(args.seqlen)
        prompt_len = prefix_len + block_len
    path = args.artifacts / f"{name}.safetensors"
    try:
        if path.is_file():
            art = load_artifact(path)
            method = artifact_method(art, None, window)
            check_protocol(method, protocol, "simulate", prefix_len, prompt_len - prefix_len, window)
            method, storages = storages_for_artifact(art, loaded, str(path), None, window)
            setting, source = protocol_setting(path.stem, window), ["--artifact", str(path)]
            artifact = {"path": str(path), "tensor_hash": art.header["tensor_hash"]}
        else:
            method, _, _ = resolve(None, name, None)
            if method.needs_artifact():
                return f"no artifact {path}"
            method = method.with_fp_window(window)
            check_protocol(method, protocol, "simulate", prefix_len, prompt_len - prefix_len, window)
            method.check_model(loaded.dims)
            storages = method.build_storages({}, loaded.dims)
            setting, source, artifact = protocol_setting(name, window), ["--recipe", name], None
    except KvcalError as exc:
        return str(exc)
    out = args.out / f"{protocol}-{setting}.json"
    start = time.perf_counter()
    record = ppl_record(loaded, method, storages, setting, artifact, text, windows, args.dtype, protocol, prompt_len,
                        args.batch_size, "simulate", "packed", prefix_len, window)
    record["deterministic"] = True
    command = ["kvcal", "eval", "ppl", *source, "--model", args.model, "--nsamples", str(args.nsamples),
               "--seqlen", str(args.seqlen), *flags, "--fp-window", str(window), "--batch-size",
               str(args.batch_size), "--device", args.device, "--dtype", args.dtype, "--json", str(out)]
    record["command"] = shlex.join(command)
    record["seconds"] = round(time.perf_counter() - start, 1)
    write_json_atomic(out, record)
    print(f"{protocol} {setting}: PPL {record['ppl']:.4f}, {record['bits_per_element']:.3f} bits, "
          f"{record['fp_keys_per_query']:.1f} fp keys/query ({record['seconds']} s)", flush=True)
    return None


if __name__ == "__main__":
    main()
    print(json.dumps({"done": True}))
