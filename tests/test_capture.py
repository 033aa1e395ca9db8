"""Captured activations and Fisher information against a direct autograd computation."""

import pytest
import torch

from kvcal.calib.capture import capture
from kvcal.models import load_model
from kvcal.models.adapter import StandardAttention


class Retain(StandardAttention):
    """Keeps the pre-RoPE keys/values of every layer with .grad retained."""

    def __init__(self):
        self.k, self.v = {}, {}

    def attend(self, inp):
        inp.k_pre.retain_grad()
        inp.v.retain_grad()
        self.k[inp.layer_idx], self.v[inp.layer_idx] = inp.k_pre, inp.v
        return super().attend(inp)


def rows(t):  # [1, H, T, D] -> [T, H*D]
    return t.detach()[0].transpose(0, 1).reshape(t.shape[2], -1)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen2"])
@pytest.mark.parametrize("budget", [1 << 30, 0])  # all in memory / everything spilled to disk
def test_capture_and_fisher_match_autograd(name, budget):
    loaded = load_model(name)
    windows = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(0))
    with capture(loaded, windows, {"k", "v", "q", "x", "fisher"}, budget_bytes=budget, batch_size=2) as store:
        assert (len(store.spilled) > 0) == (budget == 0)
        layer = store.layer(1)
        only = store.layer(1, ("k", "fisher_k"))  # a stage reads back only what it names, the same rows
        positions = store.token_positions
    assert set(only) == {"k", "fisher_k"}
    torch.testing.assert_close(only["k"], layer["k"], rtol=0, atol=0)
    assert layer["k"].shape == (72, loaded.dims.kv_channels)
    assert layer["q"].shape == (72, loaded.dims.num_heads * loaded.dims.head_dim)
    assert layer["x"].shape == (72, loaded.dims.hidden_size)
    assert positions.tolist() == list(range(24)) * 3
    # direct computation for each window alone: HF's mean next-token loss, autograd on k/v. Windows 0 and 1 share a
    # batch (batch_size=2), window 2 is alone in its own: each window's Fisher is its own loss's, whatever it shares.
    for w in range(3):
        handler = Retain()
        ids = windows[w:w + 1]
        with loaded.adapter.use(handler):
            loss = loaded.model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        sl = slice(24 * w, 24 * (w + 1))
        torch.testing.assert_close(layer["k"][sl], rows(handler.k[1]))
        torch.testing.assert_close(layer["v"][sl], rows(handler.v[1]))
        torch.testing.assert_close(layer["fisher_k"][sl], rows(handler.k[1].grad) ** 2, rtol=1e-4, atol=1e-14)
        torch.testing.assert_close(layer["fisher_v"][sl], rows(handler.v[1].grad) ** 2, rtol=1e-4, atol=1e-14)
    assert layer["fisher_k"].abs().sum() > 0
    # x and q from the model itself, not from the adapter: x is layer 1's input after its input norm (the hidden
    # state transformers returns for layer 1), q its q_proj (and q_norm, Qwen3) before RoPE
    block = loaded.model.model.layers[1]
    with torch.no_grad():
        hidden = loaded.model(ids, output_hidden_states=True, use_cache=False).hidden_states[1][0]
        x = block.input_layernorm(hidden)
        q = block.self_attn.q_proj(x).view(24, loaded.dims.num_heads, loaded.dims.head_dim)
        if hasattr(block.self_attn, "q_norm"):
            q = block.self_attn.q_norm(q)
    torch.testing.assert_close(layer["x"][sl], x)
    torch.testing.assert_close(layer["q"][sl], q.reshape(24, -1))


