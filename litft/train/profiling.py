"""What a run can tell about where its time and memory go: a torch profiler window with the kernel table and how
busy the device was (logging.profile), NVTX ranges for Nsight Systems (logging.nvtx), the CUDA allocator's history
(logging.memory_snapshot), and torch.compile's graph counts and compile time."""

from __future__ import annotations

import pickle
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from litft import metrics
from litft.files import write_atomic, write_text_atomic


def no_range(name: str):
    """A range that marks nothing (logging.nvtx off): torch.cuda.nvtx.range's stand-in."""
    return nullcontext()


class StepProfiler:
    """torch.profiler over optimizer steps START-END (logging.profile), written as a TensorBoard/Perfetto trace.

    Also prints the top ops and how busy the device was: kernel time over wall time of the window. A busy fraction
    well below 100% means the GPU waits for the host (Python, launches, syncs): bigger micro-batches, fewer
    kernels (torch.compile) or CUDA graphs help; near 100% means the kernels themselves are the cost.

    It also keeps the allocator's memory snapshot (logging.memory_snapshot): from start_snapshot() through step N,
    or until the run runs out of memory, written as a pickle for pytorch.org/memory_viz."""

    SNAPSHOT_ENTRIES = 200_000  # allocation events kept (a ring buffer): a TinyLlama step makes a few thousand

    def __init__(self, window: str | None, directory: Path, say, snapshot_steps: int = 0,
                 snapshot_path: Path | None = None) -> None:
        self.start, self.end = (int(x) for x in window.split("-")) if window else (0, -1)
        self.directory, self.say, self._prof, self._t0 = directory, say, None, 0.0
        self.snapshot_steps, self.snapshot_path, self._recording = snapshot_steps, snapshot_path, False

    def start_snapshot(self, recomputes: bool) -> None:
        """recomputes: the backward pass reruns forward code (a chunked loss, activation checkpointing)."""
        if not self.snapshot_steps:
            return
        if not torch.cuda.is_available():
            self.say("memory snapshot: CUDA only (the allocator history is the CUDA caching allocator's); skipped")
            return
        if recomputes:
            # Stacks gathered while the backward pass recomputes a loss chunk stopped the run with "SystemError:
            # <built-in function cross_entropy_loss> returned NULL without setting an exception", with C++ and Python
            # stacks and with Python stacks alone (seen on an H100 with torch 2.11).
            # Without stacks the snapshot still holds every allocation and segment by pool.
            self.say("memory snapshot: recorded without stacks (the backward pass recomputes a loss chunk or blocks;"
                     " train.loss_chunk 0 and no activation checkpointing keep Python stacks)")
            torch.cuda.memory._record_memory_history(max_entries=self.SNAPSHOT_ENTRIES, context=None, stacks="python")
        else:
            # Python stacks: the frames memory_viz shows (C++ stacks cost more and hit the same SystemError)
            torch.cuda.memory._record_memory_history(max_entries=self.SNAPSHOT_ENTRIES, stacks="python")
        self._recording = True

    def dump_snapshot(self, why: str) -> None:
        if not self._recording:
            return
        self._recording = False
        try:
            snapshot = torch.cuda.memory._snapshot()  # what torch.cuda.memory._dump_snapshot pickles
            write_atomic(self.snapshot_path, lambda tmp: tmp.write_bytes(pickle.dumps(snapshot)), durable=False,
                         what="the memory snapshot")
            self.say(f"memory snapshot ({why}) written to {self.snapshot_path}: open it in pytorch.org/memory_viz")
            for line in metrics.snapshot_pools(snapshot):
                self.say(f"  {line}")
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)

    def before(self, step: int) -> None:
        if step == self.start:
            from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

            cuda = torch.cuda.is_available()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            self._prof = profile(
                activities=activities, record_shapes=True, profile_memory=True, with_stack=False,
                on_trace_ready=tensorboard_trace_handler(str(self.directory)),
            )
            if cuda:
                torch.cuda.synchronize()
            self._t0 = time.perf_counter()
            self._prof.__enter__()

    def after(self, step: int) -> None:
        if self._prof is not None and step == self.end:
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - self._t0) * 1000
            self._prof.__exit__(None, None, None)
            averages = self._prof.key_averages()
            sort = "cuda_time_total" if cuda else "cpu_time_total"
            self.say(averages.table(sort_by=sort, row_limit=25))
            if cuda:  # where the host's time goes: with CUDA graphs the GPU waits on it if this adds up to a step
                self.say(averages.table(sort_by="self_cpu_time_total", row_limit=15))
            steps = self.end - self.start + 1
            if cuda:
                # GPU user annotations (record_function ranges such as Optimizer.step#AdamW.step) span kernels that
                # are listed too: counted, they would add the optimizer's time twice to the busy figure
                kernels = [e for e in self._prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                           and not getattr(e, "is_user_annotation", False)]
                busy_ms = sum(e.device_time_total for e in kernels) / 1000  # microseconds -> ms, copies included
                self.say(f"profiler: {steps} steps, {wall_ms:.1f} ms wall, device busy {busy_ms:.1f} ms"
                         f" ({100 * busy_ms / wall_ms:.0f}%), {len(kernels) / steps:.0f} kernels per step")
                for line in kernel_table(kernels, steps):
                    self.say(line)
                # every kernel, not only the top rows: what a breakdown by kind (adapters, attention, ...) sums over
                every_kernel = self.directory.parent / "profile_kernels.txt"
                write_text_atomic(every_kernel, "\n".join(kernel_table(kernels, steps, rows=None, width=400)) + "\n",
                                  durable=False, what="the kernel table")
                self.say(f"profiler: all kernels in {every_kernel}")
            self._prof = None
            self.say(f"profiler: steps {self.start}-{self.end} written to {self.directory} (tensorboard --logdir"
                     f" {self.directory}, or open the .pt.trace.json in ui.perfetto.dev)")
        if step == self.snapshot_steps:
            self.dump_snapshot(f"steps 1-{step}")


