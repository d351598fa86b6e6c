"""Attention for training: packed rows (attention kept within each sample), RoPE and the qkv split, grouped k/v heads
passed to the kernels as they are.

Installed on LitGPT's CausalSelfAttention by :func:`litft.layers.use_fast_layers`: ``packed_attention`` always (it
adds packed rows and is LitGPT's own method otherwise); ``attention_forward`` where the plan's ``fast_attention``
says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from litft import kernels
from litft.kernels import varlen_attention


@dataclass
class Packed:
    """Passed through LitGPT's Block as its `mask` argument: the sample boundaries of a packed row."""

    cu_seqlens: torch.Tensor
    max_length: int


def _varlen_signature() -> tuple[dict | None, bool]:
    """torch's flash-attention varlen op, if this torch has it: its causal keyword (2.10 takes is_causal, later
    versions window_size), and whether it takes grouped k/v heads (enable_gqa; without it, k and v are repeated)."""
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    params = inspect.signature(varlen_attn).parameters
    gqa = "enable_gqa" in params
    if "window_size" in params:
        return {"window_size": (-1, 0)}, gqa
    if "is_causal" in params:
        return {"is_causal": True}, gqa
    return None, False


_VARLEN_KWARGS, _VARLEN_GQA = _varlen_signature()
VARLEN_DEVICES = ("cuda",)  # where packed rows use torch's varlen op (tests add "cpu" with reference kernels)


class GroupedFlashAttention(torch.autograd.Function):
    """Causal flash attention within each cu_seqlens segment of q (N, heads, head_size) over k, v (N, groups,
    head_size) with grouped heads: torch's flash-attention ops (aten._flash_attention_forward / _backward) called as
    torch.nn.attention.varlen calls them, k and v passed at their groups. For a torch whose varlen_attn does not take
    enable_gqa (2.11): there k and v would be repeated to every head first, a copy of each in the forward pass and a
    sum in the backward (TinyLlama: 2 x 8 times the k/v bytes per layer and pass), and the repeated copies kept for
    the backward pass. Flash attention reads each group for its heads' queries itself."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_length: int, scale: float):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng_state, unused)
        ctx.max_length, ctx.scale = max_length, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_seqlens, rng_state, unused = ctx.saved_tensors
        grad_q, grad_k, grad_v = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, ctx.max_length, ctx.max_length, 0.0,
            True, rng_state, unused, scale=ctx.scale)
        return grad_q, grad_k, grad_v, None, None, None


def triton_attention_applies(module, q: torch.Tensor) -> bool:
    """Whether packed attention of q (1, N, heads, D) runs litft's Triton kernels: where the plan chose them
    (``module.triton_attention``, set by use_fast_layers), for one packed row of a CUDA tensor."""
    return getattr(module, "triton_attention", False) and q.shape[0] == 1 and kernels.available(q)


def packed_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
    """CausalSelfAttention.scaled_dot_product_attention, plus packed rows: when `mask` is a Packed, each sample
    attends only to itself. q, k, v: (1, heads, N, head_size), k and v already repeated to all heads by LitGPT.
    Returns (1, N, heads, head_size), as LitGPT's method does."""
    if not isinstance(mask, Packed):
        return type(self).scaled_dot_product_attention(self, q, k, v, mask)
    return causal_attention(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)


def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Packed | None) -> torch.Tensor:
    """Causal attention of q (B, T, heads, head_size) over k, v (B, T, kv heads, head_size), within each sample of
    a packed row when `mask` is a Packed (B = 1). Grouped k and v heads go to the kernels as they are (flash attention
    and SDPA's enable_gqa read each group for its queries). Returns (B, T, heads, head_size)."""
    scale = 1.0 / math.sqrt(self.config.attention_scores_scalar or self.config.head_size) * self.mscale**2
    b, t, heads, head_size = q.shape
    if isinstance(mask, Packed) and triton_attention_applies(self, q):
        # (1, N, H, D) -> (N, H, D): views, as for the varlen op below
        q_, k_, v_ = (x.reshape(t, x.shape[2], head_size) for x in (q, k, v))
        y = varlen_attention.VarlenGQAAttention.apply(q_, k_, v_, mask.cu_seqlens, mask.max_length, scale)
        return y.view(b, t, heads, head_size)
    if isinstance(mask, Packed) and q.device.type in VARLEN_DEVICES and _VARLEN_KWARGS is not None:
        from torch.nn.attention.varlen import varlen_attn

        # (1, N, H, D) -> (N, H, D): views; flash attention needs only the last dimension contiguous
        q_, k_, v_ = (x.reshape(t, x.shape[2], head_size) for x in (q, k, v))
        cu = mask.cu_seqlens
        gqa = {}
        if k_.shape[1] != heads:
            if _VARLEN_GQA:
                gqa = {"enable_gqa": True}
            elif not torch.compiler.is_compiling():
                y = GroupedFlashAttention.apply(q_, k_, v_, cu, mask.max_length, scale)
                return y.view(b, t, heads, head_size)
            else:  # this torch's varlen op wants every head, and dynamo traces only it: repeat, as LitGPT does
                k_, v_ = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k_, v_))
        y = varlen_attn(q_, k_, v_, cu, cu, mask.max_length, mask.max_length, scale=scale, **_VARLEN_KWARGS, **gqa)
        return y.view(b, t, heads, head_size)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, T, D), as SDPA takes them
    gqa = k.shape[1] != heads
    if isinstance(mask, Packed):  # elsewhere (CPU): a block-diagonal causal mask over the row; exact, O(N^2) memory
        segment = torch.searchsorted(mask.cu_seqlens[1:].long(), torch.arange(t, device=q.device), right=True)
        allowed = (segment[:, None] == segment[None, :]) & torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    else:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return y.transpose(1, 2)


