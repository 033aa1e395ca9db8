"""`kvcal search` (kvcal/search.py): the candidates that fit a budget are measured, the lowest perplexity is chosen,
the chosen artifact's `kvcal eval ppl` reproduces the search's number exactly, an interrupted search measures only
what it had not finished, and bad input is one line before the model loads. With --passkey: each candidate's passkey
record equals `kvcal eval passkey` on its artifact, a new grid re-runs only the grid, an interrupted search re-runs
no finished grid, and --min-passkey leaves out the candidates below it. With --speed (a GPU; faked here): tokens/s
records per candidate, reused on a re-run, and the speed front."""

from __future__ import annotations

import json
import shutil

import pytest

from kvcal import search
from kvcal.errors import KvcalError
from kvcal.models.dims import model_dims
from tests.test_cli import assert_one_line_error, kvcal

# on the tiny model's 16-channel heads and 128-token windows, the 2-bit settings with their overheads (per-channel
# ranges, scales) count 2.5 to 4.6 bits per element
ARGS = ["--model", "tiny-llama", "--bits", "4.6", "--methods", "kvquant,xquant,rtn", "--nsamples", "2", "--seqlen",
        "128", "--eval-nsamples", "2"]
# a small passkey grid the tiny model's tokenizer holds (its prompts need 245 tokens at least)
GRID = ["--passkey", "--passkey-lengths", "256", "--passkey-depths", "0", "--passkey-depths", "100",
        "--passkey-trials", "1"]

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
    with pytest.raises(KvcalError, match="--batch applies to --memory"):  # a --bits budget holds no rows
        search.make_budget(dims, 3.0, None, None, 0, 2048)


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
    # what fits but is left out on a CPU is said as such, not as "no recipe fits"
    (["--bits", "1.7", "--device", "cpu"], "no recipe is searched at 1.700 bits per element on tiny-llama: "
                                           "commvq-1bit fits but commvq calibrates for hours on a CPU"),
    (["--bits", "3", "--plot", "front.txt"], "--plot front.txt: name a .png, .pdf, .svg file"),
    (["--bits", "3", "--capture-budget-gb", "nan"], "--capture-budget-gb must be a positive number, got nan"),
    (["--bits", "3", "--seed", "-1"], "--seed must be >= 0, got -1"),
])
def test_bad_input_is_one_line(args, needle, text_file):
    assert_one_line_error(kvcal("search", "--model", "tiny-llama", "--dataset", text_file, *args), needle)


def test_generated_tokens_past_the_context_are_refused_by_their_flag(tiny):
    """Without --passkey-lengths the grid's length is the context less the generated tokens: when those leave no
    prompt, the error names --passkey-max-new-tokens, not a length the user did not give."""
    grid = search.PasskeyGrid(max_new_tokens=100000)
    with pytest.raises(KvcalError, match="^--passkey-max-new-tokens 100000 leaves no prompt within tiny-llama's"):
        search.fit_passkey_grid(tiny, grid, 64)
    assert search.fit_passkey_grid(tiny, search.PasskeyGrid(), 512).lengths == [512]


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


