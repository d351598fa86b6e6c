"""What a Fabric precision string means, in one place: the dtype weights are stored in, the dtype matmuls compute
in, and whether autocast (-mixed) or plain 16/32-bit tensors (-true) are at work.

    precision     weights stored   matmuls compute   autocast
    32-true       fp32             fp32 (TF32 on GPUs, where litft turns it on)
    bf16-mixed    fp32             bf16              yes: a 16-bit copy of each weight per matmul
    16-mixed      fp32             fp16              yes, with a loss scaler
    bf16-true     bf16             bf16              no
    16-true       fp16             fp16              no
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NAMES = ("32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true")

BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclass(frozen=True)
class Precision:
    """A Fabric precision string, read once."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"precision '{self.name}': choose one of {', '.join(NAMES)}")

    @property
    def mixed(self) -> bool:
        """-mixed: fp32 weights, 16-bit compute under autocast."""
        return self.name.endswith("-mixed")

    @property
    def true_16(self) -> bool:
        """bf16-true or 16-true: weights, gradients and optimizer state in 16 bits."""
        return self.name in ("bf16-true", "16-true")

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls and activations run in."""
        if self.name.startswith("bf16"):
            return torch.bfloat16
        if self.name.startswith("16"):
            return torch.float16
        return torch.float32

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype Fabric stores parameters in: -mixed keeps fp32 weights and casts per op."""
        return self.compute_dtype if self.name.endswith("-true") else torch.float32

    @property
    def half_compute(self) -> bool:
        """Matmuls in 16 bits (bf16 or fp16): what the Triton LoRA and attention kernels take."""
        return self.compute_dtype in (torch.bfloat16, torch.float16)

    @property
    def loss_scaled(self) -> bool:
        """16-mixed: Fabric's GradScaler owns the optimizer's grad_scale."""
        return self.name == "16-mixed"

    @property
    def param_bytes(self) -> int:
        return BYTES[self.param_dtype]

    @property
    def compute_bytes(self) -> int:
        return BYTES[self.compute_dtype]

    def peak_flops_key(self) -> str:
        """The column of metrics.PEAK_FLOPS a run's matmuls use: bf16, fp16, or tf32/fp32 for 32-true (TF32 when
        torch allows it for fp32 matmuls)."""
        if self.compute_dtype is torch.bfloat16:
            return "bf16"
        if self.compute_dtype is torch.float16:
            return "fp16"
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
