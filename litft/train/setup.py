"""The steps main() runs before the first training step, in its order: the data, a checkpoint to resume from, the
out_dir's files, the predicted memory and the memory cap, the model, the optimizer and the loaders."""

from __future__ import annotations

from pathlib import Path

import torch

from litft import metrics
from litft.errors import CheckpointError, ConfigError, DataError
from litft.model import (
    CausalLM,
    apply_activation_checkpointing,
    build_model,
    compile_blocks,
    count_parameters,
    load_into_fsdp,
    settle_4bit_compute_dtype,
)
from litft.plan import Plan
from litft.recipe import Recipe, parse_memory_cap, recipe_to_yaml, resolve_path
from litft.train.state import keep_metrics_until


def load_data(recipe: Recipe):
    """Read, split and tokenize the data once, before any model is loaded: bad data fails in seconds."""
    from litgpt.tokenizer import Tokenizer

    from litft.data import prepare_data

    directory = resolve_path(recipe.model.tokenizer_dir or recipe.model.checkpoint_dir)
    try:
        tokenizer = Tokenizer(directory)
    except Exception as err:  # noqa: BLE001 - tokenizers and sentencepiece raise their own types for a bad file
        key = "model.tokenizer_dir" if recipe.model.tokenizer_dir else "model.checkpoint_dir"
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"{key}: cannot load the tokenizer in '{directory}' ({reason}); it needs a whole"
                              " tokenizer.json or tokenizer.model, as `litgpt download` writes them") from None
    return prepare_data(recipe.data, tokenizer, seed=recipe.seed)


def load_resume(fabric, recipe: Recipe, out_dir: Path, resume: str) -> dict:
    """The checkpoint to resume from, checked against the recipe before anything is written: a refused resume leaves
    the run as it was."""
    from litft.checkpoint import find_resume_checkpoint, load_checkpoint, resume_differences

    checkpoint = load_checkpoint(find_resume_checkpoint(out_dir, resume))
    refuse, warn = resume_differences(checkpoint["config"], recipe)
    if refuse:
        raise ConfigError([f"cannot resume from {checkpoint['path']}: {d}" for d in refuse])
    for line in warn:
        fabric.print(f"resume: {line}")
    return checkpoint


def start_out_dir(out_dir: Path, recipe: Recipe, checkpoint: dict | None) -> None:
    """The run's config.yaml; a new run's metrics and result start afresh, a resumed run's metrics keep the steps up
    to its checkpoint. A failed write is a WriteError (exit 6) naming the file."""
    from litft.files import make_dir, write_text_atomic, writing

    make_dir(out_dir, "the out_dir")
    if checkpoint is None:
        for name in ("metrics.jsonl", "result.json"):  # --overwrite: start the files afresh
            with writing(f"the replaced run's {name}", out_dir / name):
                (out_dir / name).unlink(missing_ok=True)
    else:
        with writing("the metrics log", out_dir / "metrics.jsonl"):
            keep_metrics_until(out_dir / "metrics.jsonl", checkpoint["state"]["counters"]["step"])
    write_text_atomic(out_dir / "config.yaml", recipe_to_yaml(recipe))