def test_a_model_whose_shapes_need_loading_is_planned_after_the_load(text_file, monkeypatch):
    """A model whose shapes model_dims cannot read without loading it (a GGUF in parts, such as
    qwen2.5-coder-0.5b's, or a Hub config) is planned once it is loaded: the search goes on to its budget check."""
    from typer.testing import CliRunner

    import kvcal.models
    import kvcal.models.dims as dims_module
    from kvcal.cli import app

    def parts(name):
        raise dims_module.DimsNeedTheModel(f"{name} is one GGUF file in 6 parts, whose dims are not read without "
                                           "joining them")

    loads = []
    real = kvcal.models.load_model
    monkeypatch.setattr(dims_module, "model_dims", parts)
    monkeypatch.setattr(kvcal.models, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    result = CliRunner().invoke(app, ["search", "--model", "tiny-llama", "--bits", "0.01", "--dataset", str(text_file),
                                      "--device", "cpu"])
    assert result.exit_code != 0 and loads and loads[0][0] == "tiny-llama"
    assert "no recipe fits 0.010 bits per element on tiny-llama" in str(result.exception), result.output


@pytest.fixture(scope="module")
def passkey_searched(searched, text_file, tmp_path_factory):
    """The search of `searched` run again on a copy of its folder, with a passkey grid: only the grid runs."""
    out = tmp_path_factory.mktemp("passkey") / "out"
    shutil.copytree(searched[0], out)
    stamps = {p: p.stat().st_mtime_ns for p in (out / "candidates").glob("*/*")
              if p.suffix in (".json", ".safetensors")}
    result = kvcal("search", *ARGS, *GRID, "--dataset", text_file, "--out", out)
    assert result.returncode == 0, result.stderr
    return out, json.loads((out / "search.json").read_text()), result.stdout, stamps


def test_a_passkey_grid_on_a_finished_search_runs_only_the_grid(passkey_searched):
    out, record, stdout, stamps = passkey_searched
    assert {c["status"] for c in record["candidates"]} == {"reused"}
    assert {c["passkey_status"] for c in record["candidates"]} == {"measured"}
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())  # no artifact or ppl record rewritten
    assert record["passkey"] == {"lengths": [256], "depths": [0, 100], "trials": 1, "seed": 0, "mode": "simulate",
                                 "max_new_tokens": 8, "backend": "packed", "min_accuracy": None}
    assert record["rule"] == search.RULE
    header = next(line for line in stdout.splitlines() if "recipe" in line and "method" in line)
    assert "passkey" in header and f"passkey {record['fp16']['passkey_accuracy']:.2f})" in stdout


def test_passkey_accuracy_equals_eval_passkey_on_the_artifact(passkey_searched, tmp_path):
    """search.json holds each record's accuracy, and the record's `kvcal eval passkey` command, in a fresh process,
    gives the same trials: every output and the accuracy."""
    out, record, stdout, _ = passkey_searched
    rows = [record["fp16"], *record["candidates"]]
    for row in rows:
        stored = json.loads(open(row["passkey_record"]).read())
        assert row["passkey_accuracy"] == stored["accuracy"]
        assert stored["cells"] and len(stored["cells"]) == 2 and stored["mode"] == "simulate"
        assert row["passkey_record"].startswith(str(out / "candidates"))
    chosen = record["chosen"]
    assert f"passkey {chosen['passkey_accuracy']:.2f}" in stdout
    stored = json.loads(open(chosen["passkey_record"]).read())
    command = stored["command"].split()
    assert command[:3] == ["kvcal", "eval", "passkey"]
    result = kvcal(*command[1:], "--json", tmp_path / "p.json")
    assert result.returncode == 0, result.stderr
    fresh = json.loads((tmp_path / "p.json").read_text())
    assert fresh["accuracy"] == chosen["passkey_accuracy"]
    assert [r["output"] for c in fresh["cells"] for r in c["results"]] == \
        [r["output"] for c in stored["cells"] for r in c["results"]]
    outputs = {json.loads(open(r["passkey_record"]).read())["cells"][0]["results"][0]["output"] for r in rows}
    assert len(outputs) > 1  # the settings answer differently: the records are each candidate's own


