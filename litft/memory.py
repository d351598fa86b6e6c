"""The predicted memory ledger of a recipe, per GPU: what `litft estimate` prints and every run writes beside its
measured peak.

Model state is counted from the parameters of the real architecture, built on the meta device (no memory, exact
shapes): bytes per parameter by role and precision.

                          weights   compute copies   gradients   optimizer state (AdamW)
    full, bf16-true          2            -              2              2 x 2
    full, bf16-mixed         4 (fp32)     2 (autocast)   4              2 x 4
    LoRA base, bf16-true     2            -              -              -
    LoRA base, bf16-mixed    4            2              -              -
    QLoRA base (nf4)         0.5 + scales -              -              -

Activations are not guessed: one transformer block of the same architecture, method and dtype runs on the CPU for a
few tokens under `torch.autograd.graph.saved_tensors_hooks`, and every tensor autograd keeps for the backward pass
(parameters excluded, shared storage counted once) is summed. That gives bytes per token per layer, exact for what
the block saves; attention is flash/memory-efficient SDPA, which saves O(T) not O(T^2). With activation
checkpointing a block keeps only its input, and one block's activations are live again while it is recomputed.

The peak is taken when one micro-batch's activations are all alive at the start of the backward pass, together
with the weights, the optimizer state, the gradients (present while accumulating) and the loss computation's
buffers (logits and their gradient). torch's caching allocator reserves more than it allocates; the measured
ratio of peak reserved to peak allocated is applied as `allocator_overhead`. The CUDA context (not part of torch's
reserved figure, but part of the GPU's memory) is listed apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from litft.recipe import Recipe

GIB = 2**30

# Reserved / allocated at the peak: 1.06 to 1.19 on the H100 runs of benchmarks/results/ledger.md (TinyLlama full
# bf16-true 1.08, bf16-mixed 1.06, OpenLLaMA-7B LoRA 1.19, QLoRA 1.11); the middle of that range.
ALLOCATOR_OVERHEAD = 1.10
# QLoRA's, since CUDA graphs and the Triton kernels: 1.20 to 1.25 on the H100 (TinyLlama 1.22 in session 12's
# s12b-tiny, 1.25 in s13-tiny, 1.21 in vs-litgpt-tiny-lora-qlora-s14; OpenLLaMA-7B 1.20 in defaults-7b-s13 and -s14).
# bitsandbytes' dequantized weight copies, one per 4-bit matmul and of every layer's size, are freed and made again
# inside each captured graph's memory pool, which keeps more cached blocks than the plain runs do.
ALLOCATOR_OVERHEAD_QLORA = 1.20
# CUDA context + cuBLAS/cuDNN workspaces: on the GPU but outside torch's reserved figure (measured: device used
# minus torch reserved on an otherwise idle H100, benchmarks/).
CUDA_CONTEXT_GIB = 0.5

_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def _param_dtype(precision: str) -> torch.dtype:
    """The dtype Fabric stores parameters in: -mixed keeps fp32 weights and casts per op (autocast)."""
    if precision in ("bf16-true",):
        return torch.bfloat16
    if precision in ("16-true",):
        return torch.float16
    return torch.float32


def _compute_dtype(precision: str) -> torch.dtype:
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float32


@dataclass
class Part:
    name: str
    gib: float
    detail: str


@dataclass
class MemoryEstimate:
    """A ledger of predicted GPU memory (GiB, per GPU) and the host memory the run needs."""

    parts: list[Part]
    allocated_gib: float
    """Predicted peak allocated by torch."""
    total_gib: float
    """Predicted peak reserved by torch's allocator (allocated x allocator overhead): compare with the measured peak
    reserved memory."""
    device_gib: float
    """total_gib plus the CUDA context: what the GPU must have."""
    host_gib: float
    activations_per_token_layer: int
    """Bytes one token keeps per transformer block (the traced figure)."""
    tokens: int
    """Tokens per micro-batch the activations were sized for (micro_batch_size x max_seq_length, or
    data.pack_capacity)."""
    notes: list[str] = field(default_factory=list)
    allocator_overhead: float = ALLOCATOR_OVERHEAD
    """The reserved / allocated factor applied (ALLOCATOR_OVERHEAD, or ALLOCATOR_OVERHEAD_QLORA)."""

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["parts"] = {p.name: {"gib": p.gib, "detail": p.detail} for p in self.parts}
        return out

    def lines(self) -> list[str]:
        width = max(len(p.name) for p in self.parts)
        rows = [f"  {p.name:<{width}}  {p.gib:8.2f} GiB   {p.detail}" for p in self.parts]
        rows += [
            f"  {'= peak allocated':<{width}}  {self.allocated_gib:8.2f} GiB",
            f"  {'= peak reserved':<{width}}  {self.total_gib:8.2f} GiB"
            f"   (x{self.allocator_overhead} allocator overhead)",
            f"  {'+ CUDA context':<{width}}  {self.device_gib:8.2f} GiB   on the device (context ~{CUDA_CONTEXT_GIB} GiB)",
        ]
        return rows


# ----------------------------------------------------------------------------------------------------------------------
# Model state
# ----------------------------------------------------------------------------------------------------------------------


def _meta_model(recipe: Recipe, config):
    """The recipe's model on the meta device: exact parameter shapes and trainable flags, no memory."""
    if recipe.method in ("lora", "qlora"):
        from litgpt.lora import GPT, mark_only_lora_as_trainable
    else:
        from litgpt.model import GPT

        mark_only_lora_as_trainable = None
    with torch.device("meta"):
        model = GPT(config)
    if mark_only_lora_as_trainable is not None:
        mark_only_lora_as_trainable(model)
    return model


