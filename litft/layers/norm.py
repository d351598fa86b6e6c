"""RMSNorm for training: torch's fused rms_norm in place of LitGPT's, and the residual add fused into the norm after it
(AddRMSNorm, a Triton kernel each way)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from litft import kernels


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


def rms_norm_weight(norm: torch.nn.Module) -> torch.Tensor:
    """The scale a LitGPT RMSNorm multiplies by: its weight, or 1 + weight with add_unit_offset (Gemma)."""
    return (1 + norm.weight) if norm.add_unit_offset else norm.weight


def rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """LitGPT's RMSNorm as torch's rms_norm: on CUDA one fused kernel each way, which keeps its input and one fp32
    scale per row for the backward pass, where LitGPT's version runs ~5 kernels forward and keeps two fp32 copies of
    the input (8 bytes per element instead of 2 in bf16). The same arithmetic: in fp32, the weight applied before
    the cast back to the input's dtype."""
    return F.rms_norm(x, (x.shape[-1],), rms_norm_weight(self), self.eps)