def worst_case_tokens(plan: Plan, micro_batch_size: int, lengths: torch.Tensor) -> int:
    """Positions of the largest micro-batch the data can form: the B longest samples packed (rounded up to the
    packing multiple), or B rows of the longest sample when padding. With data.pack_steps: a step's longest samples
    as far as they fill a micro-batch's positions."""
    from litft.data import PACK_MULTIPLE

    b = min(plan.loader_batch_size, len(lengths))
    longest = torch.sort(lengths, descending=True).values[:b]
    if not plan.packing:
        return int(longest[0]) * micro_batch_size
    positions = int(longest.sum())
    if plan.pack_steps:
        positions = min(positions, plan.step_capacity)
    return -(-positions // PACK_MULTIPLE) * PACK_MULTIPLE


def predict_memory(recipe: Recipe, config, plan: Plan, tokens: int):
    """The ledger for this run: GPU memory, so a CPU run is predicted as the same recipe would run on a GPU. A failure
    to predict must not stop training: it is reported and skipped."""
    from litft.memory import estimate_memory
    from litft.plan import plan_for_estimate

    if plan.device != "cuda":
        plan = plan_for_estimate(recipe, config, compiled=plan.compile)
    try:
        return estimate_memory(recipe, config, tokens=tokens, plan=plan)
    except Exception as err:  # e.g. an architecture the tracer cannot build on the CPU
        print(f"memory: no prediction ({type(err).__name__}: {err})")
        return None


def apply_memory_cap(recipe: Recipe, fabric) -> None:
    """Cap torch's allocator at memory_cap, so this GPU fails where a smaller one would."""
    total = torch.cuda.get_device_properties(fabric.device).total_memory / metrics.GIB
    cap = parse_memory_cap(recipe.memory_cap, total)
    if cap >= total:
        fabric.print(f"memory: cap {cap:.1f} GiB is not below this GPU's {total:.1f} GiB; no cap applied")
        return
    torch.cuda.set_per_process_memory_fraction(cap / total, fabric.device)
    fabric.print(f"memory: capped at {cap:.1f} GiB of {total:.1f} GiB (memory_cap {recipe.memory_cap})")


def setup_model(fabric, recipe: Recipe, plan: Plan, config):
    """The model on its device with the plan's layers, wrapped with its loss (CausalLM) by Fabric; returns it and
    its parameter counts."""
    from litft.layers import use_fast_layers
    from litft.layers.lora_fused import stack_fc_weights

    fabric.seed_everything(recipe.seed)  # same seed on every rank: identical random init and LoRA A
    gpt = build_model(fabric, recipe, config, plan.strategy)
    counts = count_parameters(gpt)
    fabric.print(f"model: {config.name}, {counts.total:,} parameters, {counts.trainable:,} trainable"
                 f" ({100 * counts.trainable / counts.total:.2f}%)")
    use_fast_layers(gpt, plan.layers)
    if plan.activation_checkpointing and plan.strategy != "fsdp":  # FSDP wraps each block itself (its policy)
        apply_activation_checkpointing(gpt)
    if plan.compile:
        compile_blocks(gpt)
    causal = CausalLM(gpt, plan.loss_chunk, recipe.data.max_seq_length, plan.compile, plan.triton_loss,
                      plan.fused_residual_norms)
    if plan.strategy == "deepspeed":
        return causal, counts  # fabric.setup(model, optimizer) wraps both at once
    model = fabric.setup_module(causal)
    if plan.strategy == "fsdp" and recipe.init == "pretrained":
        load_into_fsdp(fabric, model, resolve_path(recipe.model.checkpoint_dir) / "lit_model.pth")
    settle_4bit_compute_dtype(gpt, recipe.precision)  # after setup_module, which clears the flag (qlora)
    if plan.stack_fc_weights:
        stack_fc_weights(gpt)  # after setup_module: it moves weights
    return model, counts


def make_samplers(fabric, recipe: Recipe, plan: Plan, data):
    """The training and validation samplers, before the model is built: a data set too small for the batch setup
    fails here in seconds, naming the split. Under data.pack_steps the training sampler hands out a step's samples
    at once (the same samples per step, in the same order, as grad_accum micro-batches of micro_batch_size) and the
    collate packs them into micro-batches."""
    from litft.data import EpochBatchSampler

    def sampler(dataset, name: str, **kwargs):
        try:
            return EpochBatchSampler(seed=recipe.seed, rank=fabric.global_rank, world_size=fabric.world_size,
                                     **kwargs)
        except DataError as err:
            source = data.train_source if name == "training" else data.val_source
            if name == "training" and recipe.data.val_path is None:  # what the split left for training
                source += f", less {data.val_source}"
            raise DataError(f"the {name} set ({len(dataset):,} samples: {source}) is too small: {err}") from None

    train = sampler(data.train, "training", lengths_or_n=data.train.lengths, micro_batch_size=plan.loader_batch_size,
                    shuffle=True, drop_last=True, fit_capacity=plan.step_capacity if plan.fit_steps else None)
    val = sampler(data.val, "validation", lengths_or_n=len(data.val), micro_batch_size=recipe.train.micro_batch_size,
                  shuffle=False, drop_last=False)
    return train, val


def setup_loaders(fabric, recipe: Recipe, plan: Plan, data, train_sampler, val_sampler):
    """The training and validation loaders over the samplers (make_samplers)."""
    from litft.data import build_dataloader

    # The samplers already give each rank its share, so Fabric must not add a DistributedSampler.
    train_loader, val_loader = fabric.setup_dataloaders(
        build_dataloader(data.train, train_sampler, data.pad_id, recipe.data.num_workers, plan.packing,
                         fixed_shapes=plan.cuda_graphs, step_capacity=plan.step_capacity),
        build_dataloader(data.val, val_sampler, data.pad_id, recipe.data.num_workers, plan.packing),
        use_distributed_sampler=False,
        move_to_device=False,  # the loop moves the two tensors itself; the counts stay plain ints
    )
    return train_loader, val_loader
