"""`kvcal recipes`, the names of changed settings, and artifacts that already exist."""

import pytest

from kvcal.errors import KvcalError
from kvcal.models.dims import model_dims
from kvcal.recipes import describe_recipes, recipe_names, resolve
from tests.test_cli import kvcal

SMOLLM2 = dict(family="llama", num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576)


def test_smollm2_dims_come_from_the_gguf_header_alone():
    dims = model_dims("smollm2-135m")
    assert {k: getattr(dims, k) for k in SMOLLM2} == SMOLLM2 and dims.rope.theta == 1e5  # DESIGN.md's numbers
    with pytest.raises(KvcalError, match="comes from the Hub"):
        model_dims("llama-3.1-8b")


@pytest.mark.slow
def test_header_dims_equal_the_loaded_models(smollm2):
    header = model_dims("smollm2-135m")
    assert {k: getattr(header, k) for k in SMOLLM2} == {k: getattr(smollm2.dims, k) for k in SMOLLM2}
    assert header.rope.theta == smollm2.dims.rope.theta


def test_recipes_table_bits_on_the_default_model():
    rows = {r["name"]: r for r in describe_recipes(model_dims("smollm2-135m"))}
    assert set(rows) == set(recipe_names()) and "ablations/calibquant-1bit-c1" in rows
    assert all(r["description"] and r["problem"] is None for r in rows.values())
    # by hand: fp16 is 16 bits; RTN-N stores N-bit codes plus an fp16 scale and zero per token and head of 64
    assert rows["fp16"]["bits_per_element"] == 16
    for bits in (2, 3, 4):
        assert rows[f"rtn-int{bits}"]["bits_per_element"] == pytest.approx(bits + 32 / 64, abs=1e-12)
    # KIVI-2, G 32, R 128 at 4096 tokens: 3968 tokens of 2-bit codes with an fp16 scale and zero per 32 elements
    # (keys per channel over 32 tokens, values per token over 32 channels), 128 tokens in fp16
    assert rows["kivi-2bit"]["bits_per_element"] == pytest.approx((3968 * 3 + 128 * 16) / 4096, abs=1e-12)
    assert rows["kvquant-nuq4-1pct"]["method"] == "kvquant"


def test_recipes_command_lists_every_recipe():
    result = kvcal("recipes")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "bits/elem on smollm2-135m" in lines[1]
    row = next(line for line in lines if line.startswith("│ rtn-int2 "))
    assert [c.strip() for c in row.split("│")[1:4]] == ["rtn-int2", "rtn", "2.500"]
    assert sum(line.startswith("│ ") for line in lines) == len(recipe_names())  # one row each
    other = kvcal("recipes", "--model", "tiny-llama")  # a recipe that does not fit a model says why
    assert other.returncode == 0 and "not on this model" in other.stdout


def test_a_broken_recipe_is_listed_as_broken_not_as_unfit(tmp_path, monkeypatch):
    """A recipe that does not load (bad YAML, a key its method does not have) is the recipe's fault: `broken`, while
    one that loads but does not fit the model is not."""
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes/bad-yaml.yaml").write_text("method: kivi\nconfig: [unclosed\n")
    (tmp_path / "recipes/bad-key.yaml").write_text("method: kivi\nconfig: {nonsense: 1}\n")
    monkeypatch.chdir(tmp_path)
    rows = {r["name"]: r for r in describe_recipes(model_dims("tiny-llama"))}
    assert rows["bad-yaml"]["broken"] and "not valid YAML" in rows["bad-yaml"]["problem"]
    assert rows["bad-key"]["broken"] and "nonsense" in rows["bad-key"]["problem"]
    unfit = [r for r in rows.values() if r["problem"] and not r["broken"]]
    assert unfit and all(r["name"] not in ("bad-yaml", "bad-key") for r in unfit)


def test_a_set_that_changes_the_config_changes_the_name():
    assert resolve(None, "xquant-svd-2bit", None)[1] == "svd-2bit"
    assert resolve(None, "xquant-svd-2bit", ["group_channels=32"])[1] == "svd-2bit-group_channels32"
    assert resolve(None, "xquant-svd-2bit", ["group_channels=64"])[1] == "svd-2bit"  # the recipe's own value
    assert resolve(None, "kivi-2bit", ["residual=0", "bits=3"])[1] == "2bit-bits3-residual0"  # config order
    # --method: the method's tag, plus what it does not show
    assert resolve("kivi", None, ["residual=0"])[1] == "2bit-g32-r0"
    assert resolve("xquant", None, ["group_channels=32"])[1] == "svd-4bit-group_channels32"
    assert resolve("kvquant", None, ["outliers=0.02"])[1] == "nuq4-2pct"  # the tag shows it: nothing added


def test_calibrate_names_a_changed_setting_and_says_when_it_replaces_an_artifact(tmp_path):
    args = ("calibrate", "--recipe", "rtn-int2", "--model", "tiny-llama", "--out-dir", tmp_path)
    first = kvcal(*args, "--set", "bits=3")
    assert first.returncode == 0, first.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["rtn-int2-bits3.safetensors"] and "note:" not in first.stderr
    again = kvcal(*args, "--set", "bits=3")
    assert again.returncode == 0, again.stderr
    assert f"note: {tmp_path / 'rtn-int2-bits3.safetensors'} exists and will be replaced" in again.stderr
    plain = kvcal(*args)
    assert plain.returncode == 0 and "note:" not in plain.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rtn-int2-bits3.safetensors", "rtn-int2.safetensors"]
