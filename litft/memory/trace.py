"""Activations, traced: the bytes one transformer block keeps for its backward pass, per token.

One block of the recipe's architecture, method and dtype runs on the CPU for a few tokens under
`torch.autograd.graph.saved_tensors_hooks`, with the layers the run's plan installs (litft.layers.use_fast_layers with
plan.layers), and every tensor autograd keeps (parameters excluded, shared storage counted once) is summed. Where the
plan runs a CUDA-only kernel, the trace runs a stand-in that keeps what the kernel keeps; which stand-in is read from
the same plan, so the trace follows the run. A compiled block is traced through aot_autograd with inductor's own
partitioner. Results are cached on disk by configuration.
"""

from __future__ import annotations

import contextlib
import math
import os
import types
from pathlib import Path

import torch

from litft.files import write_json_atomic
from litft.plan import Plan
from litft.recipe import Recipe

_TRACE_CACHE: dict[str, int] = {}
_TRACE_VERSION = 7  # part of the cache key: bumped when the trace itself changes, so older results are not reused


def activation_bytes_per_token_layer(recipe: Recipe, config, plan: Plan, cached_only: bool = False) -> int | None:
    """Bytes autograd saves per token in one transformer block of this architecture, method and precision, with
    the plan's layers (compiled or eager as the plan says).

    Traced at two token counts and taken as the slope, so that anything saved once per step rather than per token
    (autocast's 16-bit weight casts, rotary tables) cancels out. A compiled block saves less than an eager one
    (inductor recomputes cheap ops such as the fp32 norm copies instead of keeping them). ``cached_only``: None
    rather than trace (for `litft ls`, which must stay instant)."""
    key = repr((_TRACE_VERSION, repr(config), recipe.method, recipe.precision, tuple(recipe.lora.targets),
                recipe.lora.dropout, plan.compile, plan.layers, torch.__version__))
    if key not in _TRACE_CACHE:
        _TRACE_CACHE.update(_load_disk_cache())
    if key not in _TRACE_CACHE and cached_only:
        return None
    if key not in _TRACE_CACHE:
        measure = _saved_bytes_compiled if plan.compile else _saved_bytes
        small, large = measure(recipe, config, plan, 16), measure(recipe, config, plan, 48)
        _TRACE_CACHE[key] = math.ceil((large - small) / (48 - 16))
        _save_disk_cache(key, _TRACE_CACHE[key])
    return _TRACE_CACHE[key]


def _cache_path() -> Path:
    return Path(os.environ.get("LITFT_CACHE", Path.home() / ".cache" / "litft")) / "activation_traces.json"


def _load_disk_cache() -> dict:
    import json

    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_disk_cache(key: str, value: int) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cache = _load_disk_cache()
        cache[key] = value
        write_json_atomic(path, cache, durable=False)
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
    from litft.layers.norm import rms_norm_weight

    return _RMSNormAsOnCuda.apply(x, rms_norm_weight(self), self.eps)


class _SeededDropoutAsOnCuda(torch.autograd.Function):
    """The eager trace's stand-in for layers.lora.SeededDropout (train.triton_kernels on CUDA): torch's dropout, keeping
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
    """The eager trace's stand-in for layers.lora_fused.FusedLoRA (the plan's fused_lora): the same output from torch
    ops, keeping what FusedLoRA keeps for its backward pass: the layer's input itself
    (one tensor however many layers read it), or SwiGLU's two inputs for the MLP's proj, the r-wide A output and a
    seed; no dropped copy, no mask."""

    @staticmethod
    def forward(ctx, x, lora_a, lora_b, linear, scale, p, parts, gate=None, up=None):
        from litft.layers.lora_math import add_low_rank_parts_

        after_a = torch.nn.functional.dropout(x, p).mm(lora_a.t())
        ctx.save_for_backward(up if gate is not None else x, gate, after_a, torch.zeros(1, dtype=torch.int64))
        return add_low_rank_parts_(linear(x), after_a, lora_b, scale, parts)

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the trace never runs backward
        raise NotImplementedError("_FusedLoRAAsOnCuda is for counting saved tensors only")


def _fused_lora_as_on_cuda(self, x: torch.Tensor, swiglu_inputs: tuple | None = None) -> torch.Tensor:
    from litft.layers.lora_math import dropout_p, lora_parts

    rows = x.reshape(-1, x.shape[-1])
    rebuild = [t.reshape(rows.shape) for t in swiglu_inputs] if swiglu_inputs is not None else [None, None]
    out = _FusedLoRAAsOnCuda.apply(rows, self.lora_A, self.lora_B, self.linear, self.scaling, dropout_p(self),
                                   lora_parts(self), *rebuild)
    return out.view(*x.shape[:-1], -1)


def _mlp_as_on_cuda(self, x: torch.Tensor) -> torch.Tensor:
    """layers.mlp.mlp_forward as it runs on CUDA with train.triton_kernels: the LoRA proj is told SwiGLU's inputs."""
    from litft.layers.mlp import SwiGLU

    gate, up = self.fc_1(x), self.fc_2(x)
    return self.proj(SwiGLU.apply(gate, up, False), swiglu_inputs=(gate, up))