def _quantized_bytes_per_param(quantize: str) -> float:
    """4-bit weights: 0.5 byte + one fp32 absmax per block of 64 (4/64 B); double quantization stores the absmax in
    8 bits (1/64 B) plus one fp32 per 256 absmax blocks (bitsandbytes' defaults)."""
    if quantize.endswith("-dq"):
        return 0.5 + 1 / 64 + 4 / (64 * 256)
    return 0.5 + 4 / 64


def _optimizer_state_bytes(recipe: Recipe, trainable: list[torch.Tensor], param_bytes: int) -> tuple[float, str]:
    """Bytes of optimizer state for these trainable parameters, and a description."""
    path = recipe.optimizer.class_path
    args = recipe.optimizer.init_args
    name = path.rpartition(".")[2]
    n = sum(p.numel() for p in trainable)
    if path.startswith("bitsandbytes."):
        eight_bit = "8bit" in name
        states = 1 if "Momentum" in name or name.startswith(("SGD", "Lion", "RMSprop")) else 2
        if eight_bit:
            # blockwise 8-bit state (+ an fp32 absmax per 256 values) for tensors of >= min_8bit_size elements;
            # smaller tensors keep 32-bit state
            small = int(args.get("min_8bit_size", 4096))
            big = sum(p.numel() for p in trainable if p.numel() >= small)
            total = states * (big * (1 + 4 / 256) + (n - big) * 4)
            return total, f"{states} x 8-bit blockwise state ({name})"
        paged = " (paged: may move to host memory under pressure)" if "Paged" in name else ""
        return states * n * 4, f"{states} x fp32 state ({name}){paged}"
    if name in ("AdamW", "Adam", "NAdam", "RAdam", "Adamax"):
        extra = 1 if args.get("amsgrad") else 0
        return (2 + extra) * n * param_bytes, f"{2 + extra} moments x {param_bytes} B (AdamW keeps state in the param dtype)"
    if name == "SGD":
        if float(args.get("momentum", 0) or 0) > 0:
            return n * param_bytes, f"momentum buffer x {param_bytes} B"
        return 0.0, "none (SGD without momentum keeps no state)"
    if name in ("Adagrad", "RMSprop", "Adadelta"):
        return n * param_bytes * (2 if name == "Adadelta" else 1), f"state of {name}"
    return 2 * n * param_bytes, f"unknown optimizer {name}: assumed 2 states x {param_bytes} B"


# ----------------------------------------------------------------------------------------------------------------------
# Activations, traced
# ----------------------------------------------------------------------------------------------------------------------

_TRACE_CACHE: dict[tuple, int] = {}
_TRACE_VERSION = 6  # part of the cache key: bumped when the trace itself changes, so older results are not reused
# (2: the block's input in the parameters' dtype, autocast in the compute dtype: -mixed keeps fp32 norm inputs;
# 3: with Triton kernels, v out of the qkv output as its own tensor, as model.RopeQKV gives it;
# 4: LoRA layers as model.FusedLoRA keeps them; 5: the MLP's LoRA proj keeps SwiGLU's inputs, not its own;
# 6: dropout-0 adapters fused too, their `lambda x: x` made an nn.Identity)


def assumes_compiled(recipe: Recipe, compiled: bool | None) -> bool:
    """Which trace a prediction uses: the run's own decision when given (a run knows it), else compiled only for
    train.compile 'always'. 'auto' compiles only runs long enough to repay the compile (finetune.use_compile: none
    of the short benchmark runs), and an eager block keeps more (TinyLlama full bf16-true 82,056 against 71,048
    bytes per token and block): planning with it does not promise a fit that an eager run would miss."""
    return compiled if compiled is not None else recipe.train.compile == "always"


