"""Checkpoints that are whole or ignored, exact resume, and the run's final weights.

A checkpoint is a folder out_dir/checkpoints/step-NNNNNN holding:

    trainable.pth   the trainable weights (LoRA/QLoRA: the adapters only)
    optimizer.pth   the optimizer's state
    state.pth       step counters, the data position (sampler epoch and batch), the LR scheduler, RNG states
                    (python, numpy, torch CPU, CUDA per rank), the losses so far
    config.yaml     the resolved recipe
    COMMIT.json     written last: step, config hash, litft version, every file with its size and sha256

Under FSDP and DeepSpeed, trainable.pth and optimizer.pth are replaced by the folder `sharded/`, where every rank
writes its own part of the weights and optimizer state (fabric.save: torch.distributed.checkpoint files for FSDP,
DeepSpeed's own for ZeRO; one file gathered on rank 0 with strategy.fsdp.checkpoint 'full'). COMMIT.json lists every
file of every rank. A sharded checkpoint resumes on the same strategy and number of devices.

It is written into a temporary folder beside it, every file fsynced, COMMIT.json last, then renamed into place and
the parent folder fsynced. A folder without COMMIT.json, or whose files do not match it, is never resumed from. Old
checkpoints are deleted only after their successor is committed (train.keep_last_n).

The final weights (out_dir/final) are written in LitGPT's layout, so LitGPT's tools load them: lit_model.pth (full)
or lit_model.pth.lora (the adapters), model_config.yaml, the tokenizer files and hyperparameters.yaml; with
`merge: true` also final/merged/lit_model.pth, base + adapters as plain weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import yaml

from litft.errors import CheckpointError, ConfigError
from litft.files import (
    check_free_space,
    make_dir,
    torch_save,
    torch_save_atomic,
    write_dir_atomic,
    writing,
)
from litft.model import lora_kwargs
from litft.recipe import Recipe, config_hash, recipe_to_dict, recipe_to_yaml, resolve_path

COMMIT = "COMMIT.json"
FILES = ("trainable.pth", "optimizer.pth", "state.pth", "config.yaml")
SHARDED = "sharded"


def checkpoints_dir(out_dir: Path) -> Path:
    return out_dir / "checkpoints"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def rng_states() -> dict[str, Any]:
    import numpy as np

    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def save_checkpoint(out_dir: Path, recipe: Recipe, step: int, trainable: dict, optimizer: dict, state: dict,
                    keep_last_n: int) -> Path:
    """Write a committed checkpoint for `step` (rank 0 only), then drop checkpoints beyond keep_last_n."""
    root = checkpoints_dir(out_dir)
    make_dir(root, "the checkpoints folder")
    what = f"the step-{step} checkpoint"
    needed = _tensor_bytes(trainable) + _tensor_bytes(optimizer) + (1 << 20)
    check_free_space(root, needed, what, "The previous checkpoints are untouched; free space or set"
                     " train.keep_last_n lower")

    def write(tmp: Path) -> None:
        torch_save(trainable, tmp / "trainable.pth")
        torch_save(optimizer, tmp / "optimizer.pth")
        torch_save(state, tmp / "state.pth")
        (tmp / "config.yaml").write_text(recipe_to_yaml(recipe), encoding="utf-8")
        delay = float(os.environ.get("LITFT_TEST_SAVE_DELAY", "0"))  # tests kill a run inside this window
        if delay:
            time.sleep(delay)
        _write_commit(tmp, recipe, step)

    final = root / f"step-{step:06d}"
    write_dir_atomic(final, write, what, tmp=root / f".tmp-step-{step:06d}-{uuid.uuid4().hex[:8]}",
                     note="The previous checkpoints are untouched")
    _prune(out_dir, keep_last_n)
    return final


def _prune(out_dir: Path, keep_last_n: int) -> None:
    """After a commit: drop committed checkpoints beyond keep_last_n, and what killed saves left behind."""
    for old in committed_checkpoints(out_dir)[:-max(1, keep_last_n)]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in checkpoints_dir(out_dir).glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _write_commit(folder: Path, recipe: Recipe, step: int) -> None:
    """COMMIT.json: the step, the config hash, litft's version and every file in the folder with its size and
    sha256 (written last: a folder without it is not a checkpoint)."""
    import litft

    files = {str(file.relative_to(folder)): {"bytes": file.stat().st_size, "sha256": _sha256(file)}
             for file in sorted(folder.rglob("*")) if file.is_file()}
    commit = {"step": step, "config_hash": config_hash(recipe), "litft": litft.__version__, "files": files}
    (folder / COMMIT).write_text(json.dumps(commit, indent=2), encoding="utf-8")


def save_sharded_checkpoint(fabric, out_dir: Path, recipe: Recipe, step: int, model, optimizer, state: dict,
                            keep_last_n: int) -> Path:
    """FSDP and DeepSpeed: every rank writes its part of the weights and optimizer state into one temporary folder
    (fabric.save), then rank 0 adds state.pth, config.yaml and COMMIT.json and renames the folder into place."""
    from litft.files import move_dir_into_place

    root = checkpoints_dir(out_dir)
    what = f"the step-{step:06d} checkpoint"
    tmp = Path(fabric.broadcast(str(root / f".tmp-step-{step:06d}-{uuid.uuid4().hex[:8]}")))
    final = root / f"step-{step:06d}"
    if fabric.global_rank == 0:
        make_dir(root, "the checkpoints folder")
        with writing(what, tmp):
            tmp.mkdir()
    fabric.barrier()
    with writing(what, tmp, note="The previous checkpoints are untouched"):
        fabric.save(tmp / SHARDED, {"model": model, "optimizer": optimizer})
    fabric.barrier()
    if fabric.global_rank == 0:
        with writing(what, final, note="The previous checkpoints are untouched"):
            torch_save(state, tmp / "state.pth")
            (tmp / "config.yaml").write_text(recipe_to_yaml(recipe), encoding="utf-8")
            _write_commit(tmp, recipe, step)
            move_dir_into_place(tmp, final)
        _prune(out_dir, keep_last_n)
    fabric.barrier()
    return final


def committed_checkpoints(out_dir: Path) -> list[Path]:
    """Checkpoint folders with a commit marker, oldest first (files are verified when one is loaded)."""
    root = checkpoints_dir(out_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if (p / COMMIT).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def find_resume_checkpoint(out_dir: Path, resume: str) -> Path:
    """`resume`: 'auto' (the newest committed checkpoint in out_dir) or a checkpoint folder."""
    if resume == "auto":
        committed = committed_checkpoints(out_dir)
        if not committed:
            raise ConfigError(f"resume: auto found no committed checkpoint in '{checkpoints_dir(out_dir)}'")
        return committed[-1]
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"resume: '{resume}' is not a checkpoint folder")
    if not (path / COMMIT).is_file():
        raise CheckpointError(f"resume: '{path}' has no {COMMIT}: the save did not finish, so it is not used")
    return path


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Verify the commit marker against the files, then load them. Any mismatch is a CheckpointError."""
    try:
        commit = json.loads((path / COMMIT).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"'{path / COMMIT}' cannot be read: {err}") from None
    for name, meta in commit["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint '{path}' lacks {name}, which its {COMMIT} lists")
        size = file.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(f"'{file}' is truncated or altered: {size} bytes, {COMMIT} says {meta['bytes']}")
        if _sha256(file) != meta["sha256"]:
            raise CheckpointError(f"'{file}' is corrupt: its sha256 differs from the one in {COMMIT}")
    try:
        loaded = {
            name.split(".")[0]: torch.load(path / name, map_location="cpu", weights_only=False)
            for name in FILES if name.endswith(".pth") and (path / name).is_file()
        }
    except Exception as err:
        raise CheckpointError(f"checkpoint '{path}' cannot be loaded: {type(err).__name__}: {err}") from None
    loaded["sharded"] = path / SHARDED if (path / SHARDED).exists() else None
    loaded["config"] = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8"))
    loaded["commit"] = commit
    loaded["path"] = path
    return loaded


