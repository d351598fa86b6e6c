"""The fine-tuning loop, readable top to bottom: finetune() -> main() -> train() -> fit().

finetune() checks the recipe and builds Fabric. main() runs on every rank: data first (bad data fails before a model
loads), the plan (every speed decision, litft.plan), the predicted memory, then model, optimizer and loaders
(litft.train.setup). train() warms up the CUDA graphs, evaluates, runs fit(), evaluates again, saves the final
weights and writes result.json. fit() is the explicit loop: gather one optimizer step's micro-batches, forward and
backward each, check the loss is finite, clip, step, log.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from litft import metrics, plan as planning
from litft.checkpoint import committed_checkpoints, final_weights_bytes, save_final
from litft.errors import ConfigError, LitftError, NonFiniteLossError
from litft.files import check_free_space, write_json_atomic
from litft.model import CausalLM, architecture_problems, model_config
from litft.progress import Progress, print_summary
from litft.recipe import Recipe, config_hash, load_recipe, resolve_path, validate
from litft.strategy import build_fabric
from litft.train import setup
from litft.train.engines import GraphedMicroSteps, PlainMicroStep, model_inputs
from litft.train.optim import build_optimizer, build_scheduler, clip_gradients, optimizer_summary
from litft.train.profiling import StepProfiler, compile_stats, no_range
from litft.train.result import (
    Phases,
    RunResult,
    batch_line,
    build_result,
    memory_result,
    out_of_memory,
    per_rank,
)
from litft.train.state import Losses, LoopState, micro_batches, restore, save_training_state


def finetune(recipe: Recipe, overwrite: bool = False, resume: str | None = None) -> RunResult:
    """Run a recipe. `resume`: 'auto' (the newest committed checkpoint in out_dir) or a checkpoint folder.
    Raises a LitftError subclass (with its exit code) on bad input or a failed run."""
    problems = validate(recipe)
    if problems:
        raise ConfigError(problems)
    out_dir = resolve_path(recipe.out_dir)
    if resume == "auto" and not committed_checkpoints(out_dir):
        # LitGPT's meaning of auto: the newest committed checkpoint if there is one, else the run from its start; an
        # out_dir that holds this recipe's own run (interrupted before its first checkpoint) is this run's to restart
        overwrite = overwrite or holds_this_run(out_dir, recipe)
        print(f"resume auto: no committed checkpoint in '{out_dir}'; starting the run from the beginning")
        resume = None
    if resume is None and not started_as_other_rank():
        check_out_dir(out_dir, overwrite)
    if recipe.engine == "trainer":
        if resume is not None:
            raise ConfigError("--resume: engine trainer starts runs from the beginning only; resume under engine"
                              " fabric (the default)")
        from litft.lightning import finetune_with_trainer

        return finetune_with_trainer(recipe)
    fabric = build_fabric(recipe)
    from litft.strategy import LAUNCHED_FROM_CLI

    if fabric.world_size > 1 and not LAUNCHED_FROM_CLI:
        # Ranks spawned from Python: their exceptions would reach this process only as traceback text, so each
        # rank hands its litft error back as its return value, and it is raised here with its exit code
        outcome = fabric.launch(spawned_rank, recipe, resume)
        if isinstance(outcome, LitftError):
            raise outcome
        return outcome
    try:
        return fabric.launch(main, recipe, resume)
    except torch.OutOfMemoryError as err:  # before the loop's own handler: loading or sharding the model
        raise out_of_memory(recipe, fabric, err) from None


def spawned_rank(fabric, recipe: Recipe, resume: str | None) -> RunResult | LitftError:
    """main() in a rank Fabric spawned: a litft error (or running out of memory) is returned, not raised. What it
    returns goes back through a pickle: the figures go back, the model stays (its weights are in out_dir/final; LoRA
    layers do not pickle)."""
    try:
        return dataclasses.replace(main(fabric, recipe, resume), model=None)
    except LitftError as err:
        return err
    except torch.OutOfMemoryError as err:
        return out_of_memory(recipe, fabric, err)


def started_as_other_rank() -> bool:
    """This process is a rank other than the first, started by a launcher (the command line re-run by Lightning for
    each further device, torchrun, SLURM): rank 0 checks and writes the out_dir, and may already have written it by
    the time this one starts."""
    return any(os.environ.get(name, "0") != "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse an out_dir that cannot be written (a file, a path under a file, a read-only disk: exit 6, before
    anything is built), and refuse to mix a new run into another run's out_dir (its metrics and weights would be
    interleaved: exit 2)."""
    from litft.files import check_writable

    check_writable(out_dir)
    if out_dir.is_dir() and any((out_dir / name).exists() for name in ("result.json", "metrics.jsonl", "config.yaml")):
        if not overwrite:
            raise ConfigError(
                f"out_dir: '{out_dir}' already holds a run (config.yaml/metrics.jsonl/result.json); choose another"
                " out_dir, or pass --overwrite to replace it"
            )