def activation_bytes_per_token_layer(
    recipe: Recipe, config, compiled: bool | None = None, cached_only: bool = False
) -> int | None:
    """Bytes autograd saves per token in one transformer block of this architecture, method and precision.

    Traced at two token counts and taken as the slope, so that anything saved once per step rather than per token
    (autocast's 16-bit weight casts, rotary tables) cancels out. A compiled block saves less than an eager one
    (inductor recomputes cheap ops such as the fp32 norm copies instead of keeping them), so compiled recipes are
    traced through aot_autograd with inductor's own partitioner; results are cached on disk by configuration."""
    compiled = assumes_compiled(recipe, compiled)
    key = repr((_TRACE_VERSION, repr(config), recipe.method, recipe.precision, tuple(recipe.lora.targets),
                recipe.lora.dropout, compiled, recipe.train.fast_lora, recipe.train.fused_rms_norm, recipe.train.fast_attention,
                recipe.train.lean_swiglu, recipe.train.triton_kernels, recipe.adds_grads_in_matmul, torch.__version__))
    if key not in _TRACE_CACHE:
        _TRACE_CACHE.update(_load_disk_cache())
    if key not in _TRACE_CACHE and cached_only:
        return None
    if key not in _TRACE_CACHE:
        measure = _saved_bytes_compiled if compiled else _saved_bytes
        small, large = measure(recipe, config, 16), measure(recipe, config, 48)
        _TRACE_CACHE[key] = math.ceil((large - small) / (48 - 16))
        _save_disk_cache(key, _TRACE_CACHE[key])
    return _TRACE_CACHE[key]


def _cache_path():
    import os
    from pathlib import Path

    return Path(os.environ.get("LITFT_CACHE", Path.home() / ".cache" / "litft")) / "activation_traces.json"


def _load_disk_cache() -> dict:
    import json

    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_disk_cache(key: str, value: int) -> None:
    import json
    import os

    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cache = _load_disk_cache()
        cache[key] = value
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: trace again next time


class _RMSNormAsOnCuda(torch.autograd.Function):
    """The eager trace's stand-in for torch's rms_norm: it keeps what the fused CUDA kernel keeps for its backward
    pass (the input, and one fp32 scale per row). On the CPU rms_norm runs as a composite of ops that keep fp32
    copies of the input, which the GPU never allocates. The trace runs forward only."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the trace never runs backward
        raise NotImplementedError("_RMSNormAsOnCuda is for counting saved tensors only")


def _rms_norm_as_on_cuda(self, x: torch.Tensor) -> torch.Tensor:
    from litft.model import rms_norm_weight

    return _RMSNormAsOnCuda.apply(x, rms_norm_weight(self), self.eps)


class _SeededDropoutAsOnCuda(torch.autograd.Function):
    """The eager trace's stand-in for model.SeededDropout (train.triton_kernels on CUDA): torch's dropout, keeping
    what the Triton kernel keeps for its backward pass, a seed, and not torch's 1-byte mask per element."""

    @staticmethod
    def forward(ctx, x, p):
        ctx.save_for_backward(torch.zeros(1, dtype=torch.int64))
        return torch.nn.functional.dropout(x, p)

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the trace never runs backward
        raise NotImplementedError("_SeededDropoutAsOnCuda is for counting saved tensors only")


class _SeededDropoutModule(torch.nn.Dropout):
    def forward(self, x):
        return _SeededDropoutAsOnCuda.apply(x, self.p) if self.training else x


class _FusedLoRAAsOnCuda(torch.autograd.Function):
    """The eager trace's stand-in for model.FusedLoRA (train.triton_kernels with train.grad_into_weights on CUDA):
    the same output from torch ops, keeping what FusedLoRA keeps for its backward pass: the layer's input itself
    (one tensor however many layers read it), or SwiGLU's two inputs for the MLP's proj, the r-wide A output and a
    seed; no dropped copy, no mask."""

    @staticmethod
    def forward(ctx, x, lora_a, lora_b, linear, scale, p, parts, gate=None, up=None):
        from litft.model import add_low_rank_parts_

        after_a = torch.nn.functional.dropout(x, p).mm(lora_a.t())
        ctx.save_for_backward(up if gate is not None else x, gate, after_a, torch.zeros(1, dtype=torch.int64))
        return add_low_rank_parts_(linear(x), after_a, lora_b, scale, parts)

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the trace never runs backward
        raise NotImplementedError("_FusedLoRAAsOnCuda is for counting saved tensors only")


