"""Whole LoRA layers in Triton kernels, for one CUDA device with -true precision (the plan's ``fused_lora``): the
dropout drawn inside the kernels that multiply by A, no dropped copy kept, each layer's input gradient written once
(FusedLoRA); LLaMA's fc_1 and fc_2 over one input together (FusedLoRAPair); and a whole LoRA MLP with its adapters
inside the SwiGLU's kernels (FusedLoRAMLP, the plan's ``fused_lora_mlp``)."""

from __future__ import annotations

import torch

from litft import kernels
from litft.layers.lora_math import (
    dropout_p,
    frozen_input_grad,
    lora_parts,
    low_rank_add_,
    low_rank_backward,
    zero_grads_if_missing,
)


def fused_lora_applies(self, rows: torch.Tensor) -> bool:
    """A LoRA layer runs as FusedLoRA: where the plan chose it (``self.fused_lora``, set by use_fast_layers), in a
    training pass on CUDA, its base layer frozen (LoRA's own setting) and its dropout an nn.Dropout or none."""
    dropout = self.lora_dropout
    bias = self.linear.bias
    return (getattr(self, "fused_lora", False) and torch.is_grad_enabled() and kernels.available(rows)
            and isinstance(dropout, (torch.nn.Dropout, torch.nn.Identity))
            and not self.linear.weight.requires_grad and (bias is None or not bias.requires_grad))


