"""`litft sweep`: one recipe over a grid of settings, each run in its own process, one table at the end.

    litft sweep --config tiny-llama-lora --grid train.micro_batch_size=1,2,4,8 --grid precision=bf16-true,bf16-mixed \\
        --out out/sweep-batch --train.max_steps 30 --init random --model.tokenizer_dir litft:demo/model

Every combination of the grid's values (here 4 x 2 = 8 runs) is a `litft finetune` of the recipe with the common
overrides, the combination's values and out_dir OUT/runs/NAME, run in its own process with its output in
OUT/runs/NAME/log.txt. So a run that runs out of memory (exit 4) or fails otherwise is a row of the table, not the
end of the sweep, and one run's GPU memory cannot linger into the next. All combinations are checked before the
first one runs (every problem at once, exit 2). After each run OUT/sweep.md and OUT/sweep.csv are rewritten
(`litft compare OUT` gives the same table, with --fields/--plot). The sweep exits 0 when every run finished or ran
out of memory (a result: the setting does not fit), 1 when a run failed for another reason.

A value holding commas goes in brackets: `--grid optimizer.betas=[0.9,0.95],[0.9,0.999]`. `--dry-run` checks every
combination and prints the commands without running them. `--repeat 3` runs each combination three times and adds
the spread of its tok/s and step time (mean, standard deviation, min-max) to the table.

A plan (`litft sweep --plan FILE`) lists runs of any recipes, each with its own settings or grid:

    out: out/lab-part1                 # --out overrides it
    timeout: 900                       # seconds per run (--timeout overrides it)
    set: {init: random, train.max_steps: 20}   # settings of every run
    runs:
      - {name: full-32-true, config: tiny-llama-full, set: {precision: 32-true}}
      - {name: lora, config: tiny-llama-lora, grid: {train.micro_batch_size: [2, 4, 8]}}   # lora_micro_batch_size-2, ...

Each run's outcome (ok, out of memory, host memory, timeout, non-finite loss, data error, config error, error) goes
into OUT/outcomes.json as it ends and into the table's Outcomes section. Started again on the same OUT, a sweep skips
the runs that have an outcome, so a sweep that was stopped midway goes on where it stopped (--rerun runs all again).

`--cpu-demo` runs a plan's runs on the CPU with the demo model and data, a few steps each: the same runs, batch
arithmetic, methods and engines, for a machine without a GPU (a lab's notebooks in CPU mode, CI); one-device runs
are made in the sweep's own process (their start-up would be most of their time). What a CPU cannot
run is replaced and said per run: float16 by 32-true, QLoRA by LoRA, FSDP and DeepSpeed by DDP, more than 2
devices by 2 (gloo processes), and no memory cap.

From Python: ``litft.sweep.run_sweep("tiny-llama-lora", {"train.micro_batch_size": [1, 2, 4]}, "out/sweep")``,
``litft.sweep.run_plan("plans/lab-part1-a100.yaml", cpu_demo=True)``.
"""

from __future__ import annotations

import itertools
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from litft.errors import ConfigError
from litft.files import make_dir, write_text_atomic, writing

OUT_OF_MEMORY_EXIT = 4  # litft finetune's exit code for out of memory: a result in a sweep
OUTCOMES = {0: "ok", 2: "config error", 3: "non-finite loss", 4: "out of memory", 5: "data error",
            6: "checkpoint or file error", 130: "interrupted", -9: "host memory (killed by the OS)",
            137: "host memory (killed by the OS)", None: "timeout"}
"""A run's outcome by its exit code (litft's exit codes; -9: SIGKILL, which the kernel's out-of-memory killer
sends when the host's RAM runs out)."""
RESULTS = (0, OUT_OF_MEMORY_EXIT)
"""Outcomes that are results of the sweep (the run finished, or the setting does not fit): the sweep exits 0."""


