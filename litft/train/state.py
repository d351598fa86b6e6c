"""Where a run is: its counters and losses, the stream of micro-batches across epochs, and the training state a
checkpoint saves and a resumed run restores."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from litft.errors import CheckpointError, DataError


@dataclass
class LoopState:
    """The loop's counters. The first four are what a checkpoint saves (and a resume restores)."""

    step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    """Epochs done (the epoch the loader is in)."""
    batch_in_epoch: int = 0
    """Loader items drawn in this epoch."""
    micro_batches: int = 0
    """Loader items drawn in all: the data position."""
    max_micro_tokens: int = 0
    """Positions of the largest micro-batch run (what the memory ledger sizes its prediction for)."""
    micro_batches_run: int = 0
    """Forward/backward passes run by this process (with data.pack_steps, fewer than steps x accumulation)."""

    SAVED = ("step", "epoch", "batch_in_epoch", "micro_batches")

    def counters(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.SAVED}


@dataclass
class Losses:
    """The run's losses: the first and last step's training loss, and the validation loss before and after."""

    train_first: float | None = None
    train_last: float | None = None
    val_initial: float | None = None
    val_final: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        return dataclasses.asdict(self)


def micro_batches(loader, sampler, epochs: int, state: LoopState, resumed: bool = False):
    """Loader items across epochs, with ``state`` tracking the epoch and the position in it (what a resume needs).
    A resumed run's sampler was already placed mid-epoch (load_state_dict); set_epoch keeps that position."""
    while state.epoch < epochs:
        sampler.set_epoch(state.epoch)
        if not resumed:
            state.batch_in_epoch = 0
        resumed = False
        for batch in loader:
            state.batch_in_epoch += 1
            state.micro_batches += 1
            yield batch
        state.epoch += 1
    raise DataError("the training data ran out before the planned number of steps (this is a bug in litft)")


def save_training_state(fabric, recipe, gpt, optimizer, scheduler, sampler, state: LoopState, losses: Losses,
                        out_dir: Path, model=None) -> None:
    """A committed checkpoint of everything the next step depends on (see litft.checkpoint). ``model``: the FSDP or
    DeepSpeed module of a sharded run, whose ranks each write their part."""
    from litft.checkpoint import (
        rng_states,
        save_checkpoint,
        save_sharded_checkpoint,
        trainable_state_dict,
    )

    training_state = {
        "counters": state.counters(),
        "data_position": sampler.position(state.epoch, state.batch_in_epoch),
        "scheduler": scheduler.state_dict(),
        "losses": losses.as_dict(),
        "rng": rng_states(),
    }
    if model is not None:
        save_sharded_checkpoint(fabric, out_dir, recipe, state.step, model, optimizer, training_state,
                                recipe.train.keep_last_n)
        return
    trainable = trainable_state_dict(gpt) if recipe.method in ("lora", "qlora") else gpt.state_dict()
    optimizer_state = optimizer.state_dict()
    if fabric.global_rank == 0:
        save_checkpoint(out_dir, recipe, state.step, trainable, optimizer_state, training_state,
                        recipe.train.keep_last_n)
    fabric.barrier()


def restore(checkpoint: dict, gpt, optimizer, scheduler, sampler, state: LoopState, losses: Losses, recipe,
            fabric=None, model=None) -> None:
    """Put the run back where the checkpoint left it: weights, optimizer, schedule, data position, counters, RNG.
    A sharded run (``model``: its FSDP or DeepSpeed module) reads its part of the weights and optimizer state back
    through ``fabric``."""
    from litft.checkpoint import trainable_state_dict

    if model is not None:
        if checkpoint["sharded"] is None:
            raise CheckpointError(f"{checkpoint['path']} was written by a one-device or DDP run; a sharded run resumes"
                                  " from its own checkpoints only")
        fabric.load(checkpoint["sharded"], {"model": model, "optimizer": optimizer})
        _restore_state(checkpoint, scheduler, sampler, state, losses)
        return
    if checkpoint["sharded"] is not None:
        raise CheckpointError(f"{checkpoint['path']} was written by an FSDP or DeepSpeed run; resume it with the same"
                              " strategy and devices")
    result = gpt.load_state_dict(checkpoint["trainable"], strict=False)
    expected = set(trainable_state_dict(gpt)) if recipe.method in ("lora", "qlora") else set(gpt.state_dict())
    missing = expected & set(result.missing_keys)
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"{checkpoint['path']}/trainable.pth does not fit this model: missing {sorted(missing)[:3]},"
            f" unexpected {result.unexpected_keys[:3]}"
        )
    optimizer.load_state_dict(checkpoint["optimizer"])
    _restore_state(checkpoint, scheduler, sampler, state, losses)


def _restore_state(checkpoint: dict, scheduler, sampler, state: LoopState, losses: Losses) -> None:
    from litft.checkpoint import restore_rng_states

    saved = checkpoint["state"]
    scheduler.load_state_dict(saved["scheduler"])
    sampler.load_state_dict(saved["data_position"])
    for name, value in saved["counters"].items():
        setattr(state, name, value)
    for name, value in saved["losses"].items():
        setattr(losses, name, value)
    restore_rng_states(saved["rng"])


def keep_metrics_until(path: Path, step: int) -> None:
    """A resumed run rewrites the steps after its checkpoint: drop their rows, so no step appears twice."""
    if not path.is_file():
        return
    rows = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    kept = [line for line in rows if json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