def _fused_lora_as_on_cuda(self, x: torch.Tensor, swiglu_inputs: tuple | None = None) -> torch.Tensor:
    from litft.model import _dropout_p, lora_parts

    rows = x.reshape(-1, x.shape[-1])
    rebuild = [t.reshape(rows.shape) for t in swiglu_inputs] if swiglu_inputs is not None else [None, None]
    out = _FusedLoRAAsOnCuda.apply(rows, self.lora_A, self.lora_B, self.linear, self.scaling, _dropout_p(self),
                                   lora_parts(self), *rebuild)
    return out.view(*x.shape[:-1], -1)


def _mlp_as_on_cuda(self, x: torch.Tensor) -> torch.Tensor:
    """model.mlp_forward as it runs on CUDA with train.triton_kernels: the LoRA proj is told SwiGLU's inputs."""
    from litft.model import SwiGLU

    gate, up = self.fc_1(x), self.fc_2(x)
    return self.proj(SwiGLU.apply(gate, up, False), swiglu_inputs=(gate, up))


def _trace_block(recipe: Recipe, config, tokens: int, compiled: bool = False):
    """One block of the recipe's architecture on the CPU with uninitialised weights, and inputs for `tokens`, with
    the layers the run uses (model.use_fast_layers; for an eager trace, rms_norm as it behaves on CUDA)."""
    import types

    from litgpt.model import RMSNorm, build_rope_cache

    from litft.model import mlp_forward, use_fast_layers

    if recipe.method in ("lora", "qlora"):
        from litgpt.lora import Block, mark_only_lora_as_trainable
    else:
        from litgpt.model import Block

        mark_only_lora_as_trainable = None
    param_dtype = _param_dtype(recipe.precision)
    compute = _compute_dtype(recipe.precision)
    with torch.device("meta"):
        block = Block(config, 0).to(param_dtype)
    block = block.to_empty(device="cpu")
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)  # finite values: a compiled trace runs real kernels
    if mark_only_lora_as_trainable is not None:
        mark_only_lora_as_trainable(block)
    use_fast_layers(block, lora=recipe.train.fast_lora, norm=recipe.train.fused_rms_norm,
                    attention=recipe.train.fast_attention, swiglu=recipe.train.lean_swiglu,
                    mixed_linear=recipe.recasts_mixed_weights)
    if recipe.train.fused_rms_norm and not compiled:
        for module in block.modules():
            if isinstance(module, RMSNorm) and "forward" in vars(module):
                module.forward = types.MethodType(_rms_norm_as_on_cuda, module)
    if recipe.train.triton_kernels and recipe.train.fast_attention and not compiled:
        from litgpt.model import CausalSelfAttention

        for module in block.modules():  # q, k, v out of the qkv output as on CUDA (model.RopeQKV's torch path)
            if isinstance(module, CausalSelfAttention) and "forward" in vars(module):
                module.triton_kernels = True
    if recipe.train.triton_kernels and recipe.train.fast_lora and not compiled:
        from litgpt.lora import LoRALayer

        # the fast LoRA layers as on CUDA: whole layers as model.FusedLoRA where train.grad_into_weights applies
        # (in 16 bits), else their dropout as model.SeededDropout
        fused = recipe.adds_grads_in_matmul and compute in (torch.bfloat16, torch.float16)
        for module in block.modules():
            if not (isinstance(module, LoRALayer) and "forward" in vars(module) and module.r > 0):
                continue
            if fused and isinstance(module.lora_dropout, (torch.nn.Dropout, torch.nn.Identity)):
                module.forward = types.MethodType(_fused_lora_as_on_cuda, module)
            elif isinstance(module.lora_dropout, torch.nn.Dropout):
                module.lora_dropout = _SeededDropoutModule(module.lora_dropout.p)
        for module in block.modules():  # mlp_forward (train.lean_swiglu) before a FusedLoRA proj
            proj = getattr(module, "proj", None)
            if ("forward" in vars(module) and getattr(module.forward, "__func__", None) is mlp_forward
                    and getattr(getattr(proj, "forward", None), "__func__", None) is _fused_lora_as_on_cuda):
                module.forward = types.MethodType(_mlp_as_on_cuda, module)
    block.train()
    # the residual stream has the embedding's dtype: the parameters' (fp32 under -mixed, where each norm then keeps
    # an fp32 input for the backward pass; a 16-bit stand-in undercounted that and kept rms_norm from its fused path)
    x = torch.randn(1, tokens, config.n_embd, dtype=param_dtype, requires_grad=True)
    cos, sin = build_rope_cache(tokens, config.rope_n_elem, device=torch.device("cpu"))
    return block, x, cos.unsqueeze(0).to(compute), sin.unsqueeze(0).to(compute)


