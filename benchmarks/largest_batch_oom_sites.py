"""Where the out-of-memory failures of `kvcal bench generate --max-batch` happen, and whether a failed try leaves
memory behind for the next: runs the given batches in eager mode (16 steps, step graphs) one after another in one
process and prints, after each, where a failure was raised, the CUDA-graph pools' bytes and torch's reserved and
allocated bytes, and whether torch's capture_end raised.

  python benchmarks/largest_batch_oom_sites.py artifacts/random-llama-3.1-8b/kvquant-nuq4-1pct.safetensors \
      48,64,56,52,50,49,48

`results/bench/largest-batch-oom-sites-h100.log` came from a copy of this script that also had a switch (FIX)
making two torch calls no-ops for a variant of StepGraph that was not kept; the log's "FIX False" line is that
switch, which changed nothing here (capture_end never raised)."""
import sys
import traceback

import torch

from kvcal.artifact import load_artifact
from kvcal.methods.registry import codec_for_artifact
from kvcal.models import load_model
from kvcal.runtime import bench_generate

counts = {"capture_end_raised": 0}
orig_end = torch.cuda.CUDAGraph.capture_end


def capture_end(self, *a, **k):
    try:
        return orig_end(self, *a, **k)
    except RuntimeError as err:
        counts["capture_end_raised"] += 1
        print("    capture_end raised:", str(err).splitlines()[0][:150], flush=True)
        raise


torch.cuda.CUDAGraph.capture_end = capture_end
orig_run = bench_generate.run_case


def run_case(*a, **k):
    try:
        return orig_run(*a, **k)
    except RuntimeError:
        tb = traceback.format_exc().splitlines()
        where = [line.strip() for line in tb if line.strip().startswith("File") and "kvcal" in line][-3:]
        print("    failed at:", " | ".join(w.split("/kvcal/")[-1] for w in where), flush=True)
        raise


bench_generate.run_case = run_case


def private_gib():
    segs = torch.cuda.memory_snapshot()
    return sum(s["total_size"] for s in segs if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)) / 2**30


loaded = load_model("random-llama-3.1-8b", "bfloat16", "cuda")
path = sys.argv[1]
method, codec = codec_for_artifact(load_artifact(path), loaded, path)
print(path, flush=True)
for batch in [int(b) for b in sys.argv[2].split(",")]:
    record, err = bench_generate.run_case_or_oom(loaded, "x", method, codec, batch, 32768, 16, mode="eager")
    print(f"batch {batch}: {'ok' if record else 'OOM ' + err[:90]}; private pools {private_gib():.2f} GiB, reserved "
          f"{torch.cuda.memory_reserved() / 2**30:.2f}, allocated {torch.cuda.memory_allocated() / 2**30:.2f}, {counts}",
          flush=True)
