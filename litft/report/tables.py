"""The table of runs: its columns (fields), which runs and in what order, how values read in Markdown, the
Markdown/CSV/JSON renderings, and the environment stamp under it."""

from __future__ import annotations

import csv
import difflib
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from litft.errors import ConfigError
from litft.report.runs import ENV_KEYS, MISSING, Run, natural_key

FORMATS = ("md", "csv", "json")

# ----------------------------------------------------------------------------------------------------------------------
# Fields
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """A column: a dotted path into result.json, its title in the Markdown table and how Markdown shows its values.

    kind: text, int, rate (tok/s: thousands, no decimals), fraction_pct (0.412 -> 41.2%), ms (seconds shown in ms),
    seconds, gib (2 decimals), pct (a value already in percent, signed), loss (4 decimals), auto (by type).
    """

    path: str
    title: str
    kind: str = "auto"
    optional: bool = False
    """A default field shown only when some run has it (keys that newer versions of litft add)."""


VIRTUAL = ("run", "status", "message")
"""Fields that are not keys of result.json: the run's name, its status (refined by its log), the log's error."""

DEFAULT_FIELDS: tuple[Field, ...] = (
    Field("run", "run", "text"),
    Field("status", "status", "text"),
    Field("recipe.method", "method", "text"),
    Field("recipe.precision", "precision", "text"),
    Field("batch.micro_batch_size", "micro", "int"),
    Field("batch.grad_accum", "accum", "int"),
    Field("batch.devices", "devices", "int"),
    Field("batch.max_seq_length", "seq", "int"),
    Field("steps", "steps", "int"),
    Field("throughput.tokens_per_sec", "tok/s", "rate"),
    Field("throughput.tokens_per_sec_per_device", "tok/s/dev", "rate"),
    Field("throughput.mfu", "MFU", "fraction_pct"),
    Field("plan.strategy", "strategy", "text", optional=True),
    Field("scaling.vs_one_device", "vs 1 device", "ratio", optional=True),
    Field("throughput.median_step_time_s", "step", "ms"),
    Field("memory.peak_allocated_gib", "alloc GiB", "gib"),
    Field("memory.peak_reserved_gib", "reserved GiB", "gib"),
    Field("memory.predicted.total_gib", "predicted GiB", "gib", optional=True),
    Field("memory.error_pct", "pred. error", "pct", optional=True),
    Field("losses.val_final", "val loss", "loss"),
)

# Titles and kinds of other well-known keys, for --fields.
KNOWN_FIELDS: dict[str, Field] = {f.path: f for f in DEFAULT_FIELDS}
for _field in (
    Field("message", "message", "text"),
    Field("config_hash", "config", "text"),
    Field("device", "device", "text"),
    Field("model.name", "model", "text"),
    Field("batch.global_batch_size", "global batch", "int"),
    Field("throughput.padded_tokens_per_sec", "padded tok/s", "rate"),
    Field("throughput.samples_per_sec", "samples/s", "auto"),
    Field("throughput.padding_fraction", "padding", "fraction_pct"),
    Field("throughput.steady_state", "steady", "auto"),
    Field("memory.device_used_gib", "device used GiB", "gib"),
    Field("memory.device_total_gib", "device GiB", "gib"),
    Field("memory.host_peak_rss_gib", "host RSS GiB", "gib"),
    Field("losses.train_first", "train loss first", "loss"),
    Field("losses.train_last", "train loss last", "loss"),
    Field("losses.val_initial", "val loss before", "loss"),
    Field("environment.gpu", "GPU", "text"),
    Field("cuda_graphs.on", "CUDA graphs", "auto"),
    Field("cuda_graphs.shapes_captured", "graph shapes", "int"),
    Field("compile.unique_graphs", "compiled graphs", "int"),
    Field("batch.pack_steps", "pack steps", "auto"),
    Field("batch.micro_batches_run", "micro-batches", "int"),
    Field("memory.predicted_for_tokens", "pred. tokens", "int"),
    Field("phases_s.train", "train s", "auto"),
    Field("phases_s.warmup", "warm-up s", "auto"),
):
    KNOWN_FIELDS.setdefault(_field.path, _field)