class RotaryEmbedding(torch.autograd.Function):
    """LitGPT's apply_rope, x cos + rotate_half(x) sin with rotate_half(x) = (-x2, x1), keeping only the tables for the
    backward pass, in 3 torch kernels each way: rotate_half(x) sin = roll(x) s' with roll(x) = (x2, x1) (x rolled by
    half the head) and s' = (-sin1, sin2), so the forward is one multiply and one addcmul. The map is linear in x and
    its transpose is the same with -s', so the backward is too. LitGPT's version runs ~6 kernels each way per tensor
    (a negation, two concatenations, two multiplies, an add). With Triton kernels, :class:`RopeQKV` instead."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        signed_sin = _signed_sin(sin)
        ctx.save_for_backward(cos, signed_sin)
        return _rope_by_roll(x, cos, signed_sin).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, signed_sin = ctx.saved_tensors
        return _rope_by_roll(grad, cos, signed_sin, transpose=True).to(grad.dtype), None, None


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """s' = (-sin1, sin2) over the last dimension's halves: rotate_half(x) sin = roll(x) s'."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rope_by_roll(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, transpose: bool = False,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x cos + roll(x) s' (RoPE), or with ``transpose`` x cos - roll(x) s' (its transpose: the backward pass), in 3
    torch kernels; into ``out`` when given."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin, value=-1 if transpose else 1,
                         out=out)


class RopeQKV(torch.autograd.Function):
    """The qkv output (B, T, (heads + 2 groups) x head_size) split into q (B, T, heads, head_size), k and v (B, T,
    groups, head_size), RoPE applied to q and k; on CUDA in one Triton kernel each way (kernels.rope_qkv), elsewhere
    with :class:`RotaryEmbedding`'s torch ops. The backward pass writes the q, k and v gradients straight into one qkv
    gradient, and v leaves as its own tensor, so the attention kernel's saved v does not keep the whole qkv output
    alive. Through autograd, splitting the qkv output and roping q and k puts the gradients back with two
    concatenations (of q with k, then of both with v): two more reads and writes of the whole qkv gradient, 2 x 22 per
    pass in TinyLlama; and v, a view, keeps the qkv output (TinyLlama: 2,560 values per token and block for v's 256)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, groups: int):
        b, t, width = qkv.shape
        head_size = width // (heads + 2 * groups)
        q, k, v = qkv.view(b, t, heads + 2 * groups, head_size).split((heads, groups, groups), dim=2)
        ctx.groups, ctx.fused = groups, kernels.available(qkv)
        if ctx.fused:
            ctx.save_for_backward(cos, sin)
            return kernels.rope_qkv(q, k, v, cos, sin)
        cos, signed_sin = cos.unsqueeze(2), _signed_sin(sin).unsqueeze(2)
        ctx.save_for_backward(cos, signed_sin)
        q, k = (_rope_by_roll(x, cos, signed_sin).to(x.dtype) for x in (q, k))
        return q, k, v.contiguous()

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor):
        b, t, heads, head_size = grad_q.shape
        grad_qkv = torch.empty(b, t, heads + 2 * ctx.groups, head_size, dtype=grad_q.dtype, device=grad_q.device)
        parts = grad_qkv.split((heads, ctx.groups, ctx.groups), dim=2)
        if ctx.fused:
            cos, sin = ctx.saved_tensors
            kernels.rope_qkv(grad_q, grad_k, grad_v, cos, sin, transpose=True, out=parts)
        else:
            cos, signed_sin = ctx.saved_tensors
            for grad, part in zip((grad_q, grad_k), parts):
                _rope_by_roll(grad, cos, signed_sin, transpose=True, out=part)
            parts[2].copy_(grad_v)
        return grad_qkv.view(b, t, -1), None, None, None, None


def attention_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None, input_pos=None,
                      input_pos_maxp1=None) -> torch.Tensor:
    """CausalSelfAttention.forward for training Llama-style attention (train.fast_attention): RoPE on q and k
    together as one RotaryEmbedding (q and k are adjacent columns of the qkv output), or with Triton kernels
    (train.triton_kernels, eager) q, k and v out of the qkv output in one :class:`RopeQKV`; k, v left at their
    n_query_groups heads for the kernel, where LitGPT's forward ropes q and k separately, concatenates each with its
    (empty) unroped part and repeats k and v to all heads (TinyLlama: 4 groups copied to 32 heads, each way).
    With a KV cache (generation) it is LitGPT's own forward."""
    if input_pos is not None:
        return type(self).forward(self, x, cos, sin, mask, input_pos, input_pos_maxp1)
    b, t, _ = x.shape
    heads, groups, head_size = self.config.n_head, self.config.n_query_groups, self.config.head_size
    qkv = self.qkv(x)
    if self.triton_kernels and not torch.compiler.is_compiling():
        q, k, v = RopeQKV.apply(qkv, cos, sin, heads, groups)
    else:
        qk, v = qkv.split(((heads + groups) * head_size, groups * head_size), dim=-1)
        qk = RotaryEmbedding.apply(qk.view(b, t, heads + groups, head_size), cos.unsqueeze(2), sin.unsqueeze(2))
        q, k = qk.split((heads, groups), dim=2)  # split (not slicing): its backward is one concatenation
        v = v.view(b, t, groups, head_size)
    y = causal_attention(self, q, k, v, mask)
    return self.proj(y.reshape(b, t, heads * head_size))
