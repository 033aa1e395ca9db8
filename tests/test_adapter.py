"""The adapter's attention forward against the stock transformers model (eager), for every family."""

import pytest
import torch

from kvcal.errors import KvcalError
from kvcal.models import ModelDims, load_model

FAMILIES = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "tiny-olmo2",
            "tiny-phi3"]
UNIFORM = [name for name in FAMILIES if "gemma" not in name]  # every layer global: kvcal's caches serve them
HYBRID = ["tiny-gemma2", "tiny-gemma3"]  # sliding-window and global layers


def stock_model(name):
    from kvcal.models.tiny import build_random_model, tiny_config

    # transformers' eager attention: an implementation independent of ours (we use SDPA)
    return build_random_model(tiny_config(name.removeprefix("tiny-")), torch.float32, "cpu", 0, "eager")


def simulated_layer_outputs(loaded, storages, ids) -> list:
    """Each attention layer's output in the gptq simulation of `ids` through `storages`."""
    from kvcal.eval.simulate import SimulatedAttention

    outputs, handler = [], SimulatedAttention(storages)
    real = handler.attend
    handler.attend = lambda inp: outputs.append(real(inp)) or outputs[-1]
    with torch.inference_mode(), loaded.adapter.use(handler):
        loaded.model(ids, use_cache=False)
    return outputs


def max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", FAMILIES)
def test_identity_codec_matches_stock_model(name):
    ours = load_model(name)
    stock = stock_model(name)
    # same random weights, and the forward really is ours
    assert torch.equal(ours.model.lm_head.weight, stock.lm_head.weight)
    assert ours.model.model.layers[0].self_attn.forward.__func__.__name__ == "kvcal_attention_forward"
    ids = torch.randint(0, 256, (3, 41), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding
    mask[2, :20] = 0
    with torch.no_grad():
        ref = stock(ids, attention_mask=mask).logits
        got = ours.model(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert max_rel(got[keep], ref[keep]) < 1e-5
    # a padded row gives the same logits as that sequence alone at batch 1
    with torch.no_grad():
        alone = ours.model(ids[1:2, 7:]).logits
    assert max_rel(got[1, 7:], alone[0]) < 1e-5


@pytest.mark.parametrize("name", FAMILIES)
def test_generate_with_default_cache_matches_stock(name):
    ours = load_model(name)
    stock = stock_model(name)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=258)
    ref = stock.generate(ids, **kwargs, output_logits=True, return_dict_in_generate=True)
    got = ours.model.generate(ids, **kwargs, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.logits, ref.logits):
        assert max_rel(a, b) < 1e-5


def test_unsupported_model_type_is_one_line_error():
    from transformers import GPT2Config

    with pytest.raises(KvcalError) as err:
        ModelDims.from_config(GPT2Config())
    message = str(err.value)
    assert "gpt2" in message and "llama" in message and "\n" not in message


def test_phi3_and_olmo2_configs_kvcal_cannot_serve_are_refused_in_one_line():
    """Phi-3 loads where its attention is what kvcal's caches compute: a window shorter than the context (Phi-3 4k
    models: 2047), LongRoPE (the 128k models and Phi-3.5) and partial rotary embeddings are refused; a window at
    least as long as the context slides over nothing and is not refused for itself."""
    from transformers import Phi3Config

    from kvcal.models.tiny import tiny_config

    cases = [(dict(sliding_window=2047, max_position_embeddings=4096), "sliding-window attention (phi3, window 2047)"),
             (dict(sliding_window=262144, max_position_embeddings=131072,
                   rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
                                 "original_max_position_embeddings": 4096}), "unsupported rope type 'longrope'"),
             (dict(partial_rotary_factor=0.75), "partial rotary embeddings are not supported")]
    base = {k: v for k, v in tiny_config("phi3").to_dict().items() if k in Phi3Config().to_dict()}
    for change, message in cases:
        config = Phi3Config(**{**base, **change})
        with pytest.raises(KvcalError) as err:
            ModelDims.from_config(config)
        assert message in str(err.value) and "\n" not in str(err.value), (change, str(err.value))
    dims = ModelDims.from_config(Phi3Config(**{**base, "sliding_window": 8192, "max_position_embeddings": 4096}))
    assert dims.fused_qkv and dims.sliding_window is None and not dims.qk_norm
    olmo = ModelDims.from_config(tiny_config("olmo2"))
    assert olmo.qk_norm and olmo.qk_norm_scope == "projection" and not olmo.fused_qkv


