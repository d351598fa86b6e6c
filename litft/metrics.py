"""The figures a run reports, defined once (they are also written into every result.json as `definitions`).

- tokens_real: non-padding input positions the model trained on; tokens_padded: all positions, padding included.
- tok/s = tokens_real / steady-state train time. Steady state leaves out the first `logging.skip_steps` optimizer
  steps (compilation, allocator warm-up) and everything between steps (evaluation, checkpointing, logging).
  Reported per device and in total; padding-inclusive tok/s is reported beside it, labelled as such.
- MFU = model FLOP/s / peak dense FLOP/s of the device at the run's compute dtype (PEAK_FLOPS below).
  Model FLOPs per token of a sample of length T: 6 N_trainable + 4 N_frozen + 12 L d T, where N counts matmul
  weights (the input embedding is a lookup and is left out), 6 = forward 2 + input-gradient 2 + weight-gradient 2,
  frozen weights need no weight-gradient (4), and 12 L d T is attention's QK^T and AV (2 x 2 T d per layer
  forward, x3 with backward). Recomputation for activation checkpointing is not counted.
- Memory in GiB (2^30 bytes): torch's peak allocated and peak reserved on each rank (max over ranks), and the
  device-level used memory (all processes, as nvidia-smi shows it).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from litft.files import WriteError, writing
from litft.units import GIB

DEFINITIONS = {
    "tokens_real": "non-padding input positions trained on (all ranks)",
    "tokens_padded": "all input positions incl. padding (all ranks)",
    "tokens_per_sec": "tokens_real / steady-state train time, all devices together",
    "tokens_per_sec_per_device": "tokens_per_sec / devices",
    "padded_tokens_per_sec": "tokens_padded / steady-state train time (padding counted; not the headline figure)",
    "steady_state": "optimizer steps after the first logging.skip_steps; eval, checkpointing and logging excluded",
    "mfu": "model FLOP/s / (devices x peak dense FLOP/s at the compute dtype); "
    "FLOPs/token = 6 N_trainable + 4 N_frozen + 12 L d T (N = matmul weights, T = sample length)",
    "memory": "GiB = 2^30 bytes; torch peak allocated / reserved, max over ranks; device_used = total - free",
    "memory.predicted": "litft's ledger (litft.memory) for this recipe, sized for the largest micro-batch the run"
    " held in memory (predicted_for_tokens: the largest it formed, max_micro_batch_tokens, or with CUDA graphs the"
    " largest captured shape if larger, cuda_graphs.pool_tokens);"
    " error_pct = (predicted reserved - measured peak reserved) / measured x 100;"
    " predicted_worst_case: the same ledger for the largest micro-batch the data could form",
    "gpu": "NVML samples while training: device memory used (all processes) and utilisation (% of time a kernel ran)",
}

# Peak dense (no sparsity) FLOP/s per device, by a substring of torch.cuda.get_device_name() and compute dtype.
# "tf32" is what 32-true runs at when torch.backends.cuda.matmul.allow_tf32 is on (litft turns it on on GPUs).
# Sources: NVIDIA datasheets; H100 SXM 989.4e12 bf16 as in lightning.fabric.utilities.throughput and torchtitan.
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("h100 nvl", {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12}),
    ("h100 pcie", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    ("h100", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM (H100 80GB HBM3)
    ("h200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("a100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("v100", {"fp16": 125e12, "fp32": 15.7e12}),
    ("l4", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
]


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak dense FLOP/s of one device, or None when the device is not in the table (MFU is then not reported)."""
    name = device_name.lower()
    for key, table in PEAK_FLOPS:
        if key in name:
            return table.get(dtype)
    return None


@dataclass
class FlopModel:
    """FLOPs of one training token, by the rule in the module docstring."""

    matmul_trainable: int
    matmul_frozen: int
    n_layer: int
    attn_width: int  # d in 12 L d T: n_head x head_size

    def batch_flops(self, sample_lengths: list[int]) -> float:
        """Model FLOPs of a micro-batch whose samples have these real lengths (padding does no useful work)."""
        per_token = 6 * self.matmul_trainable + 4 * self.matmul_frozen
        tokens = sum(sample_lengths)
        attention = sum(12 * self.n_layer * self.attn_width * t * t for t in sample_lengths)
        return float(per_token * tokens + attention)


# ----------------------------------------------------------------------------------------------------------------------
# Timing without host-device synchronisation in the hot loop
# ----------------------------------------------------------------------------------------------------------------------


class StepClock:
    """Times optimizer steps. On CUDA it records events (no synchronisation); the durations are read later, when
    the loop logs. On the CPU it reads the host clock. Time between stop() and the next start() is not counted."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._open: Any = None
        self._pending: list[tuple[int, Any, Any]] = []  # (step, start, end) not yet read
        self.durations: dict[int, float] = {}  # step -> seconds

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._open = self._mark()

    def stop(self, step: int) -> None:
        self._pending.append((step, self._open, self._mark()))
        self._open = None

    def resolve(self) -> None:
        """Read every finished step's duration (waits for the last recorded event on CUDA)."""
        for step, start, end in self._pending:
            if self.cuda:
                end.synchronize()
                self.durations[step] = start.elapsed_time(end) / 1000.0
            else:
                self.durations[step] = end - start
        self._pending.clear()


