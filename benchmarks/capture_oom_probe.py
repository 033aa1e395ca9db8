"""Can a CUDA graph capture use memory that torch's cache holds? (GPU; the reason StepGraph gives up a recording
that runs out of memory and launches the step instead.)

1. Fill the driver's free memory with one tensor and free it: the memory now sits in torch's cache.
2. Capture a graph that allocates 1 GiB (into a private graph pool, as StepGraph's captures do): does it fit?
3. Allocate 1 GiB outside a capture: served from the cache.
4. Capture 4 MiB after that.
5. Empty the cache, cap torch's memory (`set_per_process_memory_fraction`) just above what it holds, then
   capture 64 MiB and allocate 64 MiB.

    python benchmarks/capture_oom_probe.py | tee results/bench/capture-oom-probe-h100.log
"""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda")


def report(tag: str) -> None:
    free, _ = torch.cuda.mem_get_info()
    print(f"{tag}: driver free {free / 2**20:.1f} MiB, torch reserved {torch.cuda.memory_reserved() / 2**20:.1f} MiB, "
          f"allocated {torch.cuda.memory_allocated() / 2**20:.1f} MiB", flush=True)


def capture(nbytes: int, tag: str, side: torch.cuda.Stream, x: torch.Tensor) -> bool:
    """Capture a graph that allocates `nbytes` (and a small op on `x`); whether the capture succeeded."""
    graph = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    ok = True
    try:
        with torch.cuda.stream(side):
            graph.capture_begin(pool=torch.cuda.graph_pool_handle())
            try:
                torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).fill_(1)
                x.mul(2)
            except BaseException:
                try:
                    graph.capture_end()
                except RuntimeError as err:
                    print("  capture_end after failure raised:", str(err).splitlines()[0])
                raise
            graph.capture_end()
    except RuntimeError as err:  # torch.OutOfMemoryError, or torch.AcceleratorError from cudaMalloc
        ok = False
        print(f"  {tag}: capture failed: {type(err).__name__}: {str(err).splitlines()[0][:150]}")
    torch.cuda.current_stream().wait_stream(side)
    report(f"  {tag} after capture ok={ok}")
    return ok


def main() -> None:
    print(torch.__version__)
    x = torch.randn(1024, device=DEVICE)
    side = torch.cuda.Stream()  # made first: on a full GPU creating a stream runs out of memory too
    print("AcceleratorError is RuntimeError:", issubclass(getattr(torch, "AcceleratorError", RuntimeError), RuntimeError))
    report("start")
    free = torch.cuda.mem_get_info()[0]
    hog = None
    for margin in (64 << 20, 256 << 20):
        try:
            hog = torch.empty(free - margin, dtype=torch.uint8, device=DEVICE)
            break
        except torch.OutOfMemoryError:
            continue
    report("hog allocated")
    del hog
    report("hog freed (cached)")
    capture(1 << 30, "1 GiB capture with the driver full of torch's cache", side, x)
    y = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    report("launched 1 GiB")
    del y
    capture(4 << 20, "4 MiB capture", side, x)
    torch.cuda.empty_cache()
    report("emptied")
    total = torch.cuda.get_device_properties(DEVICE).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (1 << 20)) / total)
    capture(64 << 20, "64 MiB capture under a cap of reserved + 1 MiB", side, x)
    try:
        torch.empty(64 << 20, dtype=torch.uint8, device=DEVICE)
        print("  launched 64 MiB under cap: ok")
    except torch.OutOfMemoryError:
        print("  launched 64 MiB under cap: OOM")
    torch.cuda.set_per_process_memory_fraction(1.0)
    print("done")


if __name__ == "__main__":
    main()
