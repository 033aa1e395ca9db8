"""`kvcal bench decode`'s naive column: naive_attention (every row dequantized by the storage's torch `read`, the
window appended, SDPA or the written-out softmax for a storage that remaps scores) against the storage's torch
reference attention (partials per row, merged), in float64 on the CPU, for every method's main recipe; and the
grid's arithmetic and table from known timings."""

import pytest
import torch

from kvcal.bench import bench_cases
from kvcal.models import ModelDims
from kvcal.runtime.bench import naive_attention, random_packed
from kvcal.runtime.decode import FullPrecision, merge_reference

RECIPES = ["rtn-int2", "kivi-2bit", "kvquant-nuq2-1pct", "skvq-k2v2-g128-w128", "calibquant-1bit", "commvq-1bit",
           "evict-2bit", "xquant-svd-2bit"]


@pytest.fixture(scope="module")
def dims():
    from transformers import LlamaConfig

    return ModelDims.from_config(LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=64, rope_theta=10000.0))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("window", [0, 8])
def test_naive_step_equals_the_storage_reference(dims, recipe, window):
    (_, _, storages), = bench_cases([recipe], [], dims)
    storage = storages[0]
    batch, tokens = 2, 128  # a multiple of every group of tokens (KIVI quantizes keys per channel in blocks)
    inv_freq = dims.rope.inv_freq("cpu")
    packed = random_packed(storage, batch, dims.num_kv_heads, dims.head_dim, tokens, device="cpu", inv_freq=inv_freq)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(batch, dims.num_heads, dims.head_dim, dtype=torch.float64, generator=gen)
    fp = None
    if window:
        valid = torch.ones(batch, window, dtype=torch.bool)
        valid[1, :3] = False  # a shorter row's window: its first slots hold nothing
        fp = FullPrecision(torch.randn(batch, dims.num_kv_heads, window, dims.head_dim, dtype=torch.float64,
                                       generator=gen),
                           torch.randn(batch, dims.num_kv_heads, window, dims.head_dim, dtype=torch.float64,
                                       generator=gen), valid)
    scale = dims.head_dim**-0.5
    want = merge_reference(storage.attend_reference(q, packed, scale, fp), batch, torch.float64)
    got = naive_attention(storage, packed, q, fp, scale)
    assert got.shape == want.shape == (batch, dims.num_heads, dims.head_dim)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    # the host-known lengths give the same step (what lets the benchmark capture it in a CUDA graph)
    packed.host_lengths = (tokens,) * batch
    torch.testing.assert_close(naive_attention(storage, packed, q, fp, scale), want, rtol=1e-9, atol=1e-9)


def test_decode_bench_rows_and_table_from_known_timings(dims, monkeypatch):
    """run_decode_bench's arithmetic and format_table's text, with the timings replaced by known values (the timing
    itself needs a GPU): GB/s = bytes / us / 1e3, % of copy against the measured copy bandwidth, x vs SDPA = sdpa us /
    case us, x vs naive = naive us / case us; a grid cell whose fp16 K/V would not fit a third of free memory is
    skipped and said."""
    from types import SimpleNamespace

    import kvcal.runtime.bench as B

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(name="Fake GPU",
                                                                                       multi_processor_count=7))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (3 * 2 * 2 * 2 * 4096 * 64 * 2, 1 << 40))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(B, "copy_bandwidth", lambda d: 2000.0)
    monkeypatch.setattr(B, "time_sdpa", lambda *a: (100.0, 4.0e6, "flash"))
    monkeypatch.setattr(B, "time_storage", lambda *a, **k: (25.0, 1.0e6))
    monkeypatch.setattr(B, "time_naive", lambda *a, **k: (300.0, False))
    logs = []
    (_, _, storages), = bench_cases(["kivi-2bit"], [], dims)
    bits = 2.53
    result = B.run_decode_bench([("kivi-2bit", storages, bits)], dims, contexts=(4096, 8192), batches=(1, 2),
                                device="cpu", log=logs.append)
    # K and V of 2 heads x 64 in bf16, batch x context = 8192 tokens a row's worth: exactly a third of free memory
    # (run); twice that (context 8192, batch 2) is skipped
    assert [(r["context"], r["batch"], r["method"]) for r in result["rows"]] == [
        (4096, 1, "sdpa"), (4096, 1, "kivi-2bit"), (4096, 2, "sdpa"), (4096, 2, "kivi-2bit"), (8192, 1, "sdpa"),
        (8192, 1, "kivi-2bit")]
    assert [line for line in logs if line.startswith("skip")] == ["skip context 8192 batch 2: 0.0 GB of fp16 K/V"]
    sdpa, kivi = result["rows"][:2]
    assert sdpa["gbps"] == 40.0 and sdpa["pct_copy"] == 2.0 and sdpa["speedup"] == 1.0
    assert kivi["gbps"] == 40.0 and kivi["pct_copy"] == 2.0 and kivi["speedup"] == 4.0
    assert kivi["x_vs_naive"] == 12.0 and kivi["naive_graph"] is False and kivi["bits"] == 2.53
    assert result["device"] == "Fake GPU" and result["copy_gbps"] == 2000.0
    table = B.format_table(result, context=4096, batch=1).splitlines()
    assert table[2:] == ["| 4096 | 1 | sdpa bf16 | 100.0 | 40 | 2 | 1.00 | | |",
                         "| 4096 | 1 | kivi-2bit | 25.0 | 40 | 2 | 4.00 | 300.0 (eager) | 12.00 |"]
    assert B.device_slug("NVIDIA H200 (141 GB)") == "h200-141-gb"


@pytest.mark.parametrize("name, config", [("fp16", {}), ("kivi", {"bits": 2, "group_size": 4, "residual": 8})])
def test_generate_bench_case_from_known_timings(name, config, monkeypatch):
    """`kvcal bench generate`'s run_case on the CPU, its clock and CUDA memory counters replaced by known values:
    tokens/s = batch x steps / seconds, the cache's bytes those of its buffers (fp16: K and V of every token, by hand)
    and equal to what bits per element predicts, the peak beyond the weights."""
    import kvcal.runtime.bench_generate as G
    from kvcal.methods import build_method
    from kvcal.models import load_model

    loaded = load_model("tiny-llama", "bfloat16")
    method = build_method(name, config)
    ticks = iter([10.0, 12.0])  # the timed steps take 2 s
    for fn, value in (("memory_allocated", 1000), ("max_memory_allocated", 5000), ("reset_peak_memory_stats", None),
                      ("synchronize", None), ("empty_cache", None)):
        monkeypatch.setattr(torch.cuda, fn, lambda *a, value=value: value)
    monkeypatch.setattr(G.time, "perf_counter", lambda: next(ticks))
    r = G.run_case(loaded, name, method, method.build_storages({}, loaded.dims), 2, 64, 4, mode="eager-launch")
    assert (r["tokens_per_s"], r["ms_per_step"], r["peak_bytes_beyond_weights"]) == (4.0, 500.0, 4000)
    d = loaded.dims
    fp16_bytes = 2 * 2 * d.num_layers * d.num_kv_heads * d.head_dim * (64 + 2 + 4) * 2  # rows, K/V, warm-up + steps
    assert r["cache_vs_prediction"] == pytest.approx(1.0, abs=1e-12)
    assert r["cache_bytes"] == fp16_bytes if name == "fp16" else r["cache_bytes"] < fp16_bytes
