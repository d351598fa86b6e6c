"""Compare runs: one table (Markdown, CSV or JSON) and bar charts from the result.json files of run dirs and sweeps.

    litft compare out/run-a out/run-b                   # two run dirs
    litft compare out/bench                             # every run under a sweep/bench dir, at any depth
    litft compare out/bench --format csv --fields run,throughput.tokens_per_sec,memory.peak_reserved_gib
    litft compare out/bench --fields +throughput.padded_tokens_per_sec --sort -tok/s --by recipe.method
    litft compare out/bench --plot plots/               # tokens_per_sec.png, peak_memory.png (, scaling.png)

From Python (notebooks)::

    from litft import report
    runs = report.load_runs(["out/bench"])
    print(report.table(runs))                           # md; fmt="csv" / "json"
    pandas.DataFrame(report.to_rows(runs))              # raw values, one dict per run
    report.plot(runs, "plots/")                         # -> list of the PNG paths written

A run is a directory holding result.json (written by every `litft finetune`, also when the run failed), or a
directory without it but with a litft log.txt (benchmarks/run_recipes.py writes one per run) or config.yaml: a run
that crashed before writing result.json, e.g. out of memory while loading the model. In a sweep that is a result, so
it is a row: its status is the error kind of the log's last `litft <command>: <kind>: <message>` line, and what
config.yaml says (method, precision, batch shape) fills the recipe columns.

Fields are dotted paths into result.json (`throughput.tokens_per_sec`), plus `run` (the run's path relative to the
common parent of all runs), `status` and `message`. Markdown shows numbers for people (thousands separators, MFU as
%, step time in ms, GiB with 2 decimals); CSV and JSON hold the raw values as result.json has them.

Every figure depends on the GPU, driver and library versions, so the table is stamped with each distinct
environment and each run's config hash, and says so loudly when the runs come from different environments.
"""

from __future__ import annotations

import csv
import difflib
import hashlib
import io
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from litft.errors import ConfigError


class _Missing:
    """A key that result.json does not have (shown blank), unlike a key whose value is null (shown 'n/a')."""

    def __repr__(self) -> str:
        return "MISSING"

    def __bool__(self) -> bool:
        return False


MISSING: Any = _Missing()

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

ENV_KEYS = ("gpu", "driver", "torch", "cuda", "litft", "litgpt", "lightning")
"""What a figure depends on: runs that differ in any of these are not comparable."""


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
# Runs
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One run: its name, directory, result.json (or what could be recovered without it) and status."""

    name: str
    path: Path
    result: dict
    status: str
    message: str | None = None
    """The last litft error message of the run's log.txt (or why there is no result), if any."""
    has_result: bool = True
    """False when result.json is missing or unreadable; `result` then holds what config.yaml says."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def get(self, path: str, default: Any = MISSING) -> Any:
        """The value at a dotted path (or a virtual field); `default` (MISSING) when the key is absent."""
        if path == "run":
            return self.name
        if path == "status":
            return self.status
        if path == "message":
            return self.message
        value = lookup(self.result, path)
        if value is MISSING and path == "memory.predicted.total_gib":
            predicted = lookup(self.result, "memory.predicted")  # tolerate a bare number
            if isinstance(predicted, (int, float)) and not isinstance(predicted, bool):
                value = predicted
        return default if value is MISSING else value

    def number(self, path: str) -> float | None:
        """The value at path as a finite float, or None."""
        value = self.get(path, None)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        return float(value)

    @property
    def environment(self) -> dict | None:
        env = self.result.get("environment") if self.has_result else None
        return env if isinstance(env, dict) else None

    @property
    def env_key(self) -> tuple | None:
        env = self.environment
        return None if env is None else tuple(env.get(k) for k in ENV_KEYS)

    @property
    def config_hash(self) -> str | None:
        value = self.result.get("config_hash")
        return value if isinstance(value, str) else None


def lookup(data: Any, path: str) -> Any:
    node = data
    for part in path.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return MISSING
    return node


def load_runs(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Run]:
    """Every run under the given paths (run dirs, or directories holding run dirs at any depth), sorted by name.

    Raises ConfigError when a path does not exist or holds no run.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [Path(p) for p in paths]
    if not paths:
        raise ConfigError("compare needs at least one PATH: a run dir (with result.json) or a sweep/bench dir")
    found: dict[Path, None] = {}
    for path in paths:
        if not path.exists():
            raise ConfigError(f"'{path}' does not exist")
        run_dirs = find_run_dirs(path)
        if not run_dirs:
            raise ConfigError(
                f"no result.json under '{path}': a run dir holds the result.json that `litft finetune` writes into its"
                " out_dir, a sweep/bench dir holds run dirs (benchmarks/run_recipes.py: DIR/runs/NAME/result.json)"
            )
        for run_dir in run_dirs:
            found.setdefault(run_dir.resolve(), None)
    names = run_names(list(found))
    runs = [read_run(run_dir, names[run_dir]) for run_dir in found]
    return sorted(runs, key=lambda r: natural_key(r.name))


