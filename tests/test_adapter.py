"""The adapter's attention forward against the stock transformers model (eager), for every family."""

import pytest
import torch

from kvcal.errors import KvcalError
from kvcal.models import ModelDims, load_model

FAMILIES = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"]


def stock_model(name):
    from kvcal.models.tiny import build_random_model, tiny_config

    # transformers' eager attention: an implementation independent of ours (we use SDPA)
    return build_random_model(tiny_config(name.removeprefix("tiny-")), torch.float32, "cpu", 0, "eager")


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