def field_for(path: str) -> Field:
    """The Field of a dotted path: a known one, or one whose kind follows from the key's name."""
    if path in KNOWN_FIELDS:
        return KNOWN_FIELDS[path]
    leaf = path.rsplit(".", 1)[-1]
    if leaf.endswith("_gib"):
        kind = "gib"
    elif leaf.endswith("_pct"):
        kind = "pct"
    elif leaf.endswith("per_sec"):
        kind = "rate"
    elif leaf.endswith("_s") or path.startswith("phases_s."):
        kind = "seconds"
    elif leaf in ("mfu",) or leaf.endswith("_fraction"):
        kind = "fraction_pct"
    elif path.startswith("losses."):
        kind = "loss"
    else:
        kind = "auto"
    return Field(path, path, kind)


# ----------------------------------------------------------------------------------------------------------------------
# Field selection, sorting, grouping
# ----------------------------------------------------------------------------------------------------------------------


def available_paths(runs: Sequence[Run]) -> list[str]:
    """Every dotted path (leaves and sections) present in some run, in first-seen order."""
    seen: dict[str, None] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                path = f"{prefix}.{key}" if prefix else str(key)
                seen.setdefault(path, None)
                walk(value, path)

    for run in runs:
        walk(run.result, "")
    return list(seen)


def _leaves_under(runs: Sequence[Run], path: str) -> list[str]:
    prefix = path + "."
    paths = available_paths(runs)
    sections = {p.rsplit(".", 1)[0] for p in paths if "." in p}
    return [p for p in paths if p.startswith(prefix) and p not in sections]


def resolve_field(runs: Sequence[Run], name: str, paths: list[str] | None = None) -> list[Field]:
    """The column(s) a --fields/--sort/--by name means: a dotted path (a section expands to its keys), a column
    title ('tok/s'), or a unique key name ('mfu'). Raises ConfigError with a did-you-mean otherwise."""
    name = name.strip()
    paths = available_paths(runs) if paths is None else paths
    if name in VIRTUAL or name in KNOWN_FIELDS or name in paths:
        leaves = _leaves_under(runs, name) if name in paths and name not in KNOWN_FIELDS else []
        return [field_for(p) for p in leaves] if leaves else [field_for(name)]
    by_title = [f for f in KNOWN_FIELDS.values() if f.title.lower() == name.lower()]
    if by_title:
        return [by_title[0]]
    suffix = [p for p in paths if p.endswith("." + name)]
    if len(suffix) == 1:
        return resolve_field(runs, suffix[0], paths)
    candidates = list(dict.fromkeys([*VIRTUAL, *paths]))
    close = suffix[:5] or difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    if not close:  # a typo in the last part of a path: match on the key names
        leaf = name.rsplit(".", 1)[-1]
        by_leaf = {}
        for p in paths:
            by_leaf.setdefault(p.rsplit(".", 1)[-1], p)
        close = [by_leaf[k] for k in difflib.get_close_matches(leaf, list(by_leaf), n=3, cutoff=0.6)]
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(
        f"unknown field '{name}': no run has it (fields are dotted paths into result.json, e.g."
        f" 'throughput.tokens_per_sec', or run/status/message).{hint}"
    )


def select_fields(runs: Sequence[Run], fields: str | Sequence[str] | None = None) -> list[Field]:
    """The columns: the defaults (optional ones only when some run has them), or the given names. A string is split on
    commas; a leading '+' (`+throughput.padded_tokens_per_sec`) adds to the defaults instead of replacing them."""
    if isinstance(fields, str):
        fields = [f for f in fields.split(",") if f.strip()]
    defaults = [f for f in DEFAULT_FIELDS if not f.optional or any(r.get(f.path) is not MISSING for r in runs)]
    if not fields:
        return defaults
    fields = list(fields)
    extend = fields[0].strip().startswith("+")
    if extend:
        fields[0] = fields[0].strip()[1:]
    chosen: list[Field] = list(defaults) if extend else []
    paths = available_paths(runs)
    problems = []
    for name in fields:
        try:
            for field in resolve_field(runs, name, paths):
                if field.path not in [f.path for f in chosen]:
                    chosen.append(field)
        except ConfigError as err:
            problems.extend(err.problems)
    if problems:
        raise ConfigError(problems)
    return chosen


def _sort_value(value: Any) -> tuple:
    if value is MISSING or value is None or (isinstance(value, float) and math.isnan(value)):
        return (2, 0, "")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, value, "")
    return (1, 0, natural_key(str(value)))


