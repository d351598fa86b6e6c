"""The model a recipe trains: its LitGPT architecture, weights (pretrained or random), LoRA adapters and 4-bit base
weights, which parameters train; and CausalLM, the model with its training loss, as the loop runs it.

litft uses LitGPT's own modules (`litgpt.model.GPT`, `litgpt.lora.GPT`) and checkpoint format, so a litft run can be
loaded, merged and chatted with by LitGPT's tools, and the reverse. The layers litft swaps in for training are in
:mod:`litft.layers`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from litft import kernels
from litft.errors import CheckpointError, ConfigError
from litft.layers.attention import Packed
from litft.layers.loss import chunked_lm_loss
from litft.layers.norm import AddRMSNorm, rms_norm_weight
from litft.precision import Precision
from litft.recipe import Recipe, resolve_path


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
    return getattr(p, "ds_numel", p.numel())  # a DeepSpeed ZeRO-3 parameter holds only its partition


def build_model(fabric, recipe: Recipe, config, strategy: str = "single") -> torch.nn.Module:
    """Create the model on the device (in the precision's dtype), then load or keep random weights, then freeze.

    Pretrained weights: the modules are created empty (no wasted init) and filled from lit_model.pth.
    Random weights: the modules keep PyTorch's default init, which is enough to measure speed and memory.
    4-bit (qlora): Fabric's BitsandbytesPrecision swaps nn.Linear for bitsandbytes layers at creation and quantizes
    weights as they are created or loaded.
    FSDP: the modules are created on the meta device (no memory); FSDP materialises each block's shard on its GPU
    (each module's reset_parameters: random weights), and pretrained weights are loaded into the shards after
    (load_into_fsdp). DeepSpeed ZeRO-3: each weight is partitioned as it is created (deepspeed.zero.Init), and
    pretrained weights are copied in one module at a time (load_into_zero3).
    """
    if recipe.method in ("lora", "qlora"):
        from litgpt.lora import GPT, mark_only_lora_as_trainable
    else:
        from litgpt.model import GPT

        mark_only_lora_as_trainable = None

    pretrained = recipe.init == "pretrained"
    zero3 = strategy == "deepspeed" and recipe.strategy.deepspeed.stage == 3
    with fabric.init_module(empty_init=pretrained or strategy == "fsdp" or zero3):
        model = GPT(config)
    if pretrained and zero3:
        load_into_zero3(fabric, model, resolve_path(recipe.model.checkpoint_dir) / "lit_model.pth")
    elif pretrained and strategy != "fsdp":
        is_lora = mark_only_lora_as_trainable is not None
        load_weights(model, resolve_path(recipe.model.checkpoint_dir) / "lit_model.pth", lora=is_lora)
        if is_lora:
            # empty_init left the adapters as uninitialised memory and the base checkpoint has none:
            # A ~ kaiming-uniform, B = 0, so the adapted model starts exactly at the base model.
            init_adapters(model)
    if mark_only_lora_as_trainable is not None:
        mark_only_lora_as_trainable(model)
    return model


def load_into_fsdp(fabric, model, path: Path) -> None:
    """Pretrained weights into an FSDP-wrapped CausalLM (after fabric.setup_module): every rank reads the checkpoint
    memory-mapped and FSDP copies each rank's shard out of it. The adapters (LoRA) are not in it: they keep the
    initialisation FSDP gave them (A random, B zero)."""
    from lightning.fabric.strategies.model_parallel import _load_raw_module_state

    state = read_state(path)
    root = getattr(model, "_forward_module", model)  # the FSDP root inside Fabric's wrapper (.module is the inner one)
    _load_raw_module_state({f"gpt.{k}": v for k, v in state.items()}, module=root, world_size=fabric.world_size,
                           strict=False)


def load_into_zero3(fabric, model, path: Path) -> None:
    """Pretrained weights into a model partitioned by deepspeed.zero.Init: each module's weights are gathered, rank 0
    copies the checkpoint's values in, and DeepSpeed partitions them again (one module's weights whole at a time)."""
    import deepspeed

    state = read_state(path) if fabric.global_rank == 0 else {}
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if not params:
            continue
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0):
            if fabric.global_rank == 0:
                with torch.no_grad():
                    for pname, p in params.items():
                        key = f"{name}.{pname}" if name else pname
                        if key in state:
                            p.copy_(state[key])


def read_state(path: Path) -> dict:
    """A LitGPT state dict, memory-mapped on the CPU; CheckpointError naming the file when it cannot be read."""
    try:
        state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as err:  # a truncated or foreign file: name it and the reason
        raise CheckpointError(f"cannot read '{path}': {type(err).__name__}: {err}") from None
    return state.get("model", state)


def settle_4bit_compute_dtype(model: torch.nn.Module, precision: str) -> None:
    """Mark bitsandbytes 4-bit layers' compute dtype as settled when the inputs will be in that dtype anyway.

    Call it after fabric.setup_module: Fabric's BitsandbytesPrecision (convert_module, run by setup_module) sets each
    layer's compute_dtype and clears compute_type_is_set; the layer's first forward sets the flag (choosing the
    input's dtype, which under '-true' precision is that same dtype). The flag is an attribute the compiled block's
    guards read, so flipping it recompiles every block once, and a recompile while a CUDA graph is being captured
    makes the capture fail."""
    if not precision.endswith("-true"):
        return  # under autocast the inputs may be float32, and the layer should see them to choose
    dtype = Precision(precision).compute_dtype
    for module in model.modules():
        if getattr(module, "compute_type_is_set", True) is False and getattr(module, "compute_dtype", None) == dtype:
            module.compute_type_is_set = True


def init_adapters(model: torch.nn.Module) -> None:
    from litgpt.lora import LoRALinear

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.reset_parameters()  # touches lora_A and lora_B only


def load_weights(model: torch.nn.Module, path: Path, lora: bool) -> None:
    """Load a LitGPT state dict strictly, except that a LoRA model's adapters are not in a base checkpoint."""
    state = read_state(path)
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # torch lists every weight whose shape differs: the config describes another model
        mismatches = [line.strip().rstrip(".") for line in str(err).splitlines() if "size mismatch" in line]
        if not mismatches:
            raise
        raise CheckpointError(
            f"'{path}' does not match the model built from model_config.yaml: {len(mismatches)} weights differ in"
            f" shape (e.g. {mismatches[0]}); the model_config.yaml beside the weights (n_layer, n_embd, n_head,"
            " intermediate_size, ...) must describe them: take both from the same `litgpt download`"
        ) from None
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


def architecture_problems(recipe: Recipe, config) -> list[str]:
    """What keeps litft from training this architecture as the recipe asks, as 'key: what and what to do' lines:
    checked before the data is read or the model is built."""
    problems = []
    unsupported = fast_path_problems(config)
    if unsupported:  # litft's training forward repeats only what Llama-family models need from GPT.forward
        problems.append(f"model: {config.name} uses {', '.join(unsupported)}, which litft's training forward does not"
                        " implement; use a Llama-family model (TinyLlama, OpenLLaMA, Llama, ...)")
    if recipe.data.max_seq_length > config.block_size:  # the rotary tables cover block_size positions
        problems.append(f"data.max_seq_length: {recipe.data.max_seq_length} is above {config.name}'s block_size"
                        f" {config.block_size}, the positions its rotary embedding covers; use at most"
                        f" {config.block_size}")
    return problems


def fast_path_problems(config) -> list[str]:
    """Why litft's training forward cannot run this architecture (empty: it can). It calls LitGPT's own blocks but
    computes rotary tables and the loss itself, so features of GPT.forward it does not repeat are refused here."""
    unsupported = {
        "scale_embeddings": config.scale_embeddings,
        "final_logit_softcapping": config.final_logit_softcapping is not None,
        "attention_logit_softcapping": config.attention_logit_softcapping is not None,
        "sliding_window_size": config.sliding_window_size is not None,
        "rope_indices": getattr(config, "rope_indices", None) is not None,
        "latent_attention": bool(getattr(config, "latent_attention", None)),
    }
    return [name for name, present in unsupported.items() if present]


class CausalLM(torch.nn.Module):
    """A LitGPT GPT and its training loss as one module, so that Fabric's precision context and DDP wrap both.

    forward(...) returns the SUM of next-token losses over labelled positions (the loop divides by the step's loss
    tokens). Packed rows (positions + cu_seqlens) keep attention within each sample. The loss runs the output layer
    over `loss_chunk` positions at a time and recomputes each chunk's logits in the backward pass, so full
    (tokens x vocabulary) logits never exist at once, in 16 or 32 bits.
    """

    def __init__(self, gpt: torch.nn.Module, loss_chunk: int, max_seq_length: int, compiled: bool = False,
                 triton_kernels: bool = False, fused_residual_norms: bool = False) -> None:
        super().__init__()
        self.gpt = gpt
        self.loss_chunk = loss_chunk
        self.compiled = compiled
        """The blocks are torch.compile'd (:func:`compile_blocks`): hidden() then keeps them to one compiled graph."""
        self.triton_kernels = triton_kernels
        """The loss as litft.kernels' cross-entropy on CUDA (the plan's triton_loss): layers.loss.CrossEntropySum."""
        self.fused_residual_norms = fused_residual_norms
        """hidden() runs each block's residual adds and the norms after them as AddRMSNorm on CUDA (the plan's
        fused_residual_norms); else each block's forward."""
        # Flash attention's varlen kernel sizes its grid by this bound and leaves any position past it in a segment
        # unwritten (garbage that reaches the weight gradients as inf/nan through the zero-loss padding). It must
        # cover every segment of every batch: samples (at most max_seq_length) and a packed row's padding tail (under
        # the row-length multiple, at most GRAPH_MULTIPLE - 1 positions). One fixed value: a per-batch one would make
        # torch.compile recompile for each new length.
        from litft.data import GRAPH_MULTIPLE

        self.max_seq_length = max(max_seq_length, GRAPH_MULTIPLE)
        self.reducer = None
        """DDP: litft.train.reduce.GradientReducer, told of each block's input so it can average gradients as the
        backward pass finishes each block."""

    def hidden(self, input_ids, positions=None, packed: Packed | None = None) -> torch.Tensor:
        gpt = self.gpt
        x = gpt.transformer.wte(input_ids)
        if self.compiled:  # one compiled graph of the block for every micro-batch (each one more is a compile)
            if torch.is_grad_enabled() and not x.requires_grad:
                # LoRA/QLoRA: the embedding is frozen, so the first block's input would not require grad and the
                # others' would, and torch.compile guards on that: two graphs. Requiring it costs that block's input
                # gradient, ~0.3% of the step (the q/k/v weights' d x (d + 2 kv) per token, of ~4 x 1.1e9).
                x.requires_grad_(True)
        if positions is None:
            t = input_ids.size(1)
            cos, sin = gpt.cos[:t].unsqueeze(0), gpt.sin[:t].unsqueeze(0)
        else:
            cos, sin = gpt.cos[positions], gpt.sin[positions]  # (B, T, rope dims): each sample from position 0
        if self.compiled:
            # The row length is dynamic; left alone, a first batch as long as the hidden size (TinyLlama: a 2,048-
            # position micro-batch, n_embd 2,048) is given the hidden size's symbol ("duck sizing") and specialised
            # to it, and the next length compiles again (seen on the H100: 4 graphs where 1 does).
            for tensor in (x, cos, sin):
                torch._dynamo.maybe_mark_dynamic(tensor, 1)
        if self.fused_residual_norms and kernels.available(x):
            return self._hidden_fused(x, cos, sin, packed)
        for i, block in enumerate(gpt.transformer.h):
            if self.reducer is not None:
                self.reducer.block_started(i, x)
            x = block(x, cos, sin, packed)
        return gpt.transformer.ln_f(x)

    def _hidden_fused(self, x, cos, sin, packed: Packed | None) -> torch.Tensor:
        """LitGPT's Block.forward for sequential-residual blocks, x + attn(norm_1(x)) then + mlp(norm_2(.)), with
        each add fused into the norm that follows it (the next block's norm_1, or ln_f after the last block)."""
        blocks = self.gpt.transformer.h
        normed = blocks[0].norm_1(x)
        residual = x
        for i, block in enumerate(blocks):
            if self.reducer is not None:  # block i's first norm is in the add before: its gradient comes later
                self.reducer.block_started(i, normed)
            attention = block.attn(normed, cos, sin, packed)
            residual, normed = AddRMSNorm.apply(residual, attention, rms_norm_weight(block.norm_2), block.norm_2.eps)
            mlp = block.mlp(normed)
            following = blocks[i + 1].norm_1 if i + 1 < len(blocks) else self.gpt.transformer.ln_f
            residual, normed = AddRMSNorm.apply(residual, mlp, rms_norm_weight(following), following.eps)
        return normed

    def forward(self, input_ids, labels, positions=None, cu_seqlens=None):
        seeds = getattr(self.gpt, "lora_seeds", None)
        if seeds is not None:  # one dropout seed for this pass's FusedLoRA layers (on CUDA, in training)
            seeds.tensor = None
            if self.triton_kernels and torch.is_grad_enabled() and kernels.available(input_ids):
                seeds.draw(input_ids.device)
        packed = Packed(cu_seqlens, self.max_seq_length) if cu_seqlens is not None else None
        hidden = self.hidden(input_ids, positions, packed)
        return chunked_lm_loss(self.gpt.lm_head, hidden, labels, self.loss_chunk, self.triton_kernels)


def compile_blocks(gpt: torch.nn.Module, backend: str = "inductor") -> None:
    """Regional compilation: each transformer block is compiled (one graph, reused by all blocks since they share
    code), which compiles in seconds rather than minutes and keeps the loop and the loss in eager Python. Build the
    CausalLM with compiled=True, so its inputs keep to that one graph. ``backend``: torch.compile's (tests use
    'aot_eager': the same graphs and guards without generating kernels)."""
    from torch._inductor import config as inductor_config

    options = {}
    if backend == "inductor" and hasattr(inductor_config.triton, "mix_order_reduction"):
        # Inductor's mix-order reduction (a row reduction fused with a column reduction of the same tensor: the
        # RMSNorm weight's gradient) decides by the row count, and guards on it: a full fine-tune compiled 3 graphs
        # of the block (rows >= 4,096, 2,560-4,095, fewer) and recompiled while CUDA graphs captured its other row
        # widths (seen on an H100). Off, the block keeps to one graph.
        options["options"] = {"triton.mix_order_reduction": False}
    for block in gpt.transformer.h:
        block.compile(dynamic=True, backend=backend, **options)
