"""The fine-tuning loop, readable top to bottom: finetune() -> main() -> fit().

finetune() checks the recipe and builds Fabric; main() runs on every rank: data first (bad data fails before a
model loads), then model, optimizer and loaders, then fit(), then the final evaluation, weights and result.json.
fit() is the explicit loop: gather one optimizer step's micro-batches, forward/backward each, check the loss is
finite, clip, step, log.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from litft import kernels, metrics
from litft.data import GRAPH_MULTIPLE
from litft.errors import ConfigError, DataError, LitftError, NonFiniteLossError, OutOfMemoryError
from litft.model import (
    CausalLM,
    apply_activation_checkpointing,
    build_model,
    compile_blocks,
    count_parameters,
    fast_attention_applies,
    fast_path_problems,
    fuses_residual_norms,
    merge_lora_checkpoint,
    model_config,
    settle_4bit_compute_dtype,
    stack_fc_weights,
    trainable_state_dict,
    triton_attention_fits,
    use_fast_layers,
    write_checkpoint_files,
)
from litft.progress import Progress, print_summary
from litft.recipe import Recipe, config_hash, recipe_to_dict, recipe_to_yaml, resolve_path, validate
from litft.strategy import build_fabric


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


def finetune(recipe: Recipe, overwrite: bool = False, resume: str | None = None) -> RunResult:
    """Run a recipe. `resume`: 'auto' (the newest committed checkpoint in out_dir) or a checkpoint folder.
    Raises a LitftError subclass (with its exit code) on bad input or a failed run."""
    problems = validate(recipe)
    if problems:
        raise ConfigError(problems)
    out_dir = resolve_path(recipe.out_dir)
    if resume is None:
        check_out_dir(out_dir, overwrite)
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


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse to mix a new run into another run's out_dir (its metrics and weights would be interleaved)."""
    if out_dir.is_dir() and any((out_dir / name).exists() for name in ("result.json", "metrics.jsonl", "config.yaml")):
        if not overwrite:
            raise ConfigError(
                f"out_dir: '{out_dir}' already holds a run (config.yaml/metrics.jsonl/result.json); choose another"
                " out_dir, or pass --overwrite to replace it"
            )


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