def split_values(text: str) -> list[str]:
    """'1,2,[0.9,0.95]' -> ['1', '2', '[0.9,0.95]']: commas inside brackets or braces do not separate."""
    values, depth, current = [], 0, ""
    for char in text:
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            values.append(current.strip())
            current = ""
        else:
            current += char
    values.append(current.strip())
    return values


def parse_grid(specs: list[str]) -> dict[str, list[str]]:
    """['train.micro_batch_size=1,2', 'precision=bf16-true'] -> {'train.micro_batch_size': ['1', '2'], ...}."""
    grid: dict[str, list[str]] = {}
    for spec in specs:
        key, eq, values = spec.partition("=")
        key = key.strip().removeprefix("--")
        parts = split_values(values) if eq else []
        if not key or not parts or any(not part for part in parts):
            raise ConfigError(f"--grid '{spec}': expected KEY=V1,V2,... e.g. --grid train.micro_batch_size=1,2,4")
        if key in grid:
            raise ConfigError(f"--grid: '{key}' is given twice; list all its values in one --grid {key}=...")
        grid[key] = parts
    if not grid:
        raise ConfigError("sweep needs at least one --grid KEY=V1,V2,... (e.g. --grid train.micro_batch_size=1,2,4)")
    return grid


def combinations(grid: dict[str, list[Any]]) -> list[list[tuple[str, str]]]:
    """Every combination of the grid's values, the first key varying slowest."""
    keys = list(grid)
    return [list(zip(keys, (str(v) for v in values))) for values in itertools.product(*grid.values())]


def run_name(combination: list[tuple[str, str]]) -> str:
    """[('train.micro_batch_size', '4'), ('precision', 'bf16-true')] -> 'micro_batch_size-4_precision-bf16-true'."""
    name = "_".join(f"{key.rpartition('.')[2]}-{value}" for key, value in combination)
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", name).strip("-") or "run"


def overrides_of(combination: list[tuple[str, str]]) -> list[str]:
    return [token for key, value in combination for token in (f"--{key}", value)]


def check(runs: list[tuple[str, str, list[str]]], source: str) -> None:
    """Load and validate every run (name, recipe, overrides) before anything runs: all problems at once, by run."""
    from litft.recipe import load_recipe, validate

    problems: list[str] = []
    for name, config, overrides in runs:
        try:
            recipe = load_recipe(config, args=overrides)
        except ConfigError as err:
            problems += [f"{name}: {problem}" for problem in err.problems]
            continue
        problems += [f"{name}: {problem}" for problem in validate(recipe)]
    if problems:
        raise ConfigError(problems, source=source)


def settings_args(settings: dict, problems: list[str]) -> list[str]:
    """A plan's settings ({dotted.key: value}, sections such as optimizer: {class_path, lr} included) as command-line
    overrides, in the shapes litft finetune takes."""
    from litft.recipe.load import _as_args, _optimizer_section, _strategy_section

    values = dict(settings)
    if isinstance(values.get("optimizer"), (dict, str)):
        values["optimizer"] = _optimizer_section(values["optimizer"], problems)
    if "strategy" in values:
        values["strategy"] = _strategy_section(values["strategy"], problems)
    return _as_args(values)


def find_plan(name_or_path: str | Path) -> Path:
    """A plan file: an existing path, or the name of a shipped plan (plans/*.yaml, with or without '.yaml')."""
    from litft.recipe.load import shipped_dir

    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_dir("plans") / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    if shipped.is_file() and path.parent == Path("."):
        return shipped
    names = sorted(p.stem for p in shipped_dir("plans").glob("*.yaml"))
    raise ConfigError(f"--plan: '{name_or_path}' is neither a file nor a shipped plan (shipped: {', '.join(names)})")


