"""Dropout whose mask is drawn again from a seed in the backward pass instead of kept (1 byte per element): Philox
random numbers of the seed and each element's index (layers.lora.SeededDropout, LoRA's dropout where the fused LoRA
layers do not take it)."""

from __future__ import annotations

import torch

from litft.kernels import _ELEMENTWISE_BLOCK, tl, triton

if triton is not None:

    @triton.jit
    def _dropout_part(x_ptr, out_ptr, offsets, n, uniform, p, scale):
        inside = offsets < n
        x = tl.load(x_ptr + offsets, mask=inside).to(tl.float32)
        keep = uniform >= p  # uniform in [0, 1): kept with probability 1 - p
        tl.store(out_ptr + offsets, tl.where(keep, x * scale, 0.0).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _dropout_kernel(x_ptr, out_ptr, seed_ptr, n, p, scale, QUARTER: tl.constexpr):
        # one Philox call gives 4 uniforms (rand4x): for the counters of this program's quarter-block, one uniform for
        # an element in each quarter, a quarter of the random-number work that one uniform per element costs
        start = tl.program_id(0) * 4 * QUARTER
        counters = tl.program_id(0) * QUARTER + tl.arange(0, QUARTER)
        u1, u2, u3, u4 = tl.rand4x(tl.load(seed_ptr), counters)
        offsets = start + tl.arange(0, QUARTER)
        _dropout_part(x_ptr, out_ptr, offsets, n, u1, p, scale)
        _dropout_part(x_ptr, out_ptr, offsets + QUARTER, n, u2, p, scale)
        _dropout_part(x_ptr, out_ptr, offsets + 2 * QUARTER, n, u3, p, scale)
        _dropout_part(x_ptr, out_ptr, offsets + 3 * QUARTER, n, u4, p, scale)


def dropout(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """x with each element zeroed with probability p and the rest scaled by 1 / (1 - p), the mask drawn from Philox
    random numbers of ``seed`` (a 1-element int64 tensor, read on the device) and each element's index: the same
    seed gives the same mask, so the backward pass (the same map: a diagonal of 0 and 1 / (1 - p)) needs the seed,
    not a mask."""
    x = x.contiguous()
    n = x.numel()
    if n >= 2**31:  # Philox counters are 32-bit here
        raise ValueError(f"dropout kernel: {n:,} elements, over 2^31")
    out = torch.empty_like(x)
    grid = (triton.cdiv(n, _ELEMENTWISE_BLOCK),)
    _dropout_kernel[grid](x, out, seed, n, p, 1.0 / (1.0 - p), QUARTER=_ELEMENTWISE_BLOCK // 4, num_warps=8)
    return out
