"""`kvcal search`: the best recipe for one model at one memory budget, chosen by measurement.

Every shipped recipe (`--ablations`: also recipes/ablations/) whose bits per element on the model fit the budget is a
candidate. Each is calibrated on the calibration split (one capture serves them all, kept under OUT/capture) and
evaluated on the evaluation split (held out: for WikiText-2 the test split, for Shakespeare the tragedies; a text
file serves both splits) under one protocol and one full-precision allowance, exactly as `kvcal eval ppl --artifact`
evaluates (the record says the command that reproduces its number). The rule: the lowest perplexity, ties to fewer
bits, then the name.

With a passkey grid (`--passkey`), fp16 and every measured candidate also run `kvcal eval passkey` on their artifact
(kvcal.eval.passkey.passkey_record), and the record goes beside the candidate's ppl record; `--min-passkey X` leaves
out of the choice every candidate whose passkey accuracy (mean over the grid) is below X.

Work is kept per candidate under OUT/candidates/NAME-KEY/ (artifact.safetensors, record.json), KEY a hash of what the
number depends on (model, dtype and device type, recipe and config, calibration and evaluation data and settings,
protocol, kvcal version): a re-run, after an interruption or with a larger budget, measures only what is new, and an
interrupted calibration resumes from its checkpoints. A passkey record is
OUT/candidates/NAME-KEY/passkey-PKEY.json, PKEY a hash of KEY and the grid: a re-run with another grid runs only the
grid, on the artifact already there.

On a CUDA device the search also times decoding (`--speed`, on by default there): fp16 and every measured candidate
decode `steps` greedy tokens through the real model and kvcal's packed cache filled with `context` synthetic tokens
per row (kvcal.runtime.bench_generate.run_case, as `kvcal bench generate` times it; one captured CUDA graph per step
where the cache allows it, else eager), and tokens/s goes into the table, search.json and a second front (bits,
perplexity and tokens/s: no other candidate at least as good in all three and better in one). Its record is
OUT/candidates/NAME-KEY/speed-SKEY.json, SKEY a hash of KEY, the settings and the GPU with the library versions. OUT/search.json explains the choice (every candidate's
numbers, the skipped ones with their reason, the rule, the Pareto front); the chosen artifact is copied to
OUT/NAME.safetensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvcal import __version__
from kvcal.accounting import bits_per_element, kv_elements
from kvcal.artifact import load_artifact, write_atomic, write_json
from kvcal.calib.checkpoint import checkpoint_folder
from kvcal.calib.run import run_calibrations
from kvcal.data import load_eval_windows, load_text
from kvcal.determinism import deterministic_algorithms
from kvcal.errors import KvcalError, first_line
from kvcal.eval.passkey import DEFAULT_DEPTHS, build_prompt, check_grid, passkey_record
from kvcal.eval.run import check_protocol, ppl_record, protocol_setting
from kvcal.methods.registry import all_methods, build_method, storages_for_artifact
from kvcal.progress import stderr_console
from kvcal.recipes import load_recipe, recipe_names
from kvcal.runtime.cache import BACKENDS

RULE = "the lowest perplexity among the candidates that fit the budget; ties: fewer bits, then the recipe name"
MEMORY_UNIT = 1 << 30  # --memory is in GiB
PASSKEY_TRIALS = 2  # the search's default grid: --seqlen tokens x DEFAULT_DEPTHS x 2 trials, simulated
PASSKEY_MODE = "simulate"
SPEED_DTYPES = ("bfloat16", "float16", "float32")  # --speed-dtype
SPEED_HEADROOM = 8  # positions the timed decode takes beyond its steps (warm-up steps and the capture)


@dataclass
class Budget:
    """Bits per element a candidate may take, counted at `tokens` tokens (`--context`, else the evaluation windows'
    length: what the evaluated cache held, its full-precision windows and sinks included), and how it was given."""

    bits: float
    tokens: int
    given: dict


@dataclass
class Plan:
    """What every candidate is measured with (the search's settings, the same for all)."""

    model: str
    dtype: str
    device: str
    dataset: str = "wikitext2"
    data_dir: str | None = None
    nsamples: int = 16
    seqlen: int = 2048
    seed: int = 0
    eval_nsamples: int = 16
    protocol: str = "gptq"
    prompt_len: int = 0
    prefix_len: int = 0
    block_len: int = 0
    fp_window: int | None = None
    batch_size: int = 1
    capture_budget_bytes: int = 4 << 30


@dataclass
class PasskeyGrid:
    """The passkey grid run on fp16 and every measured candidate: `kvcal eval passkey`'s settings. lengths None: the
    evaluation windows' length, cut to the model's positions less the generated tokens (`fit_passkey_grid`)."""

    lengths: list[int] | None = None
    depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    trials: int = PASSKEY_TRIALS
    seed: int = 0
    mode: str = PASSKEY_MODE
    max_new_tokens: int = 8
    backend: str = "packed"

    def settings(self) -> dict:
        return {"lengths": self.lengths, "depths": self.depths, "trials": self.trials, "seed": self.seed,
                "mode": self.mode, "max_new_tokens": self.max_new_tokens, "backend": self.backend}


@dataclass
class SpeedSetting:
    """The decode timing run on fp16 and every measured candidate on a GPU: `kvcal bench generate`'s settings. The
    model decodes in `dtype` (a serving dtype: the search's perplexity may run in float32, where SDPA and the kernels
    are not what a server runs); a dtype other than the search's loads the model a second time in it."""

    context: int = 4096
    batch: int = 1
    steps: int = 32
    dtype: str = "bfloat16"

    def settings(self) -> dict:
        return {"context": self.context, "batch": self.batch, "steps": self.steps, "dtype": self.dtype}


@dataclass
class Candidate:
    name: str  # the recipe
    method: object  # its setting for this model (and the allowance)
    bits: float
    key: str = ""
    record: dict | None = None
    status: str = "pending"  # measured, reused, not started (time budget)
    passkey_key: str = ""
    passkey: dict | None = None  # the passkey record
    passkey_status: str = "pending"  # measured, reused, failed (passkey_error says why)
    passkey_error: str | None = None
    speed: dict | None = None  # the speed record
    speed_path: str | None = None
    speed_status: str = "pending"  # measured, reused, failed (speed_error says why)
    speed_error: str | None = None


def parse_duration(text: str | None) -> float | None:
    """'90', '90s', '15m', '2h' -> seconds; None stays None."""
    if text is None:
        return None
    raw = text.strip().lower()
    scale = {"s": 1, "m": 60, "h": 3600}.get(raw[-1:], None)
    number = raw[:-1] if scale else raw
    try:
        seconds = float(number) * (scale or 1)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or math.isinf(seconds):
        raise KvcalError(f"--time-budget must be a positive duration such as 900, 15m or 2h, got '{text}'")
    return seconds


def make_budget(dims, bits: float | None, memory: float | None, context: int | None, batch: int,
                seqlen: int) -> Budget:
    """The budget in bits per element from --bits (counted at --context tokens, else at `seqlen`), or from --memory GiB
    for --context tokens x --batch rows."""
    if (bits is None) == (memory is None):
        raise KvcalError("give the budget as --bits B, or as --memory GiB with --context C (and --batch N)")
    if bits is not None:
        if not bits > 0 or math.isinf(bits):
            raise KvcalError(f"--bits must be a positive number, got {bits}")
        tokens = context or seqlen
        if context is not None and context <= 0:
            raise KvcalError(f"--context must be positive, got {context}")
        if batch != 1:
            raise KvcalError(f"--batch applies to --memory (rows the memory holds), not to --bits; got --batch {batch}")
        return Budget(bits, tokens, {"bits": bits, **({"context": context} if context else {})})
    if context is None or context <= 0:
        raise KvcalError("--memory needs --context C, a positive number of tokens")
    if batch <= 0:
        raise KvcalError(f"--batch must be positive, got {batch}")
    if not memory > 0 or math.isinf(memory):
        raise KvcalError(f"--memory must be a positive number of GiB, got {memory}")
    per_element = memory * MEMORY_UNIT * 8 / (kv_elements(dims, context) * batch)
    return Budget(per_element, context, {"memory_gib": memory, "context": context, "batch": batch})


def check_passkey(grid: PasskeyGrid | None, min_passkey: float | None) -> None:
    """One-line refusal, before any model loads, of a grid `kvcal eval passkey` would refuse (named by the search's
    flags) and of a --min-passkey outside [0, 1] or without a grid."""
    if min_passkey is not None:
        if grid is None:
            raise KvcalError("--min-passkey needs --passkey (the passkey grid it is measured on)")
        if not 0 <= min_passkey <= 1:
            raise KvcalError(f"--min-passkey is a passkey accuracy in [0, 1], got {min_passkey}")
    if grid is None:
        return
    check_grid(grid.lengths, grid.depths, grid.trials, grid.max_new_tokens, grid.mode, "--passkey-")
    if grid.backend not in BACKENDS:
        raise KvcalError(f"unknown --passkey-backend '{grid.backend}' (choose from {', '.join(BACKENDS)})")
    if grid.backend != "packed" and grid.mode != "decode":
        raise KvcalError("--passkey-backend applies to --passkey-mode decode only")


def fit_passkey_grid(loaded, grid: PasskeyGrid, seqlen: int) -> PasskeyGrid:
    """The grid with its lengths settled (default: `seqlen` cut to the model's max_position_embeddings less the
    generated tokens), each length checked against the model's positions and its tokenizer (a prompt must hold the
    header, the needle and the question): one-line errors before anything is measured."""
    if loaded.tokenizer is None:
        raise KvcalError(f"--passkey: {loaded.name} has no tokenizer")
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    if not grid.lengths and limit and limit - grid.max_new_tokens < 2:
        raise KvcalError(f"--passkey-max-new-tokens {grid.max_new_tokens} leaves no prompt within {loaded.name}'s "
                         f"context ({limit} positions)")
    lengths = grid.lengths or [min(seqlen, limit - grid.max_new_tokens) if limit else seqlen]
    for n in lengths:
        if limit and n + grid.max_new_tokens > limit:
            raise KvcalError(f"--passkey-lengths {n} + {grid.max_new_tokens} new tokens exceeds {loaded.name}'s "
                             f"max_position_embeddings ({limit})")
        try:
            build_prompt(loaded.tokenizer, n, 50, "12345")
        except KvcalError as exc:
            raise KvcalError(f"--passkey-lengths: {exc}") from None
    return dataclasses.replace(grid, lengths=list(lengths))


def rule(min_passkey: float | None) -> str:
    """The choice rule as search.json states it."""
    if min_passkey is None:
        return RULE
    return (f"the lowest perplexity among the candidates that fit the budget and whose passkey accuracy (mean over the "
            f"grid) is at least {min_passkey}; ties: fewer bits, then the recipe name")


def choose(rows: list[dict], min_passkey: float | None) -> dict | None:
    """The row the rule chooses among the measured ones (None: none measured, or none reaches `min_passkey`)."""
    eligible = [r for r in rows if r["ppl"] is not None and (
        min_passkey is None or (r.get("passkey_accuracy") is not None and r["passkey_accuracy"] >= min_passkey))]
    return min(eligible, key=lambda r: (r["ppl"], r["bits"], r["recipe"])) if eligible else None


def check_methods(methods: list[str] | None) -> None:
    known = all_methods()
    for name in methods or []:
        if name not in known:
            raise KvcalError(f"unknown method '{name}' in --methods (known: {', '.join(sorted(known))})")


def list_candidates(dims, budget: Budget, plan: Plan, methods: list[str] | None, ablations: bool,
                    on_cpu: bool) -> tuple[list[Candidate], list[dict]]:
    """(candidates that fit, skipped recipes with the reason), without loading the model. The candidates are ordered
    by bits, the most first (the closest to the budget start first); a setting two recipes share is measured once."""
    candidates, skipped, seen = [], [], {}
    for name in recipe_names():
        if "/" in name and not ablations:
            continue
        try:
            recipe = load_recipe(name)
        except KvcalError as exc:
            skipped.append({"recipe": name, "reason": str(exc)})
            continue
        if methods and recipe.method not in methods:
            continue
        try:
            method = build_method(recipe.method, recipe.config)
            if plan.fp_window is not None:
                method = method.with_fp_window(plan.fp_window)
            method = method.for_model(dims)
            method.check_model(dims)
            check_protocol(method, plan.protocol, "simulate", plan.prefix_len, plan.block_len, plan.fp_window)
        except KvcalError as exc:
            skipped.append({"recipe": name, "method": recipe.method, "reason": str(exc)})
            continue
        bits = bits_per_element(method, dims, budget.tokens).bits_per_element
        if bits > budget.bits + 1e-9:
            skipped.append({"recipe": name, "method": recipe.method, "bits": round(bits, 6),
                            "reason": f"{bits:.3f} bits per element is over the budget"})
            continue
        if on_cpu and method.calibrates_on_gpu and method.name not in (methods or []):
            skipped.append({"recipe": name, "method": recipe.method, "bits": round(bits, 6),
                            "reason": f"{method.name} calibrates for hours on a CPU: name it in --methods to include it"})
            continue
        setting = json.dumps([method.name, method.config()], sort_keys=True, default=str)
        if setting in seen:
            skipped.append({"recipe": name, "method": recipe.method, "reason": f"the same setting as {seen[setting]}"})
            continue
        seen[setting] = name
        candidates.append(Candidate(name, method, bits))
    candidates.sort(key=lambda c: (-c.bits, c.name))
    return candidates, skipped


def candidate_key(loaded, plan: Plan, candidate: Candidate, calib_text, eval_text) -> str:
    """A hash of everything the candidate's number depends on."""
    parts = {
        "model": loaded.identity, "dtype": plan.dtype, "device": loaded.device.type, "recipe": candidate.name,
        "method": candidate.method.name, "config": candidate.method.config(),
        "calibration": {**calib_text.provenance, "nsamples": plan.nsamples, "seqlen": plan.seqlen, "seed": plan.seed},
        "evaluation": {**eval_text.provenance, "nsamples": plan.eval_nsamples, "seqlen": plan.seqlen,
                       "protocol": plan.protocol, "prompt_len": plan.prompt_len, "prefix_len": plan.prefix_len,
                       "fp_window": plan.fp_window, "batch_size": plan.batch_size},
        "kvcal": __version__,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def passkey_key(candidate: Candidate, grid: PasskeyGrid) -> str:
    """A hash of the candidate's key (its artifact's inputs) and the passkey grid."""
    parts = {"candidate": candidate.key, "passkey": grid.settings()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def candidate_folder(out: Path, candidate: Candidate) -> Path:
    """OUT/candidates/NAME-KEY: the candidate's artifact, ppl record and passkey records."""
    return out / "candidates" / f"{candidate.name.replace('/', '-')}-{candidate.key}"


def eval_command(plan: Plan, artifact: Path) -> str:
    """The `kvcal eval ppl` command whose perplexity a candidate's record holds."""
    parts = ["kvcal eval ppl", f"--artifact {artifact}", f"--model {plan.model}", f"--dtype {plan.dtype}",
             f"--dataset {plan.dataset}", f"--seqlen {plan.seqlen}", f"--nsamples {plan.eval_nsamples}",
             f"--protocol {plan.protocol}", f"--batch-size {plan.batch_size}"]
    if plan.data_dir:
        parts.append(f"--data-dir {plan.data_dir}")
    if plan.protocol == "prefill-decode":
        parts.append(f"--prompt-len {plan.prompt_len}")
    if plan.protocol == "tail":
        parts += [f"--prefix-len {plan.prefix_len}", f"--block-len {plan.block_len}"]
    if plan.fp_window is not None:
        parts.append(f"--fp-window {plan.fp_window}")
    return " ".join(parts)


def passkey_command(plan: Plan, grid: PasskeyGrid, artifact: Path) -> str:
    """The `kvcal eval passkey` command whose grid a candidate's passkey record holds."""
    parts = ["kvcal eval passkey", f"--artifact {artifact}", f"--model {plan.model}", f"--dtype {plan.dtype}"]
    parts += [f"--lengths {n}" for n in grid.lengths] + [f"--depths {d}" for d in grid.depths]
    parts += [f"--trials {grid.trials}", f"--seed {grid.seed}", f"--mode {grid.mode}",
              f"--max-new-tokens {grid.max_new_tokens}", f"--backend {grid.backend}"]
    if plan.fp_window is not None:
        parts.append(f"--fp-window {plan.fp_window}")
    return " ".join(parts)


def measure(loaded, plan: Plan, candidate: Candidate, out: Path, text, windows) -> None:
    """Calibrate (or reuse) the candidate's artifact and evaluate it (or reuse its record)."""
    folder = candidate_folder(out, candidate)
    record_path, artifact_path = folder / "record.json", folder / "artifact.safetensors"
    if record_path.is_file() and artifact_path.is_file():
        candidate.record, candidate.status = json.loads(record_path.read_text()), "reused"
        return
    folder.mkdir(parents=True, exist_ok=True)
    if not artifact_path.is_file():
        run_calibrations(loaded, [(candidate.method, artifact_path)], plan.dataset, plan.nsamples, plan.seqlen,
                         plan.seed, plan.data_dir, plan.capture_budget_bytes, plan.batch_size, out / "capture",
                         resume=checkpoint_folder(artifact_path).exists())
    artifact = load_artifact(artifact_path)
    method, storages = storages_for_artifact(artifact, loaded, artifact_path, None, plan.fp_window)
    setting = protocol_setting(candidate.name.replace("/", "-"), plan.fp_window)
    with deterministic_algorithms(True):  # as `kvcal eval ppl` evaluates by default
        record = ppl_record(loaded, method, storages, setting,
                            {"path": str(artifact_path), "tensor_hash": artifact.header["tensor_hash"]}, text,
                            windows, plan.dtype, plan.protocol, plan.prompt_len, plan.batch_size, "simulate",
                            "packed", plan.prefix_len, plan.fp_window)
    record["deterministic"] = True
    record["command"] = eval_command(plan, artifact_path)
    write_json(record_path, record)
    candidate.record, candidate.status = record, "measured"


def measure_passkey(loaded, plan: Plan, grid: PasskeyGrid, candidate: Candidate, out: Path) -> None:
    """Run the passkey grid on the candidate's artifact (or reuse its record), as `kvcal eval passkey --artifact`
    runs it. A candidate the grid cannot run on (e.g. a packed cache without Triton kernels on CUDA) is marked failed
    with the reason, and the search goes on."""
    folder = candidate_folder(out, candidate)
    candidate.passkey_key = passkey_key(candidate, grid)
    path = folder / f"passkey-{candidate.passkey_key}.json"
    if path.is_file():
        candidate.passkey, candidate.passkey_status = json.loads(path.read_text()), "reused"
        return
    artifact_path = folder / "artifact.safetensors"
    artifact = load_artifact(artifact_path)
    method, storages = storages_for_artifact(artifact, loaded, artifact_path, None, plan.fp_window)
    setting = protocol_setting(candidate.name.replace("/", "-"), plan.fp_window)
    try:
        record = passkey_record(loaded, method, storages, setting,
                                {"path": str(artifact_path), "tensor_hash": artifact.header["tensor_hash"]},
                                plan.dtype, grid.lengths, grid.depths, grid.trials, grid.seed, grid.mode,
                                grid.max_new_tokens, grid.backend, plan.fp_window)
    except KvcalError as exc:
        candidate.passkey_error, candidate.passkey_status = first_line(str(exc)), "failed"
        stderr_console.print(f"search: passkey of {candidate.name} failed: {candidate.passkey_error}", markup=False,
                             highlight=False, soft_wrap=True)
        return
    record["command"] = passkey_command(plan, grid, artifact_path)
    write_json(path, record)
    candidate.passkey, candidate.passkey_status = record, "measured"


def check_speed(speed: SpeedSetting | None, on_cpu: bool) -> None:
    """One-line errors for the decode timing's settings, before any model loads."""
    if speed is None:
        return
    if on_cpu:
        raise KvcalError("--speed times decoding on a CUDA device (--device cuda); on a CPU the search has no speed")
    for flag, value in (("--speed-context", speed.context), ("--speed-batch", speed.batch),
                        ("--speed-steps", speed.steps)):
        if value < 1:
            raise KvcalError(f"{flag} must be >= 1, got {value}")
    if speed.dtype not in SPEED_DTYPES:
        raise KvcalError(f"--speed-dtype must be one of {', '.join(SPEED_DTYPES)}, got '{speed.dtype}'")


def timing_model(loaded, plan: Plan, speed: SpeedSetting):
    """The model the decode timing runs: the search's own when it is in speed.dtype, else loaded again in it."""
    if plan.dtype == speed.dtype:
        return loaded
    from kvcal.models import load_model

    stderr_console.print(f"search: loading {plan.model} again in {speed.dtype} for the decode timing (the "
                         f"perplexity runs in {plan.dtype})", markup=False, highlight=False, soft_wrap=True)
    return load_model(plan.model, speed.dtype, plan.device)


def fit_speed(loaded, speed: SpeedSetting) -> None:
    """The timed context, its decode steps and their warm-up within the model's positions (one line if not)."""
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    if limit and speed.context + speed.steps + SPEED_HEADROOM > limit:
        raise KvcalError(f"--speed-context {speed.context} + {speed.steps + SPEED_HEADROOM} decode steps exceeds "
                         f"{loaded.name}'s max_position_embeddings ({limit})")


def speed_key(candidate: Candidate, speed: SpeedSetting, device: str) -> str:
    """A hash of the candidate's key, the timing's settings and where it runs (GPU and library versions)."""
    import torch
    import triton

    parts = {"candidate": candidate.key, "speed": speed.settings(), "device": device, "torch": torch.__version__,
             "triton": triton.__version__}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def measure_speed(loaded, plan: Plan, speed: SpeedSetting, candidate: Candidate, out: Path, timed=None):
    """Decode tokens/s of the candidate's artifact (or reuse its record), as `kvcal bench generate` times it: the
    packed cache filled with speed.context synthetic tokens per row, speed.steps greedy steps through the model,
    replayed from one CUDA graph where the cache allows it, else eager (the record says which). A candidate that
    cannot be timed (no kernel on this GPU, a kernel that fails to compile, out of memory) is marked failed with the
    reason, said on stderr, and the search goes on. `timed`: the model in speed.dtype if already loaded; returns it
    (loaded here at the first timing that is not reused)."""
    import torch

    from kvcal.runtime.bench_generate import capture_refusal, run_case_or_oom

    folder = candidate_folder(out, candidate)
    gpu = torch.cuda.get_device_name(loaded.device)
    path = folder / f"speed-{speed_key(candidate, speed, gpu)}.json"
    candidate.speed_path = str(path)
    if path.is_file():
        candidate.speed, candidate.speed_status = json.loads(path.read_text()), "reused"
        return timed
    timed = timed or timing_model(loaded, plan, speed)
    artifact_path = folder / "artifact.safetensors"
    method, storages = storages_for_artifact(load_artifact(artifact_path), timed, artifact_path, None,
                                             plan.fp_window)
    try:
        refusal = capture_refusal(timed, storages)
        mode = "eager" if refusal else "graph"
        record, oom = run_case_or_oom(timed, candidate.name, method, storages, speed.batch, speed.context,
                                      speed.steps, mode=mode)
    except Exception as exc:  # noqa: BLE001 - a kernel that fails to build or run fails this candidate's column
        record, oom = None, f"{type(exc).__name__}: {first_line(str(exc))}"
    if record is None:
        candidate.speed_error, candidate.speed_status = oom, "failed"
        stderr_console.print(f"search: speed of {candidate.name} failed: {oom}", markup=False, highlight=False,
                             soft_wrap=True)
        return timed
    command = (f"kvcal bench generate --artifact {artifact_path} --model {plan.model} --dtype {speed.dtype} "
               f"--context {speed.context} --batch {speed.batch} --steps {speed.steps} --mode {mode} --no-max-batch")
    record.update(device=gpu, why_eager=refusal, settings=speed.settings(),
                  command=command if plan.fp_window is None else None)
    write_json(path, record)
    candidate.speed, candidate.speed_status = record, "measured"
    return timed


def speed_columns(candidate: Candidate, fp16: Candidate) -> dict:
    """A candidate's decode tokens/s, its ratio to fp16's, mode, record path and status, for search.json."""
    tps = candidate.speed["tokens_per_s"] if candidate.speed else None
    ref = fp16.speed["tokens_per_s"] if fp16.speed else None
    columns = {"tokens_per_s": tps, "x_fp16_speed": tps / ref if tps and ref else None,
               "speed_mode": candidate.speed["mode"] if candidate.speed else None,
               "speed_record": candidate.speed_path if candidate.speed else None,
               "speed_status": candidate.speed_status if candidate.record else "not started (time budget)"}
    if candidate.speed_error:
        columns["speed_error"] = candidate.speed_error
    return columns


def speed_front(rows: list[dict]) -> set[str]:
    """Names of the timed rows that no other timed row dominates on (fewer bits, lower perplexity, more tokens/s):
    at least as good in all three and better in one."""
    timed = [r for r in rows if r.get("tokens_per_s")]

    def dominates(a, b):
        no_worse = a["bits"] <= b["bits"] and a["ppl"] <= b["ppl"] and a["tokens_per_s"] >= b["tokens_per_s"]
        better = a["bits"] < b["bits"] or a["ppl"] < b["ppl"] or a["tokens_per_s"] > b["tokens_per_s"]
        return no_worse and better

    return {r["recipe"] for r in timed if not any(dominates(o, r) for o in timed if o is not r)}


def passkey_columns(candidate: Candidate, out: Path) -> dict:
    """A candidate's passkey accuracy (mean over the grid), its record's path and status, for search.json."""
    columns = {"passkey_accuracy": candidate.passkey["accuracy"] if candidate.passkey else None,
               "passkey_record": str(candidate_folder(out, candidate) / f"passkey-{candidate.passkey_key}.json")
               if candidate.passkey else None,
               "passkey_status": candidate.passkey_status if candidate.record else "not started (time budget)"}
    if candidate.passkey_error:
        columns["passkey_error"] = candidate.passkey_error
    return columns


def pareto_front(rows: list[dict]) -> set[str]:
    """Names of the measured rows no other row beats on both bits and perplexity (fewest bits for its perplexity)."""
    front, best = set(), math.inf
    for row in sorted(rows, key=lambda r: (r["bits"], r["ppl"], r["recipe"])):
        if row["ppl"] < best:
            front.add(row["recipe"])
            best = row["ppl"]
    return front


def run_search(loaded, plan: Plan, budget: Budget, candidates: list[Candidate], skipped: list[dict], out: Path,
               time_budget: float | None = None, command: str = "", passkey: PasskeyGrid | None = None,
               min_passkey: float | None = None, speed: SpeedSetting | None = None) -> dict:
    """Measure the candidates in order (none started after `time_budget` seconds), each with the passkey grid when
    one is given and timed when `speed` is given, choose, and write OUT/search.json and the chosen artifact. Returns
    the search's record."""
    check_passkey(passkey, min_passkey)
    check_speed(speed, loaded.device.type != "cuda")
    if passkey is not None:
        passkey = fit_passkey_grid(loaded, passkey, plan.seqlen)
    timed = None  # the model in speed.dtype, loaded at the first timing that is not reused
    if speed is not None:
        fit_speed(loaded, speed)
    out.mkdir(parents=True, exist_ok=True)
    calib_text = load_text(plan.dataset, "calib", plan.data_dir)
    text, windows = load_eval_windows(loaded.tokenizer, plan.dataset, plan.data_dir, plan.seqlen, plan.eval_nsamples)
    stderr_console.print(f"search: {len(candidates)} candidates; calibration on {calib_text.provenance['dataset']} "
                         f"{calib_text.provenance['split']} ({plan.nsamples} windows of {plan.seqlen}), evaluation on "
                         f"{text.provenance['dataset']} {text.provenance['split']} ({windows.shape[0]} windows), "
                         f"{plan.protocol} protocol" + (
                             "" if passkey is None else f"; passkey grid {passkey.lengths} tokens x depths "
                             f"{passkey.depths} x {passkey.trials} trials ({passkey.mode})"),
                         markup=False, highlight=False, soft_wrap=True)
    fp16 = Candidate("fp16", build_method("fp16"), 16.0)
    started = time.monotonic()
    for candidate in [fp16, *candidates]:
        candidate.key = candidate_key(loaded, plan, candidate, calib_text, text)
        if candidate is not fp16 and time_budget is not None and time.monotonic() - started > time_budget:
            candidate.status = "not started (time budget)"
            continue
        measure(loaded, plan, candidate, out, text, windows)
        if passkey is not None:
            measure_passkey(loaded, plan, passkey, candidate, out)
        if speed is not None:
            timed = measure_speed(loaded, plan, speed, candidate, out, timed)
    reference = fp16.record["ppl"]
    rows = [{"recipe": c.name, "method": c.method.name, "bits": c.bits,
             "bits_at_4096": c.record["bits_per_element"] if c.record else None,
             "ppl": c.record["ppl"] if c.record else None,
             "increase_pct": round(100 * (c.record["ppl"] / reference - 1), 4) if c.record else None,
             "status": c.status, "key": c.key,
             "record": str(candidate_folder(out, c) / "record.json") if c.record else None,
             "command": c.record["command"] if c.record else None,
             **(passkey_columns(c, out) if passkey is not None else {}),
             **(speed_columns(c, fp16) if speed is not None else {})}
            for c in candidates]
    measured = [r for r in rows if r["ppl"] is not None]
    front = pareto_front(measured)
    fast = speed_front(measured) if speed is not None else set()
    for row in rows:
        row["on_front"] = row["recipe"] in front
        if speed is not None:
            row["on_speed_front"] = row["recipe"] in fast
    chosen = choose(measured, min_passkey)
    result = {
        "command": command, "model": loaded.identity, "dtype": plan.dtype, "device": loaded.device_label,
        # every candidate's bits are counted at the budget's tokens (its "bits"; "bits_at_4096": kvcal's reference)
        "budget": {"bits_per_element": budget.bits, "tokens": budget.tokens, **budget.given},
        "protocol": plan.protocol, "fp_window": plan.fp_window,
        "calibration": {**calib_text.provenance, "nsamples": plan.nsamples, "seqlen": plan.seqlen, "seed": plan.seed},
        "evaluation": {**text.provenance, "nsamples": int(windows.shape[0]), "seqlen": plan.seqlen},
        "passkey": None if passkey is None else {**passkey.settings(), "min_accuracy": min_passkey},
        "speed": None if speed is None else {**speed.settings(), "what": "decode tokens/s through the model and the "
                                             "packed cache filled with synthetic tokens (kvcal bench generate)"},
        "rule": rule(min_passkey),
        "fp16": {"ppl": reference, "record": str(candidate_folder(out, fp16) / "record.json"),
                 **(passkey_columns(fp16, out) if passkey is not None else {}),
                 **(speed_columns(fp16, fp16) if speed is not None else {})},
        "candidates": rows, "skipped": skipped,
        "covered": f"{len(measured)} of {len(rows)} candidates" + (
            "" if len(measured) == len(rows) else " (the time budget stopped the rest)"),
        "chosen": None, "kvcal_version": __version__,
    }
    if chosen is not None:
        source = Path(chosen["record"]).parent / "artifact.safetensors"
        target = out / f"{chosen['recipe'].replace('/', '-')}.safetensors"
        write_atomic(target, lambda tmp: shutil.copyfile(source, tmp))  # never a half-copied artifact
        result["chosen"] = {**chosen, "artifact": str(target),
                            "command": eval_command(plan, target)}
    write_json(out / "search.json", result)
    return result


def plot_front(result: dict, path: Path) -> None:
    """Bits against the perplexity increase over fp16 of every measured candidate, the front joined."""
    from kvcal.eval.report import draw_pareto

    reference = {"ppl": result["fp16"]["ppl"], "bits_per_element": 16.0}
    allowance = "own windows" if result["fp_window"] is None else f"fp window {result['fp_window']}"
    points = [{"label": r["recipe"], "method": r["method"], "group": allowance, "bits": r["bits"], "ppl": r["ppl"],
               "increase": r["increase_pct"], "offset": (5, 3)} for r in result["candidates"] if r["ppl"] is not None]
    budget = result["budget"]["bits_per_element"]
    draw_pareto(reference, points, f"kvcal search: {result['model'].get('name', '')} at {budget:.3g} bits per element, "
                f"{result['protocol']} protocol", path,
                xlabel=f"bits per element (everything counted, {result['budget']['tokens']} tokens)")
