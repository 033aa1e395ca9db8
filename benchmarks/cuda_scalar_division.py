"""Does CUDA torch divide by a Python number exactly? It multiplies by the reciprocal instead, which is why
kvcal.quant.uniform.minmax_params divides by a tensor (the Triton quantize kernels and CPU torch divide
exactly, and the GPU simulation must round its scales like the runtime does).

    python benchmarks/cuda_scalar_division.py    # needs a CUDA device; prints mismatch counts
"""

import torch


def main():
    a = torch.rand(1 << 22, device="cuda") * 10
    for d in (3.0, 7.0, 15.0, 255.0):
        by_scalar = a / d
        by_tensor = a / torch.full_like(a, d)
        on_cpu = (a.cpu() / d).cuda()
        print(f"divisor {d:5.0f}: scalar vs tensor {int((by_scalar != by_tensor).sum())}, tensor vs cpu "
              f"{int((by_tensor != on_cpu).sum())}, scalar vs cpu {int((by_scalar != on_cpu).sum())} of {a.numel()}")


if __name__ == "__main__":
    main()
