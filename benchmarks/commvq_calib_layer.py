"""Time CommVQ's calibration of one layer's key EM and of the value encoders of --layers layers trained together,
on synthetic activations of a model's shapes.

The key EM's cost is per layer and the same for every layer (fixed budgets, EM early stopping aside); the value
encoders of a chunk of layers train as one stacked optimisation (`kvcal calibrate` puts as many layers in a chunk as
half of the GPU's free memory holds), so their time per layer falls with --layers. Synthetic keys have per-channel scales that
spread over two decades (as real pre-RoPE keys), values and queries are Gaussian: a timing, not a quality, run.

    python benchmarks/commvq_calib_layer.py --shape llama-3.1-8b --bits 2 --device cuda
    python benchmarks/commvq_calib_layer.py --shape smollm2-135m --bits 2 --device cuda --layers 30
    python benchmarks/commvq_calib_layer.py --shape smollm2-135m --bits 2 --device cpu --key-stages 1 --value-steps 20

--profile prints torch.profiler's operator table of the value training (its time then includes the profiler's).
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch

from kvcal.methods.commvq.calibrate import fit_keys, fit_values, held_out_windows, rows_of, window_bounds
from kvcal.methods.commvq.method import CommVQ

SHAPES = {  # num_layers, query heads, KV heads, head_dim, hidden size, rope theta
    "llama-3.1-8b": (32, 32, 8, 128, 4096, 500000.0),
    "smollm2-135m": (30, 9, 3, 64, 576, 100000.0),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--nsamples", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--key-train-vectors", type=int, default=16384)
    ap.add_argument("--key-em-steps", type=int, default=25)
    ap.add_argument("--key-stages", type=int, default=0, help="0: the method's R (time scales with R)")
    ap.add_argument("--value-steps", type=int, default=3000)
    ap.add_argument("--value-loss", default="attention")
    ap.add_argument("--value-precision", default="float32",
                    help="float32, bfloat16 (autocast of the value step) or tf32 (float32 with TF32 matrix products)")
    ap.add_argument("--value-graphs", action="store_true", help="replay each value step from one CUDA graph")
    ap.add_argument("--layers", type=int, default=1, help="value encoders trained together (the same synthetic data)")
    ap.add_argument("--codes", choices=("kernels", "reference"), default="kernels",
                    help="the training codes' chain on a GPU: the fused Triton kernels (what kvcal runs) or the torch "
                    "reference (for an A/B on one machine)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="print torch.profiler's table of the value training's operators (by device time)")
    args = ap.parse_args()

    if args.codes == "reference":  # the torch chain on CUDA tensors too (same signature as the kernels)
        from kvcal.methods.commvq import training_codes

        training_codes.gumbel_bits_triton = training_codes.gumbel_bits_reference
    layers, hq, hkv, d, hidden, rope_theta = SHAPES[args.shape]
    dims = SimpleNamespace(num_layers=layers, num_heads=hq, num_kv_heads=hkv, head_dim=d, kv_channels=hkv * d)
    method = CommVQ(bits=args.bits, key_train_vectors=args.key_train_vectors, key_em_steps=args.key_em_steps,
                    key_stages=args.key_stages, value_steps=args.value_steps, value_loss=args.value_loss,
                    value_precision=args.value_precision, value_graphs=args.value_graphs)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    tokens = args.nsamples * args.seqlen
    channel_scale = 10 ** (2 * torch.rand(dims.kv_channels, generator=gen) - 1)
    data = {"k": (torch.randn(tokens, dims.kv_channels, generator=gen) * channel_scale).bfloat16(),
            "v": torch.randn(tokens, dims.kv_channels, generator=gen).bfloat16(),
            "q": torch.randn(tokens, hq * d, generator=gen).bfloat16()}
    positions = torch.arange(args.seqlen).repeat(args.nsamples)
    windows = window_bounds(positions)
    held = held_out_windows(len(windows), method.holdout, method.seed)
    train_rows, held_rows = rows_of(windows, held, False), rows_of(windows, held, True)
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    loaded = SimpleNamespace(dims=dims, adapter=SimpleNamespace(inv_freq=inv_freq,
                                                                inv_freq_on=lambda device: inv_freq.to(device)))
    o_proj = torch.nn.Linear(hq * d, hidden, bias=False)
    with torch.no_grad():
        o_proj.weight.copy_(torch.randn(hidden, hq * d, generator=gen) * (hq * d) ** -0.5)  # seeded: runs repeat
    module = SimpleNamespace(scaling=d**-0.5, o_proj=o_proj)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    _, key_info = fit_keys(data["k"], train_rows, held_rows, 0, dims, device, lambda n=1: None,
                           method.key_fit(dims), method.seed)
    sync()
    t1 = time.perf_counter()
    store = SimpleNamespace(layer=lambda i, names=None: data)
    chunk = list(range(args.layers))
    def train_values():
        return fit_values(store, chunk, windows, held, [module] * args.layers, loaded, device, lambda n=1: None,
                          method.value_fit(dims), method.seed)[0][1]

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            value_info = train_values()
            sync()
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60))
    else:
        value_info = train_values()
    sync()
    t2 = time.perf_counter()
    stages = method.stages(dims)
    e_steps = sum(sum(group) for group in key_info["em_steps"])
    result = {
        "shape": args.shape, "bits": args.bits, "device": torch.cuda.get_device_name() if device.type == "cuda"
        else "cpu", "groups": method.num_groups(dims), "stages": stages, "key_train_vectors": args.key_train_vectors,
        "key_em_steps": args.key_em_steps, "value_steps": args.value_steps, "value_loss": args.value_loss,
        "value_precision": args.value_precision, "value_graphs": args.value_graphs, "codes": args.codes,
        "key_s": round(t1 - t0, 2), "value_s": round(t2 - t1, 2),
        "key_e_steps_per_group": e_steps / method.num_groups(dims),
        "key_ms_per_batched_e_step": round(1e3 * (t1 - t0) / max(1, e_steps / method.num_groups(dims)), 2),
        "value_layers": args.layers, "value_ms_per_step": round(1e3 * (t2 - t1) / args.value_steps, 2),
        "value_ms_per_layer_step": round(1e3 * (t2 - t1) / args.value_steps / args.layers, 3),
        "all_layers_min": round((layers * (t1 - t0) + layers / args.layers * (t2 - t1)) / 60, 1),
        "key_stage_mse": key_info["stage_mse"], "value_mse": value_info["mse"],
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
