"""Triton kernels for the parts of a training step that eager PyTorch runs as several kernels, or with more memory
traffic than they need, forward and backward (train.triton_kernels). Each reads its inputs once and writes its
outputs once, in fp32 arithmetic rounded once to the output dtype:

- SwiGLU, silu(a) * b: torch runs 2 kernels forward and 4 backward;
- RoPE on q and k, with v, from the qkv output: 3 torch kernels each way (roll, multiply, addcmul), and two
  concatenations in the backward pass to put the q, k and v gradients back into one;
- the residual stream's add with the RMSNorm after it: 2 kernels forward, 3 backward;
- the loss's cross-entropy on 16-bit logits: torch's makes fp32 copies of the logits each way;
- LoRA's dropout, its mask drawn again from a seed in the backward pass instead of kept (1 byte per element);
- LoRA's A side with its dropout (model.FusedLoRA): x @ A^T with the mask drawn as x is read, and backward A's
  gradient and the adapter's input gradient added into the frozen layer's, in one pass over x each way;
- a LoRA MLP's middle (model.FusedLoRAMLP): fc_1's and fc_2's B adds, the SwiGLU and proj's A side in one kernel
  each way, with the B gradients and proj's A gradient summed in the backward one;
- a qkv layer's LoRA B side, every adapted part (q, k, v) in one launch forward and two backward, where cuBLAS runs
  one matmul per part forward and two backward;
- AdamW's step, without the write-back of clipped gradients that torch's fused kernel does (:class:`AdamW`).

Packed rows' attention has its own module, litft.varlen_attention.

Why: in an eager step every torch op is its own kernel, and each reads and writes whole activations. On the H100
these kernels made a TinyLlama LoRA step 20% faster and a full fine-tune's 16% (benchmarks/results/s12-tiny, against
session 11's code in one call). torch.compile fuses the same ops, but compiling a block takes 15-65 s, and eager
blocks with these kernels measured faster than compiled ones (results/compile-s12); they compile in seconds
(Triton's JIT, cached on disk) and run inside litft's CUDA graphs like any kernel.

Only on CUDA tensors, and not while torch.compile traces: elsewhere the functions of litft.model that use them run
torch ops. Triton ships with torch's CUDA builds; without it (a CPU-only install) `available()` is false. The
functions below take any device's tensors, so the tests run them in Triton's interpreter (TRITON_INTERPRET=1) on
the CPU against the torch versions.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds do not ship Triton
    triton = None


def available(x: torch.Tensor) -> bool:
    """Whether the Triton kernels can take ``x``: a CUDA tensor, Triton installed, and not under torch.compile."""
    return triton is not None and x.is_cuda and not torch.compiler.is_compiling()


# 4,096 elements per program of the elementwise kernels: 8 warps x 32 threads x 16 elements, wide enough to stream
# at full bandwidth.
_ELEMENTWISE_BLOCK = 4096
# vocabulary columns per loop iteration of the loss kernels: 32,000-entry vocabularies take 8 iterations
_CROSS_ENTROPY_BLOCK = 4096


# ---- SwiGLU ----

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


# ---- RoPE ----

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


# ---- the residual add and the RMSNorm after it ----

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


# ---- cross-entropy ----

if triton is not None:

    @triton.jit
    def _cross_entropy_forward_kernel(logits_ptr, labels_ptr, loss_ptr, lse_ptr, vocab, stride_row, ignore_index,
                                      BLOCK: tl.constexpr):
        # one program per position: log-sum-exp over the vocabulary in blocks, online (running max and sum)
        row = tl.program_id(0)
        row_logits = logits_ptr + row.to(tl.int64) * stride_row
        running_max = tl.full((), float("-inf"), tl.float32)
        running_sum = tl.full((), 0.0, tl.float32)
        for start in range(0, vocab, BLOCK):
            columns = start + tl.arange(0, BLOCK)
            x = tl.load(row_logits + columns, mask=columns < vocab, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
        lse = running_max + tl.log(running_sum)
        tl.store(lse_ptr + row, lse)
        label = tl.load(labels_ptr + row)
        labelled = label != ignore_index
        target = tl.load(row_logits + tl.where(labelled, label, 0)).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(labelled, lse - target, 0.0))

    @triton.jit
    def _cross_entropy_backward_kernel(logits_ptr, labels_ptr, lse_ptr, grad_ptr, vocab, stride_row, ignore_index,
                                       BLOCK: tl.constexpr):
        # d loss / d logits = (softmax - one_hot(label)) x the loss's gradient, 0 for unlabelled positions; written
        # over the logits (the matmul that made them does not need them back)
        row = tl.program_id(0)
        row_logits = logits_ptr + row.to(tl.int64) * stride_row
        label = tl.load(labels_ptr + row)
        scale = tl.where(label != ignore_index, tl.load(grad_ptr).to(tl.float32), 0.0)
        lse = tl.load(lse_ptr + row)
        for start in range(0, vocab, BLOCK):
            columns = start + tl.arange(0, BLOCK)
            inside = columns < vocab
            x = tl.load(row_logits + columns, mask=inside).to(tl.float32)
            grad = (tl.exp(x - lse) - tl.where(columns == label, 1.0, 0.0)) * scale
            tl.store(row_logits + columns, grad.to(logits_ptr.dtype.element_ty), mask=inside)


def cross_entropy_forward(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position cross-entropy of logits (positions, vocabulary) in any float dtype, computed in fp32, 0 where
    the label is ``ignore_index``; and each position's log-sum-exp (fp32), which the backward pass needs."""
    positions, vocab = logits.shape
    losses = torch.empty(positions, dtype=torch.float32, device=logits.device)
    lse = torch.empty(positions, dtype=torch.float32, device=logits.device)
    _cross_entropy_forward_kernel[(positions,)](logits, labels, losses, lse, vocab, logits.stride(0), ignore_index,
                                                BLOCK=_CROSS_ENTROPY_BLOCK, num_warps=8)
    return losses, lse


