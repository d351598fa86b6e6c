"""nn.Linear for training: under -mixed precision without autocast's kept 16-bit weight copies
(MixedPrecisionLinear), and with -true precision on one device with the weight gradient added into .grad by the
backward matmul itself (LinearGradIntoWeight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    weight-sized tensor (TinyLlama full fine-tune: 477 such adds per step, 7.8 ms of a 122 ms H100 step; every
    micro-batch adds, as CUDA graphs keep .grad allocated). The matmul reads
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
