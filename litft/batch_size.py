"""`litft find-batch-size`: the largest micro-batch that fits, found by running it.

    litft find-batch-size --config open-llama-3b-lora --memory-cap 32GiB [--max 256] [--steps 3] [--write R.yaml]

The search starts where the memory ledger says the largest micro-batch fits (so the first trial is usually right or
next to it), then doubles while trials fit and bisects between the last size that fitted and the first that did not.
Each trial is `litft finetune` of the recipe at that micro batch (global batch = micro batch x devices, a few steps,
no evaluation, the recipe's memory_cap or --memory-cap) in its own process: out of memory is an answer (exit 4), not
a crash, and a trial's memory cannot linger into the next. It prints every trial (fits or not, tok/s, peak reserved)
and the answer; --write copies the recipe with that micro batch (and a global batch that is a multiple of it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from litft.errors import ConfigError, LitftError
from litft.sweep import OUT_OF_MEMORY_EXIT


def search(fits: Callable[[int], bool], start: int, maximum: int) -> int | None:
    """The largest size in [1, maximum] for which ``fits`` holds, assuming it holds up to a point and not beyond;
    None when not even 1 fits. Doubles from ``start`` while sizes fit, halves while they do not, then bisects."""
    size = max(1, min(start, maximum))
    if fits(size):
        good, bad = size, None
        while good < maximum:
            size = min(good * 2, maximum)
            if not fits(size):
                bad = size
                break
            good = size
        if bad is None:
            return good
    else:
        bad = size
        good = None
        while bad > 1:
            size = bad // 2
            if fits(size):
                good = size
                break
            bad = size
        if good is None:
            return None
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def ledger_start(recipe, budget_gib: float | None, maximum: int) -> int:
    """The largest power-of-two micro batch the ledger predicts to fit in ``budget_gib`` (1 if none; ``maximum``
    when there is no budget to predict against)."""
    import dataclasses

    from litft.memory import estimate_memory

    if budget_gib is None:
        return 1
    size, best = 1, 1
    while size <= maximum:
        train = dataclasses.replace(recipe.train, micro_batch_size=size, global_batch_size=size * recipe.world_size)
        estimate = estimate_memory(dataclasses.replace(recipe, train=train))
        if estimate is None or estimate.device_gib > budget_gib:
            break
        best, size = size, size * 2
    return best


def trial_command(config: str, args: list[str], micro: int, world_size: int, steps: int, out_dir: Path,
                  memory_cap: str | None) -> list[str]:
    command = [sys.executable, "-m", "litft.cli", "finetune", "--config", config, *args,
               "--train.micro_batch_size", str(micro), "--train.global_batch_size", str(micro * world_size),
               "--train.max_steps", str(steps), "--eval.initial", "false", "--eval.final", "false",
               "--eval.interval", "0", "--logging.progress", "none", "--out_dir", str(out_dir), "--overwrite"]
    if memory_cap is not None:
        command += ["--memory_cap", memory_cap]
    return command


def find_batch_size(config: str, args: list[str], memory_cap: str | None = None, maximum: int = 256,
                    steps: int = 3, say=print) -> tuple[int | None, list[dict]]:
    """(the largest micro batch that fits, every trial as {micro, fits, tokens_per_sec, peak_reserved_gib})."""
    from litft.recipe import load_recipe, parse_memory_cap

    recipe = load_recipe(config, args=args + (["--memory_cap", memory_cap] if memory_cap else []),
                         validate_paths=False)
    cap = recipe.memory_cap
    budget = None
    if cap is not None:
        try:
            budget = parse_memory_cap(cap, 80.0)
        except ValueError as err:
            raise ConfigError(f"--memory-cap: {err}") from None
    start = ledger_start(recipe, budget, maximum)
    say(f"find-batch-size: {config}, up to micro batch {maximum}; the ledger's start: {start}"
        + (f" (largest predicted to fit {cap})" if budget is not None else " (no memory cap to predict against)"))
    trials: list[dict] = []

    def fits(micro: int) -> bool:
        with tempfile.TemporaryDirectory(prefix=f"litft-bs{micro}-") as tmp:
            out_dir = Path(tmp) / "run"
            proc = subprocess.run(trial_command(config, args, micro, recipe.world_size, steps, out_dir, cap),
                                  capture_output=True, text=True, check=False)
            result_path = out_dir / "result.json"
            result = json.loads(result_path.read_text()) if result_path.is_file() else {}
        if proc.returncode not in (0, OUT_OF_MEMORY_EXIT):
            message = [line for line in proc.stderr.splitlines() if line.startswith("litft")]
            raise LitftError(f"the trial at micro batch {micro} failed (exit {proc.returncode}):"
                             f" {message[-1] if message else proc.stderr.strip()[-300:]}")
        ok = proc.returncode == 0
        trial = {"micro": micro, "fits": ok,
                 "tokens_per_sec": (result.get("throughput") or {}).get("tokens_per_sec") if ok else None,
                 "peak_reserved_gib": (result.get("memory") or {}).get("peak_reserved_gib")}
        trials.append(trial)
        rate = f", {trial['tokens_per_sec']:,.0f} tok/s" if trial["tokens_per_sec"] else ""
        say(f"  micro batch {micro}: {'fits' if ok else 'out of memory'}{rate}")
        return ok

    return search(fits, start, maximum), trials