# ----------------------------------------------------------------------------------------------------------------------
# What may change between a run and its resumption
# ----------------------------------------------------------------------------------------------------------------------

# Changing these would make the resumed run a different run: refused.
_MUST_MATCH = (
    "model", "init", "method", "lora", "quantize", "precision", "data.path", "data.val_path", "data.val_split",
    "data.fields", "data.prompt_style", "data.max_seq_length", "data.mask_prompt", "data.packing", "data.pack_steps",
    "data.fit_steps", "train.global_batch_size", "train.micro_batch_size", "devices", "num_nodes", "strategy.name",
    "seed", "optimizer.class_path",
)
# What a field missing from an older checkpoint meant, where that is not its default now: data.pack_steps was added
# off (each micro-batch a fixed number of samples) and became the default later; before data.fit_steps the steps
# took the plain shuffled order.
_BEFORE_IT_EXISTED = {"data.pack_steps": False, "data.fit_steps": False, "num_nodes": 1}
# Changing these is allowed; the resumed run says which value wins.
_WARN = ("train.epochs", "train.max_steps", "train.warmup_steps", "train.lr_schedule", "train.min_lr_ratio",
         "train.max_grad_norm", "optimizer.init_args")


def _get(values: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        values = values.get(part) if isinstance(values, dict) else None
    return values


def resume_differences(saved: dict, recipe: Recipe) -> tuple[list[str], list[str]]:
    """(refusals, warnings) comparing the checkpoint's config with the recipe of the resuming run."""
    now = recipe_to_dict(recipe)
    defaults = recipe_to_dict(Recipe())
    if isinstance(saved.get("strategy"), str):  # a recipe from before the strategy section: its name alone
        saved = {**saved, "strategy": {"name": saved["strategy"]}}

    def then(key: str) -> Any:  # a field added after the checkpoint was written: the behaviour before it existed
        section, _, name = key.rpartition(".")
        holder = _get(saved, section) if section else saved
        if isinstance(holder, dict) and name not in holder:
            return _BEFORE_IT_EXISTED.get(key, _get(defaults, key))
        return _get(saved, key)

    refuse = [f"{key}: checkpoint {then(key)!r}, now {_get(now, key)!r}"
              for key in _MUST_MATCH if then(key) != _get(now, key)]
    warn = [f"{key}: checkpoint {then(key)!r}, now {_get(now, key)!r} (the new value is used)"
            for key in _WARN if then(key) != _get(now, key)]
    return refuse, warn


# ----------------------------------------------------------------------------------------------------------------------
# The final weights
# ----------------------------------------------------------------------------------------------------------------------


def save_final(fabric, recipe: Recipe, config, gpt: torch.nn.Module, out_dir: Path, model=None) -> None:
    """out_dir/final: lit_model.pth (full) or lit_model.pth.lora (adapter), with the files LitGPT's tools need; with
    recipe.merge, final/merged too. A folder left by an earlier run is removed, then the disk's free space checked;
    a failed save removes what it wrote: out_dir holds this run's final folder whole, or none. After a sharded run
    (``model``: the FSDP or DeepSpeed module) the weights are gathered into whole tensors on rank 0 first: the same
    files as after a one-device run."""
    final = out_dir / "final"
    is_lora = recipe.method in ("lora", "qlora")
    if model is not None:
        state = consolidated_state_dict(fabric, recipe, model)
    else:
        state = trainable_state_dict(gpt) if is_lora else gpt.state_dict()
    if fabric.global_rank == 0:
        base = merge_base(recipe)
        if is_lora and recipe.merge and base is None:
            fabric.print("merge: skipped, a random-init run has no base checkpoint on disk to merge into")
        with writing("the final weights", final):
            if final.exists():
                shutil.rmtree(final)
        check_free_space(out_dir, final_bytes(recipe, _tensor_bytes(state)), "the final weights")
        try:
            write_checkpoint_files(recipe, config, final)
            name = "lit_model.pth.lora" if is_lora else "lit_model.pth"
            torch_save_atomic(state, final / name, "the final weights")
            if base is not None:
                write_checkpoint_files(recipe, config, final / "merged")
                merge_lora_checkpoint(base, final / name, config, final / "merged" / "lit_model.pth")
        except BaseException:
            shutil.rmtree(final, ignore_errors=True)  # no weights without their files, no half of a merge
            raise
    fabric.barrier()


def consolidated_state_dict(fabric, recipe: Recipe, model) -> dict[str, torch.Tensor]:
    """The whole weights of a sharded model on rank 0, in LitGPT's names (every rank takes part in the gathering;
    the other ranks get an empty dict). FSDP: its full state dict, offloaded to the CPU; DeepSpeed ZeRO-3: its
    16-bit consolidation; ZeRO-2 keeps whole weights on every rank. LoRA: the adapters only."""
    module = getattr(model, "_forward_module", model)  # FSDP's or DeepSpeed's module in Fabric's wrapper
    if recipe.strategy.name == "fsdp":
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.state_dict_type(module, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            state = module.state_dict()
    elif recipe.strategy.deepspeed.stage == 3:
        state = module._zero3_consolidated_16bit_state_dict()
    else:
        state = module.module.state_dict() if hasattr(module, "module") else module.state_dict()
    if fabric.global_rank != 0 or state is None:
        return {}
    clean = {}
    for key, value in state.items():
        for wrapper in ("_forward_module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
            key = key.replace(wrapper, "")
        clean[key.removeprefix("gpt.")] = value
    if recipe.method in ("lora", "qlora"):
        clean = {k: v for k, v in clean.items() if "lora_" in k}
    return {k: v for k, v in clean.items() if k not in ("cos", "sin")}


def merge_base(recipe: Recipe) -> Path | None:
    """The base checkpoint a LoRA run's merge adds its adapters to; None without a merge, or for a random-init run
    (no base on disk)."""
    if recipe.method in ("lora", "qlora") and recipe.merge and recipe.init == "pretrained":
        return resolve_path(recipe.model.checkpoint_dir) / "lit_model.pth"
    return None


def final_bytes(recipe: Recipe, weights_bytes: int) -> int:
    """What out_dir/final takes on disk, given its weights' size: the weights, the merged weights (the base
    checkpoint's size), the tokenizer files in each folder, and 1 MiB for the small files."""
    base = merge_base(recipe)
    merged = base.stat().st_size if base is not None and base.is_file() else 0
    tokenizer = sum(path.stat().st_size for path in _tokenizer_files(recipe))
    return weights_bytes + merged + tokenizer * (2 if base is not None else 1) + (1 << 20)


def final_weights_bytes(recipe: Recipe, config) -> int:
    """final_bytes before the model is built, from its shapes alone (a model on the meta device: no memory, no
    weights read). The weights save_final writes: full fine-tuning every tensor of the model, LoRA and QLoRA the
    adapters only, at the bytes per parameter the precision stores (litft.precision)."""
    from litft.precision import Precision

    if recipe.method in ("lora", "qlora"):
        from litgpt.lora import GPT
    else:
        from litgpt.model import GPT
    with torch.device("meta"):
        model = GPT(config)
    state = model.state_dict()
    if recipe.method in ("lora", "qlora"):
        state = {k: v for k, v in state.items() if "lora_" in k}
    numel = sum(v.numel() for v in state.values())
    return final_bytes(recipe, numel * Precision(recipe.precision).param_bytes)


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """LoRA: the adapter tensors only (a few MB instead of the whole model)."""
    # keep_vars gives the Parameter objects themselves, so wrappers that rename (Fabric, checkpointing) don't matter
    return {k: v.detach() for k, v in model.state_dict(keep_vars=True).items() if getattr(v, "requires_grad", False)}


def _tokenizer_files(recipe: Recipe) -> list[Path]:
    """The tokenizer files the final folder carries, as found beside the model (or in model.tokenizer_dir)."""
    source = resolve_path(recipe.model.tokenizer_dir or recipe.model.checkpoint_dir)
    if source is None:
        return []
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json")
    return [source / name for name in names if (source / name).is_file()]


def write_checkpoint_files(recipe: Recipe, config, target: Path) -> None:
    """model_config.yaml, tokenizer files, and litgpt's hyperparameters.yaml (so `litgpt merge_lora` and
    `litgpt chat` accept the folder too)."""
    from litgpt.config import Config

    base = {k: v for k, v in dataclasses.asdict(config).items() if not k.startswith("lora_")}
    hparams = {
        # the base an adapter goes on: none on disk after a run from random weights
        "checkpoint_dir": (str(resolve_path(recipe.model.checkpoint_dir))
                           if recipe.model.checkpoint_dir and recipe.init == "pretrained" else None),
        "precision": recipe.precision,
        "quantize": f"bnb.{recipe.quantize}" if recipe.quantize else None,
        "prompt_style": recipe.data.prompt_style,
    }
    if recipe.method in ("lora", "qlora"):
        hparams.update(lora_kwargs(recipe))
    with writing("the model's config and tokenizer files", target):
        target.mkdir(parents=True, exist_ok=True)
        (target / "model_config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(Config(**base))))
        for path in _tokenizer_files(recipe):
            shutil.copy(path, target / path.name)
        (target / "hyperparameters.yaml").write_text(yaml.safe_dump(hparams))
        (target / "prompt_style.yaml").write_text(yaml.safe_dump({"class_path": _prompt_style_class(recipe)}))


def _prompt_style_class(recipe: Recipe) -> str:
    from litgpt.prompts import PromptStyle

    cls = type(PromptStyle.from_name(recipe.data.prompt_style))
    return f"{cls.__module__}.{cls.__name__}"


def merged_lora_model(base_checkpoint: Path, adapter_path: Path, config) -> torch.nn.Module:
    """LitGPT's LoRA GPT with the base weights and the adapter loaded (memory-mapped, on the CPU) and the adapter
    merged into them (base + (alpha/r) B A), in the base weights' dtype."""
    from litgpt.lora import GPT, merge_lora_weights

    from litft.model import read_state

    with torch.device("meta"):
        model = GPT(config)
    state = dict(read_state(base_checkpoint))
    state.update(read_state(adapter_path))
    missing = [k for k in model.load_state_dict(state, strict=False, assign=True).missing_keys if "lora_" not in k]
    if missing:
        raise CheckpointError(f"'{base_checkpoint}' lacks {len(missing)} weights of the model (e.g. {missing[0]})")
    dtype = next(iter(state.values())).dtype
    for module in model.modules():  # the adapters compute in the base dtype, as they are added to it
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dtype != dtype:
                setattr(module, name, torch.nn.Parameter(p.to(dtype), requires_grad=False))
    merge_lora_weights(model)
    return model


def merge_lora_checkpoint(base_checkpoint: Path, adapter_path: Path, config, out_path: Path) -> None:
    """Write base + (alpha/r) B A into plain weights: a checkpoint any LitGPT tool loads without LoRA code.

    Runs on the CPU in the base weights' dtype, one model in memory (memory-mapped base)."""
    from litgpt.lora import lora_filter

    model = merged_lora_model(base_checkpoint, adapter_path, config)
    merged = {k.replace("linear.", ""): v for k, v in model.state_dict().items() if not lora_filter(k, v)}
    merged = {k: v for k, v in merged.items() if k not in ("cos", "sin")}
    make_dir(out_path.parent, "the merged weights' folder")
    torch_save_atomic(merged, out_path, "the merged weights")