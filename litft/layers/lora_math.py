"""LoRA's arithmetic shared by its layers (:mod:`litft.layers.lora`, :mod:`litft.layers.lora_fused`): the blocks in
which B applies, B's side forward and backward (cuBLAS, or one Triton launch for every part of a multi-part layer),
the gradients added into .grad, and the dropout seeds."""

from __future__ import annotations

import torch

from litft import kernels


def lora_parts(layer) -> tuple:
    """The blocks in which LowRankUpdate and FusedLoRA apply B: (output columns, rows of B, columns of the A output)
    per adapted projection. A LoRALinear is one block; a LoRAQKVLinear one per adapted q, k, v, B's rows holding
    the adapted projections' outputs and A's r rows each."""
    if not hasattr(layer, "enable_lora"):  # a LoRALinear (LoRAQKVLinear's enable_lora says which of q, k, v adapt)
        everything = slice(None)
        return ((everything, everything, everything),)
    q_size = layer.head_size * layer.n_head
    kv_size = layer.head_size * layer.n_query_groups
    parts, column, b_row, a_column = [], 0, 0, 0
    for enabled, size in zip(layer.enable_lora, (q_size, kv_size, kv_size)):
        if enabled:
            parts.append((slice(column, column + size), slice(b_row, b_row + size),
                          slice(a_column, a_column + layer.r)))
            b_row, a_column = b_row + size, a_column + layer.r
        column += size
    return tuple(parts)


class LoRASeeds:
    """One dropout seed per forward pass, shared by a model's FusedLoRA layers (each adds its own salt, its index):
    CausalLM.forward draws it, one small kernel per micro-batch where each layer drew its own (TinyLlama: 111 per
    micro-batch, ~2 us each). The kernels hash seed + salt into each mask's key (kernels._lora_key), so each layer
    gets its own mask. A layer called outside CausalLM's training forward (no seed drawn) draws one for itself."""

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        """The current forward pass's seed (a 1-element int64 tensor on the device), or None."""

    def draw(self, device: torch.device) -> None:
        # below 2^62 - 2^20: the layers' salts (their index, < 2^20) keep seed + salt inside int64
        self.tensor = torch.randint(2**62 - 2**20, (1,), device=device)


def lora_seed(self, device: torch.device) -> tuple[torch.Tensor, int]:
    """(seed, salt) for a FusedLoRA layer: the forward pass's shared seed and the layer's index, or its own seed."""
    seeds = getattr(self, "lora_seeds", None)
    if seeds is not None and seeds.tensor is not None and seeds.tensor.device == device:
        return seeds.tensor, self.lora_salt
    return torch.randint(2**62, (1,), device=device), 0


def dropout_p(self) -> float:
    """The adapter dropout's probability, 0 outside training or for nn.Identity."""
    dropout = self.lora_dropout
    return dropout.p if isinstance(dropout, torch.nn.Dropout) and dropout.training else 0.0


