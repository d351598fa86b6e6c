"""Bar charts of runs (matplotlib, Agg canvas): tokens/s, peak memory, and scaling over device counts."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from litft.errors import ConfigError
from litft.files import make_dir, write_atomic
from litft.report.runs import MISSING, Run
from litft.report.tables import environments, format_value, group_runs, resolve_field, sort_runs

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
    make_dir(out, "the plots folder", "--plot")
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
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    """The chart as a PNG, whole or absent (a failed write: WriteError, exit 6)."""
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png"), what="the chart", setting="--plot")
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
    return _save(fig, path)


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
    return _save(fig, path)