def holds_this_run(out_dir: Path, recipe: Recipe) -> bool:
    """Whether out_dir's config.yaml is this recipe (the same config hash: out_dir and logging aside)."""
    saved = out_dir / "config.yaml"
    if not saved.is_file():
        return False
    try:
        return config_hash(load_recipe(saved, validate_paths=False)) == config_hash(recipe)
    except LitftError:  # not a recipe litft can read: another run's, or damaged
        return False


@dataclass
class Run:
    """What main() builds and train() and fit() use: the run's parts and its state, in one place."""

    fabric: Any
    recipe: Recipe
    plan: planning.Plan
    config: Any
    """The litgpt Config."""
    data: Any
    """litft.data.PreparedData."""
    out_dir: Path
    phases: Phases
    model: Any
    """CausalLM inside Fabric's wrapper."""
    counts: Any
    optimizer: Any
    scheduler: Any
    train_loader: Any
    train_sampler: Any
    val_loader: Any
    total_steps: int
    state: LoopState = field(default_factory=LoopState)
    losses: Losses = field(default_factory=Losses)

    @property
    def gpt(self) -> torch.nn.Module:
        """The LitGPT GPT inside Fabric's wrapper and CausalLM."""
        return unwrap(self.model)

    @property
    def sharded_model(self):
        """The model as FSDP or DeepSpeed wrap it, whose weights only all ranks together hold; None otherwise."""
        return self.model if self.plan.strategy in ("fsdp", "deepspeed") else None


def unwrap(model) -> torch.nn.Module:
    """The LitGPT GPT inside Fabric's wrapper (and FSDP's or DeepSpeed's) and litft's CausalLM."""
    module = causal_lm(model)
    return module.gpt if isinstance(module, CausalLM) else module


def causal_lm(model) -> torch.nn.Module:
    """litft's CausalLM inside Fabric's wrapper, and inside FSDP's or DeepSpeed's where they wrap it."""
    module = model
    while not isinstance(module, CausalLM) and hasattr(module, "module"):
        module = module.module
    return module


