"""The kvcal command line (Typer). Bad input ends in one line on stderr and a non-zero exit.

The commands import what they run inside their functions: `kvcal --help` and the one-line errors of bad input come
back before torch and transformers load."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from kvcal.errors import KvcalError, first_line
from kvcal.progress import make_console

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Calibrate, apply and evaluate KV-cache compression methods.")
eval_app = typer.Typer(no_args_is_help=True, help="Evaluate a method or an artifact.")
app.add_typer(eval_app, name="eval")
bench_app = typer.Typer(no_args_is_help=True, help="GPU benchmarks of the compressed cache.")
app.add_typer(bench_app, name="bench")
console = make_console()


def _version(value: bool):
    if value:
        from kvcal import __version__

        console.print(f"kvcal {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print kvcal's version and exit.")):
    """Calibrate, apply and evaluate KV-cache compression methods."""

ModelOpt = typer.Option("smollm2-135m", "--model", "-m",
                        help="Model alias (see `kvcal models`), local .gguf file or local HF directory.")
DtypeOpt = typer.Option("float32", help="float32, bfloat16, float16 or float64 (exactness checks).")
DeviceOpt = typer.Option("auto", help="cpu, cuda or auto.")
DeviceMapOpt = typer.Option(None, "--device-map", help="auto (or balanced, sequential): spread the model's layers "
                            "over the CUDA GPUs (accelerate); even: the same number of layers on each (per-layer "
                            "training ends together); each layer's capture, storages, cache and step graphs on "
                            "its GPU. Not with --device.")
MaxMemoryOpt = typer.Option(None, "--max-memory", help="--device-map: memory per GPU for the weights, e.g. "
                            "0=20GiB,1=20GiB (forces a model that fits one GPU across several).")
DataDirOpt = typer.Option(None, "--data-dir", help="Folder with wiki.test.raw etc. (default: $KVCAL_DATA_DIR, else the Hub).")
SetOpt = typer.Option(None, "--set", help="Override a config key: --set bits=2 (repeatable).")
FpWindowOpt = typer.Option(None, "--fp-window", help="Full-precision allowance: the newest W tokens stay in fp16 for "
                           "every method alike (0: strict, every token compressed as it enters), overriding each "
                           "method's own window; default: each method's own (docs/conventions.md).")


@app.command("models")
def models_command():
    """List the model aliases."""
    from kvcal.models import describe_models

    table = Table("name", "kind", "source", "description")
    for row in describe_models():
        table.add_row(row["name"], row["kind"], row["source"], row["description"])
    console.print(table)


@app.command("methods")
def methods_command():
    """List the methods and their config keys with defaults."""
    import dataclasses

    from kvcal.methods import all_methods

    table = Table("method", "learns", "config (defaults)", "what it does")
    for name, cls in sorted(all_methods().items()):
        defaults = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls))
        table.add_row(name, "yes" if cls.learns else "no", defaults or "-", cls.summary)
    console.print(table)


@app.command("recipes")
def recipes_command(model: str = typer.Option("smollm2-135m", "--model", "-m", help="Model whose dims the bits per "
                                              "element are counted on (read from its config, no weights loaded).")):
    """List the recipes (`--recipe NAME`): method, bits per element on the model at 4096 tokens, and what each is."""
    from kvcal.models.dims import model_dims
    from kvcal.recipes import describe_recipes

    table = Table("recipe", "method", f"bits/elem on {model}", "description")
    for row in describe_recipes(model_dims(model)):
        bits = "-" if row["bits_per_element"] is None else f"{row['bits_per_element']:.3f}"
        note = ("" if not row["problem"] else f"(broken recipe: {row['problem']}) " if row["broken"] else
                f"(not on this model: {row['problem']}) ")
        table.add_row(escape(row["name"]), row["method"], bits, escape(note + row["description"]))
    console.print(table)


@app.command("calibrate")
def calibrate_command(
    method: str | None = typer.Option(None, help="Method name (see `kvcal methods`)."),
    recipe: list[str] | None = typer.Option(None, help="Recipe YAML file or name under recipes/. Repeat it to "
                                            "calibrate several settings from one model load and one capture."),
    model: str = ModelOpt,
    dataset: str | None = typer.Option(None, help="wikitext2, shakespeare or a text file (default: recipe, else wikitext2)."),
    data_dir: str | None = DataDirOpt,
    nsamples: int | None = typer.Option(None, help="Calibration windows (default: recipe, else 16)."),
    seqlen: int | None = typer.Option(None, help="Tokens per calibration window (default: recipe, else 2048)."),
    seed: int | None = typer.Option(None, help="Seed of the window sampler (default: recipe, else 0)."),
    sets: list[str] | None = SetOpt,
    out: Path | None = typer.Option(None, help="Artifact path (default: OUT_DIR/METHOD-TAG.safetensors)."),
    out_dir: Path | None = typer.Option(None, help="Folder for artifacts (default: artifacts/MODEL)."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    device_map: str | None = DeviceMapOpt,
    max_memory: str | None = MaxMemoryOpt,
    capture_budget_gb: float = typer.Option(4.0, help="RAM for captured activations before spilling to disk."),
    batch_size: int = typer.Option(1, help="Calibration windows per forward/backward pass."),
    capture_cache: Path | None = typer.Option(
        None, help="Folder where captured activations are kept and reused by later runs with the same "
        "model, dtype, windows and needs (several settings from one capture)."),
    evaluate: bool = typer.Option(False, "--eval", help="Then evaluate the artifact and fp16 on the dataset's "
                                  "evaluation split (gptq protocol) and print both perplexities."),
    eval_nsamples: int | None = typer.Option(None, help="--eval: evaluation windows (default 8)."),
    eval_json_dir: Path | None = typer.Option(None, help="--eval: also write both results as `kvcal eval ppl` JSON "
                                              "records in this folder (fp16.json and SETTING.json)."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted calibration from the checkpoints "
                                "it left beside its artifact (ARTIFACT.partial/; the same command and data)."),
):
    """Calibrate a method on a model and write its artifact. A method that trains (CommVQ, KVQuant, SKVQ)
    checkpoints beside the artifact as it goes; an interrupted run continues with --resume."""
    import time

    from kvcal.calib.run import check_calibration, check_checkpoints, run_calibrations
    from kvcal.models import load_model
    from kvcal.models.devmap import check_device_map
    from kvcal.recipes import resolve

    device_map, caps = check_device_map(device_map, max_memory, device)
    recipes = recipe or []
    if len(recipes) > 1 and (method or sets or out):
        raise KvcalError("with several --recipe, --method, --set and --out are not allowed (use --out-dir)")
    if out is not None and out_dir is not None:
        raise KvcalError("give --out (the artifact's path) or --out-dir (a folder of artifacts named after their "
                         "settings), not both")
    jobs = [resolve(method, r, sets) for r in recipes] if recipes else [resolve(method, None, sets)]
    names = [f"{instance.name}-{tag}" for instance, tag, _ in jobs]  # the artifacts' file names under --out-dir
    for i, name in enumerate(names):
        if name in names[:i]:
            raise KvcalError(f"--recipe {recipes[names.index(name)]} and --recipe {recipes[i]} would both write "
                             f"{name}.safetensors: calibrate them separately")
    flags = {k: v for k, v in dict(dataset=dataset, nsamples=nsamples, seqlen=seqlen, seed=seed).items() if v is not None}
    learned = [calib for instance, _, calib in jobs if instance.learns] or [jobs[0][2]]
    calib = {**learned[0], **flags}
    for other in learned[1:]:
        if {**other, **flags} != calib:
            raise KvcalError(f"recipes disagree on calibration data ({calib} vs {other}): calibrate them separately")
    _positive("--nsamples", calib["nsamples"])
    _positive("--seqlen", calib["seqlen"])
    _positive("--batch-size", batch_size)
    check_calibration([instance for instance, _, _ in jobs], calib["nsamples"], calib["seqlen"])
    if not 0 <= calib["seed"] < 2**63:
        raise KvcalError(f"--seed must be in [0, 2^63), got {calib['seed']}")
    if not math.isfinite(capture_budget_gb) or capture_budget_gb <= 0:
        raise KvcalError(f"--capture-budget-gb must be a positive number, got {capture_budget_gb}")
    if evaluate:
        eval_nsamples = 8 if eval_nsamples is None else eval_nsamples
        _positive("--eval-nsamples", eval_nsamples)
        if calib["seqlen"] < 2:
            raise KvcalError("--eval needs --seqlen of at least 2 (a window scores its tokens after the first)")
        for instance, _, _ in jobs:  # --eval runs the gptq protocol: a setting that cannot is refused before loading
            try:
                instance.check_protocol("gptq")
            except KvcalError as err:
                raise KvcalError(f"--eval runs the gptq protocol: {err}; calibrate without --eval and evaluate the "
                                 "artifact with `kvcal eval ppl --artifact`") from None
    elif eval_nsamples is not None:
        raise KvcalError("--eval-nsamples needs --eval")
    # before the model loads and the calibration runs (the default folder is artifacts/MODEL, named after loading)
    check_writable(out if out is not None else out_dir or Path("artifacts"), folder=out is None,
                   flag="--out" if out is not None else "--out-dir")
    if eval_json_dir is not None:
        if not evaluate:
            raise KvcalError("--eval-json-dir needs --eval")
        check_writable(eval_json_dir, folder=True, flag="--eval-json-dir")
    if out is not None and not resume and any(instance.learns for instance, _, _ in jobs):
        check_checkpoints([out], resume)
    if capture_cache is not None:  # written only on a miss: a read-only cache of what is needed still serves
        check_writable(capture_cache, folder=True, permission=False, flag="--capture-cache")
    if any(instance.learns for instance, _, _ in jobs) or evaluate:  # a missing dataset fails before the model loads
        from kvcal.data import check_text
        from kvcal.models import check_model_args

        check_model_args(model, dtype, device)
        if any(i.learns for i, _, _ in jobs):
            check_text(calib["dataset"], "calib", data_dir)
        if evaluate:
            check_text(calib["dataset"], "eval", data_dir)
    loaded = load_model(model, dtype, device, device_map=device_map, max_memory=caps)
    folder = out_dir or Path("artifacts") / loaded.name
    targets = [(instance, out or folder / f"{name}.safetensors") for (instance, _, _), name in zip(jobs, names)]
    started = time.perf_counter()

    def done(instance, target, artifact):
        learned = (f"{len(artifact.tensors)} tensors, {artifact.nbytes() / 1024:.1f} KiB" if artifact.tensors else
                   "no learned tensors: the artifact records the config")
        import torch

        peak = ""
        gpus = [d for d in loaded.devices if d.type == "cuda"]
        if gpus:  # what calibration held on each GPU at most, the model included
            peaks = [f"{torch.cuda.max_memory_allocated(d) / (1 << 30):.1f}" for d in gpus]
            peak = (f", peak GPU memory {peaks[0]} GiB" if len(gpus) == 1 else
                    f", peak GPU memory {' + '.join(peaks)} GiB ({', '.join(str(d) for d in gpus)})")
        console.print(f"wrote {target}  ({instance.name}, {artifact.header['bits_per_element']:.3f} bits/element, "
                      f"{learned}, {time.perf_counter() - started:.1f} s{peak})")

    artifacts = run_calibrations(loaded, targets, calib["dataset"], calib["nsamples"], calib["seqlen"], calib["seed"],
                                 data_dir, int(capture_budget_gb * (1 << 30)), batch_size, capture_cache, done,
                                 resume=resume)
    if evaluate:
        from kvcal.eval.run import compare_with_fp16

        for (instance, target), artifact in zip(targets, artifacts):
            records = compare_with_fp16(loaded, artifact, target, calib["dataset"], data_dir, calib["seqlen"],
                                        eval_nsamples, dtype)
            table = Table("method", "PPL", "bits/elem", title=f"{calib['dataset']} evaluation split, "
                          f"{records[0]['nsamples']} windows of {calib['seqlen']}, gptq protocol")
            for record in records:
                table.add_row(record["method"], f"{record['ppl']:.4f}", f"{record['bits_per_element']:.3f}")
                record["command"] = invoked_command()
                if eval_json_dir is not None:
                    write_json_atomic(Path(eval_json_dir) / f"{record['setting']}.json", record)
            console.print(table)


@eval_app.command("ppl")
def eval_ppl_command(
    model: str | None = typer.Option(None, "--model", "-m", help="Model (default: the artifact model, else smollm2-135m)."),
    artifact: list[Path] | None = typer.Option(None, help="Artifact from kvcal calibrate (repeatable: one model "
                                               "load for all)."),
    method: str | None = typer.Option(None, help="Run a method that learns nothing (baselines) without a file."),
    recipe: str | None = typer.Option(None, help="Like --method, from a recipe."),
    sets: list[str] | None = SetOpt,
    dataset: str = typer.Option("wikitext2", help="wikitext2, shakespeare or a text file."),
    data_dir: str | None = DataDirOpt,
    seqlen: int = typer.Option(2048, help="Tokens per evaluation window."),
    nsamples: int | None = typer.Option(None, help="Number of windows from the start of the split (default: all; more than it holds: all, with a note)."),
    protocol: str = typer.Option("gptq", help="gptq, prefill-decode or tail (full-precision prefix, a block "
                                 "compressed in bulk, a full-precision tail scored alone; simulate mode)."),
    prompt_len: int | None = typer.Option(None, help="prefill-decode: prompt tokens per window (default: seqlen/2)."),
    prefix_len: int | None = typer.Option(None, help="tail: full-precision prefix tokens (default: seqlen/64)."),
    block_len: int | None = typer.Option(None, help="tail: compressed block tokens (default: 3*seqlen/4)."),
    fp_window: int | None = FpWindowOpt,
    batch_size: int = typer.Option(1, help="Windows per forward pass (decode mode: rows of the batch)."),
    mode: str = typer.Option("simulate", help="simulate (whole windows, the gptq emulation) or decode "
                             "(token by token through the real compressed cache)."),
    backend: str = typer.Option("packed", help="decode mode: packed (each method's storage: Triton kernels on CUDA, "
                                "torch references elsewhere), reference (the storages' torch references on any "
                                "device: also the ablations' reconstructions)."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    device_map: str | None = DeviceMapOpt,
    max_memory: str | None = MaxMemoryOpt,
    deterministic: bool = typer.Option(True, "--deterministic/--no-deterministic", help="torch's deterministic "
                                       "mode: the same PPL every run (GPU decode of KVQuant in fp16/bf16 sums its "
                                       "value outliers in fixed point, slower)."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the result record as JSON (one artifact)."),
    json_dir: Path | None = typer.Option(None, help="Write one JSON record per artifact, named after it."),
    compress_local: bool = typer.Option(False, "--compress-local", help="On a model with sliding-window layers "
                                        "(Gemma 2 and 3): compress their windows too, not only the global layers."),
):
    """Perplexity of a compressed model (protocols: the README's Conventions)."""
    from kvcal.eval.run import evaluate_ppl_command
    from kvcal.models.devmap import check_device_map

    device_map, caps = check_device_map(device_map, max_memory, device)
    if json_out and artifact and len(artifact) > 1:
        raise KvcalError("--json takes one artifact; use --json-dir with several")
    stems = [Path(a).stem for a in artifact or []]
    for i, stem in enumerate(stems):
        if json_dir is not None and stem in stems[:i]:
            raise KvcalError(f"--artifact {artifact[stems.index(stem)]} and --artifact {artifact[i]} share the name "
                             f"{stem}: their --json-dir records would overwrite each other (rename one)")
    _positive("--batch-size", batch_size)
    for path, folder, flag in ((json_out, False, "--json"), (json_dir, True, "--json-dir")):
        if path is not None:
            check_writable(path, folder, flag=flag)
    records = evaluate_ppl_command(model, artifact, method, recipe, sets, dataset, data_dir, seqlen, nsamples,
                                   protocol, prompt_len, batch_size, dtype, device, mode, backend, deterministic,
                                   prefix_len, block_len, device_map, caps, fp_window, compress_local)
    table = Table("method", "setting", "protocol", "fp window", "mode", "windows", "tokens", "PPL", "bits/elem")
    for record in records:
        record["command"] = invoked_command()
        table.add_row(record["method"], record["setting"], record["protocol"], str(record["fp_window"]), record["mode"],
                      str(record["nsamples"]), str(record["tokens"]), f"{record['ppl']:.4f}",
                      f"{record['bits_per_element']:.3f}")
    console.print(table)
    first = records[0]
    console.print(f"{first['model']['name']} ({first['dtype']}, {first['device']}) on {first['dataset']['dataset']} "
                  f"{first['dataset']['split']}, seqlen {first['seqlen']}", highlight=False)
    if json_out:
        write_json_atomic(json_out, first)
    if json_dir:
        for record in records:
            write_json_atomic(Path(json_dir) / f"{record['setting']}.json", record)


@eval_app.command("passkey")
def eval_passkey_command(
    model: str | None = typer.Option(None, "--model", "-m", help="Model (default: the artifact model, else smollm2-135m)."),
    artifact: Path | None = typer.Option(None, help="Artifact from kvcal calibrate."),
    method: str | None = typer.Option(None, help="Run a method that learns nothing (baselines) without a file "
                                      "(default fp16)."),
    recipe: str | None = typer.Option(None, help="Like --method, from a recipe."),
    sets: list[str] | None = SetOpt,
    lengths: list[int] | None = typer.Option(None, "--lengths", help="Prompt length in tokens (repeatable; default "
                                             "1024 2048 4096 8192 where the model's max_position_embeddings "
                                             "allows)."),
    depths: list[float] | None = typer.Option(None, "--depths", help="Needle depth in % of the filler (repeatable; "
                                              "default 0 25 50 75 100)."),
    trials: int = typer.Option(5, help="Trials per length x depth cell (each its own seeded key)."),
    seed: int = typer.Option(0, help="Seed of the keys."),
    max_new_tokens: int = typer.Option(8, help="Greedy tokens generated after the question in decode mode; in "
                                       "both modes the positions kept free past the prompt."),
    mode: str = typer.Option("decode", help="decode (prefill, then greedy decoding through kvcal's cache) or "
                             "simulate (the prefill-decode simulation; the answer teacher-forced, correct when "
                             "greedy would emit it)."),
    backend: str = typer.Option("packed", help="decode mode: packed or reference (as eval ppl)."),
    fp_window: int | None = FpWindowOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    device_map: str | None = DeviceMapOpt,
    max_memory: str | None = MaxMemoryOpt,
    json_out: Path | None = typer.Option(None, "--json", help="Write the result record as JSON."),
):
    """Passkey retrieval: accuracy per context length and needle depth (a table: rows lengths, columns depths)."""
    from kvcal.eval.passkey import DEFAULT_DEPTHS, evaluate_passkey_command
    from kvcal.models.devmap import check_device_map

    device_map, caps = check_device_map(device_map, max_memory, device)
    if json_out is not None:
        check_writable(json_out, False, flag="--json")
    depths = [int(d) if float(d).is_integer() else d for d in (depths or DEFAULT_DEPTHS)]
    record = evaluate_passkey_command(model, artifact, method, recipe, sets, list(lengths) if lengths else None,
                                      depths, trials, seed, mode, max_new_tokens, backend, dtype, device,
                                      device_map, caps, fp_window)
    record["command"] = invoked_command()
    table = Table("length", *[f"{d}%" for d in record["depths"]], "all")
    for n in record["lengths"]:
        cells = [c for c in record["cells"] if c["length"] == n]
        table.add_row(str(n), *[f"{c['correct']}/{c['trials']}" for c in cells],
                      f"{sum(c['correct'] for c in cells) / sum(c['trials'] for c in cells):.2f}")
    console.print(table)
    console.print(f"passkey {record['setting']} ({record['mode']}) on {record['model']['name']} ({record['dtype']}, "
                  f"{record['device']}): accuracy {record['accuracy']:.3f}", highlight=False)
    if json_out:
        write_json_atomic(json_out, record)


@app.command("generate")
def generate_command(
    prompt: str = typer.Option(..., help="Text to continue."),
    model: str | None = typer.Option(None, "--model", "-m", help="Model (default: the artifact model, else smollm2-135m)."),
    artifact: Path | None = typer.Option(None, help="Artifact from kvcal calibrate."),
    method: str | None = typer.Option(None, help="A method that learns nothing (fp16, rtn, kivi), without a file."),
    sets: list[str] | None = SetOpt,
    max_new_tokens: int = typer.Option(64, help="Tokens to generate (greedy)."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    device_map: str | None = DeviceMapOpt,
    max_memory: str | None = MaxMemoryOpt,
    backend: str = typer.Option("packed", help="packed (each method's storage: Triton kernels on CUDA, torch references "
                                "elsewhere), or reference (the storages' torch references: also "
                                "the ablations' reconstructions)."),
    graph: bool | None = typer.Option(None, "--graph/--no-graph", help="Replay decode steps from a CUDA graph "
                                      "(default: on CUDA with the packed or fp16 cache; the reference backend runs "
                                      "eagerly). --no-graph: a Python forward per step, as generate() runs it (packed "
                                      "layers still replay their own step from a CUDA graph)."),
    deterministic: bool = typer.Option(False, "--deterministic/--no-deterministic", help="torch's deterministic "
                                       "mode: the same tokens every run (KVQuant in fp16/bf16 on the GPU sums its "
                                       "value outliers in fixed point, slower)."),
):
    """Generate greedily with the compressed cache; print the text, the cache size against fp16 and the decode speed."""
    from kvcal.determinism import deterministic_algorithms
    from kvcal.generate import generate_text
    from kvcal.models.devmap import check_device_map

    device_map, caps = check_device_map(device_map, max_memory, device)
    if not prompt:
        raise KvcalError("--prompt is empty")
    if artifact is not None and method is not None:
        raise KvcalError("give either --artifact or --method, not both")
    mode = "auto" if graph is None else ("graph" if graph else "eager")
    with deterministic_algorithms(deterministic):
        result = generate_text(prompt, model, artifact, method, sets, max_new_tokens, dtype, device, backend, mode,
                               device_map, caps)
    console.print(result["text"], highlight=False, markup=False)
    console.print(f"\n[dim]{result['summary']}[/dim]", highlight=False)


@app.command("report")
def report_command(
    records: list[Path] | None = typer.Argument(None, help="JSON records written by `kvcal eval ppl --json/--json-dir`."),
    commands: bool = typer.Option(False, help="Add the command that produced each number."),
    docs: bool = typer.Option(False, "--docs", help="Regenerate the pages that the manifest lists (docs/results.md) "
                              "from the records it names."),
    check: bool = typer.Option(False, "--check", help="Write nothing; exit 1 when a committed page differs from what "
                               "its records give (what CI runs)."),
    plot: Path | None = typer.Option(None, "--plot", help="Write the Pareto chart (PNG; needs the [plot] extra: "
                                     "matplotlib) of the records given (an fp16 record among them), one front per "
                                     "full-precision allowance; without records, of the manifest's `plot` points."),
    manifest: Path | None = typer.Option(None, help="The manifest of the pages (--docs, --check) and of the chart "
                                         "(--plot without records); its paths are relative to the folder above its "
                                         "own."),
):
    """Print JSON result records as one markdown table (PPL relative to an fp16 record when present), or regenerate
    the pages a manifest lists (--docs), check them (--check) or draw its Pareto chart (--plot); with `kvcal eval
    passkey` records, --plot draws their length x depth grids."""
    from kvcal.eval.report import (
        draw_pareto,
        markdown_table,
        plot_pareto,
        plot_passkey,
        read_passkey_record,
        read_record,
        record_points,
        write_docs,
    )

    if not (records or docs or check or plot):
        raise KvcalError("give JSON records, --docs, --check or --plot")
    if (docs or check or (plot is not None and not records)) and manifest is None:
        raise KvcalError("--docs, --check and --plot without records read a manifest: pass --manifest FILE")
    if manifest is not None and not (docs or check or (plot is not None and not records)):
        raise KvcalError("--manifest applies to --docs, --check and --plot without records (records given are "
                         "tabulated or drawn as they are)")
    passkeys = [read_passkey_record(p) for p in records or []]
    if any(passkeys):
        if not all(passkeys):
            raise KvcalError("report: give passkey records (kvcal eval passkey) or ppl records, not both")
        if plot is None or docs or check:
            raise KvcalError("report: passkey records are drawn with --plot FILE.png (their grid)")
        check_plot(plot)
        plot_passkey(passkeys, plot)
        console.print(f"wrote {plot}", highlight=False)
        return
    if plot is not None:
        check_plot(plot)
        if records:  # the records given; without any, the manifest's chart
            draw_pareto(*record_points([read_record(p) for p in records]), plot)
        else:
            plot_pareto(manifest, plot)
        console.print(f"wrote {plot}", highlight=False)
    if docs or check:
        differ = write_docs(manifest, check=check)
        if check and differ:
            make_console(stderr=True).print(f"{', '.join(differ)} differs from its records: run `kvcal report --docs --manifest {manifest}`",
                                            markup=False, highlight=False)
            raise typer.Exit(1)
        if not check:
            console.print(f"rewrote {', '.join(differ)}" if differ else "docs up to date", highlight=False)
    if records:
        console.print(markdown_table([read_record(p) for p in records], commands), markup=False, highlight=False,
                      soft_wrap=True)


@bench_app.command("generate")
def bench_generate_command(
    model: str = typer.Option("random-llama-3.1-8b", "--model", "-m", help="Model (random weights are fine: speed only)."),
    recipe: list[str] | None = typer.Option(None, help="Baseline recipe to benchmark (repeatable; fp16 when neither "
                                            "--recipe nor --artifact is given)."),
    artifact: list[Path] | None = typer.Option(None, help="Artifact to benchmark (repeatable)."),
    context: int = typer.Option(32768, help="Tokens already in the cache of every row."),
    batch: list[int] | None = typer.Option(None, help="Batch sizes to time (repeatable; default 1 and 8)."),
    steps: int = typer.Option(16, help="Timed decode steps."),
    mode: list[str] | None = typer.Option(None, help="eager (a Python forward per step, as generate() runs it: each "
                                          "packed layer replays its own step from a CUDA graph), eager-launch (the "
                                          "same with every kernel launched from Python) and/or graph (one captured "
                                          "CUDA graph of the whole step; settings whose steps are static). Repeatable; "
                                          "default eager and graph."),
    max_batch: bool = typer.Option(True, help="Also search the largest batch at which every mode fits and decodes "
                                   "--steps steps at this context (exact to one row), and time it."),
    dtype: str = typer.Option("bfloat16", help="Model dtype."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the records as JSON."),
):
    """Decode tokens/s and cache memory at long context, fp16 cache vs each setting, and the largest batch."""
    import torch

    from kvcal.artifact import load_artifact
    from kvcal.methods.registry import storages_for_artifact
    from kvcal.models import load_model
    from kvcal.recipes import resolve
    from kvcal.runtime.bench_generate import MODES, capture_refusal, largest_batch, run_case_or_oom

    if json_out is not None:
        check_writable(json_out, folder=False, flag="--json")
    modes = mode or ["eager", "graph"]
    for m in modes:
        if m not in MODES:
            raise KvcalError(f"unknown mode '{m}' ({', '.join(MODES)})")
    _positive("--context", context)
    _positive("--steps", steps)
    for b in batch or []:
        _positive("--batch", b)
    if not torch.cuda.is_available():
        raise KvcalError("kvcal bench generate needs a CUDA device")
    loaded = load_model(model, dtype, "cuda")
    cases = []
    for name in recipe or ([] if artifact else ["fp16"]):  # fp16 alone when nothing is named
        method, tag, _ = resolve(None, name, None)  # a method that learns gets random tables (speed only)
        cases.append((name, method, method.build_storages(method.synthetic_tensors(loaded.dims), loaded.dims)))
    for path in artifact or []:
        method, storages = storages_for_artifact(load_artifact(path), loaded, path)
        cases.append((Path(path).stem, method, storages))
    records, largest, tries, not_captured = [], {}, {}, {}
    table = Table("codec", "mode", "batch", "tokens/s", "ms/step", "cache GiB", "predicted GiB", "cache/pred",
                  "peak GiB")

    def add_row(r: dict, largest_mark: str = "") -> None:
        if r.get("out_of_memory"):
            table.add_row(r["codec"], r["mode"], str(r["batch"]), "out of memory", *[""] * 5)
            return
        table.add_row(r["codec"], r["mode"], f"{r['batch']}{largest_mark}", f"{r['tokens_per_s']:.1f}",
                      f"{r['ms_per_step']:.2f}", f"{r['cache_bytes'] / 2**30:.2f}",
                      f"{r['cache_bytes_predicted'] / 2**30:.2f}", f"{r['cache_vs_prediction']:.3f}",
                      f"{r['peak_bytes_beyond_weights'] / 2**30:.2f}")

    for name, method, storages in cases:
        case_modes = list(modes)
        refusal = capture_refusal(loaded, storages) if "graph" in modes else None
        if refusal:
            not_captured[name] = refusal
            case_modes.remove("graph")
        for b in batch or [1, 8]:
            for m in case_modes:
                r, oom = run_case_or_oom(loaded, name, method, storages, b, context, steps, mode=m)
                if r is None:
                    r = {"codec": name, "mode": MODES[m], "batch": b, "context": context, "out_of_memory": True,
                         "error": oom}
                records.append(r)
                add_row(r)
        if max_batch:  # the same steps and modes as the timed cases: the largest batch at which they all run
            tries[name] = []
            largest[name], at_largest = largest_batch(
                loaded, name, method, storages, context, [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256],
                tries[name], steps=steps, modes=tuple(case_modes))
            for r in at_largest:
                r["largest_batch"] = True
                records.append(r)
                add_row(r, " (largest)")
    console.print(table)
    for name, refusal in not_captured.items():
        console.print(f"{name}: eager only ({refusal})", markup=False, highlight=False)
    if largest:
        console.print("largest batch at context " + str(context) + ": " + ", ".join(f"{k} {v}" for k, v in largest.items()))
    if json_out:
        write_json_atomic(json_out, {"device": torch.cuda.get_device_name(), "model": model, "dtype": dtype,
                                     "context": context, "records": records, "largest_batch": largest,
                                     "largest_batch_tries": tries,
                                     "not_captured": not_captured,
                                     "command": invoked_command()})


DECODE_BENCH_RECIPES = ("rtn-int4", "rtn-int2", "kivi-4bit", "kivi-2bit", "kvquant-nuq4-1pct")


@bench_app.command("decode")
def bench_decode_command(
    recipe: list[str] | None = typer.Option(None, help="Recipe to benchmark (repeatable; any registered method: one "
                                            "that learns gets random tables of the right shapes). Default: "
                                            "rtn-int4, rtn-int2, kivi-4bit, kivi-2bit, kvquant-nuq4-1pct."),
    artifact: list[Path] | None = typer.Option(None, help="Artifact to benchmark (repeatable; calibrated for "
                                               "Llama-3.1-8B shapes)."),
    sets: list[str] | None = SetOpt,
    context: list[int] | None = typer.Option(None, help="Context lengths (repeatable; default 4096, 16384, 32768, 131072)."),
    batch: list[int] | None = typer.Option(None, help="Batch sizes (repeatable; default 1, 8, 32)."),
    dtype: str = typer.Option("bfloat16", help="bfloat16 or float16 queries and fp window."),
    window: int = typer.Option(128, help="Full-precision tokens of each kvcal cache."),
    rep: int = typer.Option(100, help="do_bench repetition time in ms."),
    graph: bool = typer.Option(True, "--graph/--no-graph",
                               help="Time CUDA-graph replays (GPU time, the default) or eager calls (adds host launch cost)."),
    flush: str = typer.Option("write", help="L2 flush before each timed call: 'write' (do_bench's: zeroes 256 MB, "
                                             "leaving the L2 dirty) or 'read' (sums 256 MB, leaving it clean)."),
    naive: bool = typer.Option(True, "--naive/--no-naive",
                               help="Also time each method's naive step on the same cache: the whole cache "
                                    "dequantized in torch, then SDPA (the 'x vs naive' column)."),
    json_out: Path | None = typer.Option(None, "--json", help="JSON path (default bench-decode-DEVICE.json in the current folder)."),
):
    """Per-layer decode attention at Llama-3.1-8B shapes: bf16 SDPA vs each method's packed storage and vs its naive
    torch step (dequantize everything, then SDPA), same run."""
    import torch

    from kvcal.accounting import bits_per_element
    from kvcal.bench import bench_cases
    from kvcal.models import ModelDims
    from kvcal.models.tiny import llama31_8b_config
    from kvcal.runtime import bench

    if dtype not in ("bfloat16", "float16"):
        raise KvcalError(f"--dtype must be bfloat16 or float16, got {dtype}")
    if flush not in bench.FLUSHES:
        raise KvcalError(f"--flush must be one of {', '.join(bench.FLUSHES)}, got {flush}")
    for flag, values in (("--context", context), ("--batch", batch), ("--rep", [rep])):
        for v in values or ():
            _positive(flag, v)
    if window < 0:
        raise KvcalError(f"--window must be >= 0, got {window}")
    if json_out is not None:
        check_writable(json_out, folder=False, flag="--json")
    dims = ModelDims.from_config(llama31_8b_config())
    cases = [(name, storages, bits_per_element(method, dims).bits_per_element) for name, method, storages in
             bench_cases(recipe or ([] if artifact else DECODE_BENCH_RECIPES), artifact or [], dims, sets)]
    for name, storages, _ in cases:
        refusal = "it compresses nothing" if storages.lossless else storages.kernel_refusal()
        if refusal:
            raise KvcalError(f"{name} has no packed kernels to benchmark: {refusal}")
    if not torch.cuda.is_available():
        raise KvcalError("kvcal bench decode needs a CUDA device")
    result = bench.run_decode_bench(
        cases, contexts=tuple(context or (4096, 16384, 32768, 131072)), batches=tuple(batch or (1, 8, 32)), dims=dims,
        dtype=getattr(torch, dtype), window=window, rep=rep, graph=graph, flush=flush, naive=naive)
    result["command"] = invoked_command()
    out = json_out or Path(f"bench-decode-{bench.device_slug(result['device'])}.json")
    write_json_atomic(out, result)
    console.print(bench.format_table(result), markup=False, highlight=False, soft_wrap=True)
    console.print(f"{result['device']}, device-to-device copy {result['copy_gbps']:.0f} GB/s; wrote {out}")


@app.command("search")
def search_command(
    model: str = ModelOpt,
    bits: float | None = typer.Option(None, help="Budget in bits per element, everything counted (at --context "
                                      "tokens, default --seqlen: what the evaluated cache holds)."),
    memory: float | None = typer.Option(None, help="Budget in GiB of KV cache for --context tokens x --batch rows "
                                        "(instead of --bits)."),
    context: int | None = typer.Option(None, help="Tokens the budget is counted at (--memory: needed)."),
    batch: int = typer.Option(1, "--batch", help="--memory: rows of --context tokens the cache holds."),
    methods: str | None = typer.Option(None, help="Only these methods, comma-separated (e.g. kivi,kvquant)."),
    ablations: bool = typer.Option(False, "--ablations", help="Also the ablation recipes (recipes/ablations/)."),
    dataset: str = typer.Option("wikitext2", help="wikitext2, shakespeare or a text file (calibration and "
                                "evaluation splits of it)."),
    data_dir: str | None = DataDirOpt,
    nsamples: int = typer.Option(16, help="Calibration windows."),
    seqlen: int = typer.Option(2048, help="Tokens per window (calibration and evaluation)."),
    seed: int = typer.Option(0, help="Seed of the calibration window sampler."),
    eval_nsamples: int | None = typer.Option(None, help="Evaluation windows (default: --nsamples)."),
    protocol: str = typer.Option("gptq", help="gptq, prefill-decode or tail (docs/conventions.md)."),
    prompt_len: int | None = typer.Option(None, help="prefill-decode: prompt tokens (default: seqlen/2)."),
    prefix_len: int | None = typer.Option(None, help="tail: full-precision prefix (default: seqlen/64)."),
    block_len: int | None = typer.Option(None, help="tail: compressed block (default: 3*seqlen/4)."),
    fp_window: int | None = FpWindowOpt,
    out: Path | None = typer.Option(None, help="Folder for the candidates' artifacts and records, search.json and "
                                    "the chosen artifact (default: search/MODEL); a re-run reuses what it holds."),
    time_budget: str | None = typer.Option(None, help="Start no candidate after this long (900, 15m, 2h)."),
    plot: Path | None = typer.Option(None, help="Draw bits against perplexity, the front joined (PNG)."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    capture_budget_gb: float = typer.Option(4.0, help="RAM for captured activations before spilling to disk."),
    batch_size: int = typer.Option(1, help="Windows per forward pass."),
    passkey: bool = typer.Option(False, "--passkey", help="Also run the passkey grid (as kvcal eval passkey) on fp16 "
                                 "and every measured candidate: its accuracy in the table and search.json."),
    passkey_lengths: list[int] | None = typer.Option(None, "--passkey-lengths", help="--passkey: prompt length in "
                                                     "tokens (repeatable; default --seqlen, cut to the model's "
                                                     "max_position_embeddings less the generated tokens)."),
    passkey_depths: list[float] | None = typer.Option(None, "--passkey-depths", help="--passkey: needle depth in % "
                                                      "of the filler (repeatable; default 0 25 50 75 100)."),
    passkey_trials: int | None = typer.Option(None, "--passkey-trials", help="--passkey: trials per length x depth "
                                              "cell (default 2)."),
    passkey_seed: int | None = typer.Option(None, "--passkey-seed", help="--passkey: seed of the keys (default 0)."),
    passkey_mode: str | None = typer.Option(None, "--passkey-mode", help="--passkey: simulate (default: the "
                                            "prefill-decode simulation, as the search's perplexity is simulated) or "
                                            "decode (through kvcal's cache, several times slower on a CPU)."),
    passkey_max_new_tokens: int | None = typer.Option(None, "--passkey-max-new-tokens", help="--passkey: greedy "
                                                      "tokens generated in decode mode (default 8)."),
    passkey_backend: str | None = typer.Option(None, "--passkey-backend", help="--passkey decode mode: packed "
                                               "(default) or reference."),
    min_passkey: float | None = typer.Option(None, "--min-passkey", help="Choose no candidate whose passkey accuracy "
                                             "(mean over the grid, 0-1) is below this (needs --passkey); default: "
                                             "the lowest perplexity whatever its passkey accuracy."),
    speed: bool | None = typer.Option(None, "--speed/--no-speed", help="Also time decoding (tokens/s through the "
                                      "model and the packed cache, as kvcal bench generate) of fp16 and every measured "
                                      "candidate; default: on with a CUDA device, off on a CPU."),
    speed_context: int = typer.Option(4096, "--speed-context", help="--speed: synthetic tokens in every row's cache."),
    speed_batch: int = typer.Option(1, "--speed-batch", help="--speed: rows decoded together."),
    speed_steps: int = typer.Option(32, "--speed-steps", help="--speed: timed decode steps."),
    speed_dtype: str = typer.Option("bfloat16", "--speed-dtype", help="--speed: the dtype the model decodes in "
                                    "(bfloat16, float16 or float32); one other than --dtype loads the model again."),
):
    """The best recipe for this model at this budget, chosen by measurement: every recipe that fits is calibrated and
    evaluated on held-out windows, on equal footing (--passkey: and runs the passkey grid); prints the Pareto front
    and writes the chosen artifact."""
    from kvcal.data import check_text
    from kvcal.eval.ppl import PROTOCOLS
    from kvcal.eval.simulate import tail_layout
    from kvcal.models import check_model_args, load_model
    from kvcal.models.dims import DimsNeedTheModel, model_dims
    from kvcal.search import (
        PasskeyGrid,
        Plan,
        SpeedSetting,
        check_methods,
        check_passkey,
        check_speed,
        list_candidates,
        make_budget,
        parse_duration,
        plot_front,
        run_search,
    )

    _positive("--nsamples", nsamples)
    _positive("--seqlen", seqlen)
    _positive("--batch-size", batch_size)
    eval_nsamples = nsamples if eval_nsamples is None else eval_nsamples
    _positive("--eval-nsamples", eval_nsamples)
    if protocol not in PROTOCOLS:
        raise KvcalError(f"unknown protocol '{protocol}' (choose from {', '.join(PROTOCOLS)})")
    if fp_window is not None and fp_window < 0:
        raise KvcalError(f"--fp-window must be >= 0, got {fp_window}")
    if not math.isfinite(capture_budget_gb) or capture_budget_gb <= 0:
        raise KvcalError(f"--capture-budget-gb must be a positive number, got {capture_budget_gb}")
    if seed < 0:
        raise KvcalError(f"--seed must be >= 0, got {seed}")
    plan = Plan(model, dtype, device, dataset, data_dir, nsamples, seqlen, seed, eval_nsamples, protocol,
                fp_window=fp_window, batch_size=batch_size, capture_budget_bytes=int(capture_budget_gb * (1 << 30)))
    if protocol == "prefill-decode":
        plan.prompt_len = seqlen // 2 if prompt_len is None else prompt_len
        if not 1 <= plan.prompt_len <= seqlen - 2:
            raise KvcalError(f"--prompt-len must be in [1, seqlen-2], got {plan.prompt_len}")
    elif prompt_len is not None:
        raise KvcalError("--prompt-len applies to --protocol prefill-decode only")
    if protocol == "tail":
        plan.prefix_len, plan.block_len = tail_layout(seqlen, prefix_len, block_len)
        plan.prompt_len = plan.prefix_len + plan.block_len
    elif prefix_len is not None or block_len is not None:
        raise KvcalError("--prefix-len and --block-len apply to --protocol tail only")
    wanted = [m.strip() for m in methods.split(",") if m.strip()] if methods else None
    check_methods(wanted)
    grid_flags = {"--passkey-lengths": passkey_lengths, "--passkey-depths": passkey_depths,
                  "--passkey-trials": passkey_trials, "--passkey-seed": passkey_seed, "--passkey-mode": passkey_mode,
                  "--passkey-max-new-tokens": passkey_max_new_tokens, "--passkey-backend": passkey_backend}
    given = [flag for flag, value in grid_flags.items() if value is not None]
    if given and not passkey:
        raise KvcalError(f"{given[0]} applies with --passkey only")
    grid = None
    if passkey:
        grid = PasskeyGrid(lengths=list(passkey_lengths) if passkey_lengths else None)
        if passkey_depths:
            grid.depths = [int(d) if float(d).is_integer() else d for d in passkey_depths]
        for name, value in (("trials", passkey_trials), ("seed", passkey_seed), ("mode", passkey_mode),
                            ("max_new_tokens", passkey_max_new_tokens), ("backend", passkey_backend)):
            if value is not None:
                setattr(grid, name, value)
    check_passkey(grid, min_passkey)
    seconds = parse_duration(time_budget)
    on_cpu = device == "cpu" or (device == "auto" and not _cuda_available())
    timing = None
    if speed or (speed is None and not on_cpu):
        timing = SpeedSetting(speed_context, speed_batch, speed_steps, speed_dtype)
    elif SpeedSetting(speed_context, speed_batch, speed_steps, speed_dtype) != SpeedSetting():
        raise KvcalError("--speed-context, --speed-batch, --speed-steps and --speed-dtype apply with --speed (a CUDA "
                         "device) only")
    check_speed(timing, on_cpu)
    check_model_args(model, dtype, device)

    def plan_candidates(dims):
        budget = make_budget(dims, bits, memory, context, batch, seqlen)
        candidates, skipped = list_candidates(dims, budget, plan, wanted, ablations, on_cpu)
        if not candidates:
            over = [s for s in skipped if "bits" in s and s["reason"].endswith("over the budget")]
            left_out = [s for s in skipped if "bits" in s and s not in over]  # they fit: left out on a CPU
            if left_out:
                raise KvcalError(f"no recipe is searched at {budget.bits:.3f} bits per element on {model}: "
                                 f"{', '.join(s['recipe'] for s in left_out)} {'fits' if len(left_out) == 1 else 'fit'} but "
                                 f"{left_out[0]['reason']}")
            fewest = min(over, key=lambda s: s["bits"]) if over else None
            raise KvcalError(f"no recipe fits {budget.bits:.3f} bits per element on {model}" + (
                f" (the fewest: {fewest['recipe']}, {fewest['bits']:.3f})" if fewest else "") +
                (f" among --methods {methods}" if wanted else ""))
        return budget, candidates, skipped

    try:  # the shapes without loading the model, so that a budget nothing fits is said before it loads
        planned = plan_candidates(model_dims(model))
    except DimsNeedTheModel:
        planned = None  # a Hub model or a GGUF in parts: its shapes come with it
    folder = out or Path("search") / Path(model).name
    check_writable(folder, folder=True, flag="--out")
    if plot is not None:
        check_plot(plot)
    check_text(dataset, "calib", data_dir)
    check_text(dataset, "eval", data_dir)
    loaded = load_model(model, dtype, device)
    budget, candidates, skipped = planned or plan_candidates(loaded.dims)
    result = run_search(loaded, plan, budget, candidates, skipped, folder, seconds, invoked_command(), grid,
                        min_passkey, timing)

    def accuracy(row):
        if row.get("passkey_error"):
            return "failed"
        return "-" if row["passkey_accuracy"] is None else f"{row['passkey_accuracy']:.2f}"

    def tokens(row):
        if row.get("speed_error"):
            return "failed"
        if row.get("tokens_per_s") is None:
            return "-"
        ratio = "" if row.get("x_fp16_speed") is None else f" ({row['x_fp16_speed']:.2f}x)"
        return f"{row['tokens_per_s']:.0f}{ratio}"

    reference = f"fp16 PPL {result['fp16']['ppl']:.4f}" + (f", passkey {accuracy(result['fp16'])}" if grid else "") + (
        f", {tokens(result['fp16'])} tokens/s at {timing.context} x {timing.batch} in {timing.dtype}" if timing else "")
    table = Table("recipe", "method", "bits/elem", "PPL", "vs fp16", *(["passkey"] if grid else []),
                  *(["tokens/s (x fp16)", "speed front"] if timing else []), "front", "status",
                  title=f"{model}: {len(candidates)} candidates at <= {budget.bits:.3f} bits per element, "
                  f"{protocol} protocol ({reference})")
    chosen = (result["chosen"] or {}).get("recipe")
    for row in sorted(result["candidates"], key=lambda r: (r["bits"], r["recipe"])):
        table.add_row(("* " if row["recipe"] == chosen else "") + row["recipe"], row["method"], f"{row['bits']:.3f}",
                      "-" if row["ppl"] is None else f"{row['ppl']:.4f}",
                      "-" if row["increase_pct"] is None else f"{row['increase_pct']:+.2f}%",
                      *([accuracy(row)] if grid else []),
                      *([tokens(row), "yes" if row.get("on_speed_front") else ""] if timing else []),
                      "yes" if row["on_front"] else "", row["status"])
    console.print(table)
    console.print(f"covered {result['covered']}; rule: {result['rule']}", soft_wrap=True)
    if result["chosen"] is None:
        scored = [r for r in result["candidates"] if r["ppl"] is not None and r.get("passkey_accuracy") is not None]
        if min_passkey is not None and any(r["ppl"] is not None for r in result["candidates"]):
            best = max(scored, key=lambda r: (r["passkey_accuracy"], -r["ppl"]), default=None)
            raise KvcalError(f"no measured candidate reaches --min-passkey {min_passkey}" + (
                f" (the highest: {best['recipe']}, {best['passkey_accuracy']:.3f})" if best else "") +
                f"; record: {folder / 'search.json'}")
        raise KvcalError("the time budget ended before any candidate was measured: run again with a larger one")
    console.print(f"chosen: {chosen} (PPL {result['chosen']['ppl']:.4f}, {result['chosen']['bits']:.3f} bits per "
                  f"element" + (f", passkey {accuracy(result['chosen'])}" if grid else "") +
                  f") -> {result['chosen']['artifact']}; record: {folder / 'search.json'}", soft_wrap=True)
    if plot is not None:
        plot_front(result, plot)
        console.print(f"wrote {plot}")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@app.command("inspect")
def inspect_command(path: Path = typer.Argument(..., help="Artifact file."),
                    show_all: bool = typer.Option(False, "--all", help="Every tensor and every calibration "
                                                  "diagnostic (default: a summary per tensor kind).")):
    """Check an artifact and print its header, tensors, sizes and bits per element."""
    import re
    from collections import defaultdict

    from kvcal.artifact import load_artifact
    from kvcal.methods.registry import check_artifact

    art = load_artifact(path)
    check_artifact(art, path)
    h = art.header
    m = h["model"]
    console.print(f"[bold]{path}[/bold]")
    console.print(f"method       {h['method']}  {json.dumps(h['config'], sort_keys=True)}")
    console.print(f"model        {m['name']} ({m['family']}, {m['num_layers']} layers, {m['num_heads']} heads, "
                  f"{m['num_kv_heads']} KV heads, head_dim {m['head_dim']}, rope {m['rope']['rope_type']} "
                  f"theta {m['rope']['theta']:g})  source {json.dumps(m['source'], sort_keys=True)}")
    cal = h.get("calibration")
    console.print("calibration  " + (json.dumps(cal, sort_keys=True) if cal else "none (the method learns nothing)"))
    bits = h.get("bits", {})
    parts = ", ".join(f"{k} {v:.3f}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in bits.get("parts", {}).items())
    per_element = h.get("bits_per_element")
    console.print(f"bits/element {per_element if per_element is None else f'{per_element:.4f}'} at "
                  f"{bits.get('tokens')} tokens  ({parts})")
    console.print(f"artifact     {len(art.tensors)} tensors, {art.nbytes()} bytes (static, not per token)")
    console.print(f"kvcal        {h.get('kvcal_version')}, schema {h['schema_version']}, "
                  f"tensor sha256 {str(h['tensor_hash'])[:16]}")
    long = []
    for key, value in sorted((h.get("info") or {}).items()):
        text = json.dumps(value, sort_keys=True)
        if show_all or len(text) <= 160:
            console.print(f"info         {key}: {text}")
        else:
            long.append(key)
    if long:
        console.print(f"info         {len(long)} longer diagnostics (--all prints them): {', '.join(long)}")
    if not art.tensors:
        return
    if show_all:
        table = Table("tensor", "dtype", "shape", "bytes")
        for name in sorted(art.tensors, key=_natural):
            t = art.tensors[name]
            table.add_row(name, str(t.dtype).removeprefix("torch."), str(list(t.shape)), str(t.numel() * t.element_size()))
        console.print(table)
        return
    kinds = defaultdict(list)  # layers.{i}.{part}.{name} -> kind {part}.{name}, its layers
    for name, t in art.tensors.items():
        match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        kinds[match.group(2) if match else name].append((int(match.group(1)) if match else None, t))
    table = Table("tensor kind", "layers", "dtype", "shape", "bytes")
    for kind in sorted(kinds, key=_natural):
        entries = kinds[kind]
        layers = sorted(i for i, _ in entries if i is not None)
        shapes = {tuple(t.shape) for _, t in entries}
        dtypes = {str(t.dtype).removeprefix("torch.") for _, t in entries}
        span = (f"{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else
                ",".join(map(str, layers))) if layers else "-"
        table.add_row(kind, span, "/".join(sorted(dtypes)), str(list(shapes.pop())) if len(shapes) == 1 else "varies",
                      str(sum(t.numel() * t.element_size() for _, t in entries)))
    console.print(table)
    console.print(f"{len(art.tensors)} tensors in {len(kinds)} kinds (--all lists every tensor)")


@app.command("compare")
def compare_command(
    a: Path = typer.Argument(..., help="Artifact to check."),
    b: Path = typer.Argument(..., help="Reference artifact (relative differences are taken against it)."),
    rtol: float = typer.Option(0.0, help="Relative tolerance of every tensor kind not given by --tol."),
    atol: float = typer.Option(0.0, help="Absolute tolerance of every tensor kind not given by --tol."),
    tol: list[str] = typer.Option([], "--tol", help="Tolerance of one tensor kind: KIND=RTOL,ATOL (repeatable; kinds: "
                                  "codebook, datatype, svd_left, svd_right, spectrum, range, index, weights, tensor, "
                                  "diagnostic)."),
    show_all: bool = typer.Option(False, "--all", help="Also list the diagnostics that differ (never a failure)."),
):
    """Diff two artifacts by what each tensor is; exit 1 if they differ beyond tolerance, 0 otherwise.

    The summary line comes first. Codebooks are compared up to a permutation of their codewords, SVD factors up to
    sign, datatypes as sorted sets (the kinds the header records); header fields must match exactly apart from
    provenance (device, software versions) and where a local model was found."""
    from kvcal.artifact import load_artifact
    from kvcal.compare import Tolerance, compare_artifacts, parse_tolerances

    for flag, value in (("--rtol", rtol), ("--atol", atol)):
        if not value >= 0 or not math.isfinite(value):  # nan fails both
            raise KvcalError(f"{flag} must be a finite number >= 0, got {value}")
    tolerances = parse_tolerances(tol)
    result = compare_artifacts(load_artifact(a), load_artifact(b), tolerances, Tolerance(rtol, atol))
    console.print(result.summary(), highlight=False)
    shown = result.differences if show_all else result.failures
    if shown:
        table = Table("where", "kind", "difference")
        for d in shown:
            table.add_row(d.where, d.kind + ("" if d.fails else " (not counted)"), d.what)
        console.print(table)
    raise typer.Exit(1 if result.failures else 0)


@app.command("gate")
def gate_command(
    record: Path = typer.Argument(..., help="Eval record to check (kvcal eval ppl --json)."),
    baseline: Path = typer.Option(..., "--baseline", help="Baseline eval record of the same model, data and protocol."),
    max_increase: float = typer.Option(..., "--max-increase", help="Largest perplexity increase allowed, percent."),
    max_bits_increase: float = typer.Option(0.0, "--max-bits-increase",
                                            help="Largest growth of bits per element allowed."),
):
    """CI quality gate: exit 0 when the record's perplexity and bits per element are within the limits of the
    baseline's, 1 when either regressed, 2 when the two records did not measure the same thing (one line each)."""
    from kvcal.eval.gate import MISMATCH, gate_files

    verdict = gate_files(record, baseline, max_increase, max_bits_increase)
    if verdict.code == MISMATCH:  # not a verdict on the numbers: an error, one line on stderr
        raise KvcalError(verdict.message)
    console.print(verdict.message, highlight=False, soft_wrap=True)
    raise typer.Exit(verdict.code)


def invoked_command() -> str:
    """The command line as the user typed it (recorded in result JSON for reproducibility)."""
    import shlex

    return "kvcal " + shlex.join(sys.argv[1:])


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in name.replace(".", " ").split()]


def _positive(flag: str, value: int) -> None:
    if value <= 0:
        raise KvcalError(f"{flag} must be positive, got {value}")


def check_plot(path: Path) -> None:
    """--plot's file, before any work: a format matplotlib writes from its name, matplotlib installed, a path that can
    be written."""
    if Path(path).suffix.lower() not in PLOT_FORMATS:
        raise KvcalError(f"--plot {path}: name a {', '.join(PLOT_FORMATS)} file (the format follows the name)")
    if importlib.util.find_spec("matplotlib") is None:
        raise KvcalError("--plot needs matplotlib: pip install 'kvcal[plot]'")
    check_writable(path, folder=False, flag="--plot")


PLOT_FORMATS = (".png", ".pdf", ".svg")


def check_writable(path: Path, folder: bool, permission: bool = True, flag: str | None = None) -> None:
    """One-line errors naming the flag, before any long work, for an output path kvcal could not write: a file path
    that is a folder, a folder path that is a file, a parent that is a file, or (permission) a place where no file
    can be created (probed by creating and deleting a temporary file in the nearest existing folder: permission
    bits alone say yes to root, and /proc or a read-only mount refuse anyway)."""
    path = Path(path)
    where = f"{flag} {path}" if flag else str(path)
    if not str(path).strip():
        raise KvcalError(f"{flag or 'an output path'} is empty")
    if path.exists() and path.is_dir() != folder:
        raise KvcalError(f"{where} is {'a file' if folder else 'a folder'}; expected {'a folder' if folder else 'a file path'}")
    existing = path if folder and path.is_dir() else path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise KvcalError(f"cannot write {where}: {existing} is a file, not a folder")
    if permission:
        try:
            fd, probe = tempfile.mkstemp(prefix=".kvcal-write-check.", dir=existing)
        except OSError as exc:
            raise KvcalError(f"cannot write {where}: {exc.strerror or type(exc).__name__} in {existing}") from None
        os.close(fd)
        os.unlink(probe)


def write_json_atomic(path: Path, record: dict) -> None:
    """A record where kvcal can write it (check_writable's one-line errors), written atomically."""
    from kvcal.artifact import write_json

    check_writable(Path(path), folder=False)
    write_json(path, record)


# artifacts and records are written to a temporary file and renamed: an interrupted command leaves none half-written
INTERRUPTED = "nothing written (no artifact or record of this command is left half-written)"

# click's exception base, whether typer re-exports click's (typer < 0.20) or its own vendored copy
_CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def main() -> None:
    """Exit codes: 0 ok (compare: identical), 1 compare found differences, 2 bad input or an environment problem
    (one line on stderr), 3 an unexpected error (one line), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM: handled
    as Ctrl-C is); KVCAL_DEBUG=1 shows the traceback of any error instead."""
    terminated = _sigterm_as_interrupt()
    try:
        # not standalone: click's usage errors reach us instead of being drawn as a multi-line box
        code = app(standalone_mode=False)  # typer.Exit(n) returns n here; commands return None
        # typer >= 0.2x turns Ctrl-C into Exit(130) itself, silently: said below
    except Exception as exc:
        code = _report(exc)
    except KeyboardInterrupt:
        code = 130
    if code == 130:
        if terminated:
            make_console(stderr=True).print(f"[red]terminated (SIGTERM):[/red] {INTERRUPTED}")
            code = 143
        else:
            make_console(stderr=True).print(f"[red]interrupted:[/red] {INTERRUPTED}")
    sys.exit(code if isinstance(code, int) else 0)


def _sigterm_as_interrupt() -> list:
    """SIGTERM (`kill`, a job scheduler, a machine being taken back) stops a command as Ctrl-C does: a calibration
    keeps its checkpoints and says how to resume, nothing is left half-written. Also where SIGINT is ignored (a job
    started in the background of a shell). Returns the list the handler marks when SIGTERM came."""
    import signal
    import threading

    seen: list[int] = []

    def handler(signum, frame):
        seen.append(signum)
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():  # signal handlers belong to the main thread
        signal.signal(signal.SIGTERM, handler)
    return seen


def _report(exc: Exception) -> int:
    """Print `exc` as one line on stderr and return its exit code (re-raise it under KVCAL_DEBUG=1)."""
    err = make_console(stderr=True)
    if type(exc).__name__ == "NoArgsIsHelpError":  # click >= 8.2: a group called without a command
        exc.show()
        return exc.exit_code
    if isinstance(exc, typer.Abort):  # click turns Ctrl-C (and EOF at a prompt) into Abort: main says so
        return 130
    if os.environ.get("KVCAL_DEBUG") == "1":
        raise exc
    label, code = "error:", 2
    if isinstance(exc, _CLICK_ERROR):
        ctx = getattr(exc, "ctx", None)  # usage errors know their command
        message = first_line(exc.format_message()) + (f" (see '{ctx.command_path} --help')" if ctx else "")
        code = exc.exit_code
    elif isinstance(exc, KvcalError):
        message = str(exc)
    elif isinstance(exc, (OSError, UnicodeDecodeError)):  # files and folders: the OS's own words name the path
        message = _os_message(exc)
    else:
        label, code = "internal error:", 3
        message = f"{type(exc).__name__}: {first_line(str(exc))} (KVCAL_DEBUG=1 shows the traceback)"
    err.print(f"[red]{label}[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return code


def _os_message(exc: Exception) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({exc.reason} at byte {exc.start})"
    where = " -> ".join(str(x) for x in (exc.filename, exc.filename2) if x)
    if where:
        return f"{exc.strerror or type(exc).__name__}: {where}"
    return f"{type(exc).__name__}: {first_line(str(exc))} (KVCAL_DEBUG=1 shows the traceback)"  # network errors


if __name__ == "__main__":
    main()
