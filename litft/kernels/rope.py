"""LitGPT's RoPE on q and k, with v copied, from the qkv output in one kernel each way: torch runs 3 kernels each way
(roll, multiply, addcmul), and in the backward pass two concatenations to put the q, k and v gradients back into one,
which the backward kernel here writes directly as slices of one qkv gradient."""

from __future__ import annotations

import torch

from litft.kernels import _next_power_of_2, tl, triton

if triton is not None:

    @triton.jit
    def _rope_heads(in_ptr, out_ptr, cos1, cos2, sin1, sin2, row, position, token, heads,
                    in_stride_row, in_stride_position, in_stride_head, out_stride_token, half,
                    ROTATE: tl.constexpr, TRANSPOSE: tl.constexpr, BLOCK_HEADS: tl.constexpr,
                    BLOCK_HALF: tl.constexpr):
        # every head of one token of one of q, k, v: rotated (q, k) or copied (v); out: contiguous heads of 2 halves
        head = tl.arange(0, BLOCK_HEADS)[:, None]
        column = tl.arange(0, BLOCK_HALF)[None, :]
        inside = (head < heads) & (column < half)
        x_first = in_ptr + row.to(tl.int64) * in_stride_row + position * in_stride_position + head * in_stride_head \
            + column
        x1 = tl.load(x_first, mask=inside)
        x2 = tl.load(x_first + half, mask=inside)
        out_first = out_ptr + token.to(tl.int64) * out_stride_token + head * 2 * half + column
        if ROTATE:
            x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
            if TRANSPOSE:  # the backward pass: the map's transpose
                out1 = x1 * cos1 + x2 * sin2
                out2 = x2 * cos2 - x1 * sin1
            else:  # x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)
                out1 = x1 * cos1 - x2 * sin1
                out2 = x2 * cos2 + x1 * sin2
            tl.store(out_first, out1.to(out_ptr.dtype.element_ty), mask=inside)
            tl.store(out_first + half, out2.to(out_ptr.dtype.element_ty), mask=inside)
        else:
            tl.store(out_first, x1, mask=inside)
            tl.store(out_first + half, x2, mask=inside)

    @triton.jit
    def _rope_qkv_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_out_ptr, cos_ptr, sin_ptr, positions, heads,
                         groups, q_stride_row, q_stride_position, q_stride_head,
                         k_stride_row, k_stride_position, k_stride_head,
                         v_stride_row, v_stride_position, v_stride_head,
                         q_out_stride_token, kv_out_stride_token, table_stride_row, table_stride_position, half,
                         TRANSPOSE: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
                         BLOCK_HALF: tl.constexpr):
        # one program per (row, position): that token's q and k heads rotated, its v heads copied
        token = tl.program_id(0)
        row = token // positions
        position = token % positions
        column = tl.arange(0, BLOCK_HALF)[None, :]
        table = row * table_stride_row + position * table_stride_position + column
        cos1 = tl.load(cos_ptr + table, mask=column < half).to(tl.float32)
        cos2 = tl.load(cos_ptr + table + half, mask=column < half).to(tl.float32)
        sin1 = tl.load(sin_ptr + table, mask=column < half).to(tl.float32)
        sin2 = tl.load(sin_ptr + table + half, mask=column < half).to(tl.float32)
        _rope_heads(q_ptr, q_out_ptr, cos1, cos2, sin1, sin2, row, position, token, heads,
                    q_stride_row, q_stride_position, q_stride_head, q_out_stride_token, half,
                    ROTATE=True, TRANSPOSE=TRANSPOSE, BLOCK_HEADS=BLOCK_HEADS, BLOCK_HALF=BLOCK_HALF)
        _rope_heads(k_ptr, k_out_ptr, cos1, cos2, sin1, sin2, row, position, token, groups,
                    k_stride_row, k_stride_position, k_stride_head, kv_out_stride_token, half,
                    ROTATE=True, TRANSPOSE=TRANSPOSE, BLOCK_HEADS=BLOCK_GROUPS, BLOCK_HALF=BLOCK_HALF)
        _rope_heads(v_ptr, v_out_ptr, cos1, cos2, sin1, sin2, row, position, token, groups,
                    v_stride_row, v_stride_position, v_stride_head, kv_out_stride_token, half,
                    ROTATE=False, TRANSPOSE=TRANSPOSE, BLOCK_HEADS=BLOCK_GROUPS, BLOCK_HALF=BLOCK_HALF)


def rope_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, transpose: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LitGPT's apply_rope on q and k, and v copied, in one pass: q (rows, positions, heads, head_size), k and v
    (rows, positions, groups, head_size), any strides with the last dimension contiguous (slices of the qkv output,
    say). x cos + rotate_half(x) sin with rotate_half(x) = (-x2, x1), or with ``transpose`` the map's transpose (the
    backward pass). cos, sin: (rows or 1, positions, head_size). Writes into ``out`` (three tensors of those shapes,
    each contiguous over its heads and head_size: slices of one qkv gradient, say), else into three new contiguous
    tensors; returns them."""
    rows, positions, heads, head_size = q.shape
    groups = k.shape[2]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if out is None:
        out = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    q_out, k_out, v_out = out
    # each output token's heads lie contiguously, tokens at a common stride (rows x positions flattened)
    for o in out:
        assert o.stride(-1) == 1 and o.stride(-2) == head_size and o.stride(0) == positions * o.stride(1)
    assert k_out.stride(1) == v_out.stride(1)
    cos, sin = (t.reshape(t.shape[0], positions, head_size).contiguous() for t in (cos, sin))
    _rope_qkv_kernel[(rows * positions,)](
        q, k, v, q_out, k_out, v_out, cos, sin, positions, heads, groups,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), q_out.stride(1), k_out.stride(1),
        cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), head_size // 2,
        TRANSPOSE=transpose, BLOCK_HEADS=_next_power_of_2(heads), BLOCK_GROUPS=_next_power_of_2(groups),
        BLOCK_HALF=_next_power_of_2(head_size // 2), num_warps=4)
    return out