def test_min_passkey_leaves_out_candidates_below_it(passkey_searched, text_file):
    """On the random tiny model no candidate retrieves a key: --min-passkey 0.5 chooses none (an error naming the
    highest), --min-passkey 0 chooses the lowest perplexity; both reuse every record and state the rule."""
    out, record, _, _ = passkey_searched
    text = text_file
    assert all(c["passkey_accuracy"] == 0 for c in record["candidates"])
    result = kvcal("search", *ARGS, *GRID, "--min-passkey", "0.5", "--dataset", text, "--out", out)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert last.startswith("error: no measured candidate reaches --min-passkey 0.5 (the highest: "), last
    refused = json.loads((out / "search.json").read_text())
    assert refused["chosen"] is None and refused["passkey"]["min_accuracy"] == 0.5
    assert "passkey accuracy (mean over the grid) is at least 0.5" in refused["rule"]
    assert {c["passkey_status"] for c in refused["candidates"]} == {"reused"}
    result = kvcal("search", *ARGS, *GRID, "--min-passkey", "0", "--dataset", text, "--out", out)
    assert result.returncode == 0, result.stderr
    accepted = json.loads((out / "search.json").read_text())
    assert accepted["chosen"]["recipe"] == record["chosen"]["recipe"] and "at least 0.0" in accepted["rule"]


def test_an_interrupted_passkey_search_reruns_no_finished_grid(text_file, tmp_path, monkeypatch):
    from kvcal.models import load_model

    loaded = load_model("tiny-llama")
    plan = search.Plan("tiny-llama", "float32", "cpu", str(text_file), None, 2, 128, 0, 2)
    budget = search.make_budget(loaded.dims, 4.6, None, None, 1, 128)
    grid = search.PasskeyGrid([256], [50], 1)

    def listed():
        candidates, skipped = search.list_candidates(loaded.dims, budget, plan, ["xquant", "rtn"], False, True)
        assert len(candidates) == 2
        return candidates, skipped

    calls, ppl_calls, calibrations = [], [], []
    record, ppl, calibrate = search.passkey_record, search.ppl_record, search.run_calibrations

    def stopping(*args, **kwargs):
        calls.append(args[3])
        if len(calls) == 3:  # fp16, the first candidate, then Ctrl-C in the second's grid
            raise KeyboardInterrupt
        return record(*args, **kwargs)

    monkeypatch.setattr(search, "passkey_record", stopping)
    with pytest.raises(KeyboardInterrupt):
        search.run_search(loaded, plan, budget, *listed(), tmp_path, passkey=grid)
    first, second = calls[1], calls[2]
    calls.clear()
    monkeypatch.setattr(search, "passkey_record", lambda *a, **k: (calls.append(a[3]), record(*a, **k))[1])
    monkeypatch.setattr(search, "ppl_record", lambda *a, **k: (ppl_calls.append(a[3]), ppl(*a, **k))[1])
    monkeypatch.setattr(search, "run_calibrations", lambda *a, **k: (calibrations.append(1), calibrate(*a, **k))[1])
    result = search.run_search(loaded, plan, budget, *listed(), tmp_path, passkey=grid)
    assert calls == [second] and ppl_calls == [] and calibrations == []  # only the unfinished grid runs
    status = {c["recipe"]: c["passkey_status"] for c in result["candidates"]}
    assert status == {first: "reused", second: "measured"} and result["fp16"]["passkey_status"] == "reused"
    calls.clear()
    result = search.run_search(loaded, plan, budget, *listed(), tmp_path, passkey=search.PasskeyGrid([256], [50], 2))
    assert calls == ["fp16", first, second] and ppl_calls == [] and calibrations == []  # a new grid: the grid alone
    assert all(len(json.loads(open(c["passkey_record"]).read())["cells"][0]["results"]) == 2
               for c in result["candidates"])


def test_choice_with_min_passkey_by_hand():
    rows = [{"recipe": "a", "bits": 2.0, "ppl": 20.0, "passkey_accuracy": 0.4},
            {"recipe": "b", "bits": 3.0, "ppl": 22.0, "passkey_accuracy": 0.8},
            {"recipe": "c", "bits": 2.5, "ppl": 25.0, "passkey_accuracy": 1.0},
            {"recipe": "d", "bits": 1.0, "ppl": 19.0, "passkey_accuracy": None}]  # its grid failed
    assert search.choose(rows, None)["recipe"] == "d"
    assert search.choose(rows, 0.4)["recipe"] == "a"
    assert search.choose(rows, 0.5)["recipe"] == "b"
    assert search.choose(rows, 0.9)["recipe"] == "c"
    assert search.choose(rows, 1.0)["recipe"] == "c"
    assert search.choose(rows[:2], 0.9) is None
    assert search.rule(None) == search.RULE and "at least 0.5" in search.rule(0.5)