_SKIP_DIRS = {"__pycache__", "node_modules"}
_RUN_OUTPUT_DIRS = {"tensorboard", "final"}  # what a run dir holds besides files: never a run of its own


def find_run_dirs(path: Path) -> list[Path]:
    if path.is_file():
        if path.name in ("result.json", "log.txt", "config.yaml") and _is_run_dir(path.parent):
            return [path.parent]
        return []
    run_dirs = []
    for root, dirs, files in os.walk(path):
        here = Path(root)
        is_run = _is_run_dir(here, files)
        if is_run:
            run_dirs.append(here)
        dirs[:] = sorted(
            d for d in dirs
            if not d.startswith(".") and d not in _SKIP_DIRS and not (is_run and d in _RUN_OUTPUT_DIRS)
        )
    return run_dirs


def _is_run_dir(directory: Path, files: Sequence[str] | None = None) -> bool:
    files = os.listdir(directory) if files is None else files
    if "result.json" in files:
        return True
    if "log.txt" in files and _looks_like_litft_log(directory / "log.txt"):
        return True
    return "config.yaml" in files and _read_recipe_yaml(directory / "config.yaml") is not None


def _looks_like_litft_log(path: Path) -> bool:
    try:
        head = path.read_text(encoding="utf-8", errors="replace")[:4000]
    except OSError:
        return False
    return "litft" in head


def run_names(run_dirs: list[Path]) -> dict[Path, str]:
    """Each run dir's path relative to the common parent of all of them (a lone run keeps its own name)."""
    if not run_dirs:
        return {}
    base = Path(os.path.commonpath([str(d) for d in run_dirs]))
    if base in run_dirs:  # one run, or a run dir that holds others: name it too
        base = base.parent
    return {d: (d.relative_to(base).as_posix() if d != base else d.name or str(d)) for d in run_dirs}


def natural_key(text: str) -> list:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part.lower()) for part in re.split(r"(\d+)", text)]