def test_unknown_model_name():
    with pytest.raises(KvcalError, match="unknown model 'no-such-model'"):
        load_model("no-such-model")


def test_hub_model_without_a_connection_reads_only_the_local_cache(monkeypatch):
    """Offline, a Hub model is looked up in the local cache only (local_files_only: huggingface_hub's own retries
    took about 25 s before failing), and a miss is a one-line error that says why."""
    import transformers

    import kvcal.models as models
    from kvcal.models.registry import ModelSpec

    asked = []

    def from_pretrained(source, **kwargs):  # stands in for the Hub lookup: records how it was asked, then misses
        asked.append(kwargs.get("local_files_only"))
        raise OSError(f"{source} is not in the cache")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    spec = ModelSpec("no-such-hub-model", "hub", "kvcal-tests/no-such-model-xyz", "test")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(models, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(KvcalError, match="no connection to the Hub and not in the local cache"):
        models._load_hub(spec, torch.float32, "cpu")
    monkeypatch.setattr(models, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "true")
    with pytest.raises(KvcalError, match="HF_HUB_OFFLINE is set and not in the local cache"):
        models._load_hub(spec, torch.float32, "cpu")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(KvcalError, match=r"\(OSError\)"):  # online: the Hub was asked, transformers' error named
        models._load_hub(spec, torch.float32, "cpu")
    assert asked == [True, True, False]


def test_hub_reachable(monkeypatch):
    import socket

    import kvcal.models as models

    for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)

    def refuse(*args, **kwargs):
        raise OSError("no route")

    monkeypatch.setattr(socket, "create_connection", refuse)
    assert not models.hub_reachable()
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")  # behind a proxy a direct connection says nothing
    assert models.hub_reachable()


@pytest.mark.parametrize("name", UNIFORM)
def test_the_installed_transformers_hands_kvcal_its_cache(name):
    """Runs the adapter against whatever transformers is installed: every layer's attention must receive the
    KvcalCache it was given, under a name the adapter reads. If a release renames the argument again, the failure
    names the keyword each attention call received it under."""
    import transformers

    from kvcal.methods import build_method
    from kvcal.models.adapter import CACHE_ARGUMENTS, forward_with_cache
    from kvcal.runtime.cache import KvcalCache

    loaded = load_model(name)
    cache = KvcalCache(build_method("fp16").build_storages({}, loaded.dims), loaded.dims.num_layers)
    received = []
    for module in loaded.model.model.layers:
        attn = module.self_attn
        real = attn.forward

        def spy(*args, _real=real, **kwargs):
            received.append([key for key, value in kwargs.items() if value is cache])
            return _real(*args, **kwargs)

        attn.forward = spy
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        forward_with_cache(loaded.model, ids, cache)
        forward_with_cache(loaded.model, ids[:, :1], cache)
    assert len(received) == 2 * loaded.dims.num_layers
    for names in received:
        assert len(names) == 1 and names[0] in CACHE_ARGUMENTS, (
            f"transformers {transformers.__version__} handed the cache to attention as {names or 'nothing'}; "
            f"kvcal's adapter reads {CACHE_ARGUMENTS}")
    cache.check_holds(10)
    with pytest.raises(KvcalError, match="holds 10 tokens per row after 11 were fed"):
        cache.check_holds(11)


