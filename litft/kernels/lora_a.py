"""LoRA's A side with its dropout (layers.lora_fused.FusedLoRA, layers.lora_fused.FusedLoRAPair): x @ A^T with the mask (lora_mask) drawn as
x is read, and backward A's gradient and the adapter's input gradient added into the frozen layer's, in one pass
over x each way, where the dropout kernel, cuBLAS and autograd's add of the input gradients read and write x several
times. Two adapters of one input (LLaMA's fc_1 and fc_2) take one read of it."""

from __future__ import annotations

import torch

from litft.kernels import _lora_precision, _next_power_of_2, _sm_count, tl, triton
from litft.kernels.lora_mask import _lora_check_counters, _lora_p16
from litft.kernels.splits import _add_partials, _column_splits, _row_splits

if triton is not None:
    from litft.kernels.lora_mask import _lora_keep, _lora_key  # jit functions: defined only with Triton

    @triton.jit(do_not_specialize=["M", "salt", "salt2"])
    def _lora_down_kernel(x_ptr, a_ptr, a2_ptr, out_ptr, seed_ptr, salt, salt2, M, K, R, stride_x, stride_a,
                          stride_out, stride_split, columns_per_split, p16, inv_keep,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                          PRECISION: tl.constexpr, PAIR: tl.constexpr,
                          DROPOUT: tl.constexpr):
        # program (row block, column split): out[split, rows] = dropout(x[rows, split's columns]) @ a[:, those]^T, the
        # mask applied as x is read. One split: out is the result; more: fp32 partial sums, which
        # _add_partials_kernel adds. PAIR: a second adapter over the same x (a2, its own mask from salt2), written
        # to out's columns R ... 2R - 1 from the same read of x.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        split = tl.program_id(1)
        r = tl.arange(0, BLOCK_R)
        seed = tl.load(seed_ptr)
        key, key2 = _lora_key(seed + salt), _lora_key(seed + salt2)  # this layer's mask, and the pair's
        row_words = tl.cdiv(K, 64) * 32
        dtype = x_ptr.dtype.element_ty
        first = split * columns_per_split
        stop = tl.minimum(first + columns_per_split, K)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for start in range(first, stop, BLOCK_K):
            columns = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + columns[None, :],
                        mask=(rows[:, None] < M) & (columns[None, :] < stop), other=0.0)
            at_a = r[None, :] * stride_a + columns[:, None]
            in_a = (r[None, :] < R) & (columns[:, None] < stop)
            keep = _lora_keep(key, rows, start, row_words, p16, BLOCK_K, DROPOUT)
            kept = tl.where(keep, x, 0.0)
            acc += tl.dot(kept.to(dtype), tl.load(a_ptr + at_a, mask=in_a, other=0.0).to(dtype),
                          input_precision=PRECISION)
            if PAIR:
                keep2 = _lora_keep(key2, rows, start, row_words, p16, BLOCK_K, DROPOUT)
                kept = tl.where(keep2, x, 0.0)
                acc2 += tl.dot(kept.to(dtype), tl.load(a2_ptr + at_a, mask=in_a, other=0.0).to(dtype),
                               input_precision=PRECISION)
        at_out = out_ptr + split.to(tl.int64) * stride_split + rows[:, None].to(tl.int64) * stride_out + r[None, :]
        in_out = (rows[:, None] < M) & (r[None, :] < R)
        tl.store(at_out, (acc * inv_keep).to(out_ptr.dtype.element_ty), mask=in_out)
        if PAIR:
            tl.store(at_out + R, (acc2 * inv_keep).to(out_ptr.dtype.element_ty), mask=in_out)

    @triton.jit(do_not_specialize=["M", "rows_per_split", "salt", "salt2"])
    def _lora_down_backward_kernel(x_ptr, gate_ptr, a_ptr, a2_ptr, g_ptr, grad_in_ptr, grad_x_ptr, partial_ptr,
                                   seed_ptr, salt, salt2, M, K, R, stride_x, stride_a, stride_g, stride_grad,
                                   rows_per_split, p16, inv_keep,
                                   HAS_GRAD_IN: tl.constexpr, WRITE_GRAD_X: tl.constexpr, BLOCK_M: tl.constexpr,
                                   BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                                   SWIGLU: tl.constexpr, PAIR: tl.constexpr,
                                   DROPOUT: tl.constexpr):
        # program (column block, split): BLOCK_K columns over one split's rows. Per (BLOCK_M, BLOCK_K) tile of x:
        # acc (BLOCK_R, BLOCK_K) += g^T @ keep(x), and grad_x = grad_in + keep(g @ a) / (1 - p). At the end the
        # split's partial sum of a's gradient over those columns, in fp32. PAIR: a second adapter over the same x
        # (a2; its g in g's columns R ... 2R - 1; its mask from salt2) from the same reads of x and grad_in, its
        # share of grad_x added before the one write, its partial sums after all splits' of the first.
        split = tl.program_id(1)
        seed = tl.load(seed_ptr)
        key, key2 = _lora_key(seed + salt), _lora_key(seed + salt2)  # this layer's mask, and the pair's
        row_words = tl.cdiv(K, 64) * 32
        dtype = x_ptr.dtype.element_ty
        first = tl.program_id(0) * BLOCK_K
        columns = first + tl.arange(0, BLOCK_K)
        r = tl.arange(0, BLOCK_R)
        at_a = r[:, None] * stride_a + columns[None, :]
        in_a = (r[:, None] < R) & (columns[None, :] < K)
        a = tl.load(a_ptr + at_a, mask=in_a, other=0.0).to(dtype)  # (BLOCK_R, BLOCK_K)
        if PAIR:
            a2 = tl.load(a2_ptr + at_a, mask=in_a, other=0.0).to(dtype)
        acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        start = split * rows_per_split
        stop = tl.minimum(start + rows_per_split, M)
        for row in range(start, stop, BLOCK_M):
            rows = row + tl.arange(0, BLOCK_M)
            inside = (rows[:, None] < stop) & (columns[None, :] < K)
            keep = _lora_keep(key, rows, first, row_words, p16, BLOCK_K, DROPOUT)
            at_g = g_ptr + rows[:, None].to(tl.int64) * stride_g + r[None, :]
            in_g = (rows[:, None] < stop) & (r[None, :] < R)
            g = tl.load(at_g, mask=in_g, other=0.0).to(dtype)
            at_x = rows[:, None].to(tl.int64) * stride_x + columns[None, :]
            if SWIGLU:  # x = silu(gate) * up, rebuilt as _swiglu_forward_kernel computed it (x_ptr: the up input)
                gate = tl.load(gate_ptr + at_x, mask=inside, other=0.0).to(tl.float32)
                x = (gate * tl.sigmoid(gate) * tl.load(x_ptr + at_x, mask=inside, other=0.0).to(tl.float32)).to(dtype)
            else:
                x = tl.load(x_ptr + at_x, mask=inside, other=0.0)
            acc += tl.dot(tl.trans(g), tl.where(keep, x, 0.0).to(dtype), input_precision=PRECISION)
            if WRITE_GRAD_X:
                grad_x = tl.where(keep, tl.dot(g, a, input_precision=PRECISION) * inv_keep, 0.0)
            if PAIR:
                keep2 = _lora_keep(key2, rows, first, row_words, p16, BLOCK_K, DROPOUT)
                g2 = tl.load(at_g + R, mask=in_g, other=0.0).to(dtype)
                acc2 += tl.dot(tl.trans(g2), tl.where(keep2, x, 0.0).to(dtype), input_precision=PRECISION)
                if WRITE_GRAD_X:
                    grad_x += tl.where(keep2, tl.dot(g2, a2, input_precision=PRECISION) * inv_keep, 0.0)
            if WRITE_GRAD_X:
                at = rows[:, None].to(tl.int64) * stride_grad + columns[None, :]
                if HAS_GRAD_IN:
                    grad_x += tl.load(grad_in_ptr + at, mask=inside, other=0.0).to(tl.float32)
                tl.store(grad_x_ptr + at, grad_x.to(grad_x_ptr.dtype.element_ty), mask=inside)
        at_partial = partial_ptr + split.to(tl.int64) * R * K + r[:, None] * K + columns[None, :]
        tl.store(at_partial, acc * inv_keep, mask=in_a)
        if PAIR:  # after every split's partial sums of the first adapter
            tl.store(at_partial + tl.num_programs(1).to(tl.int64) * R * K, acc2 * inv_keep, mask=in_a)


