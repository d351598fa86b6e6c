"""A reduction split over programs, for the kernels whose grid of output tiles alone leaves the GPU idle (LoRA's
r-wide matmuls, whose sums run over thousands of rows or columns): how the rows or columns are split, and one launch
that adds the splits' fp32 partial sums into up to three outputs, each rounded once to its dtype."""

from __future__ import annotations

import torch

from litft.kernels import tl, triton


def _column_splits(k: int, block_k: int, splits: int) -> tuple[int, int]:
    """(splits, columns per split) for K columns over at most ``splits`` programs per row block, each split whole
    tiles of block_k (so each split's masks start at a multiple of 8), none of them empty."""
    splits = max(1, min(splits, triton.cdiv(k, block_k)))
    columns_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    return triton.cdiv(k, columns_per_split), columns_per_split


def _row_splits(rows: int, block_m: int, column_blocks: int, programs: int) -> tuple[int, int]:
    """(splits, rows per split) for a (column blocks x splits) grid of about ``programs`` programs, each split whole
    tiles of block_m rows, none of them empty."""
    splits = max(1, min(triton.cdiv(rows, block_m), triton.cdiv(programs, column_blocks)))
    rows_per_split = triton.cdiv(triton.cdiv(rows, splits), block_m) * block_m
    return triton.cdiv(rows, rows_per_split), rows_per_split


_PARTIALS_BLOCK = 1024

if triton is not None:

    @triton.jit
    def _add_sums(partial_ptr, grad_ptr, offsets, inside, n, splits, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr):
        # grad (+)= the sum of `splits` fp32 partial sums, in fp32, rounded once to grad's dtype; without ACCUMULATE
        # grad is only written
        if ACCUMULATE:
            total = tl.load(grad_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        else:
            total = tl.zeros((BLOCK,), dtype=tl.float32)
        for split in range(0, splits):
            total += tl.load(partial_ptr + split * n + offsets, mask=inside, other=0.0)
        tl.store(grad_ptr + offsets, total.to(grad_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _add_partials_kernel(partial_ptr, grad_ptr, grad2_ptr, grad3_ptr, n, splits, BLOCK: tl.constexpr,
                             ACCUMULATE: tl.constexpr):
        # program (block, target): target t's output (grad, grad2, grad3) (+)= the sum of its `splits` partial sums,
        # partial[t] of a (targets, splits, n) fp32 tensor: the partial sums of up to three gradients in one launch
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        target = tl.program_id(1)
        sums = partial_ptr + target.to(tl.int64) * splits * n
        if target == 0:
            _add_sums(sums, grad_ptr, offsets, inside, n, splits, BLOCK, ACCUMULATE)
        elif target == 1:
            _add_sums(sums, grad2_ptr, offsets, inside, n, splits, BLOCK, ACCUMULATE)
        else:
            _add_sums(sums, grad3_ptr, offsets, inside, n, splits, BLOCK, ACCUMULATE)


def _add_partials(partial: torch.Tensor, targets: tuple[torch.Tensor, ...], accumulate: bool = True) -> None:
    """targets[t] (+)= partial[t].sum(0), for partial (len(targets), splits, ...) fp32 contiguous and up to three
    contiguous targets of n elements each, in one launch (each launch is ~3-4 us of a step under a CUDA graph:
    measured on an H100, a TinyLlama LoRA step's 266 such launches of one gradient each took 1.02 ms, its 166 of up
    to three 0.69 ms). 1,024 elements per program: a LoRA A of 32 x 2,048 is 64 programs per target (4,096 per
    program leave 16, and the kernel then took 7.3 us per call on an H100)."""
    assert 1 <= len(targets) <= 3 and partial.is_contiguous() and partial.shape[0] == len(targets)
    n = targets[0].numel()
    assert all(t.is_contiguous() and t.numel() == n for t in targets) and partial[0].numel() % n == 0
    grads = tuple(targets) + (targets[0],) * (3 - len(targets))  # unused pointers: no program reaches them
    _add_partials_kernel[(triton.cdiv(n, _PARTIALS_BLOCK), len(targets))](
        partial, *grads, n, partial[0].numel() // n, BLOCK=_PARTIALS_BLOCK, ACCUMULATE=accumulate, num_warps=4)
