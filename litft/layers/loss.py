"""The training loss: summed next-token cross-entropy over labelled positions, a chunk of positions at a time, in a
Triton kernel on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from litft import kernels
from litft.data import IGNORE_INDEX


class CrossEntropySum(torch.autograd.Function):
    """The summed cross-entropy of 16-bit logits over labelled positions, as litft.kernels' two Triton kernels: the
    forward reads the logits once (log-sum-exp in fp32, online); the backward writes the gradient over them. Where
    F.cross_entropy(logits.float()) writes an fp32 copy of the logits, log-softmax's fp32 output, and each way back
    (~40 bytes per logit against ~6; a TinyLlama step has ~4,000 positions x 32,000 logits). The same arithmetic in
    fp32: F.cross_entropy gives the same loss to rounding."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits, labels = logits.contiguous(), labels.contiguous()
        losses, lse = kernels.cross_entropy_forward(logits, labels, IGNORE_INDEX)
        ctx.save_for_backward(logits, labels, lse)
        return losses.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        # over the logits in place: no one else keeps them (the output layer's backward needs its input, not them)
        return kernels.cross_entropy_backward_(logits, labels, lse, grad.reshape(1), IGNORE_INDEX), None


def _chunk_loss(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, fused: bool = False
                ) -> torch.Tensor:
    logits = head(hidden)
    if fused and kernels.available(logits):
        return CrossEntropySum.apply(logits, labels)
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_lm_loss(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk: int,
                    fused: bool = False) -> torch.Tensor:
    """Sum of cross-entropy over labelled positions, `chunk` positions at a time (0: all at once); with ``fused``
    (train.triton_kernels) as CrossEntropySum on CUDA.

    Each chunk's logits (and their fp32 upcast) are dropped after the forward pass and recomputed in the backward
    pass (activation checkpointing of the output layer): peak memory holds one chunk's logits, not all of them,
    for one extra output-layer matmul (2 x d x vocab FLOPs per token)."""
    hidden = hidden.reshape(-1, hidden.size(-1))
    labels = labels.reshape(-1)
    if chunk <= 0 or hidden.size(0) <= chunk:
        return _chunk_loss(head, hidden, labels, fused)
    from torch.utils.checkpoint import checkpoint

    total = hidden.new_zeros((), dtype=torch.float32)
    for h, y in zip(hidden.split(chunk), labels.split(chunk)):
        # preserve_rng_state off: reading the CUDA RNG state is not allowed while a CUDA graph is being captured. A
        # LoRA head's dropout therefore draws a new mask in the recompute: the chunk's gradient is that of the
        # recomputed forward (the same distribution), its reported loss the first forward's
        total = total + checkpoint(_chunk_loss, head, h, y, fused, use_reentrant=False, preserve_rng_state=False)
    return total
