"""litft.kernels.varlen_attention's Triton kernels against SDPA with a block-diagonal causal mask in float64 (k and v
repeated to every head), output and q, k, v gradients: in fp32 (to rounding) and bf16 (within bf16 rounding), grouped
heads of several sizes, segments of uneven lengths (length 1, a padding tail, empty trailing segments, tiles straddling
boundaries), segments longer than max_length, dk/dv split over programs. On a CPU-only machine they run in Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET), at small sizes, and Triton's compiler builds the kernels for
sm_90 without a GPU; the `gpu` variants run the compiled kernels, also at TinyLlama's size with the module's tiles."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from litft import kernels
from litft.kernels import varlen_attention
from litft.kernels.varlen_attention import Tiles, VarlenGQAAttention

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# small tiles for the interpreter: several key blocks per query tile and several query steps per key block
SMALL = {"forward": Tiles(16, 16), "dq": Tiles(16, 16), "dkdv": Tiles(16, 16)}


@pytest.fixture(autouse=True)
def _needs_triton():
    assert kernels.triton is not None, "Triton is missing: `pip install -e .[test]` installs it"


def _reference(q, k, v, cu, max_length, scale):
    """SDPA over the whole row with a block-diagonal causal mask, k and v repeated to every head; queries max_length
    or more into their segment (a padding tail longer than max_length) give 0 and pass no gradient. In float64 by
    SDPA's math backend: on a GPU an fp32 reference is not exact enough for the fp32 checks, as SDPA may pick its
    memory-efficient kernel and litft's GPU runs (tests/test_gpu.py, in this process) turn on TF32 matmuls."""
    n, heads, _ = q.shape
    positions = torch.arange(n, device=q.device)
    segment = torch.searchsorted(cu[1:].long(), positions, right=True)
    allowed = (segment[:, None] == segment[None, :]) & (positions[None, :] <= positions[:, None])
    beyond = positions - cu.long()[segment] >= max_length
    allowed &= ~beyond[:, None] | (positions[:, None] == positions[None, :])  # those rows: only themselves, no NaN
    k, v = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale)
    return out.transpose(0, 1) * ~beyond[:, None, None]


def _check(device, dtype, n, heads, groups, bounds, head_dim=64, tiles=None, monkeypatch=None, max_length=512):
    torch.manual_seed(0)
    if tiles is not None:
        monkeypatch.setitem(varlen_attention.TILES, head_dim, tiles)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    q = torch.randn(n, heads, head_dim, device=device).to(dtype)
    k = torch.randn(n, groups, head_dim, device=device).to(dtype)
    v = torch.randn(n, groups, head_dim, device=device).to(dtype)
    grad = torch.randn(n, heads, head_dim, device=device).to(dtype)
    scale = head_dim ** -0.5

    leaves = [x.double().clone().requires_grad_() for x in (q, k, v)]  # the same (rounded) values, in float64
    expected = _reference(*leaves, cu, max_length, scale)
    expected.backward(grad.double())

    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = VarlenGQAAttention.apply(*inputs, cu, max_length, scale)
    out.backward(grad)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=3e-2)
    for name, actual, wanted in (("out", out, expected), *zip(("dq", "dk", "dv"), (x.grad for x in inputs),
                                                               (x.grad for x in leaves))):
        assert actual.shape == wanted.shape and actual.dtype == dtype, name
        torch.testing.assert_close(actual.double(), wanted.detach(), **tolerance, msg=lambda m: f"{name}: {m}")


# 90 positions: segments of 1, 7, 30 and 22 positions, a padding tail of 30, two empty trailing segments
UNEVEN = [0, 1, 8, 38, 60, 90, 90, 90]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,groups", [(4, 1), (4, 2), (4, 4)], ids=["gqa-4", "gqa-2", "mha"])
def test_small_tiles_match_sdpa(device, dtype, heads, groups, monkeypatch):
    """16-row tiles: 4 tokens of 4 heads (16 of 1), so most tiles and key blocks straddle a boundary."""
    _check(device, dtype, 90, heads, groups, UNEVEN, tiles=SMALL, monkeypatch=monkeypatch)


