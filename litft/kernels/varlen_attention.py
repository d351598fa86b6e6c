"""Causal attention within the segments of packed rows, grouped k/v heads, forward and backward in Triton: the
contract of layers.attention.GroupedFlashAttention (q (N, heads, D), k and v (N, groups, D), cu_seqlens, max_length).

Tiles. Every program works on fixed tiles of positions, never on segments: the grids depend on N, the head counts
and the tile sizes only, so one CUDA graph serves any cu_seqlens (no host syncs, no value-dependent launches). A
query tile is TOKENS consecutive tokens x the heads // groups query heads of one k/v group, packed into the rows of
one matrix (TinyLlama: 8 tokens x 8 heads = 64 rows), so each k/v block is loaded once for all the heads that read
it, and a group's k/v gradients are summed over its heads in one program's accumulators. A tile may straddle
segment boundaries: each row carries its query's segment start, and the mask keeps key s for query t when
start(t) <= s <= t. A query tile's key loop runs from the smallest start among its queries to its last token, so a
segment costs its own triangle plus at most a tile's worth of masked keys. Queries max_length or more into their
segment (a padding tail longer than max_length) attend to nothing: output 0, no gradient, no work; flash attention
computes nothing there either (it leaves them unwritten).

Backward, 2 kernels (3 with splits). The dq kernel (query-tile programs, as the forward) writes delta =
rowsum(dO * O) for its rows, then recomputes P block by block and accumulates dq = scale dS K in registers, written
once in q's dtype: no fp32 buffer, no convert pass. The dk/dv kernel (programs of KEYS keys of one group) then walks
the query tiles that see its keys, up to the end of its last key's segment, with P^T and dS^T from the stored
logsumexp and delta; past the causal diagonal, when keys and queries share one segment, it skips the mask. A key
block that starts a long segment has the longest walk (~512 / 8 steps); with splits > 1, that many programs share
a key block's tiles and one more kernel adds their fp32 partials. Two passes over the scores instead of one with
atomic dq adds: more matrix work, but deterministic.

Segment starts per token come from a binary search of cu_seqlens in the forward kernel, kept for the backward
pass. The logsumexp is kept in base 2 of the scaled scores (lse2 = log2 sum 2^(s scale log2 e)): the kernels use
exp2. fp32 inputs take fp32 matrix products ("ieee"), for tests and checks.

Measured on an H100 (benchmarks/attention_bench.py, TinyLlama's shapes, 4,096-position rows of ~13.5 samples,
kernel time per row; docs/speed.md): forward 36 us, dq 40 us, dk/dv 85 us, 158 us in all against 314 us for
GroupedFlashAttention's flash kernels and their reductions; rows of 2,048: 100 against 177 us.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from litft.kernels import tl, triton


@dataclass(frozen=True)
class Tiles:
    """One kernel's launch shape. rows: query rows (tokens x a group's heads) per program (forward, dq) or per loop
    step (dk/dv); keys: keys per loop step (forward, dq) or per program (dk/dv); warps and pipeline stages; splits
    (dk/dv): programs per key block, each taking every splits-th query tile, their fp32 partial sums added by one
    more kernel (shorter chains of steps for the blocks that start long segments, at the cost of that pass)."""
    rows: int
    keys: int
    warps: int = 4
    stages: int = 3
    splits: int = 1


# Per head size: the fastest of benchmarks/attention_bench.py --sweep for 64 on the H100 (its neighbours within
# ~5%); 128's chosen to compile without spills, untimed. Module-level so that the sweep can try others; any
# power-of-two rows and keys >= 16 compile (tl.dot's minimum). 3 stages or more: with 2, Triton's pipeliner issues
# a step's loads at the end of the step before, so each step waits for them in full (seen in the SASS).
TILES: dict[int, dict[str, Tiles]] = {
    64: {"forward": Tiles(64, 32, 4, 3), "dq": Tiles(64, 32, 4, 4), "dkdv": Tiles(64, 64, 4, 3, 2)},
    128: {"forward": Tiles(64, 32, 4, 3), "dq": Tiles(64, 32, 4, 3), "dkdv": Tiles(32, 64, 8, 3, 2)},
}
_KERNELS = ("forward", "dq", "dkdv")
HEAD_SIZES = (16, 32, 64, 128)  # others raise ValueError: the caller falls back to its other path

_LOG2_E = 1.0 / math.log(2.0)
_SUM_BLOCK = 1024  # elements per program of the splits' sum: 4 warps x 32 threads x 8


if triton is not None:

    @triton.jit
    def _segment_index(cu_ptr, bounds, position, BOUNDS_LOG2: tl.constexpr):
        # the largest i with cu[i] <= position (cu non-decreasing, cu[0] = 0): a branchless binary search over
        # 2^BOUNDS_LOG2 >= bounds entries, one gather per halving
        index = tl.zeros_like(position)
        for i in tl.static_range(BOUNDS_LOG2):
            probe = index + (1 << (BOUNDS_LOG2 - 1 - i))
            start = tl.load(cu_ptr + probe, mask=probe < bounds, other=2147483647)
            index = tl.where(start <= position, probe, index)
        return index

    @triton.jit
    def _dot(a, b, acc, PRECISION: tl.constexpr):
        # a @ b (+ acc) in fp32. "interpret": Triton's interpreter multiplies 16-bit operands as raw integers, so
        # there they are widened first (their values, already rounded, are kept)
        if PRECISION == "interpret":
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc, input_precision=PRECISION)

    @triton.jit
    def _tile_rows(tile_start, n, GROUP_HEADS: tl.constexpr, ROWS: tl.constexpr):
        # row r of a query tile: token tile_start + r // GROUP_HEADS, head r % GROUP_HEADS of the group; with a
        # group size that does not divide ROWS the last ROWS % GROUP_HEADS rows are idle
        TOKENS: tl.constexpr = ROWS // GROUP_HEADS
        row = tl.arange(0, ROWS)
        token = tile_start + row // GROUP_HEADS
        return token, row % GROUP_HEADS, (row < TOKENS * GROUP_HEADS) & (token < n)

    @triton.jit
    def _key_block(q, k_ptr, v_ptr, start, hi, group, token, seg, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                   HEAD_DIM: tl.constexpr, KEYS: tl.constexpr, PRECISION: tl.constexpr):
        # keys start ... start + KEYS (before hi) of one group: k, v and the query tile's scores over them, -inf
        # where a query may not see a key (later, or before its segment's start)
        key = start + tl.arange(0, KEYS)
        d = tl.arange(0, HEAD_DIM)
        inside = (key < hi)[:, None]
        k = tl.load(k_ptr + key[:, None].to(tl.int64) * k_stride_t + group * k_stride_h + d[None, :],
                    mask=inside, other=0.0)
        v = tl.load(v_ptr + key[:, None].to(tl.int64) * v_stride_t + group * v_stride_h + d[None, :],
                    mask=inside, other=0.0)
        s = _dot(q, tl.trans(k), None, PRECISION)
        s = tl.where((key[None, :] <= token[:, None]) & (key[None, :] >= seg[:, None]), s, float("-inf"))
        return k, v, s

    @triton.jit
    def _forward_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seg_ptr, cu_ptr, n, bounds, max_length, heads,
                        qk_scale, q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                        GROUP_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr,
                        BOUNDS_LOG2: tl.constexpr, PRECISION: tl.constexpr):
        TOKENS: tl.constexpr = ROWS // GROUP_HEADS
        tile_start = tl.program_id(0) * TOKENS
        group = tl.program_id(1)
        token, head, valid = _tile_rows(tile_start, n, GROUP_HEADS, ROWS)
        head += group * GROUP_HEADS
        seg = tl.load(cu_ptr + _segment_index(cu_ptr, bounds, token, BOUNDS_LOG2))
        # idle rows, and queries max_length or more into their segment, get start n: no key passes start <= s,
        # their output is 0 and they pass no gradient
        seg = tl.where(valid & (token - seg < max_length), seg, n)
        tl.store(seg_ptr + token, seg, mask=valid & (head == 0))  # once per token, by group 0
        lo = tl.min(seg, axis=0)  # the smallest start among the tile's queries
        hi = tl.minimum(tile_start + TOKENS, n)
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + token[:, None].to(tl.int64) * q_stride_t + head[:, None] * q_stride_h + d[None, :],
                    mask=valid[:, None], other=0.0)
        # finite start: a row whose keys are all masked in a block keeps p = 2^(-inf - m) = 0, never inf - inf
        m = tl.full([ROWS], -1.0e30, tl.float32)
        total = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        for start in range(lo, hi, KEYS):
            k, v, s = _key_block(q, k_ptr, v_ptr, start, hi, group, token, seg, k_stride_t, k_stride_h, v_stride_t,
                                 v_stride_h, HEAD_DIM, KEYS, PRECISION)
            # running max m of the unscaled scores: 2^(s c - m c) is one fused multiply-add per score
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp2(s * qk_scale - (m_new * qk_scale)[:, None])
            alpha = tl.exp2((m - m_new) * qk_scale)
            total = total * alpha + tl.sum(p, axis=1)
            acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], PRECISION)
            m = m_new
        total = tl.where(total > 0, total, 1.0)
        rows_out = token[:, None].to(tl.int64) * heads + head[:, None]
        tl.store(out_ptr + rows_out * HEAD_DIM + d[None, :], (acc / total[:, None]).to(out_ptr.dtype.element_ty),
                 mask=valid[:, None])
        tl.store(lse_ptr + token.to(tl.int64) * heads + head, m * qk_scale + tl.log2(total), mask=valid)

    @triton.jit
    def _dq_kernel(q_ptr, k_ptr, v_ptr, out_ptr, grad_out_ptr, lse_ptr, delta_ptr, seg_ptr, grad_q_ptr, n, heads,
                   qk_scale, scale, q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                   go_stride_t, go_stride_h, GROUP_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   ROWS: tl.constexpr, KEYS: tl.constexpr, PRECISION: tl.constexpr):
        TOKENS: tl.constexpr = ROWS // GROUP_HEADS
        tile_start = tl.program_id(0) * TOKENS
        group = tl.program_id(1)
        token, head, valid = _tile_rows(tile_start, n, GROUP_HEADS, ROWS)
        head += group * GROUP_HEADS
        seg = tl.load(seg_ptr + token, mask=valid, other=n)  # the forward's starts (n: attends to nothing)
        lo = tl.min(seg, axis=0)
        hi = tl.minimum(tile_start + TOKENS, n)
        d = tl.arange(0, HEAD_DIM)
        token64 = token[:, None].to(tl.int64)
        q = tl.load(q_ptr + token64 * q_stride_t + head[:, None] * q_stride_h + d[None, :],
                    mask=valid[:, None], other=0.0)
        grad_out = tl.load(grad_out_ptr + token64 * go_stride_t + head[:, None] * go_stride_h + d[None, :],
                           mask=valid[:, None], other=0.0)
        out = tl.load(out_ptr + (token64 * heads + head[:, None]) * HEAD_DIM + d[None, :], mask=valid[:, None],
                      other=0.0)
        # delta = rowsum(dO * O) = rowsum(P * dP): the softmax backward's subtrahend, for the dk/dv kernel too
        delta = tl.sum(grad_out.to(tl.float32) * out.to(tl.float32), axis=1)
        row = token.to(tl.int64) * heads + head
        tl.store(delta_ptr + row, delta, mask=valid)
        lse = tl.load(lse_ptr + row, mask=valid, other=0.0)
        grad_q = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        for start in range(lo, hi, KEYS):
            k, v, s = _key_block(q, k_ptr, v_ptr, start, hi, group, token, seg, k_stride_t, k_stride_h, v_stride_t,
                                 v_stride_h, HEAD_DIM, KEYS, PRECISION)
            p = tl.exp2(s * qk_scale - lse[:, None])
            grad_p = _dot(grad_out, tl.trans(v), None, PRECISION)
            grad_s = p * (grad_p - delta[:, None])  # dS = P (dP - delta)
            grad_q = _dot(grad_s.to(k.dtype), k, grad_q, PRECISION)
        tl.store(grad_q_ptr + (token64 * heads + head[:, None]) * HEAD_DIM + d[None, :],
                 (grad_q * scale).to(grad_q_ptr.dtype.element_ty), mask=valid[:, None])

    @triton.jit
    def _dkdv_step(grad_k, grad_v, k, v, key, tile_start, group, n, heads, qk_scale, q_ptr, grad_out_ptr, lse_ptr,
                   delta_ptr, seg_ptr, q_stride_t, q_stride_h, go_stride_t, go_stride_h, GROUP_HEADS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
        # one query tile's share of a key block's dk, dv
        token, head, valid = _tile_rows(tile_start, n, GROUP_HEADS, ROWS)
        head += group * GROUP_HEADS
        d = tl.arange(0, HEAD_DIM)
        token64 = token[:, None].to(tl.int64)
        q = tl.load(q_ptr + token64 * q_stride_t + head[:, None] * q_stride_h + d[None, :],
                    mask=valid[:, None], other=0.0)
        grad_out = tl.load(grad_out_ptr + token64 * go_stride_t + head[:, None] * go_stride_h + d[None, :],
                           mask=valid[:, None], other=0.0)
        row = token.to(tl.int64) * heads + head
        lse = tl.load(lse_ptr + row, mask=valid, other=0.0)
        delta = tl.load(delta_ptr + row, mask=valid, other=0.0)
        # transposed scores, keys x query rows: the products below then give dk, dv without transposes
        s = _dot(k, tl.trans(q), None, PRECISION)
        if MASKED:
            seg = tl.load(seg_ptr + token, mask=valid, other=n)  # idle rows: no key passes
            s = tl.where((key[:, None] <= token[None, :]) & (key[:, None] >= seg[None, :]), s, float("-inf"))
        p = tl.exp2(s * qk_scale - lse[None, :])
        grad_v = _dot(p.to(grad_out.dtype), grad_out, grad_v, PRECISION)
        grad_p = _dot(v, tl.trans(grad_out), None, PRECISION)
        grad_s = p * (grad_p - delta[None, :])  # dS = P (dP - delta)
        grad_k = _dot(grad_s.to(q.dtype), q, grad_k, PRECISION)
        return grad_k, grad_v

    @triton.jit
    def _dkdv_kernel(q_ptr, k_ptr, v_ptr, grad_out_ptr, lse_ptr, delta_ptr, seg_ptr, cu_ptr, grad_k_ptr,
                     grad_v_ptr, n, bounds, max_length, heads, groups, qk_scale, scale, q_stride_t, q_stride_h,
                     k_stride_t, k_stride_h, v_stride_t, v_stride_h, go_stride_t, go_stride_h,
                     GROUP_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr,
                     BOUNDS_LOG2: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr):
        TOKENS: tl.constexpr = ROWS // GROUP_HEADS
        STEP: tl.constexpr = TOKENS * SPLITS
        # query tiles from the first key on that may hold a query before the last key: the causal diagonal
        DIAGONAL: tl.constexpr = (KEYS - 1 + TOKENS - 1) // TOKENS * TOKENS
        key_start = tl.program_id(0) * KEYS
        group = tl.program_id(1)
        split = tl.program_id(2)  # takes the tiles split, split + SPLITS, ... of each stretch below
        key = key_start + tl.arange(0, KEYS)
        inside = key < n
        d = tl.arange(0, HEAD_DIM)
        key64 = key[:, None].to(tl.int64)
        k = tl.load(k_ptr + key64 * k_stride_t + group * k_stride_h + d[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(v_ptr + key64 * v_stride_t + group * v_stride_h + d[None, :], mask=inside[:, None], other=0.0)
        # queries that see these keys: from the first key to the end of the last key's segment (n past cu[-1]),
        # or to max_length past its start
        segment = _segment_index(cu_ptr, bounds, tl.minimum(key, n - 1), BOUNDS_LOG2)
        starts = tl.load(cu_ptr + segment)
        ends = tl.load(cu_ptr + segment + 1, mask=segment + 1 < bounds, other=n)
        hi = tl.minimum(tl.max(ends, axis=0), tl.max(starts, axis=0) + max_length)
        # past the diagonal, while every key and query lies in one segment (and within max_length of its start),
        # no score is masked: those tiles skip the mask
        first_end = tl.min(ends, axis=0)
        clean_end = tl.minimum(first_end, tl.min(starts, axis=0) + max_length)
        clean_end = tl.where(first_end >= key_start + KEYS, clean_end, key_start)
        middle = key_start + DIAGONAL
        clean_stop = middle + tl.maximum(clean_end - middle, 0) // TOKENS * TOKENS
        grad_k = tl.zeros([KEYS, HEAD_DIM], tl.float32)
        grad_v = tl.zeros([KEYS, HEAD_DIM], tl.float32)
        for tile_start in range(key_start + split * TOKENS, tl.minimum(middle, hi), STEP):
            grad_k, grad_v = _dkdv_step(grad_k, grad_v, k, v, key, tile_start, group, n, heads, qk_scale, q_ptr,
                                        grad_out_ptr, lse_ptr, delta_ptr, seg_ptr, q_stride_t, q_stride_h,
                                        go_stride_t, go_stride_h, GROUP_HEADS, HEAD_DIM, ROWS, True, PRECISION)
        for tile_start in range(middle + split * TOKENS, clean_stop, STEP):
            grad_k, grad_v = _dkdv_step(grad_k, grad_v, k, v, key, tile_start, group, n, heads, qk_scale, q_ptr,
                                        grad_out_ptr, lse_ptr, delta_ptr, seg_ptr, q_stride_t, q_stride_h,
                                        go_stride_t, go_stride_h, GROUP_HEADS, HEAD_DIM, ROWS, False, PRECISION)
        for tile_start in range(clean_stop + split * TOKENS, hi, STEP):
            grad_k, grad_v = _dkdv_step(grad_k, grad_v, k, v, key, tile_start, group, n, heads, qk_scale, q_ptr,
                                        grad_out_ptr, lse_ptr, delta_ptr, seg_ptr, q_stride_t, q_stride_h,
                                        go_stride_t, go_stride_h, GROUP_HEADS, HEAD_DIM, ROWS, True, PRECISION)
        # SPLITS > 1: this split's fp32 partial sums, at split x (N, groups, D)
        kv_rows = ((split.to(tl.int64) * n + key64) * groups + group) * HEAD_DIM + d[None, :]
        tl.store(grad_k_ptr + kv_rows, (grad_k * scale).to(grad_k_ptr.dtype.element_ty), mask=inside[:, None])
        tl.store(grad_v_ptr + kv_rows, grad_v.to(grad_v_ptr.dtype.element_ty), mask=inside[:, None])

    @triton.jit
    def _sum_splits_kernel(partial_k_ptr, partial_v_ptr, grad_k_ptr, grad_v_ptr, numel, SPLITS: tl.constexpr,
                           BLOCK: tl.constexpr):
        # dk, dv = the sums of the splits' fp32 partials (split-major), in the gradients' dtype
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < numel
        grad_k = tl.zeros([BLOCK], tl.float32)
        grad_v = tl.zeros([BLOCK], tl.float32)
        for split in tl.static_range(SPLITS):
            grad_k += tl.load(partial_k_ptr + split * numel + offsets, mask=inside, other=0.0)
            grad_v += tl.load(partial_v_ptr + split * numel + offsets, mask=inside, other=0.0)
        tl.store(grad_k_ptr + offsets, grad_k.to(grad_k_ptr.dtype.element_ty), mask=inside)
        tl.store(grad_v_ptr + offsets, grad_v.to(grad_v_ptr.dtype.element_ty), mask=inside)


def supports(heads: int, groups: int, head_dim: int) -> bool:
    """Whether the kernels take attention of this shape: a head size of HEAD_SIZES, groups dividing heads, and at
    most a tile's rows of query heads per group."""
    return (head_dim in HEAD_SIZES and heads % groups == 0
            and heads // groups <= min(_tiles(head_dim, kernel).rows for kernel in _KERNELS))


def _shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    n, heads, head_dim = q.shape
    groups = k.shape[1]
    if k.shape != (n, groups, head_dim) or v.shape != k.shape or heads % groups:
        raise ValueError(f"varlen attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: want q"
                         " (N, heads, D) and k, v (N, groups, D) with groups dividing heads")
    if not supports(heads, groups, head_dim):
        raise ValueError(f"varlen attention: head size {head_dim} with {heads // groups} heads a group is not"
                         f" supported (head sizes {HEAD_SIZES}, at most a tile's rows of heads a group)")
    return n, heads, groups, head_dim


def _tiles(head_dim: int, kernel: str) -> Tiles:
    return TILES[head_dim if head_dim in TILES else min(TILES, key=lambda size: abs(size - head_dim))][kernel]


def _lane(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()  # the kernels read head_dim contiguously, any other strides


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_length: int,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out (N, heads, D) in q's dtype, lse2 (N, heads) fp32 and each token's segment start (N,) int32, n for
    queries max_length or more into their segment (which attend to nothing: output 0)."""
    n, heads, groups, head_dim = _shapes(q, k, v)
    if max_length < 1:
        raise ValueError(f"varlen attention: max_length {max_length}, want at least 1")
    q, k, v = _lane(q), _lane(k), _lane(v)
    cu = cu_seqlens.to(torch.int32).contiguous()
    out = torch.empty(n, heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(n, heads, dtype=torch.float32, device=q.device)
    seg = torch.empty(n, dtype=torch.int32, device=q.device)
    tiles = _tiles(head_dim, "forward")
    grid = (triton.cdiv(n, tiles.rows // (heads // groups)), groups)
    _forward_kernel[grid](q, k, v, out, lse, seg, cu, n, cu.numel(), max_length, heads, scale * _LOG2_E,
                          q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                          GROUP_HEADS=heads // groups, HEAD_DIM=head_dim, ROWS=tiles.rows, KEYS=tiles.keys,
                          BOUNDS_LOG2=_log2_bounds(cu), PRECISION=_precision(q),
                          num_warps=tiles.warps, num_stages=tiles.stages)
    return out, lse, seg


def varlen_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, seg: torch.Tensor, cu_seqlens: torch.Tensor, max_length: int, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """grad_q (N, heads, D), grad_k and grad_v (N, groups, D), from varlen_forward's out, lse2 and segment starts."""
    n, heads, groups, head_dim = _shapes(q, k, v)
    q, k, v, grad_out = _lane(q), _lane(k), _lane(v), _lane(grad_out)
    cu = cu_seqlens.to(torch.int32).contiguous()
    grad_q = torch.empty(n, heads, head_dim, dtype=q.dtype, device=q.device)
    grad_k = torch.empty(n, groups, head_dim, dtype=k.dtype, device=k.device)
    grad_v = torch.empty(n, groups, head_dim, dtype=v.dtype, device=v.device)
    delta = torch.empty(n, heads, dtype=torch.float32, device=q.device)
    group_heads = heads // groups
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               grad_out.stride(0), grad_out.stride(1))
    tiles = _tiles(head_dim, "dq")
    _dq_kernel[(triton.cdiv(n, tiles.rows // group_heads), groups)](
        q, k, v, out, grad_out, lse, delta, seg, grad_q, n, heads, scale * _LOG2_E, scale, *strides,
        GROUP_HEADS=group_heads, HEAD_DIM=head_dim, ROWS=tiles.rows, KEYS=tiles.keys, PRECISION=_precision(q),
        num_warps=tiles.warps, num_stages=tiles.stages)
    tiles = _tiles(head_dim, "dkdv")
    out_k, out_v = grad_k, grad_v
    if tiles.splits > 1:
        out_k, out_v = (torch.empty(tiles.splits, *x.shape, dtype=torch.float32, device=x.device)
                        for x in (grad_k, grad_v))
    _dkdv_kernel[(triton.cdiv(n, tiles.keys), groups, tiles.splits)](
        q, k, v, grad_out, lse, delta, seg, cu, out_k, out_v, n, cu.numel(), max_length, heads, groups,
        scale * _LOG2_E, scale, *strides, GROUP_HEADS=group_heads, HEAD_DIM=head_dim, ROWS=tiles.rows,
        KEYS=tiles.keys, BOUNDS_LOG2=_log2_bounds(cu), PRECISION=_precision(q), SPLITS=tiles.splits,
        num_warps=tiles.warps, num_stages=tiles.stages)
    if tiles.splits > 1:
        _sum_splits_kernel[(triton.cdiv(grad_k.numel(), _SUM_BLOCK),)](
            out_k, out_v, grad_k, grad_v, grad_k.numel(), SPLITS=tiles.splits, BLOCK=_SUM_BLOCK, num_warps=4)
    return grad_q, grad_k, grad_v


def _log2_bounds(cu: torch.Tensor) -> int:
    return max(1, (cu.numel() - 1).bit_length())  # 2^this >= cu.numel(): the binary search's range


def _precision(q: torch.Tensor) -> str:
    if not q.is_cuda:
        return "interpret"  # CPU tensors: Triton's interpreter (the tests)
    return "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 products in fp32; tf32 is unused by 16-bit ones


class VarlenGQAAttention(torch.autograd.Function):
    """Causal attention of q (N, heads, D) over k, v (N, groups, D) within each cu_seqlens segment of a packed row,
    query head h reading group h // (heads // groups); layers.attention.GroupedFlashAttention's contract, in Triton kernels
    (see the module docstring). cu_seqlens: int32 (segments + 1,) on q's device, trailing entries may repeat N.
    max_length: the caller's bound on segment lengths; queries further into a longer segment get 0. CUDA-graph safe:
    no host syncs, grids fixed by the shapes. Raises ValueError for shapes it does not take (head sizes outside
    HEAD_SIZES), before any launch, so a caller can fall back."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_length: int, scale: float):
        out, lse, seg = varlen_forward(q, k, v, cu_seqlens, max_length, scale)
        ctx.save_for_backward(q, k, v, out, lse, seg, cu_seqlens)
        ctx.max_length, ctx.scale = max_length, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, seg, cu_seqlens = ctx.saved_tensors
        grad_q, grad_k, grad_v = varlen_backward(grad_out, q, k, v, out, lse, seg, cu_seqlens, ctx.max_length,
                                                   ctx.scale)
        return grad_q, grad_k, grad_v, None, None, None