class FusedLoRA(torch.autograd.Function):
    """A whole LoRA layer, W x + s B (A dropout(x)), with its dropout inside the A matmuls (kernels.lora_down and
    kernels.lora_down_backward, Triton) and its input gradient written once: grad @ W from cuBLAS, and the
    adapters' share added into it by the kernel that computes A's gradient (train.triton_kernels with
    train.grad_into_weights: one device, -true precision, CUDA).

    Where LowRankUpdate after SeededDropout runs, per layer and micro-batch: the dropout (x read, the dropped copy
    written and kept for the backward pass), A's matmul (the copy read), and backward the dropout again, two matmuls
    over the copy and the input gradient, and autograd's add of that gradient to the frozen layer's (three more
    passes), this reads x once forward, and x and the frozen layer's input gradient once backward, writing the sum
    in place. It keeps x itself (often kept anyway: attention's output, which flash attention keeps; fc_1 and fc_2
    share theirs), not a dropped copy. B's side is LowRankUpdate's: B's matmul adds into W x in place (alpha = s),
    and B's gradient goes into .grad by the matmul. The frozen layer runs under no_grad; its input gradient is
    :func:`frozen_input_grad`'s."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, linear: torch.nn.Module,
                scale: float, p: float, parts: tuple, seed: torch.Tensor, salt: int,
                gate: torch.Tensor | None = None, up: torch.Tensor | None = None) -> torch.Tensor:
        pretrained = linear(x)
        after_a = kernels.lora_down(x, lora_a, p, seed, salt)  # (tokens, r x parts), dropout(x) A^T
        low_rank_add_(pretrained, after_a, lora_b, scale, parts)
        # x = silu(gate) * up (the MLP's proj after the SwiGLU kernel): keep the two inputs, which SwiGLU keeps too,
        # and rebuild x in the backward kernel, rather than keep x as well
        ctx.save_for_backward(up if gate is not None else x, gate, after_a, seed)
        ctx.linear, ctx.lora_a, ctx.lora_b, ctx.scale, ctx.p, ctx.parts = linear, lora_a, lora_b, scale, p, parts
        ctx.salt = salt
        return pretrained

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, gate, after_a, seed = ctx.saved_tensors  # gate None: x is the layer's input itself
        lora_a, lora_b, scale = ctx.lora_a, ctx.lora_b, ctx.scale
        grad = grad.contiguous()
        grad_after_a = low_rank_backward(grad, after_a, lora_b, scale, ctx.parts)
        input_grad = ctx.needs_input_grad[0]
        zero_grads_if_missing(lora_a)
        grad_x, _ = kernels.lora_down_backward(
            x, lora_a, grad_after_a, ctx.p, seed, frozen_input_grad(ctx.linear, grad) if input_grad else None,
            input_grad=input_grad, grad_a=lora_a.grad, salt=ctx.salt, gate=gate)
        return grad_x, None, None, None, None, None, None, None, None, None, None


def fused_lora_pair_applies(first: torch.nn.Module, second: torch.nn.Module, rows: torch.Tensor) -> bool:
    """FusedLoRAPair runs for two LoRALinear layers over one input (LLaMA's fc_1 and fc_2) of the same rank, adapted
    and not merged, that would each run as FusedLoRA (:func:`fused_lora_applies`), with one dropout probability."""
    def fused(layer) -> bool:
        return getattr(layer, "fused_lora", False) and layer.r > 0 and not layer.merged and fused_lora_applies(layer, rows)

    return (fused(first) and fused(second) and first.lora_A.shape == second.lora_A.shape
            and first.lora_A.dtype == second.lora_A.dtype and dropout_p(first) == dropout_p(second))


def lora_pair_seed(first: torch.nn.Module, second: torch.nn.Module, device: torch.device) -> tuple:
    """(seed, salt, salt2) for FusedLoRAPair: the forward pass's shared seed and each layer's own salt, the masks
    each would draw as FusedLoRA (lora_math.lora_seed); without a shared seed, one drawn for the pair, salts 0, 1."""
    seeds = getattr(first, "lora_seeds", None)
    if (seeds is not None and seeds is getattr(second, "lora_seeds", None) and seeds.tensor is not None
            and seeds.tensor.device == device):
        return seeds.tensor, first.lora_salt, second.lora_salt
    return torch.randint(2**62, (1,), device=device), 0, 1


class FusedLoRAPair(torch.autograd.Function):
    """Two LoRA layers over one input, as LLaMA's MLP runs fc_1 and fc_2 on the same normed x: FusedLoRA for both,
    with their A sides in one kernel each way (kernels.lora_down / lora_down_backward with ``a2``) and their input
    gradients summed by the matmuls. Each layer keeps its own dropout mask (its own salt), so the outputs and
    gradients are those of the two FusedLoRA layers and autograd's add of their input gradients.

    Per micro-batch and block this saves, against two FusedLoRA layers: one read of x forward; backward one read of
    x, of the frozen input gradient and one write of the sum (the pair kernel adds both adapters' shares in one
    pass, where two kernels each read and write it), and autograd's add of the two input gradients (TinyLlama: 3
    passes over a (tokens x 2,048) tensor). The second frozen layer's input gradient is added by its matmul (beta
    = 1). Keeps x once, the (tokens x 2 r) A output and the seed: what the two layers keep. Measured on an H100
    (TinyLlama as shipped): LoRA +0.5% real tok/s, QLoRA +1.8%."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, first: torch.nn.Module, second: torch.nn.Module, lora_a: torch.Tensor,
                lora_b: torch.Tensor, lora_a2: torch.Tensor, lora_b2: torch.Tensor, p: float, seed: torch.Tensor,
                salt: int, salt2: int):
        gate, up = first.linear(x), second.linear(x)
        after_a = kernels.lora_down(x, lora_a, p, seed, salt, a2=lora_a2, salt2=salt2)  # (tokens, 2 r)
        r = lora_a.shape[0]
        low_rank_add_(gate, after_a[:, :r], lora_b, first.scaling, lora_parts(first))
        low_rank_add_(up, after_a[:, r:], lora_b2, second.scaling, lora_parts(second))
        ctx.save_for_backward(x, after_a, seed)
        ctx.first, ctx.second, ctx.p, ctx.salt, ctx.salt2 = first, second, p, salt, salt2
        ctx.adapters = (lora_a, lora_b, lora_a2, lora_b2)  # parameters: reach their .grad
        return gate, up

    @staticmethod
    def backward(ctx, grad_gate: torch.Tensor, grad_up: torch.Tensor):
        x, after_a, seed = ctx.saved_tensors
        first, second = ctx.first, ctx.second
        lora_a, lora_b, lora_a2, lora_b2 = ctx.adapters
        grad_gate, grad_up = grad_gate.contiguous(), grad_up.contiguous()
        r = lora_a.shape[0]
        grad_after_a = torch.empty_like(after_a)
        low_rank_backward(grad_gate, after_a[:, :r], lora_b, first.scaling, lora_parts(first),
                          out=grad_after_a[:, :r])
        low_rank_backward(grad_up, after_a[:, r:], lora_b2, second.scaling, lora_parts(second),
                          out=grad_after_a[:, r:])
        zero_grads_if_missing(lora_a, lora_a2)
        input_grad = ctx.needs_input_grad[0]
        frozen = (frozen_input_grad(second.linear, grad_up, into=frozen_input_grad(first.linear, grad_gate))
                  if input_grad else None)
        grad_x, _ = kernels.lora_down_backward(x, lora_a, grad_after_a, ctx.p, seed, frozen, input_grad=input_grad,
                                               grad_a=lora_a.grad, salt=ctx.salt, a2=lora_a2, salt2=ctx.salt2,
                                               grad_a2=lora_a2.grad)
        return grad_x, None, None, None, None, None, None, None, None, None, None


