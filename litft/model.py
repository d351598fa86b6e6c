"""Build the LitGPT model a recipe asks for: its architecture, weights (pretrained or random), LoRA adapters,
4-bit base weights, which parameters train; plus the loss, and saving/merging of the final weights.

litft uses LitGPT's own modules (`litgpt.model.GPT`, `litgpt.lora.GPT`) and checkpoint format, so a litft run can be
loaded, merged and chatted with by LitGPT's tools, and the reverse.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from litft import kernels
from litft.kernels import varlen_attention
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


def settle_4bit_compute_dtype(model: torch.nn.Module, precision: str) -> None:
    """Mark bitsandbytes 4-bit layers' compute dtype as settled when the inputs will be in that dtype anyway.

    Call it after fabric.setup_module: Fabric's BitsandbytesPrecision (convert_module, run by setup_module) sets each
    layer's compute_dtype and clears compute_type_is_set; the layer's first forward sets the flag (choosing the
    input's dtype, which under '-true' precision is that same dtype). The flag is an attribute the compiled block's
    guards read, so flipping it recompiles every block once, and a recompile while a CUDA graph is being captured
    makes the capture fail."""
    if not precision.endswith("-true"):
        return  # under autocast the inputs may be float32, and the layer should see them to choose
    dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "32-true": torch.float32}.get(precision)
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


# ----------------------------------------------------------------------------------------------------------------------
# The training forward: LitGPT's blocks, packed attention, a chunked loss
# ----------------------------------------------------------------------------------------------------------------------


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


@dataclass
class Packed:
    """Passed through LitGPT's Block as its `mask` argument: the sample boundaries of a packed row."""

    cu_seqlens: torch.Tensor
    max_length: int


def _varlen_signature() -> tuple[dict | None, bool]:
    """torch's flash-attention varlen op, if this torch has it: its causal keyword (2.10 takes is_causal, later
    versions window_size), and whether it takes grouped k/v heads (enable_gqa; without it, k and v are repeated)."""
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    params = inspect.signature(varlen_attn).parameters
    gqa = "enable_gqa" in params
    if "window_size" in params:
        return {"window_size": (-1, 0)}, gqa
    if "is_causal" in params:
        return {"is_causal": True}, gqa
    return None, False


_VARLEN_KWARGS, _VARLEN_GQA = _varlen_signature()
VARLEN_DEVICES = ("cuda",)  # where packed rows use torch's varlen op (tests add "cpu" with reference kernels)


class GroupedFlashAttention(torch.autograd.Function):
    """Causal flash attention within each cu_seqlens segment of q (N, heads, head_size) over k, v (N, groups,
    head_size) with grouped heads: torch's flash-attention ops (aten._flash_attention_forward / _backward) called as
    torch.nn.attention.varlen calls them, k and v passed at their groups. For a torch whose varlen_attn does not take
    enable_gqa (2.11): there k and v would be repeated to every head first, a copy of each in the forward pass and a
    sum in the backward (TinyLlama: 2 x 8 times the k/v bytes per layer and pass), and the repeated copies kept for
    the backward pass. Flash attention reads each group for its heads' queries itself."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_length: int, scale: float):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng_state, unused)
        ctx.max_length, ctx.scale = max_length, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_seqlens, rng_state, unused = ctx.saved_tensors
        grad_q, grad_k, grad_v = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, ctx.max_length, ctx.max_length, 0.0,
            True, rng_state, unused, scale=ctx.scale)
        return grad_q, grad_k, grad_v, None, None, None


# Packed rows' attention runs litft.varlen_attention's Triton kernels (train.triton_kernels, eager, CUDA) where they
# were measured faster than flash attention's varlen ops: head size 64 with grouped k/v heads (TinyLlama: 32 heads
# over 4 groups). In benchmarks/attention_bench.py (results/attention-s21; rows of 4,096 positions, ~13.5 samples,
# forward + backward kernel time per row on the H100): flash attention (GroupedFlashAttention) 315 us, Triton 162 us.
# Other shapes (OpenLLaMA's 32 or 40 heads of 100 or 128, no groups) keep flash attention: not measured.
TRITON_ATTENTION_HEAD_SIZES = (64,)


def triton_attention_fits(head_size: int, heads: int, groups: int, attention_kernel: str = "auto") -> bool:
    """Whether train.attention_kernel picks litft.varlen_attention's kernels for attention of this shape: auto, where
    they were measured faster (grouped k/v heads of a size in TRITON_ATTENTION_HEAD_SIZES); triton, wherever they
    take it (varlen_attention.supports); flash, nowhere."""
    if attention_kernel == "auto":
        return head_size in TRITON_ATTENTION_HEAD_SIZES and groups < heads
    return attention_kernel == "triton" and varlen_attention.supports(heads, groups, head_size)


def triton_attention_applies(q: torch.Tensor, k: torch.Tensor, attention_kernel: str = "auto") -> bool:
    """Whether packed attention of q (1, N, heads, D) over k (1, N, groups, D) runs litft.varlen_attention's
    kernels: on CUDA (kernels.available), in 16 bits, one packed row, of a shape :func:`triton_attention_fits`."""
    return (kernels.available(q) and q.dtype in (torch.bfloat16, torch.float16) and q.shape[0] == 1
            and triton_attention_fits(q.shape[-1], q.shape[-2], k.shape[-2], attention_kernel))


def packed_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
    """CausalSelfAttention.scaled_dot_product_attention, plus packed rows: when `mask` is a Packed, each sample
    attends only to itself. q, k, v: (1, heads, N, head_size), k and v already repeated to all heads by LitGPT.
    Returns (1, N, heads, head_size), as LitGPT's method does."""
    if not isinstance(mask, Packed):
        return type(self).scaled_dot_product_attention(self, q, k, v, mask)
    return causal_attention(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)


def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Packed | None) -> torch.Tensor:
    """Causal attention of q (B, T, heads, head_size) over k, v (B, T, kv heads, head_size), within each sample of
    a packed row when `mask` is a Packed (B = 1). Grouped k and v heads go to the kernels as they are (flash attention
    and SDPA's enable_gqa read each group for its queries). Returns (B, T, heads, head_size)."""
    scale = 1.0 / math.sqrt(self.config.attention_scores_scalar or self.config.head_size) * self.mscale**2
    b, t, heads, head_size = q.shape
    if (isinstance(mask, Packed) and getattr(self, "triton_kernels", False)
            and triton_attention_applies(q, k, getattr(self, "attention_kernel", "auto"))):
        # (1, N, H, D) -> (N, H, D): views, as for the varlen op below
        q_, k_, v_ = (x.reshape(t, x.shape[2], head_size) for x in (q, k, v))
        y = varlen_attention.VarlenGQAAttention.apply(q_, k_, v_, mask.cu_seqlens, mask.max_length, scale)
        return y.view(b, t, heads, head_size)
    if isinstance(mask, Packed) and q.device.type in VARLEN_DEVICES and _VARLEN_KWARGS is not None:
        from torch.nn.attention.varlen import varlen_attn

        # (1, N, H, D) -> (N, H, D): views; flash attention needs only the last dimension contiguous
        q_, k_, v_ = (x.reshape(t, x.shape[2], head_size) for x in (q, k, v))
        cu = mask.cu_seqlens
        gqa = {}
        if k_.shape[1] != heads:
            if _VARLEN_GQA:
                gqa = {"enable_gqa": True}
            elif not torch.compiler.is_compiling():
                y = GroupedFlashAttention.apply(q_, k_, v_, cu, mask.max_length, scale)
                return y.view(b, t, heads, head_size)
            else:  # this torch's varlen op wants every head, and dynamo traces only it: repeat, as LitGPT does
                k_, v_ = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k_, v_))
        y = varlen_attn(q_, k_, v_, cu, cu, mask.max_length, mask.max_length, scale=scale, **_VARLEN_KWARGS, **gqa)
        return y.view(b, t, heads, head_size)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, T, D), as SDPA takes them
    gqa = k.shape[1] != heads
    if isinstance(mask, Packed):  # elsewhere (CPU): a block-diagonal causal mask over the row; exact, O(N^2) memory
        segment = torch.searchsorted(mask.cu_seqlens[1:].long(), torch.arange(t, device=q.device), right=True)
        allowed = (segment[:, None] == segment[None, :]) & torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    else:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return y.transpose(1, 2)


