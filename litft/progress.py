"""What a run shows while it trains: a rich progress bar on a terminal, plain log lines elsewhere (files, CI,
notebooks' captured output), and a summary table at the end. Only rank 0 shows anything."""

from __future__ import annotations

import sys
import time

from litft import units


def _fmt_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Progress:
    """Live progress of optimizer steps: step/total, loss, tok/s, GiB, ETA."""

    def __init__(self, mode: str, total_steps: int, enabled: bool) -> None:
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode if enabled else "none"
        self.total = total_steps
        self._t0 = time.perf_counter()
        self._bar = None
        if self.mode == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeRemainingColumn

            self._bar = RichProgress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[stats]}"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total_steps, stats="", start=False)
            self._bar.start()

    def start(self) -> None:
        """The first step begins: the ETA counts from here, not from loading, compiling and capturing before it."""
        self._t0 = time.perf_counter()
        if self._bar is not None:
            self._bar.start_task(self._task)

    def print(self, message: str) -> None:
        if self.mode == "rich":
            self._bar.console.print(message)
        elif self.mode == "plain":
            print(message, flush=True)

    def update(self, step: int, loss: float, tok_s: float | None, gib: float | None, lr: float) -> None:
        stats = f"loss {units.loss(loss)} | lr {lr:.2e} | {units.rate(tok_s)} tok/s"
        if gib:
            stats += f" | {units.gib(gib)}"
        if self.mode == "rich":
            self._bar.update(self._task, completed=step, stats=stats)
        elif self.mode == "plain":
            elapsed = time.perf_counter() - self._t0
            eta = elapsed / step * (self.total - step) if step else None
            print(f"step {step}/{self.total} | {stats} | ETA {_fmt_duration(eta)}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def print_summary(result: dict) -> None:
    """The end-of-run table: what ran, how fast, how much memory, where the files are."""
    from rich.console import Console
    from rich.table import Table

    t = result["throughput"]
    mem = result["memory"]
    losses = result["losses"]
    table = Table(title=f"litft run: {result['status']}", show_header=False, title_justify="left")
    table.add_column("figure", style="bold")
    table.add_column("value")
    rows = [
        ("model / method", f"{result['model']['name']} / {result['recipe']['method']} / {result['recipe']['precision']}"),
        ("batch", result["batch"]["arithmetic"]),
        ("parameters", f"{units.params(result['parameters']['trainable'])} trainable of"
                       f" {units.params(result['parameters']['total'])}"),
        ("steps / epochs", f"{units.count(result['steps'])} / {result['epochs_completed']:.2f}"),
        ("loss (train first -> last)", f"{units.loss(losses['train_first'])} -> {units.loss(losses['train_last'])}"),
        ("val loss (initial -> final)", f"{units.loss(losses['val_initial'])} -> {units.loss(losses['val_final'])}"),
        ("tok/s (real, all devices)", f"{units.rate(t['tokens_per_sec'])}  (padded:"
                                      f" {units.rate(t['padded_tokens_per_sec'])})"),
        ("tok/s per device", units.rate(t["tokens_per_sec_per_device"])),
        ("MFU", units.percent(t["mfu"]) if t["mfu"] is not None else "n/a (CPU or GPU not in the peak table)"),
        ("median step time", f"{t['median_step_time_s'] * 1000:.1f} ms" if t["median_step_time_s"] else "n/a"),
        ("padding", f"{units.percent(t['padding_fraction'])} of positions"),
        ("peak memory", _memory_line(mem)),
        ("wall time", " | ".join(f"{k} {v:.1f}s" for k, v in result["phases_s"].items())),
        ("out_dir", result["out_dir"]),
    ]
    for rank in mem.get("per_rank") or []:
        memory = (f"{units.gib(rank['peak_allocated_gib'])} allocated, {units.gib(rank['peak_reserved_gib'])} reserved"
                  if rank["peak_allocated_gib"] is not None else "no device memory")
        figures = f"{units.rate(rank['tokens_per_sec'])} tok/s, {memory}, host RSS {units.gib(rank['host_peak_rss_gib'])}"
        rows.append((f"rank {rank['rank']}", figures))
    if not t["steady_state"]:
        rows.append(("note", "run too short to skip warm-up steps: throughput includes them"))
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def _memory_line(mem: dict) -> str:
    """The measured peak, and the ledger's prediction with the micro-batch size it was made for."""
    from litft.memory.ledger import sized_for

    predicted = mem.get("predicted")
    if mem.get("peak_allocated_gib") is None:
        line = f"host peak RSS {units.gib(mem['host_peak_rss_gib'])} (CPU run: no device memory)"
        if predicted:
            line += (f"; on a GPU the ledger predicts {units.gib(predicted['total_gib'])} reserved"
                     f" {sized_for(predicted['tokens'])}")
        return line
    line = (
        f"{units.gib(mem['peak_allocated_gib'])} allocated, {units.gib(mem['peak_reserved_gib'])} reserved"
        f" (device used {units.gib(mem['device_used_gib'])} of {units.gib(mem['device_total_gib'])})"
    )
    if predicted and mem.get("error_pct") is not None:
        line += (f"; predicted {units.gib(predicted['total_gib'])} reserved ({mem['error_pct']:+.1f}%)"
                 f" {sized_for(predicted['tokens'])}")
    return line
