"""Models split over several devices (--device-map): the checks, the placement of the built-in models, and the
per-layer devices of capture, codecs and caches. The CPU has one device, so the bookkeeping runs through accelerate's
hooks with every block on the CPU (or on meta, where no memory is needed); the GPU test splits a model over two."""

import pytest
import torch

from kvcal.determinism import deterministic_algorithms
from kvcal.errors import KvcalError
from kvcal.eval.ppl import decoded_nll, simulated_nll
from kvcal.methods import build_method
from kvcal.models import load_model
from kvcal.models.devmap import (
    build_split,
    check_device_map,
    check_placement,
    infer_map,
    parse_max_memory,
    run_per_device,
)
from kvcal.runtime.cache import KvcalCache
from tests.test_cli import assert_one_line_error, kvcal
from tests.test_runtime import CALIBRATION_TEXT, KVQUANT_CONFIG


def tiny_map(layers=2, device="cpu", **where):
    """An explicit map of a tiny model's blocks, each on `device` unless `where` names another (layer index ->
    device)."""
    blocks = {"model.embed_tokens": device, **{f"model.layers.{i}": where.get(f"l{i}", device) for i in range(layers)},
              "model.norm": device, "model.rotary_emb": device, "lm_head": device}
    return blocks


@pytest.fixture(scope="module")
def split():
    """tiny-llama placed by an explicit map (through the public API): accelerate's hooks on every block (all on the
    CPU)."""
    import kvcal

    return kvcal.load_model("tiny-llama", device_map=tiny_map())


# ---- work on several devices at once ------------------------------------------------------------------------------
def test_run_per_device_gives_each_device_a_thread_and_keeps_its_order():
    """Items of two devices ("cpu" and "meta": two torch devices without a GPU) run in two threads at once (each waits
    at a barrier the other must reach: one thread after the other would time out), each device's items in order; one
    device runs in the calling thread."""
    import threading

    barrier = threading.Barrier(2, timeout=30)
    seen = []

    def work(item, stop):
        stop()
        if item[1] == 0:
            barrier.wait()
        seen.append((item, threading.current_thread().name))

    items = [("cpu", 0), ("meta", 0), ("cpu", 1), ("meta", 1), ("cpu", 2)]
    run_per_device(items, lambda item: item[0], work)
    assert sorted(i for i, _ in seen) == sorted(items)
    for device in ("cpu", "meta"):
        mine = [(i, name) for i, name in seen if i[0] == device]
        assert [i[1] for i, _ in mine] == list(range(len(mine)))  # in order
        assert len({name for _, name in mine}) == 1 and mine[0][1] != threading.current_thread().name
    seen.clear()
    run_per_device([("cpu", 1), ("cpu", 2)], lambda item: item[0], work)
    assert [name for _, name in seen] == [threading.current_thread().name] * 2


def test_run_per_device_stops_the_other_devices_on_a_failure():
    """A failure on one device stops the other device's work at its next check (stop() raises there) and is the error
    the caller sees."""
    import threading

    started = threading.Event()
    steps = []

    def work(item, stop):
        if item == "meta":
            started.wait(30)
            raise ValueError("meta failed")
        started.set()
        for step in range(10_000):
            stop()
            steps.append(step)
            threading.Event().wait(0.001)

    with pytest.raises(ValueError, match="meta failed"):
        run_per_device(["cpu", "meta"], lambda item: item, work)
    assert 0 < len(steps) < 10_000  # stopped early, not run to its end


def test_ctrl_c_while_devices_work_stops_them_all():
    """Ctrl-C reaches the calling thread (SIGINT sent to it from a worker stands in for the terminal's) while it waits:
    both devices' work stops at its next check and the caller sees KeyboardInterrupt."""
    import signal
    import threading

    steps = {"cpu": 0, "meta": 0}

    def work(item, stop):
        for step in range(10_000):
            stop()
            steps[item] += 1
            if item == "cpu" and step == 20:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            threading.Event().wait(0.001)

    # Python's own SIGINT handler (a run started in the background of a shell inherits SIGINT ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_per_device(["cpu", "meta"], lambda item: item, work)
    finally:
        signal.signal(signal.SIGINT, before)
    assert 0 < steps["cpu"] < 10_000 and 0 < steps["meta"] < 10_000


