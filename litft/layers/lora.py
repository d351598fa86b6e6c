"""LoRA layers as plain matmuls (the plan's ``fast_lora``): LitGPT's LoRALinear and LoRAQKVLinear computing the same
function with the adapter's scale on its r-wide product and B's output added by its matmul in place; with
``grad_into_weights`` the adapters' gradients added into .grad by the backward matmuls (LowRankUpdate); with
``triton_kernels`` the dropout as a seeded kernel (SeededDropout); with both, on CUDA, whole layers as
:class:`~litft.layers.lora_fused.FusedLoRA`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from litft import kernels
from litft.layers import lora_fused
from litft.layers.linear import add_into_grad
from litft.layers.lora_math import (
    add_low_rank_parts_,
    dropout_p,
    lora_parts,
    lora_seed,
    low_rank_b_backward,
)


def _add_low_rank(pretrained: torch.Tensor, after_a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """pretrained + after_a @ b.T, the add done by the matmul itself (beta = 1, in place on ``pretrained``, a fresh
    2-D matmul output that no backward pass needs): no separate pass over the output, forward or backward.
    ``b`` is cast to the output's dtype (under autocast the adapter weights stay fp32)."""
    return pretrained.addmm_(after_a, b.t().to(pretrained.dtype))


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
        grad_after_a = low_rank_b_backward(grad, after_a, ctx.lora_b, ctx.scale, ctx.parts)
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


def lora_dropout(self, rows: torch.Tensor) -> torch.Tensor:
    """The adapter's dropout: SeededDropout with ``self.triton_kernels`` on CUDA, else the layer's own nn.Dropout."""
    dropout = self.lora_dropout
    if (self.triton_kernels and isinstance(dropout, torch.nn.Dropout) and dropout.training and dropout.p > 0
            and kernels.available(rows)):
        return SeededDropout.apply(rows, dropout.p)
    return dropout(rows)


def lora_linear_forward(self, x: torch.Tensor, swiglu_inputs: tuple | None = None) -> torch.Tensor:
    """LoRALinear.forward as W x + B (s A dropout(x)): the scale s = alpha / r multiplies the r-wide product, not the
    layer's output, and the matmul with B adds into W x in place. The same function as LitGPT's
    ``W x + (dropout(x) A^T B^T) s``. Per adapted layer it saves the scale's multiply and the add over the whole
    output (TinyLlama's adapted layers write 17,920 outputs per token and block: q, k, v 2,560, proj 2,048, fc_1 and
    fc_2 5,632 each, mlp proj 2,048), forward and backward. With ``self.grads_into_adapters`` (the plan's
    grad_into_weights) the adapters run as LowRankUpdate; with ``self.triton_kernels`` the dropout as SeededDropout;
    with ``self.fused_lora``, on CUDA, the whole layer as FusedLoRA. ``swiglu_inputs``: (gate, up) when x is
    kernels.swiglu_forward(gate, up) (mlp_forward), for FusedLoRA to keep them, not x."""
    if self.r == 0 or self.merged:
        return self.linear(x)
    rows = x.reshape(-1, x.shape[-1])  # 2-D from the start: the in-place add acts on a matmul output, not a view
    rebuild = [t.reshape(rows.shape) for t in swiglu_inputs] if swiglu_inputs is not None else [None, None]
    out = _fused_or_low_rank_update(self, rows, rebuild)
    if out is None:
        pretrained = self.linear(rows)
        after_a = F.linear(lora_dropout(self, rows), self.lora_A) * self.scaling  # (tokens, r): the scale is free
        out = _add_low_rank(pretrained, after_a, self.lora_B)
    return out.view(*x.shape[:-1], -1)


def _fused_or_low_rank_update(self, rows: torch.Tensor, rebuild: list) -> torch.Tensor | None:
    """A fast LoRA layer's output over 2-D ``rows`` as FusedLoRA or LowRankUpdate where they apply, else None."""
    if lora_fused.fused_lora_applies(self, rows):
        return lora_fused.FusedLoRA.apply(rows, self.lora_A, self.lora_B, self.linear, self.scaling, dropout_p(self),
                                          lora_parts(self), *lora_seed(self, rows.device), *rebuild)
    if self.grads_into_adapters and torch.is_grad_enabled():
        return LowRankUpdate.apply(self.linear(rows), lora_dropout(self, rows), self.lora_A, self.lora_B,
                                   self.scaling, lora_parts(self))
    return None


def lora_qkv_forward(self, x: torch.Tensor) -> torch.Tensor:
    """LoRAQKVLinear.forward without conv1d and zero-padding: lora_A's rows hold r per adapted projection and
    lora_B's rows the adapted projections' outputs. One (tokens, r x adapted) x (r x adapted, q + k + v) matmul with
    a block-diagonal B (zeros for a projection not adapted: a few hundred thousand multiply-adds per token) adds
    the adapters' outputs into the pretrained output in place, scaled on the r-wide side as in lora_linear_forward.
    Same result as LitGPT's grouped conv1d + index_copy, as plain matmuls that compile and fuse well. With
    ``self.grads_into_adapters`` LowRankUpdate applies B block by block instead, or with ``self.fused_lora`` the
    whole layer runs as FusedLoRA."""
    if self.r == 0 or not any(self.enable_lora) or self.merged:
        return self.linear(x)
    rows = x.reshape(-1, x.shape[-1])
    out = _fused_or_low_rank_update(self, rows, [None, None])
    if out is not None:
        return out.view(*x.shape[:-1], -1)
    pretrained = self.linear(rows)
    q_size = self.head_size * self.n_head
    kv_size = self.head_size * self.n_query_groups
    after_a = F.linear(lora_dropout(self, rows), self.lora_A) * self.scaling  # (tokens, r x adapted)
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