def cross_entropy_backward_(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
                            ignore_index: int) -> torch.Tensor:
    """The gradient of sum(cross_entropy_forward's losses) x grad (a 1-element tensor, read on the device: no host
    sync) with respect to the logits, written in place over ``logits``, which it returns."""
    positions, vocab = logits.shape
    _cross_entropy_backward_kernel[(positions,)](logits, labels, lse, grad, vocab, logits.stride(0), ignore_index,
                                                 BLOCK=_CROSS_ENTROPY_BLOCK, num_warps=8)
    return logits


# ---- dropout ----

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


# ---- LoRA's down-projection with its dropout ----

# The dropout mask of a LoRA layer's input x (rows, K) is a function of the seed and each element's place, the same
# in the forward kernel and the backward kernel whatever their tiles: element (row, col) is kept when its 16-bit
# uniform is at least p16 = round(p x 65,536). The uniforms come two to a 32-bit word: word row x ceil(K / 64) x 32
# + col // 2, XORed with a 32-bit key of seed + salt, through _mix32 (low half: the even column, high half: the odd
# one). The kept probability is 1 - p16 / 65,536 (p = 0.05: 0.9499970), and the kept elements are scaled by its
# inverse, so the expectation is x's.
# Why a hash and not Philox: the kernels draw every mask twice (forward, and again backward), and on the H100 the
# draws were 6% of a TinyLlama LoRA step (50.2 ms at dropout 0.05 against 47.3 ms at 0, no mask drawn; profiles in
# benchmarks/results/s19-dropout). Philox-4x32 with 10 rounds (Triton's randint4x) costs ~100 integer operations per
# call for 8 halves, ~12 per element plus the shuffles that interleave its 4 words; _mix32 costs 8 per word, 4 per
# element, and one interleave. A dropout mask needs independent-looking bits, not Philox's statistical margin;
# tests/test_kernels.py checks the kept fraction and the independence of neighbouring elements and of salts.
# Measured on the H100 (results/s19-mask, TinyLlama LoRA, 60 steps, twice each in one call): Philox-10 74,962 /
# 73,419 real tok/s, Philox-7 75,174 / 74,295, this hash 75,294 / 76,126 (+2.0% on Philox-10's mean). Per step in
# the profiles (two calls: s19-dropout, s19-mask) the four LoRA kernels took 10.7 ms with the hash, 11.8 with
# Philox-10 and 8.8 without any mask (dropout 0). What is left of the mask's cost is mostly lora_down_backward's
# (2.73 against 1.82 ms): Triton computes the mask there once per layout it is used in (the dropped x for A's
# gradient, the input gradient's share), so it hashes every word twice (the sm_90 code's TTGIR shows both).
# Triton 3.6-3.9 failed to compile (an assertion in ConvertTritonGPUToLLVM, sm_90) a first version that read x in
# 16-column tiles, once x's row stride is known to be a multiple of 16; these read tiles of 64 columns or more.
_LORA_P_BITS = 16


def _lora_p16(p: float) -> tuple[int, float]:
    """The kernels' integer threshold for dropout probability p, and the scale of kept elements."""
    p16 = round(p * (1 << _LORA_P_BITS))
    if p > 0 and p16 == 0 or p16 >= 1 << _LORA_P_BITS:
        raise ValueError(f"LoRA dropout {p} is outside what a 16-bit threshold draws: (2^-16, 1 - 2^-16)")
    return p16, (1 << _LORA_P_BITS) / ((1 << _LORA_P_BITS) - p16)