def main(fabric, recipe: Recipe, resume: str | None = None) -> RunResult:
    # Everything that can be checked before the model is built is checked first: a bad setting costs seconds
    phases = Phases()
    out_dir = resolve_path(recipe.out_dir)
    config = model_config(recipe)
    problems = architecture_problems(recipe, config)
    if problems:
        raise ConfigError(problems)
    with phases("load"):
        data = setup.load_data(recipe)
    checkpoint = setup.load_resume(fabric, recipe, out_dir, resume) if resume is not None else None
    cuda = fabric.device.type == "cuda"
    plan = planning.resolve(recipe, config, fabric.device.type, fabric.world_size, data_stats=data.train.stats,
                            device_name=torch.cuda.get_device_name(fabric.device) if cuda else None,
                            capability=torch.cuda.get_device_capability(fabric.device) if cuda else None)
    train_sampler, val_sampler = setup.make_samplers(fabric, recipe, plan, data)
    micro_batches_per_epoch = len(train_sampler) * plan.loader_batch_size // recipe.train.micro_batch_size
    total_steps = planning.planned_steps(recipe, micro_batches_per_epoch)
    check_free_space(out_dir, final_weights_bytes(recipe, config), "the final weights")
    if fabric.global_rank == 0:
        setup.start_out_dir(out_dir, recipe, checkpoint)
    fabric.print(f"litft: {recipe.method} fine-tune, {recipe.init} weights, precision {recipe.precision},"
                 f" out_dir {out_dir}")
    for line in data.describe():
        fabric.print(f"data {line}")
    fabric.print(f"batch: {batch_line(recipe, plan)}")
    for note in plan.notes:
        fabric.print(f"speed: {note}")

    # the predicted ledger (CPU, seconds) and the memory cap, before anything is on the GPU
    worst_case = setup.predict_memory(recipe, config, plan, setup.worst_case_tokens(
        plan, recipe.train.micro_batch_size, data.train.lengths))
    if worst_case is not None:
        fabric.print(f"memory: predicted peak {worst_case.total_gib:.2f} GiB reserved per device (`litft estimate`"
                     " itemises it)")
    if recipe.memory_cap is not None and cuda:
        setup.apply_memory_cap(recipe, fabric)

    with phases("setup"):
        model, counts = setup.setup_model(fabric, recipe, plan, config)
        fabric.print(f"speed: {plan.speed_line()}")
        if plan.strategy == "deepspeed":  # DeepSpeed's engine takes the model and its optimizer together
            raw_optimizer = build_optimizer(recipe, model, plan)
            model, optimizer = fabric.setup(model, raw_optimizer)
            scheduler = build_scheduler(recipe, raw_optimizer, total_steps)  # DeepSpeed steps the same param groups
        else:
            optimizer = fabric.setup_optimizers(build_optimizer(recipe, model, plan))
            scheduler = build_scheduler(recipe, optimizer, total_steps)
        train_loader, val_loader = setup.setup_loaders(fabric, recipe, plan, data, train_sampler, val_sampler)
    run = Run(fabric, recipe, plan, config, data, out_dir, phases, model, counts, optimizer, scheduler,
              train_loader, train_sampler, val_loader, total_steps)
    if checkpoint is not None:
        restore(checkpoint, run.gpt, optimizer, scheduler, train_sampler, run.state, run.losses, recipe, fabric,
                run.sharded_model)
    return train(run, checkpoint, worst_case)


def train(run: Run, checkpoint: dict | None, worst_case) -> RunResult:
    """Warm up, evaluate, fit, evaluate, save; then result.json, whatever happened (a failed run's says so)."""
    fabric, recipe, plan, state, losses = run.fabric, run.recipe, run.plan, run.state, run.losses
    is_main = fabric.global_rank == 0
    optimizer_used = optimizer_summary(run.optimizer)
    if recipe.train.max_grad_norm is not None:
        optimizer_used["clipping"] = ("norm only; the fused step divides" if plan.step_scales
                                      else "fabric.clip_gradients")
    fabric.print(f"optimizer: {optimizer_used['class']} ({optimizer_used['implementation']}"
                 + (f"; clipping: {optimizer_used['clipping']}" if "clipping" in optimizer_used else "")
                 + ("; each step's loss read a step late, a non-finite step's update skipped on the device"
                    if plan.step_scales else "; each step's loss read before its update") + ")")
    progress = Progress(recipe.logging.progress, run.total_steps, enabled=is_main)
    writer = (metrics.MetricsWriter(run.out_dir, recipe.logging.tensorboard, metrics.wandb_settings(recipe))
              if is_main else None)
    reducer = None
    if plan.reduces_gradients:
        from litft.train.reduce import GradientReducer

        reducer = GradientReducer(run.gpt, fabric.device)
        causal_lm(run.model).reducer = reducer
    micro_step = (GraphedMicroSteps(fabric, run.model, progress.print, plan.compile, reducer) if plan.cuda_graphs
                  else PlainMicroStep(fabric, run.model, reducer))
    if checkpoint is not None:
        progress.print(f"resumed from {checkpoint['path']} at step {state.step} (epoch {state.epoch},"
                       f" micro-batch {state.batch_in_epoch} of {len(run.train_sampler)})")
    profiler = StepProfiler(recipe.logging.profile, run.out_dir / "profile", progress.print,
                            recipe.logging.memory_snapshot, run.out_dir / "memory_snapshot.pickle")
    profiler.start_snapshot(recomputes=recipe.train.loss_chunk > 0 or recipe.train.activation_checkpointing)
    graphs_before = compile_stats()  # the ledger's trace compiles too: count only the run's own graphs
    throughput = throughput_meter(run)
    clock = metrics.StepClock(fabric.device)
    status, gpu = "failed", {}
    try:
        if plan.cuda_graphs:  # warm-up and capture run the largest micro-batch: inside the try (out of memory: exit 4)
            with run.phases("warmup"):  # CUDA graphs' warm-up and capture, with the compiles they set off
                micro_step.prepare(stand_in_batches(run))
        if recipe.eval.initial and checkpoint is None:  # a resumed run keeps the val loss its run started from
            with run.phases("eval"):
                losses.val_initial = evaluate(fabric, run.model, run.val_loader, recipe.eval.max_batches)
            progress.print(f"val loss before training: {losses.val_initial:.4f}")
        sampler = metrics.GpuSampler(fabric.device, recipe.logging.gpu_sample_interval)
        try:
            with run.phases("train"):
                fit(run, micro_step, Meters(throughput, clock, writer, progress, profiler, flop_model(run)))
        finally:
            gpu = sampler.stop()
        if recipe.eval.final:
            with run.phases("eval"):
                losses.val_final = evaluate(fabric, run.model, run.val_loader, None)
            progress.print(f"val loss after training: {losses.val_final:.4f}")
        with run.phases("save"):
            save_final(fabric, recipe, run.config, run.gpt, run.out_dir, run.sharded_model)
        status = "ok"
    except torch.OutOfMemoryError as err:
        profiler.dump_snapshot("out of memory")
        raise out_of_memory(recipe, fabric, err) from None
    finally:
        profiler.dump_snapshot("the run ended before the snapshot's last step")  # nothing if written or off
        progress.close()
        if writer is not None:
            writer.close()
        clock.resolve()
        result = report(run, status, throughput, clock, gpu, worst_case, micro_step.stats(),
                        compile_stats(since=graphs_before), optimizer_used)
        if is_main:
            write_json_atomic(run.out_dir / "result.json", result)
    if is_main and recipe.logging.progress != "none":
        print_summary(result)
    return RunResult(out_dir=run.out_dir, result=result, model=run.gpt)


