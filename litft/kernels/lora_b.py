"""LoRA's B side: the low-rank add forward, B's gradient and the r-wide input gradient backward, for every adapted
part of a layer (q, k and v of a qkv layer) in one launch forward and two backward (and the add of B's partial
sums), where cuBLAS runs one matmul per part forward and two backward."""

from __future__ import annotations

import torch

from litft.kernels import _lora_precision, _next_power_of_2, _sm_count, tl, triton
from litft.kernels.splits import _add_partials, _row_splits

# A LoRA layer's B side is small matmuls (R = 32 wide) over the layer's whole output: forward out += s h B_p^T per
# adapted part p (q, k and v of a qkv layer are three), backward h's gradient s grad_p B_p and B's s grad_p^T h_p.
# cuBLAS runs each as its own launch, each at several times its bandwidth floor: measured on an H100, per TinyLlama
# block and micro-batch of 4,096 rows the qkv layer's 3 forward adds took ~32 us and its 6 backward matmuls ~45 us
# (128x256 badd 10.8 us per call, 32x64 bz 9.6 us, split-K 6.0 + 2.1 us), where one pass over its (4,096 x 2,560)
# output is 21 MB, ~6 us of HBM bandwidth. Here each direction covers every part in
# one launch (backward: one launch for h's gradient, one for B's partial sums over row splits, and their add).
# A part is (first output column, end column, first row of B, first column of h); the kernels take up to 3.