def main(fabric, recipe: Recipe, resume: str | None = None) -> RunResult:
    from litgpt.tokenizer import Tokenizer

    from litft.data import EpochBatchSampler, build_dataloader, collate_function, largest_batches, prepare_data

    phases = Phases()
    out_dir = resolve_path(recipe.out_dir)
    is_main = fabric.global_rank == 0

    # ---- data: read, split and tokenize once, before any model is loaded ----
    with phases("load"):
        tokenizer = Tokenizer(resolve_path(recipe.model.tokenizer_dir or recipe.model.checkpoint_dir))
        data = prepare_data(recipe.data, tokenizer, seed=recipe.seed)
    checkpoint = None
    if resume is not None:  # before anything is written: a refused resume leaves the run as it was
        from litft.checkpoint import find_resume_checkpoint, load_checkpoint, resume_differences

        checkpoint = load_checkpoint(find_resume_checkpoint(out_dir, resume))
        refuse, warn = resume_differences(checkpoint["config"], recipe)
        if refuse:
            raise ConfigError([f"cannot resume from {checkpoint['path']}: {d}" for d in refuse])
        for line in warn:
            fabric.print(f"resume: {line}")
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        if checkpoint is None:
            for name in ("metrics.jsonl", "result.json"):  # --overwrite: start the files afresh
                (out_dir / name).unlink(missing_ok=True)
        else:
            keep_metrics_until(out_dir / "metrics.jsonl", checkpoint["state"]["counters"]["step"])
        (out_dir / "config.yaml").write_text(recipe_to_yaml(recipe), encoding="utf-8")
    progress_lines: list[str] = []

    def say(message: str) -> None:
        progress_lines.append(message)
        fabric.print(message)

    say(f"litft: {recipe.method} fine-tune, {recipe.init} weights, precision {recipe.precision}, out_dir {out_dir}")
    for line in data.describe():
        say(f"data {line}")
    say(f"batch: {recipe.batch_arithmetic()}")

    # ---- the predicted ledger (CPU, seconds) and the memory cap, before anything is on the GPU ----
    config = model_config(recipe)
    unsupported = fast_path_problems(config)
    if unsupported:  # litft's training forward repeats only what Llama-family models need from GPT.forward
        raise ConfigError(f"model: {config.name} uses {', '.join(unsupported)}, which litft's training forward does"
                          " not implement; use a Llama-family model (TinyLlama, OpenLLaMA, Llama, ...)")
    graphed = use_cuda_graphs(recipe, fabric)
    compiled, compile_why = use_compile(recipe, fabric, config, data.train.stats, graphed)
    grads_in_matmul = recipe.adds_grads_in_matmul and not compiled  # train.grad_into_weights in effect
    # train.triton_kernels in effect: on CUDA with Triton installed; SwiGLU's and RoPE's only in eager blocks (compiled
    # blocks fuse the same ops through inductor), the loss's in either (it runs outside the blocks)
    wants_triton = recipe.train.triton_kernels and fabric.device.type == "cuda"
    if wants_triton and kernels.triton is None:
        say("speed: train.triton_kernels is on but Triton is not installed: torch ops run instead")
    triton_loss = wants_triton and kernels.triton is not None
    triton_layers = triton_loss and not compiled
    # AdamW's step as kernels.AdamW (compiled blocks too: the step runs outside them), where whole parameters sit on
    # each rank and no fp16 scaler owns grad_scale
    triton_adamw = triton_loss and whole_parameters_unscaled(fabric)
    predicted = predict_memory(recipe, config, worst_case_tokens(recipe, data.train.lengths), compiled)
    if predicted is not None:
        say(f"memory: predicted peak {predicted.total_gib:.2f} GiB reserved per device (`litft estimate` itemises it)")
    if recipe.memory_cap is not None and fabric.device.type == "cuda":
        apply_memory_cap(recipe, fabric, say)

    # ---- model, optimizer, loaders ----
    with phases("setup"):
        fabric.seed_everything(recipe.seed)  # same seed on every rank: identical random init and LoRA A
        gpt = build_model(fabric, recipe, config)
        counts = count_parameters(gpt)
        say(
            f"model: {config.name}, {counts.total:,} parameters, {counts.trainable:,} trainable"
            f" ({100 * counts.trainable / counts.total:.2f}%)"
        )
        use_fast_layers(gpt, lora=recipe.train.fast_lora, norm=recipe.train.fused_rms_norm,
                        attention=recipe.train.fast_attention, swiglu=recipe.train.lean_swiglu,
                        mixed_linear=recipe.recasts_mixed_weights,
                        grad_into_weights=grads_in_matmul, triton_kernels=triton_layers,
                        attention_kernel=recipe.train.attention_kernel)
        if recipe.train.activation_checkpointing:
            apply_activation_checkpointing(gpt)
        # packed rows' attention in Triton (model.causal_attention decides per call; this says what it will decide)
        triton_attention = (triton_layers and recipe.data.packing and recipe.train.fast_attention
                            and fast_attention_applies(config) and not recipe.precision.startswith("32")
                            and triton_attention_fits(config.head_size, config.n_head, config.n_query_groups,
                                                      recipe.train.attention_kernel))
        # the residual adds fused into the norms: eager blocks that are still LitGPT's own (not checkpoint-wrapped)
        fused_residual_norms = (triton_layers and recipe.train.fused_rms_norm
                                and not recipe.train.activation_checkpointing and fuses_residual_norms(gpt))
        if compiled:
            compile_blocks(gpt)
        graphs_before = compile_stats()  # the ledger's trace above compiles too: count only the run's own graphs
        say(f"speed: packing {'on' if recipe.data.packing else 'off'},"
            f" torch.compile {'on' if compiled else 'off'}{f' ({compile_why})' if compile_why else ''},"
            f" CUDA graphs {'on' if graphed else 'off'},"
            f" loss chunk {recipe.train.loss_chunk or 'off'}, activation checkpointing"
            f" {'on' if recipe.train.activation_checkpointing else 'off'}"
            + f", RMSNorm {'fused' if recipe.train.fused_rms_norm else 'LitGPT'}"
            + f", attention {'fast' if recipe.train.fast_attention else 'LitGPT'}"
            + f", SwiGLU {'lean' if recipe.train.lean_swiglu else 'LitGPT'}"
            + (f", -mixed weights {'recast in backward' if recipe.recasts_mixed_weights else 'kept by autocast'}"
               if recipe.precision.endswith("-mixed") else "")
            + (", weight gradients added by the matmul" if grads_in_matmul else "")
            + (", SwiGLU, RoPE and LoRA dropout in Triton kernels" if triton_layers else "")
            + (", packed attention in Triton kernels" if triton_attention else "")
            + (", residual adds fused into the norms" if fused_residual_norms else "")
            + (", the loss in a Triton kernel" if triton_loss else "")
            + (f", LoRA layers {'fast' if recipe.train.fast_lora else 'LitGPT'}" if recipe.method != "full" else ""))
        model = fabric.setup_module(CausalLM(gpt, recipe.train.loss_chunk, recipe.data.max_seq_length, compiled,
                                             triton_loss, fused_residual_norms))
        settle_4bit_compute_dtype(gpt, recipe.precision)  # after setup_module, which clears the flag (qlora)
        if triton_layers and grads_in_matmul and recipe.method == "lora" and recipe.train.fast_lora:
            stack_fc_weights(gpt)  # FusedLoRAMLP: one matmul for fc_1 and fc_2 (after setup_module: it moves weights)
        optimizer = fabric.setup_optimizers(build_optimizer(recipe, model, triton_adamw))
        optimizer_used = optimizer_summary(optimizer)
        # a fused step takes grad_scale (clipping) and found_inf (the loss read a step late: see fit) on the device
        reads_late = scales_in_step(fabric, optimizer.optimizer)
        if recipe.train.max_grad_norm is not None:
            optimizer_used["clipping"] = "norm only; the fused step divides" if reads_late else "fabric.clip_gradients"
        say(f"optimizer: {optimizer_used['class']} ({optimizer_used['implementation']}"
            + (f"; clipping: {optimizer_used['clipping']}" if "clipping" in optimizer_used else "")
            + ("; each step's loss read a step late, a non-finite step's update skipped on the device" if reads_late
               else "; each step's loss read before its update") + ")")

        # data.pack_steps: the sampler hands out a step's samples at once (the same samples per step, in the same
        # order, as grad_accum micro-batches of micro_batch_size) and the collate fills micro-batches from them
        step_capacity = recipe.step_capacity if recipe.packs_steps else None
        train_sampler = EpochBatchSampler(
            data.train.lengths, recipe.loader_batch_size, shuffle=True, seed=recipe.seed,
            rank=fabric.global_rank, world_size=fabric.world_size, drop_last=True,
            fit_capacity=step_capacity if recipe.data.fit_steps else None,
        )
        val_sampler = EpochBatchSampler(
            len(data.val), recipe.train.micro_batch_size, shuffle=False, seed=recipe.seed,
            rank=fabric.global_rank, world_size=fabric.world_size, drop_last=False,
        )
        # The samplers already give each rank its share, so Fabric must not add a DistributedSampler.
        train_loader, val_loader = fabric.setup_dataloaders(
            build_dataloader(data.train, train_sampler, data.pad_id, recipe.data.num_workers, recipe.data.packing,
                             fixed_shapes=graphed, step_capacity=step_capacity),
            build_dataloader(data.val, val_sampler, data.pad_id, recipe.data.num_workers, recipe.data.packing),
            use_distributed_sampler=False,
            move_to_device=False,  # the loop moves the two tensors itself; the counts stay plain ints
        )
        micro_batches_per_epoch = len(train_sampler) * recipe.loader_batch_size // recipe.train.micro_batch_size
        total_steps = planned_steps(recipe, micro_batches_per_epoch)
        scheduler = build_scheduler(recipe, optimizer, total_steps)

    device_name = torch.cuda.get_device_name(fabric.device) if fabric.device.type == "cuda" else "cpu"
    flop_model = metrics.FlopModel(
        counts.matmul_trainable, counts.matmul_frozen, config.n_layer, config.n_head * config.head_size
    )
    throughput = metrics.Throughput(
        world_size=fabric.world_size,
        skip_steps=recipe.logging.skip_steps,
        peak_flops_per_device=metrics.peak_flops(device_name, metrics.compute_dtype(recipe.precision))
        if fabric.device.type == "cuda" else None,
    )
    writer = metrics.MetricsWriter(out_dir, recipe.logging.tensorboard) if is_main else None
    progress = Progress(recipe.logging.progress, total_steps, enabled=is_main)

    status = "failed"
    gpu: dict = {}
    losses: dict[str, float | None] = {"train_first": None, "train_last": None, "val_initial": None, "val_final": None}
    # micro_batches: loader items consumed (the data position); micro_batches_run: forward/backward passes run by
    # this process (with data.pack_steps, fewer than steps x grad_accum)
    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "micro_batches": 0, "max_micro_tokens": 0,
             "micro_batches_run": 0}
    clock = metrics.StepClock(fabric.device)
    micro_step = (GraphedMicroSteps(fabric, model, progress.print, compiled) if graphed
                  else PlainMicroStep(fabric, model))
    if checkpoint is not None:
        restore(checkpoint, fabric, model, optimizer, scheduler, train_sampler, state, losses, recipe)
        progress.print(f"resumed from {checkpoint['path']} at step {state['step']} (epoch {state['epoch']},"
                       f" micro-batch {state['batch_in_epoch']} of {len(train_sampler)})")
    profiler = StepProfiler(recipe.logging.profile, out_dir / "profile", progress.print,
                            recipe.logging.memory_snapshot, out_dir / "memory_snapshot.pickle")
    profiler.start_snapshot(recomputes=recipe.train.loss_chunk > 0 or recipe.train.activation_checkpointing)
    try:
        if graphed:  # warm-up and capture run the largest micro-batch: inside the try, so running out of memory is exit 4
            train_collate = collate_function(data.pad_id, recipe.data.packing, True, recipe.loader_batch_size)
            with phases("warmup"):  # CUDA graphs' warm-up and capture, with the compiles they set off
                micro_step.prepare(largest_batches(data.train.lengths, recipe.loader_batch_size, train_collate,
                                                   data.pad_id, step_capacity,
                                                   GraphedMicroSteps.upfront_shapes(step_capacity)))
        if recipe.eval.initial:
            with phases("eval"):
                losses["val_initial"] = evaluate(fabric, model, val_loader, recipe.eval.max_batches)
            progress.print(f"val loss before training: {losses['val_initial']:.4f}")
        sampler = metrics.GpuSampler(fabric.device, recipe.logging.gpu_sample_interval)
        try:
            with phases("train"):
                fit(
                    fabric, recipe, model, optimizer, scheduler, train_loader, train_sampler, val_loader,
                    total_steps, flop_model, throughput, clock, writer, progress, losses, state, phases, out_dir,
                    micro_step, profiler, reads_late,
                )
        finally:
            gpu = sampler.stop()
        if recipe.eval.final:
            with phases("eval"):
                losses["val_final"] = evaluate(fabric, model, val_loader, None)
            progress.print(f"val loss after training: {losses['val_final']:.4f}")
        with phases("save"):
            save_final(fabric, recipe, config, model, out_dir)
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
        # Token, sample and FLOP counts summed over the ranks (one all-reduce, on the device: NCCL needs CUDA
        # tensors), only when every rank got here: a rank that failed would leave the others waiting on it
        rank_sum = None
        if status == "ok" and fabric.world_size > 1:
            rank_sum = lambda t: fabric.all_reduce(t.to(fabric.device), reduce_op="sum").cpu()  # noqa: E731
        # The prediction to hold the measurement against: the same ledger, sized for the largest micro-batch this
        # run held in memory: the largest it formed (a short run rarely meets the data's worst case, which stays in
        # the result too), or, with CUDA graphs, the largest captured shape if larger: prepare() captures the data's
        # largest shape first, and that capture's activations stay reserved in the graphs' pool for the whole run.
        # (Measured on the H100, TinyLlama full bf16-true with packing: 2,816 positions formed in 32 steps, the
        # pool sized for 4,096; the ledger for 2,816 said 16.7 GiB, for 4,096 19.8 GiB, measured 20.3 GiB reserved.)
        seen = None
        run_compile_stats = compile_stats(since=graphs_before)  # before the ledger below traces again
        graph_stats = micro_step.stats()
        held_tokens = max(state["max_micro_tokens"], graph_stats.get("pool_tokens", 0))
        if predicted is not None and held_tokens:
            seen = predict_memory(recipe, config, held_tokens, compiled)
        result = build_result(
            recipe, fabric, status, config, counts, data, state, losses, throughput.summary(clock.durations, rank_sum),
            phases, out_dir, len(train_sampler), seen or predicted, gpu, worst_case=predicted,
        )
        result["cuda_graphs"] = graph_stats
        result["compile"] = run_compile_stats
        result["optimizer"] = optimizer_used
        result["grad_into_weights"] = grads_in_matmul
        result["loss_read"] = "a step late" if reads_late else "before each update"
        result["triton_kernels"] = {"swiglu_rope": triton_layers, "loss": triton_loss,
                                    "residual_norms": fused_residual_norms, "packed_attention": triton_attention,
                                    "adamw": optimizer_used["implementation"] == TRITON_ADAMW}
        if is_main:
            write_json_atomic(out_dir / "result.json", result)
    if is_main and recipe.logging.progress != "none":
        print_summary(result)
    return RunResult(out_dir=out_dir, result=result, model=unwrap(model))


