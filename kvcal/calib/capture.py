"""Capture per-layer pre-RoPE keys, values, queries, layer inputs X and Fisher information.

Fisher (KVQuant) = squared gradient of the LM loss w.r.t. the pre-RoPE keys and the values (the
k_proj / v_proj outputs, after Qwen3's k_norm), per element and per token, computed in the same
forward/backward pass as the activations so the two are aligned by construction. The loss of a
window is its mean next-token cross-entropy; windows of a batch are summed, so each window's
gradient is exactly its own.

Everything is stored per layer as rows of tokens, [N, C] float32 with N = windows x seqlen and
channels in projection-output order (channel = head * head_dim + d). The store keeps up to
`budget_bytes` in memory and spills further windows to safetensors files in a temporary folder, so
an 8B model's activations never need to fit in RAM at once; `store.layer(i)` reads one layer back.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from kvcal.calib.checkpoint import Checkpoints
from kvcal.eval.ppl import TailObjective
from kvcal.models.adapter import AttentionInputs, StandardAttention

CAPTURABLE = ("k", "v", "q", "x", "fisher")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B*T, H*D] (or [B, T, C] -> [B*T, C]) as float32 on the CPU."""
    if t.dim() == 4:
        t = t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)
    return t.detach().reshape(-1, t.shape[-1]).to("cpu", torch.float32)


class CaptureStore:
    def __init__(self, num_layers: int, budget_bytes: int = 4 << 30):
        self.num_layers = num_layers
        self.budget_bytes = budget_bytes
        self.memory: list[list[dict[str, torch.Tensor]]] = []  # chunk -> layer -> name -> rows
        self.spilled: list[Path] = []
        self.memory_bytes = 0
        self._spill_dir: Path | None = None
        self.positions: list[torch.Tensor] = []  # position of each token within its window
        self.windows: torch.Tensor | None = None  # the calibration windows [N, T] (capture and run_calibrations set it)
        # what a method scoring settings by perplexity runs on the windows (run_calibrations sets it:
        # kvcal.eval.ppl.TailObjective, CalibQuant's tau search)
        self.objective = None
        # where a method that trains keeps its checkpoints (run_calibrations sets the run's: kvcal/calib/checkpoint.py)
        self.checkpoints = Checkpoints.off()

    def add(self, per_layer: list[dict[str, torch.Tensor]], positions: torch.Tensor) -> None:
        nbytes = sum(t.numel() * 4 for layer in per_layer for t in layer.values())
        self.positions.append(positions.reshape(-1).cpu())
        # Once a chunk has spilled, all later ones spill too, so layer() reads chunks in order.
        if not self.spilled and self.memory_bytes + nbytes <= self.budget_bytes:
            self.memory.append(per_layer)
            self.memory_bytes += nbytes
            return
        if self._spill_dir is None:
            self._spill_dir = Path(tempfile.mkdtemp(prefix="kvcal-capture-"))
        path = self._spill_dir / f"chunk{len(self.spilled):05d}.safetensors"
        _write_chunk(per_layer, path)
        self.spilled.append(path)

    def save(self, folder: Path) -> None:
        """Persist the whole capture (for `--capture-cache`): chunk files plus token positions."""
        folder.mkdir(parents=True, exist_ok=True)
        for n, chunk in enumerate(self.memory):
            _write_chunk(chunk, folder / f"chunk{n:05d}.safetensors")
        for n, path in enumerate(self.spilled, start=len(self.memory)):
            shutil.copyfile(path, folder / f"chunk{n:05d}.safetensors")
        save_file({"positions": self.token_positions}, str(folder / "positions.safetensors"))

    @classmethod
    def load(cls, folder: Path, num_layers: int) -> CaptureStore:
        """A store over a saved capture; its files are read in place and never deleted."""
        store = cls(num_layers, budget_bytes=0)
        store.spilled = sorted(folder.glob("chunk*.safetensors"))
        with safe_open(str(folder / "positions.safetensors"), framework="pt") as f:
            store.positions = [f.get_tensor("positions")]
        return store

    @staticmethod
    def saved_needs(folder: Path, num_layers: int) -> tuple[set[str], str | None]:
        """What a saved capture holds (its needs.json) and None, or (set(), what makes it unusable): needs.json must be
        a JSON list of capturable names, every chunk must hold, for every layer, exactly the row names those needs
        produce (fisher: fisher_k and fisher_v), all with one row count per chunk, and the chunks' rows must add up to
        the saved token positions."""
        try:
            needs = json.loads((folder / "needs.json").read_text())
            if not isinstance(needs, list) or not set(needs) <= set(CAPTURABLE):
                return set(), "needs.json is not a list of capturable names"
            names = {n for need in needs for n in (("fisher_k", "fisher_v") if need == "fisher" else (need,))}
            expected = {f"{i}.{name}" for i in range(num_layers) for name in names}
            with safe_open(str(folder / "positions.safetensors"), framework="pt") as f:
                rows = f.get_slice("positions").get_shape()[0]
            chunks = sorted(folder.glob("chunk*.safetensors"))
            if not chunks:
                return set(), "no chunk files"
            held = 0
            for path in chunks:
                with safe_open(str(path), framework="pt") as f:
                    if set(f.keys()) != expected:
                        return set(), f"{path.name} does not hold {sorted(names)} for every layer"
                    counts = {f.get_slice(key).get_shape()[0] for key in expected}
                if len(counts) != 1:
                    return set(), f"{path.name} holds different row counts"
                held += counts.pop()
            if held != rows:
                return set(), f"the chunks hold {held} rows, the positions {rows}"
        except Exception as exc:  # noqa: BLE001 - any read failure means: capture again
            return set(), f"{type(exc).__name__}"
        return set(needs), None

    @property
    def token_positions(self) -> torch.Tensor:
        return torch.cat(self.positions)

    def layer(self, i: int, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """All captured rows of layer i: names k, v, q, x, fisher_k, fisher_v (those captured; `names`: only these,
        so that a stage reads back only what it uses)."""
        parts: dict[str, list[torch.Tensor]] = {}
        for chunk in self.memory:
            for name, t in chunk[i].items():
                if names is None or name in names:
                    parts.setdefault(name, []).append(t)
        for path in self.spilled:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    layer, name = key.split(".", 1)
                    if int(layer) == i and (names is None or name in names):
                        parts.setdefault(name, []).append(f.get_tensor(key))
        return {name: torch.cat(ts) for name, ts in parts.items()}

    def close(self) -> None:
        self.memory.clear()
        if self._spill_dir is not None:
            shutil.rmtree(self._spill_dir, ignore_errors=True)
            self._spill_dir = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _write_chunk(per_layer: list[dict[str, torch.Tensor]], path: Path) -> None:
    save_file({f"{i}.{name}": t.contiguous() for i, layer in enumerate(per_layer) for name, t in layer.items()}, str(path))


class CaptureAttention(StandardAttention):
    """Standard attention that records its inputs (and registers Fisher hooks) per layer."""

    def __init__(self, needs: set[str], num_layers: int):
        self.needs = needs
        self.records: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]

    def attend(self, inp: AttentionInputs) -> torch.Tensor:
        record = self.records[inp.layer_idx]
        for name, tensor in (("k", inp.k_pre), ("v", inp.v), ("q", inp.q), ("x", inp.x)):
            if name in self.needs:
                record[name] = _rows(tensor)
        if "fisher" in self.needs:
            inp.k_pre.register_hook(lambda g, r=record: r.__setitem__("fisher_k", _rows(g.float() ** 2)))
            inp.v.register_hook(lambda g, r=record: r.__setitem__("fisher_v", _rows(g.float() ** 2)))
        return super().attend(inp)