class RotaryEmbedding(torch.autograd.Function):
    """LitGPT's apply_rope, x cos + rotate_half(x) sin with rotate_half(x) = (-x2, x1), keeping only the tables for the
    backward pass, in 3 torch kernels each way: rotate_half(x) sin = roll(x) s' with roll(x) = (x2, x1) (x rolled by
    half the head) and s' = (-sin1, sin2), so the forward is one multiply and one addcmul. The map is linear in x and
    its transpose is the same with -s', so the backward is too. LitGPT's version runs ~6 kernels each way per tensor
    (a negation, two concatenations, two multiplies, an add). With Triton kernels, :class:`RopeQKV` instead."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        signed_sin = _signed_sin(sin)
        ctx.save_for_backward(cos, signed_sin)
        return _rope_by_roll(x, cos, signed_sin).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, signed_sin = ctx.saved_tensors
        return _rope_by_roll(grad, cos, signed_sin, transpose=True).to(grad.dtype), None, None


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """s' = (-sin1, sin2) over the last dimension's halves: rotate_half(x) sin = roll(x) s'."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rope_by_roll(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, transpose: bool = False,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x cos + roll(x) s' (RoPE), or with ``transpose`` x cos - roll(x) s' (its transpose: the backward pass), in 3
    torch kernels; into ``out`` when given."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin, value=-1 if transpose else 1,
                         out=out)


class RopeQKV(torch.autograd.Function):
    """The qkv output (B, T, (heads + 2 groups) x head_size) split into q (B, T, heads, head_size), k and v (B, T,
    groups, head_size), RoPE applied to q and k; on CUDA in one Triton kernel each way (kernels.rope_qkv), elsewhere
    with :class:`RotaryEmbedding`'s torch ops. The backward pass writes the q, k and v gradients straight into one qkv
    gradient, and v leaves as its own tensor, so the attention kernel's saved v does not keep the whole qkv output
    alive. Through autograd, splitting the qkv output and roping q and k puts the gradients back with two
    concatenations (of q with k, then of both with v): two more reads and writes of the whole qkv gradient, 2 x 22 per
    pass in TinyLlama; and v, a view, keeps the qkv output (TinyLlama: 2,560 values per token and block for v's 256)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, groups: int):
        b, t, width = qkv.shape
        head_size = width // (heads + 2 * groups)
        q, k, v = qkv.view(b, t, heads + 2 * groups, head_size).split((heads, groups, groups), dim=2)
        ctx.groups, ctx.fused = groups, kernels.available(qkv)
        if ctx.fused:
            ctx.save_for_backward(cos, sin)
            return kernels.rope_qkv(q, k, v, cos, sin)
        cos, signed_sin = cos.unsqueeze(2), _signed_sin(sin).unsqueeze(2)
        ctx.save_for_backward(cos, signed_sin)
        q, k = (_rope_by_roll(x, cos, signed_sin).to(x.dtype) for x in (q, k))
        return q, k, v.contiguous()

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor):
        b, t, heads, head_size = grad_q.shape
        grad_qkv = torch.empty(b, t, heads + 2 * ctx.groups, head_size, dtype=grad_q.dtype, device=grad_q.device)
        parts = grad_qkv.split((heads, ctx.groups, ctx.groups), dim=2)
        if ctx.fused:
            cos, sin = ctx.saved_tensors
            kernels.rope_qkv(grad_q, grad_k, grad_v, cos, sin, transpose=True, out=parts)
        else:
            cos, signed_sin = ctx.saved_tensors
            for grad, part in zip((grad_q, grad_k), parts):
                _rope_by_roll(grad, cos, signed_sin, transpose=True, out=part)
            parts[2].copy_(grad_v)
        return grad_qkv.view(b, t, -1), None, None, None, None


def attention_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None, input_pos=None,
                      input_pos_maxp1=None) -> torch.Tensor:
    """CausalSelfAttention.forward for training Llama-style attention (train.fast_attention): RoPE on q and k
    together as one RotaryEmbedding (q and k are adjacent columns of the qkv output), or with Triton kernels
    (train.triton_kernels, eager) q, k and v out of the qkv output in one :class:`RopeQKV`; k, v left at their
    n_query_groups heads for the kernel, where LitGPT's forward ropes q and k separately, concatenates each with its
    (empty) unroped part and repeats k and v to all heads (TinyLlama: 4 groups copied to 32 heads, each way).
    With a KV cache (generation) it is LitGPT's own forward."""
    if input_pos is not None:
        return type(self).forward(self, x, cos, sin, mask, input_pos, input_pos_maxp1)
    b, t, _ = x.shape
    heads, groups, head_size = self.config.n_head, self.config.n_query_groups, self.config.head_size
    qkv = self.qkv(x)
    if self.triton_kernels and not torch.compiler.is_compiling():
        q, k, v = RopeQKV.apply(qkv, cos, sin, heads, groups)
    else:
        qk, v = qkv.split(((heads + groups) * head_size, groups * head_size), dim=-1)
        qk = RotaryEmbedding.apply(qk.view(b, t, heads + groups, head_size), cos.unsqueeze(2), sin.unsqueeze(2))
        q, k = qk.split((heads, groups), dim=2)  # split (not slicing): its backward is one concatenation
        v = v.view(b, t, groups, head_size)
    y = causal_attention(self, q, k, v, mask)
    return self.proj(y.reshape(b, t, heads * head_size))


