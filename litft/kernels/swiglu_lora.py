"""A LoRA LLaMA MLP's middle (layers.lora_fused.FusedLoRAMLP): fc_1's and fc_2's B adds, the SwiGLU and proj's A side with its
dropout in one kernel each way, the backward kernel also summing proj's A gradient and fc_1's and fc_2's B
gradients, all from one read of the (rows x intermediate) tensors."""

from __future__ import annotations

import torch

from litft.kernels import _lora_precision, _next_power_of_2, _sm_count, tl, triton
from litft.kernels.lora_mask import _lora_check_counters, _lora_p16
from litft.kernels.splits import _add_partials, _column_splits, _row_splits

# layers.lora_fused.FusedLoRAMLP runs a LoRA MLP whose fc_1, fc_2 and proj are all adapted around these two kernels. Around the
# SwiGLU between the layers, the adapters' own passes over the (rows x intermediate) tensors are the costliest part
# of a LoRA step (measured on an H100: the MLP's adapters took 10.6 of the 13.7 ms that the adapters add to a
# TinyLlama step): fc_1's and fc_2's B matmuls read and write gate and up to add into them; proj's A side reads SwiGLU's
# output again forward and, backward, reads gate and up again to rebuild it and reads and writes the input gradient
# that SwiGLU's backward kernel then reads once more. Here the forward kernel takes the frozen layers' gate and up,
# adds s B (A dropout(x)) into each tile as it reads it, writes silu(gate) * up once, and multiplies it by proj's A
# (its dropout drawn as for lora_down) before the tile leaves; the backward kernel adds proj's adapter share into the
# frozen input gradient, computes gate's and up's gradients, and sums proj's A gradient and fc_1's and fc_2's B
# gradients, all from one read of each tensor. Per token and block (TinyLlama, 5,632 intermediate) that takes 50,688
# bf16 elements of traffic out of the step: forward 2 x 2 x 5,632 (the B adds) + 5,632 (proj's A reading the
# product); backward 4 x 5,632 (proj's A backward and its round trip through memory) + 2 x 5,632 (B's gradients
# reading gate's and up's gradients apart from the matmuls that make the r-wide ones).