@pytest.mark.parametrize("device", DEVICES)
def test_default_tiles_match_sdpa(device):
    """The module's own tiles (128 query rows, 64 keys), segments longer than a key block, N not a tile multiple."""
    _check(device, torch.bfloat16, 200, 8, 2, [0, 3, 100, 101, 170, 200, 200])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [2, 3])
def test_split_key_blocks_match_sdpa(device, splits, monkeypatch):
    """dk/dv programs split over the query tiles of their key block, the fp32 partial sums added after."""
    _check(device, torch.float32, 90, 4, 2, UNEVEN, tiles=dict(SMALL, dkdv=Tiles(16, 16, splits=splits)),
           monkeypatch=monkeypatch)


@pytest.mark.parametrize("device", DEVICES)
def test_segments_longer_than_max_length(device, monkeypatch):
    """max_length 24 under segments of 30 and 60 (the padding tail): their queries from position 24 on give 0 and
    no gradient, as flash attention computes nothing past max_seqlen; the shorter segments are exact."""
    _check(device, torch.float32, 120, 4, 2, [0, 30, 40, 60, 120, 120], tiles=SMALL, monkeypatch=monkeypatch,
           max_length=24)


@pytest.mark.parametrize("device", DEVICES)
def test_group_size_not_dividing_the_tile(device, monkeypatch):
    """3 heads a group: 5 tokens per 16-row tile, the last row idle. Head size 32."""
    _check(device, torch.float32, 40, 6, 2, [0, 9, 10, 33, 40], head_dim=32,
           tiles={"forward": Tiles(16, 16), "dq": Tiles(16, 16), "dkdv": Tiles(16, 16)}, monkeypatch=monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,groups,head_dim", [(32, 4, 64), (16, 4, 128)], ids=["tinyllama", "head-128"])
def test_tinyllama_shape_on_gpu(heads, groups, head_dim):
    """TinyLlama's attention (32 heads, 4 groups, head size 64) on a 4,096-position row with the compiled kernels,
    and head size 128."""
    lengths = [512, 400, 300, 250, 222, 222, 200, 180, 150, 120, 100, 80, 60, 40, 8, 1]
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    bounds += [4096] * (34 - len(bounds))
    _check("cuda", torch.bfloat16, 4096, heads, groups, bounds, head_dim=head_dim)


def test_unsupported_head_size_raises():
    q = torch.zeros(8, 4, 48)
    k = torch.zeros(8, 2, 48)
    with pytest.raises(ValueError, match="head size"):
        VarlenGQAAttention.apply(q, k, k, torch.tensor([0, 8], dtype=torch.int32), 8, 1.0)


_COMPILE_FOR_SM90 = r"""
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from litft.kernels import varlen_attention as va

POINTERS = {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "seg_ptr": "*i32", "cu_ptr": "*i32"}
for head_dim in (64, 128):
    for name, kernel in (("forward", va._forward_kernel), ("dq", va._dq_kernel), ("dkdv", va._dkdv_kernel)):
        tiles = va.TILES[head_dim][name]
        constexprs = {"GROUP_HEADS": 8, "HEAD_DIM": head_dim, "ROWS": tiles.rows, "KEYS": tiles.keys,
                      "BOUNDS_LOG2": 6, "PRECISION": "tf32", "SPLITS": tiles.splits}
        signature = {}
        for p in inspect.signature(kernel.fn).parameters:
            if p in constexprs:
                signature[p] = "constexpr"
            elif p.endswith("_ptr"):
                signature[p] = POINTERS.get(p, "*bf16")
            else:
                signature[p] = "fp32" if p in ("qk_scale", "scale") else "i32"
        constexprs = {p: c for p, c in constexprs.items() if p in signature}
        # a real call's specialisation: pointers and strides multiples of 16
        attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(signature)
                 if p.endswith("_ptr") or "stride" in p}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": tiles.warps, "num_stages": tiles.stages})
        # tensor cores: wgmma, or mma.sync for dots of fewer than 64 rows a warpgroup
        assert "mma" in compiled.asm["ptx"], (head_dim, name)
signature = {"partial_k_ptr": "*fp32", "partial_v_ptr": "*fp32", "grad_k_ptr": "*bf16", "grad_v_ptr": "*bf16",
             "numel": "i32", "SPLITS": "constexpr", "BLOCK": "constexpr"}
constexprs = {"SPLITS": 2, "BLOCK": va._SUM_BLOCK}
triton.compile(ASTSource(fn=va._sum_splits_kernel, signature=signature, constexprs=constexprs),
               target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print("compiled")
"""


def test_kernels_compile_for_sm90():
    """Triton's compiler, not its interpreter (a subprocess without TRITON_INTERPRET), builds the kernels with the
    module's tiles for the H100 (sm_90), which the CPU-only machine can do without a GPU: the
    interpreter accepts shapes and ops that the compiler rejects."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("device", DEVICES)
def test_packed_attention_takes_the_kernels_where_they_apply(device, monkeypatch):
    """layers.attention.causal_attention on a packed row (a Packed mask, one row) runs these kernels for a module the
    plan gave triton_attention, and gives the output and q, k, v gradients of the path without them (flash
    attention's varlen ops on CUDA; SDPA with a block-diagonal mask on the CPU) within bf16 rounding. The plan's
    choice by train.attention_kernel: auto takes grouped heads of TRITON_ATTENTION_HEAD_SIZES only, flash none,
    triton any shape the kernels take. On the CPU the interpreter stands in for CUDA (kernels.available says yes), at
    head size 16 and small tiles; on CUDA TinyLlama's heads (32 of 64 over 4)."""
    from types import SimpleNamespace

    from litft.layers import attention
    from litft.plan import TRITON_ATTENTION_HEAD_SIZES, triton_attention_fits

    torch.manual_seed(0)
    if device == "cpu":
        monkeypatch.setattr(kernels, "available", lambda x: True)
        monkeypatch.setitem(varlen_attention.TILES, 16, SMALL)
        heads, groups, head_size, bounds = 4, 2, 16, UNEVEN
    else:
        heads, groups, head_size, bounds = 32, 4, 64, [0, 37, 237, 242, 512, 1000, 1024, 1024]
    n = bounds[-1]
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    calls = []
    real_apply = VarlenGQAAttention.apply
    monkeypatch.setattr(VarlenGQAAttention, "apply", lambda *args: calls.append(args) or real_apply(*args))
    config = SimpleNamespace(attention_scores_scalar=None, head_size=head_size)
    q, k, v = (torch.randn(1, n, h, head_size, device=device).to(torch.bfloat16) for h in (heads, groups, groups))
    grad = torch.randn(1, n, heads, head_size, device=device).to(torch.bfloat16)
    results = []
    for triton_attention in (True, False):
        module = SimpleNamespace(config=config, mscale=1.0, triton_attention=triton_attention)
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attention.causal_attention(module, *inputs, attention.Packed(cu, 512))
        out.backward(grad)
        results.append([out.float(), *(x.grad.float() for x in inputs)])
        assert len(calls) == 1  # the first pass only
    for actual, wanted in zip(*results):
        torch.testing.assert_close(actual, wanted, rtol=2e-2, atol=3e-2)
    # train.attention_kernel, as the plan decides it: auto takes grouped heads of the measured sizes only; flash
    # never; triton any shape the kernels take
    assert triton_attention_fits(64, 32, 4, "auto") and 64 in TRITON_ATTENTION_HEAD_SIZES
    assert not triton_attention_fits(64, 32, 32, "auto")  # ungrouped heads
    assert not triton_attention_fits(128, 32, 4, "auto")  # not a measured size
    assert not triton_attention_fits(64, 32, 4, "flash") and not triton_attention_fits(128, 32, 32, "flash")
    assert triton_attention_fits(128, 32, 32, "triton") and triton_attention_fits(head_size, heads, groups, "triton")
    assert not triton_attention_fits(100, 32, 32, "triton")  # a head size the kernels do not take
    # a module of ungrouped heads the plan gave the kernels (attention_kernel triton) runs them
    k_all = k.repeat_interleave(heads // groups, dim=2)
    module = SimpleNamespace(config=config, mscale=1.0, triton_attention=True)
    attention.causal_attention(module, q, k_all, k_all, attention.Packed(cu, 512))
    assert len(calls) == 2
