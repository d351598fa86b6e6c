"""SwiGLU, silu(a) * b, in one elementwise pass each way, where torch runs 2 kernels forward and 4 backward, each
reading and writing whole activations. The backward pass recomputes silu(a) from a, not keeping it."""

from __future__ import annotations

import torch

from litft.kernels import _ELEMENTWISE_BLOCK, tl, triton

if triton is not None:

    @triton.jit
    def _swiglu_forward_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        a = tl.load(a_ptr + offsets, mask=inside).to(tl.float32)
        b = tl.load(b_ptr + offsets, mask=inside).to(tl.float32)
        out = a * tl.sigmoid(a) * b
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _swiglu_backward_kernel(grad_ptr, a_ptr, b_ptr, grad_a_ptr, grad_b_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        grad = tl.load(grad_ptr + offsets, mask=inside).to(tl.float32)
        a = tl.load(a_ptr + offsets, mask=inside).to(tl.float32)
        b = tl.load(b_ptr + offsets, mask=inside).to(tl.float32)
        sigmoid = tl.sigmoid(a)
        silu = a * sigmoid
        # d silu(a) / da = sigmoid(a) (1 + a (1 - sigmoid(a)))
        grad_a = grad * b * sigmoid * (1.0 + a * (1.0 - sigmoid))
        tl.store(grad_a_ptr + offsets, grad_a.to(grad_a_ptr.dtype.element_ty), mask=inside)
        tl.store(grad_b_ptr + offsets, (grad * silu).to(grad_b_ptr.dtype.element_ty), mask=inside)


def swiglu_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b in one pass."""
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty_like(a)
    n = a.numel()
    grid = (triton.cdiv(n, _ELEMENTWISE_BLOCK),)
    _swiglu_forward_kernel[grid](a, b, out, n, BLOCK=_ELEMENTWISE_BLOCK, num_warps=8)
    return out


def swiglu_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of silu(a) * b with respect to a and b, in one pass (silu(a) recomputed, not kept)."""
    grad, a, b = grad.contiguous(), a.contiguous(), b.contiguous()
    grad_a, grad_b = torch.empty_like(a), torch.empty_like(b)
    n = a.numel()
    grid = (triton.cdiv(n, _ELEMENTWISE_BLOCK),)
    _swiglu_backward_kernel[grid](grad, a, b, grad_a, grad_b, n, BLOCK=_ELEMENTWISE_BLOCK, num_warps=8)
    return grad_a, grad_b