# Launches of the two kernels, by shape: the fastest of benchmarks/lora_kernel_bench.py's sweep at TinyLlama's shapes
# and 2,048 rows, measured on an H100 (triton.testing.do_bench, cold L2; docs/speed.md), microseconds per call:
#   forward,  K 2,048 (q, k, v: R 96; proj, fc, head: R 32): BLOCK_M 16, BLOCK_K 128, 8 warps (27 / 15; unfused:
#             41 / 22)
#   forward,  K 5,632 (the MLP's proj): BLOCK_M 16, BLOCK_K 128, 4 warps, the columns split over 4 programs per row
#             block (24 at 2,048 rows and 39 at 4,096, against 33 and 42 unsplit; at K 2,048 splits gained nothing
#             beyond the sweep's noise)
#   backward, R 96:                                           BLOCK_M 64, BLOCK_K 128, 8 warps (43; unfused: 86)
#   backward, R 32, K 2,048:                                  BLOCK_M 32, BLOCK_K 128, 8 warps (33; unfused: 37)
#   backward, R 32, K 5,632:                                  BLOCK_M 32, BLOCK_K 64, 4 warps (68; unfused: 75)
# ("unfused": the dropout kernel, cuBLAS and, backward, autograd's add of the input gradients.) The backward pass
# runs about 2 programs per SM (column blocks x row splits). The sweep drew its masks with Philox, which costs more
# than lora_mask's hash (see there).