def sort_runs(runs: Sequence[Run], key: str | None) -> list[Run]:
    """Runs sorted by a field (name, title or path; '-' first for descending); missing values last."""
    runs = sorted(runs, key=lambda r: natural_key(r.name))
    if not key:
        return runs
    descending = key.startswith("-")
    field = resolve_field(runs, key.lstrip("-"))[0]
    present = [r for r in runs if _sort_value(r.get(field.path))[0] < 2]
    absent = [r for r in runs if _sort_value(r.get(field.path))[0] == 2]
    present.sort(key=lambda r: _sort_value(r.get(field.path)), reverse=descending)
    return present + absent


def group_runs(runs: Sequence[Run], by: str | None) -> list[tuple[Any, list[Run]]]:
    """[(value, runs)] by the value of a field, groups in sorted order, runs in their given order."""
    if not by:
        return [(None, list(runs))]
    field = resolve_field(runs, by)[0]
    groups: dict[str, tuple[Any, list[Run]]] = {}
    for run in runs:
        value = run.get(field.path)
        groups.setdefault(json.dumps(value, default=str), (value, []))[1].append(run)
    return sorted(groups.values(), key=lambda g: _sort_value(g[0]))


# ----------------------------------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------------------------------


_NUMBER_FORMATS = {
    "rate": lambda v: f"{v:,.0f}",
    "fraction_pct": lambda v: f"{v * 100:.1f}%",
    "ms": lambda v: f"{v * 1000:,.1f} ms",
    "seconds": lambda v: f"{v:,.1f} s",
    "gib": lambda v: f"{v:,.2f}",
    "pct": lambda v: f"{v:+.1f}%",
    "loss": lambda v: f"{v:.4f}",
    "ratio": lambda v: f"{v:.2f}x",
}
"""How Markdown shows a finite number of each Field kind (int and auto: by the value's type)."""

_NUMERIC_KINDS = {"int", *_NUMBER_FORMATS}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_value(value: Any, kind: str = "auto") -> str:
    """A value as people read it in the Markdown table: '' for a missing key, 'n/a' for null."""
    if value is MISSING:
        return ""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), default=str)
    if not _is_number(value):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if kind in _NUMBER_FORMATS:
        return _NUMBER_FORMATS[kind](value)
    if isinstance(value, int):
        return f"{value:,}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def _raw(value: Any) -> Any:
    return None if value is MISSING else value


def to_rows(
    runs: Sequence[Run], fields: str | Sequence[str] | Sequence[Field] | None = None, sort: str | None = None,
    by: str | None = None,
) -> list[dict[str, Any]]:
    """One dict per run, keyed by field path, with the raw values of result.json (None where absent): for pandas."""
    fields = _fields(runs, fields, by)
    ordered = [run for _, group in group_runs(sort_runs(runs, sort), by) for run in group]
    return [{f.path: _raw(run.get(f.path)) for f in fields} for run in ordered]


def _fields(runs: Sequence[Run], fields: Any, by: str | None) -> list[Field]:
    if fields and all(isinstance(f, Field) for f in fields):
        chosen = list(fields)
    else:
        chosen = select_fields(runs, fields)
    if by:
        by_field = resolve_field(runs, by)[0]
        if by_field.path not in [f.path for f in chosen]:
            chosen.insert(1 if chosen and chosen[0].path == "run" else 0, by_field)
    return chosen