@dataclass
class StepRecord:
    """What one optimizer step processed (summed over its micro-batches on this rank)."""

    step: int
    tokens_real: int
    tokens_padded: int
    samples: int
    loss_tokens: int
    flops: float


@dataclass
class Throughput:
    """Accumulates step records; `summary()` gives the steady-state figures."""

    world_size: int
    skip_steps: int
    peak_flops_per_device: float | None
    records: list[StepRecord] = field(default_factory=list)

    def add(self, record: StepRecord) -> None:
        self.records.append(record)

    def summary(self, durations: dict[int, float], rank_sum=None) -> dict[str, Any]:
        """`rank_sum`: sums a tensor over the ranks (an all-reduce), so that token, sample and FLOP counts are the
        totals of all ranks; without it (one device, or a failed run that must not wait on a collective) they are
        this rank's x world size."""
        columns = ("tokens_real", "tokens_padded", "samples", "loss_tokens", "flops")
        counts = torch.tensor([[float(getattr(r, c)) for c in columns] for r in self.records],
                              dtype=torch.float64).reshape(-1, len(columns))
        w = self.world_size
        counts = rank_sum(counts) if rank_sum is not None and w > 1 else counts * w
        totals = {r.step: dict(zip(columns, row)) for r, row in zip(self.records, counts.tolist())}
        timed = [r for r in self.records if r.step in durations]
        steady = [r for r in timed if r.step > self.skip_steps]
        is_steady = bool(steady)
        if not steady:  # a very short run: report what there is, and say so
            steady = timed
        seconds = sum(durations[r.step] for r in steady)

        def total(column: str, records) -> float:
            return sum(totals[r.step][column] for r in records)

        real, padded = total("tokens_real", steady), total("tokens_padded", steady)
        samples, flops = total("samples", steady), total("flops", steady)
        out: dict[str, Any] = {
            "steady_state": is_steady,
            "steps_measured": len(steady),
            "steps_skipped": len(timed) - len(steady),
            "train_time_s": seconds,
            "tokens_real": int(total("tokens_real", self.records)),
            "tokens_padded": int(total("tokens_padded", self.records)),
            "loss_tokens": int(total("loss_tokens", self.records)),
            "padding_fraction": 1 - real / padded if padded else 0.0,
            "tokens_per_sec": real / seconds if seconds else None,
            "tokens_per_sec_per_device": real / seconds / w if seconds else None,
            "padded_tokens_per_sec": padded / seconds if seconds else None,
            "samples_per_sec": samples / seconds if seconds else None,
            "median_step_time_s": statistics.median(durations[r.step] for r in steady) if steady else None,
            "model_flops_per_sec": flops / seconds if seconds else None,
            "mfu": None,
        }
        if seconds and self.peak_flops_per_device:
            out["mfu"] = flops / seconds / (w * self.peak_flops_per_device)
        return out


# ----------------------------------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------------------------------


def memory_stats(device: torch.device) -> dict[str, float | None]:
    """Peak allocated/reserved (torch, this process) and device used memory (all processes), in GiB."""
    if device.type != "cuda":
        return {"peak_allocated_gib": None, "peak_reserved_gib": None, "device_used_gib": None, "device_total_gib": None}
    free, total = torch.cuda.mem_get_info(device)
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
        "device_used_gib": (total - free) / GIB,
        "device_total_gib": total / GIB,
    }


def snapshot_pools(snapshot: dict) -> list[str]:
    """Where reserved memory sits at the moment of an allocator snapshot (torch.cuda.memory._snapshot()), one line per
    memory pool: reserved (the pool's segments), allocated (live blocks) and free (reserved, not allocated: held for
    reuse by that pool only). Pool (0, 0) is the default pool; any other is a CUDA graph's private pool, whose free
    blocks the default pool cannot use: the gap between peak allocated and peak reserved that graphs add."""
    pools: dict[tuple, list[int]] = {}
    for segment in snapshot.get("segments", []):
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        totals = pools.setdefault(pool, [0, 0, 0])
        totals[0] += segment.get("total_size", 0)
        totals[1] += segment.get("allocated_size", 0)
        totals[2] += 1
    lines = []
    for pool, (reserved, allocated, segments) in sorted(pools.items()):
        name = "default pool" if pool == (0, 0) else f"graph pool {pool}"
        lines.append(f"{name}: {reserved / GIB:.2f} GiB reserved in {segments} segments, {allocated / GIB:.2f} GiB"
                     f" allocated, {(reserved - allocated) / GIB:.2f} GiB free")
    return lines