@pytest.mark.parametrize("args, needle", [
    (["--min-passkey", "0.5"], "--min-passkey needs --passkey"),
    (["--passkey", "--min-passkey", "1.5"], "--min-passkey is a passkey accuracy in [0, 1], got 1.5"),
    (["--passkey", "--min-passkey", "-0.1"], "--min-passkey is a passkey accuracy in [0, 1]"),
    (["--passkey", "--passkey-lengths", "1"], "--passkey-lengths must be at least 2 tokens, got 1"),
    (["--passkey", "--passkey-depths", "120"], "--passkey-depths are percentages in [0, 100], got 120"),
    (["--passkey", "--passkey-trials", "0"], "--passkey-trials must be positive"),
    (["--passkey", "--passkey-mode", "nope"], "unknown --passkey-mode 'nope'"),
    (["--passkey", "--passkey-backend", "reference"], "--passkey-backend applies to --passkey-mode decode only"),
    (["--passkey-trials", "3"], "--passkey-trials applies with --passkey only"),
])
def test_bad_passkey_input_is_one_line_before_the_model(args, needle, text_file, tmp_path):
    """Said before the model is even looked at: a model that does not exist would be refused otherwise."""
    assert_one_line_error(kvcal("search", "--model", tmp_path / "no-model", "--bits", "3", "--dataset", text_file,
                                *args), needle)


@pytest.mark.parametrize("length, needle", [
    ("100", "--passkey-lengths: a passkey prompt of 100 tokens cannot hold the header"),
    ("5000", "--passkey-lengths 5000 + 8 new tokens exceeds tiny-llama's max_position_embeddings (4096)"),
])
def test_a_grid_the_model_cannot_hold_is_one_line_before_any_measurement(length, needle, text_file, tmp_path):
    out = tmp_path / "out"
    assert_one_line_error(kvcal("search", *ARGS, "--passkey", "--passkey-lengths", length, "--dataset", text_file,
                                "--out", out), needle)
    assert not (out / "candidates").exists()


def test_speed_front_by_hand():
    rows = [{"recipe": "a", "bits": 2.0, "ppl": 30.0, "tokens_per_s": 100.0},
            {"recipe": "b", "bits": 2.0, "ppl": 30.0, "tokens_per_s": 90.0},  # a is as good and faster
            {"recipe": "c", "bits": 3.0, "ppl": 25.0, "tokens_per_s": 80.0},
            {"recipe": "d", "bits": 4.0, "ppl": 26.0, "tokens_per_s": 200.0},  # more bits, worse ppl, fastest
            {"recipe": "e", "bits": 4.0, "ppl": 27.0, "tokens_per_s": 150.0},  # d beats it everywhere
            {"recipe": "f", "bits": 1.0, "ppl": 50.0, "tokens_per_s": None}]  # not timed
    assert search.speed_front(rows) == {"a", "c", "d"}
    assert search.pareto_front([r for r in rows if r["recipe"] != "f"]) == {"a", "c"}


