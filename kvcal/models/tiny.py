"""Models built from a config in code: tiny random models for tests, and real shapes for benchmarks.

They need no download. Their tokenizer is a byte-level tokenizer (256 byte symbols plus bos/eos/pad)
so any text can be fed to them.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

BYTE_VOCAB = 256
SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")
TINY_VOCAB = BYTE_VOCAB + len(SPECIAL_TOKENS)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for raw bytes
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    for i, special in enumerate(SPECIAL_TOKENS):
        vocab[special] = BYTE_VOCAB + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", model_max_length=1 << 30
    )


def tiny_config(family: str):
    """Small but structurally faithful: GQA (4 query heads, 2 KV heads), head_dim 16, 2 layers."""
    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=BYTE_VOCAB,
        eos_token_id=BYTE_VOCAB + 1,
        pad_token_id=BYTE_VOCAB + 2,
        # Larger than HF's default 0.02 so attention is far from uniform and quantization error shows.
        initializer_range=0.1,
    )
    # a family's config class loads that family's transformers modules (~1 s): imported when it is asked for
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(rope_theta=10000.0, **common)
    if family == "mistral":
        from transformers import MistralConfig

        return MistralConfig(rope_theta=10000.0, sliding_window=None, **common)
    if family == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(rope_theta=1000000.0, use_sliding_window=False, **common)
    if family == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(rope_theta=1000000.0, use_sliding_window=False, **common)
    if family == "gemma2":  # sliding (window 8) and global layers alternate, scores soft-capped
        from transformers import Gemma2Config

        return Gemma2Config(rope_theta=10000.0, query_pre_attn_scalar=16, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=50.0,
                            final_logit_softcapping=30.0, **common)
    if family == "gemma3":  # q/k norm; local layers (window 8) with their own RoPE base; 2 local : 1 global
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
                                query_pre_attn_scalar=16, sliding_window=8,
                                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                **{**common, "num_hidden_layers": 3})
    if family == "olmo2":  # q/k norms over the whole projection (before the split into heads)
        from transformers import Olmo2Config

        return Olmo2Config(rope_theta=500000.0, **common)
    if family == "phi3":  # one fused qkv_proj
        from transformers import Phi3Config

        return Phi3Config(rope_theta=10000.0, sliding_window=None, **common)
    raise ValueError(family)


def llama31_8b_config():
    """Llama-3.1-8B's published config (for random-weight speed benchmarks; no download)."""
    from transformers import LlamaConfig  # lazy, as in tiny_config

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    )


def build_random_model(config, dtype: torch.dtype, device: str, seed: int = 0, attn_implementation: str = "sdpa"):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()
