"""LLaMA's MLP for training: SwiGLU with its silu recomputed in the backward pass, in Triton kernels on CUDA; a LoRA
MLP's layers fused where the plan says so (:mod:`litft.layers.lora_fused`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from litft import kernels
from litft.layers import lora_fused
from litft.layers.lora_math import dropout_p


class SwiGLU(torch.autograd.Function):
    """LLaMAMLP's silu(a) * b (a = fc_1(x), b = fc_2(x)) keeping a and b for the backward pass and recomputing silu(a)
    there, where autograd keeps silu(a) as well: one tensor of intermediate_size per token less (TinyLlama: 11,264
    bytes per token and block in bf16; 1 GiB for 22 blocks at 4,096 positions), for one more elementwise pass in
    the backward pass. With ``fused`` (train.triton_kernels) on a CUDA tensor in eager mode: one Triton kernel each
    way (kernels.swiglu_forward/backward), where torch runs 2 forward and 4 backward."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, fused: bool = False) -> torch.Tensor:
        ctx.fused = fused and kernels.available(a)
        ctx.save_for_backward(a, b)
        return kernels.swiglu_forward(a, b) if ctx.fused else F.silu(a) * b

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        if ctx.fused:
            return *kernels.swiglu_backward(grad, a, b), None
        return torch.ops.aten.silu_backward(grad * b, a), grad * F.silu(a), None


def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """LLaMAMLP.forward with SwiGLU's silu recomputed in the backward pass (the plan's lean_swiglu), in Triton kernels
    on CUDA with ``self.triton_kernels``. A LoRA MLP the plan fuses (``fused_lora_mlp``) runs as one FusedLoRAMLP
    (the adapters inside the SwiGLU's kernels). Otherwise LoRA fc_1 and fc_2 that would each run as FusedLoRA run as
    one FusedLoRAPair, and a proj that runs as FusedLoRA is told SwiGLU's inputs: it keeps those, not its input."""
    rows = x.reshape(-1, x.shape[-1])
    if lora_fused.fused_lora_mlp_applies(self, rows):
        salts = (self.fc_1.lora_salt, self.fc_2.lora_salt, self.proj.lora_salt)
        out = lora_fused.FusedLoRAMLP.apply(rows, self, *lora_fused.lora_mlp_adapters(self), dropout_p(self.fc_1),
                                            self.fc_1.lora_seeds.tensor, salts)
        return out.view(*x.shape[:-1], -1)
    if lora_fused.fused_lora_pair_applies(self.fc_1, self.fc_2, rows):
        seed, salt, salt2 = lora_fused.lora_pair_seed(self.fc_1, self.fc_2, rows.device)
        gate, up = lora_fused.FusedLoRAPair.apply(rows, self.fc_1, self.fc_2, self.fc_1.lora_A, self.fc_1.lora_B,
                                                  self.fc_2.lora_A, self.fc_2.lora_B, dropout_p(self.fc_1), seed,
                                                  salt, salt2)
        gate, up = gate.view(*x.shape[:-1], -1), up.view(*x.shape[:-1], -1)
    else:
        gate, up = self.fc_1(x), self.fc_2(x)
    out = SwiGLU.apply(gate, up, self.triton_kernels)
    if getattr(self.proj, "fused_lora", False) and kernels.available(gate):
        return self.proj(out, swiglu_inputs=(gate, up))
    return self.proj(out)