def throughput_meter(run: Run) -> metrics.Throughput:
    device_name = torch.cuda.get_device_name(run.fabric.device) if run.fabric.device.type == "cuda" else None
    peak = metrics.peak_flops(device_name, run.plan.precision.peak_flops_key()) if device_name else None
    return metrics.Throughput(world_size=run.fabric.world_size, skip_steps=run.recipe.logging.skip_steps,
                              peak_flops_per_device=peak)


def stand_in_batches(run: Run) -> list[dict]:
    """The batches CUDA graphs warm up on and capture before training: the data's largest first, then every packed
    width a step's micro-batch can take."""
    from litft.data import collate_function, largest_batches

    plan, data = run.plan, run.data
    collate = collate_function(data.pad_id, plan.packing, True, plan.loader_batch_size)
    return largest_batches(data.train.lengths, plan.loader_batch_size, collate, data.pad_id, plan.step_capacity,
                           GraphedMicroSteps.upfront_shapes(plan.step_capacity))


def report(run: Run, status: str, throughput, clock, gpu: dict, worst_case, graph_stats: dict, compiled: dict,
           optimizer_used: dict) -> dict:
    """result.json's content. Token, sample and FLOP counts are summed over the ranks (one all-reduce, on the device:
    NCCL needs CUDA tensors), only when every rank got here: a rank that failed would leave the others waiting.

    The prediction the measurement is held against is the same ledger, sized for the largest micro-batch this run
    held in memory: the largest it formed (a short run rarely meets the data's worst case, which stays in the result
    too), or, with CUDA graphs, the largest captured shape if larger: that capture's activations stay reserved in
    the graphs' pool for the whole run."""
    fabric = run.fabric
    rank_sum = None
    if status == "ok" and fabric.world_size > 1:
        rank_sum = lambda t: fabric.all_reduce(t.to(fabric.device), reduce_op="sum").cpu()  # noqa: E731
    held_tokens = max(run.state.max_micro_tokens, graph_stats.get("pool_tokens", 0))
    seen = None
    if worst_case is not None and held_tokens:
        seen = setup.predict_memory(run.recipe, run.config, run.plan, held_tokens)
    memory = memory_result(run, seen or worst_case, worst_case, gpu)
    summary = throughput.summary(clock.durations, rank_sum)
    if rank_sum is not None:  # every rank got here: each one's own memory and speed
        own = throughput.summary(clock.durations)  # this rank's counts x world size
        own_rate = own["tokens_per_sec"] / fabric.world_size if own["tokens_per_sec"] else None
        memory["per_rank"] = per_rank(fabric, memory["host_peak_rss_gib"], own_rate)
    extra = {"cuda_graphs": graph_stats, "compile": compiled, "optimizer": optimizer_used,
             "grad_into_weights": run.plan.layers.grad_into_weights, "loss_read": run.plan.loss_read(),
             "triton_kernels": run.plan.triton_summary()}
    return build_result(run, status, summary, memory, gpu, extra)