def read_run(run_dir: Path, name: str | None = None) -> Run:
    name = name or run_dir.name
    log = parse_log(run_dir / "log.txt")
    result_path = run_dir / "result.json"
    if result_path.is_file():
        try:
            result = json.loads(result_path.read_text(encoding="utf-8"))
            if not isinstance(result, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as err:
            recovered = recover_result(run_dir)
            return Run(name, run_dir, recovered, "unreadable result.json", f"{result_path}: {err}", has_result=False)
        status = str(result.get("status") or "unknown")
        message = None
        if status != "ok" and log is not None:
            status, message = log
        return Run(name, run_dir, result, status, message)
    recovered = recover_result(run_dir)
    if log is not None:
        status, message = log
    else:
        status = "no result"
        message = (f"{run_dir} has no result.json" + (" and no error in its log.txt" if (run_dir / "log.txt").is_file()
                   else "") + ": the run crashed, was killed or is still running")
    return Run(name, run_dir, recovered, status, message, has_result=False)


def _error_kinds() -> list[str]:
    from litft.errors import LitftError

    kinds, stack = [], [LitftError]
    while stack:
        cls = stack.pop()
        kinds.append(cls.kind)
        stack.extend(cls.__subclasses__())
    return sorted(set(kinds), key=len, reverse=True)


def parse_log(path: Path) -> tuple[str, str] | None:
    """(status, message) from a run's log: the last `litft <command>: <kind>: <message>` line the CLI printed, or
    a bare CUDA out-of-memory traceback, or a timeout that benchmarks/run_recipes.py noted; None if none."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    kinds = "|".join(re.escape(k) for k in _error_kinds())
    pattern = re.compile(rf"^litft(?: [\w.-]+)?: ({kinds}|interrupted)(?:: (.*))?$")
    found = None
    lines = text.splitlines()
    for line in lines:
        match = pattern.match(line.strip())
        if match:
            found = (match.group(1), (match.group(2) or match.group(1)).strip())
    if found:
        return found
    tail = [line.strip() for line in lines if line.strip()][-30:]
    for line in reversed(tail):
        if "OutOfMemoryError" in line or "CUDA out of memory" in line:
            return "out of memory", line
    for line in reversed(tail):
        if line.startswith("timed out after"):
            return "timed out", line
    for line in reversed(tail):
        if re.match(r"^[\w.]+(Error|Exception)\b", line):
            return "crashed", line
    return None


def _read_recipe_yaml(path: Path) -> dict | None:
    """A litft config.yaml (the resolved recipe every run writes before loading its model), or None."""
    try:
        import yaml

        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except Exception:
        return None
    resolved = ("method", "precision", "train", "data", "out_dir", "devices")  # every resolved recipe has these
    if isinstance(data, dict) and all(k in data for k in resolved) and isinstance(data.get("train"), dict):
        return data
    return None


_LOG_START = re.compile(
    r"^litft: (?P<method>\w+) fine-tune, (?P<init>\w+) weights, precision (?P<precision>\S+), out_dir", re.M
)
_LOG_BATCH = re.compile(
    r"^batch: micro_batch_size (?P<micro>\d+) x accumulation (?P<accum>\d+) x devices (?P<devices>\d+)"
    r" = global_batch_size (?P<global_batch>\d+);.* at max_seq_length (?P<seq>\d+)", re.M
)


def recover_result(run_dir: Path) -> dict:
    """What a run dir without result.json still says: the resolved recipe in config.yaml (hence the batch shape and
    config hash), else the first lines `litft finetune` printed into log.txt (method, precision, batch shape)."""
    recipe = _read_recipe_yaml(run_dir / "config.yaml")
    if recipe is None:
        return _recover_from_log(run_dir / "log.txt")
    train, data = recipe.get("train") or {}, recipe.get("data") or {}
    devices = recipe.get("devices") if isinstance(recipe.get("devices"), int) else None
    micro, global_batch = train.get("micro_batch_size"), train.get("global_batch_size")
    accum = None
    if all(isinstance(v, int) and v > 0 for v in (devices, micro, global_batch)):
        accum = global_batch // (micro * devices)
    hashed = {k: v for k, v in recipe.items() if k not in ("out_dir", "logging")}  # as litft.recipe.config_hash
    return {
        "config_hash": hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()[:12],
        "recipe": recipe,
        "batch": {
            "micro_batch_size": micro, "grad_accum": accum, "devices": devices, "global_batch_size": global_batch,
            "max_seq_length": data.get("max_seq_length"),
        },
    }


def _recover_from_log(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    start, batch = _LOG_START.search(text), _LOG_BATCH.search(text)
    result: dict = {}
    if start:
        result["recipe"] = {"method": start["method"], "init": start["init"], "precision": start["precision"]}
    if batch:
        numbers = {k: int(v) for k, v in batch.groupdict().items()}
        result["batch"] = {
            "micro_batch_size": numbers["micro"], "grad_accum": numbers["accum"], "devices": numbers["devices"],
            "global_batch_size": numbers["global_batch"], "max_seq_length": numbers["seq"],
        }
    return result


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


_NUMERIC_KINDS = {"int", "rate", "fraction_pct", "ms", "seconds", "gib", "pct", "loss"}


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
    if kind == "rate":
        return f"{value:,.0f}"
    if kind == "fraction_pct":
        return f"{value * 100:.1f}%"
    if kind == "ms":
        return f"{value * 1000:,.1f} ms"
    if kind == "seconds":
        return f"{value:,.1f} s"
    if kind == "gib":
        return f"{value:,.2f}"
    if kind == "pct":
        return f"{value:+.1f}%"
    if kind == "loss":
        return f"{value:.4f}"
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


# ----------------------------------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------------------------------

_SHORT_STATUS = {"out of memory": "OOM", "non-finite loss": "NaN loss", "timed out": "timeout"}


def _short_status(run: Run) -> str:
    return _SHORT_STATUS.get(run.status, run.status.replace(" ", "\n"))


def _device_label(runs: Sequence[Run]) -> str:
    known = [env for env, _ in environments(runs) if env is not None]
    gpus = list(dict.fromkeys(env.get("gpu") or "CPU" for env in known))
    if not gpus:
        return "environment unknown"
    if len(gpus) > 1 or len(known) > 1:
        return "MIXED environments (not comparable): " + " vs ".join(gpus)
    env = known[0]
    return f"{gpus[0]}, torch {env.get('torch')}" + (f", driver {env.get('driver')}" if env.get("driver") else "")


def _figure(n_bars: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.4, 1.0 * n_bars + 2.5), 4.8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _labels(runs: Sequence[Run]) -> list[str]:
    devices = {r.get("batch.devices") for r in runs if r.get("batch.devices") not in (None, MISSING)}
    if len(devices) > 1:
        return [f"{r.name}\n{r.get('batch.devices')} dev" if isinstance(r.get("batch.devices"), int) else r.name
                for r in runs]
    return [r.name for r in runs]


def _x_axis(ax, runs: Sequence[Run]) -> None:
    labels = _labels(runs)
    rotate = len(runs) > 4 or max(len(line) for label in labels for line in label.split("\n")) > 14
    ax.set_xticks(range(len(runs)), labels, rotation=25 if rotate else 0, ha="right" if rotate else "center",
                  fontsize=8 if len(runs) > 8 else 9)


def _group_colors(runs: Sequence[Run], by: str | None) -> tuple[list, list]:
    """A color per run (by group when `by` is given) and legend handles."""
    from matplotlib.patches import Patch

    if not by:
        return ["tab:blue"] * len(runs), []
    field = resolve_field(runs, by)[0]
    values = list(dict.fromkeys(json.dumps(r.get(field.path), default=str) for r in runs))
    palette = [f"C{i % 10}" for i in range(len(values))]
    color = {v: palette[i] for i, v in enumerate(values)}
    colors = [color[json.dumps(r.get(field.path), default=str)] for r in runs]
    handles = [Patch(color=color[v], label=f"{field.title} = {format_value(json.loads(v))}") for v in values]
    return colors, handles


def _empty_bar(ax, x: float, height: float, text: str, width: float = 0.6) -> None:
    ax.bar(x, height, width=width, fill=False, hatch="//", edgecolor="tab:red", linestyle="--", linewidth=1.2)
    ax.annotate(text, (x, height), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                color="tab:red", fontsize=9, fontweight="bold")


def plot(runs: Sequence[Run], out_dir: str | os.PathLike, by: str | None = None, sort: str | None = None) -> list[Path]:
    """Write tokens_per_sec.png and peak_memory.png (and scaling.png when the runs differ in device count) into
    out_dir; failed runs are annotated empty bars. Returns the paths written. Needs matplotlib (`pip install
    litft[plot]`); it draws on the Agg canvas and leaves pyplot's backend alone."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'litft[plot]' (or pip install matplotlib)") from None
    runs = [run for _, group in group_runs(sort_runs(runs, sort), by) for run in group]
    if not runs:
        raise ConfigError("nothing to plot: no runs")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [
        _plot_tokens_per_sec(runs, out / "tokens_per_sec.png", by), _plot_memory(runs, out / "peak_memory.png", by)
    ]
    devices = {r.get("batch.devices") for r in runs if r.ok and r.number("throughput.tokens_per_sec") is not None}
    if len(devices - {None, MISSING}) > 1:
        written.append(_plot_scaling(runs, out / "scaling.png"))
    return written


def _plot_tokens_per_sec(runs: Sequence[Run], path: Path, by: str | None) -> Path:
    fig, ax = _figure(len(runs))
    values = [r.number("throughput.tokens_per_sec") if r.ok else None for r in runs]
    top = max([v for v in values if v is not None], default=1.0)
    colors, handles = _group_colors(runs, by)
    for i, (run, value) in enumerate(zip(runs, values)):
        if value is None:
            _empty_bar(ax, i, 0.06 * top, _short_status(run) if not run.ok else "n/a")
            continue
        ax.bar(i, value, width=0.6, color=colors[i])
        per_device = run.number("throughput.tokens_per_sec_per_device")
        devices = run.get("batch.devices", None)
        label = f"{value:,.0f}" + (f"\n({per_device:,.0f}/dev)" if per_device and isinstance(devices, int)
                                   and devices > 1 else "")
        ax.annotate(label, (i, value), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                    fontsize=8)
    ax.set_ylim(0, top * 1.18)
    ax.set_ylabel("tokens/s (real, all devices)")
    ax.yaxis.set_major_formatter(_thousands())
    ax.set_title("Throughput: real (non-padding) tokens/s, steady state, all devices\n" + _device_label(runs),
                 fontsize=10)
    _x_axis(ax, runs)
    if handles:
        ax.legend(handles=handles, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path)
    return path


def _thousands():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:,.0f}")


