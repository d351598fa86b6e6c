"""AdamW's step (:class:`AdamW`): torch's fused update, one Triton kernel per large parameter, without the write-back
of the clipped gradients that torch's fused kernel does."""

from __future__ import annotations

import torch

from litft.kernels import _ELEMENTWISE_BLOCK, tl, triton

if triton is not None:

    @triton.jit
    def _adamw_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_ptr, grad_scale_ptr, found_inf_ptr, n, lr,
                      beta1, beta2, eps, weight_decay, HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                      BLOCK: tl.constexpr):
        # torch's fused AdamW update (aten _fused_adamw_) in fp32, each tensor stored back in its own dtype; the
        # gradient divided by grad_scale (clipping) but not written back; nothing read or written where found_inf
        # is nonzero (the step skipped, as torch's kernel skips it)
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if HAS_FOUND_INF:
            n = tl.where(tl.load(found_inf_ptr) == 0.0, n, 0)
        inside = offsets < n
        step = tl.load(step_ptr).to(tl.float32)  # already counts this step
        bias_correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))  # 1 - beta1 ** step
        bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
        grad = tl.load(grad_ptr + offsets, mask=inside).to(tl.float32)
        if HAS_GRAD_SCALE:
            grad = grad / tl.load(grad_scale_ptr)
        param = tl.load(param_ptr + offsets, mask=inside).to(tl.float32)
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=inside).to(tl.float32)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=inside).to(tl.float32)
        param = param - lr * weight_decay * param
        exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
        denominator = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
        param = param - (lr / bias_correction1) * exp_avg / denominator
        tl.store(param_ptr + offsets, param.to(param_ptr.dtype.element_ty), mask=inside)
        tl.store(exp_avg_ptr + offsets, exp_avg.to(exp_avg_ptr.dtype.element_ty), mask=inside)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty), mask=inside)


# Parameters of at least this many elements take AdamW's Triton step, smaller ones torch's fused op (one launch for
# all of them). A Triton launch from Python costs ~40 us of host time, and the optimizer step waits on the host:
# measured on an H100, LoRA's ~220 small adapters, each its own launch, made a TinyLlama LoRA step 9.4 ms longer
# (58.0 -> 67.4 ms). A 1M-element bf16 parameter is 14 MB of traffic, ~5 us of GPU time at 3 TB/s. The Triton step
# took a TinyLlama full fine-tune's step from 110.7 to 107.7 ms, and TinyLlama's smallest matrix (proj, 4.2M
# elements) is well over the threshold, so every matrix keeps that (docs/speed.md).
ADAMW_TRITON_MIN_NUMEL = 1 << 20


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW (fused) whose step runs one Triton kernel per large parameter (ADAMW_TRITON_MIN_NUMEL) and
    torch's fused op over the rest: the same update, the same state (exp_avg, exp_avg_sq, a float32 step tensor on
    the device: checkpoints load into either class), and the same clipping hook (``grad_scale``, which the fused
    kernel takes from torch's GradScaler and litft's clipping sets) and the same skip hook (``found_inf``: nonzero,
    the step changes nothing; litft's loop sets it where it reads a step's loss after the update is launched).

    Why: with a grad_scale, torch's fused kernel writes every gradient back divided. A bf16 parameter then costs 16
    bytes of memory traffic per step (param, grad, two moments read; all four written) where the update needs 14
    (the gradient only read): TinyLlama full fine-tune, 1.1e9 x 16 B = 17.6 GB, which torch's kernel ran in 8.6 ms
    on an H100 (2.0 TB/s), the Triton kernel in 5.7 ms (measured; docs/speed.md). Used for torch.optim.AdamW
    recipes under train.triton_kernels on CUDA, one device or DDP (whole parameters on each rank); amsgrad,
    maximize and a tensor lr run torch's step."""

    def __init__(self, params, **kwargs) -> None:
        kwargs["fused"] = True  # torch's checks for fused (CUDA floating-point parameters) and its grad_scale hook
        super().__init__(params, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        plain = (closure is None
                 and not any(g["amsgrad"] or g["maximize"] or isinstance(g["lr"], torch.Tensor)
                             for g in self.param_groups))
        if not plain:
            return super().step(closure)
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                state = self.state[p]
                if not state:  # as torch's fused AdamW initialises it
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if not params:
                continue
            steps = [self.state[p]["step"] for p in params]
            torch._foreach_add_(steps, 1)
            beta1, beta2 = group["betas"]
            hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])
            small: dict[tuple, list[torch.Tensor]] = {}
            for p in params:
                state = self.state[p]
                if p.numel() >= ADAMW_TRITON_MIN_NUMEL and p.is_contiguous() and p.grad.is_contiguous():
                    adamw_step_(p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], grad_scale, **hyper,
                                found_inf=found_inf)
                else:
                    small.setdefault((p.device, p.dtype), []).append(p)
            for same in small.values():  # what torch's fused AdamW runs (it writes these gradients back divided)
                states = [self.state[p] for p in same]
                torch._fused_adamw_(same, [p.grad for p in same], [s["exp_avg"] for s in states],
                                    [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                                    amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=found_inf, **hyper)
            if found_inf is not None:  # a skipped step does not count (as torch's fused AdamW undoes its count)
                torch._foreach_sub_(steps, [found_inf] * len(steps))
        return None


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                step: torch.Tensor, grad_scale: torch.Tensor | None, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, found_inf: torch.Tensor | None = None) -> None:
    """One AdamW update of ``param`` in place (and of its moments), as torch's fused AdamW does it: ``step`` (a
    1-element tensor) already counts this step; the gradient is divided by ``grad_scale`` when given; nothing changes
    where ``found_inf`` (a 1-element float tensor) is nonzero (all read on the device: no host sync). All four
    tensors contiguous and of one shape."""
    for t in (param, grad, exp_avg, exp_avg_sq):
        assert t.is_contiguous() and t.shape == param.shape
    n = param.numel()
    _adamw_kernel[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, step, grad_scale if grad_scale is not None else step,
        found_inf if found_inf is not None else step, n, lr, beta1, beta2, eps, weight_decay,
        HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None, BLOCK=_ELEMENTWISE_BLOCK,
        num_warps=8)