@pytest.mark.parametrize("name", HYBRID)
def test_hybrid_models_keep_their_layer_pattern_and_compress_only_global_layers(name):
    """Gemma 2 / 3 keep their local/global pattern, window, soft-cap and local RoPE in ModelDims (and in the identity
    an artifact records). In the simulation a local layer attends exactly (its bounded window, as the model) and a
    global layer through the method; fp16 equals the model's own loss; decoding through kvcal's cache gives the
    simulation's loss (Gemma 2's soft-capped scores through the torch references; CalibQuant's decode kernel, which
    does not apply the cap, refuses it in one line)."""
    import dataclasses

    from kvcal.eval.ppl import simulated_nll
    from kvcal.methods import build_method
    from kvcal.models.adapter import forward_with_cache
    from kvcal.models.loaded import GLOBAL, LOCAL
    from kvcal.runtime.cache import KvcalCache

    loaded = load_model(name)
    dims = loaded.dims
    assert dims.hybrid and dims.sliding_window == 8 and dims.layer_types[0] == LOCAL and GLOBAL in dims.layer_types
    identity = dims.to_dict()
    assert identity["layer_types"] == list(dims.layer_types) and identity["sliding_window"] == 8
    if name == "tiny-gemma2":
        assert dims.attn_softcap == 50.0 and dims.local_rope is None and not dims.qk_norm
    else:
        assert dims.attn_softcap is None and dims.local_rope.theta == 10000.0 and dims.rope.theta == 1e6 and dims.qk_norm
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    fp16, rtn = build_method("fp16").build_storages({}, dims), build_method("rtn", {"bits": 2}).build_storages({}, dims)
    # fp16 through kvcal's adapter: the model's own loss on windows three times the sliding window
    with torch.no_grad():
        want = loaded.model(ids, labels=ids).loss.item()
    got = simulated_nll(loaded, fp16, ids, batch_size=2)
    assert abs(got.nll / got.tokens - want) < 1e-5

    exact, compressed = simulated_layer_outputs(loaded, fp16, ids), simulated_layer_outputs(loaded, rtn, ids)
    assert torch.equal(compressed[0], exact[0])  # layer 0 is local: its window stays exact
    assert not torch.allclose(compressed[-1], exact[-1], atol=1e-3)  # the last is global: 2-bit RTN shows
    global_dims = dataclasses.replace(dims, layer_types=(GLOBAL,) * dims.num_layers)
    loaded.adapter.dims = global_dims  # the same model with every layer global: layer 0 is compressed too
    try:
        assert not torch.allclose(simulated_layer_outputs(loaded, rtn, ids)[0], exact[0], atol=1e-3)
    finally:
        loaded.adapter.dims = dims
    # the runtime cache: a local layer attends to its window of exact tokens, a global one through the method;
    # decoding token by token gives the simulation's loss
    from kvcal.eval.ppl import decoded_nll

    for storages in (fp16, rtn):
        simulated, decoded = simulated_nll(loaded, storages, ids), decoded_nll(loaded, storages, ids)
        assert decoded.tokens == simulated.tokens
        assert abs(decoded.nll - simulated.nll) / simulated.nll < 1e-5
    # a 20-token prefill (longer than the window, one row left-padded) and 4 decode steps through kvcal's cache give
    # the logits of the whole sequence at once; a local layer then holds window - 1 tokens, a global one all 24
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.inference_mode():
        whole = loaded.model(ids, attention_mask=mask).logits
        cache = KvcalCache(fp16, dims.num_layers)
        steps = [forward_with_cache(loaded.model, ids[:, :20], cache, attention_mask=mask[:, :20]).logits]
        for t in range(20, 24):
            steps.append(forward_with_cache(loaded.model, ids[:, t : t + 1], cache, attention_mask=mask[:, : t + 1])
                         .logits)
    got = torch.cat(steps, 1)
    keep = mask.bool()
    assert max_rel(got[keep], whole[keep]) < 1e-5
    held = [layer.held()["fp_tokens"] for layer in cache.layers]
    assert held == [2 * (dims.sliding_window - 1) if kind == LOCAL else 2 * 24 for kind in dims.layer_types]
    if dims.attn_softcap is not None:
        # the decode kernels apply the cap (tests/kernel_cases.py: the *_softcap_* cases and a Gemma 2 decoding
        # through CommVQ's and XQuant's kernels; tests/xquant_kernel_cases.py); CalibQuant's, whose scores are
        # remapped, says so in one line before any launch
        from types import SimpleNamespace

        from kvcal.runtime.decode import SOFTCAP_REFUSAL

        capped, q = SimpleNamespace(softcap=50.0), torch.randn(1, 4, 16)
        m = build_method("calibquant")
        storage = m.build_storages(m.synthetic_tensors(dims), dims)[-1]
        assert storage.supports_triton(q, capped) == SOFTCAP_REFUSAL