def kernel_table(kernels: list, steps: int, rows: int | None = 30, width: int = 150) -> list[str]:
    """GPU kernels grouped by their full name (the op table above cuts names at 55 characters, which hides what an
    elementwise kernel computes), the most time first: ms per step, calls per step, mean us, share of the device
    time; the first ``rows`` kernels, or all with None. Under CUDA graphs this is the only per-kernel view: the op
    table sees one graph launch."""
    totals: dict[str, list[float]] = {}
    for event in kernels:
        entry = totals.setdefault(event.name, [0.0, 0])
        entry[0] += event.device_time_total
        entry[1] += 1
    busy = sum(total for total, _ in totals.values()) or 1.0
    lines = [f"profiler: top kernels by GPU time ({len(totals)} distinct), per step:",
             f"  {'ms':>7} {'calls':>6} {'mean us':>8} {'share':>6}  kernel"]
    for name, (total, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"  {total / 1000 / steps:7.2f} {calls / steps:6.0f} {total / calls:8.1f} {100 * total / busy:5.1f}%"
                     f"  {name[:width]}")
    return lines


def compile_stats(since: dict | None = None) -> dict:
    """How many graphs torch.compile built in this process, or since an earlier count (a number growing with steps
    means recompiles: look at TORCH_LOGS); with `since`, also where the compile time went: the slowest of torch's
    compile-time phases, in seconds (nested: a phase includes the phases it calls), when anything compiled. torch
    keeps those times for the whole process, so they include the ledger's compiled trace (no code generated: seconds)."""
    try:
        from torch._dynamo.utils import compile_times, counters

        now = {"unique_graphs": counters["stats"]["unique_graphs"], "frames_ok": counters["frames"]["ok"]}
    except Exception:
        return {}
    stats = {key: value - (since or {}).get(key, 0) for key, value in now.items()}
    if since is not None and stats["unique_graphs"] > 0:
        try:
            names, seconds = compile_times(repr="csv", aggregate=True)
            slowest = sorted(zip(names, map(float, seconds)), key=lambda item: -item[1])[:12]
            stats["seconds_by_phase"] = {name: round(value, 2) for name, value in slowest}
        except Exception:  # noqa: BLE001 - a diagnostic: its absence must not fail a run
            pass
    return stats