def _plot_memory(runs: Sequence[Run], path: Path, by: str | None) -> Path:
    fig, ax = _figure(len(runs))
    reserved = [r.number("memory.peak_reserved_gib") for r in runs]
    predicted = [r.number("memory.predicted.total_gib") for r in runs]
    capacity = sorted({round(v, 1) for r in runs if (v := r.number("memory.device_total_gib")) is not None})
    # a CPU run has no torch device memory: its host peak RSS is marked instead (a different quantity, labelled so)
    host = [r.number("memory.host_peak_rss_gib") if reserved[i] is None and r.ok else None for i, r in enumerate(runs)]
    has_predicted = any(v is not None for v in predicted)
    top = max([v for v in reserved + predicted + capacity + host if v is not None], default=1.0)
    width = 0.38 if has_predicted else 0.6
    shift = width / 2 if has_predicted else 0.0
    colors, handles = _group_colors(runs, by)
    for i, run in enumerate(runs):
        if reserved[i] is None or not run.ok:
            height = 0.06 * top
            if run.status == "out of memory" and len(capacity) == 1:
                height, text = capacity[0], "OOM"  # it needed more than the device has
            elif not run.ok:
                text = _short_status(run)
            elif run.get("device") == "cpu" or run.environment and not run.environment.get("gpu"):
                text = "n/a\n(CPU)"
            else:
                text = "n/a"
            _empty_bar(ax, i - shift, height, text, width)
        else:
            ax.bar(i - shift, reserved[i], width=width, color=colors[i])
            ax.annotate(f"{reserved[i]:.2f}", (i - shift, reserved[i]), xytext=(0, 3), textcoords="offset points",
                        ha="center", va="bottom", fontsize=8)
        if host[i] is not None:
            ax.plot([i - shift], [host[i]], marker="x", color="black", markersize=8, linestyle="none")
            ax.annotate(f"host RSS {host[i]:.2f}", (i - shift, host[i]), xytext=(6, 0), textcoords="offset points",
                        va="center", fontsize=8)
        if predicted[i] is not None:
            ax.bar(i + shift, predicted[i], width=width, fill=False, edgecolor="0.35", hatch="..")
            ax.annotate(f"{predicted[i]:.2f}", (i + shift, predicted[i]), xytext=(0, 3), textcoords="offset points",
                        ha="center", va="bottom", fontsize=8, color="0.3")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    legend = list(handles) or [Patch(color="tab:blue", label="peak reserved (measured)")]
    if has_predicted:
        legend.append(Patch(facecolor="none", edgecolor="0.35", hatch="..", label="predicted total"))
    if any(v is not None for v in host):
        legend.append(Line2D([], [], marker="x", color="black", linestyle="none",
                             label="host peak RSS (runs without GPU memory)"))
    for value in capacity:
        ax.axhline(value, color="tab:red", linestyle=":", linewidth=1)
    if capacity:
        legend.append(Line2D([], [], color="tab:red", linestyle=":", label="device memory " + ", ".join(
            f"{v:g}" for v in capacity) + " GiB"))
    ax.set_ylim(0, top * 1.15)
    ax.set_ylabel("GiB (2^30 bytes)")
    ax.set_title("Peak memory: torch peak reserved (max over ranks)" + (" vs predicted total" if has_predicted else "")
                 + ", GiB\n" + _device_label(runs), fontsize=10)
    _x_axis(ax, runs)
    ax.legend(handles=legend, fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path)
    return path