# ---- bad input ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (("auto", None, "auto", 0), "this machine has none"),
    (("auto", None, "cpu", 2), "--device cpu and --device-map auto both place the model"),
    (("everywhere", None, "auto", 2), "unknown --device-map 'everywhere' (auto, balanced, sequential, even)"),
    (("auto", "0=20GiB,1", "auto", 2), "--max-memory '0=20GiB,1' is malformed"),
    (("auto", "gpu0=20GiB", "auto", 2), "is malformed"),
    (("auto", "0=lots", "auto", 2), "is malformed"),
    (("auto", "0=1GiB,0=2GiB", "auto", 2), "names GPU 0 twice"),
    (("auto", "0=0GiB", "auto", 2), "gives GPU 0 no memory"),
    (("auto", "2=20GiB", "auto", 2), "names GPU 2, and this machine has 2"),
    ((None, "0=20GiB", "auto", 2), "--max-memory applies with --device-map only"),
])
def test_device_map_checks_are_one_line(args, needle):
    device_map, max_memory, device, gpus = args
    with pytest.raises(KvcalError, match=None) as err:
        check_device_map(device_map, max_memory, device, gpus)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_max_memory_parses_gpu_caps():
    assert parse_max_memory("0=20GiB, 1=512MiB") == {0: "20GiB", 1: "512MiB"}
    assert check_device_map("auto", "0=20GiB,1=20GiB", "auto", gpus=2) == ("auto", {0: "20GiB", 1: "20GiB"})
    assert check_device_map(None, None, "cpu", gpus=0) == (None, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without GPUs")
@pytest.mark.parametrize("argv", [
    ["calibrate", "--method", "kvquant", "--model", "tiny-llama", "--device-map", "auto", "--out-dir", "TMP/a"],
    ["generate", "--prompt", "x", "--model", "tiny-llama", "--method", "fp16", "--device-map", "auto"],
    ["eval", "ppl", "--method", "fp16", "--model", "tiny-llama", "--device-map", "auto", "--json", "TMP/r.json"],
    ["eval", "passkey", "--method", "fp16", "--model", "tiny-llama", "--device-map", "auto", "--max-memory", "0=1GiB"],
])
def test_device_map_without_gpus_is_one_line_and_writes_nothing(argv, tmp_path):
    result = kvcal(*[a.replace("TMP", str(tmp_path)) for a in argv])
    assert_one_line_error(result, "--device-map places the model's layers on CUDA GPUs, and this machine has none")
    assert list(tmp_path.iterdir()) == []


def test_offloading_maps_are_refused():
    with pytest.raises(KvcalError, match="offloads layers to disk"):
        check_placement({"model.layers.0": 0, "model.layers.1": "disk"})
    with pytest.raises(KvcalError, match="offloads model.layers.1 to the CPU"):
        check_placement({"model.layers.0": 0, "model.layers.1": "cpu"})
    check_placement({"model.layers.0": 0, "model.layers.1": "cuda:1"})  # GPUs only: fine


# ---- placement ----------------------------------------------------------------------------------------------------
def test_a_map_keeps_the_tiny_weights_and_logits(split):
    """A tiny model placed by a map is the model built without one, run through accelerate's hooks (each block's
    hook moves its inputs to the block's device)."""
    plain = load_model("tiny-llama")
    assert hasattr(split.model.model.layers[1], "_hf_hook") and not hasattr(plain.model.model.layers[1], "_hf_hook")
    for (name, a), (_, b) in zip(plain.model.named_parameters(), split.model.named_parameters()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(plain.model(ids).logits, split.model(ids).logits)
    assert [split.layer_device(i) for i in range(2)] == [torch.device("cpu")] * 2
    assert split.device_label == "cpu"


def test_layer_device_is_where_the_layer_weights_are():
    """The per-layer device comes from the weights, not from a device kept beside the model: a model whose second
    layer sits on meta (no memory) reports it; the input device is the embeddings'."""
    loaded = load_model("tiny-llama")
    loaded.model.model.layers[1].to("meta")  # (accelerate's dispatch would call CPU blocks beside meta offloaded)
    assert loaded.layer_device(0) == torch.device("cpu") and loaded.layer_device(1) == torch.device("meta")
    assert loaded.devices == [torch.device("cpu"), torch.device("meta")]
    assert loaded.device_label == "cpu+meta"
    assert loaded.device == torch.device("cpu")
    from kvcal.models.devmap import placement_summary

    assert placement_summary(loaded) == "layers 0 on cpu, 1 on meta (embeddings cpu, LM head cpu)"


def test_real_shapes_are_built_per_module_on_their_devices():
    """random-llama-3.1-8b with a map is never built whole: each module is allocated and drawn on its own device (meta
    here: Llama-3.1-8B's 8 billion parameters in no memory), and the source says its weights are drawn per module."""
    blocks = {"model.embed_tokens": "meta", **{f"model.layers.{i}": "meta" for i in range(32)}, "model.norm": "meta",
              "model.rotary_emb": "meta", "lm_head": "meta"}
    loaded = load_model("random-llama-3.1-8b", "bfloat16", device_map=blocks)
    assert loaded.source == {"random_seed": 0, "shapes": "llama-3.1-8b", "init": "per-module"}
    assert {p.device.type for p in loaded.model.parameters()} == {"meta"}
    assert sum(p.numel() for p in loaded.model.parameters()) == 8_030_261_248  # Llama-3.1-8B's published count
    assert loaded.layer_device(31) == torch.device("meta") and loaded.dtype == torch.bfloat16


def test_split_build_weights_do_not_depend_on_the_map():
    """The per-module draw is seeded by the module's name: one block or a map of several give the same weights,
    transformers' own init (normal(0, initializer_range) for projections and embeddings, ones for norms) and the
    model's RoPE buffers."""
    from kvcal.models.tiny import build_random_model, tiny_config

    config = tiny_config("qwen2")  # k/v biases: zeros
    whole = build_split(config, torch.float32, {"": "cpu"}, None, seed=3)
    mapped = build_split(config, torch.float32, tiny_map(), None, seed=3)
    other = build_split(config, torch.float32, {"": "cpu"}, None, seed=4)
    reference = build_random_model(config, torch.float32, "cpu")
    params = dict(mapped.named_parameters())
    for name, p in whole.named_parameters():
        assert torch.equal(p, params[name]), name
    assert not torch.equal(whole.lm_head.weight, other.lm_head.weight)
    assert float(params["model.layers.0.self_attn.q_proj.weight"].detach().std()) == pytest.approx(0.1, rel=0.05)
    assert torch.equal(params["model.layers.1.input_layernorm.weight"], torch.ones(64))
    assert torch.equal(params["model.layers.0.self_attn.k_proj.bias"], torch.zeros(32))
    assert torch.equal(mapped.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)


def test_8b_shapes_spread_over_two_capped_gpus_or_are_refused():
    """accelerate's placement of Llama-3.1-8B shapes in bf16 (15 GiB) under per-GPU caps: 9 GiB each splits the
    layers over GPUs 0 and 1 with nothing on the CPU or disk; 5 GiB each does not fit, and kvcal refuses the offload."""
    from kvcal.models.tiny import build_random_model, llama31_8b_config

    skeleton = build_random_model(llama31_8b_config(), torch.bfloat16, "meta")
    placement = infer_map(skeleton, "sequential", {0: "9GiB", 1: "9GiB"}, torch.bfloat16)
    assert set(placement.values()) == {0, 1}
    assert placement["model.embed_tokens"] == 0 and placement["lm_head"] == 1
    layers = [placement[f"model.layers.{i}"] for i in range(32)]
    assert layers == sorted(layers)  # consecutive layers, GPU 0 first
    with pytest.raises(KvcalError, match="offloads layers to disk"):
        check_placement(infer_map(skeleton, "sequential", {0: "5GiB", 1: "5GiB"}, torch.bfloat16))


def test_even_puts_the_same_number_of_layers_on_every_gpu():
    """--device-map even on Llama-3.1-8B shapes (a skeleton on meta): 16 + 16 consecutive layers on two GPUs (accelerate's
    'balanced' puts 14 on the first), 11 + 11 + 10 on three, the embeddings on the first GPU, the final norm and the
    untied LM head on the last; every parameter has its block. No more GPUs than layers; a share over its cap is
    refused in one line."""
    from kvcal.models.devmap import even_map
    from kvcal.models.tiny import build_random_model, llama31_8b_config

    skeleton = build_random_model(llama31_8b_config(), torch.bfloat16, "meta")
    for gpus, counts in ((2, [16, 16]), (3, [11, 11, 10])):
        placement = infer_map(skeleton, "even", None, torch.bfloat16, gpus=gpus)
        layers = [placement[f"model.layers.{i}"] for i in range(32)]
        assert layers == sorted(layers) and [layers.count(g) for g in range(gpus)] == counts
        assert placement["model.embed_tokens"] == 0
        assert placement["model.norm"] == placement["lm_head"] == gpus - 1
        blocks = tuple(f"{b}." for b in placement)
        assert all(name.startswith(blocks) for name, _ in skeleton.named_parameters())
    tiny = build_random_model(tiny_config_tied(), torch.float32, "meta")  # 2 layers over 4 GPUs: 2 used
    assert even_map(tiny, 4) == {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
                                 "model.rotary_emb": 1, "lm_head": 0}  # the tied head with the embeddings
    # GPU 0's share: 16 layers of 218.1M parameters and the 525M embeddings, in bf16: 7.48 GiB
    assert even_map(skeleton, 2, {0: "7.5GiB", 1: "8GiB"})["model.layers.15"] == 0
    with pytest.raises(KvcalError) as err:
        even_map(skeleton, 2, {0: "7GiB", 1: "60GiB"})
    assert str(err.value) == ("--device-map even puts 7.48 GiB of weights on GPU 0, over its --max-memory (7.00 GiB): "
                              "use more GPUs, or --device-map auto")


def tiny_config_tied():
    from kvcal.models.tiny import tiny_config

    config = tiny_config("llama")
    config.tie_word_embeddings = True
    return config


# ---- one data path through the map ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def calibration_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(CALIBRATION_TEXT)
    return path


def test_calibration_through_a_map_gives_the_same_artifact(split, calibration_text, tmp_path):
    """KVQuant (Fisher capture, per-layer fits on each layer's device) calibrated through the hooks of a map gives
    the tensors calibrated without one, bit for bit, and the same header but for the timing."""
    from kvcal.calib.run import run_calibration

    plain = load_model("tiny-llama")
    arts = [run_calibration(loaded, build_method("kvquant", KVQUANT_CONFIG), tmp_path / f"{n}.safetensors",
                            str(calibration_text), nsamples=3, seqlen=48) for n, loaded in (("a", plain), ("b", split))]
    assert arts[0].tensors.keys() == arts[1].tensors.keys() and len(arts[0].tensors) == 12
    for name, t in arts[0].tensors.items():
        assert torch.equal(t, arts[1].tensors[name]), name
    assert arts[0].header["tensor_hash"] == arts[1].header["tensor_hash"]


@pytest.mark.parametrize("name,config", [("kvquant", KVQUANT_CONFIG), ("kivi", {"bits": 2, "group_size": 4,
                                                                              "residual": 8})])
def test_decode_through_a_map_equals_decode_without(split, calibration_text, tmp_path, name, config):
    """The packed cache passed through accelerate's hooks (the cache argument is one they leave alone) decodes what
    it decodes without a map, and what the simulation gives; greedy generation emits the same tokens."""
    from kvcal.calib.run import run_calibration
    from kvcal.runtime.graph import greedy_decode

    plain = load_model("tiny-llama")
    method = build_method(name, config)
    tensors = (run_calibration(plain, method, tmp_path / "a.safetensors", str(calibration_text), nsamples=3,
                               seqlen=48).tensors if method.learns else {})
    codec = method.build_storages(tensors, plain.dims)
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(5))
    want = decoded_nll(plain, codec, ids, batch_size=2)
    got = decoded_nll(split, method.build_storages(tensors, split.dims), ids, batch_size=2)
    assert got.tokens == want.tokens and got.nll == want.nll
    assert got.nll == pytest.approx(simulated_nll(split, codec, ids).nll, rel=1e-3)
    outs = []
    for loaded in (plain, split):
        cache = KvcalCache(method.build_storages(tensors, loaded.dims), loaded.dims.num_layers)
        outs.append(greedy_decode(loaded, cache, ids[:1, :12], 10))
    assert torch.equal(outs[0]["tokens"], outs[1]["tokens"]) and outs[1]["mode"] == "eager"


def test_each_cache_layer_allocates_on_its_layers_device(split, calibration_text, tmp_path):
    """A packed layer allocates its buffers, its full-precision slots, its storage's tables and its RoPE tables on
    the device of the keys it receives; a cache whose layer 0 is on the CPU and layer 1 on meta keeps each on its own
    (the shared state holds one RoPE table per device and RoPE)."""
    from kvcal.calib.run import run_calibration

    method = build_method("kvquant", KVQUANT_CONFIG)
    art = run_calibration(split, method, tmp_path / "a.safetensors", str(calibration_text), nsamples=3, seqlen=48)
    codec = method.build_storages(art.tensors, split.dims)
    cache = KvcalCache(codec, 2)
    inv_freq = split.dims.rope.inv_freq("cpu")
    dims = split.dims
    for layer, device in zip(cache.layers, ("cpu", "meta")):
        layer._init(2, dims.num_kv_heads, dims.head_dim, torch.float32, torch.device(device), inv_freq.to(device),
                    dims.hidden_size)
    for layer, device in zip(cache.layers, ("cpu", "meta")):
        tensors = [*layer.buffers.values(), layer.fp_k, layer.fp_v, layer.fp_valid, layer.lengths, layer.rope_cos,
                   layer.rope_sin, layer.storage.key_table, layer.storage.key_scale]
        assert {t.device.type for t in tensors} == {device}
    assert sorted(device.type for device, _ in cache.shared._tables) == ["cpu", "meta"]
    assert codec[0].key_table.device.type == "cpu"  # layer 0's storage was not moved by layer 1's


# ---- two GPUs -----------------------------------------------------------------------------------------------------
def _small_llama_config():
    """Llama-3.1-8B's attention shapes per head (head_dim 128, GQA 4:1) in 4 small random layers (the shapes of
    tests/test_runtime.py's GPU tests)."""
    from kvcal.models.tiny import llama31_8b_config

    config = llama31_8b_config()
    config.num_hidden_layers, config.hidden_size, config.intermediate_size = 4, 1024, 2048
    config.num_attention_heads, config.num_key_value_heads, config.vocab_size = 8, 2, 512
    return config


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("which", ["rtn", "kvquant", "kivi"])
@pytest.mark.filterwarnings("error:decode_attention_triton")  # both sides on the Triton kernels, not the reference
def test_split_over_two_gpus_decodes_what_one_gpu_decodes(which, tmp_path):
    """A 4-layer model at Llama-3.1-8B head shapes (bf16) split over cuda:0 (layers 0-1) and cuda:1 (layers 2-3):
    KVQuant calibrated on it (each layer's fit on its GPU) gives the tables calibrated on one GPU, and decode-mode
    logits step by step through one artifact (each packed layer's kernels and step graph on its own GPU) equal those
    of the model on cuda:0 alone, bit for bit (torch's deterministic mode, entered before the first matmul: KVQuant's
    value sums in fixed order)."""
    with deterministic_algorithms(True):
        _split_decode(which, tmp_path)


def _split_decode(which, tmp_path):
    from kvcal.calib.run import run_calibration
    from kvcal.models import LoadedModel, ModelDims
    from kvcal.models.adapter import forward_with_cache, install_adapter
    from kvcal.models.devmap import dispatch
    from kvcal.models.tiny import build_random_model, byte_tokenizer

    config = _small_llama_config()
    models = []
    for placement in (None, tiny_map(4, "cuda:0", l2="cuda:1", l3="cuda:1") | {"model.norm": "cuda:1",
                                                                                "lm_head": "cuda:1"}):
        model = build_random_model(config, torch.bfloat16, "cuda:0")
        if placement is not None:
            model = dispatch(model, placement)
        loaded = LoadedModel("small-llama", model, byte_tokenizer(), ModelDims.from_config(config))
        install_adapter(loaded)
        models.append(loaded)
    one, two = models
    assert [two.layer_device(i).index for i in range(4)] == [0, 0, 1, 1]
    method = build_method(which, {"bits": 4})
    tensors = {}
    if which == "kvquant":
        text = tmp_path / "text.txt"
        text.write_text(CALIBRATION_TEXT)
        arts = [run_calibration(m, method, tmp_path / f"{i}.safetensors", str(text), nsamples=2, seqlen=256)
                for i, m in enumerate(models)]
        for name, t in arts[0].tensors.items():  # (the CPU test checks bit-identity; k-means on GPUs may reorder sums)
            torch.testing.assert_close(arts[1].tensors[name], t, rtol=1e-3, atol=1e-3)
        tensors = arts[0].tensors
    prompt = torch.randint(0, 512, (2, 300), device="cuda:0", generator=torch.Generator("cuda:0").manual_seed(0))
    caches = [KvcalCache(method.build_storages(tensors, m.dims), 4) for m in models]
    with torch.inference_mode():
        for m, cache in zip(models, caches):
            forward_with_cache(m.model, prompt, cache)
        ids = prompt[:, -1:]
        for _ in range(40):
            want = forward_with_cache(one.model, ids, caches[0]).logits
            got = forward_with_cache(two.model, ids, caches[1]).logits
            assert torch.equal(got.to(want.device), want)
            ids = want[:, -1:].argmax(-1)
    for i, layer in enumerate(caches[1].layers):
        assert {t.device.index for t in layer.buffers.values()} == {two.layer_device(i).index}
        assert layer.step_graph.replays > 0  # each layer's step replayed from a graph on its own GPU


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_even_splits_smollm2_over_two_gpus_with_one_gpus_logits():
    """smollm2-135m loaded with --device-map even over two GPUs (transformers loads it by kvcal's explicit map): layers
    0-14 on cuda:0, 15-29 on cuda:1, the tied LM head with the embeddings on cuda:0, and the logits of the model on
    cuda:0 alone, bit for bit."""
    ids = torch.arange(1, 65).unsqueeze(0)
    logits = []
    for kwargs in ({"device": "cuda:0"}, {"device_map": "even"}):
        loaded = load_model("smollm2-135m", "float32", **kwargs)
        if "device_map" in kwargs:
            assert [str(loaded.layer_device(i)) for i in (0, 14, 15, 29)] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
            assert loaded.model.get_output_embeddings().weight.device == torch.device("cuda:0")
        with torch.no_grad():
            logits.append(loaded.model(ids.to("cuda:0")).logits.cpu())
        del loaded
    assert torch.equal(logits[0], logits[1])