def zero_grads_if_missing(*params: torch.Tensor) -> None:
    """A zero .grad for each parameter that has none yet: the adapter kernels and matmuls add into .grad."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)


def frozen_input_grad(linear: torch.nn.Module, grad: torch.Tensor,
                       into: torch.Tensor | None = None) -> torch.Tensor:
    """grad @ W for a frozen base layer: nn.Linear's weight, or bitsandbytes' 4-bit weight dequantized as its own
    backward pass does it (bitsandbytes.autograd MatMul4Bit: dequantize_4bit, then one matmul). With ``into``: added
    into it by the matmul (beta = 1), which is returned."""
    weight = linear.weight
    quant_state = getattr(weight, "quant_state", None)
    if quant_state is not None:
        import bitsandbytes.functional as bnbF

        weight = bnbF.dequantize_4bit(weight.data.view(-1, 1), quant_state)
    weight = weight.to(grad.dtype)
    return grad.mm(weight) if into is None else into.addmm_(grad, weight)


def add_low_rank_parts_(pretrained: torch.Tensor, after_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                        parts: tuple) -> torch.Tensor:
    """B's half of a LoRA layer's forward pass (LowRankUpdate, FusedLoRA): pretrained += s after_a B^T, part by part
    (lora_parts), each added in place by its matmul (alpha = s)."""
    for columns, b_rows, a_columns in parts:  # column blocks of a row-major matmul output: views, no copies
        pretrained[:, columns].addmm_(after_a[:, a_columns], lora_b[b_rows].t(), alpha=scale)
    return pretrained


def low_rank_b_backward(grad: torch.Tensor, after_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                         parts: tuple, out: torch.Tensor | None = None) -> torch.Tensor:
    """B's half of a LoRA layer's backward pass (LowRankUpdate, FusedLoRA, FusedLoRAPair): B's gradient added into
    .grad by its matmuls, and the gradient with respect to the r-wide A output, returned (written into ``out``, a
    tensor of after_a's shape, if given)."""
    zero_grads_if_missing(lora_b)
    grad_after_a = torch.empty_like(after_a) if out is None else out
    for columns, b_rows, a_columns in parts:
        block = grad[:, columns]
        lora_b.grad[b_rows].addmm_(block.t(), after_a[:, a_columns], alpha=scale)
        grad_after_a[:, a_columns].addmm_(block, lora_b[b_rows], beta=0, alpha=scale)  # beta 0: not read
    return grad_after_a


# The Fused* layers run B's side in Triton (kernels.lora_up_ / lora_up_backward) for layers of at least this many
# parts. Measured on an H100 (4,096 rows, R 32, us per call replayed from a CUDA graph): a qkv layer's 3 parts
# forward 16.6 (cuBLAS, one addmm_ per part) -> 10.6, backward 32.1 (two matmuls per part) -> ~20; one part (proj)
# forward 8.9 -> 9.0 and backward 13.0 -> 15.7, so a single part keeps cuBLAS. Only layers up to
# TRITON_B_SIDE_MAX_WIDTH output columns (TinyLlama's qkv, 2,560) were measured; wider ones (OpenLLaMA's qkv: 3 x
# 3,200 or 3 x 4,096 columns, whose backward kernel would run one program per 64 rows: 32 programs at 2,048 rows)
# keep cuBLAS.
TRITON_B_SIDE_MIN_PARTS = 2
TRITON_B_SIDE_MAX_WIDTH = 2560


def _b_side_bounds(parts: tuple, width: int) -> tuple[tuple[int, int, int, int], ...]:
    """lora_parts' slices as kernels.lora_up_'s parts: (first output column, end column, first row of B, first
    column of the A output), for an output ``width`` columns wide."""
    bounds = []
    for columns, b_rows, a_columns in parts:
        start, end, _ = columns.indices(width)
        bounds.append((start, end, b_rows.start or 0, a_columns.start or 0))
    return tuple(bounds)


def triton_b_side(t: torch.Tensor, parts: tuple) -> bool:
    """Whether B's side of a layer with output (or output gradient) t runs in Triton: on CUDA, at the measured sizes."""
    return (kernels.available(t) and len(parts) >= TRITON_B_SIDE_MIN_PARTS
            and t.shape[-1] <= TRITON_B_SIDE_MAX_WIDTH)


def low_rank_add_(pretrained: torch.Tensor, after_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                  parts: tuple) -> torch.Tensor:
    """B's half of a Fused* layer's forward pass, pretrained += s after_a B^T part by part, in place: one Triton
    launch for every part on CUDA (:data:`TRITON_B_SIDE_MIN_PARTS`, :data:`TRITON_B_SIDE_MAX_WIDTH`), else
    :func:`add_low_rank_parts_`'s matmuls."""
    if triton_b_side(pretrained, parts):
        return kernels.lora_up_(pretrained, after_a, lora_b, scale, _b_side_bounds(parts, pretrained.shape[1]))
    return add_low_rank_parts_(pretrained, after_a, lora_b, scale, parts)


def low_rank_backward(grad: torch.Tensor, after_a: torch.Tensor, lora_b: torch.Tensor, scale: float, parts: tuple,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """B's half of a Fused* layer's backward pass, as :func:`low_rank_b_backward` (B's gradient added into .grad,
    the A output's gradient returned, into ``out`` if given): two Triton launches and an add of partial sums on
    CUDA (:data:`TRITON_B_SIDE_MIN_PARTS`), else its matmuls."""
    if not triton_b_side(grad, parts):
        return low_rank_b_backward(grad, after_a, lora_b, scale, parts, out)
    zero_grads_if_missing(lora_b)
    return kernels.lora_up_backward(grad, after_a, lora_b, scale, _b_side_bounds(parts, grad.shape[1]), lora_b.grad,
                                    out=out)
