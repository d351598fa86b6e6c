"""What a run reports: its phases' wall time, the figures of result.json, the RunResult handed back to Python, and
the message of a run that ran out of memory."""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from litft import metrics
from litft.errors import OutOfMemoryError
from litft.recipe import Recipe, config_hash, parse_memory_cap, recipe_to_dict


@dataclass
class RunResult:
    """What a run produced: its figures (the content of result.json) and where its files are."""

    out_dir: Path
    result: dict
    model: torch.nn.Module | None = None
    """The trained model (LitGPT GPT, on its device) when the run ran in this process; None when Fabric spawned the
    ranks (several devices started from Python): load out_dir/final instead."""

    @property
    def status(self) -> str:
        return self.result["status"]

    @property
    def tokens_per_sec(self) -> float | None:
        return self.result["throughput"]["tokens_per_sec"]

    @property
    def val_loss(self) -> float | None:
        return self.result["losses"]["val_final"]

    def __getitem__(self, key: str) -> Any:
        return self.result[key]


class Phases:
    """Wall time of each phase, in seconds: load (data and tokenizer), setup (model, optimizer, loaders), warmup (CUDA
    graphs' warm-up and capture of the largest shapes, and the torch.compile runs they set off), train, eval, save."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def memory_result(run, predicted, worst_case, gpu: dict) -> dict:
    """result.json's memory: torch's peaks (max over ranks), host RSS, the cap, and the ledger's prediction for the
    largest micro-batch the run held, with its error against the measured peak reserved."""
    fabric, recipe = run.fabric, run.recipe
    mem = metrics.memory_stats(fabric.device)
    if fabric.world_size > 1 and fabric.device.type == "cuda":
        # max over ranks: the rank that ran out first decides whether the run fits
        peaks = torch.tensor([mem["peak_allocated_gib"], mem["peak_reserved_gib"]], device=fabric.device)
        peaks = fabric.all_reduce(peaks, reduce_op="max")
        mem["peak_allocated_gib"], mem["peak_reserved_gib"] = peaks.tolist()
    mem["host_peak_rss_gib"] = metrics.host_peak_rss_gib()
    mem["cap_gib"] = None
    if recipe.memory_cap is not None and fabric.device.type == "cuda":
        mem["cap_gib"] = parse_memory_cap(recipe.memory_cap, mem["device_total_gib"])
    mem["predicted"] = predicted.as_dict() if predicted is not None else None
    mem["predicted_worst_case"] = worst_case.as_dict() if worst_case is not None else None
    mem["max_micro_batch_tokens"] = run.state.max_micro_tokens
    mem["predicted_for_tokens"] = predicted.tokens if predicted is not None else None
    mem["error_pct"] = None
    if predicted is not None and mem["peak_reserved_gib"]:
        mem["error_pct"] = (predicted.total_gib - mem["peak_reserved_gib"]) / mem["peak_reserved_gib"] * 100
    if gpu:
        mem["device_used_peak_gib"] = gpu.get("device_used_peak_gib")
    return mem


def per_rank(fabric, host_peak_rss_gib: float, tokens_per_sec: float | None) -> list[dict] | None:
    """Every rank's peak memory, host RSS and real tokens per second (its own tokens over its own timed steps), for
    result.json and the summary; one all-gather, made only when every rank got here. None on one device."""
    if fabric.world_size == 1:
        return None
    nan = float("nan")
    own = metrics.memory_stats(fabric.device)  # this rank's peaks (result.json's memory holds the max over ranks)
    mine = [own["peak_allocated_gib"], own["peak_reserved_gib"], host_peak_rss_gib, tokens_per_sec]
    import torch.distributed as dist

    local = torch.tensor([nan if v is None else float(v) for v in mine], dtype=torch.float64, device=fabric.device)
    gathered = [torch.empty_like(local) for _ in range(fabric.world_size)]
    dist.all_gather(gathered, local)
    rows = [row.cpu().tolist() for row in gathered]
    keys = ("peak_allocated_gib", "peak_reserved_gib", "host_peak_rss_gib", "tokens_per_sec")
    return [{"rank": rank, **{k: (None if math.isnan(v) else v) for k, v in zip(keys, row)}}
            for rank, row in enumerate(rows)]


def build_result(run, status: str, throughput: dict, memory: dict, gpu: dict, extra: dict) -> dict:
    """The content of result.json (its definitions travel with it: metrics.DEFINITIONS)."""
    recipe, config, counts, data, state, plan = run.recipe, run.config, run.counts, run.data, run.state, run.plan
    return {
        "status": status,
        "engine": "fabric",
        "out_dir": str(run.out_dir),
        "config_hash": config_hash(recipe),
        "recipe": recipe_to_dict(recipe),
        "model": {"name": config.name, "n_layer": config.n_layer, "n_embd": config.n_embd},
        "parameters": {
            "total": counts.total, "trainable": counts.trainable, "frozen": counts.frozen,
            "matmul_trainable": counts.matmul_trainable, "matmul_frozen": counts.matmul_frozen,
        },
        "batch": {
            "micro_batch_size": recipe.train.micro_batch_size,
            "grad_accum": recipe.grad_accum,
            "devices": run.fabric.world_size,
            "global_batch_size": recipe.train.global_batch_size,
            "max_seq_length": recipe.data.max_seq_length,
            "arithmetic": batch_line(recipe, plan),
            "pack_steps": plan.pack_steps,
            "micro_batches_run": state.micro_batches_run,
        },
        "data": {
            "train": dataclasses.asdict(data.train.stats), "val": dataclasses.asdict(data.val.stats),
            "train_source": data.train_source, "val_source": data.val_source,
        },
        "steps": state.step,
        "epochs_completed": state.micro_batches / max(1, len(run.train_sampler)),
        "losses": run.losses.as_dict(),
        "throughput": throughput,
        "memory": memory,
        "phases_s": run.phases.seconds,
        "gpu": gpu or {},
        "device": torch.cuda.get_device_name(run.fabric.device) if run.fabric.device.type == "cuda" else "cpu",
        "environment": metrics.environment(),
        "definitions": metrics.DEFINITIONS,
        "files": {
            "config": "config.yaml",
            "metrics": "metrics.jsonl",
            "tensorboard": "tensorboard/" if recipe.logging.tensorboard else None,
            "weights": "final/lit_model.pth.lora" if recipe.method in ("lora", "qlora") else "final/lit_model.pth",
        },
        "plan": plan.as_dict(),
        **extra,
    }


def batch_line(recipe: Recipe, plan) -> str:
    """The batch arithmetic as the run prints it, with how data.pack_steps fills the micro-batches."""
    line = recipe.batch_arithmetic()
    if plan.pack_steps:
        line += f"; micro-batches filled to {plan.step_capacity:,} positions (data.pack_steps)"
    return line


def out_of_memory(recipe: Recipe, fabric, err: Exception) -> OutOfMemoryError:
    """The out-of-memory error (exit 4): the batch shape that ran out, the peak, and what would help."""
    mem = metrics.memory_stats(fabric.device)
    t = recipe.train
    hints = []
    if t.micro_batch_size > 1:
        hints.append(f"train.micro_batch_size {t.micro_batch_size // 2} (keeps global_batch_size by accumulating)")
    if not t.activation_checkpointing:
        hints.append("train.activation_checkpointing true")
    if recipe.precision.endswith("-mixed"):
        hints.append("precision bf16-true (no fp32 master weights)")
    if recipe.method == "full":
        hints.append("method lora, or an 8-bit optimizer (bitsandbytes.optim.AdamW8bit)")
    elif recipe.method == "lora":
        hints.append("method qlora")
    hints.append(f"data.max_seq_length {recipe.data.max_seq_length // 2}")
    peak = (f"; peak allocated {mem['peak_allocated_gib']:.2f} GiB of {mem['device_total_gib']:.1f} GiB"
            if mem["peak_allocated_gib"] is not None else "")
    return OutOfMemoryError(
        f"out of memory on rank {fabric.global_rank} with micro_batch_size {t.micro_batch_size}, max_seq_length"
        f" {recipe.data.max_seq_length}, precision {recipe.precision}, method {recipe.method}{peak} ({err})."
        " Try: " + "; ".join(hints) + ". `litft estimate` predicts the memory of each choice."
    )
