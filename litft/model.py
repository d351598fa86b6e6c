"""Build the LitGPT model a recipe asks for: its architecture, weights (pretrained or random), LoRA adapters,
4-bit base weights, which parameters train; plus the loss, and saving/merging of the final weights.

litft uses LitGPT's own modules (`litgpt.model.GPT`, `litgpt.lora.GPT`) and checkpoint format, so a litft run can be
loaded, merged and chatted with by LitGPT's tools, and the reverse.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from litft.errors import CheckpointError, ConfigError
from litft.recipe import Recipe, resolve_path

IGNORE_INDEX = -100

# recipe target name -> litgpt.lora.Config flag
_LORA_FLAGS = {
    "q": "lora_query",
    "k": "lora_key",
    "v": "lora_value",
    "o": "lora_projection",
    "mlp": "lora_mlp",
    "head": "lora_head",
}


def lora_kwargs(recipe: Recipe) -> dict:
    """The litgpt.lora.Config fields of the recipe's adapters (the names litgpt's hyperparameters.yaml uses)."""
    lo = recipe.lora
    flags = {flag: target in lo.targets for target, flag in _LORA_FLAGS.items()}
    return {"lora_r": lo.r, "lora_alpha": lo.alpha, "lora_dropout": lo.dropout, **flags}


def model_config(recipe: Recipe):
    """The litgpt Config: from the checkpoint's model_config.yaml when there is one, else by name.

    LoRA methods get a litgpt.lora.Config carrying the adapter shape."""
    from litgpt.config import Config
    from litgpt.lora import Config as LoRAConfig

    cls = LoRAConfig if recipe.method in ("lora", "qlora") else Config
    extra = lora_kwargs(recipe) if cls is LoRAConfig else {}
    ckpt = resolve_path(recipe.model.checkpoint_dir)
    if ckpt is not None and (ckpt / "model_config.yaml").is_file():
        config = cls.from_file(ckpt / "model_config.yaml", **extra)
        name = recipe.model.name
        if name is not None and name != config.name:
            # A name that disagrees with the checkpoint would make `init: random` measure a different model than
            # the one the recipe claims; refuse rather than guess.
            reference = Config.from_name(name)
            ours = {k: v for k, v in dataclasses.asdict(config).items() if not k.startswith("lora_")}
            differ = [k for k, v in dataclasses.asdict(reference).items() if k in ours and ours[k] != v]
            if any(k in differ for k in ("n_layer", "n_embd", "n_head", "n_query_groups", "intermediate_size")):
                raise ConfigError(
                    f"model.name: '{name}' differs from the checkpoint's model_config.yaml ('{config.name}') in"
                    f" {', '.join(differ[:6])}; remove model.name or fix model.checkpoint_dir"
                )
        return config
    if recipe.model.name is None:
        raise ConfigError("model.name: needed when model.checkpoint_dir holds no model_config.yaml")
    return cls.from_name(recipe.model.name, **extra)


@dataclass
class ParameterCounts:
    """Parameters by role. `matmul_*` exclude the input embedding (a lookup, no multiply-adds), and feed MFU."""

    trainable: int
    frozen: int
    matmul_trainable: int
    matmul_frozen: int

    @property
    def total(self) -> int:
        return self.trainable + self.frozen


def count_parameters(model: torch.nn.Module) -> ParameterCounts:
    counts = dict(trainable=0, frozen=0, matmul_trainable=0, matmul_frozen=0)
    for name, p in model.named_parameters():
        n = _logical_numel(p)
        role = "trainable" if p.requires_grad else "frozen"
        counts[role] += n
        if not name.endswith("wte.weight"):
            counts[f"matmul_{role}"] += n
    return ParameterCounts(**counts)


def _logical_numel(p: torch.Tensor) -> int:
    """Elements a parameter stands for: a 4-bit bitsandbytes weight packs two values per uint8 byte."""
    quant_state = getattr(p, "quant_state", None)
    if quant_state is not None and getattr(quant_state, "shape", None) is not None:
        return int(torch.Size(quant_state.shape).numel())
    return p.numel()


def build_model(fabric, recipe: Recipe, config) -> torch.nn.Module:
    """Create the model on the device (in the precision's dtype), then load or keep random weights, then freeze.

    Pretrained weights: the modules are created empty (no wasted init) and filled from lit_model.pth.
    Random weights: the modules keep PyTorch's default init, which is enough to measure speed and memory.
    4-bit (qlora): Fabric's BitsandbytesPrecision swaps nn.Linear for bitsandbytes layers at creation and quantizes
    weights as they are created or loaded.
    """
    if recipe.method in ("lora", "qlora"):
        from litgpt.lora import GPT, mark_only_lora_as_trainable
    else:
        from litgpt.model import GPT

        mark_only_lora_as_trainable = None

    pretrained = recipe.init == "pretrained"
    with fabric.init_module(empty_init=pretrained):
        model = GPT(config)
    if pretrained:
        is_lora = mark_only_lora_as_trainable is not None
        load_weights(model, resolve_path(recipe.model.checkpoint_dir) / "lit_model.pth", lora=is_lora)
        if is_lora:
            # empty_init left the adapters as uninitialised memory and the base checkpoint has none:
            # A ~ kaiming-uniform, B = 0, so the adapted model starts exactly at the base model.
            init_adapters(model)
    if mark_only_lora_as_trainable is not None:
        mark_only_lora_as_trainable(model)
    return model


def init_adapters(model: torch.nn.Module) -> None:
    from litgpt.lora import LoRALinear

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.reset_parameters()  # touches lora_A and lora_B only


def load_weights(model: torch.nn.Module, path: Path, lora: bool) -> None:
    """Load a LitGPT state dict strictly, except that a LoRA model's adapters are not in a base checkpoint."""
    try:
        state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as err:  # a truncated or foreign file: name it and the reason
        raise CheckpointError(f"cannot read '{path}': {type(err).__name__}: {err}") from None
    state = state.get("model", state)
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (lora and "lora_" in k)]
    if missing or result.unexpected_keys:
        details = []
        if missing:
            details.append(f"missing {len(missing)} keys (e.g. {', '.join(missing[:3])})")
        if result.unexpected_keys:
            details.append(f"unexpected {len(result.unexpected_keys)} keys (e.g. {', '.join(result.unexpected_keys[:3])})")
        raise CheckpointError(
            f"'{path}' does not match the model built from model_config.yaml: {'; '.join(details)}"
        )


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each transformer block in the backward pass (torch's own checkpoint wrapper, non-reentrant)."""
    from litgpt.model import Block
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as _apply,
    )

    _apply(model, check_fn=lambda module: isinstance(module, Block))


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over positions whose label is not IGNORE_INDEX.

    The loop divides by the optimizer step's total loss tokens, so every loss token weighs the same whatever the
    micro-batch / accumulation / device split (micro 8 x accum 1 and micro 2 x accum 4 give the same gradient).
    Logits are upcast to fp32 for the log-softmax; labels are already shifted (label t is the token after input t).
    """
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


# ----------------------------------------------------------------------------------------------------------------------
# Final weights
# ----------------------------------------------------------------------------------------------------------------------


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """LoRA: the adapter tensors only (a few MB instead of the whole model)."""
    # keep_vars gives the Parameter objects themselves, so wrappers that rename (Fabric, checkpointing) don't matter
    return {k: v.detach() for k, v in model.state_dict(keep_vars=True).items() if getattr(v, "requires_grad", False)}


def write_checkpoint_files(recipe: Recipe, config, target: Path) -> None:
    """model_config.yaml, tokenizer files, and litgpt's hyperparameters.yaml (so `litgpt merge_lora` and
    `litgpt chat` accept the folder too)."""
    import shutil

    from litgpt.config import Config

    target.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in dataclasses.asdict(config).items() if not k.startswith("lora_")}
    (target / "model_config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(Config(**base))))
    source = resolve_path(recipe.model.tokenizer_dir or recipe.model.checkpoint_dir)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json"):
        if source is not None and (source / name).is_file():
            shutil.copy(source / name, target / name)
    hparams = {
        "checkpoint_dir": str(resolve_path(recipe.model.checkpoint_dir)) if recipe.model.checkpoint_dir else None,
        "precision": recipe.precision,
        "quantize": f"bnb.{recipe.quantize}" if recipe.quantize else None,
        "prompt_style": recipe.data.prompt_style,
    }
    if recipe.method in ("lora", "qlora"):
        hparams.update(lora_kwargs(recipe))
    (target / "hyperparameters.yaml").write_text(yaml.safe_dump(hparams))
    (target / "prompt_style.yaml").write_text(yaml.safe_dump({"class_path": _prompt_style_class(recipe)}))


def _prompt_style_class(recipe: Recipe) -> str:
    from litgpt.prompts import PromptStyle

    cls = type(PromptStyle.from_name(recipe.data.prompt_style))
    return f"{cls.__module__}.{cls.__name__}"


def merge_lora_checkpoint(base_checkpoint: Path, adapter_path: Path, config, out_path: Path) -> None:
    """Write base + (alpha/r) B A into plain weights: a checkpoint any LitGPT tool loads without LoRA code.

    Runs on the CPU in the base weights' dtype, one model in memory (memory-mapped base)."""
    from litgpt.lora import GPT, lora_filter, merge_lora_weights

    with torch.device("meta"):
        model = GPT(config)
    state = torch.load(base_checkpoint, mmap=True, weights_only=True, map_location="cpu")
    adapter = torch.load(adapter_path, mmap=True, weights_only=True, map_location="cpu")
    state = dict(state.get("model", state))
    state.update(adapter)
    model.load_state_dict(state, strict=False, assign=True)
    dtype = next(iter(state.values())).dtype
    for module in model.modules():  # the adapters compute in the base dtype, as they are added to it
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dtype != dtype:
                setattr(module, name, torch.nn.Parameter(p.to(dtype), requires_grad=False))
    merge_lora_weights(model)
    merged = {k.replace("linear.", ""): v for k, v in model.state_dict().items() if not lora_filter(k, v)}
    merged = {k: v for k, v in merged.items() if k not in ("cos", "sin")}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(merged, out_path)