if triton is not None:
    from litft.kernels.lora_mask import _lora_keep, _lora_key  # jit functions: defined only with Triton

    @triton.jit
    def _with_low_rank(frozen, after_a, b_t, scale, PRECISION: tl.constexpr):
        # frozen + scale x after_a @ b_t in fp32, rounded to after_a's dtype (the layers' 16 bits) as the matmul that
        # adds it in place rounds it
        total = frozen.to(tl.float32) + scale * tl.dot(after_a, b_t, input_precision=PRECISION)
        return total.to(after_a.dtype).to(tl.float32)

    @triton.jit(do_not_specialize=["M", "salt"])
    def _swiglu_lora_forward_kernel(gate_ptr, up_ptr, h_ptr, b1_ptr, b2_ptr, a_ptr, out_ptr, hp_ptr, seed_ptr, salt,
                                    scale1, scale2, M, K, R, stride_in, stride_h, stride_hp, stride_split,
                                    columns_per_split, p16, inv_keep, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                                    BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
        # program (row block, column split), over the split's column tiles of (M, K) gate and up:
        #   gate = gate + s1 h1 b1^T, up = up + s2 h2 b2^T (h1, h2: the r-wide A outputs of fc_1 and fc_2, h's two
        #   halves; b1, b2: their B, (K, R)); out = silu(gate) * up, written; hp[split, rows] += dropout(out) @ a^T
        #   (proj's A, (R, K)), its mask that of lora_down with the seed and salt. One split: hp is the result;
        #   more: fp32 partial sums, which _add_partials_kernel adds. gate's and up's rows stride_in apart (the two
        #   halves of one matmul's output when fc_1's and fc_2's weights are one tensor), out's K.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        split = tl.program_id(1)
        r = tl.arange(0, BLOCK_R)
        key = _lora_key(tl.load(seed_ptr) + salt)
        row_words = tl.cdiv(K, 64) * 32
        dtype = gate_ptr.dtype.element_ty
        at_h = h_ptr + rows[:, None].to(tl.int64) * stride_h + r[None, :]
        in_h = (rows[:, None] < M) & (r[None, :] < R)
        h1 = tl.load(at_h, mask=in_h, other=0.0).to(dtype)
        h2 = tl.load(at_h + R, mask=in_h, other=0.0).to(dtype)
        first = split * columns_per_split
        stop = tl.minimum(first + columns_per_split, K)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for start in range(first, stop, BLOCK_K):
            columns = start + tl.arange(0, BLOCK_K)
            at = rows[:, None].to(tl.int64) * K + columns[None, :]
            at_in = rows[:, None].to(tl.int64) * stride_in + columns[None, :]
            inside = (rows[:, None] < M) & (columns[None, :] < stop)
            at_b = columns[None, :] * R + r[:, None]  # (BLOCK_R, BLOCK_K): B^T's tile
            in_b = (r[:, None] < R) & (columns[None, :] < stop)
            gate = _with_low_rank(tl.load(gate_ptr + at_in, mask=inside, other=0.0), h1,
                                  tl.load(b1_ptr + at_b, mask=in_b, other=0.0).to(dtype), scale1, PRECISION)
            up = _with_low_rank(tl.load(up_ptr + at_in, mask=inside, other=0.0), h2,
                                tl.load(b2_ptr + at_b, mask=in_b, other=0.0).to(dtype), scale2, PRECISION)
            out = (gate * tl.sigmoid(gate) * up).to(dtype)
            tl.store(out_ptr + at, out, mask=inside)
            keep = _lora_keep(key, rows, start, row_words, p16, BLOCK_K, DROPOUT)
            kept = tl.where(keep, out, 0.0)
            acc += tl.dot(kept.to(dtype), tl.load(a_ptr + r[None, :] * K + columns[:, None],
                                                  mask=(r[None, :] < R) & (columns[:, None] < stop),
                                                  other=0.0).to(dtype), input_precision=PRECISION)
        at_hp = hp_ptr + split.to(tl.int64) * stride_split + rows[:, None].to(tl.int64) * stride_hp + r[None, :]
        tl.store(at_hp, (acc * inv_keep).to(hp_ptr.dtype.element_ty), mask=in_h)

    @triton.jit(do_not_specialize=["M", "rows_per_split", "salt"])
    def _swiglu_lora_backward_kernel(grad_ptr, gate_ptr, up_ptr, h_ptr, b1_ptr, b2_ptr, a_ptr, gp_ptr, grad_gate_ptr,
                                     grad_up_ptr, partial_ptr, seed_ptr, salt, scale1, scale2, M, K, R, stride_in,
                                     stride_out, stride_h, stride_gp, rows_per_split, p16, inv_keep,
                                     BLOCK_M: tl.constexpr,
                                     BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                                     B_GRADS: tl.constexpr, DROPOUT: tl.constexpr):
        # program (column block, row split), over the split's row tiles: gate, up and out rebuilt as the forward
        # kernel made them; grad_out = grad (the frozen proj's input gradient) + dropout'(gp @ a) (gp: the gradient
        # of proj's r-wide A output); gate's and up's gradients written; and, in fp32 over the split's rows, the
        # partial sums of proj's A gradient gp^T dropout(out) (R, K), and of fc_1's and fc_2's B gradients
        # s grad_gate^T h1 and s grad_up^T h2 (K, R) after it: partial[0] a's, [1] b1's, [2] b2's, per split
        # (without B_GRADS the B gradients are left to the caller: fewer registers per program). gate's and up's
        # rows stride_in apart, grad_gate's and grad_up's stride_out, grad's K.
        split = tl.program_id(1)
        key = _lora_key(tl.load(seed_ptr) + salt)
        row_words = tl.cdiv(K, 64) * 32
        dtype = gate_ptr.dtype.element_ty
        first = tl.program_id(0) * BLOCK_K
        columns = first + tl.arange(0, BLOCK_K)
        r = tl.arange(0, BLOCK_R)
        in_a = (r[:, None] < R) & (columns[None, :] < K)
        a = tl.load(a_ptr + r[:, None] * K + columns[None, :], mask=in_a, other=0.0).to(dtype)  # (BLOCK_R, BLOCK_K)
        at_b = columns[None, :] * R + r[:, None]  # B^T's tile
        b1_t = tl.load(b1_ptr + at_b, mask=in_a, other=0.0).to(dtype)
        b2_t = tl.load(b2_ptr + at_b, mask=in_a, other=0.0).to(dtype)
        acc_a = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        acc_b1 = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        acc_b2 = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        start = split * rows_per_split
        stop = tl.minimum(start + rows_per_split, M)
        for row in range(start, stop, BLOCK_M):
            rows = row + tl.arange(0, BLOCK_M)
            inside = (rows[:, None] < stop) & (columns[None, :] < K)
            in_r = (rows[:, None] < stop) & (r[None, :] < R)
            at_h = h_ptr + rows[:, None].to(tl.int64) * stride_h + r[None, :]
            h1 = tl.load(at_h, mask=in_r, other=0.0).to(dtype)
            h2 = tl.load(at_h + R, mask=in_r, other=0.0).to(dtype)
            gp = tl.load(gp_ptr + rows[:, None].to(tl.int64) * stride_gp + r[None, :], mask=in_r, other=0.0).to(dtype)
            at = rows[:, None].to(tl.int64) * K + columns[None, :]
            at_in = rows[:, None].to(tl.int64) * stride_in + columns[None, :]
            at_out = rows[:, None].to(tl.int64) * stride_out + columns[None, :]
            gate = _with_low_rank(tl.load(gate_ptr + at_in, mask=inside, other=0.0), h1, b1_t, scale1, PRECISION)
            up = _with_low_rank(tl.load(up_ptr + at_in, mask=inside, other=0.0), h2, b2_t, scale2, PRECISION)
            sigmoid = tl.sigmoid(gate)
            silu = gate * sigmoid
            keep = _lora_keep(key, rows, first, row_words, p16, BLOCK_K, DROPOUT)
            acc_a += tl.dot(tl.trans(gp), tl.where(keep, (silu * up).to(dtype), 0.0).to(dtype),
                            input_precision=PRECISION)
            grad_out = tl.load(grad_ptr + at, mask=inside, other=0.0).to(tl.float32) + tl.where(
                keep, tl.dot(gp, a, input_precision=PRECISION) * inv_keep, 0.0)
            # d silu(gate) / d gate = sigmoid(gate) (1 + gate (1 - sigmoid(gate)))
            grad_gate = (grad_out * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))).to(dtype)
            grad_up = (grad_out * silu).to(dtype)
            tl.store(grad_gate_ptr + at_out, grad_gate, mask=inside)
            tl.store(grad_up_ptr + at_out, grad_up, mask=inside)
            if B_GRADS:
                acc_b1 += tl.dot(tl.trans(h1), grad_gate, input_precision=PRECISION)
                acc_b2 += tl.dot(tl.trans(h2), grad_up, input_precision=PRECISION)
        splits = tl.num_programs(1).to(tl.int64)
        at_partial = partial_ptr + split.to(tl.int64) * R * K
        tl.store(at_partial + r[:, None] * K + columns[None, :], acc_a * inv_keep, mask=in_a)
        if B_GRADS:
            tl.store(at_partial + splits * R * K + at_b, acc_b1 * scale1, mask=in_a)
            tl.store(at_partial + 2 * splits * R * K + at_b, acc_b2 * scale2, mask=in_a)


