"""Finding run dirs and reading each run: its result.json, or, for a run that crashed before writing one, its status
from the log's last litft error and its recipe from config.yaml or the log's first lines."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from litft.errors import ConfigError


class _Missing:
    """A key that result.json does not have (shown blank), unlike a key whose value is null (shown 'n/a')."""

    def __repr__(self) -> str:
        return "MISSING"

    def __bool__(self) -> bool:
        return False


MISSING: Any = _Missing()

ENV_KEYS = ("gpu", "driver", "torch", "cuda", "litft", "litgpt", "lightning")
"""What a figure depends on: runs that differ in any of these are not comparable."""


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
    add_scaling(runs)
    return sorted(runs, key=lambda r: natural_key(r.name))


SAME_WORK = ("model.name", "recipe.method", "recipe.precision", "batch.global_batch_size", "batch.max_seq_length")
"""What a run on several devices shares with the one-device run it is compared with."""


def add_scaling(runs: list[Run]) -> None:
    """``scaling`` in each multi-device run's result (in memory, not on disk): its real tok/s over that of a
    one-device run among ``runs`` doing the same work (SAME_WORK), and which run that was."""
    single: dict[tuple, Run] = {}
    for run in runs:
        if run.get("batch.devices", None) == 1 and run.number("throughput.tokens_per_sec"):
            single.setdefault(tuple(run.get(key, None) for key in SAME_WORK), run)
    for run in runs:
        devices = run.get("batch.devices", None)
        rate = run.number("throughput.tokens_per_sec")
        base = single.get(tuple(run.get(key, None) for key in SAME_WORK))
        if isinstance(devices, int) and devices > 1 and rate and base is not None and isinstance(run.result, dict):
            run.result["scaling"] = {"vs_one_device": rate / base.number("throughput.tokens_per_sec"),
                                     "one_device_run": base.name}


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