class SwiGLU(torch.autograd.Function):
    """LLaMAMLP's silu(a) * b (a = fc_1(x), b = fc_2(x)) keeping a and b for the backward pass and recomputing silu(a)
    there, where autograd keeps silu(a) as well: one tensor of intermediate_size per token less (TinyLlama: 11,264
    bytes per token and block in bf16; 1 GiB for 22 blocks at 4,096 positions), for one more elementwise pass in
    the backward pass. With ``fused`` (train.triton_kernels) on a CUDA tensor in eager mode: one Triton kernel each
    way (kernels.swiglu_forward/backward), where torch runs 2 forward and 4 backward."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, fused: bool = False) -> torch.Tensor:
        ctx.fused = fused and kernels.available(a)
        ctx.save_for_backward(a, b)
        return kernels.swiglu_forward(a, b) if ctx.fused else F.silu(a) * b

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        if ctx.fused:
            return *kernels.swiglu_backward(grad, a, b), None
        return torch.ops.aten.silu_backward(grad * b, a), grad * F.silu(a), None


def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """LLaMAMLP.forward with SwiGLU's silu recomputed in the backward pass (train.lean_swiglu), in Triton kernels on
    CUDA with train.triton_kernels. A LoRA MLP whose three layers would each run as FusedLoRA runs as one
    FusedLoRAMLP (the adapters inside the SwiGLU's kernels). Otherwise LoRA fc_1 and fc_2 that would each run as
    FusedLoRA run as one FusedLoRAPair, and a LoRA proj (lora_linear_forward) is told SwiGLU's inputs when the
    kernel made its input: as FusedLoRA it keeps those, not its input."""
    rows = x.reshape(-1, x.shape[-1])
    if _fused_lora_mlp_applies(self, rows):
        salts = (self.fc_1.lora_salt, self.fc_2.lora_salt, self.proj.lora_salt)
        out = FusedLoRAMLP.apply(rows, self, *lora_mlp_adapters(self), _dropout_p(self.fc_1),
                                 self.fc_1.lora_seeds.tensor, salts)
        return out.view(*x.shape[:-1], -1)
    if _fused_lora_pair_applies(self.fc_1, self.fc_2, rows):
        seed, salt, salt2 = _lora_pair_seed(self.fc_1, self.fc_2, rows.device)
        gate, up = FusedLoRAPair.apply(rows, self.fc_1, self.fc_2, self.fc_1.lora_A, self.fc_1.lora_B,
                                       self.fc_2.lora_A, self.fc_2.lora_B, _dropout_p(self.fc_1), seed, salt, salt2)
        gate, up = gate.view(*x.shape[:-1], -1), up.view(*x.shape[:-1], -1)
    else:
        gate, up = self.fc_1(x), self.fc_2(x)
    out = SwiGLU.apply(gate, up, self.triton_kernels)
    if self.triton_kernels and kernels.available(gate) and _takes_swiglu_inputs(self.proj):
        return self.proj(out, swiglu_inputs=(gate, up))
    return self.proj(out)


def _fused_lora_pair_applies(first: torch.nn.Module, second: torch.nn.Module, rows: torch.Tensor) -> bool:
    """FusedLoRAPair runs for two layers over one input: each a LoRALinear (lora_linear_forward) of the same rank,
    adapted and not merged, that would run as FusedLoRA (:func:`_fused_lora_applies`), with one dropout
    probability."""
    def fused(layer) -> bool:
        return (getattr(layer.forward, "__func__", None) is lora_linear_forward and layer.r > 0 and not layer.merged
                and _fused_lora_applies(layer, rows))

    return (fused(first) and fused(second) and first.lora_A.shape == second.lora_A.shape
            and first.lora_A.dtype == second.lora_A.dtype and _dropout_p(first) == _dropout_p(second))


def _lora_pair_seed(first: torch.nn.Module, second: torch.nn.Module, device: torch.device) -> tuple:
    """(seed, salt, salt2) for FusedLoRAPair: the forward pass's shared seed and each layer's own salt, the masks
    each would draw as FusedLoRA (:func:`_lora_seed`); without a shared seed, one drawn for the pair, salts 0 and 1."""
    seeds = getattr(first, "lora_seeds", None)
    if (seeds is not None and seeds is getattr(second, "lora_seeds", None) and seeds.tensor is not None
            and seeds.tensor.device == device):
        return seeds.tensor, first.lora_salt, second.lora_salt
    return torch.randint(2**62, (1,), device=device), 0, 1


def _takes_swiglu_inputs(layer: torch.nn.Module) -> bool:
    """Whether the layer's forward is lora_linear_forward, which takes ``swiglu_inputs``."""
    return getattr(layer.forward, "__func__", None) is lora_linear_forward


class MixedPrecisionLinear(torch.autograd.Function):
    """F.linear under autocast (-mixed precision) keeping the fp32 weight, not a 16-bit copy, for the backward pass,
    which casts it again. Autocast casts each weight to 16 bits for its matmul, and the matmul keeps that cast until
    its backward pass: a 16-bit copy of every weight is alive from the forward pass to the backward pass (TinyLlama:
    1.03B matmul weights x 2 B = 1.9 GiB). Here one layer's copy is alive at a time, for one more cast per weight in
    the backward pass (4 + 2 bytes read and written per weight: TinyLlama ~6.2 GB, ~2 ms per micro-batch on an H100).
    The same arithmetic as autocast's linear: 16-bit inputs and weight, the gradients cast back to fp32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        x16 = x.to(dtype)
        ctx.save_for_backward(x16, weight)
        ctx.x_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype
        return F.linear(x16, weight.to(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x16, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(weight.to(grad.dtype)).to(ctx.x_dtype)
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_weight = rows.t().mm(x16.reshape(-1, x16.shape[-1])).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias, None


def mixed_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward with MixedPrecisionLinear under autocast (train.lean_mixed_linear); outside autocast (a
    model used after training, say) nn.Linear's own."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return F.linear(x, self.weight, self.bias)
    return MixedPrecisionLinear.apply(x, self.weight, self.bias, torch.get_autocast_dtype(device))


class LinearGradIntoWeight(torch.autograd.Function):
    """F.linear whose backward pass adds the weight's gradient into ``weight.grad`` by the matmul itself
    (addmm_, beta = 1) instead of returning it for autograd to add: autograd computes each micro-batch's weight
    gradient into a new tensor and then adds it to .grad in a second kernel, which reads two and writes one
    weight-sized tensor (TinyLlama full fine-tune: 477 such adds per step, 7.8 ms of a 122 ms H100 step in
    benchmarks/results/kernels-tiny; every micro-batch adds, as CUDA graphs keep .grad allocated). The matmul reads
    the old gradient as it writes the new sum: the same sum, rounded once (fp32 accumulation) where autograd rounds
    the product and then the sum. For one device only: DDP's all-reduce runs from autograd's accumulation hooks,
    which this bypasses."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias = weight, bias  # parameters: kept on ctx, so that backward reaches their .grad
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        rows = grad.reshape(-1, grad.shape[-1])
        if weight.requires_grad:
            add_into_grad(weight, rows.t(), x.reshape(-1, x.shape[-1]))
        if bias is not None and bias.requires_grad:
            summed = rows.sum(0)
            if bias.grad is None:
                bias.grad = summed
            else:
                bias.grad.add_(summed)
        return grad_x, None, None


def add_into_grad(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """param.grad += a @ b in one matmul (param.grad = a @ b when there is none yet)."""
    if param.grad is None:
        param.grad = a.mm(b)
    else:
        param.grad.addmm_(a, b)


def grad_into_weight_forward(self, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward through LinearGradIntoWeight (train.grad_into_weights) while its weight trains; a frozen
    layer (LoRA's base) or an inference call (no grad) stays nn.Linear's own."""
    if not (torch.is_grad_enabled() and self.weight.requires_grad):
        return F.linear(x, self.weight, self.bias)
    return LinearGradIntoWeight.apply(x, self.weight, self.bias)


def fast_attention_applies(config) -> bool:
    """attention_forward covers Llama-style attention: RoPE over the whole head, no q/k norms, no interleaved RoPE."""
    return (config.rope_n_elem == config.head_size and not config.norm_qk
            and not getattr(config, "rope_interleave", False))


def _add_low_rank(pretrained: torch.Tensor, after_a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """pretrained + after_a @ b.T, the add done by the matmul itself (beta = 1, in place on ``pretrained``, a fresh
    2-D matmul output that no backward pass needs): no separate pass over the output, forward or backward.
    ``b`` is cast to the output's dtype (under autocast the adapter weights stay fp32)."""
    return pretrained.addmm_(after_a, b.t().to(pretrained.dtype))


def add_low_rank_parts_(pretrained: torch.Tensor, after_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                        parts: tuple) -> torch.Tensor:
    """B's half of a LoRA layer's forward pass (LowRankUpdate, FusedLoRA): pretrained += s after_a B^T, part by part
    (lora_parts), each added in place by its matmul (alpha = s)."""
    for columns, b_rows, a_columns in parts:  # column blocks of a row-major matmul output: views, no copies
        pretrained[:, columns].addmm_(after_a[:, a_columns], lora_b[b_rows].t(), alpha=scale)
    return pretrained


# The Fused* layers run B's side in Triton (kernels.lora_up_ / lora_up_backward) for layers of at least this many
# parts. Measured on the H100 (benchmarks/results/lora-up-s21, 4,096 rows, R 32, us per call replayed from a CUDA
# graph): a qkv layer's 3 parts forward 16.6 (cuBLAS, one addmm_ per part) -> 10.6, backward 32.1 (two matmuls per
# part) -> ~20; one part (proj) forward 8.9 -> 9.0 and backward 13.0 -> 15.7, so a single part keeps cuBLAS. In a
# step (results/s21-attn's profile) the qkv layer's B side took 11.7 us forward and 13.4 + 6.8 us (+ an add of
# partial sums) backward. Only layers up to TRITON_B_SIDE_MAX_WIDTH output columns (TinyLlama's qkv, 2,560) were
# measured; wider ones (OpenLLaMA's qkv: 3 x 3,200 or 3 x 4,096 columns, whose backward kernel would run one program
# per 64 rows: 32 programs at 2,048 rows) keep cuBLAS.
TRITON_B_SIDE_MIN_PARTS = 2
TRITON_B_SIDE_MAX_WIDTH = 2560


def _b_side_bounds(parts: tuple, width: int) -> tuple[tuple[int, int, int, int], ...]:
    """lora_parts' slices as kernels.lora_up_'s parts: (first output column, end column, first row of B, first
    column of the A output), for an output ``width`` columns wide."""
    bounds = []
    for columns, b_rows, a_columns in parts:
        start, end, _ = columns.indices(width)
        bounds.append((start, end, b_rows.start or 0, a_columns.start or 0))
    return tuple(bounds)


def _triton_b_side(t: torch.Tensor, parts: tuple) -> bool:
    """Whether B's side of a layer with output (or output gradient) t runs in Triton: on CUDA, at the measured sizes."""
    return (kernels.available(t) and len(parts) >= TRITON_B_SIDE_MIN_PARTS
            and t.shape[-1] <= TRITON_B_SIDE_MAX_WIDTH)


def low_rank_add_(pretrained: torch.Tensor, after_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                  parts: tuple) -> torch.Tensor:
    """B's half of a Fused* layer's forward pass, pretrained += s after_a B^T part by part, in place: one Triton
    launch for every part on CUDA (:data:`TRITON_B_SIDE_MIN_PARTS`, :data:`TRITON_B_SIDE_MAX_WIDTH`), else
    :func:`add_low_rank_parts_`'s matmuls."""
    if _triton_b_side(pretrained, parts):
        return kernels.lora_up_(pretrained, after_a, lora_b, scale, _b_side_bounds(parts, pretrained.shape[1]))
    return add_low_rank_parts_(pretrained, after_a, lora_b, scale, parts)


def low_rank_backward(grad: torch.Tensor, after_a: torch.Tensor, lora_b: torch.Tensor, scale: float, parts: tuple,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """B's half of a Fused* layer's backward pass, as :func:`_low_rank_b_backward` (B's gradient added into .grad,
    the A output's gradient returned, into ``out`` if given): two Triton launches and an add of partial sums on
    CUDA (:data:`TRITON_B_SIDE_MIN_PARTS`), else its matmuls."""
    if not _triton_b_side(grad, parts):
        return _low_rank_b_backward(grad, after_a, lora_b, scale, parts, out)
    zero_grads_if_missing(lora_b)
    return kernels.lora_up_backward(grad, after_a, lora_b, scale, _b_side_bounds(parts, grad.shape[1]), lora_b.grad,
                                    out=out)


class LowRankUpdate(torch.autograd.Function):
    """The adapters' half of a LoRA layer with their gradients added into .grad by the backward matmuls
    (train.grad_into_weights for LoRA and QLoRA): pretrained += s (dropped A^T) B_p^T for each part p, a block of
    output columns with its rows of B and its r columns of dropped A^T (one part for a LoRALinear; one per adapted
    projection of a LoRAQKVLinear, its block-diagonal B applied block by block). The scale s rides on the matmuls
    (alpha), not on a tensor.

    Per adapted layer and micro-batch this runs 2 + 2 x parts matmuls and nothing else, where autograd runs the
    scale's multiply each way and adds each adapter gradient into .grad in its own kernel (A and B: 2 per layer;
    ~500 kernels of a few microseconds per TinyLlama LoRA step, every micro-batch under CUDA graphs). For one device
    and -true precision only, as LinearGradIntoWeight."""

    @staticmethod
    def forward(ctx, pretrained: torch.Tensor, dropped: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                scale: float, parts: tuple) -> torch.Tensor:
        after_a = dropped.mm(lora_a.t())  # (tokens, r x parts)
        add_low_rank_parts_(pretrained, after_a, lora_b, scale, parts)
        ctx.mark_dirty(pretrained)
        ctx.save_for_backward(dropped, after_a)
        ctx.lora_a, ctx.lora_b, ctx.scale, ctx.parts = lora_a, lora_b, scale, parts  # parameters: reach their .grad
        return pretrained

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dropped, after_a = ctx.saved_tensors
        lora_a = ctx.lora_a
        grad_after_a = _low_rank_b_backward(grad, after_a, ctx.lora_b, ctx.scale, ctx.parts)
        add_into_grad(lora_a, grad_after_a.t(), dropped)
        grad_dropped = grad_after_a.mm(lora_a) if ctx.needs_input_grad[1] else None
        return grad if ctx.needs_input_grad[0] else None, grad_dropped, None, None, None, None


class SeededDropout(torch.autograd.Function):
    """LoRA's dropout as one Triton kernel (kernels.dropout, train.triton_kernels) that keeps a seed, not a mask: the
    backward pass draws the same mask again from it. torch's dropout keeps a 1-byte mask per element (TinyLlama LoRA:
    13.6 KB per token and block, 0.6 GiB at 2,048 positions) and writes and reads it. The seed comes from torch's
    generator on the device, so each call, and each replay of a captured CUDA graph, draws a new mask. The same
    distribution as torch's dropout, not the same draws."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        seed = torch.randint(2**62, (1,), device=x.device)
        ctx.save_for_backward(seed)
        ctx.p = p
        return kernels.dropout(x, p, seed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (seed,) = ctx.saved_tensors
        return kernels.dropout(grad, ctx.p, seed), None


def zero_grads_if_missing(*params: torch.Tensor) -> None:
    """A zero .grad for each parameter that has none yet: the adapter kernels and matmuls add into .grad."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)


def _frozen_input_grad(linear: torch.nn.Module, grad: torch.Tensor,
                       into: torch.Tensor | None = None) -> torch.Tensor:
    """grad @ W for a frozen base layer: nn.Linear's weight, or bitsandbytes' 4-bit weight dequantized as its own
    backward pass does it (bitsandbytes.autograd MatMul4Bit: dequantize_4bit, then one matmul). With ``into``: added
    into it by the matmul (beta = 1), which is returned."""
    weight = linear.weight
    quant_state = getattr(weight, "quant_state", None)
    if quant_state is not None:
        import bitsandbytes.functional as bnbF

        weight = bnbF.dequantize_4bit(weight.data.view(-1, 1), quant_state)
    weight = weight.to(grad.dtype)
    return grad.mm(weight) if into is None else into.addmm_(grad, weight)


class FusedLoRA(torch.autograd.Function):
    """A whole LoRA layer, W x + s B (A dropout(x)), with its dropout inside the A matmuls (kernels.lora_down and
    kernels.lora_down_backward, Triton) and its input gradient written once: grad @ W from cuBLAS, and the
    adapters' share added into it by the kernel that computes A's gradient (train.triton_kernels with
    train.grad_into_weights: one device, -true precision, CUDA).

    Where LowRankUpdate after SeededDropout runs, per layer and micro-batch: the dropout (x read, the dropped copy
    written and kept for the backward pass), A's matmul (the copy read), and backward the dropout again, two matmuls
    over the copy and the input gradient, and autograd's add of that gradient to the frozen layer's (three more
    passes), this reads x once forward, and x and the frozen layer's input gradient once backward, writing the sum
    in place. It keeps x itself (often kept anyway: attention's output, which flash attention keeps; fc_1 and fc_2
    share theirs), not a dropped copy. B's side is LowRankUpdate's: B's matmul adds into W x in place (alpha = s),
    and B's gradient goes into .grad by the matmul. The frozen layer runs under no_grad; its input gradient is
    :func:`_frozen_input_grad`'s."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, linear: torch.nn.Module,
                scale: float, p: float, parts: tuple, seed: torch.Tensor, salt: int,
                gate: torch.Tensor | None = None, up: torch.Tensor | None = None) -> torch.Tensor:
        pretrained = linear(x)
        after_a = kernels.lora_down(x, lora_a, p, seed, salt)  # (tokens, r x parts), dropout(x) A^T
        low_rank_add_(pretrained, after_a, lora_b, scale, parts)
        # x = silu(gate) * up (the MLP's proj after the SwiGLU kernel): keep the two inputs, which SwiGLU keeps too,
        # and rebuild x in the backward kernel, rather than keep x as well
        ctx.save_for_backward(up if gate is not None else x, gate, after_a, seed)
        ctx.linear, ctx.lora_a, ctx.lora_b, ctx.scale, ctx.p, ctx.parts = linear, lora_a, lora_b, scale, p, parts
        ctx.salt = salt
        return pretrained

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, gate, after_a, seed = ctx.saved_tensors  # gate None: x is the layer's input itself
        lora_a, lora_b, scale = ctx.lora_a, ctx.lora_b, ctx.scale
        grad = grad.contiguous()
        grad_after_a = low_rank_backward(grad, after_a, lora_b, scale, ctx.parts)
        input_grad = ctx.needs_input_grad[0]
        zero_grads_if_missing(lora_a)
        grad_x, _ = kernels.lora_down_backward(
            x, lora_a, grad_after_a, ctx.p, seed, _frozen_input_grad(ctx.linear, grad) if input_grad else None,
            input_grad=input_grad, grad_a=lora_a.grad, salt=ctx.salt, gate=gate)
        return grad_x, None, None, None, None, None, None, None, None, None, None


def _low_rank_b_backward(grad: torch.Tensor, after_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                         parts: tuple, out: torch.Tensor | None = None) -> torch.Tensor:
    """B's half of a LoRA layer's backward pass (LowRankUpdate, FusedLoRA, FusedLoRAPair): B's gradient added into
    .grad by its matmuls, and the gradient with respect to the r-wide A output, returned (written into ``out``, a
    tensor of after_a's shape, if given)."""
    zero_grads_if_missing(lora_b)
    grad_after_a = torch.empty_like(after_a) if out is None else out
    for columns, b_rows, a_columns in parts:
        block = grad[:, columns]
        lora_b.grad[b_rows].addmm_(block.t(), after_a[:, a_columns], alpha=scale)
        grad_after_a[:, a_columns].addmm_(block, lora_b[b_rows], beta=0, alpha=scale)  # beta 0: not read
    return grad_after_a


class FusedLoRAPair(torch.autograd.Function):
    """Two LoRA layers over one input, as LLaMA's MLP runs fc_1 and fc_2 on the same normed x: FusedLoRA for both,
    with their A sides in one kernel each way (kernels.lora_down / lora_down_backward with ``a2``) and their input
    gradients summed by the matmuls. Each layer keeps its own dropout mask (its own salt), so the outputs and
    gradients are those of the two FusedLoRA layers and autograd's add of their input gradients.

    Per micro-batch and block this saves, against two FusedLoRA layers: one read of x forward; backward one read of
    x, of the frozen input gradient and one write of the sum (the pair kernel adds both adapters' shares in one
    pass, where two kernels each read and write it), and autograd's add of the two input gradients (TinyLlama: 3
    passes over a (tokens x 2,048) tensor). The second frozen layer's input gradient is added by its matmul (beta
    = 1). Keeps x once, the (tokens x 2 r) A output and the seed: what the two layers keep. Measured on the H100
    (benchmarks/results/s16b-tiny, TinyLlama as shipped): LoRA +0.5% real tok/s, QLoRA +1.8%."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, first: torch.nn.Module, second: torch.nn.Module, lora_a: torch.Tensor,
                lora_b: torch.Tensor, lora_a2: torch.Tensor, lora_b2: torch.Tensor, p: float, seed: torch.Tensor,
                salt: int, salt2: int):
        gate, up = first.linear(x), second.linear(x)
        after_a = kernels.lora_down(x, lora_a, p, seed, salt, a2=lora_a2, salt2=salt2)  # (tokens, 2 r)
        r = lora_a.shape[0]
        low_rank_add_(gate, after_a[:, :r], lora_b, first.scaling, lora_parts(first))
        low_rank_add_(up, after_a[:, r:], lora_b2, second.scaling, lora_parts(second))
        ctx.save_for_backward(x, after_a, seed)
        ctx.first, ctx.second, ctx.p, ctx.salt, ctx.salt2 = first, second, p, salt, salt2
        ctx.adapters = (lora_a, lora_b, lora_a2, lora_b2)  # parameters: reach their .grad
        return gate, up

    @staticmethod
    def backward(ctx, grad_gate: torch.Tensor, grad_up: torch.Tensor):
        x, after_a, seed = ctx.saved_tensors
        first, second = ctx.first, ctx.second
        lora_a, lora_b, lora_a2, lora_b2 = ctx.adapters
        grad_gate, grad_up = grad_gate.contiguous(), grad_up.contiguous()
        r = lora_a.shape[0]
        grad_after_a = torch.empty_like(after_a)
        low_rank_backward(grad_gate, after_a[:, :r], lora_b, first.scaling, lora_parts(first),
                          out=grad_after_a[:, :r])
        low_rank_backward(grad_up, after_a[:, r:], lora_b2, second.scaling, lora_parts(second),
                          out=grad_after_a[:, r:])
        zero_grads_if_missing(lora_a, lora_a2)
        input_grad = ctx.needs_input_grad[0]
        frozen = (_frozen_input_grad(second.linear, grad_up, into=_frozen_input_grad(first.linear, grad_gate))
                  if input_grad else None)
        grad_x, _ = kernels.lora_down_backward(x, lora_a, grad_after_a, ctx.p, seed, frozen, input_grad=input_grad,
                                               grad_a=lora_a.grad, salt=ctx.salt, a2=lora_a2, salt2=ctx.salt2,
                                               grad_a2=lora_a2.grad)
        return grad_x, None, None, None, None, None, None, None, None, None, None


def lora_mlp_adapters(mlp: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """A LoRA LLaMAMLP's six adapter matrices in FusedLoRAMLP's order: fc_1's A and B, fc_2's, proj's."""
    return (mlp.fc_1.lora_A, mlp.fc_1.lora_B, mlp.fc_2.lora_A, mlp.fc_2.lora_B, mlp.proj.lora_A, mlp.proj.lora_B)


# FusedLoRAMLP runs for MLPs at most this wide (intermediate size), where it was measured faster than the layers
# apart on the H100: TinyLlama's 5,632 (4,096-row micro-batches), +3.4% and +3.8% real tok/s in two calls
# (results/s18-mlp, s18-splits). OpenLLaMA-7B's 11,008 (2,048 rows) ran 3.4% slower with it, still 2.0% slower after
# its forward kernel's splits followed the row count (s18-7b, s18-splits), its kernels at 1.9-6x their bandwidth floor.
# Sizes in between were not measured: they keep the layers apart.
FUSED_LORA_MLP_MAX_INTERMEDIATE = 5632


def _fused_lora_mlp_applies(mlp: torch.nn.Module, rows: torch.Tensor) -> bool:
    """FusedLoRAMLP runs for a LLaMAMLP whose fc_1 and fc_2 run as FusedLoRAPair (:func:`_fused_lora_pair_applies`)
    and whose proj would run as FusedLoRA with their rank and dropout probability, the three drawing their masks from
    the forward pass's shared seed (LoRASeeds, drawn by CausalLM), at most FUSED_LORA_MLP_MAX_INTERMEDIATE wide."""
    proj = mlp.proj
    if getattr(mlp.fc_1, "lora_B", None) is None or mlp.fc_1.lora_B.shape[0] > FUSED_LORA_MLP_MAX_INTERMEDIATE:
        return False
    seeds = getattr(mlp.fc_1, "lora_seeds", None)
    shared = (seeds is not None and seeds.tensor is not None and seeds.tensor.device == rows.device
              and all(getattr(layer, "lora_seeds", None) is seeds for layer in (mlp.fc_2, proj)))
    return (shared and _fused_lora_pair_applies(mlp.fc_1, mlp.fc_2, rows) and _takes_swiglu_inputs(proj) and proj.r > 0
            and not proj.merged and _fused_lora_applies(proj, rows) and proj.lora_A.shape[0] == mlp.fc_1.lora_A.shape[0]
            and proj.lora_A.dtype == mlp.fc_1.lora_A.dtype and _dropout_p(proj) == _dropout_p(mlp.fc_1))


class FusedLoRAMLP(torch.autograd.Function):
    """A LLaMA MLP with LoRA on fc_1, fc_2 and proj, proj(silu(fc_1(x)) * fc_2(x)), from the same frozen matmuls
    and A-side kernels as FusedLoRAPair and FusedLoRA, with everything between them in one Triton kernel each way
    (kernels.swiglu_lora_forward / swiglu_lora_backward): fc_1's and fc_2's B adds, the SwiGLU, and proj's A side
    forward; backward proj's adapter share of its input gradient, SwiGLU's gradients, proj's A gradient and fc_1's
    and fc_2's B gradients. Against FusedLoRAPair + SwiGLU + FusedLoRA that is 50,688 bf16 elements of traffic per
    token and block less on paper (TinyLlama; kernels.py), and measured on the H100 +3.4% / +3.8% real tok/s for
    TinyLlama LoRA, +4.9% for QLoRA; the gain is the forward kernel's, the backward one runs at ~2x its bandwidth
    floor (benchmarks/README.md, session 18). The outputs and gradients are theirs, each dropout
    mask drawn from the same seed and salt, up to rounding: gate and up reach the SwiGLU rounded to 16 bits as
    before, and the SwiGLU's output gradient, which their kernels rounded, stays in fp32 inside the kernel.

    Keeps x, the frozen gate and up (rows x intermediate each, as SwiGLU kept the adapted ones), the r-wide A outputs
    and the seed: what the three layers kept. For one device and -true precision, as FusedLoRA."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mlp: torch.nn.Module, lora_a1: torch.Tensor, lora_b1: torch.Tensor,
                lora_a2: torch.Tensor, lora_b2: torch.Tensor, lora_a3: torch.Tensor, lora_b3: torch.Tensor,
                p: float, seed: torch.Tensor, salts: tuple[int, int, int]) -> torch.Tensor:
        fc_1, fc_2, proj = mlp.fc_1, mlp.fc_2, mlp.proj
        stacked = stacked_fc_weight(mlp)
        if stacked is not None:  # one matmul for both frozen layers: gate and up are its output's column halves
            gate_up = torch.nn.functional.linear(x, stacked)
            gate, up = gate_up[:, :stacked.shape[0] // 2], gate_up[:, stacked.shape[0] // 2:]
        else:
            gate, up = fc_1.linear(x), fc_2.linear(x)  # frozen: their B adds happen in the SwiGLU kernel
        after_a = kernels.lora_down(x, lora_a1, p, seed, salts[0], a2=lora_a2, salt2=salts[1])  # (tokens, 2 r)
        out, after_proj_a = kernels.swiglu_lora_forward(gate, up, after_a, lora_b1, lora_b2, fc_1.scaling,
                                                        fc_2.scaling, lora_a3, p, seed, salts[2])
        y = proj.linear(out)
        low_rank_add_(y, after_proj_a, lora_b3, proj.scaling, lora_parts(proj))
        ctx.save_for_backward(x, gate, up, after_a, after_proj_a, seed)
        ctx.mlp, ctx.p, ctx.salts = mlp, p, salts
        ctx.adapters = (lora_a1, lora_b1, lora_a2, lora_b2, lora_a3, lora_b3)  # parameters: reach their .grad
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, gate, up, after_a, after_proj_a, seed = ctx.saved_tensors
        fc_1, fc_2, proj = ctx.mlp.fc_1, ctx.mlp.fc_2, ctx.mlp.proj
        lora_a1, lora_b1, lora_a2, lora_b2, lora_a3, lora_b3 = ctx.adapters
        zero_grads_if_missing(*ctx.adapters)
        grad = grad.contiguous()
        grad_after_proj_a = low_rank_backward(grad, after_proj_a, lora_b3, proj.scaling, lora_parts(proj))
        grad_gate_up = torch.empty((gate.shape[0], 2 * gate.shape[1]), dtype=gate.dtype, device=gate.device)
        grad_gate, grad_up = kernels.swiglu_lora_backward(
            _frozen_input_grad(proj.linear, grad), gate, up, after_a, lora_b1, lora_b2, fc_1.scaling, fc_2.scaling,
            lora_a3, grad_after_proj_a, ctx.p, seed, ctx.salts[2], lora_a3.grad, lora_b1.grad, lora_b2.grad,
            out=grad_gate_up)
        r = lora_a1.shape[0]
        grad_after_a = torch.empty_like(after_a)  # fc_1's and fc_2's: s grad B, B's own gradients already added
        grad_after_a[:, :r].addmm_(grad_gate, lora_b1.to(grad_gate.dtype), beta=0, alpha=fc_1.scaling)
        grad_after_a[:, r:].addmm_(grad_up, lora_b2.to(grad_up.dtype), beta=0, alpha=fc_2.scaling)
        input_grad = ctx.needs_input_grad[0]
        stacked = stacked_fc_weight(ctx.mlp)
        if not input_grad:
            frozen = None
        elif stacked is not None:  # both frozen layers' input gradients from one matmul over the stacked weights
            frozen = grad_gate_up.mm(stacked)
        else:
            frozen = _frozen_input_grad(fc_2.linear, grad_up, into=_frozen_input_grad(fc_1.linear, grad_gate))
        grad_x, _ = kernels.lora_down_backward(x, lora_a1, grad_after_a, ctx.p, seed, frozen, input_grad=input_grad,
                                               grad_a=lora_a1.grad, salt=ctx.salts[0], a2=lora_a2,
                                               salt2=ctx.salts[1], grad_a2=lora_a2.grad)
        return grad_x, None, None, None, None, None, None, None, None, None, None


def stack_fc_weights(model: torch.nn.Module) -> int:
    """Put each LoRA LLaMA MLP's frozen fc_1 and fc_2 weights one after the other in one tensor (the parameters
    become its two halves; their values, names and state_dict stay), where FusedLoRAMLP may run: frozen plain
    nn.Linear bases without bias, at most FUSED_LORA_MLP_MAX_INTERMEDIATE wide. FusedLoRAMLP then runs one matmul
    for both forward (the output's column halves are gate and up) and one for both input gradients backward (where
    the second layer's matmul added into the first's output: a beta = 1 matmul, ~30 us slower per call than a plain
    one at TinyLlama's 4,096 rows on the H100, results/s19-mask's profile). Measured on the H100 (results/s19-stack,
    TinyLlama LoRA, beside the code before in one call): 75,939 / 75,763 -> 76,874 / 76,667 real tok/s (+1.2%), the
    same losses and memory. Call it once the model is on its device in its final dtype (after fabric.setup_module,
    which may move parameters). Returns the MLPs stacked."""
    from litgpt.lora import LoRALinear
    from litgpt.model import LLaMAMLP

    stacked = 0
    for mlp in model.modules():
        if not (isinstance(mlp, LLaMAMLP) and isinstance(mlp.fc_1, LoRALinear) and isinstance(mlp.fc_2, LoRALinear)):
            continue
        first, second = mlp.fc_1.linear, mlp.fc_2.linear
        if not (type(first) is torch.nn.Linear and type(second) is torch.nn.Linear and first.bias is None
                and second.bias is None and first.weight.shape == second.weight.shape
                and first.weight.dtype == second.weight.dtype and first.weight.device == second.weight.device
                and not first.weight.requires_grad and not second.weight.requires_grad
                and first.weight.shape[0] <= FUSED_LORA_MLP_MAX_INTERMEDIATE):
            continue
        if stacked_fc_weight(mlp) is None:  # (not already stacked)
            both = torch.cat([first.weight.data, second.weight.data])
            width = first.weight.shape[0]
            first.weight.data, second.weight.data = both[:width], both[width:]
        stacked += 1
    return stacked


def stacked_fc_weight(mlp: torch.nn.Module) -> torch.Tensor | None:
    """fc_1's and fc_2's weights as one (2 x intermediate, n_embd) tensor when they lie one after the other in one
    storage (stack_fc_weights), else None."""
    first, second = mlp.fc_1.linear.weight, mlp.fc_2.linear.weight
    if (first.dtype != second.dtype or first.shape != second.shape or first.device != second.device
            or not first.is_contiguous() or not second.is_contiguous()
            or first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
            or second.storage_offset() != first.storage_offset() + first.numel()):
        return None
    return first.detach().as_strided((2 * first.shape[0], first.shape[1]), (first.shape[1], 1))


class LoRASeeds:
    """One dropout seed per forward pass, shared by a model's FusedLoRA layers (each adds its own salt, its index):
    CausalLM.forward draws it, one small kernel per micro-batch where each layer drew its own (TinyLlama: 111 per
    micro-batch, ~2 us each). The kernels hash seed + salt into each mask's key (kernels._lora_key), so each layer
    gets its own mask. A layer called outside CausalLM's training forward (no seed drawn) draws one for itself."""

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        """The current forward pass's seed (a 1-element int64 tensor on the device), or None."""

    def draw(self, device: torch.device) -> None:
        # below 2^62 - 2^20: the layers' salts (their index, < 2^20) keep seed + salt inside int64
        self.tensor = torch.randint(2**62 - 2**20, (1,), device=device)


def _lora_seed(self, device: torch.device) -> tuple[torch.Tensor, int]:
    """(seed, salt) for a FusedLoRA layer: the forward pass's shared seed and the layer's index, or its own seed."""
    seeds = getattr(self, "lora_seeds", None)
    if seeds is not None and seeds.tensor is not None and seeds.tensor.device == device:
        return seeds.tensor, self.lora_salt
    return torch.randint(2**62, (1,), device=device), 0


def _fused_lora_applies(self, rows: torch.Tensor) -> bool:
    """FusedLoRA runs: train.triton_kernels and train.grad_into_weights, a training pass on CUDA in 16 bits, the
    base layer frozen (LoRA's own setting), and the adapter's dropout an nn.Dropout."""
    dropout = self.lora_dropout
    bias = self.linear.bias
    return (self.triton_kernels and self.grads_into_adapters and torch.is_grad_enabled()
            and kernels.available(rows) and rows.dtype in (torch.bfloat16, torch.float16)
            and isinstance(dropout, (torch.nn.Dropout, torch.nn.Identity))
            and not self.linear.weight.requires_grad and (bias is None or not bias.requires_grad))


def _dropout_p(self) -> float:
    """The adapter dropout's probability, 0 outside training or for nn.Identity."""
    dropout = self.lora_dropout
    return dropout.p if isinstance(dropout, torch.nn.Dropout) and dropout.training else 0.0


def _lora_dropout(self, rows: torch.Tensor) -> torch.Tensor:
    """The adapter's dropout: SeededDropout where train.triton_kernels applies, else the layer's own nn.Dropout."""
    dropout = self.lora_dropout
    if (self.triton_kernels and isinstance(dropout, torch.nn.Dropout) and dropout.training and dropout.p > 0
            and kernels.available(rows)):
        return SeededDropout.apply(rows, dropout.p)
    return dropout(rows)


def lora_parts(layer) -> tuple:
    """The blocks in which LowRankUpdate and FusedLoRA apply B: (output columns, rows of B, columns of the A output)
    per adapted projection. A LoRALinear is one block; a LoRAQKVLinear one per adapted q, k, v, B's rows holding
    the adapted projections' outputs and A's r rows each."""
    if not hasattr(layer, "enable_lora"):  # a LoRALinear (LoRAQKVLinear's enable_lora says which of q, k, v adapt)
        everything = slice(None)
        return ((everything, everything, everything),)
    q_size = layer.head_size * layer.n_head
    kv_size = layer.head_size * layer.n_query_groups
    parts, column, b_row, a_column = [], 0, 0, 0
    for enabled, size in zip(layer.enable_lora, (q_size, kv_size, kv_size)):
        if enabled:
            parts.append((slice(column, column + size), slice(b_row, b_row + size),
                          slice(a_column, a_column + layer.r)))
            b_row, a_column = b_row + size, a_column + layer.r
        column += size
    return tuple(parts)


def lora_linear_forward(self, x: torch.Tensor, swiglu_inputs: tuple | None = None) -> torch.Tensor:
    """LoRALinear.forward as W x + B (s A dropout(x)): the scale s = alpha / r multiplies the r-wide product, not the
    layer's output, and the matmul with B adds into W x in place. The same function as LitGPT's
    ``W x + (dropout(x) A^T B^T) s``. Per adapted layer it saves the scale's multiply and the add over the whole
    output (TinyLlama's adapted layers write 17,920 outputs per token and block: q, k, v 2,560, proj 2,048, fc_1 and
    fc_2 5,632 each, mlp proj 2,048), forward and backward. With ``self.grads_into_adapters`` (set by
    use_fast_layers from train.grad_into_weights) the adapters run as LowRankUpdate; with ``self.triton_kernels``
    the dropout as SeededDropout; with both, on CUDA, the whole layer as FusedLoRA (:func:`_fused_lora_applies`).
    ``swiglu_inputs``: (gate, up) when x is kernels.swiglu_forward(gate, up) (mlp_forward), for FusedLoRA to keep
    them, not x."""
    if self.r == 0 or self.merged:
        return self.linear(x)
    rows = x.reshape(-1, x.shape[-1])  # 2-D from the start: the in-place add acts on a matmul output, not a view
    if _fused_lora_applies(self, rows):
        rebuild = [t.reshape(rows.shape) for t in swiglu_inputs] if swiglu_inputs is not None else [None, None]
        out = FusedLoRA.apply(rows, self.lora_A, self.lora_B, self.linear, self.scaling, _dropout_p(self),
                              lora_parts(self), *_lora_seed(self, rows.device), *rebuild)
        return out.view(*x.shape[:-1], -1)
    pretrained = self.linear(rows)
    if self.grads_into_adapters and torch.is_grad_enabled():
        out = LowRankUpdate.apply(pretrained, _lora_dropout(self, rows), self.lora_A, self.lora_B, self.scaling,
                                  lora_parts(self))
        return out.view(*x.shape[:-1], -1)
    after_a = F.linear(_lora_dropout(self, rows), self.lora_A) * self.scaling  # (tokens, r): the scale costs nothing
    return _add_low_rank(pretrained, after_a, self.lora_B).view(*x.shape[:-1], -1)


def lora_qkv_forward(self, x: torch.Tensor) -> torch.Tensor:
    """LoRAQKVLinear.forward without conv1d and zero-padding: lora_A's rows hold r per adapted projection and
    lora_B's rows the adapted projections' outputs. One (tokens, r x adapted) x (r x adapted, q + k + v) matmul with
    a block-diagonal B (zeros for a projection not adapted: a few hundred thousand multiply-adds per token) adds
    the adapters' outputs into the pretrained output in place, scaled on the r-wide side as in lora_linear_forward.
    Same result as LitGPT's grouped conv1d + index_copy, as plain matmuls that compile and fuse well. With
    ``self.grads_into_adapters`` (train.grad_into_weights) LowRankUpdate applies B block by block instead, or the
    whole layer runs as FusedLoRA where :func:`_fused_lora_applies`."""
    if self.r == 0 or not any(self.enable_lora) or self.merged:
        return self.linear(x)
    rows = x.reshape(-1, x.shape[-1])
    if _fused_lora_applies(self, rows):
        out = FusedLoRA.apply(rows, self.lora_A, self.lora_B, self.linear, self.scaling, _dropout_p(self),
                              lora_parts(self), *_lora_seed(self, rows.device))
        return out.view(*x.shape[:-1], -1)
    pretrained = self.linear(rows)
    if self.grads_into_adapters and torch.is_grad_enabled():
        out = LowRankUpdate.apply(pretrained, _lora_dropout(self, rows), self.lora_A, self.lora_B, self.scaling,
                                  lora_parts(self))
        return out.view(*x.shape[:-1], -1)
    q_size = self.head_size * self.n_head
    kv_size = self.head_size * self.n_query_groups
    after_a = F.linear(_lora_dropout(self, rows), self.lora_A) * self.scaling  # (tokens, r x adapted)
    adapted = sum(self.enable_lora)
    parts = iter(self.lora_B.split(self.qkv_shapes, dim=0))
    blocks, column = [], 0
    for enabled, size in zip(self.enable_lora, (q_size, kv_size, kv_size)):
        if enabled:  # this projection's B in its own r columns
            blocks.append(F.pad(next(parts), (column, (adapted - 1) * self.r - column)))
            column += self.r
        else:
            blocks.append(self.lora_B.new_zeros(size, adapted * self.r))
    return _add_low_rank(pretrained, after_a, torch.cat(blocks, dim=0)).view(*x.shape[:-1], -1)


class AddRMSNorm(torch.autograd.Function):
    """The residual stream's add and the next RMSNorm as one Triton kernel each way (kernels.add_rms_norm, with
    train.triton_kernels): returns (residual + delta, rms_norm(residual + delta) x weight). In eager torch the add
    and the norm are a kernel each forward, and backward the norm's input gradient, its weight gradient and the add
    of the stream's gradient are three: each pass reads or writes a (tokens x hidden) tensor that the fused kernel
    keeps in registers. Keeps what the two ops keep: the new residual (the norm's input) and one fp32 scale per row."""

    @staticmethod
    def forward(ctx, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
        new_residual, out, rstd = kernels.add_rms_norm(residual, delta, weight, eps)
        ctx.save_for_backward(new_residual, weight, rstd)
        ctx.set_materialize_grads(False)  # the last norm's new residual feeds nothing: no zeros to read
        return new_residual, out

    @staticmethod
    def backward(ctx, grad_residual: torch.Tensor | None, grad_out: torch.Tensor | None):
        new_residual, weight, rstd = ctx.saved_tensors
        if grad_out is None:  # pragma: no cover - the normed output always feeds a layer
            return grad_residual, grad_residual, None, None
        grad_in, grad_weight = kernels.add_rms_norm_backward(grad_out, grad_residual, new_residual, weight, rstd,
                                                             weight_grad=ctx.needs_input_grad[2])
        return grad_in, grad_in, grad_weight, None


def fuses_residual_norms(gpt: torch.nn.Module) -> bool:
    """Whether hidden() can run the model as AddRMSNorm + attention + AddRMSNorm + MLP per block: every block a
    sequential-residual one with RMSNorm before attention and MLP and no post-norms, and an RMSNorm at the end."""
    from litgpt.model import Block, RMSNorm

    def rms(norm) -> bool:
        return isinstance(norm, RMSNorm) and norm.dim == -1

    blocks = gpt.transformer.h
    return rms(gpt.transformer.ln_f) and all(
        type(b).forward is Block.forward and not b.config.parallel_residual and rms(b.norm_1) and rms(b.norm_2)
        and isinstance(b.post_attention_norm, torch.nn.Identity) and isinstance(b.post_mlp_norm, torch.nn.Identity)
        for b in blocks)


def rms_norm_weight(norm: torch.nn.Module) -> torch.Tensor:
    """The scale a LitGPT RMSNorm multiplies by: its weight, or 1 + weight with add_unit_offset (Gemma)."""
    return (1 + norm.weight) if norm.add_unit_offset else norm.weight


def rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """LitGPT's RMSNorm as torch's rms_norm: on CUDA one fused kernel each way, which keeps its input and one fp32
    scale per row for the backward pass, where LitGPT's version runs ~5 kernels forward and keeps two fp32 copies of
    the input (8 bytes per element instead of 2 in bf16). The same arithmetic: in fp32, the weight applied before
    the cast back to the input's dtype."""
    return F.rms_norm(x, (x.shape[-1],), rms_norm_weight(self), self.eps)


def _is_identity_function(dropout) -> bool:
    """A LoRA layer's dropout that is a plain function returning its input (LitGPT's ``lambda x: x`` for dropout
    0), not a module."""
    if isinstance(dropout, torch.nn.Module) or not callable(dropout):
        return False
    probe = torch.empty(0)
    try:
        return dropout(probe) is probe
    except Exception:  # some other function: not ours to judge, it stays
        return False


def use_fast_layers(model: torch.nn.Module, lora: bool = True, norm: bool = True, attention: bool = True,
                    swiglu: bool = True, mixed_linear: bool = False, grad_into_weights: bool = False,
                    triton_kernels: bool = False, attention_kernel: str = "auto") -> None:
    """Swap in packed attention; with ``attention`` (train.fast_attention), attention_forward where it applies; with
    ``lora`` (train.fast_lora), the matmul LoRA layers; with ``norm`` (train.fused_rms_norm), torch's rms_norm; with
    ``swiglu`` (train.lean_swiglu), mlp_forward in LLaMA MLPs; with ``mixed_linear`` (train.lean_mixed_linear, for
    -mixed precision), mixed_linear_forward in every plain nn.Linear (LoRA's base layers and the output layer
    included; bitsandbytes' 4-bit layers, a subclass, keep theirs); with ``grad_into_weights``
    (train.grad_into_weights, -true precision on one device), grad_into_weight_forward in every plain nn.Linear and
    LowRankUpdate in the fast LoRA layers;
    with ``triton_kernels`` (train.triton_kernels), mlp_forward's SwiGLU, attention_forward's RoPE and the fast LoRA
    layers' dropout run Triton kernels on CUDA in eager mode, and packed attention too where ``attention_kernel``
    (train.attention_kernel) picks them. Per instance: LitGPT's classes stay untouched."""
    import types

    from litgpt.lora import LoRALinear, LoRAQKVLinear
    from litgpt.model import CausalSelfAttention, LLaMAMLP, RMSNorm

    seeds = LoRASeeds()  # FusedLoRA's dropout seed, one per forward pass (CausalLM.forward draws it)
    lora_layers = 0
    for module in model.modules():
        if lora and isinstance(module, (LoRAQKVLinear, LoRALinear)):
            module.lora_seeds, module.lora_salt = seeds, lora_layers
            lora_layers += 1
            if _is_identity_function(module.lora_dropout):
                # LitGPT gives a dropout-0 adapter `lambda x: x`, which the fused paths cannot tell from any other
                # function; as an nn.Identity (no parameters or state) it runs them as a dropout of 0 (no mask drawn)
                module.lora_dropout = torch.nn.Identity()
        if swiglu and type(module).__name__ == "LLaMAMLP" and isinstance(module, LLaMAMLP):  # not its subclasses
            module.forward = types.MethodType(mlp_forward, module)
            module.triton_kernels = triton_kernels
        if isinstance(module, CausalSelfAttention):
            module.scaled_dot_product_attention = types.MethodType(packed_attention, module)
            if attention and fast_attention_applies(module.config):
                module.forward = types.MethodType(attention_forward, module)
                module.triton_kernels, module.attention_kernel = triton_kernels, attention_kernel
        if lora and isinstance(module, LoRAQKVLinear):
            module.forward = types.MethodType(lora_qkv_forward, module)
            module.grads_into_adapters, module.triton_kernels = grad_into_weights, triton_kernels
        elif lora and isinstance(module, LoRALinear):
            module.forward = types.MethodType(lora_linear_forward, module)
            module.grads_into_adapters, module.triton_kernels = grad_into_weights, triton_kernels
        elif norm and isinstance(module, RMSNorm) and module.dim == -1:
            module.forward = types.MethodType(rms_norm_forward, module)
        elif mixed_linear and type(module) is torch.nn.Linear:
            module.forward = types.MethodType(mixed_linear_forward, module)
        elif grad_into_weights and type(module) is torch.nn.Linear:
            module.forward = types.MethodType(grad_into_weight_forward, module)
    if lora_layers:
        model.lora_seeds = seeds


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
        """The loss as litft.kernels' cross-entropy (train.triton_kernels) on CUDA: :class:`CrossEntropySum`."""
        self.fused_residual_norms = fused_residual_norms
        """hidden() runs each block's residual adds and the norms after them as :class:`AddRMSNorm` on CUDA (eager
        blocks, train.triton_kernels, and a model where :func:`fuses_residual_norms`); else each block's forward."""
        # Flash attention's varlen kernel sizes its grid by this bound and leaves any position past it in a segment
        # unwritten (garbage that reaches the weight gradients as inf/nan through the zero-loss padding). It must
        # cover every segment of every batch: samples (at most max_seq_length) and a packed row's padding tail (under
        # the row-length multiple, at most GRAPH_MULTIPLE - 1 positions). One fixed value: a per-batch one would make
        # torch.compile recompile for each new length.
        from litft.data import GRAPH_MULTIPLE

        self.max_seq_length = max(max_seq_length, GRAPH_MULTIPLE)

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
        for block in gpt.transformer.h:
            x = block(x, cos, sin, packed)
        return gpt.transformer.ln_f(x)

    def _hidden_fused(self, x, cos, sin, packed: Packed | None) -> torch.Tensor:
        """LitGPT's Block.forward for sequential-residual blocks, x + attn(norm_1(x)) then + mlp(norm_2(.)), with
        each add fused into the norm that follows it (the next block's norm_1, or ln_f after the last block)."""
        blocks = self.gpt.transformer.h
        normed = blocks[0].norm_1(x)
        residual = x
        for i, block in enumerate(blocks):
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


class CrossEntropySum(torch.autograd.Function):
    """The summed cross-entropy of 16-bit logits over labelled positions, as litft.kernels' two Triton kernels: the
    forward reads the logits once (log-sum-exp in fp32, online); the backward writes the gradient over them. Where
    F.cross_entropy(logits.float()) writes an fp32 copy of the logits, log-softmax's fp32 output, and each way back
    (~40 bytes per logit against ~6; a TinyLlama step has ~4,000 positions x 32,000 logits). The same arithmetic in
    fp32: F.cross_entropy gives the same loss to rounding."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits, labels = logits.contiguous(), labels.contiguous()
        losses, lse = kernels.cross_entropy_forward(logits, labels, IGNORE_INDEX)
        ctx.save_for_backward(logits, labels, lse)
        return losses.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        # over the logits in place: no one else keeps them (the output layer's backward needs its input, not them)
        return kernels.cross_entropy_backward_(logits, labels, lse, grad.reshape(1), IGNORE_INDEX), None


def _chunk_loss(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, fused: bool = False
                ) -> torch.Tensor:
    logits = head(hidden)
    if fused and kernels.available(logits):
        return CrossEntropySum.apply(logits, labels)
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_lm_loss(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk: int,
                    fused: bool = False) -> torch.Tensor:
    """Sum of cross-entropy over labelled positions, `chunk` positions at a time (0: all at once); with ``fused``
    (train.triton_kernels) as CrossEntropySum on CUDA.

    Each chunk's logits (and their fp32 upcast) are dropped after the forward pass and recomputed in the backward
    pass (activation checkpointing of the output layer): peak memory holds one chunk's logits, not all of them,
    for one extra output-layer matmul (2 x d x vocab FLOPs per token)."""
    hidden = hidden.reshape(-1, hidden.size(-1))
    labels = labels.reshape(-1)
    if chunk <= 0 or hidden.size(0) <= chunk:
        return _chunk_loss(head, hidden, labels, fused)
    from torch.utils.checkpoint import checkpoint

    total = hidden.new_zeros((), dtype=torch.float32)
    for h, y in zip(hidden.split(chunk), labels.split(chunk)):
        # preserve_rng_state off: reading the CUDA RNG state is not allowed while a CUDA graph is being captured. A
        # LoRA head's dropout therefore draws a new mask in the recompute: the chunk's gradient is that of the
        # recomputed forward (the same distribution), its reported loss the first forward's
        total = total + checkpoint(_chunk_loss, head, h, y, fused, use_reentrant=False, preserve_rng_state=False)
    return total


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
        # widths (H100, benchmarks/results/mixed-compiled-tiny). Off, the block keeps to one graph.
        options["options"] = {"triton.mix_order_reduction": False}
    for block in gpt.transformer.h:
        block.compile(dynamic=True, backend=backend, **options)