def _saved_bytes_compiled(recipe: Recipe, config, tokens: int) -> int:
    """What a torch.compile'd block saves: the inputs of its backward graph (not the incoming gradients), as
    partitioned by inductor's min-cut rematerialisation, without generating any code."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    with torch.random.fork_rng():
        torch.manual_seed(0)
        block, x, cos, sin = _trace_block(recipe, config, tokens, compiled=True)
        saved = {"bytes": 0}

        def backward_compiler(gm, example_inputs):
            for node in gm.graph.nodes:
                value = node.meta.get("val")
                if node.op == "placeholder" and not node.name.startswith("tangents") and isinstance(value, torch.Tensor):
                    saved["bytes"] += value.numel() * value.element_size()
            return make_boxed_func(gm)

        backend = aot_autograd(fw_compiler=lambda gm, inputs: make_boxed_func(gm), bw_compiler=backward_compiler,
                               partition_fn=min_cut_rematerialization_partition)
        torch._dynamo.reset()
        with _autocast(recipe):
            out = torch.compile(block, backend=backend, dynamic=False)(x, cos, sin)
        out.float().sum().backward()
        torch._dynamo.reset()
    return saved["bytes"]


def _saved_bytes(recipe: Recipe, config, tokens: int) -> int:
    """Run one block forward on the CPU (eager) and sum the storage of every tensor saved for backward
    (parameters, buffers and the rotary tables excluded; storage shared by several saved views counted once).

    QLoRA is traced unquantized: a frozen bitsandbytes 4-bit matmul keeps the same activations as a frozen 16-bit
    one (it needs the weight, not the input, for the input gradient), and quantizing on the CPU is slow."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        block, x, cos, sin = _trace_block(recipe, config, tokens)
        excluded = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *block.buffers(), cos, sin]}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in excluded and ptr not in saved:
                saved[ptr] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(recipe):
            block(x, cos, sin)
    return sum(saved.values())


def _autocast(recipe: Recipe):
    """-mixed precision traces under CPU autocast (16-bit matmuls over fp32 weights); others need no context."""
    mixed = recipe.precision.endswith("-mixed")
    return torch.autocast("cpu", dtype=_compute_dtype(recipe.precision)) if mixed else contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------------------------------
# The ledger
# ----------------------------------------------------------------------------------------------------------------------


SHARDING = ("none", "zero2", "zero3")
OFFLOAD = ("none", "optimizer", "optimizer+params")