if triton is not None:

    @triton.jit
    def _mix32(x):
        # a bijection of 32-bit words in which every output bit depends on every input bit: two xorshift-multiply
        # rounds and a final xorshift (the "lowbias32" constants of Chris Wellons' hash-prospector search)
        x = (x ^ (x >> 16)) * 0x7FEB352D
        x = (x ^ (x >> 15)) * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _lora_key(seed):
        # the 32-bit key of a mask: seed (int64: the forward pass's seed + the layer's salt) hashed, both halves
        return _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ _mix32((seed >> 32).to(tl.uint32)))

    @triton.jit
    def _lora_keep(key, rows, first_column, row_words, p16, BLOCK_K: tl.constexpr, DROPOUT: tl.constexpr):
        # the (BLOCK_M, BLOCK_K) keep mask of columns first_column ... + BLOCK_K (first_column even) under key
        # (_lora_key); without DROPOUT (p = 0) all true, and no random numbers drawn: the compiler drops the selects
        keep = tl.full((rows.shape[0], BLOCK_K), 1, tl.int1)
        if DROPOUT:
            words = (rows[:, None] * row_words + first_column // 2 + tl.arange(0, BLOCK_K // 2)[None, :]).to(tl.uint32)
            uniforms = _mix32(words ^ key)
            halves = tl.join(uniforms & 0xFFFF, uniforms >> 16)  # (BLOCK_M, BLOCK_K // 2, 2): even, odd column
            keep = tl.reshape(halves, (rows.shape[0], BLOCK_K)) >= p16
        return keep

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
    contiguous targets of n elements each, in one launch (each launch is ~3-4 us of a step under a CUDA graph: a
    TinyLlama LoRA step ran 266 of them for 1.02 ms, one per gradient, and runs 166 for 0.69 ms, results/s19-stack
    and s19-partials' profiles). 1,024 elements per program: a LoRA A of 32 x 2,048 is 64 programs per target
    (4,096 per program left 16, and the kernel took 7.3 us per call on the H100, results/s14b-tiny)."""
    assert 1 <= len(targets) <= 3 and partial.is_contiguous() and partial.shape[0] == len(targets)
    n = targets[0].numel()
    assert all(t.is_contiguous() and t.numel() == n for t in targets) and partial[0].numel() % n == 0
    grads = tuple(targets) + (targets[0],) * (3 - len(targets))  # unused pointers: no program reaches them
    _add_partials_kernel[(triton.cdiv(n, _PARTIALS_BLOCK), len(targets))](
        partial, *grads, n, partial[0].numel() // n, BLOCK=_PARTIALS_BLOCK, ACCUMULATE=accumulate, num_warps=4)


def _lora_precision(x: torch.Tensor) -> str:
    # fp32 inputs (the CPU tests' and a 32-true run's) multiply in fp32, as torch's matmul does by default, not tf32
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _lora_check_counters(rows: int, k: int) -> None:
    if rows * triton.cdiv(k, 64) * 32 >= 2**31:  # the masks' word numbers are 32-bit (int32 before the key's XOR)
        raise ValueError(f"LoRA dropout kernels: {rows:,} x {k:,} elements, over 2^32")


# Launches of the two kernels, by shape: the fastest of a sweep at TinyLlama's shapes and 2,048 rows on the H100
# (benchmarks/results/lora-kernels-s14.md: triton.testing.do_bench, cold L2), microseconds per call:
#   forward,  K 2,048 (q, k, v: R 96; proj, fc, head: R 32): BLOCK_M 16, BLOCK_K 128, 8 warps (27 / 15; the first
#             version, 16-column tiles and one 32-bit uniform per element: 23 / 20; dropout + cuBLAS: 41 / 22)
#   forward,  K 5,632 (the MLP's proj): BLOCK_M 16, BLOCK_K 128, 4 warps, the columns split over 4 programs per row
#             block (lora-kernels-s15.md: 24 at 2,048 rows and 39 at 4,096, against 33 and 42 unsplit; at K 2,048
#             splits gained nothing beyond the sweep's noise)
#   backward, R 96:                                           BLOCK_M 64, BLOCK_K 128, 8 warps (43; before: 86)
#   backward, R 32, K 2,048:                                  BLOCK_M 32, BLOCK_K 128, 8 warps (33; before: 37)
#   backward, R 32, K 5,632:                                  BLOCK_M 32, BLOCK_K 64, 4 warps (68; before: 75)
# ("before": the dropout kernel, cuBLAS and, backward, autograd's add of the input gradients.) The backward pass
# runs about 2 programs per SM (column blocks x row splits). These sweeps drew the masks from Philox (see above).


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


def _sm_count(t: torch.Tensor) -> int:
    """The streaming multiprocessors of t's GPU; 2 for a CPU tensor (the interpreter's tests)."""
    return torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 2


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


# ---- LoRA's B side: the low-rank add forward, B's gradient and the r-wide input gradient backward ----

# A LoRA layer's B side is small matmuls (R = 32 wide) over the layer's whole output: forward out += s h B_p^T per
# adapted part p (q, k and v of a qkv layer are three), backward h's gradient s grad_p B_p and B's s grad_p^T h_p.
# cuBLAS runs each as its own launch, each at several times its bandwidth floor: per TinyLlama block and micro-batch
# of 4,096 rows the qkv layer's 3 forward adds took ~32 us and its 6 backward matmuls ~45 us
# (results/s20-defer/runs/after-profile: 128x256 badd 10.8 us per call, 32x64 bz 9.6 us, split-K 6.0 + 2.1 us), where
# one pass over its (4,096 x 2,560) output is 21 MB, ~6 us of HBM bandwidth. Here each direction covers every part in
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
# 2,048, 256 and 256 columns; R 32) on the H100, us per call from CUDA-graph replays (results/lora-up-s21): forward
# 64 x 64 tiles, 4 warps, 10.6 (others 11.1-15.0); backward 19.5-20.8 at the launches below, up to 30.5 at others.
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


# ---- LLaMA's LoRA MLP: SwiGLU with the adapters of fc_1, fc_2 and proj inside its kernels ----

# model.FusedLoRAMLP runs a LoRA MLP whose fc_1, fc_2 and proj are all adapted (the lab's recipe) around these two
# kernels. Around the SwiGLU between the layers, the adapters' own passes over the (rows x intermediate) tensors are
# the costliest part of a LoRA step (results/s17-ceiling: MLP adapters 10.6 of the 13.7 ms they add to a TinyLlama
# step): fc_1's and fc_2's B matmuls read and write gate and up to add into them; proj's A side reads SwiGLU's
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


# Launches: the fastest or within the sweeps' noise at TinyLlama's sizes (4,096 rows, K 5,632, R 32) on the H100
# (benchmarks/results/lora-mlp-s18a.md and -s18b.md; triton.testing.do_bench, ms, the same launch 0.277-0.303 ms
# across and within the two calls):
#   forward:  BLOCK_M 16, BLOCK_K 64, 4 warps, the columns split over 2 programs per row block (0.095 / 0.096; BLOCK_K
#             128 with 4 splits 0.102 / 0.104; BLOCK_M 32 0.16-0.33; 2 warps 0.12-0.13; num_stages 1, 2, 4 slower)
#   backward: BLOCK_M 32, BLOCK_K 64, 4 warps, 2 programs per SM, B gradients in the kernel (0.277 / 0.282 with the
#             r-wide matmuls after it; the B gradients by cuBLAS instead 0.25-0.27 at best; larger tiles up to 4x
#             slower, their registers spilled). Against the layers apart, 0.194 + 0.286 ms in the first call.
# The backward kernel runs at ~2x its bandwidth floor (5 passes: 0.069 ms), the forward at ~2.3x (0.041 ms).
# The forward's column splits follow the row count: OpenLLaMA-7B's micro-batch (2,048 rows, K 11,008) at 2 splits
# was 256 programs of 86 column tiles each, and the kernel took 252 us per call in a step, where the SwiGLU and proj
# A-side kernels it replaces took ~65 us (plus two cuBLAS B adds; results/s18-7b-profile). At least 8 programs per
# SM (~1,056 on the H100) keeps more tiles in flight: TinyLlama's 4,096 rows take 5 splits (the sweep: 2 and 4
# splits within 2% of each other; the step +3.8% in s18-splits), 7B's 9 (the 7B step still 2.0% slower than the
# layers apart, so model.FUSED_LORA_MLP_MAX_INTERMEDIATE keeps the 7B on them).
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


# ---- AdamW ----

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


# Parameters of at least this many elements take kernels.AdamW's Triton step, smaller ones torch's fused op (one launch
# for all of them). A Triton launch from Python costs ~40 us of host time, and the optimizer step waits on the host:
# LoRA's ~220 small adapters, each its own launch, made a TinyLlama LoRA step 9.4 ms longer (58.0 -> 67.4 ms,
# benchmarks/results/adamw-ab). A 1M-element bf16 parameter is 14 MB of traffic, ~5 us of GPU time at 3 TB/s;
# TinyLlama's smallest matrix (proj, 4.2M) and everything larger took the step from 110.7 to 107.7 ms there.
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
    on the H100 (2.0 TB/s), the Triton kernel in 5.7 ms (benchmarks/results/adamw-ab). Used for torch.optim.AdamW
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


@functools.lru_cache(maxsize=None)
def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()
