"""Triton kernels for the parts of a training step that eager PyTorch runs as several kernels, or with more memory
traffic than they need, forward and backward (train.triton_kernels). Each reads its inputs once and writes its
outputs once, in fp32 arithmetic rounded once to the output dtype. One module a family:

- swiglu: SwiGLU, silu(a) * b: torch runs 2 kernels forward and 4 backward;
- rope: RoPE on q and k, with v, from the qkv output: 3 torch kernels each way (roll, multiply, addcmul), and two
  concatenations in the backward pass to put the q, k and v gradients back into one;
- rms_norm: the residual stream's add with the RMSNorm after it: 2 kernels forward, 3 backward;
- cross_entropy: the loss's cross-entropy on 16-bit logits: torch's makes fp32 copies of the logits each way;
- seeded_dropout: LoRA's dropout, its mask drawn again from a seed in the backward pass instead of kept (1 byte per
  element);
- lora_a: LoRA's A side with its dropout (layers.lora_fused.FusedLoRA): x @ A^T with the mask drawn as x is read, and backward
  A's gradient and the adapter's input gradient added into the frozen layer's, in one pass over x each way;
- swiglu_lora: a LoRA MLP's middle (layers.lora_fused.FusedLoRAMLP): fc_1's and fc_2's B adds, the SwiGLU and proj's A side in
  one kernel each way, with the B gradients and proj's A gradient summed in the backward one;
- lora_b: a qkv layer's LoRA B side, every adapted part (q, k, v) in one launch forward and two backward, where
  cuBLAS runs one matmul per part forward and two backward;
- adamw: AdamW's step, without the write-back of clipped gradients that torch's fused kernel does (:class:`AdamW`);
- varlen_attention: causal attention within the segments of packed rows, grouped k/v heads.

lora_mask (the LoRA kernels' dropout mask, a hash of seed and place) and splits (a reduction split over programs,
their fp32 partial sums added in one launch) serve several of them; this module keeps the Triton import, the small
helpers every family uses, and the functions the rest of litft calls (``kernels.swiglu_forward``, ``kernels.AdamW``).

Why: in an eager step every torch op is its own kernel, and each reads and writes whole activations. Measured on an
H100, these kernels made a TinyLlama LoRA step 20% faster and a full fine-tune's 16% (docs/speed.md). torch.compile
fuses the same ops, but compiling a block takes 15-65 s, and eager blocks with these kernels measured faster than
compiled ones; they compile in seconds (Triton's JIT, cached on disk) and run inside litft's CUDA graphs like any
kernel.

Only on CUDA tensors, and not while torch.compile traces: elsewhere the functions of litft.model that use them run
torch ops. Triton ships with torch's CUDA builds; without it (a CPU-only install) `available()` is false. The
functions take any device's tensors, so the tests run them in Triton's interpreter (TRITON_INTERPRET=1) on the CPU
against the torch versions.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds do not ship Triton
    triton = None
    tl = None


def available(x: torch.Tensor) -> bool:
    """Whether the Triton kernels can take ``x``: a CUDA tensor, Triton installed, and not under torch.compile."""
    return triton is not None and x.is_cuda and not torch.compiler.is_compiling()


# 4,096 elements per program of the elementwise kernels: 8 warps x 32 threads x 16 elements, wide enough to stream
# at full bandwidth.
_ELEMENTWISE_BLOCK = 4096


@functools.lru_cache(maxsize=None)
def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _sm_count(t: torch.Tensor) -> int:
    """The streaming multiprocessors of t's GPU; 2 for a CPU tensor (the interpreter's tests)."""
    return torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 2


def _lora_precision(x: torch.Tensor) -> str:
    # fp32 inputs (the CPU tests' and a 32-true run's) multiply in fp32, as torch's matmul does by default, not tf32
    return "ieee" if x.dtype == torch.float32 else "tf32"


# The families, after the names above that they import from this module.
from litft.kernels import varlen_attention  # noqa: E402
from litft.kernels.adamw import AdamW, adamw_step_  # noqa: E402
from litft.kernels.cross_entropy import cross_entropy_backward_, cross_entropy_forward  # noqa: E402
from litft.kernels.lora_a import lora_down, lora_down_backward  # noqa: E402
from litft.kernels.lora_b import lora_up_, lora_up_backward  # noqa: E402
from litft.kernels.lora_mask import _lora_p16  # noqa: E402,F401  (the mask's threshold and scale, for callers' checks)
from litft.kernels.rms_norm import add_rms_norm, add_rms_norm_backward  # noqa: E402
from litft.kernels.rope import rope_qkv  # noqa: E402
from litft.kernels.seeded_dropout import dropout  # noqa: E402
from litft.kernels.swiglu import swiglu_backward, swiglu_forward  # noqa: E402
from litft.kernels.swiglu_lora import swiglu_lora_backward, swiglu_lora_forward  # noqa: E402

__all__ = [
    "AdamW", "add_rms_norm", "add_rms_norm_backward", "adamw_step_", "available", "cross_entropy_backward_",
    "cross_entropy_forward", "dropout", "lora_down", "lora_down_backward", "lora_up_", "lora_up_backward", "rope_qkv",
    "swiglu_backward", "swiglu_forward", "swiglu_lora_backward", "swiglu_lora_forward", "triton", "varlen_attention",
]
