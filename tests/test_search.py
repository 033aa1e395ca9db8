"""`kvcal search` (kvcal/search.py): the candidates that fit a budget are measured, the lowest perplexity is chosen,
the chosen artifact's `kvcal eval ppl` reproduces the search's number exactly, an interrupted search measures only
what it had not finished, and bad input is one line before the model loads."""

from __future__ import annotations

import json

import pytest

from kvcal import search
from kvcal.errors import KvcalError
from kvcal.models.dims import model_dims
from tests.test_cli import assert_one_line_error, kvcal

# on the tiny model's 16-channel heads and 128-token windows, the 2-bit settings with their overheads (per-channel
# ranges, scales) count 2.5 to 4.6 bits per element
ARGS = ["--model", "tiny-llama", "--bits", "4.6", "--methods", "kvquant,xquant,rtn", "--nsamples", "2", "--seqlen",
        "128", "--eval-nsamples", "2"]



@pytest.fixture(scope="module")
def searched(text_file):
    out = text_file.parent / "out"
    result = kvcal("search", *ARGS, "--dataset", text_file, "--out", out)
    assert result.returncode == 0, result.stderr
    return out, json.loads((out / "search.json").read_text()), result.stdout


def test_search_chooses_the_lowest_perplexity_and_eval_reproduces_it(searched, text_file, tmp_path):
    out, record, stdout = searched
    measured = [c for c in record["candidates"] if c["ppl"] is not None]
    assert {c["method"] for c in measured} == {"kvquant", "xquant", "rtn"}
    assert all(c["bits"] <= 4.6 for c in record["candidates"])
    best = min(measured, key=lambda c: (c["ppl"], c["bits"]))
    chosen = record["chosen"]
    assert chosen["recipe"] == best["recipe"] and "chosen: " + best["recipe"] in stdout
    fewest = min(measured, key=lambda c: (c["bits"], c["ppl"]))
    assert fewest["on_front"] and best["on_front"]  # the front starts at the fewest bits and ends at the lowest PPL
    # the chosen artifact, evaluated by `kvcal eval ppl` in a fresh process, gives the search's number exactly
    command = chosen["command"].split()
    assert command[:3] == ["kvcal", "eval", "ppl"]
    result = kvcal(*command[1:], "--json", tmp_path / "r.json")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "r.json").read_text())["ppl"] == chosen["ppl"]
    # every skipped recipe says why
    assert record["skipped"] and all(s["reason"] for s in record["skipped"])


def test_an_interrupted_search_measures_only_what_it_had_not_finished(text_file, tmp_path, monkeypatch):
    from kvcal.models import load_model

    loaded = load_model("tiny-llama")
    plan = search.Plan("tiny-llama", "float32", "cpu", str(text_file), None, 2, 128, 0, 2)
    budget = search.make_budget(loaded.dims, 4.6, None, None, 1, 128)
    candidates, skipped = search.list_candidates(loaded.dims, budget, plan, ["xquant", "rtn", "kvquant"], False, True)
    assert len(candidates) >= 3
    calls = []
    record = search.ppl_record

    def stopping(*args, **kwargs):
        calls.append(args[3])
        if len(calls) == 3:  # fp16, the first candidate, then Ctrl-C in the second
            raise KeyboardInterrupt
        return record(*args, **kwargs)

    monkeypatch.setattr(search, "ppl_record", stopping)
    with pytest.raises(KeyboardInterrupt):
        search.run_search(loaded, plan, budget, candidates, skipped, tmp_path)
    first = calls[1]
    calls.clear()
    monkeypatch.setattr(search, "ppl_record", lambda *a, **k: (calls.append(a[3]), record(*a, **k))[1])
    candidates, skipped = search.list_candidates(loaded.dims, budget, plan, ["xquant", "rtn", "kvquant"], False, True)
    result = search.run_search(loaded, plan, budget, candidates, skipped, tmp_path)
    assert first not in calls and "fp16" not in calls  # finished work is reused
    assert len(calls) == len(candidates) - 1
    status = {c["recipe"]: c["status"] for c in result["candidates"]}
    assert status[first] == "reused" and sorted(set(status.values())) == ["measured", "reused"]