def test_bits_per_element_counts_local_layers_as_their_fp16_window():
    """tiny-gemma3: layers local, local, global, window 8, reference 4096 tokens: fp16 holds 16 bits in the global
    layer and 16 x 7 / 4096 in each local one (its window - 1 newest tokens between steps), over three layers."""
    from kvcal.accounting import bits_per_element
    from kvcal.methods import build_method
    from kvcal.models.dims import model_dims

    dims = model_dims("tiny-gemma3")
    report = bits_per_element(build_method("fp16"), dims)
    assert report.bits_per_element == pytest.approx((16 + 2 * 16 * 7 / 4096) / 3, rel=1e-12)
    assert report.parts["local_window"] == pytest.approx(2 * 16 * 7 / 4096 / 3, rel=1e-12)
    rtn = bits_per_element(build_method("rtn", {"bits": 4}), dims)
    uniform = bits_per_element(build_method("rtn", {"bits": 4}), model_dims("tiny-qwen3"))  # same shapes, all global
    assert rtn.bits_per_element == pytest.approx(uniform.bits_per_element / 3 + 2 * 16 * 7 / 4096 / 3, rel=1e-12)


def test_soft_capped_mixed_attention_is_attention_over_the_chosen_copies():
    """mixed_attention with a soft-cap (Gemma 2's compressed layers) equals capped attention over the full-precision
    keys where every key is full precision, and over the reconstructed ones where none is."""
    from kvcal.models.attention import attention, mixed_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 16, generator=gen, dtype=torch.float64) * 4
    k, v, k_hat, v_hat = (torch.randn(1, 2, 6, 16, generator=gen, dtype=torch.float64) * 4 for _ in range(4))
    ones = torch.ones(6, 6, dtype=torch.bool)
    for fp, (kk, vv) in ((ones, (k, v)), (~ones, (k_hat, v_hat))):
        got = mixed_attention(q, k, v, k_hat, v_hat, fp, None, 0.25, softcap=5.0)
        torch.testing.assert_close(got, attention(q, kk, vv, None, 0.25, softcap=5.0))
    assert not torch.allclose(attention(q, k, v, None, 0.25, softcap=5.0), attention(q, k, v, None, 0.25))


def test_a_cache_the_adapter_cannot_see_is_refused_in_one_line(tiny):
    """A Cache under a keyword the adapter does not know, or use_cache=True with no cache, would run attention
    without the cache: both are refused, naming the argument and the transformers version."""
    import transformers
    from transformers.cache_utils import DynamicCache

    attn = tiny.model.model.layers[0].self_attn
    hidden = torch.randn(1, 3, tiny.dims.hidden_size)
    positions = torch.arange(3)[None]
    with pytest.raises(KvcalError, match=f"transformers {transformers.__version__} passes the cache to attention as "
                                         "`kv_store`"):
        attn(hidden, position_ids=positions, kv_store=DynamicCache())
    with pytest.raises(KvcalError, match="use_cache=True"):
        attn(hidden, position_ids=positions, use_cache=True)
    out, _ = attn(hidden, position_ids=positions, use_cache=False)  # no cache asked for: plain attention
    assert out.shape == hidden.shape