def _lora_down_launch(k: int) -> dict:
    if k > 4096:
        return dict(block_m=16, block_k=128, num_warps=4, splits=4)
    return dict(block_m=16, block_k=128, num_warps=8, splits=1)


def _lora_down_backward_launch(k: int, r: int) -> dict:
    if r > 32:
        return dict(block_m=64, block_k=128, num_warps=8, programs_per_sm=2)
    if k > 4096:
        return dict(block_m=32, block_k=64, num_warps=4, programs_per_sm=2)
    return dict(block_m=32, block_k=128, num_warps=8, programs_per_sm=2)


def lora_down(x: torch.Tensor, a: torch.Tensor, p: float, seed: torch.Tensor, salt: int = 0, *,
              a2: torch.Tensor | None = None, salt2: int = 0,
              block_m: int | None = None, block_k: int | None = None, num_warps: int | None = None,
              splits: int | None = None) -> torch.Tensor:
    """dropout(x) @ a^T for x (rows, K) and a LoRA A matrix a (R, K), in one pass over x: the mask (drop with
    probability p, keep scaled by 1 / (1 - p); see _lora_p16) is drawn from hashed numbers of ``seed`` + ``salt``
    (``seed``: a 1-element int64 tensor, read on the device; ``salt``: an int, so that layers sharing one seed draw
    different masks) as x is read, and neither it nor the dropped x is written. lora_down_backward
    draws the same mask. Accumulates in fp32; returns (rows, R) in x's dtype. With ``splits`` > 1 the columns are
    split over that many programs per row block, each writing an fp32 partial sum, and one more kernel adds them:
    more programs in flight on the short inputs of a micro-batch, and each program reads a slice of a, not all of it.
    With ``a2`` (R, K), a second adapter of the same input (LLaMA's fc_1 and fc_2) with its own mask (``salt2``),
    from the same read of x: returns (rows, 2 R), dropout(x) @ a^T in the first R columns, dropout2(x) @ a2^T in
    the rest, the masks those of two calls with each salt. ``block_m``, ``block_k``, ``num_warps``, ``splits``: the
    launch (else :func:`_lora_down_launch`'s), for benchmarks/lora_kernel_bench.py."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    a = a.contiguous()
    rows, k = x.shape
    r = a.shape[0]
    if a2 is not None:
        a2 = a2.contiguous()
        assert a2.shape == a.shape and a2.dtype == a.dtype
    width = r if a2 is None else 2 * r  # output columns
    _lora_check_counters(rows, k)
    p16, inv_keep = _lora_p16(p)
    launch = _lora_down_launch(k)
    block_m, block_k = block_m or launch["block_m"], block_k or launch["block_k"]
    splits, columns_per_split = _column_splits(k, block_k, splits or launch["splits"])
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    partial = out if splits == 1 else torch.empty((splits, rows, width), dtype=torch.float32, device=x.device)
    _lora_down_kernel[(triton.cdiv(rows, block_m), splits)](
        x, a, a2 if a2 is not None else a, partial, seed, salt, salt2, rows, k, r, x.stride(0), a.stride(0), width,
        rows * width, columns_per_split, p16, inv_keep, BLOCK_M=block_m, BLOCK_K=block_k,
        BLOCK_R=max(16, _next_power_of_2(r)), PRECISION=_lora_precision(x), DROPOUT=p16 > 0, PAIR=a2 is not None,
        num_warps=num_warps or launch["num_warps"])
    if splits > 1:
        _add_partials(partial[None], (out,), accumulate=False)
    return out


def lora_down_backward(x: torch.Tensor, a: torch.Tensor, grad_after_a: torch.Tensor, p: float, seed: torch.Tensor,
                       grad_in: torch.Tensor | None, input_grad: bool = True, grad_a: torch.Tensor | None = None,
                       salt: int = 0, gate: torch.Tensor | None = None, *,
                       a2: torch.Tensor | None = None, salt2: int = 0, grad_a2: torch.Tensor | None = None,
                       block_m: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                       programs_per_sm: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The backward pass of lora_down in one pass over x (and over ``grad_in``): the gradient with respect to x,
    grad_in + dropout'(grad_after_a @ a) (the same mask: the same seed and salt), written in place over ``grad_in``
    (the frozen layer's input gradient: this adds the adapter's into it without a separate add) or into a new tensor
    when it is None, or not at all without ``input_grad``; and the gradient with respect to a,
    grad_after_a^T @ dropout(x), in fp32 (rows split over programs, their partial sums added here), or added into
    ``grad_a`` (a's .grad, contiguous, any float dtype) by one more kernel, which then returns it: where torch's sum
    and add_ run two. With ``gate`` the layer's input is silu(gate) * x (LLaMA's SwiGLU: gate = fc_1's output,
    x = fc_2's), rebuilt tile by tile as swiglu_forward computed it: the caller keeps the two inputs, which SwiGLU's
    backward pass keeps anyway, not the product (TinyLlama: 11,264 bytes per token and block). With ``a2`` (the
    pair of lora_down's ``a2``; ``grad_after_a`` then (rows, 2 R), a2's share in its last R columns): both adapters'
    gradients from one pass over x and ``grad_in``, their two shares of the input gradient added before the one
    write, and a2's gradient added into ``grad_a2`` (as a's into ``grad_a``; both required). ``block_m``,
    ``block_k``, ``num_warps``, ``programs_per_sm``: the launch (else :func:`_lora_down_backward_launch`'s), for
    benchmarks/lora_kernel_bench.py."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    if gate is not None:
        assert gate.shape == x.shape and gate.stride() == x.stride()
    a, grad_after_a = a.contiguous(), grad_after_a.contiguous()
    rows, k = x.shape
    r = a.shape[0]
    pair = 2 if a2 is not None else 1
    if a2 is not None:
        a2 = a2.contiguous()
        assert a2.shape == a.shape and grad_a is not None and grad_a2 is not None and grad_a2.is_contiguous()
    assert grad_after_a.shape == (rows, pair * r)
    _lora_check_counters(rows, k)
    p16, inv_keep = _lora_p16(p)
    if grad_in is not None:
        assert grad_in.shape == x.shape and grad_in.stride(-1) == 1
    launch = _lora_down_backward_launch(k, r)
    block_m, block_k = block_m or launch["block_m"], block_k or launch["block_k"]
    grad_x = grad_in if grad_in is not None or not input_grad else torch.empty_like(x)
    column_blocks = triton.cdiv(k, block_k)
    splits, rows_per_split = _row_splits(rows, block_m, column_blocks,
                                         (programs_per_sm or launch["programs_per_sm"]) * _sm_count(x))
    partial = torch.empty((pair * splits, r, k), dtype=torch.float32, device=x.device)  # a2's after a's
    _lora_down_backward_kernel[(column_blocks, splits)](
        x, gate if gate is not None else x, a, a2 if a2 is not None else a, grad_after_a,
        grad_in if grad_in is not None else x, grad_x if grad_x is not None else x, partial, seed, salt, salt2, rows,
        k, r, x.stride(0), a.stride(0), grad_after_a.stride(0), grad_x.stride(0) if grad_x is not None else x.stride(0),
        rows_per_split, p16, inv_keep, HAS_GRAD_IN=grad_in is not None, WRITE_GRAD_X=input_grad, BLOCK_M=block_m,
        BLOCK_K=block_k, BLOCK_R=max(16, _next_power_of_2(r)), PRECISION=_lora_precision(x), DROPOUT=p16 > 0,
        SWIGLU=gate is not None, PAIR=a2 is not None, num_warps=num_warps or launch["num_warps"])
    grad_x = grad_x if input_grad else None
    if grad_a is None:  # (no pair here: it needs both .grad)
        return grad_x, partial.sum(0) if splits > 1 else partial[0]
    assert grad_a.shape == (r, k) and grad_a.is_contiguous()
    _add_partials(partial.view(pair, splits, r * k), (grad_a,) if a2 is None else (grad_a, grad_a2))
    return grad_x, grad_a