class GpuSampler:
    """Samples device memory used (all processes) and GPU utilisation through NVML on a background thread, so the
    training loop pays nothing for it. No-op without a GPU or without nvidia-ml-py."""

    def __init__(self, device: torch.device, interval: float) -> None:
        import threading

        self.used_gib: list[float] = []
        self.utilization: list[float] = []
        self._stop = threading.Event()
        self._thread = None
        if device.type != "cuda" or interval <= 0:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception:  # no NVML: the figures stay empty and the result says so
            return
        self._interval = interval
        self._thread = threading.Thread(target=self._run, name="litft-gpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.used_gib.append(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / GIB)
                self.utilization.append(float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))
            except Exception:
                return

    def stop(self) -> dict[str, float | int | None]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        return {
            "samples": len(self.used_gib),
            "device_used_peak_gib": max(self.used_gib) if self.used_gib else None,
            "utilization_mean_pct": statistics.fmean(self.utilization) if self.utilization else None,
            "utilization_min_pct": min(self.utilization) if self.utilization else None,
        }


def host_peak_rss_gib() -> float:
    """Peak resident memory of this process (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


# ----------------------------------------------------------------------------------------------------------------------
# Writers
# ----------------------------------------------------------------------------------------------------------------------


class MetricsWriter:
    """One JSON object per logged step in out_dir/metrics.jsonl, and the same scalars in TensorBoard.

    A write that fails raises WriteError (exit 6, litft.files) naming the file; the writer then closes both quietly
    (close() has nothing left to do) and cuts metrics.jsonl back to its last whole row, so a resumed run or a
    report reads whole rows only."""

    def __init__(self, out_dir: Path, tensorboard: bool, wandb: dict | None = None) -> None:
        """``wandb``: wandb.init's arguments (project, mode, config, ...) to log each row to Weights & Biases too."""
        self.path = out_dir / "metrics.jsonl"
        self.tensorboard_dir = out_dir / "tensorboard"
        self._file = self._tb = self._wandb = None
        if wandb is not None:
            self._wandb = start_wandb(out_dir, wandb)
        with writing("the metrics log", self.path):
            self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            with self._writing_tensorboard():
                self._tb = SummaryWriter(log_dir=str(self.tensorboard_dir))

    def write(self, row: dict[str, Any]) -> None:
        whole = self._file.tell()
        try:
            with writing("the metrics log", self.path):
                self._file.write(json.dumps({k: _json_number(v) for k, v in row.items()}) + "\n")
                self._file.flush()
        except WriteError:
            self._abandon()
            with contextlib.suppress(OSError):
                os.truncate(self.path, whole)
            raise
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=row["step"])
        if self._tb is not None:
            with self._writing_tensorboard():
                step = row["step"]
                for key, value in row.items():
                    if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                        self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        file, tb, run = self._file, self._tb, self._wandb
        self._file = self._tb = self._wandb = None
        if run is not None:
            run.finish()
        try:
            if file is not None:
                with writing("the metrics log", self.path):
                    file.close()
        finally:
            if tb is not None:
                with self._writing_tensorboard():
                    tb.close()

    @contextlib.contextmanager
    def _writing_tensorboard(self):
        """TensorBoard writes from a thread of its own: its failures surface at the next add, flush or close."""
        try:
            with writing("the TensorBoard log", self.tensorboard_dir,
                         note="TensorBoard is optional: logging.tensorboard false turns it off"):
                yield
        except WriteError:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """After a failed write: close both, ignoring what else fails (the first failure is the one reported)."""
        for handle in (self._file, self._tb):
            if handle is not None:
                with contextlib.suppress(Exception):
                    handle.close()
        self._file = self._tb = None


def start_wandb(out_dir: Path, settings: dict):
    """A Weights & Biases run writing under out_dir/wandb; ConfigError when wandb is not installed."""
    try:
        import wandb
    except ImportError:
        from litft.errors import ConfigError

        raise ConfigError("logging.wandb: needs the wandb package (pip install wandb), or unset it") from None
    return wandb.init(dir=str(out_dir), name=out_dir.name, **settings)


def wandb_settings(recipe) -> dict | None:
    """wandb.init's arguments for a recipe's logging.wandb (None: off): the project, the mode and the recipe."""
    if not recipe.logging.wandb:
        return None
    from litft.recipe import recipe_to_dict

    return {"project": recipe.logging.wandb, "mode": recipe.logging.wandb_mode, "config": recipe_to_dict(recipe)}


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def environment() -> dict[str, Any]:
    """Versions and hardware a figure depends on (stamped into result.json)."""
    import platform

    import lightning
    import litgpt

    import litft

    env: dict[str, Any] = {
        "litft": litft.__version__,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "litgpt": getattr(litgpt, "__version__", None) or _dist_version("litgpt"),
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": __import__("os").cpu_count(),
        "gpu": None,
        "gpu_count": 0,
        "driver": None,
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
        env["driver"] = _nvidia_driver()
    try:
        env["bitsandbytes"] = _dist_version("bitsandbytes")
    except Exception:
        env["bitsandbytes"] = None
    return env


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        return driver.decode() if isinstance(driver, bytes) else driver
    except Exception:
        return None