def estimate_memory(
    recipe: Recipe, config=None, tokens: int | None = None, compiled: bool | None = None, cached_only: bool = False,
    sharding: str = "none", offload: str = "none",
) -> MemoryEstimate | None:
    """Predict the peak GPU memory of a recipe, per GPU, part by part.

    `tokens`: positions in the largest micro-batch (a run passes what its data can form); by default the recipe's
    bound, micro_batch_size x max_seq_length (data.pack_capacity under data.pack_steps). `cached_only`: return None
    rather than trace the activations (used by `litft ls`, which must stay instant). `sharding` and `offload` plan a
    sharded run over recipe.devices GPUs (see shard_model_state; litft's own loop runs DDP, which replicates:
    'none')."""
    from litft.model import model_config

    config = config or model_config(recipe)
    model = _meta_model(recipe, config)
    param_dtype = _param_dtype(recipe.precision)
    pbytes = _BYTES[param_dtype]
    compute_bytes = _BYTES[_compute_dtype(recipe.precision)]
    mixed = recipe.precision.endswith("-mixed")
    qlora = recipe.method == "qlora"

    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    n_frozen = sum(p.numel() for _, p in frozen)

    parts: list[Part] = []
    # weights
    if qlora:
        # the 4-bit layers: LoRA's base linears and the output layer
        quantized = [p.numel() for n, p in frozen if n.endswith("linear.weight") or n.endswith("lm_head.weight")]
        linear_frozen = sum(quantized)
        other_frozen = n_frozen - linear_frozen
        q = _quantized_bytes_per_param(recipe.quantize)
        weights = linear_frozen * q + other_frozen * pbytes + n_trainable * pbytes
        detail = (f"{linear_frozen / 1e9:.2f}B linear weights x {q:.3f} B ({recipe.quantize}) +"
                  f" {(other_frozen + n_trainable) / 1e6:.1f}M others x {pbytes} B")
    else:
        weights = (n_trainable + n_frozen) * pbytes
        detail = f"{(n_trainable + n_frozen) / 1e9:.3f}B params x {pbytes} B ({param_dtype})".replace("torch.", "")
        if mixed:
            detail += ": the fp32 master weights of -mixed"
    parts.append(Part("weights", weights / GIB, detail))
    if mixed:
        matrices = [p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n]
        if recipe.recasts_mixed_weights and sharding == "none":
            # train.lean_mixed_linear: one layer's cast alive at a time (the largest: usually the output layer).
            # A sharded plan is for FSDP/DeepSpeed, whose own mixed precision keeps the casts (see shard_model_state)
            parts.append(Part("16-bit weight copies", max(matrices) * compute_bytes / GIB,
                              "one layer's cast at a time (train.lean_mixed_linear recasts in the backward pass)"))
        else:
            # autocast casts each weight to 16 bits for its matmul and keeps the cast for the backward pass
            parts.append(Part("16-bit weight copies", sum(matrices) * compute_bytes / GIB,
                              "autocast's per-step casts, kept for the backward pass"))

    grads = n_trainable * pbytes
    parts.append(Part("gradients", grads / GIB, f"{n_trainable / 1e6:.1f}M trainable x {pbytes} B"))
    opt_bytes, opt_detail = _optimizer_state_bytes(recipe, trainable, pbytes)
    parts.append(Part("optimizer state", opt_bytes / GIB, opt_detail))
    host_offloaded = 0.0
    if sharding != "none" or offload != "none":
        block_params = sum(p.numel() for p in model.transformer.h[0].parameters())
        host_offloaded = shard_model_state(parts, recipe.devices, sharding, offload, block_params, compute_bytes, mixed)

    # activations
    tokens = tokens or (recipe.step_capacity if recipe.packs_steps else
                        recipe.train.micro_batch_size * recipe.data.max_seq_length)
    per_token_layer = activation_bytes_per_token_layer(recipe, config, compiled, cached_only)
    if per_token_layer is None:  # cached_only and not traced yet
        return None
    if recipe.train.activation_checkpointing:
        block_input = config.n_embd * compute_bytes
        acts = tokens * (config.n_layer * block_input + per_token_layer)
        act_detail = (f"{tokens:,} tokens x ({config.n_layer} blocks x {block_input:,} B kept input + one block"
                      f" recomputed {per_token_layer:,} B)")
    else:
        acts = tokens * config.n_layer * per_token_layer
        how = "compiled" if assumes_compiled(recipe, compiled) else "eager"
        act_detail = f"{tokens:,} tokens x {config.n_layer} blocks x {per_token_layer:,} B/token/block (traced, {how})"
    parts.append(Part("activations", acts / GIB, act_detail))

    # the loss, one chunk of positions at a time (train.loss_chunk; each chunk's logits are recomputed in the backward
    # pass): with train.triton_kernels (a CUDA run's default), the lm_head output in the compute dtype, its gradient
    # written over it (model.CrossEntropySum): compute-dtype bytes per (position x vocabulary entry); with torch's
    # cross-entropy, the output, its fp32 upcast, log-softmax saved for the backward pass, and the logits' gradient:
    # 2 + 4 + 4 + 2 bytes
    vocab = config.padded_vocab_size
    chunk = min(tokens, recipe.train.loss_chunk) if recipe.train.loss_chunk > 0 else tokens
    per_logit = compute_bytes if recipe.train.triton_kernels else 2 * compute_bytes + 4 + 4
    parts.append(Part("logits and loss", chunk * vocab * per_logit / GIB,
                      f"{chunk:,} positions (one loss chunk) x {vocab:,} vocab x {per_logit} B"
                      + (" (Triton cross-entropy)" if recipe.train.triton_kernels else "")))
    if qlora:
        # bitsandbytes multiplies by a 4-bit weight through a dequantized copy in the compute dtype, made for each
        # matmul (its backward pass's input gradient, and model.FusedLoRA's): one layer's copy is alive at a time,
        # at the peak the output layer's, whose backward pass runs first
        largest = max(quantized)
        parts.append(Part("dequantized weight", largest * compute_bytes / GIB,
                          f"one 4-bit layer's weight in {compute_bytes} B for its matmul ({largest / 1e6:.1f}M)"))

    allocated = sum(p.gib for p in parts)
    overhead = ALLOCATOR_OVERHEAD_QLORA if qlora else ALLOCATOR_OVERHEAD
    total = allocated * overhead
    notes = []
    if recipe.grad_accum == 1 and recipe.method == "full":
        notes.append("accumulation 1: gradients and a micro-batch's activations overlap only in part; the ledger"
                     " counts both in full (an upper bound)")
    host = (n_trainable + n_frozen) * pbytes / GIB  # loading a checkpoint memory-maps it; about one copy at most
    if host_offloaded:
        host += host_offloaded
        notes.append(f"offload: {host_offloaded:.1f} GiB of host RAM for what all {recipe.devices} ranks move there"
                     " (DeepSpeed pins it: it must be free RAM, not swap)")
    return MemoryEstimate(
        parts=parts,
        allocated_gib=allocated,
        total_gib=total,
        device_gib=total + CUDA_CONTEXT_GIB,
        host_gib=host,
        activations_per_token_layer=per_token_layer,
        tokens=tokens,
        notes=notes,
        allocator_overhead=overhead,
    )