def window_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Sum over windows of each window's mean next-token cross-entropy."""
    pred = logits[:, :-1]
    if pred.dtype in (torch.float16, torch.bfloat16):
        pred = pred.float()
    targets = ids[:, 1:].to(logits.device)  # a split model's logits may come out on another device
    per_token = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), targets.reshape(-1), reduction="none")
    return per_token.view(ids.shape[0], -1).mean(dim=1).sum()


def capture(loaded, windows: torch.Tensor, needs, budget_bytes: int = 4 << 30, batch_size: int = 1,
            progress=None) -> CaptureStore:
    """Run the calibration windows [n, T] through the model and store what `needs` asks for."""
    needs = set(needs)
    unknown = needs - set(CAPTURABLE)
    if unknown:
        raise ValueError(f"cannot capture {sorted(unknown)}")
    model = loaded.model
    store = CaptureStore(loaded.dims.num_layers, budget_bytes)
    store.windows = windows
    store.objective = TailObjective(loaded)
    fisher = "fisher" in needs
    saved_grad = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():  # gradients flow to activations only, never accumulate on weights
        p.requires_grad_(False)
    try:
        for start in range(0, windows.shape[0], batch_size):
            ids = windows[start : start + batch_size].to(loaded.device)
            handler = CaptureAttention(needs, loaded.dims.num_layers)
            with loaded.adapter.use(handler), torch.set_grad_enabled(fisher):
                embeds = model.get_input_embeddings()(ids)
                if fisher:
                    embeds = embeds.detach().requires_grad_(True)
                logits = model(inputs_embeds=embeds, use_cache=False).logits
                if fisher:
                    window_loss(logits, ids).backward()
                del logits
            positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
            store.add(handler.records, positions)
            if progress is not None:
                progress(ids.shape[0])
    except BaseException:
        store.close()
        raise
    finally:
        for p, flag in zip(model.parameters(), saved_grad):
            p.requires_grad_(flag)
    return store
