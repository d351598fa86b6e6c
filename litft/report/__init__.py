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

import difflib
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from litft.errors import ConfigError
from litft.report.plots import plot
from litft.report.runs import MISSING, Run, load_runs
from litft.report.tables import (
    DEFAULT_FIELDS,
    FORMATS,
    Field,
    format_value,
    select_fields,
    stamp,
    table,
    to_rows,
)


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