def shard_model_state(parts: list[Part], devices: int, sharding: str, offload: str, block_params: int,
                      compute_bytes: int, mixed: bool) -> float:
    """Rewrite the model-state parts of a ledger (in place) for a sharded run over `devices` GPUs; return the GiB
    of host RAM that offload takes, for all ranks together. Activations and the loss are per GPU: unchanged.

        sharding   weights                              gradients   optimizer state
        zero2      full (gathered for forward/backward)  / devices   / devices    (FSDP SHARD_GRAD_OP, ZeRO-2)
        zero3      / devices + 2 blocks gathered         / devices   / devices    (FSDP FULL_SHARD, ZeRO-3)

    Two blocks gathered: the one computing and the next one prefetched, in the compute dtype. With -mixed, zero3
    gathers each block already cast to 16 bits (those are the 16-bit copies); under zero2 every layer's copy stays
    until its backward. Offload (DeepSpeed ZeRO-Offload / ZeRO-Infinity): 'optimizer' moves the
    optimizer state, and under -mixed the fp32 master weights it updates, to host RAM (the GPU keeps the 16-bit
    weights); 'optimizer+params' (zero3 only) also moves the sharded weights, leaving only the gathered blocks."""
    if sharding not in SHARDING:
        raise ValueError(f"sharding '{sharding}': choose one of {', '.join(SHARDING)}")
    if offload not in OFFLOAD:
        raise ValueError(f"offload '{offload}': choose one of {', '.join(OFFLOAD)}")
    if offload != "none" and sharding == "none":
        raise ValueError("offload needs sharding zero2 or zero3 (DeepSpeed offloads its ZeRO partitions)")
    if offload == "optimizer+params" and sharding != "zero3":
        raise ValueError("offload optimizer+params needs sharding zero3 (only ZeRO-3 partitions the weights)")
    by_name = {p.name: p for p in parts}
    n = max(devices, 1)
    gathered = 2 * block_params * compute_bytes / GIB
    host = 0.0
    weights, grads, state = by_name["weights"], by_name["gradients"], by_name["optimizer state"]
    copies = by_name.get("16-bit weight copies")
    full_weights = weights.gib

    grads.gib /= n
    grads.detail += f", sharded over {n} GPUs"
    if offload != "none":
        host += state.gib  # every rank's share, all on the one host
        state.detail += f": moved to host RAM ({state.gib:.2f} GiB for all ranks)"
        state.gib = 0.0
    else:
        state.gib /= n
        state.detail += f", sharded over {n} GPUs"

    if mixed and offload != "none":
        # the fp32 master weights go with the optimizer; the GPU trains on the 16-bit copies
        host += full_weights
        sixteen = full_weights * compute_bytes / 4
        weights.gib, weights.detail = sixteen, f"16-bit weights (fp32 master copy on the host: {full_weights:.2f} GiB)"
        if copies is not None:
            parts.remove(copies)
            copies = None
        full_weights = sixteen
    if sharding == "zero3":
        if offload == "optimizer+params":
            host += full_weights
            weights.gib = gathered
            weights.detail = f"on the host ({full_weights:.2f} GiB); 2 blocks gathered on the GPU at a time"
        else:
            weights.gib = full_weights / n + gathered
            weights.detail += f", sharded over {n} GPUs + 2 blocks gathered ({gathered:.2f} GiB)"
        if copies is not None:  # FSDP gathers in the compute dtype: the casts are the gathered blocks above
            parts.remove(copies)
    else:
        weights.detail += " (replicated: zero2 shards gradients and optimizer state only)"
    return host


