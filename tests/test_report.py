"""`kvcal report`: each row is compared only with the fp16 record of the same model, dataset, protocol, seqlen and
windows; docs/results.md is generated from the records that results/tables.yaml names."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcal.cli import app
from kvcal.errors import KvcalError
from kvcal.eval.report import (
    load_manifest,
    markdown_table,
    pareto_points,
    read_passkey_record,
    read_record,
    render_docs,
    write_docs,
)


def record(method, ppl, nsamples, protocol="gptq", seqlen=2048, model="smollm2-135m", fp_window=0, setting=None):
    return {"setting": setting or f"{method}-{nsamples}", "method": method, "ppl": ppl,
            "bits_per_element": 16.0 if method == "fp16" else 2.5, "protocol": protocol, "nsamples": nsamples,
            "seqlen": seqlen, "model": {"name": model}, "dataset": {"dataset": "wikitext2", "split": "wiki.test.raw"},
            "device": "cpu", "fp_window": fp_window}


def rows_of(table: str) -> list[str]:
    return [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| setting")]


def deltas(records):
    return {r.split(" | ")[0].lstrip("| "): r.split(" | ")[3] for r in rows_of(markdown_table(records))}


def test_rows_compare_with_the_matching_fp16_record_only():
    records = [record("fp16", 20.0, 8), record("fp16", 25.0, 16), record("kivi", 30.0, 16), record("kivi", 22.0, 8),
               record("rtn", 40.0, 16, protocol="prefill-decode"), record("rtn", 50.0, 16, seqlen=1024)]
    got = deltas(records)
    assert got["fp16-8"] == "+0.0%" and got["fp16-16"] == "+0.0%"  # not +25% against the 8-window fp16
    assert got["kivi-16"] == "+20.0%"  # 30 / 25
    assert got["kivi-8"] == "+10.0%"  # 22 / 20
    rtn = [line for line in rows_of(markdown_table(records)) if line.startswith("| rtn-16")]
    assert [line.split(" | ")[3] for line in rtn] == ["", ""]  # no fp16 of that protocol or seqlen: no comparison
    # nor of that model or dataset: the same windows of another model or text are not compared with this fp16
    other_text = {**record("kivi", 30.0, 16, setting="kivi-shakespeare"),
                  "dataset": {"dataset": "shakespeare", "split": "tragedies"}}
    got = deltas([*records, record("kivi", 30.0, 16, model="qwen2.5-coder-0.5b", setting="kivi-qwen"), other_text])
    assert got["kivi-qwen"] == "" and got["kivi-shakespeare"] == "" and got["kivi-16"] == "+20.0%"


def test_rows_of_two_allowances_are_never_in_one_table():
    """Strict and windowed rows of the same windows form two tables, each headed by the one fp16 record; a record
    written before `fp_window` existed is placed by its method's own window (KIVI's residual)."""
    old_kivi = {**record("kivi", 26.0, 16, setting="kivi-old"), "config": {"bits": 2, "residual": 128}}
    del old_kivi["fp_window"]
    records = [record("fp16", 20.0, 16), record("rtn", 40.0, 16, setting="rtn-fp0"),
               record("rtn", 30.0, 16, fp_window=128, setting="rtn-fp128"),
               record("kivi", 25.0, 16, fp_window=128, setting="kivi-fp128"), old_kivi]
    tables = markdown_table(records).split("\n\n**")
    assert len(tables) == 2
    strict, windowed = ([r.split(" | ")[0].lstrip("| ") for r in rows_of(t)] for t in tables)
    assert strict == ["fp16-16", "rtn-fp0"] and "--fp-window 0" in tables[0]
    assert windowed == ["fp16-16", "rtn-fp128", "kivi-fp128", "kivi-old"] and "--fp-window 128" in tables[1]
    assert deltas(records)["rtn-fp128"] == "+50.0%"


def test_plot_of_given_records_draws_one_front_per_allowance(tmp_path):
    """`kvcal report --plot` with records draws those (from any folder: no manifest needed); records of another
    protocol than the fp16 record's are refused in one line."""
    pytest.importorskip("matplotlib")
    from kvcal.eval.report import record_points

    records = [record("fp16", 20.0, 16), record("rtn", 40.0, 16, setting="rtn-fp0"),
               record("rtn", 30.0, 16, fp_window=128, setting="rtn-fp128")]
    reference, points, _ = record_points(records)
    assert {p["label"]: p["group"] for p in points} == {"rtn-fp0": "--fp-window 0", "rtn-fp128": "--fp-window 128"}
    paths = []
    for i, r in enumerate(records):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(r))
    out = tmp_path / "chart.png"
    result = CliRunner().invoke(app, ["report", "--plot", str(out), *map(str, paths)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(KvcalError, match="rtn-tail not of the fp16 record's") as err:
        record_points(records + [record("rtn", 30.0, 16, protocol="tail", setting="rtn-tail")])
    assert "\n" not in str(err.value)


# docs/results.md from results/tables.yaml and the records it names

ROOT = Path(__file__).resolve().parent.parent


def test_committed_results_page_is_what_the_records_give():
    """Fails when docs/results.md differs from what `kvcal report --docs` generates from the committed records (a
    table or a number edited by hand, or a record changed without regenerating)."""
    assert write_docs(ROOT / "results/tables.yaml", check=True) == []


def test_every_plot_point_matches_the_reference_protocol():
    """The committed chart: every point of the reference's model, dataset, protocol and windows, every method under
    both allowances (one front each), the increase over fp16 as the records give it."""
    reference, points = pareto_points(load_manifest(ROOT / "results/tables.yaml"), ROOT)
    assert reference["method"] == "fp16" and len(points) >= 20
    assert {p["method"] for p in points} >= {"RTN", "KIVI", "KVQuant", "SKVQ", "XQuant", "CommVQ", "evict"}
    assert {p["group"] for p in points} == {"--fp-window 0", "--fp-window 128"}
    kivi2 = next(p for p in points if p["label"] == "kivi-2bit" and p["group"] == "--fp-window 128")
    record = json.loads((ROOT / "results/equal-footing/smollm2-135m/gptq-kivi-2bit-fp128.json").read_text())
    assert kivi2["increase"] == pytest.approx(100 * (record["ppl"] / reference["ppl"] - 1))


MANIFEST = """
docs:
- path: docs/page.md
  blocks:
  - text: "fp16 is {{results/fp16.json ppl .2f}}."
  - table:
      title: T
      columns: [setting, PPL, vs fp16, bits/elem, us]
      cells: [label, ppl, vs_ref, bits, us]
      ref: results/fp16.json
      rows:
      - {rec: results/fp16.json, label: fp16, us: ""}
      - {rec: results/q.json, label: q, cells: {us: {rec: results/bench.json, at: [rows, {method: q, batch: 8}, us],
         fmt: "{v:.1f} ({r[speedup]:.2f}x)"}}}
"""


def tiny_checkout(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "results/tables.yaml").write_text(MANIFEST)
    (tmp_path / "results/fp16.json").write_text(json.dumps({"ppl": 20.0, "bits_per_element": 16.0}))
    (tmp_path / "results/q.json").write_text(json.dumps({"ppl": 25.0, "bits_per_element": 2.5}))
    (tmp_path / "results/bench.json").write_text(json.dumps({"rows": [
        {"method": "q", "batch": 1, "us": 9.0, "speedup": 1.5}, {"method": "q", "batch": 8, "us": 40.25, "speedup": 3.0}]}))
    return tmp_path / "results/tables.yaml"


def test_page_from_a_manifest_and_check_fails_after_a_record_changes(tmp_path):
    manifest = tiny_checkout(tmp_path)
    assert write_docs(manifest) == ["docs/page.md"]
    assert (tmp_path / "docs/page.md").read_text() == (
        "fp16 is 20.00.\n\n## T\n\n| setting | PPL | vs fp16 | bits/elem | us |\n|---|---|---|---|---|\n"
        "| fp16 | 20.000 | +0.0% | 16.00 |  |\n| q | 25.000 | +25.0% | 2.50 | 40.2 (3.00x) |\n")
    runner = CliRunner()
    assert runner.invoke(app, ["report", "--check", "--manifest", str(manifest)]).exit_code == 0
    (tmp_path / "results/q.json").write_text(json.dumps({"ppl": 25.5, "bits_per_element": 2.5}))
    result = runner.invoke(app, ["report", "--check", "--manifest", str(manifest)])
    assert result.exit_code == 1 and "docs/page.md differs from its records" in result.output
    assert "25.000" in (tmp_path / "docs/page.md").read_text()  # --check writes nothing


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.replace("batch: 8}", "batch: 2}"), "0 elements match"),
    (lambda m: m.replace("results/q.json", "results/missing.json"), "record results/missing.json does not exist"),
    (lambda m: m.replace("{{results/fp16.json ppl .2f}}", "{{results/fp16.json nll .2f}}"), "no 'nll'"),
    (lambda m: m.replace("bits, us]", "bits, ns]"), "row has no 'ns'"),
])
def test_manifest_errors_are_one_line(tmp_path, edit, message):
    manifest = tiny_checkout(tmp_path)
    manifest.write_text(edit(MANIFEST))
    with pytest.raises(KvcalError, match=message) as err:
        render_docs(load_manifest(manifest), tmp_path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("manifest, message", [
    ("docs:\n- path: docs/page.md\n", "page 1: needs a 'path' and a 'blocks' list"),
    ("docs:\n- path: docs/page.md\n  blocks:\n  - table: {rows: []}\n",
     "block 1: needs a 'text' or a 'table' with 'columns' and 'rows' lists"),
    ("docs:\n- path: docs/page.md\n  blocks:\n  - 3\n", "block 1: needs a 'text' or a 'table'"),
])
def test_a_manifest_missing_its_parts_is_a_one_line_error(tmp_path, manifest, message):
    path = tmp_path / "tables.yaml"
    path.write_text(manifest)
    with pytest.raises(KvcalError, match=message) as err:
        load_manifest(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change, message", [
    ({"ppl": 0}, "perplexity 0: not above 0"),
    ({"ppl": -5.0}, "perplexity -5.0: not above 0"),
    ({"model": ["smollm2-135m"]}, "'model' is a JSON list"),
    ({"dataset": 3}, "'dataset' is a JSON int"),
])
def test_records_with_impossible_values_are_refused(tmp_path, change, message):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({**record("kivi", 25.0, 4), **change}))
    with pytest.raises(KvcalError, match=message):
        read_record(path)