if triton is not None:

    @triton.jit
    def _lora_part(block, blocks0, blocks1, start0, end0, b_row0, h_column0, start1, end1, b_row1, h_column1,
                   start2, end2, b_row2, h_column2, BLOCK_N: tl.constexpr):
        # column block `block` of the parts' blocks laid end to end (blocks0 in part 0, blocks1 in part 1, the rest
        # in part 2): its first column, its part's end column, its part's first row of B and first column of h
        in1 = block >= blocks0
        in2 = block >= blocks0 + blocks1
        first_block = tl.where(in2, blocks0 + blocks1, tl.where(in1, blocks0, 0))
        start = tl.where(in2, start2, tl.where(in1, start1, start0))
        end = tl.where(in2, end2, tl.where(in1, end1, end0))
        b_row = tl.where(in2, b_row2, tl.where(in1, b_row1, b_row0))
        h_column = tl.where(in2, h_column2, tl.where(in1, h_column1, h_column0))
        first = start + (block - first_block) * BLOCK_N
        return first, end, b_row + (first - start), h_column

    @triton.jit(do_not_specialize=["M"])
    def _lora_up_kernel(out_ptr, h_ptr, b_ptr, M, R, stride_out, stride_h, scale, blocks0, blocks1,
                        start0, end0, b_row0, h_column0, start1, end1, b_row1, h_column1,
                        start2, end2, b_row2, h_column2,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        PRECISION: tl.constexpr):
        # program (row block, column block): out[rows, columns] += s h[rows, the part's R columns] @ B[its rows]^T
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        first, end, b_first, h_column = _lora_part(tl.program_id(1), blocks0, blocks1, start0, end0, b_row0,
                                                   h_column0, start1, end1, b_row1, h_column1, start2, end2,
                                                   b_row2, h_column2, BLOCK_N)
        columns = first + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        dtype = h_ptr.dtype.element_ty
        h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + h_column + r[None, :],
                    mask=(rows[:, None] < M) & (r[None, :] < R), other=0.0)
        b_t = tl.load(b_ptr + (b_first + tl.arange(0, BLOCK_N))[None, :] * R + r[:, None],
                      mask=(r[:, None] < R) & (columns[None, :] < end), other=0.0).to(dtype)  # (BLOCK_R, BLOCK_N)
        at = out_ptr + rows[:, None].to(tl.int64) * stride_out + columns[None, :]
        inside = (rows[:, None] < M) & (columns[None, :] < end)
        out = tl.load(at, mask=inside, other=0.0).to(tl.float32)
        out += tl.dot(h, b_t, input_precision=PRECISION) * scale
        tl.store(at, out.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit(do_not_specialize=["M"])
    def _lora_up_grad_h_kernel(grad_ptr, b_ptr, grad_h_ptr, M, R, stride_grad, stride_grad_h, scale,
                               start0, end0, b_row0, h_column0, start1, end1, b_row1, h_column1,
                               start2, end2, b_row2, h_column2, PARTS: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                               PRECISION: tl.constexpr):
        # program (row block): grad_h[rows, part p's R columns] = s grad[rows, p's columns] @ B[p's rows], every part
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        r = tl.arange(0, BLOCK_R)
        in_rows = rows[:, None] < M
        dtype = grad_ptr.dtype.element_ty
        for part in tl.static_range(PARTS):
            start = start0 if part == 0 else (start1 if part == 1 else start2)
            end = end0 if part == 0 else (end1 if part == 1 else end2)
            b_row = b_row0 if part == 0 else (b_row1 if part == 1 else b_row2)
            h_column = h_column0 if part == 0 else (h_column1 if part == 1 else h_column2)
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for first in range(start, end, BLOCK_N):
                columns = first + tl.arange(0, BLOCK_N)
                grad = tl.load(grad_ptr + rows[:, None].to(tl.int64) * stride_grad + columns[None, :],
                               mask=in_rows & (columns[None, :] < end), other=0.0)
                b = tl.load(b_ptr + (b_row + columns - start)[:, None] * R + r[None, :],
                            mask=(columns[:, None] < end) & (r[None, :] < R), other=0.0).to(dtype)
                acc += tl.dot(grad, b, input_precision=PRECISION)
            tl.store(grad_h_ptr + rows[:, None].to(tl.int64) * stride_grad_h + h_column + r[None, :],
                     (acc * scale).to(grad_h_ptr.dtype.element_ty), mask=in_rows & (r[None, :] < R))

    @triton.jit(do_not_specialize=["M", "rows_per_split"])
    def _lora_up_grad_b_kernel(grad_ptr, h_ptr, partial_ptr, M, R, b_rows, stride_grad, stride_h, scale,
                               rows_per_split, blocks0, blocks1, start0, end0, b_row0, h_column0,
                               start1, end1, b_row1, h_column1, start2, end2, b_row2, h_column2,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                               PRECISION: tl.constexpr):
        # program (column block, row split): the split's fp32 partial sum of B's gradient over the block's rows of
        # B, s grad[split's rows, columns]^T @ h[split's rows, the part's R columns]
        first, end, b_first, h_column = _lora_part(tl.program_id(0), blocks0, blocks1, start0, end0, b_row0,
                                                   h_column0, start1, end1, b_row1, h_column1, start2, end2,
                                                   b_row2, h_column2, BLOCK_N)
        split = tl.program_id(1)
        columns = first + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        dtype = grad_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
        row_start = split * rows_per_split
        stop = tl.minimum(row_start + rows_per_split, M)
        for row in range(row_start, stop, BLOCK_M):
            rows = row + tl.arange(0, BLOCK_M)
            grad_t = tl.load(grad_ptr + rows[None, :].to(tl.int64) * stride_grad + columns[:, None],
                             mask=(rows[None, :] < stop) & (columns[:, None] < end), other=0.0)  # (BLOCK_N, BLOCK_M)
            h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + h_column + r[None, :],
                        mask=(rows[:, None] < stop) & (r[None, :] < R), other=0.0).to(dtype)
            acc += tl.dot(grad_t, h, input_precision=PRECISION)
        b_at = b_first + tl.arange(0, BLOCK_N)
        tl.store(partial_ptr + split.to(tl.int64) * b_rows * R + b_at[:, None] * R + r[None, :], acc * scale,
                 mask=(columns[:, None] < end) & (r[None, :] < R))


def _lora_part_table(parts: tuple[tuple[int, int, int, int], ...], block_n: int
                     ) -> tuple[int, list[int], list[int]]:
    """(the parts' column blocks of block_n in all, the first two parts' counts, the parts' (start, end, first row
    of B, first column of h) laid flat, padded to 3 parts); the kernels find a column block's part from them."""
    assert 1 <= len(parts) <= 3
    blocks = [triton.cdiv(end - start, block_n) for start, end, _, _ in parts]
    padded = list(parts) + [parts[-1]] * (3 - len(parts))  # unused: no block reaches them
    return sum(blocks), (blocks + [0, 0])[:2], [value for part in padded for value in part]


# Launches: the fastest of benchmarks/lora_up_bench.py's sweep at a TinyLlama qkv layer's sizes (4,096 rows; parts of
# 2,048, 256 and 256 columns; R 32), measured on an H100, us per call from CUDA-graph replays (docs/speed.md):
# forward 64 x 64 tiles, 4 warps, 10.6 (others 11.1-15.0; cuBLAS's three adds 16.6); backward 19.5-20.8 at the
# launches below (cuBLAS 32.1), up to 30.5 at others.
def _lora_up_launch() -> dict:
    return dict(block_m=64, block_n=64, num_warps=4)