def _plot_scaling(runs: Sequence[Run], path: Path) -> Path:
    """Total tok/s against device count, one series per configuration that differs only in devices, with the
    ideal (linear from the series' 1-device run) dashed."""
    measured = [r for r in runs if r.ok and r.number("throughput.tokens_per_sec") is not None
                and isinstance(r.get("batch.devices"), int)]
    series: dict[tuple, list[Run]] = {}
    for run in measured:
        key = tuple(json.dumps(run.get(p), default=str) for p in (
            "model.name", "recipe.method", "recipe.precision", "recipe.quantize", "batch.micro_batch_size",
            "batch.max_seq_length"))
        series.setdefault(key, []).append(run)
    fig, ax = _figure(4)
    top_devices = max(r.get("batch.devices") for r in measured)
    for i, (key, group) in enumerate(series.items()):
        group.sort(key=lambda r: r.get("batch.devices"))
        xs = [r.get("batch.devices") for r in group]
        ys = [r.number("throughput.tokens_per_sec") for r in group]
        color = f"C{i % 10}"
        name = " ".join(json.loads(k) for k in key[:3] if json.loads(k)) + f", micro {json.loads(key[4])}"
        ax.plot(xs, ys, "o-", color=color, label=name)
        base = [y for x, y in zip(xs, ys) if x == 1]
        if base and len(set(xs)) > 1:
            one = sum(base) / len(base)
            ax.plot([1, top_devices], [one, one * top_devices], "--", color=color, alpha=0.6,
                    label="ideal: linear from 1 device")
            for x, y in zip(xs, ys):
                if x > 1:
                    ax.annotate(f"{y / (one * x):.0%} of linear", (x, y), xytext=(6, -14), textcoords="offset points",
                                fontsize=8, color=color)
        for run, x, y in zip(group, xs, ys):
            ax.annotate(f"{y:,.0f}", (x, y), xytext=(4, 4), textcoords="offset points", fontsize=8)
    ax.set_xlabel("devices")
    ax.set_xticks(sorted({r.get("batch.devices") for r in measured}))
    ax.set_xlim(0.6, top_devices + 0.4 + 0.15 * top_devices)
    ax.set_ylabel("tokens/s (real, all devices)")
    ax.yaxis.set_major_formatter(_thousands())
    ax.set_ylim(bottom=0)
    ax.set_title("Scaling: total real tokens/s vs devices, steady state\n" + _device_label(measured), fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(path)
    return path


# ----------------------------------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------------------------------


def compare(
    paths: Sequence[str | os.PathLike], fmt: str = "md", fields: str | None = None, by: str | None = None,
    plot_dir: str | os.PathLike | None = None, sort: str | None = None, stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """`litft compare`: print the table (md to stdout with the stamp; csv/json to stdout with the stamp on stderr, so
    stdout stays machine-readable) and write the plots."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    if fmt not in FORMATS:
        close = difflib.get_close_matches(fmt, FORMATS, n=1)
        raise ConfigError(f"--format '{fmt}' is not one of {', '.join(FORMATS)}" +
                          (f"; did you mean '{close[0]}'?" if close else ""))
    runs = load_runs(paths)
    text = table(runs, fields, fmt, sort=sort, by=by)
    stdout.write(text if text.endswith("\n") else text + "\n")
    notes = stderr if fmt != "md" else stdout
    if fmt != "md":
        for line in stamp(runs):
            print(line, file=stderr)
    if plot_dir is not None:
        if fmt == "md":
            print("", file=notes)
        for path in plot(runs, plot_dir, by=by, sort=sort):
            print(f"wrote {path}", file=notes)
    return 0


__all__ = [
    "Run", "Field", "DEFAULT_FIELDS", "MISSING", "load_runs", "table", "to_rows", "plot", "stamp", "compare",
    "select_fields", "format_value",
]