def table(
    runs: Sequence[Run], fields: str | Sequence[str] | Sequence[Field] | None = None, fmt: str = "md", *,
    sort: str | None = None, by: str | None = None, stamp: bool = True,
) -> str:
    """The runs as a table: 'md' (GitHub Markdown, numbers for people, stamped with the environment(s) and config
    hashes unless stamp=False), 'csv' or 'json' (a list of row dicts; both raw values, no stamp: see `stamp()`)."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown format '{fmt}'; choose one of {', '.join(FORMATS)}")
    fields = _fields(runs, fields, by)
    if fmt == "json":
        return json.dumps(to_rows(runs, fields, sort, by), indent=2, default=str)
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow([f.path for f in fields])
        for row in to_rows(runs, fields, sort, by):
            writer.writerow([_csv_cell(v) for v in row.values()])
        return buffer.getvalue()
    return _markdown(runs, fields, sort, by, stamp)


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        return json.dumps(value, default=str)
    return value


def _markdown(runs: Sequence[Run], fields: list[Field], sort: str | None, by: str | None, stamp_: bool) -> str:
    groups = group_runs(sort_runs(runs, sort), by)
    cells = {id(run): [format_value(run.get(f.path), f.kind).replace("|", "\\|") for f in fields]
             for _, group in groups for run in group}
    titles = [f.title for f in fields]
    widths = [max([len(t), 3, *(len(c[i]) for c in cells.values())]) for i, t in enumerate(titles)]
    numeric = [  # right-aligned: numeric kinds always, other columns when every value is a number
        f.kind in _NUMERIC_KINDS or (
            f.kind == "auto" and any(_is_number(r.get(f.path)) for r in runs)
            and all(_is_number(r.get(f.path)) or r.get(f.path) in (None, MISSING) for r in runs)
        )
        for f in fields
    ]

    def line(values: list[str]) -> str:
        padded = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric)) + "|"
    out: list[str] = []
    by_title = resolve_field(runs, by)[0].title if by else None
    for value, group in groups:
        if by:
            out += [f"**{by_title} = {format_value(value)}** ({len(group)} run{'s' if len(group) != 1 else ''})", ""]
        out += [line(titles), rule, *(line(cells[id(run)]) for run in group)]
        if by:
            out.append("")
    if stamp_:
        out += ["", *stamp(runs, markdown=True)]
    return "\n".join(out).rstrip("\n") + "\n"


# ----------------------------------------------------------------------------------------------------------------------
# Environment stamp
# ----------------------------------------------------------------------------------------------------------------------


def describe_environment(env: dict | None) -> str:
    if env is None:
        return "unknown (no result.json)"
    gpu = env.get("gpu")
    parts = [f"GPU {gpu}" if gpu else f"CPU {env.get('cpu') or ''}".rstrip() + " (no GPU)"]
    parts.append(f"driver {env.get('driver') or 'none'}")
    for key in ("torch", "cuda", "litft", "litgpt", "lightning"):
        parts.append(f"{'CUDA' if key == 'cuda' else key} {env.get(key) or 'none'}")
    return ", ".join(parts)


def environments(runs: Sequence[Run]) -> list[tuple[dict | None, list[Run]]]:
    """[(environment, runs)] for each distinct (gpu, driver, torch, cuda, litft, litgpt, lightning)."""
    groups: dict[Any, tuple[dict | None, list[Run]]] = {}
    for run in runs:
        groups.setdefault(run.env_key, (run.environment, []))[1].append(run)
    return list(groups.values())


def stamp(runs: Sequence[Run], markdown: bool = False) -> list[str]:
    """The lines under the table: a warning when the runs come from different environments, one line per
    environment with its runs, each run's config hash, and notes on figures that need care."""
    lines: list[str] = []
    envs = environments(runs)
    known = [(env, group) for env, group in envs if env is not None]
    if len(known) > 1:
        differ = [key for key in ENV_KEYS if len({env.get(key) for env, _ in known}) > 1]
        text = (
            f"WARNING: these runs come from {len(known)} different environments (they differ in {', '.join(differ)}):"
            " tok/s, MFU and memory are not comparable across GPUs, drivers or library versions. Compare runs of one"
            " environment, or rerun them on one machine."
        )
        lines.append(f"> **{text}**" if markdown else text)
        if markdown:
            lines.append("")
    for i, (env, group) in enumerate(known, 1):
        label = f"environment {i}" if len(known) > 1 else "environment"
        lines.append(f"{label}: {describe_environment(env)} [{', '.join(r.name for r in group)}]")
    for env, group in envs:
        if env is None:
            lines.append(f"environment unknown (no result.json): {', '.join(r.name for r in group)}")
    hashes = [f"{r.name} {r.config_hash or '(none)'}" for r in runs]
    lines.append("config hash: " + ", ".join(hashes))
    by_hash: dict[str, list[str]] = {}
    for run in runs:
        if run.config_hash:
            by_hash.setdefault(run.config_hash, []).append(run.name)
    for value, names in by_hash.items():
        if len(names) > 1:
            lines.append(f"note: {', '.join(names)} share config {value}: repeats of one recipe, so their differences"
                         " are run-to-run noise (or the environment)")
    for run in runs:
        if run.ok and run.get("throughput.steady_state") is False:
            lines.append(f"note: {run.name} measured no steady-state step (fewer steps than logging.skip_steps + 1):"
                         " its tok/s includes warm-up")
    for run in runs:
        if not run.ok and run.message:
            message = run.message if len(run.message) <= 240 else run.message[:237] + "..."
            lines.append(f"{run.name}: {run.status}: {message}")
    if markdown:
        return [line if line.startswith(">") or not line else f"- {line}" for line in lines]
    return lines