def test_speed_records_are_written_reused_and_failures_said(text_file, tmp_path, monkeypatch):
    """The GPU part faked (this suite has no GPU): the search times fp16 and every candidate once, writes their
    records, computes x fp16 and the speed front from them, marks a failure with its reason, and a re-run reuses
    every record. The timing itself is run_case (tests/test_bench.py and the GPU runs)."""
    import torch

    from kvcal.models import load_model
    from kvcal.runtime import bench_generate

    loaded = load_model("tiny-llama")
    plan = search.Plan("tiny-llama", "float32", "cpu", str(text_file), None, 2, 128, 0, 2)
    budget = search.make_budget(loaded.dims, 4.6, None, None, 1, 128)
    candidates, skipped = search.list_candidates(loaded.dims, budget, plan, ["xquant", "rtn"], False, True)
    names = [c.name for c in candidates]
    assert len(names) == 2
    rates = {"fp16": 100.0, names[0]: 150.0}
    timed, rerun, dtypes = [], [], set()

    def fake_run(loaded_, name, method, storages, batch, context, steps, mode="eager"):
        timed.append((name, batch, context, steps, mode))
        dtypes.add(loaded_.model.dtype)
        if name not in rates and not rerun:  # run_case_or_oom's answer to an out-of-memory error
            return None, "CUDA out of memory. Tried to allocate 2.00 GiB"
        if name not in rates:  # on the re-run: a kernel that does not compile
            raise RuntimeError("PassManager::run failed\nthe MLIR dump")
        return {"codec": name, "mode": bench_generate.MODES[mode], "tokens_per_s": rates[name]}, None

    monkeypatch.setattr(search, "check_speed", lambda speed, on_cpu: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(bench_generate, "capture_refusal", lambda loaded_, storages: None)
    monkeypatch.setattr(bench_generate, "run_case_or_oom", fake_run)
    speed = search.SpeedSetting(context=64, batch=2, steps=3)
    result = search.run_search(loaded, plan, budget, candidates, skipped, tmp_path, speed=speed)
    assert timed == [(n, 2, 64, 3, "graph") for n in ["fp16", *names]]
    assert dtypes == {torch.bfloat16}  # the perplexity in float32, the timing in the serving dtype
    rows = {c["recipe"]: c for c in result["candidates"]}
    assert rows[names[0]]["tokens_per_s"] == 150.0 and rows[names[0]]["x_fp16_speed"] == 1.5
    assert rows[names[0]]["speed_status"] == "measured" and rows[names[0]]["on_speed_front"]
    assert rows[names[1]]["speed_status"] == "failed" and "out of memory" in rows[names[1]]["speed_error"]
    assert rows[names[1]]["tokens_per_s"] is None and not rows[names[1]]["on_speed_front"]
    record = json.loads(open(rows[names[0]]["speed_record"]).read())
    assert record["device"] == "Fake GPU" and record["settings"] == speed.settings()
    assert record["settings"]["dtype"] == "bfloat16" and "--dtype bfloat16" in record["command"]
    assert record["command"].startswith("kvcal bench generate --artifact ") and "--context 64" in record["command"]
    assert result["fp16"]["tokens_per_s"] == 100.0 and result["speed"]["context"] == 64
    timed.clear()
    rerun.append(True)
    again = search.run_search(loaded, plan, budget, *search.list_candidates(loaded.dims, budget, plan, ["xquant", "rtn"],
                                                                            False, True), tmp_path, speed=speed)
    assert [t[0] for t in timed] == [names[1]]  # only the failed one is tried again
    failed = {c["recipe"]: c for c in again["candidates"]}[names[1]]
    assert failed["speed_status"] == "failed" and failed["speed_error"] == "RuntimeError: PassManager::run failed"
    assert {c["recipe"]: c["speed_status"] for c in again["candidates"]}[names[0]] == "reused"


@pytest.mark.parametrize("args, needle", [
    (["--speed", "--device", "cpu"], "--speed times decoding on a CUDA device"),
    (["--speed-context", "1024", "--device", "cpu"], "apply with --speed (a CUDA device) only"),
    (["--speed-dtype", "float16", "--device", "cpu"], "apply with --speed (a CUDA device) only"),
    (["--speed", "--device", "cuda", "--speed-dtype", "int8"], "--speed-dtype must be one of bfloat16, float16"),
])
def test_bad_speed_input_is_one_line_before_the_model(args, needle, text_file, tmp_path):
    assert_one_line_error(kvcal("search", "--model", tmp_path / "no-model", "--bits", "3", "--dataset", text_file,
                                *args), needle)