def test_cache_argument_is_read_from_the_forward_signature():
    from kvcal.models.adapter import cache_argument

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs): ...

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs): ...

    class Neither(torch.nn.Module):
        def forward(self, input_ids, **kwargs): ...

    assert cache_argument(Old()) == "past_key_values" and cache_argument(New()) == "cache"
    with pytest.raises(KvcalError, match="takes neither `cache` nor `past_key_values`"):
        cache_argument(Neither())


def test_a_window_layers_static_decode_step_attends_to_its_window():
    """LosslessLayer's static (CUDA-graph) decode step with a window: the new token sees itself and the window - 1
    tokens before it, nothing older (the same step without a window sees them all). The synthetic fill leaves what a
    prefill of 10 tokens leaves: a window layer holds its window - 1 newest."""
    from types import SimpleNamespace

    from kvcal.models.attention import attention
    from kvcal.runtime.cache import LosslessLayer

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 1, 16, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    history = [torch.randn(1, 2, 10, 16, generator=gen, dtype=torch.float64) for _ in range(2)]
    zeros = torch.zeros(1, 1, 16, dtype=torch.float64)
    for window in (4, None):
        layer = LosslessLayer(0, 16, window)
        layer.fill_synthetic(1, 10, 2, 16, torch.float64, "cpu", None)
        kept = layer.kept
        assert layer.length == 10 and kept == (10 if window is None else window - 1)
        layer.k_buf[:, :, :kept], layer.v_buf[:, :, :kept] = (h[:, :, 10 - kept:] for h in history)
        layer.begin_static()
        inp = SimpleNamespace(q=q, k_pre=k, v=v, cos=torch.ones_like(zeros), sin=zeros, scale=0.25, softcap=None)
        got = layer.attend(inp)
        keys, values = (torch.cat([h, new], 2) for h, new in zip(history, (k, v)))
        start = 0 if window is None else 11 - window
        torch.testing.assert_close(got, attention(q, keys[:, :, start:], values[:, :, start:], None, 0.25))


