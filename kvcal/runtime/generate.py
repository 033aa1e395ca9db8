"""What generating with a compressed cache needs of the runtime, whatever the method and the model: the cache's size
line (kvcal/generate.py builds the cache from an artifact or a recipe; kvcal.models.as_loaded wraps a transformers
model)."""

from __future__ import annotations

from kvcal.accounting import kv_elements


def first_compressed_length(policy) -> int:
    """The fewest tokens a row's cache holds before its policy compresses any (sinks, then the window, then a whole
    block; a bulk policy: a prompt one token longer than its sinks and window)."""
    return policy.sink + policy.residual + (1 if policy.bulk else policy.block)


def size_summary(name: str, storages, loaded, cache, tokens: int, predicted: float) -> str:
    """The cache's size line: the compressed part and the full-precision part (held in the model's dtype, float32 on a
    CPU: more than fp16 would take) apart, so a short sequence that sits wholly in the window is not read as a ratio."""
    dims = loaded.dims
    dtype = str(loaded.dtype).removeprefix("torch.")
    allocated, used = cache.nbytes()
    held = cache.held()
    fp16 = 2 * kv_elements(dims, tokens)

    def mib(nbytes) -> str:
        return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"

    def ratio(reference, nbytes) -> str:
        r = reference / max(nbytes, 1)
        return f"{r:.1f}x smaller" if r >= 1 else f"{1 / r:.1f}x larger"

    if storages.lossless:
        return f"{name}: no compression: {tokens} tokens in {mib(used)} ({dtype} K/V; fp16 would take {mib(fp16)})"
    if held["compressed_tokens"] == 0:
        policy = storages.policy
        if policy.bulk:
            when = (f"compresses a prompt's tokens past its {policy.sink} sinks and newest {policy.residual} (a prompt "
                    f"of {first_compressed_length(policy)} tokens or more)")
        else:
            when = (f"compresses once {first_compressed_length(policy)} tokens are cached (sinks {policy.sink}, window "
                    f"{policy.residual}, blocks of {policy.block})")
        return (f"{name}: nothing compressed yet: all {tokens} tokens are in the full-precision part ({mib(used)} in "
                f"{dtype}; fp16 would take {mib(fp16)}); {name} {when}")
    n_c, n_fp = held["compressed_tokens"], held["fp_tokens"]
    if not storages[0].holds_format:
        return (f"{name}: an ablation held as its reconstruction (float64, not the format's bytes): {n_c} tokens "
                f"compressed, {n_fp} in the full-precision part; the format takes {predicted:.2f} bits/element "
                f"(accounting) vs fp16 {mib(fp16)}")
    c_bytes = held["compressed_bytes"]
    c_bits = 8 * c_bytes / kv_elements(dims, n_c)
    measured = 8 * used / kv_elements(dims, tokens)
    return (f"{name} ({dtype}): compressed part {n_c} tokens in {mib(c_bytes)} ({c_bits:.2f} bits/element, "
            f"{ratio(2 * kv_elements(dims, n_c), c_bytes)} than fp16); full-precision part {n_fp} tokens "
            f"in {mib(held['fp_bytes'])} ({dtype}); whole cache {mib(used)} for {tokens} tokens ({measured:.2f} "
            f"bits/element; accounting predicts {predicted:.2f}, fp16 slots counted as fp16; {mib(allocated)} "
            f"allocated) vs fp16 {mib(fp16)}: {ratio(fp16, used)}")
