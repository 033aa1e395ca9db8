"""Result records (JSON from `kvcal eval ppl`) to markdown tables."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import yaml

from kvcal.accounting import bits_per_element
from kvcal.artifact import write_atomic
from kvcal.errors import KvcalError
from kvcal.methods.registry import build_method
from kvcal.models import ModelDims
from kvcal.quant.rope import RopeSpec

RECORD_FIELDS = {"setting": str, "method": str, "ppl": (int, float), "bits_per_element": (int, float),
                 "protocol": str, "nsamples": int}


def read_record(path) -> dict:
    """One `kvcal eval ppl` JSON record, or a one-line error saying why the file is not one."""
    path = Path(path)
    if not path.is_file():
        raise KvcalError(f"report: {path} is not a file")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise KvcalError(f"report: {path} is not JSON ({type(exc).__name__})") from None
    if not isinstance(record, dict):
        raise KvcalError(f"report: {path} is not a kvcal eval record (a JSON {type(record).__name__})")
    for key, kind in RECORD_FIELDS.items():
        if key == "ppl" and record.get(key, 0) is None:  # a diverged run, written as null
            record[key] = float("nan")
            continue
        if not isinstance(record.get(key), kind) or isinstance(record.get(key), bool):
            raise KvcalError(f"report: {path} is not a kvcal eval record ('{key}' missing or of the wrong type)")
    if not record["ppl"] > 0 and not math.isnan(record["ppl"]):
        raise KvcalError(f"report: {path} is not a kvcal eval record (perplexity {record['ppl']}: not above 0)")
    for key, inner in (("model", "name"), ("dataset", "dataset")):  # a name alone reads as {inner: name}
        value = record.get(key)
        if isinstance(value, str):
            record[key] = {inner: value}
        elif value is not None and not isinstance(value, dict):
            raise KvcalError(f"report: {path} is not a kvcal eval record ('{key}' is a JSON {type(value).__name__})")
    return record


def _relative(value: float, reference: dict | None) -> str:
    if reference is None or not (reference["ppl"] > 0 and math.isfinite(reference["ppl"])):
        return ""
    return f"{100 * (value / reference['ppl'] - 1):+.1f}%"


def fp_window_of(record: dict) -> int | None:
    """The full-precision allowance a record ran under: its `fp_window`, or for a record written before the field
    existed, its method's own window (0 under tail); None when its config no longer builds."""
    if isinstance(record.get("fp_window"), int):
        return record["fp_window"]
    if record.get("protocol") == "tail" or record.get("method") == "fp16":
        return 0
    try:
        return build_method(record["method"], record.get("config") or {}).own_fp_window()
    except KvcalError:
        return None


def bits_at_seqlen(record: dict) -> float | None:
    """Bits per element at the record's window length (`bits_at_seqlen`, or for a record written before the field
    existed, its method's footprint at that length on the record's model shapes); None when that cannot be built."""
    if isinstance(record.get("bits_at_seqlen"), (int, float)):
        return record["bits_at_seqlen"]
    try:
        m = record["model"]
        dims = ModelDims(family=m["family"], num_layers=m["num_layers"], num_heads=m["num_heads"],
                         num_kv_heads=m["num_kv_heads"], head_dim=m["head_dim"], hidden_size=m["hidden_size"],
                         rope=RopeSpec(**m["rope"]))
        method = build_method(record["method"], record.get("config") or {})
        return bits_per_element(method, dims, int(record["seqlen"])).bits_per_element
    except (KeyError, TypeError, ValueError, KvcalError):
        return None


def comparison_key(record: dict) -> tuple:
    """What two records must share for one's perplexity to be compared with the other's: the model, the dataset and
    split, the protocol (and its prompt length), the window length and the number of windows. The full-precision
    allowance is not in it (fp16 is the reference of every allowance): `group_key` adds it."""
    dataset = record.get("dataset") or {}
    return (json.dumps(record.get("model", {}).get("name")), dataset.get("dataset"), dataset.get("split"),
            record.get("protocol"), record.get("prompt_len"), record.get("seqlen"), record.get("nsamples"))