def test_a_time_budget_stops_starting_candidates(text_file, tmp_path, monkeypatch):
    from kvcal.models import load_model

    loaded = load_model("tiny-llama")
    plan = search.Plan("tiny-llama", "float32", "cpu", str(text_file), None, 2, 128, 0, 2)
    budget = search.make_budget(loaded.dims, 4.6, None, None, 1, 128)
    candidates, skipped = search.list_candidates(loaded.dims, budget, plan, ["xquant", "rtn", "kvquant"], False, True)
    clock = iter(range(0, 1000, 10))  # each reading 10 s later
    monkeypatch.setattr(search.time, "monotonic", lambda: next(clock))
    result = search.run_search(loaded, plan, budget, candidates, skipped, tmp_path, time_budget=15)
    statuses = [c["status"] for c in result["candidates"]]
    assert statuses[0] == "measured" and set(statuses[1:]) == {"not started (time budget)"}
    assert result["covered"].startswith("1 of ")


def test_pareto_front_by_hand():
    rows = [{"recipe": "a", "bits": 2.0, "ppl": 30.0}, {"recipe": "b", "bits": 2.5, "ppl": 31.0},
            {"recipe": "c", "bits": 3.0, "ppl": 25.0}, {"recipe": "d", "bits": 1.0, "ppl": 40.0},
            {"recipe": "e", "bits": 3.0, "ppl": 25.0}]
    assert search.pareto_front(rows) == {"d", "a", "c"}


def test_a_memory_budget_in_bits_by_hand():
    dims = model_dims("tiny-llama")
    elements = 2 * 1000 * dims.num_layers * dims.num_kv_heads * dims.head_dim  # K and V of 1000 tokens
    budget = search.make_budget(dims, None, 1.0, 1000, 4, 2048)
    assert budget.bits == pytest.approx((1 << 30) * 8 / (elements * 4)) and budget.tokens == 1000
    assert search.make_budget(dims, 3.0, None, None, 1, 2048).tokens == 2048
    with pytest.raises(KvcalError, match="--memory needs --context"):
        search.make_budget(dims, None, 1.0, None, 1, 2048)
    with pytest.raises(KvcalError, match="give the budget"):
        search.make_budget(dims, 3.0, 1.0, 100, 1, 2048)


def test_gpu_calibrations_are_left_out_on_a_cpu_unless_named():
    dims = model_dims("tiny-llama")
    plan = search.Plan("tiny-llama", "float32", "cpu")
    budget = search.make_budget(dims, 16.0, None, None, 1, 2048)

    def names(methods, cpu):
        return {c.method.name for c in search.list_candidates(dims, budget, plan, methods, False, cpu)[0]}

    assert "commvq" not in names(None, True) and "commvq" in names(["commvq"], True)
    assert "commvq" in names(None, False)


@pytest.mark.parametrize("args, needle", [
    (["--bits", "0.01"], "no recipe fits 0.010 bits per element on tiny-llama (the fewest: "),
    (["--bits", "3", "--methods", "kivi,nope"], "unknown method 'nope' in --methods"),
    (["--bits", "3", "--time-budget", "soon"], "--time-budget must be a positive duration"),
    (["--memory", "1"], "--memory needs --context"),
    (["--bits", "3", "--protocol", "nope"], "unknown protocol 'nope'"),
])
def test_bad_input_is_one_line(args, needle, text_file):
    assert_one_line_error(kvcal("search", "--model", "tiny-llama", "--dataset", text_file, *args), needle)


def test_an_unwritable_out_is_one_line(text_file, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_one_line_error(kvcal("search", "--model", "tiny-llama", "--bits", "3", "--dataset", text_file, "--out",
                                blocker), "--out")


def test_nothing_fits_before_the_model_loads(monkeypatch):
    """The budget check runs on the shapes alone (model_dims): the error comes without loading the model."""
    dims = model_dims("smollm2-135m")
    plan = search.Plan("smollm2-135m", "float32", "cpu")
    budget = search.make_budget(dims, 0.01, None, None, 1, 2048)
    candidates, skipped = search.list_candidates(dims, budget, plan, None, False, True)
    assert candidates == [] and min(s.get("bits", 99) for s in skipped) > 0.01