@torch.no_grad()
def evaluate(fabric, model, loader, max_batches: int | None) -> float:
    """Mean loss per loss token over the validation set (all ranks)."""
    model.eval()
    total = torch.zeros(2, device=fabric.device)  # (loss sum, loss tokens)
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        total[0] += model(**model_inputs(batch, fabric.device))
        total[1] += batch["loss_tokens"]
    if fabric.world_size > 1:
        total = fabric.all_reduce(total, reduce_op="sum")
    model.train()
    loss_sum, tokens = total.tolist()
    return loss_sum / max(tokens, 1)


# ----------------------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Meters:
    """What fit() measures and shows with: throughput, step times, the metrics files, progress, the profiler."""

    throughput: metrics.Throughput
    clock: metrics.StepClock
    writer: metrics.MetricsWriter | None
    progress: Progress
    profiler: StepProfiler
    flops: metrics.FlopModel


@dataclass
class StepNumbers:
    """One optimizer step's loss and gradient norm on their way to the host, with what the step trained on: read
    before the next update (see fit)."""

    step: int
    on_device: torch.Tensor
    """[loss, gradient norm] (the loss twice without clipping) where the step computed them: what the fused
    optimizer's found_inf is made from, on the device."""
    check: torch.Tensor
    """The same on the host, once ``ready`` has passed."""
    ready: Any
    """A CUDA event recorded after the copy to the host, or None (the check is already on the host)."""
    record: metrics.StepRecord
    epoch: float
    """Epochs done when the step's batches had been drawn (for the log row)."""
    lr: float
    """The learning rate the step's update uses (the scheduler moves on before a late-read step is logged)."""

    @classmethod
    def of(cls, step: int, check: torch.Tensor, record: metrics.StepRecord, epoch: float,
           lr: float) -> StepNumbers:
        if check.device.type != "cuda":
            return cls(step, check, check, None, record, epoch, lr)
        host = torch.empty(check.shape, dtype=check.dtype, pin_memory=True)
        host.copy_(check, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(step, check, host, ready, record, epoch, lr)

    def read(self) -> tuple[float, float]:
        """The loss and gradient norm (waits for the step to get that far on the device)."""
        if self.ready is not None:
            self.ready.synchronize()
        loss_value, norm_value = self.check.tolist()
        return loss_value, norm_value


def fit(run: Run, micro_step, meters: Meters) -> None:
    """The loop: one iteration per optimizer step, `grad_accum` micro-batches each (with data.pack_steps, as many as
    the step's samples fill; `micro_step` runs one micro-batch's forward and backward, plainly or as a CUDA graph).

    A step's loss and gradient norm must be finite before the weights change. Read at once, they cost a host-device
    sync per step, and the GPU idles from the step's last kernel until the host has launched the update and the
    next step's work. Where the plan says so (plan.step_scales: a fused optimizer that can skip its own update on
    the device through found_inf, as torch's GradScaler uses it), step N's numbers are read after step N+1's forward
    and backward are queued and before step N+1's update: a non-finite step still changes no weights, and the GPU
    always has work queued. Steps that evaluate or save, and the last, are read at once (their numbers are needed
    before anything is written)."""
    fabric, recipe, state = run.fabric, run.recipe, run.state
    reads_late = run.plan.step_scales
    batches = micro_batches(run.train_loader, run.train_sampler, recipe.train.epochs, state, resumed=state.step > 0)
    # logging.nvtx: forward+backward and optimizer as named ranges in an Nsight Systems capture
    mark = torch.cuda.nvtx.range if recipe.logging.nvtx and fabric.device.type == "cuda" else no_range
    pending: StepNumbers | None = None  # a step whose numbers are not read yet
    inner = getattr(run.optimizer, "optimizer", run.optimizer)  # Fabric wraps the torch optimizer (found_inf)
    meters.progress.start()
    while state.step < run.total_steps:
        step = state.step + 1
        meters.profiler.before(step)
        step_batches = next(batches) if run.plan.pack_steps else [next(batches) for _ in range(recipe.grad_accum)]
        numbers = forward_backward(run, micro_step, meters, step, step_batches, mark)
        if pending is not None:  # the previous step, read while this step's work runs on the device
            log_step(run, meters, pending, *read_step(run, meters, pending), val_loss=None)
            pending = None
        if reads_late:  # the update skips itself on the device if this step's numbers are not finite
            inner.found_inf = (~torch.isfinite(numbers.on_device)).any().float()
        else:
            loss_value, norm_value = read_step(run, meters, numbers)  # one host-device sync per step
        with mark("optimizer"):
            run.optimizer.step()
            # CUDA graphs add into the gradients' fixed addresses: zero them in place rather than free them
            run.optimizer.zero_grad(set_to_none=not micro_step.keeps_gradients)
        run.scheduler.step()
        meters.clock.stop(step)
        state.step = step
        meters.profiler.after(step)

        evaluates = bool(recipe.eval.interval and step % recipe.eval.interval == 0 and step < run.total_steps)
        saves = bool(recipe.train.save_interval and step % recipe.train.save_interval == 0)
        if reads_late:
            if not (evaluates or saves or step == run.total_steps):
                pending = numbers
                continue
            loss_value, norm_value = read_step(run, meters, numbers)
        val_loss = None
        if evaluates:
            with run.phases("eval"):
                val_loss = evaluate(fabric, run.model, run.val_loader, recipe.eval.max_batches)
            meters.progress.print(f"step {step}: val loss {val_loss:.4f}")
        if saves:
            with run.phases("save"):
                save_training_state(fabric, recipe, run.gpt, run.optimizer, run.scheduler, run.train_sampler,
                                    state, run.losses, run.out_dir, run.sharded_model)
        log_step(run, meters, numbers, loss_value, norm_value, val_loss)


def forward_backward(run: Run, micro_step, meters: Meters, step: int, step_batches: list[dict], mark) -> StepNumbers:
    """One step's micro-batches forward and backward, then the gradient norm (and clipping); returns the step's
    numbers, still on the device."""
    fabric, recipe, state = run.fabric, run.recipe, run.state
    state.max_micro_tokens = max(state.max_micro_tokens, *(b["tokens_padded"] for b in step_batches))
    state.micro_batches_run += len(step_batches)
    # Normalise by the step's loss tokens over all ranks, so each loss token weighs the same however the global
    # batch is split into micro-batches and devices. DDP averages gradients over ranks, hence the x world_size.
    loss_tokens = sum(b["loss_tokens"] for b in step_batches)  # counted on the CPU by the collate
    if fabric.world_size > 1:  # a device tensor only when ranks must agree on it (one small all-reduce)
        denominator = ranks_loss_tokens(fabric, loss_tokens).clamp(min=1).float() / fabric.world_size
    else:  # a Python number: no host-to-device copy, which would wait for the previous step to finish
        denominator = float(max(loss_tokens, 1))

    meters.clock.start()
    loss_sum = torch.zeros((), device=fabric.device)
    reducer = getattr(micro_step, "reducer", None)
    for i, batch in enumerate(step_batches):
        last = i == len(step_batches) - 1
        if reducer is not None:
            reducer.arm(last)  # litft's DDP: the step's last backward pass averages the gradients
        # FSDP's no_sync keeps the unsharded gradients until the last micro-batch; DeepSpeed reduces in each backward
        with fabric.no_backward_sync(run.model, enabled=not last and run.plan.strategy == "fsdp"):
            with mark("forward+backward"):
                loss_sum += micro_step(model_inputs(batch, fabric.device), denominator)

    grad_norm = None
    if recipe.train.max_grad_norm is not None and run.plan.strategy != "deepspeed":  # DeepSpeed clips in its step
        grad_norm = clip_gradients(fabric, run.model, run.optimizer, recipe.train.max_grad_norm, run.plan.step_scales)
    step_loss = (loss_sum / denominator / fabric.world_size).float()
    if fabric.world_size > 1:
        step_loss = sum_over_ranks(step_loss)
    check = torch.stack([step_loss, grad_norm.float() if grad_norm is not None else step_loss])
    return StepNumbers.of(step, check, metrics.StepRecord(
        step=step,
        tokens_real=sum(b["tokens_real"] for b in step_batches),
        tokens_padded=sum(b["tokens_padded"] for b in step_batches),
        samples=sum(b["samples"] for b in step_batches),
        loss_tokens=loss_tokens,
        flops=sum(meters.flops.batch_flops(b["lengths"]) for b in step_batches),
    ), epoch=state.epoch + state.batch_in_epoch / max(1, len(run.train_sampler)), lr=run.scheduler.get_last_lr()[0])


def ranks_loss_tokens(fabric, loss_tokens: int) -> torch.Tensor:
    """The step's loss tokens summed over the ranks, on the device. The count goes up through pinned memory without
    waiting (a plain torch.tensor(..., device=cuda) would wait for the GPU to finish the previous step's work)."""
    count = torch.tensor(loss_tokens, pin_memory=fabric.device.type == "cuda")
    return sum_over_ranks(count.to(fabric.device, non_blocking=True))


def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """An all-reduce (sum, in place) queued on the device. Not fabric.all_reduce: Lightning puts a barrier before
    every reduction, and a barrier makes the host wait until the GPU has finished all its queued work, twice a step
    (measured on 2 H200s: 7 ms of a 32 ms TinyLlama LoRA step under DDP)."""
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor


def flop_model(run: Run) -> metrics.FlopModel:
    counts, config = run.counts, run.config
    return metrics.FlopModel(counts.matmul_trainable, counts.matmul_frozen, config.n_layer,
                             config.n_head * config.head_size)


def read_step(run: Run, meters: Meters, numbers: StepNumbers) -> tuple[float, float]:
    """A step's loss and gradient norm, stopping the run if either is not finite; counts the step."""
    loss_value, norm_value = numbers.read()
    if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
        what = "loss" if not math.isfinite(loss_value) else "gradient norm"
        raise NonFiniteLossError(
            f"the {what} is {loss_value if what == 'loss' else norm_value} at step {numbers.step} (rank"
            f" {run.fabric.global_rank}); stopped before its optimizer step changed them, so the weights are those"
            f" of step {numbers.step - 1}. Try a lower optimizer.init_args.lr (now"
            f" {run.recipe.optimizer.init_args.get('lr')}),"
            " train.max_grad_norm, or precision bf16-mixed/32-true"
        )
    meters.throughput.add(numbers.record)
    if run.losses.train_first is None:
        run.losses.train_first = loss_value
    run.losses.train_last = loss_value
    return loss_value, norm_value


def log_step(run: Run, meters: Meters, numbers: StepNumbers, loss_value: float, norm_value: float,
             val_loss: float | None) -> None:
    """A metrics row (metrics.jsonl, TensorBoard) and the progress line, every logging.interval steps."""
    step, recipe = numbers.step, run.recipe
    if not (step % recipe.logging.interval == 0 or step == run.total_steps or val_loss is not None):
        return
    clock = meters.clock
    clock.resolve()
    recent = meters.throughput.summary({s: clock.durations[s] for s in clock.durations if s > step - 10})
    mem = metrics.memory_stats(run.fabric.device)
    row = {
        "step": step,
        "epoch": numbers.epoch,
        "loss": loss_value,
        "lr": numbers.lr,
        # DeepSpeed clips inside its own step, so litft has no norm to show (the check holds the loss twice)
        "grad_norm": norm_value if recipe.train.max_grad_norm is not None and run.plan.strategy != "deepspeed" else None,
        "step_time_s": clock.durations[step],
        "tokens_per_sec": recent["tokens_per_sec"],
        "tokens_real": numbers.record.tokens_real * run.fabric.world_size,
        "peak_allocated_gib": mem["peak_allocated_gib"],
        "peak_reserved_gib": mem["peak_reserved_gib"],
        "mfu": recent["mfu"],
    }
    if val_loss is not None:
        row["val_loss"] = val_loss
    if meters.writer is not None:
        meters.writer.write(row)
    meters.progress.update(step, loss_value, recent["tokens_per_sec"], mem["peak_reserved_gib"], row["lr"])