def group_key(record: dict) -> tuple:
    """What rows of one table share, so that they rank against each other: the comparison key and the allowance."""
    return (*comparison_key(record), None if record.get("method") == "fp16" else fp_window_of(record))


def group_title(record: dict) -> str:
    window = fp_window_of(record)
    allowance = ("full-precision window: each method's own" if window is None else
                 "strict: every token compressed as it enters (--fp-window 0)" if window == 0 else
                 f"the newest {window} tokens in fp16 (--fp-window {window})")
    model = (record.get("model") or {}).get("name", "?")
    dataset = (record.get("dataset") or {}).get("dataset", "?")
    return (f"{model}, {dataset}, {record.get('nsamples')} x {record.get('seqlen')}, protocol "
            f"{record.get('protocol')}; {allowance}")


def markdown_table(records: list[dict], commands: bool = False) -> str:
    """One table per protocol and full-precision allowance (rows of two are never ranked together), rows in the
    order given; "vs fp16" against the fp16 record of the same model, dataset, protocol, seqlen and windows among
    `records` (blank when there is none), which heads every table it applies to."""
    references = {}
    for r in records:
        if r["method"] == "fp16":
            references.setdefault(comparison_key(r), r)
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["method"] != "fp16":
            groups.setdefault(group_key(r), []).append(r)
    for r in records:  # an fp16 record heads every table of its comparison key (or its own, if none)
        if r["method"] == "fp16":
            owners = [k for k in groups if k[:-1] == comparison_key(r)] or [group_key(r)]
            for key in owners:
                groups.setdefault(key, []).insert(0, r)
    header = ["setting", "method", "PPL", "vs fp16", "bits/elem", "at seqlen", "fp keys/query", "protocol", "windows",
              "device"]
    if commands:
        header.append("command")
    tables = []
    for rows in groups.values():
        lines = [f"**{group_title(next((r for r in rows if r['method'] != 'fp16'), rows[0]))}**", "",
                 "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for r in rows:
            delta = _relative(r["ppl"], references.get(comparison_key(r)))
            mode = r.get("mode", "simulate")
            fp_keys, at_seqlen = r.get("fp_keys_per_query"), bits_at_seqlen(r)
            row = [r["setting"], r["method"], f"{r['ppl']:.3f}", delta, f"{r['bits_per_element']:.2f}",
                   "" if at_seqlen is None else f"{at_seqlen:.2f}",
                   "" if fp_keys is None else f"{fp_keys:.1f}",
                   r["protocol"] + ("" if mode in ("simulate", "simulated") else f" ({mode})"),
                   str(r["nsamples"]), r.get("device", "?")]
            if commands:
                row.append(f"`{r.get('command', '')}`")
            lines.append("| " + " | ".join(row) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


# ---------------------------------------------------------------------------------------------------------------
# pages from committed records: a manifest (YAML) lists the blocks of each page (prose, tables), each table cell
# names the record (and the field inside it) its number comes from.
_PLACEHOLDER = re.compile(r"\{\{([^{}]+)\}\}")


class _Records:
    """JSON records read once each, by path relative to the repository root."""

    def __init__(self, root: Path):
        self.root = root
        self.cache: dict[str, object] = {}

    def get(self, path: str):
        if path not in self.cache:
            file = self.root / path
            if not file.is_file():
                raise KvcalError(f"report: record {path} does not exist")
            try:
                self.cache[path] = json.loads(file.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as exc:
                raise KvcalError(f"report: {path} is not JSON ({type(exc).__name__})") from None
        return self.cache[path]


def _select(obj, at, where: str):
    """Walk `at` into a record: a string is a key, an int an index, a mapping picks the one list element whose fields
    equal it."""
    for step in at:
        if isinstance(step, dict):
            found = [x for x in obj if isinstance(x, dict) and all(x.get(k) == v for k, v in step.items())] \
                if isinstance(obj, list) else []
            if len(found) != 1:
                raise KvcalError(f"report: {where}: {len(found)} elements match {step}, not 1")
            obj = found[0]
        elif isinstance(obj, dict) and isinstance(step, str) and step in obj:
            obj = obj[step]
        elif isinstance(obj, list) and isinstance(step, int) and -len(obj) <= step < len(obj):
            obj = obj[step]
        else:
            raise KvcalError(f"report: {where}: no '{step}'")
    return obj


def _cell(spec, records: _Records, where: str) -> str:
    """A table cell: literal text, or {rec, at, fmt[, ref, bold]}: `fmt` is formatted with v (the value at `at`),
    r (the record at `rec`, or the element its `at` walked to before a last key) and rel (v / the value at ref - 1)."""
    if not isinstance(spec, dict):
        return "" if spec is None else str(spec)
    record = records.get(spec["rec"])
    where = f"{where} ({spec['rec']})"
    at = list(spec.get("at", []))
    value = _select(record, at, where)
    if spec.get("fn") == "bits_at_seqlen":  # derived from the record, not stored in it
        value = bits_at_seqlen(value)
        if value is None:
            raise KvcalError(f"report: {where}: its bits at the window length cannot be computed")
    fields = {"v": value, "r": record if not at else _select(record, at[:-1], where)}
    if "ref" in spec:
        ref = spec["ref"]
        ref_value = _select(records.get(ref["rec"]) if "rec" in ref else record, ref.get("at", at), where)
        fields["rel"] = value / ref_value - 1
    try:
        text = spec.get("fmt", "{v}").format(**fields)
    except (KeyError, IndexError, ValueError, TypeError) as exc:
        raise KvcalError(f"report: {where}: format {spec.get('fmt')!r}: {type(exc).__name__} {exc}") from None
    return f"**{text}**" if spec.get("bold") else text


# Cell kinds of a row that stands for one eval record (`rows: - {rec: ..., label: ...}`).
_EVAL_CELLS = {
    "ppl": lambda row: {"rec": row["rec"], "at": row.get("at", []) + ["ppl"], "fmt": row.get("ppl_fmt", "{v:.3f}")},
    "bits": lambda row: {"rec": row["rec"], "at": row.get("at", []) + ["bits_per_element"], "fmt": "{v:.2f}"},
    "fp_keys": lambda row: {"rec": row["rec"], "at": row.get("at", []) + ["fp_keys_per_query"], "fmt": "{v:.1f}"},
    "bits_seqlen": lambda row: {"rec": row["rec"], "at": row.get("at", []), "fn": "bits_at_seqlen", "fmt": "{v:.2f}"},
    "command": lambda row: {"rec": row["rec"], "at": ["command"], "fmt": "`{v}`"},
    "device": lambda row: {"rec": row["rec"], "at": row.get("at", []) + ["device"]},
}


def _row_cells(row: dict, kinds: list[str], table: dict, where: str) -> list:
    cells = []
    for kind in kinds:
        if kind in row.get("cells", {}):
            cell = row["cells"][kind]
        elif kind == "vs_ref" and "ref" in table:
            cell = {"rec": row["rec"], "at": row.get("at", []) + ["ppl"], "fmt": "{rel:+.1%}",
                    "ref": {"rec": table["ref"], "at": ["ppl"]}}
        elif kind in _EVAL_CELLS and "rec" in row:
            cell = _EVAL_CELLS[kind](row)
        elif kind in row:
            cell = row[kind]
        else:
            raise KvcalError(f"report: {where}: row has no '{kind}'")
        if isinstance(cell, dict) and kind in row.get("bold", []):
            cell = {**cell, "bold": True}
        cells.append(cell)
    return cells


def _table(table: dict, records: _Records, where: str) -> str:
    header = table["columns"]
    kinds = table.get("cells")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, row in enumerate(table["rows"]):
        here = f"{where} row {i + 1}"
        raw = row if isinstance(row, list) else _row_cells(row, kinds, table, here)
        if len(raw) != len(header):
            raise KvcalError(f"report: {here}: {len(raw)} cells for {len(header)} columns")
        lines.append("| " + " | ".join(_cell(c, records, here) for c in raw) + " |")
    return "\n".join(lines)


def _text(text: str, records: _Records, where: str) -> str:
    """Prose with {{PATH FIELD.FIELD FORMAT}} placeholders, each replaced by that field of that record."""

    def one(match: re.Match) -> str:
        parts = match.group(1).split()
        if len(parts) not in (2, 3):
            raise KvcalError(f"report: {where}: placeholder {{{{{match.group(1)}}}}} is not {{{{PATH FIELD [FORMAT]}}}}")
        at = [int(s) if s.lstrip("-").isdigit() else s for s in parts[1].split(".")]
        return _cell({"rec": parts[0], "at": at, "fmt": "{v:" + (parts[2] if len(parts) == 3 else "") + "}"},
                     records, where)

    return _PLACEHOLDER.sub(one, text.rstrip("\n"))


def load_manifest(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise KvcalError(f"report: manifest {path} does not exist (--docs and a chart without records need a kvcal "
                         "checkout; give records to tabulate or --plot them)")
    try:
        manifest = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise KvcalError(f"report: {path} is not YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("docs"), list):
        raise KvcalError(f"report: {path} has no 'docs' list")
    for i, page in enumerate(manifest["docs"]):
        where = f"report: {path} page {i + 1}"
        if not isinstance(page, dict) or not isinstance(page.get("path"), str) or not isinstance(page.get("blocks"),
                                                                                                   list):
            raise KvcalError(f"{where}: needs a 'path' and a 'blocks' list")
        for j, block in enumerate(page["blocks"]):
            table = block.get("table") if isinstance(block, dict) else None
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                continue
            if not (isinstance(table, dict) and isinstance(table.get("columns"), list)
                    and isinstance(table.get("rows"), list)):
                raise KvcalError(f"{where} ({page['path']}) block {j + 1}: needs a 'text' or a 'table' with "
                                 "'columns' and 'rows' lists")
    return manifest


def render_docs(manifest: dict, root: Path) -> dict[str, str]:
    """Every page of the manifest: {output path: markdown}."""
    records = _Records(Path(root))
    pages = {}
    for page in manifest["docs"]:
        blocks = []
        for i, block in enumerate(page["blocks"]):
            where = f"{page['path']} block {i + 1}"
            if "text" in block:
                blocks.append(_text(block["text"], records, where))
                continue
            table = block["table"]
            where = f"{page['path']} table '{table.get('title') or i + 1}'"
            if table.get("title"):
                blocks.append("#" * table.get("level", 2) + " " + table["title"])
            if table.get("intro"):
                blocks.append(_text(table["intro"], records, where))
            blocks.append(_table(table, records, where))
            if table.get("after"):
                blocks.append(_text(table["after"], records, where))
        pages[page["path"]] = "\n\n".join(blocks) + "\n"
    return pages


def write_docs(manifest_path: Path, check: bool = False) -> list[str]:
    """Write (or, with `check`, compare) every generated page; returns the pages that differed."""
    manifest_path = Path(manifest_path)
    root = manifest_path.resolve().parent.parent
    pages = render_docs(load_manifest(manifest_path), root)
    differ = [out for out, text in pages.items()
              if ((root / out).read_text(encoding="utf-8") if (root / out).is_file() else None) != text]
    if not check:  # every page is rendered before the first is written, and each is written whole (atomically)
        for out in differ:
            write_atomic(root / out, lambda tmp, text=pages[out]: Path(tmp).write_text(text, encoding="utf-8"))
    return differ


# ---------------------------------------------------------------------------------------------------------------
# The Pareto chart: the manifest's `plot` section lists its points (record, optional `at` into a record that holds
# several, a label and the method, which picks the colour); `reference` is the fp16 record they are compared with.


def _allowance(record: dict) -> str:
    window = fp_window_of(record)
    return "own windows" if window is None else f"--fp-window {window}"


def pareto_points(manifest: dict, root: Path) -> tuple[dict, list[dict]]:
    """(the fp16 reference record, [{label, method, group, bits, ppl, increase (%)}]) of the manifest's `plot`
    section; `group` is each point's full-precision allowance (one curve each)."""
    spec = manifest.get("plot")
    if not isinstance(spec, dict) or not spec.get("points"):
        raise KvcalError("report: the manifest has no 'plot' section with points")
    records = _Records(Path(root))
    reference = records.get(spec["reference"])
    key = comparison_key(reference)
    points = []
    for i, point in enumerate(spec["points"]):
        where = f"plot point {i + 1} ({point.get('label')})"
        record = _select(records.get(point["rec"]), point.get("at", []), where)
        if comparison_key(record)[:6] != key[:6] or record.get("nsamples") != reference.get("nsamples"):
            raise KvcalError(f"report: {where}: {point['rec']} is not of the reference's model, dataset, protocol, "
                             "seqlen and windows")
        points.append(_point(record, reference, point["label"], point["method"], point.get("offset", (5, 3))))
    return reference, points


def _point(record: dict, reference: dict, label: str, method: str, offset=(5, 3)) -> dict:
    return {"label": label, "method": method, "group": _allowance(record), "bits": record["bits_per_element"],
            "ppl": record["ppl"], "increase": 100 * (record["ppl"] / reference["ppl"] - 1), "offset": tuple(offset)}


def record_points(records: list[dict]) -> tuple[dict, list[dict], str]:
    """(the fp16 reference, the points, a title) of `kvcal eval ppl` records given on the command line: one fp16 record
    and the others of its model, dataset, protocol, seqlen and windows (a one-line error otherwise)."""
    references = [r for r in records if r["method"] == "fp16"]
    if not references:
        raise KvcalError("report --plot: give the fp16 record of the same windows too (the increase is over fp16)")
    reference = references[0]
    key = comparison_key(reference)
    others = [r for r in records if r["method"] != "fp16"]
    stray = [r["setting"] for r in others if comparison_key(r) != key]
    if stray:
        raise KvcalError(f"report --plot: {', '.join(stray)} not of the fp16 record's model, dataset, protocol, seqlen "
                         "and windows")
    if not others:
        raise KvcalError("report --plot: give the records of some compressed settings besides fp16")
    points = [_point(r, reference, r["setting"], r["method"]) for r in others]
    model, dataset = (reference.get("model") or {}).get("name", "?"), (reference.get("dataset") or {}).get("dataset")
    title = f"{model}, {dataset}, protocol {reference['protocol']}, {reference['nsamples']} x {reference['seqlen']}"
    return reference, points, title


def plot_pareto(manifest_path: Path, out: Path) -> None:
    """The manifest's chart (its `plot` section)."""
    manifest_path = Path(manifest_path)
    manifest = load_manifest(manifest_path)
    reference, points = pareto_points(manifest, manifest_path.resolve().parent.parent)
    draw_pareto(reference, points, manifest["plot"].get("title", ""), out)


def save_figure(fig, out, **options) -> None:
    """A chart written whole or not at all (write_atomic): the format from `out`'s extension."""
    write_atomic(out, lambda tmp: fig.savefig(tmp, format=Path(out).suffix.lstrip(".").lower(), **options))


def draw_pareto(reference: dict, points: list[dict], title: str, out: Path,
                xlabel: str = "bits per element (everything counted, 4096 tokens)") -> None:
    """Perplexity increase over fp16 (symlog %) against bits per element, one colour per method and one marker per
    full-precision allowance, each point labelled (`offset`: the label's offset in points, where labels would
    overlap), and per allowance its Pareto front (fewest bits for the lowest increase) joined by a line: rows of two
    allowances are never ranked together."""
    try:  # matplotlib is optional (kvcal[plot]): imported only to draw
        import matplotlib
    except ImportError:
        raise KvcalError("--plot needs matplotlib: pip install 'kvcal[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use(): pyplot takes its backend when imported

    fig, ax = plt.subplots(figsize=(12, 7.5), dpi=110)
    methods = list(dict.fromkeys(p["method"] for p in points))
    groups = list(dict.fromkeys(p["group"] for p in points))
    colors = plt.get_cmap("tab10")
    markers, lines = "os^Dv", ["-", "--", ":", "-."]
    for i, method in enumerate(methods):
        for j, group in enumerate(groups):
            mine = [p for p in points if p["method"] == method and p["group"] == group]
            if not mine:
                continue
            ax.scatter([p["bits"] for p in mine], [p["increase"] for p in mine], s=36, color=colors(i % 10),
                       marker=markers[j % len(markers)], label=method if len(groups) == 1 else f"{method} ({group})",
                       zorder=3)
            for p in mine:
                ax.annotate(p["label"], (p["bits"], p["increase"]), xytext=p["offset"], textcoords="offset points",
                            fontsize=7.5, color=colors(i % 10))
    for j, group in enumerate(groups):
        front, best = [], math.inf
        for p in sorted((p for p in points if p["group"] == group), key=lambda p: (p["bits"], p["increase"])):
            if p["increase"] < best:
                front.append(p)
                best = p["increase"]
        ax.step([p["bits"] for p in front], [p["increase"] for p in front], where="post", color="0.5", lw=1,
                ls=lines[j % len(lines)], zorder=1, label=f"Pareto front, {group}")
    ax.axhline(0, color="black", lw=1.2, ls="--", zorder=2,
               label=f"fp16 (PPL {reference['ppl']:.3f}, {reference['bits_per_element']:.0f} bits)")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(-0.3, 2 * max(max(p["increase"] for p in points), 1.0))
    ax.set_xlim(0.5, max(p["bits"] for p in points) + 0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("perplexity increase over fp16 (%, log scale above 1%)")
    ax.set_title(title, fontsize=11)
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    save_figure(fig, out)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# The passkey grid: one heatmap per `kvcal eval passkey` record (rows: context length, columns: needle depth).


def read_passkey_record(path) -> dict | None:
    """The record at `path` when it is a `kvcal eval passkey` record, else None (a one-line error for unreadable
    JSON or a passkey record without its grid)."""
    path = Path(path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KvcalError(f"report: cannot read {path} ({type(exc).__name__})") from None
    if not isinstance(record, dict) or record.get("kind") != "passkey":
        return None
    if not all(isinstance(record.get(k), list) and record.get(k) for k in ("lengths", "depths", "cells")):
        raise KvcalError(f"report: {path} is a passkey record without its lengths, depths and cells")
    if not all(isinstance(c, dict) and {"length", "depth", "accuracy"} <= c.keys() for c in record["cells"]):
        raise KvcalError(f"report: {path} is a passkey record whose cells lack a length, depth or accuracy")
    if not (isinstance(record.get("setting"), str) and isinstance(record.get("mode"), str)
            and isinstance(record.get("model"), dict)):
        raise KvcalError(f"report: {path} is a passkey record without its setting, mode or model")
    return record


def accuracy_grid(record: dict) -> tuple[list[int], list, list[list[float]]]:
    """(lengths, depths, accuracy[length][depth]) of a passkey record (NaN where a cell is missing)."""
    lengths, depths = record["lengths"], record["depths"]
    acc = {(c["length"], c["depth"]): c["accuracy"] for c in record["cells"]}
    return lengths, depths, [[acc.get((n, d), float("nan")) for d in depths] for n in lengths]


def plot_passkey(records: list[dict], out: Path) -> None:
    """Passkey accuracy heatmaps, one panel per record (length x depth, each cell annotated)."""
    try:  # matplotlib is optional (kvcal[plot]): imported only to draw
        import matplotlib
    except ImportError:
        raise KvcalError("--plot needs matplotlib: pip install 'kvcal[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use(): pyplot takes its backend when imported

    cols = min(4, len(records))  # rows of 4 panels
    rows = -(-len(records) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.2 + 3.6 * cols, 0.4 + 3.4 * rows), dpi=110, squeeze=False,
                             constrained_layout=True)
    flat = axes.flatten().tolist()
    for ax in flat[len(records):]:
        ax.axis("off")
    for k, (ax, record) in enumerate(zip(flat, records)):
        lengths, depths, grid = accuracy_grid(record)
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(depths)), [f"{d:g}%" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, "-" if value != value else f"{value:.2f}", ha="center", va="center", fontsize=8)
        if k // cols == rows - 1 or k + cols >= len(records):
            ax.set_xlabel("needle depth")
        if k % cols == 0:
            ax.set_ylabel("context length (tokens)")
        bits = record.get("bits_per_element")
        label = f"{record['setting']}" + (f", {bits:.2f} bits" if isinstance(bits, (int, float)) else "")
        ax.set_title(f"{label} ({record['mode']})", fontsize=9)
    fig.colorbar(image, ax=flat, label="accuracy", shrink=0.6)
    name = records[0]["model"].get("name", "")
    fig.suptitle(f"passkey retrieval, {name}", fontsize=10)
    save_figure(fig, out, bbox_inches="tight")
    plt.close(fig)