# ----------------------------------------------------------------------------------------------------------------------
# What would fit
# ----------------------------------------------------------------------------------------------------------------------

# Changes in the order of how much they alter the training: same maths first, then precision, optimizer, method, data.
def _candidate_changes(recipe: Recipe) -> list[tuple[str, dict]]:
    t = recipe.train
    out: list[tuple[str, dict]] = []
    # data.pack_capacity overrides micro_batch_size x max_seq_length as a micro-batch's positions: drop it first
    unset_capacity = {"data": {"pack_capacity": None}} if recipe.data.pack_capacity is not None else {}
    if unset_capacity and recipe.data.pack_capacity > t.micro_batch_size * recipe.data.max_seq_length:
        out.append((f"data.pack_capacity null (micro-batches of {t.micro_batch_size * recipe.data.max_seq_length:,}"
                    " positions, same global batch)", unset_capacity))
    micro = t.micro_batch_size // 2
    while micro >= 1:
        out.append((f"train.micro_batch_size {micro} (same global batch, more accumulation)",
                    {"train": {"micro_batch_size": micro}, **unset_capacity}))
        micro //= 2
    if not t.activation_checkpointing:
        out.append(("train.activation_checkpointing true (~30% more compute)", {"train": {"activation_checkpointing": True}}))
    if recipe.precision.endswith("-mixed"):
        out.append(("precision bf16-true (no fp32 master weights or fp32 Adam state)", {"precision": "bf16-true"}))
    if recipe.method == "full":
        out.append(("optimizer bitsandbytes.optim.AdamW8bit (8-bit Adam state)",
                    {"optimizer": {"class_path": "bitsandbytes.optim.AdamW8bit"}}))
        out.append(("optimizer torch.optim.SGD, momentum 0 (no optimizer state)",
                    {"optimizer": {"class_path": "torch.optim.SGD", "init_args": {"momentum": 0.0}}}))
        out.append(("method lora (frozen weights, small adapters)", {"method": "lora"}))
    if recipe.method in ("full", "lora") and not recipe.precision.endswith("-mixed"):
        out.append(("method qlora, quantize nf4-dq (4-bit frozen weights)", {"method": "qlora", "quantize": "nf4-dq"}))
    if recipe.data.max_seq_length >= 256:
        out.append((f"data.max_seq_length {recipe.data.max_seq_length // 2} (truncates long samples)",
                    {"data": {"max_seq_length": recipe.data.max_seq_length // 2}}))
    return out


def _apply(recipe: Recipe, change: dict) -> Recipe:
    updates = {}
    for key, value in change.items():
        if isinstance(value, dict) and key != "optimizer":
            updates[key] = dataclasses.replace(getattr(recipe, key), **value)
        elif key == "optimizer":
            spec = recipe.optimizer
            cls_path = value.get("class_path", spec.class_path)
            module_name, _, class_name = cls_path.rpartition(".")
            params = inspect.signature(getattr(importlib.import_module(module_name), class_name).__init__).parameters
            args = {k: v for k, v in spec.init_args.items() if k in params}
            args.update(value.get("init_args", {}))
            updates[key] = dataclasses.replace(spec, class_path=cls_path, init_args=args)
        else:
            updates[key] = value
    return dataclasses.replace(recipe, **updates)


def what_would_fit(recipe: Recipe, budget_gib: float) -> list[dict[str, Any]]:
    """Single changes (and, when none fits alone, pairs) that bring the predicted device memory under the budget,
    least intrusive first, each with the GiB it saves."""
    base = estimate_memory(recipe)
    changes = _candidate_changes(recipe)
    results = []
    for label, change in changes:
        est = estimate_memory(_apply(recipe, change))
        results.append({"change": label, "overrides": change, "device_gib": est.device_gib,
                        "saving_gib": base.device_gib - est.device_gib, "fits": est.device_gib <= budget_gib})
    fitting = [r for r in results if r["fits"]]
    if fitting:
        return fitting
    pairs = []
    for i, (label_a, change_a) in enumerate(changes):
        for label_b, change_b in changes[i + 1 :]:
            if set(change_a) & set(change_b) - {"train", "data"}:  # these two merge key by key
                continue
            merged = _merge(change_a, change_b)
            est = estimate_memory(_apply(recipe, merged))
            if est.device_gib <= budget_gib:
                pairs.append({"change": f"{label_a} + {label_b}", "overrides": merged, "device_gib": est.device_gib,
                              "saving_gib": base.device_gib - est.device_gib, "fits": True})
    return pairs[:8]


def _merge(a: dict, b: dict) -> dict:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in a.items()}
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out