def read_plan(path: str | Path) -> tuple[dict, list[tuple[str, str, list[str]]]]:
    """A sweep plan (see the module docstring): its options (out, timeout) and its runs as (name, recipe,
    overrides), grids expanded. Every problem of the file at once, as a ConfigError (exit 2)."""
    from litft.recipe.load import cli_value, read_recipe_file

    path = find_plan(path)
    plan = read_recipe_file(path)  # strict YAML: duplicate keys and empty files are errors, with their lines
    problems: list[str] = []
    unknown = sorted(set(plan) - {"out", "timeout", "set", "runs"})
    if unknown:
        problems.append(f"unknown key(s) {', '.join(unknown)}: a plan has out, timeout, set and runs")
    common = plan.get("set") or {}
    entries = plan.get("runs")
    if not isinstance(common, dict):
        problems.append("set: expected a mapping of settings, e.g. {train.max_steps: 20}")
        common = {}
    if not isinstance(entries, list) or not entries:
        problems.append("runs: expected a list of runs, each {name, config, set and/or grid}")
        entries = []
    runs: list[tuple[str, str, list[str]]] = []
    for index, entry in enumerate(entries, 1):
        where = f"runs[{index}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("config"), str) or not entry.get("name"):
            problems.append(f"{where}: expected a mapping with name and config (a recipe), and set and/or grid")
            continue
        extra = sorted(set(entry) - {"name", "config", "set", "grid"})
        if extra:
            problems.append(f"{where} ({entry['name']}): unknown key(s) {', '.join(extra)}")
        settings = {**common, **(entry.get("set") or {})}
        base = settings_args(settings, problems)
        grid = entry.get("grid")
        if grid is None:
            runs.append((str(entry["name"]), entry["config"], base))
            continue
        if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
            problems.append(f"{where} ({entry['name']}): grid: expected KEY: [V1, V2, ...]")
            continue
        for combination in combinations({k: [cli_value(v) for v in values] for k, values in grid.items()}):
            runs.append((f"{entry['name']}_{run_name(combination)}", entry["config"], base + overrides_of(combination)))
    names = [name for name, _, _ in runs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        problems.append(f"run names given twice: {', '.join(twice)}; each run needs its own name")
    if plan.get("timeout") is not None and not isinstance(plan["timeout"], (int, float)):
        problems.append(f"timeout: expected seconds, got {plan['timeout']!r}")
    if problems:
        raise ConfigError(problems, source=str(path))
    return {"out": plan.get("out"), "timeout": plan.get("timeout")}, runs


CPU_DEMO_DEVICES = 2
"""Devices (gloo processes) a multi-device run gets in --cpu-demo mode: enough to run DDP's code paths."""


def on_cpu_demo(recipe, steps: int = 3):
    """``recipe`` as --cpu-demo runs it: the demo model and data on the CPU for ``steps`` steps, its batch sizes,
    method, engine and devices kept where a CPU can run them; returns (recipe, notes naming what changed)."""
    import dataclasses

    from litft.recipe.schema import StrategyConfig

    notes: list[str] = []
    model = dataclasses.replace(recipe.model, name=None, checkpoint_dir="litft:demo/model", tokenizer_dir=None)
    data = dataclasses.replace(recipe.data, path="litft:demo/instructions.jsonl", val_path=None, num_workers=0)
    train = dataclasses.replace(recipe.train, max_steps=min(recipe.train.max_steps or steps, steps))
    precision, method, devices, strategy = recipe.precision, recipe.method, recipe.devices, recipe.strategy
    if precision.startswith("16-"):
        notes.append(f"precision {precision} -> 32-true (float16 needs a GPU)")
        precision = "32-true"
    if method == "qlora":
        notes.append("method qlora -> lora (bitsandbytes' 4-bit layers need a GPU under Fabric)")
        method = "lora"
    if strategy.sharded:
        notes.append(f"strategy {strategy.name} -> ddp (Lightning's FSDP and DeepSpeed need GPUs)")
        strategy = StrategyConfig(name="ddp")
    if devices * recipe.num_nodes > CPU_DEMO_DEVICES:
        # the global batch keeps its samples: accumulation grows as devices shrink
        notes.append(f"devices {devices} x nodes {recipe.num_nodes} -> {CPU_DEMO_DEVICES}")
        devices = CPU_DEMO_DEVICES
    demo = dataclasses.replace(recipe, model=model, data=data, train=train, init="pretrained", precision=precision,
                               method=method, quantize=None if method != "qlora" else recipe.quantize,
                               accelerator="cpu", devices=devices, num_nodes=1, strategy=strategy, memory_cap=None,
                               merge=False, logging=dataclasses.replace(recipe.logging, tensorboard=False))
    return demo, notes


def cpu_demo_runs(runs: list[tuple[str, str, list[str]]], out: Path, steps: int = 3,
                  say=print) -> list[tuple[str, str, list[str]]]:
    """Each run as --cpu-demo runs it: its recipe (config + overrides) moved onto the CPU (on_cpu_demo), written to
    OUT/cpu-demo/NAME.yaml and run from there."""
    from litft.recipe import load_recipe, recipe_to_yaml

    folder = out / "cpu-demo"
    make_dir(folder, "the CPU demo recipes' folder", "--out")
    moved = []
    for name, config, overrides in runs:
        recipe, notes = on_cpu_demo(load_recipe(config, args=overrides, validate_paths=False), steps)
        path = folder / f"{name}.yaml"
        write_text_atomic(path, recipe_to_yaml(recipe))
        if notes:
            say(f"{name} (cpu-demo): {'; '.join(notes)}")
        moved.append((name, str(path), []))
    return moved


def run_plan(path: str | Path, out: str | Path | None = None, overrides: list[str] | None = None,
             timeout: float | None = None, cpu_demo: bool = False, steps: int = 3, say=print, dry_run: bool = False,
             rerun: bool = False, only: list[str] | None = None) -> int:
    """``litft sweep --plan PATH``: every run of the plan (read_plan), or those named in ``only``, ``overrides``
    added to each, into OUT (the plan's out, else out/sweep-NAME); ``cpu_demo``: on the CPU with the demo model
    (on_cpu_demo), ``steps`` steps each. Returns the sweep's exit code."""
    options, runs = read_plan(path)
    if only is not None:
        unknown = sorted(set(only) - {name for name, _, _ in runs})
        if unknown:
            raise ConfigError(f"only: no run named {', '.join(unknown)} in {path}")
        runs = [run for run in runs if run[0] in only]
    runs = [(name, recipe, args + list(overrides or [])) for name, recipe, args in runs]
    out = Path(out or options["out"] or f"out/sweep-{find_plan(path).stem}")
    in_process: set[str] = set()
    if cpu_demo:
        check(runs, str(path))
        runs = cpu_demo_runs(runs, out, steps, say)
        from litft.recipe import load_recipe

        in_process = {name for name, config, args in runs
                      if load_recipe(config, args=args, validate_paths=False).world_size == 1}
    return run_planned(runs, out, timeout=timeout if timeout is not None else options["timeout"], say=say,
                       dry_run=dry_run, source=str(path), rerun=rerun, in_process=in_process)


def run_sweep(
    config: str, grid: dict[str, list[Any]], out: str | Path, common: list[str] | None = None,
    timeout: float | None = None, say=print, dry_run: bool = False, repeat: int = 1, rerun: bool = False,
) -> int:
    """Run every combination (see the module docstring); return the sweep's exit code. `dry_run`: check every
    combination and print the commands, run nothing. `repeat`: run each combination that many times (NAME_rep1,
    ...) and add each combination's spread of tok/s and step time to the table."""
    common = list(common or [])
    runs = [(run_name(combination), config, common + overrides_of(combination))
            for combination in combinations(grid)]
    if len({name for name, _, _ in runs}) != len(runs):
        raise ConfigError("sweep: two combinations give the same run name; make the grid values distinct")
    if repeat < 1:
        raise ConfigError(f"--repeat: expected 1 or more runs per combination, got {repeat}")
    groups = {name: [f"{name}_rep{r}" for r in range(1, repeat + 1)] if repeat > 1 else [name] for name, _, _ in runs}
    runs = [(run, recipe, overrides) for name, recipe, overrides in runs for run in groups[name]]
    return run_planned(runs, out, timeout=timeout, say=say, dry_run=dry_run, groups=groups if repeat > 1 else None,
                       source=f"sweep of {config}", rerun=rerun)


def run_planned(runs: list[tuple[str, str, list[str]]], out: str | Path, timeout: float | None = None, say=print,
                dry_run: bool = False, groups: dict[str, list[str]] | None = None, source: str = "sweep",
                rerun: bool = False, in_process: set[str] | frozenset[str] = frozenset()) -> int:
    """Run each (name, recipe, overrides) in its own process into OUT/runs/NAME, recording its outcome; runs with an
    outcome in OUT/outcomes.json already are skipped unless ``rerun``. Returns the sweep's exit code.

    ``in_process``: runs to make in this process instead (--cpu-demo's one-device runs: a process's start-up, ~5 s of
    imports, is most of a few-step demo run; such a run cannot run out of GPU memory or be timed out)."""
    from litft import report

    if any(token in ("--out_dir", "--resume") or token.startswith(("--out_dir=", "--resume="))
           for _, _, overrides in runs for token in overrides):
        raise ConfigError("sweep: out_dir and resume are set per run (OUT/runs/NAME); leave them out")
    out = Path(out)
    check(runs, source)
    if dry_run:
        for index, (name, config, overrides) in enumerate(runs, 1):
            command = ["litft", "finetune", "--config", config, *overrides, "--out_dir", str(out / "runs" / name)]
            say(f"[{index}/{len(runs)}] {name}: {' '.join(command)}")
        say(f"{len(runs)} run(s) checked; --dry-run: nothing ran")
        return 0

    outcomes_path = out / "outcomes.json"
    outcomes: dict[str, dict] = {}
    if outcomes_path.is_file() and not rerun:
        outcomes = json.loads(outcomes_path.read_text(encoding="utf-8"))
    failed: list[str] = [name for name, outcome in outcomes.items() if outcome["exit_code"] not in RESULTS]
    for index, (name, config, overrides) in enumerate(runs, 1):
        if name in outcomes:
            say(f"[{index}/{len(runs)}] {name}: {outcomes[name]['outcome']} in an earlier start of this sweep;"
                " skipped (--rerun runs it again)")
            continue
        run_dir = out / "runs" / name
        make_dir(run_dir, "the run's folder", "--out")
        command = [sys.executable, "-m", "litft.cli", "finetune", "--config", config, *overrides,
                   "--out_dir", str(run_dir), "--overwrite", "--logging.progress", "plain"]
        say(f"[{index}/{len(runs)}] {name}: {' '.join(command[3:])}")
        start = time.perf_counter()
        log_path = run_dir / "log.txt"
        with writing("the run's log", log_path, "--out"):
            log = open(log_path, "wb", buffering=0)  # unbuffered: closing it writes nothing that could fail
        with log:  # the run writes into it itself
            try:
                if name in in_process:
                    code = _run_here(command[3:], log)
                else:
                    code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                code = None
                with writing("the run's log", log_path, "--out"):
                    log.write(f"\nlitft sweep: timeout: the run took more than {timeout:.0f} s and was stopped\n"
                              .encode())
        seconds = time.perf_counter() - start
        what = OUTCOMES.get(code, f"error (exit {code})")
        say(f"[{index}/{len(runs)}] {name}: {what}{' (a result)' if code == OUT_OF_MEMORY_EXIT else ''} in"
            f" {seconds:.0f} s")
        if code not in RESULTS:
            failed.append(name)
        outcomes[name] = {"outcome": what, "exit_code": code, "seconds": round(seconds, 1),
                          "message": last_message(log_path)}
        write_text_atomic(outcomes_path, json.dumps(outcomes, indent=2), what="the sweep's outcomes",
                          setting="--out")
        write_tables(out, report, groups, outcomes)

    say("")
    with open(out / "sweep.md", encoding="utf-8") as table:
        say(table.read().rstrip())
    say(f"\ncharts and other fields: litft compare {out} --plot {out / 'plots'} --fields ...")
    if failed:
        say(f"\n{len(failed)} run(s) failed (not out of memory): {', '.join(failed)}; see their log.txt")
        return 1
    return 0


def _run_here(args: list[str], log) -> int:
    """`litft ARGS` in this process, its output into the binary ``log``; returns its exit code (1, with the
    traceback in the log, for an error that is not litft's)."""
    import contextlib
    import io
    import traceback

    from litft.cli import main

    text = io.TextIOWrapper(log, encoding="utf-8", write_through=True)
    try:
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            try:
                return main(args)
            except Exception:  # noqa: BLE001 - the run's own failure is its outcome, not the sweep's
                traceback.print_exc(file=text)
                return 1
    finally:
        text.flush()
        text.detach()  # the log stays open for the caller


def last_message(log_path: Path) -> str:
    """The last line litft wrote to a run's log (its error, for a run that failed)."""
    try:
        lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    said = [line for line in lines if line.startswith("litft")]
    return (said or [line for line in lines if line.strip()] or [""])[-1].strip()[:300]


def write_tables(out: Path, report, groups: dict[str, list[str]] | None = None,
                 outcomes: dict[str, dict] | None = None) -> None:
    """OUT/sweep.md and OUT/sweep.csv from every run so far (the same as `litft compare OUT`), with each run's
    outcome, and with repeats the spread of each combination."""
    runs = report.load_runs([out])
    text = report.table(runs, None, "md") + "\n"
    if outcomes:
        text += "\n## Outcomes\n\n| run | outcome | exit | seconds | last message |\n|---|---|---:|---:|---|\n"
        text += "".join(f"| {name} | {o['outcome']} | {o['exit_code']} | {o['seconds']:.0f} |"
                        f" {o['message'].replace('|', '/')} |\n" for name, o in outcomes.items())
    if groups:
        text += "\n" + "\n".join(spread_lines(out, groups)) + "\n"
    write_text_atomic(out / "sweep.md", text, what="the sweep's table", setting="--out")
    write_text_atomic(out / "sweep.csv", report.table(runs, None, "csv"), what="the sweep's table", setting="--out")


def spread_lines(out: Path, groups: dict[str, list[str]]) -> list[str]:
    """One row per combination: steady-state tok/s and median step time over its finished repeats, as mean, sample
    standard deviation, and min-max: how far one run's figure can be trusted."""
    lines = ["## Repeats", "", "| combination | runs ok | tok/s mean | tok/s sd | tok/s min-max | step ms mean |"
             " step ms sd |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, members in groups.items():
        results = []
        for member in members:
            path = out / "runs" / member / "result.json"
            if path.is_file():
                result = json.loads(path.read_text(encoding="utf-8"))
                if result.get("status") == "ok" and result["throughput"].get("tokens_per_sec"):
                    results.append(result["throughput"])
        rates = [t["tokens_per_sec"] for t in results]
        steps = [t["median_step_time_s"] * 1000 for t in results if t.get("median_step_time_s")]
        if not rates:
            lines.append(f"| {name} | 0 of {len(members)} | | | | | |")
            continue
        sd = statistics.stdev(rates) if len(rates) > 1 else float("nan")
        step_sd = statistics.stdev(steps) if len(steps) > 1 else float("nan")
        lines.append(f"| {name} | {len(rates)} of {len(members)} | {statistics.mean(rates):,.0f} | {sd:,.0f} |"
                     f" {min(rates):,.0f}-{max(rates):,.0f} | {statistics.mean(steps) if steps else float('nan'):.1f} |"
                     f" {step_sd:.1f} |")
    return lines