# Launches: the fastest, or within the noise, of benchmarks/lora_mlp_bench.py's sweeps at TinyLlama's sizes (4,096
# rows, K 5,632, R 32), measured on an H100 (triton.testing.do_bench, ms; one launch measured 0.277-0.303 ms across
# and within two runs; docs/speed.md):
#   forward:  BLOCK_M 16, BLOCK_K 64, 4 warps, the columns split over 2 programs per row block (0.095 / 0.096; BLOCK_K
#             128 with 4 splits 0.102 / 0.104; BLOCK_M 32 0.16-0.33; 2 warps 0.12-0.13; num_stages 1, 2, 4 slower)
#   backward: BLOCK_M 32, BLOCK_K 64, 4 warps, 2 programs per SM, B gradients in the kernel (0.277 / 0.282 with the
#             r-wide matmuls after it; the B gradients by cuBLAS instead 0.25-0.27 at best; larger tiles up to 4x
#             slower, their registers spilled). Against the layers apart, 0.194 + 0.286 ms.
# The backward kernel runs at ~2x its bandwidth floor (5 passes: 0.069 ms), the forward at ~2.3x (0.041 ms).
# The forward's column splits follow the row count: OpenLLaMA-7B's micro-batch (2,048 rows, K 11,008) at 2 splits
# was 256 programs of 86 column tiles each, and the kernel took 252 us per call in a step, where the SwiGLU and proj
# A-side kernels it replaces took ~65 us (plus two cuBLAS B adds). At least 8 programs per SM (~1,056 on the H100)
# keeps more tiles in flight: TinyLlama's 4,096 rows take 5 splits (the sweep: 2 and 4 splits within 2% of each
# other; a whole step measured 3.8% faster than at 2 splits), 7B's 9 (the 7B step still 2.0% slower than the layers
# apart, so plan.FUSED_LORA_MLP_MAX_INTERMEDIATE keeps the 7B on them).
def _swiglu_lora_forward_launch(k: int) -> dict:
    return dict(block_m=16, block_k=64, num_warps=4, programs_per_sm=8)