def unwrap(model) -> torch.nn.Module:
    """The LitGPT GPT inside Fabric's wrapper and litft's CausalLM."""
    module = model.module if hasattr(model, "module") else model
    return module.gpt if isinstance(module, CausalLM) else module


@dataclass
class StepNumbers:
    """One optimizer step's loss and gradient norm on their way to the host, with what the step trained on: read
    by fit before the next update (see fit's defer_reads)."""

    step: int
    check: torch.Tensor
    """[loss, gradient norm] (the loss twice without clipping): on the host once ``ready`` has passed."""
    ready: Any
    """A CUDA event recorded after the copy to the host, or None (the check is already on the host)."""
    record: metrics.StepRecord
    epoch: float
    """Epochs done when the step's batches had been drawn (for the log row)."""

    @classmethod
    def of(cls, step: int, check: torch.Tensor, record: metrics.StepRecord, epoch: float) -> StepNumbers:
        if check.device.type != "cuda":
            return cls(step, check, None, record, epoch)
        host = torch.empty(check.shape, dtype=check.dtype, pin_memory=True)
        host.copy_(check, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(step, host, ready, record, epoch)

    def read(self) -> tuple[float, float]:
        """The loss and gradient norm (waits for the step to get that far on the device)."""
        if self.ready is not None:
            self.ready.synchronize()
        loss_value, norm_value = self.check.tolist()
        return loss_value, norm_value


def fit(
    fabric, recipe, model, optimizer, scheduler, train_loader, train_sampler, val_loader, total_steps, flop_model,
    throughput, clock, writer, progress, losses, state, phases, out_dir, micro_step, profiler, defer_reads: bool,
) -> None:
    """The loop: one iteration per optimizer step, `grad_accum` micro-batches each (with data.pack_steps, as many as
    the step's samples fill; `micro_step` runs one micro-batch's forward and backward, plainly or as a CUDA graph)."""
    accum = recipe.grad_accum
    batches = micro_batches(train_loader, train_sampler, recipe.train.epochs, state, resumed=state["step"] > 0)
    mark = nvtx_range if recipe.logging.nvtx and fabric.device.type == "cuda" else no_range
    # A step's loss and gradient norm must be finite before the weights change. Read at once, they cost a host-device
    # sync per step, and the GPU idles from the step's last kernel until the host has launched the update and the
    # next step's work. A fused torch optimizer can instead skip its own update on the device (found_inf, as torch's
    # GradScaler uses it): then step N's numbers are read after step N+1's forward and backward are queued and before
    # step N+1's update, so a non-finite step still changes no weights and the GPU always has work queued. Steps that
    # evaluate or save, and the last, are read at once (their numbers are needed before anything is written).
    # defer_reads: scales_in_step for the optimizer (fused torch optimizers take found_inf as they take grad_scale).
    # Measured on the H100 (TinyLlama LoRA, CUDA graphs): +4.5% to +9.4% real tok/s, the GPU busy 45.9 ms of a 46.5 ms
    # step (benchmarks/results/s20-defer, s20-wall). Session 8's eager steps, host-bound, had gained nothing from
    # launching the update first (overlap-tiny).
    pending: StepNumbers | None = None  # a step whose numbers are not read yet
    inner = getattr(optimizer, "optimizer", optimizer)  # Fabric wraps the torch optimizer, which takes found_inf

    def read_step(numbers: StepNumbers) -> tuple[float, float]:
        """A step's loss and gradient norm, stopping the run if either is not finite; counts the step."""
        loss_value, norm_value = numbers.read()
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
            what = "loss" if not math.isfinite(loss_value) else "gradient norm"
            raise NonFiniteLossError(
                f"the {what} is {loss_value if what == 'loss' else norm_value} at step {numbers.step} (rank"
                f" {fabric.global_rank}); stopped before its optimizer step changed them, so the weights are those"
                f" of step {numbers.step - 1}. Try a lower optimizer.init_args.lr (now"
                f" {recipe.optimizer.init_args.get('lr')}),"
                " train.max_grad_norm, or precision bf16-mixed/32-true"
            )
        throughput.add(numbers.record)
        if losses["train_first"] is None:
            losses["train_first"] = loss_value
        losses["train_last"] = loss_value
        return loss_value, norm_value

    def log_step(numbers: StepNumbers, loss_value: float, norm_value: float, val_loss: float | None) -> None:
        step = numbers.step
        if step % recipe.logging.interval == 0 or step == total_steps or val_loss is not None:
            clock.resolve()
            recent = throughput.summary({s: clock.durations[s] for s in clock.durations if s > step - 10})
            mem = metrics.memory_stats(fabric.device)
            row = {
                "step": step,
                "epoch": numbers.epoch,
                "loss": loss_value,
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": norm_value if recipe.train.max_grad_norm is not None else None,
                "step_time_s": clock.durations[step],
                "tokens_per_sec": recent["tokens_per_sec"],
                "tokens_real": numbers.record.tokens_real * fabric.world_size,
                "peak_allocated_gib": mem["peak_allocated_gib"],
                "peak_reserved_gib": mem["peak_reserved_gib"],
                "mfu": recent["mfu"],
            }
            if val_loss is not None:
                row["val_loss"] = val_loss
            if writer is not None:
                writer.write(row)
            progress.update(step, loss_value, recent["tokens_per_sec"], mem["peak_reserved_gib"], row["lr"])

    progress.start()
    while state["step"] < total_steps:
        step = state["step"] + 1
        profiler.before(step)
        if recipe.packs_steps:  # one loader item: the step's samples, already packed into micro-batches
            step_batches = next(batches)
        else:
            step_batches = [next(batches) for _ in range(accum)]
        state["max_micro_tokens"] = max(state["max_micro_tokens"], *(b["tokens_padded"] for b in step_batches))
        state["micro_batches_run"] += len(step_batches)
        # Normalise by the step's loss tokens over all ranks, so each loss token weighs the same however the global
        # batch is split into micro-batches and devices. DDP averages gradients over ranks, hence the x world_size.
        loss_tokens = sum(b["loss_tokens"] for b in step_batches)  # counted on the CPU by the collate
        if fabric.world_size > 1:  # a device tensor only when ranks must agree on it (one small all-reduce)
            total = fabric.all_reduce(torch.tensor(loss_tokens, device=fabric.device), reduce_op="sum")
            denominator = total.clamp(min=1).float() / fabric.world_size
        else:  # a Python number: no host-to-device copy, which would wait for the previous step to finish
            denominator = float(max(loss_tokens, 1))

        clock.start()
        loss_sum = torch.zeros((), device=fabric.device)
        for i, batch in enumerate(step_batches):
            with fabric.no_backward_sync(model, enabled=i < len(step_batches) - 1):
                with mark("forward+backward"):
                    loss_sum += micro_step(model_inputs(batch, fabric.device), denominator)

        grad_norm = None
        if recipe.train.max_grad_norm is not None:
            grad_norm = clip_gradients(fabric, model, optimizer, recipe.train.max_grad_norm)  # checked below
        step_loss = (loss_sum / denominator / fabric.world_size).float()
        if fabric.world_size > 1:
            step_loss = fabric.all_reduce(step_loss, reduce_op="sum")
        check = torch.stack([step_loss, grad_norm.float() if grad_norm is not None else step_loss])
        numbers = StepNumbers.of(step, check, metrics.StepRecord(
            step=step,
            tokens_real=sum(b["tokens_real"] for b in step_batches),
            tokens_padded=sum(b["tokens_padded"] for b in step_batches),
            samples=sum(b["samples"] for b in step_batches),
            loss_tokens=sum(b["loss_tokens"] for b in step_batches),
            flops=sum(flop_model.batch_flops(b["lengths"]) for b in step_batches),
        ), epoch=state["epoch"] + state["batch_in_epoch"] / max(1, len(train_sampler)))
        if pending is not None:  # the previous step, read while this step's work runs on the device
            log_step(pending, *read_step(pending), val_loss=None)
            pending = None
        if defer_reads:  # the update skips itself on the device if this step's numbers are not finite
            inner.found_inf = (~torch.isfinite(check)).any().float()
        else:
            loss_value, norm_value = read_step(numbers)  # one host-device sync per step
        with mark("optimizer"):
            optimizer.step()
            # CUDA graphs add into the gradients' fixed addresses: zero them in place rather than free them
            optimizer.zero_grad(set_to_none=not micro_step.keeps_gradients)
        scheduler.step()
        clock.stop(step)
        state["step"] = step
        profiler.after(step)

        evaluates = bool(recipe.eval.interval and step % recipe.eval.interval == 0 and step < total_steps)
        saves = bool(recipe.train.save_interval and step % recipe.train.save_interval == 0)
        if defer_reads:
            if not (evaluates or saves or step == total_steps):
                pending = numbers
                continue
            loss_value, norm_value = read_step(numbers)

        val_loss = None
        if evaluates:
            with phases("eval"):
                val_loss = evaluate(fabric, model, val_loader, recipe.eval.max_batches)
            progress.print(f"step {step}: val loss {val_loss:.4f}")

        if saves:
            with phases("save"):
                save_training_state(fabric, recipe, model, optimizer, scheduler, train_sampler, state, losses, out_dir)

        log_step(numbers, loss_value, norm_value, val_loss)


COMPILE_PAYS_OFF_S = {"full": 40.0, "lora": 350.0, "qlora": 170.0}
"""Seconds of work at the GPU's peak FLOP/s above which 'auto' compiles a run that replays CUDA graphs, by method
(see use_compile for the measurements behind each)."""


def use_compile(recipe: Recipe, fabric, config, stats, graphed: bool) -> tuple[bool, str]:
    """Whether to torch.compile the blocks, and why when 'auto' decided (for the run's speed line).

    'auto': never on the CPU (inductor's C++ compile costs minutes for little gain); always on CUDA without CUDA
    graphs (compiling then also cuts the host's launch overhead: TinyLlama LoRA 13,899 vs 8,662 real tok/s on the
    H100, benchmarks/results/ablation-tiny*). With CUDA graphs the host overhead is gone and compiling only makes the
    kernels faster, so it compiles when the planned work repays the compile time. Measured on the H100 (TinyLlama,
    eager + graphs in results/swiglu-tiny and overlap-tiny, compiled + graphs in compile-full-tiny,
    compile-lora-tiny(-2) and compiled-profile), break-even in seconds of work at peak FLOP/s:
      full bf16-true: 147.6 -> 130.4 ms per ~7,700-token step for ~9 s more warm-up (the block compiles in ~9 s):
        523 steps = 4.0M tokens x 6 x 1.03e9 FLOPs / 989e12 = 25 s (bf16-mixed: 206.5 -> 168.4 ms, 12 s);
      LoRA: 74.7 -> 69.3 ms per ~3,900-token step for ~80 s (the LoRA block takes ~66 s of inductor codegen):
        14,500 steps = 57M tokens x 4 x 1.03e9 / 989e12 = 238 s (OpenLLaMA-7B LoRA: 294.4 -> 251.8 ms for 68 s,
        162 s of work at peak);
      QLoRA: 90.4 -> 79.9 ms for ~72 s: 114 s.
    'auto' compiles above COMPILE_PAYS_OFF_S for the method, half as much again as the TinyLlama break-even (a
    margin for the models and GPUs not measured): a full fine-tune of TinyLlama compiles from ~6M tokens (half an
    epoch of Alpaca's 52k rows), LoRA from ~85M tokens (six epochs). Work = planned tokens x FLOPs per token (6 per
    trainable and 4 per frozen weight: metrics.FlopModel's rule, attention left out).

    Those break-evens were measured against eager blocks of torch ops. With litft's Triton kernels in effect
    (train.triton_kernels, Triton installed) eager blocks ran faster than compiled ones on the H100 (TinyLlama full
    bf16-true 113.1 against 115.5 ms per step, LoRA 61.0 against 61.7 ms, benchmarks/results/compile-s12): compiling
    then never pays off, and 'auto' stays eager. (Not measured at 7B: 'always' compiles.)"""
    mode = recipe.train.compile
    if mode != "auto":
        return mode == "always", ""
    if fabric.device.type != "cuda":
        return False, ""
    if not graphed:
        return True, ""
    if recipe.train.triton_kernels and kernels.triton is not None:
        return False, "auto: eager blocks with litft's Triton kernels run faster than compiled ones"
    peak = metrics.peak_flops(torch.cuda.get_device_name(fabric.device), metrics.compute_dtype(recipe.precision))
    if peak is None:
        return True, "no peak FLOP/s known for this GPU"
    n = estimated_parameters(config)
    per_token = 6 * n if recipe.method == "full" else 4 * n
    batches_per_epoch = stats.samples // fabric.world_size // recipe.train.micro_batch_size
    tokens = planned_steps(recipe, batches_per_epoch) * recipe.train.global_batch_size * stats.mean_length
    seconds = tokens * per_token / peak
    threshold = COMPILE_PAYS_OFF_S[recipe.method]
    verdict = "pays off" if seconds > threshold else "would not pay off"
    return seconds > threshold, (f"auto: {seconds:,.0f} s of work at peak FLOP/s, compiling {verdict} above"
                                 f" {threshold:.0f} s for {recipe.method}")


def estimated_parameters(config) -> int:
    """Weights a token passes through in a Llama-style model: attention, MLP (3 matrices) and the output head."""
    attention = config.n_embd * (config.n_head + 2 * config.n_query_groups) * config.head_size
    attention += config.n_head * config.head_size * config.n_embd
    mlp = 3 * config.n_embd * config.intermediate_size
    return config.n_layer * (attention + mlp) + config.padded_vocab_size * config.n_embd


def use_cuda_graphs(recipe: Recipe, fabric) -> bool:
    """Whether micro-steps replay as CUDA graphs: 'auto' on one CUDA device (DDP's all-reduce hooks stay eager)."""
    possible = fabric.device.type == "cuda" and fabric.world_size == 1
    if recipe.train.cuda_graphs == "always" and not possible:
        raise ConfigError("train.cuda_graphs: 'always' needs a single CUDA device (this run has"
                          f" {fabric.world_size} x {fabric.device.type}); use 'auto' or 'never'")
    return possible and recipe.train.cuda_graphs != "never"


class PlainMicroStep:
    """One micro-batch: forward, then backward of loss / denominator; returns the detached loss sum."""

    keeps_gradients = False

    def __init__(self, fabric, model) -> None:
        self.fabric, self.model = fabric, model

    def __call__(self, inputs: dict, denominator) -> torch.Tensor:
        loss = self.model(**inputs)
        self.fabric.backward(loss / denominator)
        return loss.detach()

    def stats(self) -> dict:
        return {"on": False}


class GraphedMicroSteps:
    """One micro-batch's forward and backward, replayed as a CUDA graph: one per distinct batch shape.

    Why: a TinyLlama LoRA step launches ~11,000 kernels, and run plainly the GPU is busy 11% of the step's time
    (H100, benchmarks/results/ablation-tiny-2, lora-plain-profile: 406 ms per step plainly, 109 ms replayed). A
    graph replays a micro-step's kernels with one launch.
    How: before training (prepare), stand-in batches run plainly (compiled blocks: the largest shape and the next
    smaller one, WARMUP times each, so that torch.compile builds its shape-generic kernels; eager blocks: the largest
    shape once, which allocates the gradients and lets a layer settle what it sets on its first call: nothing
    recompiles or initialises during a capture), and the largest shape is captured, then the smaller packed widths.
    A new shape met in training is captured straight away, with no plain warm-up: a plain run would need a second
    set of activations beside the graphs' pool; if that capture fails (a recompile for the new shape, say), the
    shape warms up plainly and is captured again. Micro-batches of a captured shape copy their tensors
    into the graph's inputs and replay it. Backward adds into the gradients in place, at the addresses captured, so
    the loop zeroes gradients in place (keeps_gradients). The scale 1/denominator is a device tensor filled before
    each replay (a plain number would be frozen into the graph). All graphs share one memory pool: they never run
    at the same time, and each one's output is copied out before the next replay. If a capture after warm-up fails
    (an op that cannot be captured), the run says why once and continues plainly.
    """

    keeps_gradients = True
    WARMUP = 2  # plain micro-batches before a capture (torch's CUDA graph docs warm up a few, too)
    EAGER_WARMUP = 1  # the same, before training, for eager blocks: nothing of theirs depends on the shapes seen
    UPFRONT_SHAPES = 16  # packed row widths captured before training, at least (TinyLlama at 4 x 512: 8 widths of 256)

    @classmethod
    def upfront_shapes(cls, step_capacity: int | None) -> int:
        """Packed row widths to capture before training: every width a step's micro-batch can take under
        data.pack_steps (capacity / GRAPH_MULTIPLE), at least UPFRONT_SHAPES. With 16 only, a 4,608-position
        capacity left 2 of its 18 widths to be captured during training, and the 60-step runs that met them ran at
        ~60,000 real tok/s for those intervals against ~69,000 (benchmarks/results/s16-tiny, lora-4608)."""
        widths = -(-step_capacity // GRAPH_MULTIPLE) if step_capacity else 0
        return max(cls.UPFRONT_SHAPES, widths)

    def __init__(self, fabric, model, say, compiled: bool = False) -> None:
        self.fabric, self.model, self.say = fabric, model, say
        self.compiled = compiled  # torch.compile'd blocks: warm up on two shapes (their kernels are built for both)
        self.plain = PlainMicroStep(fabric, model)
        self.graphs: dict[tuple, tuple] = {}
        self.warming: dict[tuple, int] = {}  # shapes that run plainly before their capture: plain runs so far
        self.replays = 0
        self.retries = 0  # new shapes whose direct capture failed and that were captured after a warm-up
        self.failure: str | None = None
        self.pool = torch.cuda.graph_pool_handle()
        self.scale = torch.ones((), device=fabric.device)
        self.failed = False
        self.pool_tokens = 0  # positions of the largest captured micro-batch: what sized the graphs' pool
        self.captured_before_training = 0  # shapes prepare() captured
        self.plain_warmup_s = 0.0  # wall seconds of the plain warm-up micro-steps (prepare's and retries')
        self.warmup_micro_batches = 0  # plain micro-steps on stand-in batches (not training): prepare's and retries'
        self.capture_s = 0.0  # wall seconds of the captures, graph instantiation included

    def prepare(self, batches: list[dict]) -> None:
        """Before training: warm up plainly on the first stand-in batch (largest first; data.largest_batches),
        compiled on the first two, give back their gradients, and capture the largest shape, so the graphs' pool is
        sized once by the largest micro-batch; then capture the other stand-ins' shapes (packed rows: every width
        up to UPFRONT_SHAPES), so that the training steps replay instead of capturing (a 40-step TinyLlama LoRA run
        captured 8 widths during its steps, each capture costing about a plain micro-step's launch time).
        The warm-up's dropout draws come from a forked random state: the run's own random numbers (and a resumed
        run's) are those it would draw without it."""
        device = self.fabric.device
        # The gradients first, in segments of their own, so that none is carved out of the warm-up's activation
        # segments, which empty_cache() before the capture should give back. (It was meant to close full
        # bf16-mixed's gap between peak reserved and allocated; measured on the H100 it did not: 33.01 GiB reserved
        # before, 33.17 after, benchmarks/results/ablation-tiny-2.)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        with torch.random.fork_rng(devices=[device]):
            inputs = [model_inputs(batch, device) for batch in batches]
            # compiled: the largest shape and the next smaller, so that dynamo builds shape-generic kernels and no
            # later width recompiles during its capture; eager: one plain micro-step (~0.25 s for TinyLlama)
            shapes, times = (2, self.WARMUP) if self.compiled else (1, self.EAGER_WARMUP)
            self._warm_up(inputs[:shapes], times)
            if not self._capture(self.key(inputs[0]), inputs[0], last_try=True):
                return
            self.pool_tokens = int(batches[0]["tokens_padded"])
            for batch_inputs in inputs[1:]:  # a capture does not run the micro-step: the gradients stay zero
                key = self.key(batch_inputs)
                if key in self.graphs or self._capture(key, batch_inputs, last_try=False):
                    continue
                self.retries += 1  # as in training: warm this shape up plainly, then capture it
                self._warm_up([batch_inputs], self.WARMUP)
                if not self._capture(key, batch_inputs, last_try=True):
                    return
            self.captured_before_training = len(self.graphs)

    def _warm_up(self, inputs: list[dict], times: int) -> None:
        """``times`` plain micro-steps on each stand-in, then their gradients zeroed: they are not training."""
        start = time.perf_counter()
        for batch_inputs in inputs:
            for _ in range(times):
                self.plain(batch_inputs, 1.0)
                self.warmup_micro_batches += 1
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
        torch.cuda.synchronize()
        self.plain_warmup_s += time.perf_counter() - start

    @staticmethod
    def key(inputs: dict) -> tuple:
        return tuple((name, tuple(t.shape)) for name, t in inputs.items())

    def __call__(self, inputs: dict, denominator) -> torch.Tensor:
        if self.failed:
            return self.plain(inputs, denominator)
        key = self.key(inputs)
        if key not in self.graphs:
            if not self.graphs or key in self.warming:
                loss = self.plain(inputs, denominator)  # this micro-batch's real contribution, and a warm-up
                self.warming[key] = self.warming.get(key, 0) + 1
                if self.warming[key] >= self.WARMUP:
                    self._capture(key, inputs, last_try=True)
                return loss
            if not self._capture(key, inputs, last_try=False):
                self.retries += 1
                self.warming[key] = 0
                return self(inputs, denominator)
        graph, static_inputs, static_loss = self.graphs[key]
        for name, tensor in inputs.items():
            static_inputs[name].copy_(tensor, non_blocking=True)
        self.scale.fill_(1.0 / denominator)
        graph.replay()
        self.replays += 1
        return static_loss.clone()  # the next replay of any graph may overwrite static_loss (one shared pool)

    def _capture(self, key: tuple, inputs: dict, last_try: bool) -> bool:
        static_inputs = {name: tensor.clone() for name, tensor in inputs.items()}
        stream = torch.cuda.current_stream()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # plain runs' activations go back; the graphs' pool holds theirs
        graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        try:
            # thread_local: the DataLoader's pin-memory thread keeps calling CUDA during the capture (it touches
            # no captured stream); the default mode ("global") makes those calls fail the capture
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                static_loss = self.model(**static_inputs)
                self.fabric.backward(static_loss * self.scale)
        except Exception as err:  # noqa: BLE001 - any capture failure: retry after a warm-up, or fall back
            self.capture_s += time.perf_counter() - start
            # A capture that raised as it ended leaves its side stream current and (torch 2.11) the allocator
            # recording into the pool, so that every later capture into it fails ("beginAllocateToPool: already
            # recording to mempool_id"; benchmarks/capture_pool_probe.py). Later captures go to a new pool; the
            # graphs captured so far keep theirs.
            torch.cuda.set_stream(stream)
            reset_capture_state()
            self.pool = torch.cuda.graph_pool_handle()
            if not last_try:
                return False
            self.failed = True
            self.graphs.clear()
            self.failure = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            self.say(f"CUDA graphs off for the rest of the run: capturing a micro-step failed ({self.failure});"
                     " set train.cuda_graphs: never to skip the attempt")
            return False
        self.capture_s += time.perf_counter() - start
        self.graphs[key] = (graph, static_inputs, static_loss.detach())
        return True

    def stats(self) -> dict:
        """For result.json: shapes captured, replays, plain warm-up micro-batches, retried captures, a failure."""
        return {"on": not self.failed, "shapes_captured": len(self.graphs),
                "captured_before_training": self.captured_before_training, "replays": self.replays,
                "plain_micro_batches": sum(self.warming.values()), "retried_captures": self.retries,
                "warmup_micro_batches": self.warmup_micro_batches,
                "failure": self.failure, "pool_tokens": self.pool_tokens if not self.failed else 0,
                "plain_warmup_s": round(self.plain_warmup_s, 3), "capture_s": round(self.capture_s, 3)}


def reset_capture_state() -> None:
    """After a capture that raised, let random ops (dropout) run plainly again.

    A capture marks the CUDA random generator as capturing and unmarks it when the capture ends; a capture that
    raised never unmarks it, and the next plain dropout then fails ("Offset increment outside graph capture").
    Capturing an empty graph marks and unmarks it again."""
    try:
        torch.cuda.synchronize()
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pass
    except Exception:  # noqa: BLE001 - the plain path will raise its own, clearer error if the device is unusable
        pass


@contextmanager
def nvtx_range(name: str):
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


@contextmanager
def no_range(name: str):
    yield


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
            # stacks and with Python stacks alone (H100, torch 2.11: results/memory-tiny, results/call-s8-1.log).
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
            with open(self.snapshot_path, "wb") as f:
                pickle.dump(snapshot, f)
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
                every_kernel.write_text("\n".join(kernel_table(kernels, steps, rows=None, width=400)) + "\n")
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


def worst_case_tokens(recipe: Recipe, lengths: torch.Tensor) -> int:
    """Positions of the largest micro-batch the data can form: the B longest samples packed (rounded up to the
    packing multiple), or B rows of the longest sample when padding. With data.pack_steps: a step's longest samples
    as far as they fill micro_batch_size x max_seq_length positions."""
    from litft.data import PACK_MULTIPLE

    b = min(recipe.loader_batch_size, len(lengths))
    longest = torch.sort(lengths, descending=True).values[:b]
    if not recipe.data.packing:
        return int(longest[0]) * recipe.train.micro_batch_size
    positions = int(longest.sum())
    if recipe.packs_steps:
        positions = min(positions, recipe.step_capacity)
    return -(-positions // PACK_MULTIPLE) * PACK_MULTIPLE


def predict_memory(recipe: Recipe, config, tokens: int, compiled: bool):
    """The ledger for this run; a failure to predict must not stop training, so it is reported and skipped."""
    from litft.memory import estimate_memory

    try:
        return estimate_memory(recipe, config, tokens=tokens, compiled=compiled)
    except Exception as err:  # e.g. an architecture the tracer cannot build on the CPU
        print(f"memory: no prediction ({type(err).__name__}: {err})")
        return None


def apply_memory_cap(recipe: Recipe, fabric, say) -> None:
    """Cap torch's allocator at memory_cap, so this GPU fails where a smaller one would."""
    from litft.recipe import parse_memory_cap

    total = torch.cuda.get_device_properties(fabric.device).total_memory / metrics.GIB
    cap = parse_memory_cap(recipe.memory_cap, total)
    if cap >= total:
        say(f"memory: cap {cap:.1f} GiB is not below this GPU's {total:.1f} GiB; no cap applied")
        return
    torch.cuda.set_per_process_memory_fraction(cap / total, fabric.device)
    say(f"memory: capped at {cap:.1f} GiB of {total:.1f} GiB (memory_cap {recipe.memory_cap})")


def save_training_state(fabric, recipe, model, optimizer, scheduler, sampler, state, losses, out_dir) -> None:
    """A committed checkpoint of everything the next step depends on (see litft.checkpoint)."""
    from litft.checkpoint import rng_states, save_checkpoint

    gpt = unwrap(model)
    trainable = trainable_state_dict(gpt) if recipe.method in ("lora", "qlora") else gpt.state_dict()
    training_state = {
        "counters": {k: state[k] for k in ("step", "epoch", "batch_in_epoch", "micro_batches")},
        "data_position": sampler.position(state["epoch"], state["batch_in_epoch"]),
        "scheduler": scheduler.state_dict(),
        "losses": dict(losses),
        "rng": rng_states(),
    }
    optimizer_state = optimizer.state_dict()
    if fabric.global_rank == 0:
        save_checkpoint(out_dir, recipe, state["step"], trainable, optimizer_state, training_state,
                        recipe.train.keep_last_n)
    fabric.barrier()


def restore(checkpoint, fabric, model, optimizer, scheduler, sampler, state, losses, recipe) -> None:
    """Put the run back where the checkpoint left it: weights, optimizer, schedule, data position, counters, RNG."""
    from litft.checkpoint import restore_rng_states
    from litft.errors import CheckpointError

    gpt = unwrap(model)
    result = gpt.load_state_dict(checkpoint["trainable"], strict=False)
    expected = set(trainable_state_dict(gpt)) if recipe.method in ("lora", "qlora") else set(gpt.state_dict())
    missing = expected & set(result.missing_keys)
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"{checkpoint['path']}/trainable.pth does not fit this model: missing {sorted(missing)[:3]},"
            f" unexpected {result.unexpected_keys[:3]}"
        )
    optimizer.load_state_dict(checkpoint["optimizer"])
    saved = checkpoint["state"]
    scheduler.load_state_dict(saved["scheduler"])
    sampler.load_state_dict(saved["data_position"])
    state.update(saved["counters"])
    losses.update(saved["losses"])
    restore_rng_states(saved["rng"])


def keep_metrics_until(path: Path, step: int) -> None:
    """A resumed run rewrites the steps after its checkpoint: drop their rows, so no step appears twice."""
    if not path.is_file():
        return
    rows = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    kept = [line for line in rows if json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def model_inputs(batch: dict, device: torch.device) -> dict:
    """The tensors CausalLM.forward takes, on the device (copies overlap with compute: pinned memory, non_blocking)."""
    inputs = {key: batch[key].to(device, non_blocking=True) for key in ("input_ids", "labels")}
    if "cu_seqlens" in batch:
        inputs["positions"] = batch["positions"].to(device, non_blocking=True)
        inputs["cu_seqlens"] = batch["cu_seqlens"].to(device, non_blocking=True)
    return inputs


def micro_batches(loader, sampler, epochs: int, state: dict, resumed: bool = False):
    """Micro-batches across epochs, with `state` tracking the epoch and the position in it (what a resume needs).
    A resumed run's sampler was already placed mid-epoch (load_state_dict); set_epoch keeps that position."""
    while state["epoch"] < epochs:
        sampler.set_epoch(state["epoch"])
        if not resumed:
            state["batch_in_epoch"] = 0
        resumed = False
        for batch in loader:
            state["batch_in_epoch"] += 1
            state["micro_batches"] += 1
            yield batch
        state["epoch"] += 1
    raise DataError("the training data ran out before the planned number of steps (this is a bug in litft)")


def planned_steps(recipe: Recipe, batches_per_epoch: int) -> int:
    """Optimizer steps of the run: all epochs' micro-batches in steps of grad_accum, capped by max_steps."""
    steps = recipe.train.epochs * batches_per_epoch // recipe.grad_accum
    if steps < 1:
        raise ConfigError(
            f"train.global_batch_size: one optimizer step needs {recipe.train.global_batch_size} samples, but the"
            f" training set gives each of {recipe.world_size} device(s) only {batches_per_epoch} micro-batch(es) of"
            f" {recipe.train.micro_batch_size} per epoch; lower global_batch_size or use more data"
        )
    if recipe.train.max_steps is not None:
        steps = min(steps, recipe.train.max_steps)
    return steps


def clip_gradients(fabric, model, optimizer, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm to ``max_norm``; returns the norm before clipping (not checked for finiteness).

    clip_grad_norm_ multiplies every gradient by min(1, max_norm / (norm + 1e-6)): one more pass over all gradients
    (TinyLlama full fine-tune: 2.2 GB read and written, 1.8 ms of a 122 ms H100 step in
    benchmarks/results/lora-width-tiny). A fused torch optimizer divides each gradient by its ``grad_scale`` inside
    its own kernel (the hook torch's GradScaler uses), so on one device or under DDP (whole gradients on every rank)
    litft computes the norm only and hands the optimizer max(1, (norm + 1e-6) / max_norm) to divide by. Sharded
    strategies, fp16 loss scaling (whose scaler owns grad_scale) and other optimizers keep Fabric's clip_gradients."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Fabric wraps the torch optimizer
    if scales_in_step(fabric, inner):
        grads = [p.grad for group in inner.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        # fp32, as the fused kernels take their grad_scale (GradScaler's); the norm of bf16 gradients is bf16
        inner.grad_scale = ((norm.float() + 1e-6) / max_norm).clamp(min=1.0)
        return norm
    return fabric.clip_gradients(model, optimizer, max_norm=max_norm, error_if_nonfinite=False)


def scales_in_step(fabric, optimizer: torch.optim.Optimizer) -> bool:
    """Whether clip_gradients can leave the scaling to the optimizer's fused kernel (see there)."""
    return (
        bool(optimizer.defaults.get("fused"))
        and getattr(optimizer, "_step_supports_amp_scaling", False)
        and whole_parameters_unscaled(fabric)
    )


def whole_parameters_unscaled(fabric) -> bool:
    """One device or DDP (each rank holds whole parameters and gradients), and no fp16 loss scaler (which would own
    an optimizer's grad_scale)."""
    from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy

    return (type(fabric.strategy) in (SingleDeviceStrategy, DDPStrategy)
            and getattr(fabric.strategy.precision, "scaler", None) is None)


TRITON_ADAMW = "Triton kernel (litft.kernels.AdamW)"


def build_optimizer(recipe: Recipe, model, triton_adamw: bool = False) -> torch.optim.Optimizer:
    """The recipe's optimizer over the trainable parameters. With ``triton_adamw`` (train.triton_kernels on CUDA,
    see main), torch.optim.AdamW that would run fused runs as kernels.AdamW: the same update without writing the
    clipped gradients back (TinyLlama full fine-tune on the H100: see kernels.AdamW)."""
    import importlib

    module_name, _, class_name = recipe.optimizer.class_path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = optimizer_kwargs(recipe, cls, on_cuda=bool(params) and all(p.is_cuda for p in params))
    if triton_adamw and cls is torch.optim.AdamW and kwargs.get("fused") and not kwargs.get("amsgrad"):
        cls = kernels.AdamW
    return cls(params, **kwargs)


def optimizer_kwargs(recipe: Recipe, cls: type, on_cuda: bool) -> dict:
    """The optimizer's keyword arguments: the recipe's, with fused=True for torch's AdamW, Adam and SGD on CUDA (one
    fused kernel per chunk of parameters instead of a chain of foreach kernels, one per term of the update) unless
    the recipe chose fused or foreach itself. A None there is no choice: jsonargparse fills in the class's defaults,
    foreach=None and fused=None included, and taking those for a choice had kept every recipe on torch's foreach
    AdamW (seen in the H100 profile of a full fine-tune: 17 ms of a 133 ms step, benchmarks/results/compiled-profile)."""
    kwargs = dict(recipe.optimizer.init_args)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    fusable = cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
    if fusable and on_cuda and kwargs.get("fused") is None and kwargs.get("foreach") is None:
        kwargs["fused"] = True
    return kwargs


def optimizer_summary(optimizer) -> dict:
    """For the run's log and result.json: the optimizer's class and the implementation its step runs (torch's
    optimizers: fused, foreach, or torch's own choice when neither was set: foreach for CUDA tensors)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper
    defaults = inner.defaults
    if isinstance(inner, kernels.AdamW):
        implementation = TRITON_ADAMW
    elif defaults.get("fused"):
        implementation = "fused"
    elif defaults.get("foreach"):
        implementation = "foreach"
    elif "foreach" in defaults:
        implementation = "torch's default: foreach on CUDA, for-loop elsewhere"
    else:
        implementation = "its own"
    return {"class": f"{type(inner).__module__}.{type(inner).__name__}", "implementation": implementation}


def build_scheduler(recipe: Recipe, optimizer, total_steps: int):
    """Linear warm-up over warmup_steps (capped at the run's length), then cosine/linear decay or constant."""
    t = recipe.train
    warmup = min(t.warmup_steps, total_steps)

    def factor(done: int) -> float:  # `done` optimizer steps completed; the next step uses this factor
        if done < warmup:
            return (done + 1) / warmup
        if t.lr_schedule == "constant" or total_steps <= warmup:
            return 1.0
        progress = (done - warmup) / max(1, total_steps - warmup)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if t.lr_schedule == "cosine" else 1 - progress
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * shape

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


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


def save_final(fabric, recipe: Recipe, config, model, out_dir: Path) -> None:
    """out_dir/final: lit_model.pth (full) or lit_model.pth.lora (adapter), with the files LitGPT's tools need."""
    final = out_dir / "final"
    is_lora = recipe.method in ("lora", "qlora")
    gpt = unwrap(model)
    state = trainable_state_dict(gpt) if is_lora else gpt.state_dict()
    if fabric.global_rank == 0:
        write_checkpoint_files(recipe, config, final)
        name = "lit_model.pth.lora" if is_lora else "lit_model.pth"
        save_atomic(state, final / name)
        if is_lora and recipe.merge:
            base = resolve_path(recipe.model.checkpoint_dir) / "lit_model.pth" if recipe.init == "pretrained" else None
            if base is None:
                fabric.print("merge: skipped, a random-init run has no base checkpoint on disk to merge into")
            else:
                merged = final / "merged"
                write_checkpoint_files(recipe, config, merged)
                merge_lora_checkpoint(base, final / name, config, merged / "lit_model.pth")
    fabric.barrier()


def save_atomic(state: dict, path: Path) -> None:
    """Write to a temporary file, fsync, then rename: the file on disk is whole or absent."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, default=str), encoding="utf-8")
    os.replace(tmp, path)


def build_result(
    recipe, fabric, status, config, counts, data, state, losses, throughput, phases, out_dir, batches_per_epoch,
    predicted=None, gpu=None, worst_case=None,
) -> dict:
    mem = metrics.memory_stats(fabric.device)
    if fabric.world_size > 1 and fabric.device.type == "cuda":
        # max over ranks: the rank that ran out first decides whether the run fits
        peaks = torch.tensor([mem["peak_allocated_gib"], mem["peak_reserved_gib"]], device=fabric.device)
        peaks = fabric.all_reduce(peaks, reduce_op="max")
        mem["peak_allocated_gib"], mem["peak_reserved_gib"] = peaks.tolist()
    mem["host_peak_rss_gib"] = metrics.host_peak_rss_gib()
    mem["cap_gib"] = None
    if recipe.memory_cap is not None and fabric.device.type == "cuda":
        from litft.recipe import parse_memory_cap

        mem["cap_gib"] = parse_memory_cap(recipe.memory_cap, mem["device_total_gib"])
    mem["predicted"] = predicted.as_dict() if predicted is not None else None
    mem["predicted_worst_case"] = worst_case.as_dict() if worst_case is not None else None
    mem["max_micro_batch_tokens"] = state["max_micro_tokens"]
    mem["predicted_for_tokens"] = predicted.tokens if predicted is not None else None
    mem["error_pct"] = None
    if predicted is not None and mem["peak_reserved_gib"]:
        mem["error_pct"] = (predicted.total_gib - mem["peak_reserved_gib"]) / mem["peak_reserved_gib"] * 100
    if gpu:
        mem["device_used_peak_gib"] = gpu.get("device_used_peak_gib")
    return {
        "status": status,
        "out_dir": str(out_dir),
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
            "devices": fabric.world_size,
            "global_batch_size": recipe.train.global_batch_size,
            "max_seq_length": recipe.data.max_seq_length,
            "arithmetic": recipe.batch_arithmetic(),
            "pack_steps": recipe.packs_steps,
            "micro_batches_run": state["micro_batches_run"],
        },
        "data": {
            "train": dataclasses.asdict(data.train.stats), "val": dataclasses.asdict(data.val.stats),
            "train_source": data.train_source, "val_source": data.val_source,
        },
        "steps": state["step"],
        "epochs_completed": state["micro_batches"] / max(1, batches_per_epoch),
        "losses": losses,
        "throughput": throughput,
        "memory": mem,
        "phases_s": phases.seconds,
        "gpu": gpu or {},
        "device": torch.cuda.get_device_name(fabric.device) if fabric.device.type == "cuda" else "cpu",
        "environment": metrics.environment(),
        "definitions": metrics.DEFINITIONS,
        "files": {
            "config": "config.yaml",
            "metrics": "metrics.jsonl",
            "tensorboard": "tensorboard/" if recipe.logging.tensorboard else None,
            "weights": "final/lit_model.pth.lora" if recipe.method in ("lora", "qlora") else "final/lit_model.pth",
        },
    }


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


def out_of_memory(recipe: Recipe, fabric, err: Exception) -> OutOfMemoryError:
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


__all__ = ["finetune", "RunResult", "main", "fit", "LitftError"]