def _trace_block(recipe: Recipe, config, plan: Plan, tokens: int):
    """One block of the recipe's architecture on the CPU with random weights, and inputs for ``tokens``, with the
    plan's layers, and stand-ins for what the plan runs in CUDA-only kernels (eager blocks)."""
    from litgpt.model import build_rope_cache

    from litft.layers import use_fast_layers

    if recipe.method in ("lora", "qlora"):
        from litgpt.lora import Block, mark_only_lora_as_trainable
    else:
        from litgpt.model import Block

        mark_only_lora_as_trainable = None
    param_dtype, compute = plan.precision.param_dtype, plan.precision.compute_dtype
    with torch.device("meta"):
        block = Block(config, 0).to(param_dtype)
    block = block.to_empty(device="cpu")
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)  # finite values: a compiled trace runs real kernels
    if mark_only_lora_as_trainable is not None:
        mark_only_lora_as_trainable(block)
    use_fast_layers(block, plan.layers)
    if not plan.compile:
        _stand_in_cuda_kernels(block, plan)
    block.train()
    # the residual stream has the embedding's dtype: the parameters' (fp32 under -mixed, where each norm then keeps
    # an fp32 input for the backward pass)
    x = torch.randn(1, tokens, config.n_embd, dtype=param_dtype, requires_grad=True)
    cos, sin = build_rope_cache(tokens, config.rope_n_elem, device=torch.device("cpu"))
    return block, x, cos.unsqueeze(0).to(compute), sin.unsqueeze(0).to(compute)


def _stand_in_cuda_kernels(block: torch.nn.Module, plan: Plan) -> None:
    """Where the plan runs a kernel that exists only on CUDA, a stand-in that keeps what that kernel keeps: torch's
    fused rms_norm (fused_rms_norm), the seeded LoRA dropout (triton_kernels), whole FusedLoRA layers (fused_lora)
    and the MLP's proj keeping SwiGLU's inputs. (RoPE's qkv split runs its torch path on the CPU, which keeps what
    the kernel keeps.)"""
    from litgpt.lora import LoRALayer
    from litgpt.model import RMSNorm

    from litft.layers.mlp import mlp_forward

    layers = plan.layers
    for module in block.modules():
        if layers.fused_rms_norm and isinstance(module, RMSNorm) and "forward" in vars(module):
            module.forward = types.MethodType(_rms_norm_as_on_cuda, module)
        if not (layers.triton_kernels and isinstance(module, LoRALayer) and "forward" in vars(module)
                and module.r > 0):
            continue
        if layers.fused_lora and isinstance(module.lora_dropout, (torch.nn.Dropout, torch.nn.Identity)):
            module.forward = types.MethodType(_fused_lora_as_on_cuda, module)
        elif isinstance(module.lora_dropout, torch.nn.Dropout):
            module.lora_dropout = _SeededDropoutModule(module.lora_dropout.p)
    for module in block.modules():  # mlp_forward (lean_swiglu) before a FusedLoRA proj
        proj = getattr(module, "proj", None)
        if ("forward" in vars(module) and getattr(module.forward, "__func__", None) is mlp_forward
                and getattr(getattr(proj, "forward", None), "__func__", None) is _fused_lora_as_on_cuda):
            module.forward = types.MethodType(_mlp_as_on_cuda, module)


def _saved_bytes_compiled(recipe: Recipe, config, plan: Plan, tokens: int) -> int:
    """What a torch.compile'd block saves: the inputs of its backward graph (not the incoming gradients), as
    partitioned by inductor's min-cut rematerialisation, without generating any code."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    with torch.random.fork_rng():
        torch.manual_seed(0)
        block, x, cos, sin = _trace_block(recipe, config, plan, tokens)
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
        with _autocast(plan):
            out = torch.compile(block, backend=backend, dynamic=False)(x, cos, sin)
        out.float().sum().backward()
        torch._dynamo.reset()
    return saved["bytes"]


def _saved_bytes(recipe: Recipe, config, plan: Plan, tokens: int) -> int:
    """Run one block forward on the CPU (eager) and sum the storage of every tensor saved for backward
    (parameters, buffers and the rotary tables excluded; storage shared by several saved views counted once).

    QLoRA is traced unquantized: a frozen bitsandbytes 4-bit matmul keeps the same activations as a frozen 16-bit
    one (it needs the weight, not the input, for the input gradient), and quantizing on the CPU is slow."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        block, x, cos, sin = _trace_block(recipe, config, plan, tokens)
        excluded = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *block.buffers(), cos, sin]}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in excluded and ptr not in saved:
                saved[ptr] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(plan):
            block(x, cos, sin)
    return sum(saved.values())


def _autocast(plan: Plan):
    """-mixed precision traces under CPU autocast (16-bit matmuls over fp32 weights); others need no context."""
    precision = plan.precision
    return torch.autocast("cpu", dtype=precision.compute_dtype) if precision.mixed else contextlib.nullcontext()
