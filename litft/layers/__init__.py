"""litft's training layers, each beside the LitGPT layer it replaces, installed per instance by
:func:`use_fast_layers` as the plan's :class:`~litft.plan.LayerPlan` names them (LitGPT's classes stay untouched, and
a module the plan leaves alone runs LitGPT's own forward).

    attention.py   packed rows, RoPE with the qkv split, grouped k/v heads to the kernels   (CausalSelfAttention)
    mlp.py         SwiGLU with its silu recomputed in the backward pass                    (LLaMAMLP)
    lora.py        LoRA layers as plain matmuls; adapters' gradients into .grad            (LoRALinear, LoRAQKVLinear)
    lora_fused.py  whole LoRA layers, pairs and MLPs in Triton kernels                     (the same, on CUDA)
    lora_math.py   LoRA's arithmetic shared by the two above
    linear.py      -mixed precision without kept 16-bit copies; weight gradients into .grad (nn.Linear)
    norm.py        torch's fused rms_norm; the residual add fused into the norm            (RMSNorm)
    loss.py        the summed cross-entropy, chunked, in a Triton kernel on CUDA           (GPT's head + loss)
"""

from __future__ import annotations

import types

import torch

from litft.layers.attention import attention_forward, packed_attention
from litft.layers.linear import grad_into_weight_forward, mixed_linear_forward
from litft.layers.lora import lora_linear_forward, lora_qkv_forward
from litft.layers.lora_math import LoRASeeds
from litft.layers.mlp import mlp_forward
from litft.layers.norm import rms_norm_forward
from litft.plan import LayerPlan


def use_fast_layers(model: torch.nn.Module, layers: LayerPlan = LayerPlan()) -> None:
    """Install litft's layers in ``model`` (a LitGPT GPT, or a Block) as ``layers`` says: packed attention always
    (LitGPT's own attention otherwise); attention_forward (fast_attention); the matmul LoRA layers (fast_lora), with
    the plan's grad_into_weights, triton_kernels and fused_lora on each; torch's rms_norm (fused_rms_norm);
    mlp_forward in LLaMA MLPs (lean_swiglu); and in every plain nn.Linear (LoRA's base layers and the output layer
    included; bitsandbytes' 4-bit layers, a subclass, keep theirs) mixed_linear_forward (lean_mixed_linear) or
    grad_into_weight_forward (grad_into_weights)."""
    from litgpt.lora import LoRALinear, LoRAQKVLinear
    from litgpt.model import CausalSelfAttention, LLaMAMLP, RMSNorm

    seeds = LoRASeeds()  # FusedLoRA's dropout seed, one per forward pass (CausalLM.forward draws it)
    lora_layers = 0
    for module in model.modules():
        if layers.fast_lora and isinstance(module, (LoRAQKVLinear, LoRALinear)):
            module.lora_seeds, module.lora_salt = seeds, lora_layers
            lora_layers += 1
            if _is_identity_function(module.lora_dropout):
                # LitGPT gives a dropout-0 adapter `lambda x: x`, which the fused paths cannot tell from any other
                # function; as an nn.Identity (no parameters or state) it runs them as a dropout of 0 (no mask drawn)
                module.lora_dropout = torch.nn.Identity()
            module.forward = types.MethodType(
                lora_qkv_forward if isinstance(module, LoRAQKVLinear) else lora_linear_forward, module)
            module.grads_into_adapters, module.triton_kernels = layers.grad_into_weights, layers.triton_kernels
            module.fused_lora = layers.fused_lora
        elif layers.lean_swiglu and type(module).__name__ == "LLaMAMLP" and isinstance(module, LLaMAMLP):
            # LLaMAMLP itself and litgpt.lora's LLaMAMLP (same forward, LoRA layers inside), not other subclasses
            module.forward = types.MethodType(mlp_forward, module)
            module.triton_kernels, module.fused_lora_mlp = layers.triton_kernels, layers.fused_lora_mlp
        elif isinstance(module, CausalSelfAttention):
            module.scaled_dot_product_attention = types.MethodType(packed_attention, module)
            if layers.fast_attention:
                module.forward = types.MethodType(attention_forward, module)
                module.triton_kernels, module.triton_attention = layers.triton_kernels, layers.triton_attention
        elif layers.fused_rms_norm and isinstance(module, RMSNorm) and module.dim == -1:
            module.forward = types.MethodType(rms_norm_forward, module)
        elif layers.lean_mixed_linear and type(module) is torch.nn.Linear:
            module.forward = types.MethodType(mixed_linear_forward, module)
        elif layers.grad_into_weights and type(module) is torch.nn.Linear:
            module.forward = types.MethodType(grad_into_weight_forward, module)
    if lora_layers:
        model.lora_seeds = seeds


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