def test_fisher_against_finite_differences():
    """d loss / d k_pre for one element, by central differences on that element.

    transformers' RMSNorm computes in float32 even for a float64 model, so the step must be large
    enough to dominate float32 rounding (1e-3) and the tolerance loose (2%): this checks the scaling of
    the Fisher (per-window mean loss), the exact values are checked against autograd above.
    """
    loaded = load_model("tiny-llama")
    model = loaded.model.double()
    loaded.adapter.inv_freq = loaded.adapter.inv_freq.double()
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    with capture(loaded, ids, {"fisher"}) as store:
        fisher = store.layer(0)["fisher_k"]
    token, channel, eps = 9, 5, 1e-3
    head, d = divmod(channel, loaded.dims.head_dim)

    class Nudge(StandardAttention):
        def __init__(self, delta):
            self.delta = delta

        def attend(self, inp):
            if inp.layer_idx == 0:
                k = inp.k_pre.clone()
                k[0, head, token, d] += self.delta
                inp.k_pre = k
            return super().attend(inp)

    losses = []
    for delta in (eps, -eps):
        with loaded.adapter.use(Nudge(delta)), torch.no_grad():
            logits = model(ids, use_cache=False).logits  # float64 end to end
            losses.append(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item())
    grad = (losses[0] - losses[1]) / (2 * eps)
    assert fisher[token, channel].item() == pytest.approx(grad**2, rel=2e-2)
    assert grad != 0


def test_capture_cache_is_reused_and_extended(tmp_path):
    from kvcal.calib.run import cached_capture

    loaded = load_model("tiny-llama")
    windows = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    first = cached_capture(loaded, windows, {"k"}, 1 << 30, 1, tmp_path)
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    stamp = (folder / "positions.safetensors").stat().st_mtime_ns
    again = cached_capture(loaded, windows, {"k"}, 1 << 30, 1, tmp_path)
    assert (folder / "positions.safetensors").stat().st_mtime_ns == stamp  # read back, not recaptured
    torch.testing.assert_close(again.layer(1)["k"], first.layer(1)["k"], rtol=0, atol=0)
    assert torch.equal(again.token_positions, first.token_positions)
    wider = cached_capture(loaded, windows, {"v"}, 1 << 30, 1, tmp_path)  # not cached yet: union captured
    assert {"k", "v"} <= set(wider.layer(0))
    assert set(cached_capture(loaded, windows, {"k", "v"}, 1 << 30, 1, tmp_path).layer(0)) == {"k", "v"}
    other = cached_capture(loaded, windows[:1], {"k"}, 1 << 30, 1, tmp_path)  # other windows: another entry
    assert other.layer(0)["k"].shape[0] == 16 and len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


@pytest.mark.parametrize("damage", ["garbage_chunk", "missing_chunk", "needs_not_a_list", "missing_layer", "missing_name",
                                    "short_rows"])
def test_a_broken_capture_cache_is_captured_again(tmp_path, damage):
    """A saved capture that does not read back whole (a full disk, a hand edit) is reported and replaced by a new
    capture, with the same rows as a fresh one, never a crash deep in calibration."""
    from safetensors.torch import load_file, save_file

    from kvcal.calib.capture import CaptureStore
    from kvcal.calib.run import cached_capture

    loaded = load_model("tiny-llama")
    windows = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    fresh = cached_capture(loaded, windows, {"k", "v"}, 1 << 30, 1, tmp_path).layer(1)["k"]
    (folder,) = tmp_path.iterdir()
    assert CaptureStore.saved_needs(folder, loaded.dims.num_layers) == ({"k", "v"}, None)
    chunk = sorted(folder.glob("chunk*.safetensors"))[0]
    if damage == "garbage_chunk":
        chunk.write_bytes(b"not safetensors")
    elif damage == "missing_chunk":
        chunk.unlink()
    elif damage == "needs_not_a_list":
        (folder / "needs.json").write_text('{"k": 1}')
    elif damage == "missing_layer":
        save_file({k: t for k, t in load_file(str(chunk)).items() if not k.startswith("1.")}, str(chunk))
    elif damage == "missing_name":  # what needs.json promises is not there: calibration would fail on a KeyError
        save_file({k: t for k, t in load_file(str(chunk)).items() if not k.endswith(".v")}, str(chunk))
    else:
        save_file({k: t[:5] if k == "1.k" else t for k, t in load_file(str(chunk)).items()}, str(chunk))
    assert CaptureStore.saved_needs(folder, loaded.dims.num_layers)[1] is not None
    again = cached_capture(loaded, windows, {"k", "v"}, 1 << 30, 1, tmp_path)
    torch.testing.assert_close(again.layer(1)["k"], fresh)
    assert CaptureStore.saved_needs(folder, loaded.dims.num_layers)[1] is None  # replaced by the new capture
