"""The residual stream's add and the RMSNorm after it in one kernel each way, where torch runs 2 forward and 3
backward: the forward pass writes the new residual stream and its norm from one read of both inputs, keeping each
row's 1 / rms for the backward pass, which adds the stream's gradient from later blocks into the norm's input
gradient as it writes it."""

from __future__ import annotations

import torch

from litft.kernels import _next_power_of_2, tl, triton

if triton is not None:

    @triton.jit
    def _add_rms_norm_forward_kernel(residual_ptr, delta_ptr, weight_ptr, new_residual_ptr, out_ptr, rstd_ptr,
                                     columns, eps, BLOCK: tl.constexpr):
        # one program per row: the residual stream's add, rounded to its dtype as torch's add stores it, then the
        # norm of that stored value
        row = tl.program_id(0).to(tl.int64) * columns
        offsets = tl.arange(0, BLOCK)
        inside = offsets < columns
        x = tl.load(residual_ptr + row + offsets, mask=inside, other=0.0).to(tl.float32)
        x += tl.load(delta_ptr + row + offsets, mask=inside, other=0.0).to(tl.float32)
        x = x.to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row + offsets, x, mask=inside)
        x = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / columns + eps)
        weight = tl.load(weight_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row + offsets, (x * rstd * weight).to(out_ptr.dtype.element_ty), mask=inside)
        tl.store(rstd_ptr + tl.program_id(0), rstd)

    @triton.jit
    def _add_rms_norm_backward_kernel(grad_out_ptr, grad_residual_ptr, x_ptr, weight_ptr, rstd_ptr, grad_in_ptr,
                                      grad_weight_ptr, rows, columns, rows_per_program,
                                      HAS_GRAD_RESIDUAL: tl.constexpr, WEIGHT_GRAD: tl.constexpr,
                                      BLOCK: tl.constexpr):
        # rows_per_program rows per program: the input gradient of each (the norm's, plus the residual stream's
        # gradient passing through the add) and, with WEIGHT_GRAD, this program's partial sum of the weight gradient
        program = tl.program_id(0)
        offsets = tl.arange(0, BLOCK)
        inside = offsets < columns
        weight = tl.load(weight_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        grad_weight = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(rows_per_program):
            index = program * rows_per_program + i
            if index < rows:
                row = index.to(tl.int64) * columns
                grad = tl.load(grad_out_ptr + row + offsets, mask=inside, other=0.0).to(tl.float32)
                x_hat = tl.load(x_ptr + row + offsets, mask=inside, other=0.0).to(tl.float32)
                rstd = tl.load(rstd_ptr + index)
                x_hat = x_hat * rstd
                grad_scaled = grad * weight
                # d/dx of x rstd(x) w: rstd (g w - x_hat mean(g w x_hat))
                grad_in = rstd * (grad_scaled - x_hat * (tl.sum(grad_scaled * x_hat, axis=0) / columns))
                if HAS_GRAD_RESIDUAL:
                    grad_in += tl.load(grad_residual_ptr + row + offsets, mask=inside, other=0.0).to(tl.float32)
                tl.store(grad_in_ptr + row + offsets, grad_in.to(grad_in_ptr.dtype.element_ty), mask=inside)
                if WEIGHT_GRAD:
                    grad_weight += grad * x_hat
        if WEIGHT_GRAD:
            tl.store(grad_weight_ptr + program.to(tl.int64) * columns + offsets, grad_weight, mask=inside)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """residual + delta (the new residual stream, in their promoted dtype) and its RMS norm times ``weight`` (in the
    residual's dtype), in one pass; and each row's 1 / rms (fp32), which the backward pass needs."""
    columns = residual.shape[-1]
    residual, delta = residual.contiguous(), delta.contiguous()
    new_residual = torch.empty(residual.shape, dtype=torch.promote_types(residual.dtype, delta.dtype),
                               device=residual.device)
    out = torch.empty_like(new_residual)
    rows = new_residual.numel() // columns
    rstd = torch.empty(rows, dtype=torch.float32, device=residual.device)
    _add_rms_norm_forward_kernel[(rows,)](residual, delta, weight, new_residual, out, rstd, columns, eps,
                                          BLOCK=_next_power_of_2(columns), num_warps=8)
    return new_residual, out, rstd


def add_rms_norm_backward(grad_out: torch.Tensor, grad_residual: torch.Tensor | None, x: torch.Tensor,
                          weight: torch.Tensor, rstd: torch.Tensor, weight_grad: bool
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradient reaching residual and delta (one tensor: the add passes it to both): the norm's input gradient
    plus ``grad_residual`` (the stream's gradient from later blocks; None when the new residual fed nothing else);
    and with ``weight_grad`` the weight's gradient (fp32 partial sums per program, summed here)."""
    columns = x.shape[-1]
    rows = x.numel() // columns
    grad_out = grad_out.contiguous()
    programs = min(rows, 4 * torch.cuda.get_device_properties(x.device).multi_processor_count) if x.is_cuda \
        else min(rows, 4)
    rows_per_program = triton.cdiv(rows, programs)
    grad_in = torch.empty_like(x)
    partial = torch.empty((programs, columns), dtype=torch.float32, device=x.device) if weight_grad else grad_in
    _add_rms_norm_backward_kernel[(programs,)](
        grad_out, grad_residual.contiguous() if grad_residual is not None else grad_out, x, weight, rstd, grad_in,
        partial, rows, columns, rows_per_program, HAS_GRAD_RESIDUAL=grad_residual is not None,
        WEIGHT_GRAD=weight_grad, BLOCK=_next_power_of_2(columns), num_warps=8)
    return grad_in, partial.sum(0).to(weight.dtype) if weight_grad else None