def test_compress_local_compresses_the_sliding_window_layers_too(text_file, tmp_path):
    """`--compress-local`: in the simulation every layer goes through the method, the local ones still bounded by the
    model's window mask: on tiny-gemma2 (one RoPE for both kinds of layer) each layer's output equals that of the same
    model whose adapter treats every layer as global, bit for bit, and layer 0 no longer equals the exact attention.
    Bits: the local layers hold their window - 1 newest tokens in the method's format (the footprint an all-global
    model of the same shapes has at 7 tokens). Through the CLI the record says so, decode mode (the packed cache) gives
    the simulation's perplexity, and a model without sliding-window layers is refused in one line."""
    import dataclasses
    import json
    import os
    import subprocess
    import sys

    from kvcal.accounting import bits_per_element
    from kvcal.methods import build_method
    from kvcal.models.dims import model_dims
    from kvcal.models.loaded import GLOBAL

    loaded = load_model("tiny-gemma2")
    dims = loaded.dims
    assert dims.local_rope is None
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    fp16, rtn = build_method("fp16").build_storages({}, dims), build_method("rtn", {"bits": 2}).build_storages({}, dims)

    exact = simulated_layer_outputs(loaded, fp16, ids)
    rtn.compress_local = True
    local_too = simulated_layer_outputs(loaded, rtn, ids)
    rtn.compress_local = False
    loaded.adapter.dims = dataclasses.replace(dims, layer_types=(GLOBAL,) * dims.num_layers)
    try:
        all_global = simulated_layer_outputs(loaded, rtn, ids)
    finally:
        loaded.adapter.dims = dims
    assert all(torch.equal(a, b) for a, b in zip(local_too, all_global))
    assert not torch.allclose(local_too[0], exact[0], atol=1e-3)
    assert torch.equal(simulated_layer_outputs(loaded, rtn, ids)[0], exact[0])  # the flag off: local exact again

    dims = model_dims("tiny-gemma3")  # local, local, global; window 8
    method = build_method("rtn", {"bits": 4})
    uniform = model_dims("tiny-qwen3")  # the same shapes, every layer global
    got = bits_per_element(method, dims, compress_local=True).bits_per_element
    want = (bits_per_element(method, uniform).bits_per_element / 3
            + bits_per_element(method, uniform, 7).bits_per_element * 7 / 4096 * 2 / 3)
    assert got == pytest.approx(want, rel=1e-12)
    assert got < bits_per_element(method, dims).bits_per_element  # 4-bit windows instead of fp16 ones

    env = dict(os.environ, COLUMNS="200")

    def kvcal(*args):
        return subprocess.run([sys.executable, "-m", "kvcal.cli", *map(str, args)], capture_output=True, text=True,
                              env=env, timeout=300)

    base = ["eval", "ppl", "--model", "tiny-gemma3", "--method", "rtn", "--set", "bits=2", "--dataset", text_file,
            "--nsamples", "1", "--seqlen", "24"]
    records = {}
    for flag in ([], ["--compress-local"]):
        out = tmp_path / f"r{len(flag)}.json"
        run = kvcal(*base, *flag, "--json", out)
        assert run.returncode == 0, run.stderr
        records[bool(flag)] = json.loads(out.read_text())
    on, off = records[True], records[False]
    assert on["compress_local"] is True and "compress_local" not in off and on["setting"].endswith("-compress-local")
    assert on["ppl"] != off["ppl"]
    assert on["bits_per_element"] == pytest.approx(
        bits_per_element(build_method("rtn", {"bits": 2}), dims, compress_local=True).bits_per_element, rel=1e-12)
    out = tmp_path / "decode.json"  # the packed cache compresses the windows too, as the simulation does
    run = kvcal(*base, "--compress-local", "--mode", "decode", "--json", out)
    assert run.returncode == 0, run.stderr
    assert json.loads(out.read_text())["ppl"] == pytest.approx(on["ppl"], rel=1e-4)
    for args, needle in ((["eval", "ppl", "--model", "tiny-llama", "--method", "rtn", "--dataset", text_file,
                           "--nsamples", "1", "--seqlen", "24", "--compress-local"], "tiny-llama has none"),):
        run = kvcal(*args)
        assert run.returncode == 2 and run.stderr.strip().startswith("error:") and needle in run.stderr
        assert "\n" not in run.stderr.strip(), run.stderr


@pytest.mark.parametrize("name", HYBRID)
def test_greedy_decoding_through_the_cache_of_a_hybrid_model(name):
    """kvcal generate / eval passkey's decode loop on a model whose first layer is local (a LosslessLayer, no kernels
    to ask for): greedy tokens through kvcal's cache (torch references, as on a CPU) equal transformers' generate on
    the same cache, and the cache says why its steps are not graph-captured."""
    from kvcal.methods import build_method
    from kvcal.models.adapter import cache_kwargs
    from kvcal.runtime.cache import KvcalCache
    from kvcal.runtime.graph import greedy_decode

    loaded = load_model(name)
    storages = build_method("rtn", {"bits": 4}).build_storages({}, loaded.dims)
    prompt = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    cache = KvcalCache(storages, loaded.dims.num_layers, backend="reference")
    ours = greedy_decode(loaded, cache, prompt, 6, None, "auto")
    assert type(cache.layers[0]).__name__ == "LosslessLayer"
    assert "synchronize with the host" in cache.graph_refusal()
    stock = loaded.model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=258,
                                  **cache_kwargs(loaded.model, KvcalCache(storages, loaded.dims.num_layers)))
    assert ours["tokens"][0].tolist() == stock[0, 20:].tolist()