def _swiglu_lora_backward_launch(k: int) -> dict:
    return dict(block_m=32, block_k=64, num_warps=4, programs_per_sm=2, b_grads=True)


def _row_strided(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up as the SwiGLU kernels read them: columns contiguous, both rows the same stride (contiguous
    copies where they are not)."""
    if gate.stride(1) != 1 or up.stride(1) != 1 or gate.stride(0) != up.stride(0):
        gate, up = gate.contiguous(), up.contiguous()
    return gate, up


def swiglu_lora_forward(gate: torch.Tensor, up: torch.Tensor, after_a: torch.Tensor, b1: torch.Tensor,
                        b2: torch.Tensor, scale1: float, scale2: float, a: torch.Tensor, p: float, seed: torch.Tensor,
                        salt: int = 0, *, block_m: int | None = None, block_k: int | None = None,
                        num_warps: int | None = None, splits: int | None = None, num_stages: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward pass of a LoRA LLaMA MLP between its frozen matmuls, in one pass over gate and up: with fc_1's
    and fc_2's adapters added (``gate`` and ``up``: the frozen layers' outputs (rows, K); ``after_a``: (rows, 2 R),
    their A outputs side by side, as lora_down's pair returns them; ``b1``, ``b2``: their B (K, R); ``scale1``,
    ``scale2``: their alpha / r), returns ``out`` = silu(gate + s1 h1 b1^T) * (up + s2 h2 b2^T) (rows, K) and
    dropout(out) @ a^T (rows, R) for proj's A ``a`` (R, K), the mask that of lora_down with ``seed`` and ``salt``.
    Each sum is rounded to the dtype before the SwiGLU, as the matmul that adds into a 16-bit output rounds it.
    ``gate`` and ``up`` may be column slices of one (rows, 2 K) tensor (FusedLoRAMLP's one matmul for fc_1 and
    fc_2): rows of the same stride, columns contiguous. ``block_m``, ``block_k``, ``num_warps``, ``splits``,
    ``num_stages``: the launch (else _swiglu_lora_forward_launch's; num_stages Triton's default), for
    benchmarks/lora_mlp_bench.py."""
    gate, up = _row_strided(gate, up)
    after_a = after_a.contiguous()
    b1, b2, a = b1.contiguous(), b2.contiguous(), a.contiguous()
    rows, k = gate.shape
    r = a.shape[0]
    assert up.shape == gate.shape and after_a.shape == (rows, 2 * r) and b1.shape == b2.shape == (k, r)
    assert a.shape == (r, k)
    _lora_check_counters(rows, k)
    p16, inv_keep = _lora_p16(p)
    launch = _swiglu_lora_forward_launch(k)
    block_m, block_k = block_m or launch["block_m"], block_k or launch["block_k"]
    if splits is None:  # enough programs to fill the GPU (launch's programs_per_sm), whatever the row count
        splits = triton.cdiv(launch["programs_per_sm"] * _sm_count(gate), triton.cdiv(rows, block_m))
    splits, columns_per_split = _column_splits(k, block_k, splits)
    out = torch.empty_like(gate)
    after_proj_a = torch.empty((rows, r), dtype=gate.dtype, device=gate.device)
    partial = after_proj_a if splits == 1 else torch.empty((splits, rows, r), dtype=torch.float32, device=gate.device)
    _swiglu_lora_forward_kernel[(triton.cdiv(rows, block_m), splits)](
        gate, up, after_a, b1, b2, a, out, partial, seed, salt, scale1, scale2, rows, k, r, gate.stride(0),
        after_a.stride(0), r, rows * r, columns_per_split, p16, inv_keep, BLOCK_M=block_m, BLOCK_K=block_k,
        BLOCK_R=max(16, _next_power_of_2(r)), PRECISION=_lora_precision(gate), DROPOUT=p16 > 0,
        num_warps=num_warps or launch["num_warps"], **({} if num_stages is None else {"num_stages": num_stages}))
    if splits > 1:
        _add_partials(partial[None], (after_proj_a,), accumulate=False)
    return out, after_proj_a


def swiglu_lora_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, after_a: torch.Tensor,
                         b1: torch.Tensor, b2: torch.Tensor, scale1: float, scale2: float, a: torch.Tensor,
                         grad_after_proj_a: torch.Tensor, p: float, seed: torch.Tensor, salt: int,
                         grad_a: torch.Tensor, grad_b1: torch.Tensor, grad_b2: torch.Tensor, *,
                         block_m: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                         programs_per_sm: int | None = None, b_grads: bool | None = None,
                         num_stages: int | None = None, out: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward pass of :func:`swiglu_lora_forward` (the same arguments, and ``grad``: the frozen proj's input
    gradient, (rows, K); ``grad_after_proj_a``: the gradient of its second output, (rows, R)) in one pass over
    ``grad``, gate and up: returns the gradients with respect to the sums gate + s1 h1 b1^T and up + s2 h2 b2^T (the
    frozen fc_1's and fc_2's output gradients), and adds proj's A gradient into ``grad_a`` (R, K) and fc_1's and
    fc_2's B gradients into ``grad_b1`` and ``grad_b2`` (K, R), their .grad (contiguous, any float dtype): fp32 sums
    over row splits, rounded once. The gradients with respect to ``after_a`` are left to the caller: the returned
    gradients times s B, one matmul each. The two gradients are the column halves of one (rows, 2 K) tensor, ``out``
    if given (else a new one): one matmul with fc_1's and fc_2's weights stacked takes both. ``gate`` and ``up``
    may be column slices of one tensor, as for swiglu_lora_forward. ``block_m``, ``block_k``, ``num_warps``,
    ``programs_per_sm``, ``num_stages``: the launch (else _swiglu_lora_backward_launch's; num_stages Triton's
    default); ``b_grads`` False: the B gradients by cuBLAS after the kernel, each a second read of a returned
    gradient (for benchmarks/lora_mlp_bench.py)."""
    grad = grad.contiguous()
    gate, up = _row_strided(gate, up)
    after_a, grad_after_proj_a = after_a.contiguous(), grad_after_proj_a.contiguous()
    b1, b2, a = b1.contiguous(), b2.contiguous(), a.contiguous()
    rows, k = gate.shape
    r = a.shape[0]
    assert grad.shape == up.shape == gate.shape and after_a.shape == (rows, 2 * r)
    assert grad_after_proj_a.shape == (rows, r) and b1.shape == b2.shape == (k, r) and a.shape == (r, k)
    for into, shape in ((grad_a, (r, k)), (grad_b1, (k, r)), (grad_b2, (k, r))):
        assert into.shape == shape and into.is_contiguous()
    _lora_check_counters(rows, k)
    p16, inv_keep = _lora_p16(p)
    launch = _swiglu_lora_backward_launch(k)
    block_m, block_k = block_m or launch["block_m"], block_k or launch["block_k"]
    column_blocks = triton.cdiv(k, block_k)
    splits, rows_per_split = _row_splits(rows, block_m, column_blocks,
                                         (programs_per_sm or launch["programs_per_sm"]) * _sm_count(gate))
    b_grads = launch["b_grads"] if b_grads is None else b_grads
    if out is None:
        out = torch.empty((rows, 2 * k), dtype=gate.dtype, device=gate.device)
    assert out.shape == (rows, 2 * k) and out.is_contiguous() and out.dtype == gate.dtype
    grad_gate, grad_up = out[:, :k], out[:, k:]
    partial = torch.empty((3 if b_grads else 1, splits, r * k), dtype=torch.float32, device=gate.device)
    _swiglu_lora_backward_kernel[(column_blocks, splits)](
        grad, gate, up, after_a, b1, b2, a, grad_after_proj_a, grad_gate, grad_up, partial, seed, salt, scale1,
        scale2, rows, k, r, gate.stride(0), out.stride(0), after_a.stride(0), grad_after_proj_a.stride(0),
        rows_per_split, p16, inv_keep,
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=max(16, _next_power_of_2(r)), PRECISION=_lora_precision(gate),
        DROPOUT=p16 > 0, B_GRADS=b_grads, num_warps=num_warps or launch["num_warps"],
        **({} if num_stages is None else {"num_stages": num_stages}))
    if not b_grads:
        grad_b1.addmm_(grad_gate.t(), after_a[:, :r], alpha=scale1)
        grad_b2.addmm_(grad_up.t(), after_a[:, r:], alpha=scale2)
    _add_partials(partial, (grad_a, grad_b1, grad_b2)[:partial.shape[0]])  # a's, and b1's and b2's with b_grads
    return grad_gate, grad_up
