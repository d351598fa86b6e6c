"""Lightning Fabric from a recipe: accelerator, devices and nodes, strategy and precision (or the 4-bit plugin for
QLoRA).

Strategies: one device; DDP as :class:`ReducingDDPStrategy` (processes and the process group from Fabric, the
gradient averaging from litft.train.reduce); FSDP and DeepSpeed as Lightning configures them, from the recipe's
strategy section. Several nodes: Fabric reads torchrun's and SLURM's environment variables itself
(docs/multi-gpu.md)."""

from __future__ import annotations

import torch
from lightning.fabric.strategies import DDPStrategy

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
    if accelerator == "cuda" and recipe.precision.startswith("bf16") and not torch.cuda.is_bf16_supported(
            including_emulation=False):
        name = torch.cuda.get_device_name(0)
        problems.append(f"precision: {recipe.precision} needs a GPU with bfloat16 (compute capability 8.0+: A100,"
                        f" H100), and {name} has none; use 16-mixed (float16 with a loss scaler) or 32-true")
    if recipe.strategy.sharded and accelerator == "cpu":
        problems.append(f"strategy: {recipe.strategy.name} needs CUDA GPUs and this machine has none (Lightning's FSDP"
                        " and DeepSpeed strategies refuse the CPU); on the CPU use strategy ddp")
    if recipe.strategy.name == "deepspeed":
        try:
            import deepspeed  # noqa: F401
        except ImportError as err:
            problems.append(f"strategy: deepspeed needs the deepspeed package, which does not import here ({err});"
                            " pip install 'litft[deepspeed]'")
    if problems:
        raise ConfigError(problems)

    precision, plugins = recipe.precision, None
    if recipe.method == "qlora":
        from lightning.fabric.plugins import BitsandbytesPrecision

        plugins = BitsandbytesPrecision(mode=recipe.quantize, dtype=Precision(recipe.precision).compute_dtype)
        precision = None

    strategy = _strategy(recipe)
    if accelerator == "cuda":
        # 32-true matmuls on TensorFloat-32 units (10-bit mantissa inputs, fp32 accumulate); MFU then uses TF32 peak.
        torch.set_float32_matmul_precision("high")
    return L.Fabric(
        accelerator=accelerator,
        devices=recipe.devices,
        num_nodes=recipe.num_nodes,
        strategy=strategy,
        precision=precision,
        plugins=plugins,
        loggers=loggers,
    )


def _strategy(recipe: Recipe):
    """The Fabric strategy of the recipe: 'auto' for one device, else a configured strategy object."""
    name = recipe.strategy.name
    if recipe.world_size == 1 and name in ("auto", "ddp"):
        return "auto"
    if name in ("auto", "ddp"):
        return ReducingDDPStrategy(start_method="popen" if LAUNCHED_FROM_CLI else "spawn")
    if name == "fsdp":
        from lightning.fabric.strategies import FSDPStrategy
        from litgpt.model import Block

        f = recipe.strategy.fsdp
        return FSDPStrategy(
            auto_wrap_policy={Block},  # one FSDP unit per transformer block: gathered, used and freed in turn
            activation_checkpointing_policy={Block} if recipe.train.activation_checkpointing else None,
            sharding_strategy=f.sharding,
            cpu_offload=f.cpu_offload,
            state_dict_type=f.checkpoint,
            use_orig_params=True,  # LoRA: frozen and trainable weights share a unit; optimizer state per parameter
            limit_all_gathers=True,
        )
    from lightning.fabric.strategies import DeepSpeedStrategy

    d = recipe.strategy.deepspeed
    strategy = DeepSpeedStrategy(stage=d.stage, offload_optimizer=d.offload_optimizer,
                                 offload_parameters=d.offload_parameters, pin_memory=True)
    if recipe.train.max_grad_norm is not None:  # DeepSpeed clips inside its step (Fabric's clip_gradients refuses)
        strategy.config["gradient_clipping"] = recipe.train.max_grad_norm
    return strategy


class ReducingDDPStrategy(DDPStrategy):
    """Fabric's DDP (processes, process group, collectives) without torch's DDP wrapper: the module is moved to its
    device and returned as it is, and litft.train.reduce averages the gradients once per step. Why: the wrapper's
    autograd hooks cannot run inside CUDA graphs, never see gradients that the matmul writes into .grad itself, and
    keep a second copy of every gradient in their buckets."""

    def setup_module(self, module):
        return module
