"""The loss's cross-entropy over 16-bit logits, computed in fp32 without the fp32 copies of the logits that torch's
makes each way: the forward pass keeps each position's log-sum-exp, and the backward pass writes the logits'
gradient over the logits, which the matmul that made them does not need back."""

from __future__ import annotations

import torch

from litft.kernels import tl, triton

# vocabulary columns per loop iteration of the loss kernels: 32,000-entry vocabularies take 8 iterations
_CROSS_ENTROPY_BLOCK = 4096

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