def _lora_up_backward_launch() -> dict:
    return dict(h_block_m=64, h_block_n=128, h_warps=8, b_block_m=64, b_block_n=64, b_warps=4, programs_per_sm=2)


def lora_up_(out: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float,
             parts: tuple[tuple[int, int, int, int], ...], *, block_m: int | None = None,
             block_n: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """B's half of a LoRA layer's forward pass, in place: out[:, start:end] += scale h[:, c:c + R] @ B[row:row +
    end - start]^T for each part (start, end, row, c) of ``parts`` (at most 3: q, k and v of a qkv layer), in one
    launch. ``out`` (rows, N) with contiguous columns, ``h`` (rows, >= R) the A side's output, ``b`` (B rows, R).
    Each output element is rounded once, as cuBLAS's addmm_ (beta 1, alpha = scale) rounds it. Returns ``out``.
    ``block_m``, ``block_n``, ``num_warps``: the launch (else _lora_up_launch's), for benchmarks/lora_up_bench.py."""
    assert out.stride(1) == 1 and h.stride(1) == 1
    b = b.contiguous()
    rows, r = out.shape[0], b.shape[1]
    launch = _lora_up_launch()
    block_m, block_n = block_m or launch["block_m"], block_n or launch["block_n"]
    total_blocks, blocks, table = _lora_part_table(parts, block_n)
    _lora_up_kernel[(triton.cdiv(rows, block_m), total_blocks)](
        out, h, b, rows, r, out.stride(0), h.stride(0), scale, *blocks, *table, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_R=max(16, _next_power_of_2(r)), PRECISION=_lora_precision(out), num_warps=num_warps or launch["num_warps"])
    return out


def lora_up_backward(grad: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float,
                     parts: tuple[tuple[int, int, int, int], ...], grad_b: torch.Tensor,
                     out: torch.Tensor | None = None, **launch_args) -> torch.Tensor:
    """The backward pass of :func:`lora_up_` for the output gradient ``grad`` (rows, N): B's gradient, scale
    grad_p^T h_p per part, added into ``grad_b`` (B's .grad, contiguous; fp32 partial sums over row splits, rounded
    once), and h's gradient, scale grad_p @ B_p in each part's R columns, returned (written into ``out``, of h's
    shape, if given; h's columns outside the parts are left as they are). ``launch_args``: the launch (keys of
    _lora_up_backward_launch), for benchmarks/lora_up_bench.py."""
    assert grad.stride(1) == 1 and h.stride(1) == 1 and grad_b.is_contiguous() and grad_b.shape == b.shape
    b = b.contiguous()
    rows, r = grad.shape[0], b.shape[1]
    launch = {**_lora_up_backward_launch(), **launch_args}
    block_r = max(16, _next_power_of_2(r))
    precision = _lora_precision(grad)
    grad_h = torch.empty_like(h) if out is None else out
    _, _, table = _lora_part_table(parts, launch["h_block_n"])
    _lora_up_grad_h_kernel[(triton.cdiv(rows, launch["h_block_m"]),)](
        grad, b, grad_h, rows, r, grad.stride(0), grad_h.stride(0), scale, *table, PARTS=len(parts),
        BLOCK_M=launch["h_block_m"], BLOCK_N=launch["h_block_n"], BLOCK_R=block_r, PRECISION=precision,
        num_warps=launch["h_warps"])
    block_n = launch["b_block_n"]
    column_blocks, blocks, table = _lora_part_table(parts, block_n)
    splits, rows_per_split = _row_splits(rows, launch["b_block_m"], column_blocks,
                                         launch["programs_per_sm"] * _sm_count(grad))
    partial = torch.empty((1, splits, b.numel()), dtype=torch.float32, device=grad.device)
    _lora_up_grad_b_kernel[(column_blocks, splits)](
        grad, h, partial, rows, r, b.shape[0], grad.stride(0), h.stride(0), scale, rows_per_split, *blocks, *table,
        BLOCK_M=launch["b_block_m"], BLOCK_N=block_n, BLOCK_R=block_r, PRECISION=precision,
        num_warps=launch["b_warps"])
    _add_partials(partial, (grad_b,))
    return grad_h