def lora_mlp_adapters(mlp: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """A LoRA LLaMAMLP's six adapter matrices in FusedLoRAMLP's order: fc_1's A and B, fc_2's, proj's."""
    return (mlp.fc_1.lora_A, mlp.fc_1.lora_B, mlp.fc_2.lora_A, mlp.fc_2.lora_B, mlp.proj.lora_A, mlp.proj.lora_B)


def fused_lora_mlp_applies(mlp: torch.nn.Module, rows: torch.Tensor) -> bool:
    """A LoRA LLaMAMLP runs as FusedLoRAMLP: where the plan chose it (``mlp.fused_lora_mlp``, set by
    use_fast_layers), its fc_1 and fc_2 running as FusedLoRAPair (:func:`fused_lora_pair_applies`) and its proj as
    FusedLoRA with their rank and dropout probability, the three drawing their masks from the forward pass's shared
    seed (LoRASeeds, drawn by CausalLM)."""
    if not getattr(mlp, "fused_lora_mlp", False):
        return False
    proj = mlp.proj
    seeds = getattr(mlp.fc_1, "lora_seeds", None)
    shared = (seeds is not None and seeds.tensor is not None and seeds.tensor.device == rows.device
              and all(getattr(layer, "lora_seeds", None) is seeds for layer in (mlp.fc_2, proj)))
    return (shared and fused_lora_pair_applies(mlp.fc_1, mlp.fc_2, rows) and proj.r > 0 and not proj.merged
            and fused_lora_applies(proj, rows) and proj.lora_A.shape[0] == mlp.fc_1.lora_A.shape[0]
            and proj.lora_A.dtype == mlp.fc_1.lora_A.dtype and dropout_p(proj) == dropout_p(mlp.fc_1))


class FusedLoRAMLP(torch.autograd.Function):
    """A LLaMA MLP with LoRA on fc_1, fc_2 and proj, proj(silu(fc_1(x)) * fc_2(x)), from the same frozen matmuls
    and A-side kernels as FusedLoRAPair and FusedLoRA, with everything between them in one Triton kernel each way
    (kernels.swiglu_lora_forward / swiglu_lora_backward): fc_1's and fc_2's B adds, the SwiGLU, and proj's A side
    forward; backward proj's adapter share of its input gradient, SwiGLU's gradients, proj's A gradient and fc_1's
    and fc_2's B gradients. Against FusedLoRAPair + SwiGLU + FusedLoRA that is 50,688 bf16 elements of traffic per
    token and block less on paper (TinyLlama), and measured on an H100 +3.4% / +3.8% real tok/s for
    TinyLlama LoRA, +4.9% for QLoRA; the gain is the forward kernel's, the backward one runs at ~2x its bandwidth
    floor. The outputs and gradients are theirs, each dropout
    mask drawn from the same seed and salt, up to rounding: gate and up reach the SwiGLU rounded to 16 bits as
    before, and the SwiGLU's output gradient, which their kernels rounded, stays in fp32 inside the kernel.

    Keeps x, the frozen gate and up (rows x intermediate each, as SwiGLU kept the adapted ones), the r-wide A outputs
    and the seed: what the three layers kept. For one device and -true precision, as FusedLoRA."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mlp: torch.nn.Module, lora_a1: torch.Tensor, lora_b1: torch.Tensor,
                lora_a2: torch.Tensor, lora_b2: torch.Tensor, lora_a3: torch.Tensor, lora_b3: torch.Tensor,
                p: float, seed: torch.Tensor, salts: tuple[int, int, int]) -> torch.Tensor:
        fc_1, fc_2, proj = mlp.fc_1, mlp.fc_2, mlp.proj
        stacked = stacked_fc_weight(mlp)
        if stacked is not None:  # one matmul for both frozen layers: gate and up are its output's column halves
            gate_up = torch.nn.functional.linear(x, stacked)
            gate, up = gate_up[:, :stacked.shape[0] // 2], gate_up[:, stacked.shape[0] // 2:]
        else:
            gate, up = fc_1.linear(x), fc_2.linear(x)  # frozen: their B adds happen in the SwiGLU kernel
        after_a = kernels.lora_down(x, lora_a1, p, seed, salts[0], a2=lora_a2, salt2=salts[1])  # (tokens, 2 r)
        out, after_proj_a = kernels.swiglu_lora_forward(gate, up, after_a, lora_b1, lora_b2, fc_1.scaling,
                                                        fc_2.scaling, lora_a3, p, seed, salts[2])
        y = proj.linear(out)
        low_rank_add_(y, after_proj_a, lora_b3, proj.scaling, lora_parts(proj))
        ctx.save_for_backward(x, gate, up, after_a, after_proj_a, seed)
        ctx.mlp, ctx.p, ctx.salts = mlp, p, salts
        ctx.adapters = (lora_a1, lora_b1, lora_a2, lora_b2, lora_a3, lora_b3)  # parameters: reach their .grad
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, gate, up, after_a, after_proj_a, seed = ctx.saved_tensors
        fc_1, fc_2, proj = ctx.mlp.fc_1, ctx.mlp.fc_2, ctx.mlp.proj
        lora_a1, lora_b1, lora_a2, lora_b2, lora_a3, lora_b3 = ctx.adapters
        zero_grads_if_missing(*ctx.adapters)
        grad = grad.contiguous()
        grad_after_proj_a = low_rank_backward(grad, after_proj_a, lora_b3, proj.scaling, lora_parts(proj))
        grad_gate_up = torch.empty((gate.shape[0], 2 * gate.shape[1]), dtype=gate.dtype, device=gate.device)
        grad_gate, grad_up = kernels.swiglu_lora_backward(
            frozen_input_grad(proj.linear, grad), gate, up, after_a, lora_b1, lora_b2, fc_1.scaling, fc_2.scaling,
            lora_a3, grad_after_proj_a, ctx.p, seed, ctx.salts[2], lora_a3.grad, lora_b1.grad, lora_b2.grad,
            out=grad_gate_up)
        r = lora_a1.shape[0]
        grad_after_a = torch.empty_like(after_a)  # fc_1's and fc_2's: s grad B, B's own gradients already added
        grad_after_a[:, :r].addmm_(grad_gate, lora_b1.to(grad_gate.dtype), beta=0, alpha=fc_1.scaling)
        grad_after_a[:, r:].addmm_(grad_up, lora_b2.to(grad_up.dtype), beta=0, alpha=fc_2.scaling)
        input_grad = ctx.needs_input_grad[0]
        stacked = stacked_fc_weight(ctx.mlp)
        if not input_grad:
            frozen = None
        elif stacked is not None:  # both frozen layers' input gradients from one matmul over the stacked weights
            frozen = grad_gate_up.mm(stacked)
        else:
            frozen = frozen_input_grad(fc_2.linear, grad_up, into=frozen_input_grad(fc_1.linear, grad_gate))
        grad_x, _ = kernels.lora_down_backward(x, lora_a1, grad_after_a, ctx.p, seed, frozen, input_grad=input_grad,
                                               grad_a=lora_a1.grad, salt=ctx.salts[0], a2=lora_a2,
                                               salt2=ctx.salts[1], grad_a2=lora_a2.grad)
        return grad_x, None, None, None, None, None, None, None, None, None, None


def stack_fc_weights(model: torch.nn.Module) -> int:
    """Put each LoRA LLaMA MLP's frozen fc_1 and fc_2 weights one after the other in one tensor (the parameters
    become its two halves; their values, names and state_dict stay), for FusedLoRAMLP (the plan's
    ``stack_fc_weights``): frozen plain nn.Linear bases without bias. FusedLoRAMLP then runs one matmul for both
    forward (the output's column halves are gate and up) and one for both input gradients backward (where the second
    layer's matmul added into the first's output: a beta = 1 matmul, ~30 us slower per call than a plain one at
    TinyLlama's 4,096 rows on an H100). Measured on an H100 (TinyLlama LoRA): +1.2% real tok/s, the same losses and
    memory. Call it once the model is on its device in its final dtype (after fabric.setup_module,
    which may move parameters). Returns the MLPs stacked."""
    from litgpt.lora import LoRALinear
    from litgpt.model import LLaMAMLP

    stacked = 0
    for mlp in model.modules():
        if not (isinstance(mlp, LLaMAMLP) and isinstance(mlp.fc_1, LoRALinear) and isinstance(mlp.fc_2, LoRALinear)):
            continue
        first, second = mlp.fc_1.linear, mlp.fc_2.linear
        if not (type(first) is torch.nn.Linear and type(second) is torch.nn.Linear and first.bias is None
                and second.bias is None and first.weight.shape == second.weight.shape
                and first.weight.dtype == second.weight.dtype and first.weight.device == second.weight.device
                and not first.weight.requires_grad and not second.weight.requires_grad):
            continue
        if stacked_fc_weight(mlp) is None:  # (not already stacked)
            both = torch.cat([first.weight.data, second.weight.data])
            width = first.weight.shape[0]
            first.weight.data, second.weight.data = both[:width], both[width:]
        stacked += 1
    return stacked


def stacked_fc_weight(mlp: torch.nn.Module) -> torch.Tensor | None:
    """fc_1's and fc_2's weights as one (2 x intermediate, n_embd) tensor when they lie one after the other in one
    storage (stack_fc_weights), else None."""
    first, second = mlp.fc_1.linear.weight, mlp.fc_2.linear.weight
    if (first.dtype != second.dtype or first.shape != second.shape or first.device != second.device
            or not first.is_contiguous() or not second.is_contiguous()
            or first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
            or second.storage_offset() != first.storage_offset() + first.numel()):
        return None
    return first.detach().as_strided((2 * first.shape[0], first.shape[1]), (first.shape[1], 1))