def test_a_model_or_dataset_given_by_name_reads_as_that_name(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({**record("kivi", 25.0, 4), "model": "smollm2-135m", "dataset": "wikitext2"}))
    got = read_record(path)
    assert got["model"] == {"name": "smollm2-135m"} and got["dataset"] == {"dataset": "wikitext2"}
    assert markdown_table([got]).count("| kivi-4 |") == 1


@pytest.mark.parametrize("change, message", [
    ({"lengths": []}, "without its lengths, depths and cells"),
    ({"cells": [{"length": 64, "depth": 0}]}, "cells lack a length, depth or accuracy"),
    ({"setting": None}, "without its setting, mode or model"),
])
def test_passkey_records_without_their_grid_are_refused(tmp_path, change, message):
    good = {"kind": "passkey", "setting": "fp16", "mode": "simulate", "model": {"name": "tiny-llama"},
            "lengths": [64], "depths": [0], "cells": [{"length": 64, "depth": 0, "accuracy": 1.0}]}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(good))
    assert read_passkey_record(path) == good
    path.write_text(json.dumps({**good, **change}))
    with pytest.raises(KvcalError, match=message):
        read_passkey_record(path)


def test_manifest_without_docs_check_or_plot_is_refused(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record("kivi", 25.0, 4)))
    result = CliRunner().invoke(app, ["report", str(path), "--manifest", str(tmp_path / "none.yaml")])
    assert isinstance(result.exception, KvcalError)
    assert str(result.exception).startswith("--manifest applies to --docs, --check and --plot")


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "pareto.png"
    result = CliRunner().invoke(app, ["report", "--plot", str(out), "--manifest", str(ROOT / "results/tables.yaml")])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bits_at_the_window_length_by_hand():
    """An eviction budget of 256 tokens is 1 bit per element at the 4096-token reference but 2 at 2048-token windows:
    the report computes it from the record's config and model shapes when the record does not carry it."""
    from kvcal.eval.report import bits_at_seqlen

    model = {"family": "llama", "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
             "hidden_size": 64, "rope": {"head_dim": 16, "theta": 10000.0}}
    evict = {**record("evict", 30.0, 16), "config": {"sink": 4, "window": 252}, "model": model}
    assert bits_at_seqlen(evict) == pytest.approx(2.0)
    assert bits_at_seqlen({**evict, "seqlen": 4096}) == pytest.approx(1.0)
    assert bits_at_seqlen({**evict, "bits_at_seqlen": 3.5}) == 3.5
    assert bits_at_seqlen({**evict, "config": {"no_such_key": 1}}) is None
