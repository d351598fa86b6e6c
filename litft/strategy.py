"""Lightning Fabric from a recipe: accelerator, devices, strategy and precision (or the 4-bit plugin for QLoRA)."""

from __future__ import annotations

import torch

from litft.errors import ConfigError
from litft.precision import Precision
from litft.recipe import Recipe

# Set by the `litft` command line: child processes of a multi-device run can then be started by re-running the same
# command (Fabric's "ddp"). From Python or a notebook, Fabric has to spawn them instead ("ddp_spawn").
LAUNCHED_FROM_CLI = False


def resolve_accelerator(recipe: Recipe) -> str:
    if recipe.accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if recipe.accelerator == "cuda" and not torch.cuda.is_available():
        raise ConfigError("accelerator: cuda was asked for, but torch sees no CUDA GPU (set accelerator: cpu or auto)")
    return recipe.accelerator


def build_fabric(recipe: Recipe, loggers=None):
    import lightning as L

    accelerator = resolve_accelerator(recipe)
    problems = []
    if accelerator == "cpu" and recipe.precision in ("16-mixed", "16-true"):
        problems.append(f"precision: {recipe.precision} needs a GPU; on the CPU use 32-true, bf16-mixed or bf16-true")
    if accelerator == "cpu" and recipe.method == "qlora":
        problems.append("method: qlora needs a CUDA GPU (Fabric's BitsandbytesPrecision refuses the CPU)")
    if accelerator == "cuda" and recipe.devices > torch.cuda.device_count():
        problems.append(f"devices: {recipe.devices} asked for, {torch.cuda.device_count()} CUDA GPU(s) visible")
    if problems:
        raise ConfigError(problems)

    precision, plugins = recipe.precision, None
    if recipe.method == "qlora":
        from lightning.fabric.plugins import BitsandbytesPrecision

        plugins = BitsandbytesPrecision(mode=recipe.quantize, dtype=Precision(recipe.precision).compute_dtype)
        precision = None

    if recipe.devices == 1:
        strategy = "auto"
    elif recipe.strategy in ("auto", "ddp"):
        strategy = "ddp" if LAUNCHED_FROM_CLI else "ddp_spawn"
    else:
        strategy = recipe.strategy
    if accelerator == "cuda":
        # 32-true matmuls on TensorFloat-32 units (10-bit mantissa inputs, fp32 accumulate); MFU then uses TF32 peak.
        torch.set_float32_matmul_precision("high")
    return L.Fabric(
        accelerator=accelerator,
        devices=recipe.devices,
        strategy=strategy,
        precision=precision,
        plugins=plugins,
        loggers=loggers,
    )
