"""A litft recipe through Lightning's Trainer, for those who train with ``L.Trainer``: :class:`RecipeModule` (a
LightningModule), :class:`RecipeData` (a LightningDataModule) and :class:`RunFiles` (a Callback that writes the run's
metrics.jsonl, result.json and final weights as the Fabric loop does).

They are made of litft's own parts: the model and its LoRA or 4-bit layers (``litft.model.build_model``), the data,
samplers and collates (``litft.data``), the optimizer and schedule (``litft.train.optim``) and the loss over each
step's loss tokens. ``litft finetune --engine trainer`` (or ``engine: trainer`` in a recipe) runs a recipe this way;
:func:`trainer_for` gives the Trainer to call ``fit`` on by hand::

    recipe = litft.load_recipe("demo")
    trainer = litft.lightning.trainer_for(recipe)
    trainer.fit(litft.lightning.RecipeModule(recipe), datamodule=litft.lightning.RecipeData(recipe))

What differs from the Fabric engine, and why:

- The Trainer calls ``training_step`` once per micro-batch through its strategy's wrappers (torch's
  DistributedDataParallel under DDP), so litft's CUDA graphs, its own gradient averaging, gradients written by the
  matmul and the fused step's in-kernel clipping stay off (``trainer_plan``); litft's layers, Triton kernels, packing
  and loss stay on.
- Each step's loss is the sum over its loss tokens on all ranks divided by their number, as in the Fabric engine: the
  micro-batches' losses are summed into the gradients unscaled and the gradients are divided by the step's loss tokens
  once, before clipping and the update (the count is known only after the step's last micro-batch).
- Strategies: one device, DDP and FSDP (Lightning's, configured from the recipe's strategy section). DeepSpeed keeps
  the gradients inside its engine, where this division cannot reach: it runs under the Fabric engine.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import lightning as L
import torch

from litft import metrics
from litft.plan import Plan
from litft.recipe import Recipe, resolve_path


def trainer_plan(recipe: Recipe, config, device: str, world_size: int, data_stats=None) -> Plan:
    """litft's plan for a run under the Trainer: the Fabric engine's, less what only litft's own loop can run (see the
    module doc): CUDA graphs, gradients written by the matmul (and the fused LoRA layers that need them), the fused
    step's scales, litft's AdamW kernel and its DDP reducer. Micro-batches hold micro_batch_size samples each (no
    data.pack_steps: the Trainer's loop counts micro-batches)."""
    from litft.plan import resolve

    train = dataclasses.replace(recipe.train, cuda_graphs="never", grad_into_weights=False)
    cuda = device == "cuda"
    plan = resolve(dataclasses.replace(recipe, train=train), config, device, world_size, data_stats=data_stats,
                   device_name=torch.cuda.get_device_name() if cuda else None,
                   capability=torch.cuda.get_device_capability() if cuda else None)
    # step_capacity and fit_steps stay: the sampler fits each step's samples as the Fabric engine's does (the same
    # samples per step), though the Trainer's micro-batches hold micro_batch_size samples each
    note = "engine trainer: CUDA graphs, gradients written by the matmul, litft's DDP reducer and fused step off"
    return dataclasses.replace(plan, reduces_gradients=False, step_scales=False, triton_adamw=False,
                               stack_fc_weights=False, pack_steps=False,
                               loader_batch_size=recipe.train.micro_batch_size, notes=(*plan.notes, note))


class MicroBatches(torch.utils.data.Sampler):
    """A step's samples (one item of an :class:`~litft.data.EpochBatchSampler` of micro_batch_size x grad_accum) as
    grad_accum micro-batches of micro_batch_size, in order: the same samples per step as the Fabric engine, one
    micro-batch per ``training_step``. ``set_epoch`` reaches the step sampler (Lightning calls it each epoch)."""

    def __init__(self, steps, micro_batch_size: int) -> None:
        self.steps, self.micro_batch_size = steps, micro_batch_size

    def set_epoch(self, epoch: int) -> None:
        self.steps.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.steps) * (self.steps.micro_batch_size // self.micro_batch_size)

    def __iter__(self):
        m = self.micro_batch_size
        for step in self.steps:
            for start in range(0, len(step), m):
                yield step[start:start + m]


class RecipeData(L.LightningDataModule):
    """The recipe's data: tokenized once (litft.data.prepare_data), the training set in steps of the same samples as
    the Fabric engine's (shuffled per epoch by (seed, epoch), split between ranks by positions), one micro-batch per
    loader item; the validation set in micro-batches, in order."""

    def __init__(self, recipe: Recipe) -> None:
        super().__init__()
        self.recipe = recipe
        self.data = None
        self.plan: Plan | None = None

    def setup(self, stage: str | None = None) -> None:
        from litft.model import model_config
        from litft.train.setup import load_data

        if self.data is None:
            self.data = load_data(self.recipe)
        if self.plan is None and self.trainer is not None:
            self.plan = trainer_plan(self.recipe, model_config(self.recipe), self.trainer.strategy.root_device.type,
                                     self.trainer.world_size, self.data.train.stats)

    def _rank(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_dataloader(self):
        from litft.data import EpochBatchSampler, build_dataloader

        recipe, plan = self.recipe, self.plan
        rank, world_size = self._rank()
        step_samples = recipe.train.micro_batch_size * recipe.grad_accum
        fit = plan.step_capacity if plan.fit_steps else None
        steps = EpochBatchSampler(self.data.train.lengths, step_samples, shuffle=True, seed=recipe.seed, rank=rank,
                                  world_size=world_size, drop_last=True, fit_capacity=fit)
        return build_dataloader(self.data.train, MicroBatches(steps, recipe.train.micro_batch_size),
                                self.data.pad_id, recipe.data.num_workers, packing=plan.packing)

    def val_dataloader(self):
        from litft.data import EpochBatchSampler, build_dataloader

        rank, world_size = self._rank()
        sampler = EpochBatchSampler(len(self.data.val), self.recipe.train.micro_batch_size, shuffle=False,
                                    seed=self.recipe.seed, rank=rank, world_size=world_size, drop_last=False)
        return build_dataloader(self.data.val, sampler, self.data.pad_id, self.recipe.data.num_workers,
                                packing=self.plan.packing if self.plan else False)


class RecipeModule(L.LightningModule):
    """The recipe's model and loss as a LightningModule: manual optimization, one micro-batch per training_step, an
    optimizer step after every grad_accum of them (see the module doc for how the loss is normalised)."""

    def __init__(self, recipe: Recipe) -> None:
        super().__init__()
        from litft.model import model_config

        self.automatic_optimization = False
        self.recipe = recipe
        self.config = model_config(recipe)
        self.plan: Plan | None = None
        self.total_steps: int | None = None
        self.causal = None
        self.counts = None
        self._micro = 0
        self._loss = None          # the step's loss sum so far, on the device
        self._tokens = [0, 0, 0, 0]  # the step's real, padded, loss tokens and samples so far
        self._flops = 0.0
        self.step_done: dict[str, Any] | None = None
        """Set by the micro-batch that ends an optimizer step (loss, lr, grad_norm, counts), for RunFiles."""
        self.val_loss: float | None = None
        self._val = None

    # ---- the model and the optimizer ----

    def setup(self, stage: str) -> None:
        """The plan for this Trainer's device and ranks, and the schedule's length (trainer.max_steps, else the
        optimizer steps the Trainer's epochs make), when finetune_with_trainer has not set them."""
        trainer = self.trainer
        if self.plan is None:
            datamodule = getattr(trainer, "datamodule", None)
            stats = datamodule.data.train.stats if getattr(datamodule, "data", None) is not None else None
            self.plan = trainer_plan(self.recipe, self.config, trainer.strategy.root_device.type, trainer.world_size,
                                     stats)
        if self.total_steps is None and stage == "fit":
            self.total_steps = (trainer.max_steps if trainer.max_steps > 0
                                else max(1, trainer.estimated_stepping_batches // self.recipe.grad_accum))

    def configure_model(self) -> None:
        from litft.layers import use_fast_layers
        from litft.model import (
            CausalLM,
            apply_activation_checkpointing,
            build_model,
            compile_blocks,
            count_parameters,
        )

        if self.causal is not None:
            return
        plan = self.plan
        L.seed_everything(self.recipe.seed, verbose=False)  # the Fabric engine's random init and LoRA A
        gpt = build_model(_TrainerParts(self.trainer), self.recipe, self.config, plan.strategy)
        self.counts = count_parameters(gpt)
        use_fast_layers(gpt, plan.layers)
        if plan.activation_checkpointing and plan.strategy != "fsdp":  # FSDP checkpoints its own units
            apply_activation_checkpointing(gpt)
        if plan.compile:
            compile_blocks(gpt)
        self.causal = CausalLM(gpt, plan.loss_chunk, self.recipe.data.max_seq_length, plan.compile, plan.triton_loss,
                               plan.fused_residual_norms)

    def configure_optimizers(self):
        from litft.train.optim import build_optimizer, build_scheduler

        optimizer = build_optimizer(self.recipe, self.causal, self.plan)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": build_scheduler(self.recipe, optimizer, self.total_steps or 1),
                                 "interval": "step"}}

    # ---- training ----

    def training_step(self, batch: dict, batch_idx: int):
        from litft.train.engines import model_inputs

        loss = self.causal(**model_inputs(batch, self.device))  # the micro-batch's summed token losses
        self.manual_backward(loss)
        self._loss = loss.detach() if self._micro == 0 else self._loss + loss.detach()
        counts = (batch["tokens_real"], batch["tokens_padded"], batch["loss_tokens"], batch["samples"])
        self._tokens = [a + b for a, b in zip(self._tokens if self._micro else [0, 0, 0, 0], counts)]
        self._flops = (self._flops if self._micro else 0.0) + self._flop_model.batch_flops(batch["lengths"])
        self._micro += 1
        if self._micro < self.recipe.grad_accum:
            return None
        self._micro = 0
        self.step_done = self._optimizer_step()
        return self.step_done["loss_tensor"]

    def _optimizer_step(self) -> dict[str, Any]:
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        world_size = self.trainer.world_size
        step_counts = torch.tensor([float(v) for v in self._tokens] + [self._flops], dtype=torch.float64,
                                   device=self.device)
        step_loss = self._loss.float().reshape(1)
        if world_size > 1:  # the step's counts and loss over all ranks
            torch.distributed.all_reduce(step_counts)
            torch.distributed.all_reduce(step_loss)
        loss_tokens = max(float(step_counts[2]), 1.0)
        # Gradients hold sum over micro-batches of each rank's summed token losses, averaged over the ranks by the
        # strategy (/ world_size): x world_size / the step's loss tokens gives the mean token loss's gradient.
        scale = world_size / loss_tokens
        with torch.no_grad():
            for p in self.causal.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        grad_norm = None
        max_norm = self.recipe.train.max_grad_norm
        if max_norm is not None:
            if self.plan.strategy == "fsdp":  # a norm over all ranks' shards: FSDP's own clip (through Lightning)
                grad_norm = self.trainer.strategy.model.clip_grad_norm_(max_norm)
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_([p for p in self.causal.parameters() if p.grad is not None],
                                                           max_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss = step_loss / loss_tokens
        counts = step_counts.tolist()
        return {"loss_tensor": loss.reshape(()), "loss": float(loss), "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "tokens_real": int(counts[0]), "tokens_padded": int(counts[1]), "loss_tokens": int(counts[2]),
                "samples": int(counts[3]), "flops": counts[4]}

    @property
    def _flop_model(self) -> metrics.FlopModel:
        config, counts = self.config, self.counts
        return metrics.FlopModel(counts.matmul_trainable, counts.matmul_frozen, config.n_layer,
                                 config.n_head * config.head_size)

    # ---- validation: the mean loss per loss token over the validation set (all ranks) ----

    def on_validation_epoch_start(self) -> None:
        self._val = torch.zeros(2, dtype=torch.float64, device=self.device)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        from litft.train.engines import model_inputs

        self._val[0] += self.causal(**model_inputs(batch, self.device)).double()
        self._val[1] += batch["loss_tokens"]

    def on_validation_epoch_end(self) -> None:
        total = self._val
        if self.trainer.world_size > 1:
            torch.distributed.all_reduce(total)
        loss_sum, tokens = total.tolist()
        self.val_loss = loss_sum / max(tokens, 1)


class _TrainerParts:
    """What litft.model.build_model and litft.checkpoint.save_final ask of Fabric, answered by a Trainer: its
    init_module (the precision's dtype, the device, meta or zero.Init under sharding), ranks, print and barrier."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def init_module(self, empty_init: bool | None = None):
        return self.trainer.init_module(empty_init=empty_init)

    @property
    def global_rank(self) -> int:
        return self.trainer.global_rank

    @property
    def world_size(self) -> int:
        return self.trainer.world_size

    def print(self, *args, **kwargs) -> None:
        if self.trainer.global_rank == 0:
            print(*args, **kwargs)

    def barrier(self) -> None:
        self.trainer.strategy.barrier()


class RunFiles(L.Callback):
    """The run's files as the Fabric engine writes them: a metrics.jsonl row every logging.interval steps (loss, lr,
    gradient norm, step time, tok/s, memory) and a val_loss row per validation, TensorBoard beside it, and at the end
    the final weights (final/, as after a Fabric run) and result.json with the run's figures and the engine's name."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.out_dir = resolve_path(recipe.out_dir)
        self.writer = None
        self.durations: dict[int, float] = {}
        self.records: list[metrics.StepRecord] = []
        self.losses: dict[str, float | None] = {"train_first": None, "train_last": None, "val_initial": None,
                                                "val_final": None}
        self._t0 = 0.0
        self._started = time.perf_counter()
        self.validated_at: int | None = None
        """The step of the last validation (the Trainer's interval may already have validated the last step)."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.global_rank == 0 and self.writer is None:
            from litft.files import make_dir

            make_dir(self.out_dir, "the out_dir")
            self.writer = metrics.MetricsWriter(self.out_dir, self.recipe.logging.tensorboard,
                                                metrics.wandb_settings(self.recipe))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if pl_module._micro == 0:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        done, pl_module.step_done = pl_module.step_done, None
        if done is None:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        step = trainer.global_step
        self.durations[step] = time.perf_counter() - self._t0
        self.records.append(metrics.StepRecord(step=step, tokens_real=done["tokens_real"],
                                               tokens_padded=done["tokens_padded"], samples=done["samples"],
                                               loss_tokens=done["loss_tokens"], flops=done["flops"]))
        if not math.isfinite(done["loss"]):
            from litft.errors import NonFiniteLossError

            raise NonFiniteLossError(f"the loss is {done['loss']} at step {step} (rank {trainer.global_rank}) under"
                                     " the Trainer engine; try a lower optimizer.init_args.lr or train.max_grad_norm")
        self.losses["train_first"] = self.losses["train_first"] if self.losses["train_first"] is not None \
            else done["loss"]
        self.losses["train_last"] = done["loss"]
        interval = self.recipe.logging.interval
        if self.writer is not None and (step % interval == 0 or step == trainer.max_steps):
            mem = metrics.memory_stats(pl_module.device)
            seconds = self.durations[step]
            self.writer.write({
                "step": step, "epoch": trainer.current_epoch, "loss": done["loss"], "lr": done["lr"],
                "grad_norm": done["grad_norm"], "step_time_s": seconds,
                "tokens_per_sec": done["tokens_real"] / seconds if seconds else None,
                "tokens_real": done["tokens_real"], "peak_allocated_gib": mem["peak_allocated_gib"],
                "peak_reserved_gib": mem["peak_reserved_gib"],
            })

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or pl_module.val_loss is None:
            return
        key = "val_initial" if trainer.global_step == 0 else "val_final"
        self.losses[key] = pl_module.val_loss
        self.validated_at = trainer.global_step
        if self.writer is not None:
            self.writer.write({"step": trainer.global_step, "val_loss": pl_module.val_loss})

    def finish(self, trainer, module: RecipeModule, status: str) -> dict:
        """Final weights and result.json (rank 0 writes; every rank takes part in gathering sharded weights)."""
        from litft.checkpoint import save_final
        from litft.files import write_text_atomic
        from litft.recipe import config_hash, recipe_to_dict

        recipe = self.recipe
        sharded = trainer.strategy.model if module.plan.strategy == "fsdp" else None
        save_final(_TrainerParts(trainer), recipe, module.config, module.causal.gpt, self.out_dir, sharded)
        peak = None
        if module.device.type == "cuda":
            from litft.metrics import peak_flops

            peak = peak_flops(torch.cuda.get_device_name(module.device), recipe.precision)
        throughput = metrics.Throughput(trainer.world_size, recipe.logging.skip_steps, peak)
        for record in self.records:  # counts already summed over the ranks: as one rank of one
            throughput.add(record)
        figures = dataclasses.replace(throughput, world_size=1).summary(self.durations)
        if figures.get("tokens_per_sec") is not None:
            figures["tokens_per_sec_per_device"] = figures["tokens_per_sec"] / trainer.world_size
        if figures.get("mfu") is not None:
            figures["mfu"] /= trainer.world_size
        memory = metrics.memory_stats(module.device)
        result = {
            "status": status,
            "engine": "trainer",
            "out_dir": str(self.out_dir),
            "config_hash": config_hash(recipe),
            "recipe": recipe_to_dict(recipe),
            "model": {"name": module.config.name, "n_layer": module.config.n_layer, "n_embd": module.config.n_embd},
            "parameters": dataclasses.asdict(module.counts) | {"total": module.counts.total},
            "batch": {"micro_batch_size": recipe.train.micro_batch_size, "grad_accum": recipe.grad_accum,
                      "devices": trainer.world_size, "global_batch_size": recipe.train.global_batch_size,
                      "max_seq_length": recipe.data.max_seq_length, "arithmetic": recipe.batch_arithmetic()},
            "steps": trainer.global_step,
            "losses": dict(self.losses),
            "throughput": figures,
            "memory": {"peak_allocated_gib": memory["peak_allocated_gib"],
                       "peak_reserved_gib": memory["peak_reserved_gib"],
                       "host_peak_rss_gib": metrics.host_peak_rss_gib()},
            "phases_s": {"total": time.perf_counter() - self._started},
            "device": torch.cuda.get_device_name(module.device) if module.device.type == "cuda" else "cpu",
            "environment": metrics.environment(),
            "definitions": metrics.DEFINITIONS,
            "plan": module.plan.as_dict(),
            "files": {"config": "config.yaml", "metrics": "metrics.jsonl",
                      "weights": "final/lit_model.pth.lora" if recipe.method in ("lora", "qlora")
                      else "final/lit_model.pth"},
        }
        if trainer.global_rank == 0:
            import json

            if self.writer is not None:
                self.writer.close()
                self.writer = None
            write_text_atomic(self.out_dir / "result.json", json.dumps(result, indent=2, default=str))
        return result


def trainer_strategy(recipe: Recipe):
    """The Trainer's strategy for the recipe's strategy section: 'auto' on one device, DDP (processes started as
    the command line was, or spawned from Python), or FSDP with one unit per transformer block."""
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from litft.strategy import LAUNCHED_FROM_CLI

    name = recipe.strategy.name  # deepspeed is refused with the recipe's other problems (litft.recipe.validate)
    if recipe.world_size == 1 and name in ("auto", "ddp"):
        return "auto"
    if name in ("auto", "ddp"):
        return DDPStrategy(start_method="popen" if LAUNCHED_FROM_CLI else "spawn")
    from litgpt.model import Block

    f = recipe.strategy.fsdp
    return FSDPStrategy(auto_wrap_policy={Block},
                        activation_checkpointing_policy={Block} if recipe.train.activation_checkpointing else None,
                        sharding_strategy=f.sharding, cpu_offload=f.cpu_offload, state_dict_type=f.checkpoint,
                        use_orig_params=True, limit_all_gathers=True)


def trainer_for(recipe: Recipe, callbacks: list | None = None, total_steps: int | None = None) -> L.Trainer:
    """A Trainer for the recipe: its accelerator, devices, nodes, strategy and precision (QLoRA: Lightning's
    BitsandbytesPrecision); max_steps the recipe's (or ``total_steps``); validation every eval.interval steps;
    no logger or checkpoints of Lightning's own (RunFiles writes the run's files)."""
    from litft.strategy import resolve_accelerator

    accelerator = resolve_accelerator(recipe)
    precision, plugins = recipe.precision, None
    if recipe.method == "qlora":
        from lightning.pytorch.plugins import BitsandbytesPrecision

        from litft.precision import Precision

        plugins = [BitsandbytesPrecision(mode=recipe.quantize, dtype=Precision(recipe.precision).compute_dtype)]
        precision = None
    interval = recipe.eval.interval
    return L.Trainer(
        accelerator=accelerator, devices=recipe.devices, num_nodes=recipe.num_nodes,
        strategy=trainer_strategy(recipe), precision=precision, plugins=plugins,
        max_epochs=recipe.train.epochs, max_steps=total_steps or recipe.train.max_steps or -1,
        val_check_interval=interval * recipe.grad_accum if interval else None,  # counted in micro-batches
        check_val_every_n_epoch=None if interval else 1, limit_val_batches=recipe.eval.max_batches or 1.0,
        num_sanity_val_steps=0, use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=recipe.logging.progress in ("auto", "rich"), enable_model_summary=False,
        callbacks=callbacks or [], deterministic=False,
    )


def finetune_with_trainer(recipe: Recipe):
    """``litft finetune`` with engine trainer: the recipe through Lightning's Trainer (RecipeModule, RecipeData,
    RunFiles), writing out_dir as the Fabric engine does; returns a RunResult."""
    from litft.data.sampler import batches_per_rank
    from litft.files import make_dir, write_text_atomic
    from litft.model import model_config
    from litft.plan import planned_steps
    from litft.recipe import recipe_to_yaml
    from litft.train.result import RunResult

    out_dir = resolve_path(recipe.out_dir)
    data_module = RecipeData(recipe)
    data_module.setup()
    module = RecipeModule(recipe)
    steps_per_epoch = batches_per_rank(len(data_module.data.train), recipe.train.micro_batch_size * recipe.grad_accum,
                                       recipe.world_size, drop_last=True)
    total_steps = planned_steps(recipe, steps_per_epoch * recipe.grad_accum)
    files = RunFiles(recipe)
    trainer = trainer_for(recipe, callbacks=[files], total_steps=total_steps)
    device = "cuda" if trainer.strategy.root_device.type == "cuda" else "cpu"
    module.plan = data_module.plan = trainer_plan(recipe, model_config(recipe), device, trainer.world_size,
                                                  data_module.data.train.stats)
    module.total_steps = total_steps
    if trainer.global_rank == 0:
        make_dir(out_dir, "the out_dir")
        for name in ("metrics.jsonl", "result.json"):
            (out_dir / name).unlink(missing_ok=True)
        write_text_atomic(out_dir / "config.yaml", recipe_to_yaml(recipe))
    if recipe.eval.initial:
        trainer.validate(module, datamodule=data_module, verbose=False)
    trainer.fit(module, datamodule=data_module)
    if recipe.eval.final and files.validated_at != trainer.global_step:
        trainer.validate(module, datamodule=data_module, verbose=False)
    result = files.finish(trainer, module, "ok")
    if trainer.global_rank == 0:
        losses, speed = result["losses"], result["throughput"]["tokens_per_sec"]
        print(f"litft run: ok (engine trainer) | steps {result['steps']} | loss {losses['train_first']:.4f} ->"
              f" {losses['train_last']:.4f}" + (f" | {speed:,.0f} tok/s" if speed else "") + f" | out_dir {out_dir}")
    return RunResult(out_dir, result, module.causal.gpt if trainer.world_size == 1 else None)
