"""litft.kernels' Triton kernels against the torch functions they replace: SwiGLU (model.SwiGLU's torch path), RoPE
(LitGPT's own apply_rope and its autograd gradient) and the loss (F.cross_entropy), forward and backward, in fp32 (equal to rounding) and bf16
(within bf16 rounding). On a CPU-only machine they run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET); the `gpu` variants run the compiled kernels on CUDA."""

import pytest
import torch

from litft import kernels
from litft.kernels import adamw, lora_mask
from litft.layers.mlp import SwiGLU

_adamw_step = kernels.adamw_step_  # the kernel's launcher, before a test wraps it

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def _needs_triton():
    assert kernels.triton is not None, "Triton is missing: `pip install -e .[test]` installs it"


def _bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # bf16 keeps 8 significant bits: an element may differ by a few units of its last place
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_kernels_match_torch(device, dtype):
    torch.manual_seed(0)
    # 5,000 elements: more than one program of 4,096, the second one partly masked
    a, b, grad = (torch.randn(2, 50, 50, device=device) for _ in range(3))
    a32, b32 = a.clone().requires_grad_(), b.clone().requires_grad_()
    expected = SwiGLU.apply(a32, b32, False)
    expected.backward(grad)

    out = kernels.swiglu_forward(a.to(dtype), b.to(dtype))
    grad_a, grad_b = kernels.swiglu_backward(grad.to(dtype), a.to(dtype), b.to(dtype))
    assert out.dtype == grad_a.dtype == grad_b.dtype == dtype
    if dtype == torch.float32:
        for actual, wanted in ((out, expected), (grad_a, a32.grad), (grad_b, b32.grad)):
            torch.testing.assert_close(actual, wanted.detach(), rtol=1e-5, atol=1e-6)
    else:
        for actual, wanted in ((out, expected), (grad_a, a32.grad), (grad_b, b32.grad)):
            _bf16_close(actual, wanted.detach())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_row_tables", [False, True], ids=["shared-tables", "per-row-tables"])
def test_rope_qkv_kernel_matches_litgpts_apply_rope(device, dtype, per_row_tables):
    """The kernel on q, k and v as LitGPT's attention lays them out (strided slices of the qkv output, grouped k/v
    heads) gives apply_rope's q and k and v itself, and with transpose=True apply_rope's gradients (v's passed
    through), written into slices of one qkv gradient as model.RopeQKV's backward pass does. Per-row tables: packed
    rows, whose positions restart with each sample."""
    from litgpt.model import apply_rope, build_rope_cache

    torch.manual_seed(0)
    rows, positions, heads, groups, head_size = 2, 9, 6, 2, 16
    cos, sin = build_rope_cache(32, head_size, device=torch.device(device))
    if per_row_tables:
        index = torch.stack([torch.arange(positions), torch.arange(positions) % 4]).to(device)  # row 1: 3 samples
        cos, sin = cos[index], sin[index]  # (rows, positions, head_size)
    else:
        cos, sin = cos[:positions].unsqueeze(0), sin[:positions].unsqueeze(0)  # (1, positions, head_size)
    qkv = torch.randn(rows, positions, heads + 2 * groups, head_size, device=device)
    q, k, v = qkv.split((heads, groups, groups), dim=2)
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()

    # apply_rope takes (rows, heads, positions, head_size) and tables of (rows or 1, positions, head_size)
    x = torch.cat((q, k), dim=2).transpose(1, 2).detach().clone().requires_grad_()
    expected = apply_rope(x, cos, sin)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    expected, expected_grad = expected.transpose(1, 2), x.grad.transpose(1, 2)
    grad_v = torch.randn_like(v)

    cos_, sin_ = cos.to(dtype), sin.to(dtype)
    out = kernels.rope_qkv(q.to(dtype), k.to(dtype), v.to(dtype), cos_, sin_)
    assert [o.shape for o in out] == [q.shape, k.shape, v.shape]
    assert all(o.is_contiguous() and o.dtype == dtype for o in out)
    grad_q, grad_k = grad.transpose(1, 2).to(dtype).split((heads, groups), dim=2)
    grad_qkv = torch.full(qkv.shape, float("nan"), dtype=dtype, device=device)
    written = kernels.rope_qkv(grad_q.contiguous(), grad_k.contiguous(), grad_v.to(dtype), cos_, sin_,
                               out=grad_qkv.split((heads, groups, groups), dim=2), transpose=True)
    assert all(w.data_ptr() == s.data_ptr() for w, s in zip(written, grad_qkv.split((heads, groups, groups), 2)))
    check = (lambda a, b: torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-5)) \
        if dtype == torch.float32 else _bf16_close
    check(torch.cat(out[:2], dim=2), expected)
    assert torch.equal(out[2], v.to(dtype))
    check(grad_qkv[:, :, : heads + groups], expected_grad)
    assert torch.equal(grad_qkv[:, :, heads + groups:], grad_v.to(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_kernels_match_torchs(device, dtype):
    """model.CrossEntropySum (the kernels through autograd) against F.cross_entropy on the same logits in fp32: the
    summed loss over labelled positions and its gradient (scaled by an upstream gradient), unlabelled positions
    (-100) contributing neither; a vocabulary of 5,000 (two loop blocks, the second partly masked)."""
    import torch.nn.functional as F

    from litft.data import IGNORE_INDEX
    from litft.layers.loss import CrossEntropySum

    torch.manual_seed(0)
    logits = (torch.randn(9, 5000, device=device) * 4).to(dtype)
    labels = torch.randint(0, 5000, (9,), device=device)
    labels[[2, 7]] = IGNORE_INDEX
    reference = logits.float().clone().requires_grad_()
    expected = F.cross_entropy(reference, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    (expected * 0.37).backward()

    fused = logits.clone().requires_grad_()
    loss = CrossEntropySum.apply(fused * 1, labels)  # * 1: a non-leaf, as the output layer's logits are
    (loss * 0.37).backward()
    assert loss.dtype == torch.float32 and fused.grad.dtype == dtype
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-4)
    assert (fused.grad[[2, 7]] == 0).all()
    if dtype == torch.float32:
        torch.testing.assert_close(fused.grad, reference.grad, rtol=1e-5, atol=1e-7)
    else:  # the gradient rounded to bf16 once; softmax values are at most 1
        torch.testing.assert_close(fused.grad.float(), reference.grad, rtol=1e-2, atol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_dropout_draws_its_mask_again_from_the_seed(device):
    """kernels.dropout: about p of the elements zeroed, the rest scaled by 1 / (1 - p); the same seed, the same mask
    (so model.SeededDropout's backward pass applies the forward's mask); another seed, another mask."""
    from litft.layers.lora import SeededDropout

    x = torch.rand(64, 100, device=device) + 0.5  # no zeros of its own
    seed = torch.tensor([1234], device=device)
    out = kernels.dropout(x, 0.25, seed)
    dropped = out == 0
    assert 0.2 < dropped.float().mean().item() < 0.3
    torch.testing.assert_close(out[~dropped], x[~dropped] / 0.75)
    assert torch.equal(kernels.dropout(x, 0.25, seed), out)
    assert not torch.equal(kernels.dropout(x, 0.25, seed + 1) == 0, dropped)

    leaf = x.clone().requires_grad_()
    y = SeededDropout.apply(leaf * 1, 0.25)
    y.backward(torch.ones_like(y))
    assert torch.equal(leaf.grad == 0, y == 0)  # the gradient passes exactly where the forward kept
    torch.testing.assert_close(leaf.grad[y != 0], torch.full_like(leaf.grad[y != 0], 1 / 0.75))


@pytest.mark.gpu
def test_seeded_dropout_draws_a_new_mask_in_each_cuda_graph_replay():
    """The seed is drawn from torch's generator inside the graph, which advances with each replay: a captured step
    does not repeat its dropout masks."""
    from litft.layers.lora import SeededDropout

    x = torch.ones(4096, device="cuda")
    SeededDropout.apply(x, 0.5)  # Triton compiles the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = SeededDropout.apply(x, 0.5)
    masks = []
    for _ in range(3):
        graph.replay()
        masks.append(out == 0)
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    assert all(0.4 < m.float().mean().item() < 0.6 for m in masks)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stream_gradient", [True, False], ids=["stream-grad", "last-norm"])
def test_add_rms_norm_matches_an_add_and_torchs_rms_norm(device, dtype, stream_gradient):
    """model.AddRMSNorm against residual + delta then F.rms_norm: both outputs, and the gradients of residual, delta
    and the weight, with the new residual feeding later layers (its gradient added in) or nothing (the last norm).
    A hidden size of 48 (masked columns in a block of 64) and 7 rows over 4 programs (one does fewer)."""
    import torch.nn.functional as F

    from litft.layers.norm import AddRMSNorm

    torch.manual_seed(0)
    residual, delta = torch.randn(7, 48, device=device), torch.randn(7, 48, device=device)
    weight = torch.rand(48, device=device) + 0.5
    grad_out, grad_stream = torch.randn(7, 48, device=device), torch.randn(7, 48, device=device)

    def run(fused: bool):
        leaves = [t.to(dtype).requires_grad_() for t in (residual, delta, weight)]
        r, d, w = leaves
        if fused:
            new_residual, out = AddRMSNorm.apply(r * 1, d * 1, w, 1e-5)
        else:
            new_residual = r + d
            out = F.rms_norm(new_residual, (48,), w, 1e-5)
        loss = (out * grad_out.to(dtype)).sum()
        if stream_gradient:
            loss = loss + (new_residual * grad_stream.to(dtype)).sum()
        loss.backward()
        return [new_residual.detach(), out.detach()] + [t.grad for t in leaves]

    for actual, expected in zip(run(True), run(False)):
        if dtype == torch.float32:
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        else:
            _bf16_close(actual, expected)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_fused_residual_norms_give_the_blocks_loss_and_gradients(tiny_recipe, monkeypatch, method):
    """CausalLM with fused_residual_norms (each residual add fused into the norm after it, the last into ln_f)
    computes what LitGPT's Block.forward computes: the same loss and gradients of every trainable weight (the norm
    weights among them in a full fine-tune), fp32, on a packed batch. On the CPU the kernels run in Triton's
    interpreter: kernels.available is made to say yes."""
    import copy

    from litft.data import collate_packed
    from litft.layers import use_fast_layers
    from litft.model import CausalLM, model_config
    from litft.plan import residual_norms_fuse
    from tests.test_fast_path import _loss_and_grads, _lora_gpt, _samples

    if method == "lora":
        gpt = _lora_gpt(tiny_recipe, ["q", "k", "v", "o", "mlp"])
    else:
        from litgpt.model import GPT

        torch.manual_seed(0)
        gpt = GPT(model_config(tiny_recipe(method="full")))
    use_fast_layers(gpt)
    assert residual_norms_fuse(gpt.config)
    reference = CausalLM(copy.deepcopy(gpt), loss_chunk=0, max_seq_length=64)
    fused = CausalLM(gpt, loss_chunk=0, max_seq_length=64, fused_residual_norms=True)
    monkeypatch.setattr(kernels, "available", lambda x: True)
    batch = collate_packed(_samples([20, 30, 9]), pad_id=0)
    loss, grads = _loss_and_grads(fused, batch)
    loss_ref, grads_ref = _loss_and_grads(reference, batch)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_ref.keys() and grads
    if method == "full":
        assert any("norm" in name or "ln_f" in name for name in grads)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_kernels_take_only_cuda_tensors():
    """On CPU tensors layers.mlp.SwiGLU runs its torch ops even when asked for the kernels."""
    a = torch.randn(4, 8)
    assert not kernels.available(a)
    torch.testing.assert_close(SwiGLU.apply(a, a, True), SwiGLU.apply(a, a, False))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_norm", [None, 0.05])
@pytest.mark.parametrize("skip", [False, True])
def test_adamw_kernel_steps_as_torchs_fused_adamw(device, dtype, max_norm, skip, monkeypatch):
    """kernels.AdamW against torch.optim.AdamW(fused=True), the weights through the Triton kernel and the biases
    through torch's fused op (the size threshold lowered): three steps with weight decay, a learning rate changed
    between steps (as the scheduler does) and the same gradients (of magnitudes 1e-6 to 1), clipped through
    grad_scale (litft's clip_gradients) or not, and with ``skip`` the middle step skipped on the device (found_inf
    1, the others 0, as litft's loop sets it). Equal parameters and moments (fp32: to a few units of the last
    place; bf16: within a bf16 step), the skipped step changing nothing, the Triton kernel's gradients left as they
    were (torch's kernel writes them back divided), and a state_dict that torch's AdamW loads and steps on from."""
    import lightning as L

    from litft.train.optim import clip_gradients

    fabric = L.Fabric(accelerator=device, devices=1)
    monkeypatch.setattr(adamw, "ADAMW_TRITON_MIN_NUMEL", 1000)  # the weights (4,800 and 6,000), not the biases
    launched = []
    monkeypatch.setattr(adamw, "adamw_step_", lambda p, *args, **kw: launched.append(p.numel()) or
                        _adamw_step(p, *args, **kw))

    def gradient(p, step):  # the same for both optimizers, whatever their weights became
        g = torch.Generator().manual_seed(1000 * step + p.numel())
        scale = 10.0 ** torch.randint(-6, 1, p.shape, generator=g)
        return (torch.randn(p.shape, generator=g) * scale).to(device, dtype)

    results = []
    for cls in (kernels.AdamW, torch.optim.AdamW):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 300), torch.nn.Linear(300, 20)).to(device, dtype)
        model, optimizer = fabric.setup(model, cls(model.parameters(), lr=0.01, weight_decay=0.1, fused=True))
        for step in range(3):
            optimizer.param_groups[0]["lr"] = 0.01 * (step + 1)
            for p in model.parameters():
                p.grad = gradient(p, step)
            if max_norm is not None:
                clip_gradients(fabric, model, optimizer, max_norm, in_step=True)
            if skip:
                optimizer.optimizer.found_inf = torch.tensor(float(step == 1), device=device)
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.step()
            if skip and step == 1:
                assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
                assert all(float(s["step"]) == 1 for s in optimizer.optimizer.state.values())
            if cls is kernels.AdamW:  # the Triton kernel's gradients as they were (torch's op divides the others)
                assert all(torch.equal(p.grad, gradient(p, step)) for p in model.parameters() if p.numel() >= 1000)
            optimizer.zero_grad()
        results.append(([p.detach().clone() for p in model.parameters()], optimizer.state_dict()))
    assert sorted(set(launched)) == [4800, 6000] and len(launched) == 3 * 2  # a skipped step launches too
    (params, state), (ref_params, ref_state) = results
    # bf16: Triton's interpreter (the CPU variant) rounds fp32 to bf16 toward zero, the GPU to nearest as torch does:
    # a bf16 step (2^-8 relative) per rounding there, over three steps
    bf16_rtol = 3e-2 if device == "cpu" else 1e-2
    # (moments: sums of gradients of either sign, so a rounding of the tensor's largest values is the unit)
    check = (lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)) if dtype == torch.float32 \
        else (lambda a, b: torch.testing.assert_close(a.float(), b.float(), rtol=bf16_rtol,
                                                      atol=bf16_rtol * b.float().abs().max().item()))
    for p, ref in zip(params, ref_params):
        if dtype == torch.float32:
            check(p, ref)
        else:  # and weights that cross 0: a bf16 step of the ~0.25 they started from (Linear(16, .)'s init) is 2^-10
            torch.testing.assert_close(p.float(), ref.float(), rtol=bf16_rtol, atol=1e-3)
    for index, ref in ref_state["state"].items():
        assert state["state"][index]["step"].item() == ref["step"].item() == (2 if skip else 3)
        check(state["state"][index]["exp_avg"], ref["exp_avg"])
        check(state["state"][index]["exp_avg_sq"], ref["exp_avg_sq"])
    # the state loads into torch's AdamW, which steps on from it
    model = torch.nn.Sequential(torch.nn.Linear(16, 300), torch.nn.Linear(300, 20)).to(device, dtype)
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
            p.grad = gradient(p, 3)
    torch_adamw = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, fused=True)
    torch_adamw.load_state_dict(state)
    torch_adamw.step()
    assert all(s["step"].item() == (3 if skip else 4) for s in torch_adamw.state.values())


def _lora_mask(rows: int, k: int, p: float, seed: torch.Tensor, device) -> torch.Tensor:
    """The mask the LoRA kernels draw for a (rows, k) input: the input gradient of dropout(x) @ ones^T for an
    incoming gradient of ones is the scaled mask itself."""
    ones = torch.ones(1, k, device=device)
    grad_x, _ = kernels.lora_down_backward(torch.ones(rows, k, device=device), ones, torch.ones(rows, 1, device=device),
                                           p, seed, None)
    return grad_x != 0


def _mix32_reference(x):
    """lora_mask._mix32 in numpy's wrapping uint32 arithmetic."""
    import numpy as np

    x = np.asarray(x, dtype=np.uint32)
    with np.errstate(over="ignore"):  # the products wrap, as uint32 multiplies do on the GPU
        x = (x ^ (x >> np.uint32(16))) * np.uint32(0x7FEB352D)
        x = (x ^ (x >> np.uint32(15))) * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def _lora_mask_reference(rows: int, k: int, p: float, seed: int) -> torch.Tensor:
    """The keep mask as litft.kernels.lora_mask's docstring specifies it, computed apart from the kernels: word
    row x ceil(k / 64) x 32 + col // 2, XORed with the key of the seed, hashed; the low 16 bits for the even column,
    the high 16 for the odd one; kept when at least p16."""
    import numpy as np

    key = _mix32_reference(np.uint32(seed & 0xFFFFFFFF) ^ _mix32_reference(np.uint32(seed >> 32)))
    row, col = np.meshgrid(np.arange(rows, dtype=np.int64), np.arange(k, dtype=np.int64), indexing="ij")
    words = (row * (-(-k // 64) * 32) + col // 2).astype(np.uint32)
    uniforms = _mix32_reference(words ^ key)
    halves = np.where(col % 2 == 0, uniforms & np.uint32(0xFFFF), uniforms >> np.uint32(16))
    return torch.from_numpy(halves >= lora_mask._lora_p16(p)[0])


def test_lora_masks_are_the_specified_hash_and_look_independent():
    """The LoRA kernels' mask is the documented function of seed and place (checked against a numpy version on a
    shape with a partial column group), and, over 512 x 2,048 elements, behaves as independent draws: the dropped
    fraction within 5 standard deviations of p; two neighbours (along a row, down a column), the same element under
    two salts (two layers of one pass) or two seeds (two passes) dropped together at the rate of independent draws,
    p^2, within 5 standard deviations."""
    seed = 2**40 + 987654321
    mask = _lora_mask(70, 80, 0.25, torch.tensor([seed]), "cpu")
    assert torch.equal(mask, _lora_mask_reference(70, 80, 0.25, seed))
    assert torch.equal(_lora_mask(3, 200, 0.05, torch.tensor([seed + 7]), "cpu"),
                       _lora_mask_reference(3, 200, 0.05, seed + 7))

    p, rows, k = 0.05, 512, 2048
    dropped = ~_lora_mask_reference(rows, k, p, seed)
    n = dropped.numel()
    assert abs(dropped.double().mean().item() - p) < 5 * (p * (1 - p) / n) ** 0.5
    both_p = p * p
    pairs = {
        "along a row": (dropped[:, 1:], dropped[:, :-1]),
        "down a column": (dropped[1:], dropped[:-1]),
        "another salt": (dropped, ~_lora_mask_reference(rows, k, p, seed + 1)),
        "another seed": (dropped, ~_lora_mask_reference(rows, k, p, seed + 2**33)),
    }
    for name, (first, second) in pairs.items():
        together = (first & second).double().mean().item()
        assert abs(together - both_p) < 5 * (both_p * (1 - both_p) / first.numel()) ** 0.5, (name, together)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_in", ["added-in-place", "new", "no-input-grad"])
def test_lora_down_kernels_apply_one_mask_forward_and_backward(device, grad_in):
    """kernels.lora_down is dropout(x) @ a^T, and lora_down_backward its gradients with respect to x (added in place
    into the frozen layer's input gradient, or new, or skipped) and to a, all with the one mask the seed gives: the
    mask drawn through an identity a. 70 rows (2 row splits of 64 on the CPU, one partly filled; 3 row tiles of 32)
    and 80 columns (a column group of 64 and a partly masked one), an r of 12 (R padded to 16); fp32, where the
    interpreter's dot is exact up to summation order."""
    torch.manual_seed(0)
    rows, k, r, p = 70, 80, 12, 0.25
    seed = torch.tensor([987654321], device=device)
    mask = _lora_mask(rows, k, p, seed, device)
    assert 0.2 < 1 - mask.float().mean().item() < 0.3
    assert torch.equal(_lora_mask(rows, k, p, seed, device), mask)
    assert not torch.equal(_lora_mask(rows, k, p, seed + 1, device), mask)
    p16, scale = lora_mask._lora_p16(p)
    assert p16 == 16384 and scale == 1 / (1 - p)  # 0.25 is a multiple of 2^-16: exact
    x, a = torch.randn(rows, k, device=device), torch.randn(r, k, device=device)
    # references in float64: a GPU session may have set fp32 matmuls to TF32 (torch.set_float32_matmul_precision)
    dropped = x.double() * mask * scale
    for splits in (1, 2):  # one program per row block, or the columns split over two and their partial sums added
        torch.testing.assert_close(kernels.lora_down(x, a, p, seed, splits=splits, block_k=64).double(),
                                   dropped @ a.double().t(), rtol=1e-5, atol=1e-4)

    grad_after_a, frozen_grad = torch.randn(rows, r, device=device), torch.randn(rows, k, device=device)
    given = frozen_grad.clone() if grad_in == "added-in-place" else None
    grad_x, grad_a = kernels.lora_down_backward(x, a, grad_after_a, p, seed, given,
                                                input_grad=grad_in != "no-input-grad")
    expected_grad_a = grad_after_a.double().t() @ dropped
    torch.testing.assert_close(grad_a.double(), expected_grad_a, rtol=1e-5, atol=1e-4)
    earlier = torch.randn(r, k, device=device)  # a .grad from earlier micro-batches: the partial sums added into it
    into = earlier.clone()
    kernels.lora_down_backward(x, a, grad_after_a, p, seed, None, input_grad=False, grad_a=into)
    torch.testing.assert_close(into.double(), earlier.double() + expected_grad_a, rtol=1e-5, atol=1e-4)
    adapter_share = mask * (grad_after_a.double() @ a.double()) * scale
    if grad_in == "added-in-place":
        assert grad_x is given
        torch.testing.assert_close(grad_x.double(), frozen_grad.double() + adapter_share, rtol=1e-5, atol=1e-5)
    elif grad_in == "new":
        torch.testing.assert_close(grad_x.double(), adapter_share, rtol=1e-5, atol=1e-5)
    else:
        assert grad_x is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pair", [False, True])
def test_lora_down_kernels_without_dropout_are_the_plain_matmuls(device, pair):
    """With p 0 the kernels draw no mask (DROPOUT off): lora_down is x @ a^T, and lora_down_backward adds g @ a into
    the frozen input gradient and g^T x into a's .grad; one adapter or the pair. fp32 against float64."""
    torch.manual_seed(0)
    rows, k, r = 70, 80, 12
    seed = torch.tensor([5], device=device)
    x, a, a2 = torch.randn(rows, k, device=device), torch.randn(r, k, device=device), torch.randn(r, k, device=device)
    both = torch.cat([a, a2]) if pair else a
    extra = dict(a2=a2, salt2=1) if pair else {}
    torch.testing.assert_close(kernels.lora_down(x, a, 0.0, seed, **extra).double(), x.double() @ both.double().t(),
                               rtol=1e-5, atol=1e-4)
    g, frozen = torch.randn(rows, both.shape[0], device=device), torch.randn(rows, k, device=device)
    grad_a, grad_a2 = torch.zeros_like(a), torch.zeros_like(a2)
    grads = dict(a2=a2, salt2=1, grad_a2=grad_a2) if pair else {}
    grad_x, _ = kernels.lora_down_backward(x, a, g, 0.0, seed, frozen.clone(), grad_a=grad_a, **grads)
    torch.testing.assert_close(grad_x.double(), frozen.double() + g.double() @ both.double(), rtol=1e-5, atol=1e-4)
    expected = g.double().t() @ x.double()
    torch.testing.assert_close(grad_a.double(), expected[:r], rtol=1e-5, atol=1e-4)
    if pair:
        torch.testing.assert_close(grad_a2.double(), expected[r:], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_lora_down_backward_rebuilds_a_swiglu_input_as_the_forward_kernel_made_it(device):
    """With ``gate``, lora_down_backward takes the layer's input as silu(gate) * up, rebuilt tile by tile: the same
    gradients as from the product swiglu_forward wrote (the MLP's proj keeps fc_1's and fc_2's outputs, not it)."""
    torch.manual_seed(0)
    rows, k, r, p = 70, 80, 12, 0.25
    seed = torch.tensor([13579], device=device)
    gate, up = torch.randn(rows, k, device=device), torch.randn(rows, k, device=device)
    product = kernels.swiglu_forward(gate, up) if kernels.available(gate) else gate * torch.sigmoid(gate) * up
    a, grad_after_a = torch.randn(r, k, device=device), torch.randn(rows, r, device=device)
    frozen_grad = torch.randn(rows, k, device=device)
    from_product = kernels.lora_down_backward(product, a, grad_after_a, p, seed, frozen_grad.clone())
    rebuilt = kernels.lora_down_backward(up, a, grad_after_a, p, seed, frozen_grad.clone(), gate=gate)
    for got, wanted in zip(rebuilt, from_product):
        torch.testing.assert_close(got, wanted, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 2])
def test_lora_down_pair_is_two_adapters_with_their_own_masks_from_one_read(device, splits):
    """lora_down with ``a2`` (LLaMA's fc_1 and fc_2 over one input) gives what two calls give, each adapter with the
    mask of its own salt, side by side; lora_down_backward with ``a2`` gives both adapters' gradients and the sum of
    their input-gradient shares added into the frozen layers' one, as two calls and an add do. fp32, interpreter."""
    torch.manual_seed(0)
    rows, k, r, p = 70, 80, 12, 0.25
    seed, salt, salt2 = torch.tensor([24680], device=device), 5, 6
    x = torch.randn(rows, k, device=device)
    a, a2 = torch.randn(r, k, device=device), torch.randn(r, k, device=device)
    both = kernels.lora_down(x, a, p, seed, salt, a2=a2, salt2=salt2, splits=splits, block_k=64)
    assert both.shape == (rows, 2 * r)
    alone = (kernels.lora_down(x, a, p, seed, salt, splits=splits, block_k=64),
             kernels.lora_down(x, a2, p, seed, salt2, splits=splits, block_k=64))
    assert not torch.allclose(alone[0], kernels.lora_down(x, a, p, seed, salt2, splits=splits, block_k=64))
    torch.testing.assert_close(both, torch.cat(alone, dim=1), rtol=1e-6, atol=1e-6)

    grad_after_a, frozen_grad = torch.randn(rows, 2 * r, device=device), torch.randn(rows, k, device=device)
    earlier, earlier2 = torch.randn(r, k, device=device), torch.randn(r, k, device=device)
    grad_a, grad_a2 = earlier.clone(), earlier2.clone()
    grad_x, _ = kernels.lora_down_backward(x, a, grad_after_a, p, seed, frozen_grad.clone(), grad_a=grad_a, salt=salt,
                                           a2=a2, salt2=salt2, grad_a2=grad_a2)
    first, expected_a = kernels.lora_down_backward(x, a, grad_after_a[:, :r].contiguous(), p, seed, None, salt=salt)
    second, expected_a2 = kernels.lora_down_backward(x, a2, grad_after_a[:, r:].contiguous(), p, seed, None,
                                                     salt=salt2)
    torch.testing.assert_close(grad_x, frozen_grad + first + second, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_a, earlier + expected_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_a2, earlier2 + expected_a2, rtol=1e-5, atol=1e-5)
    # without the input gradient (an input that needs none): the adapters' gradients only
    grad_a, grad_a2 = earlier.clone(), earlier2.clone()
    none, _ = kernels.lora_down_backward(x, a, grad_after_a, p, seed, None, input_grad=False, grad_a=grad_a, salt=salt,
                                         a2=a2, salt2=salt2, grad_a2=grad_a2)
    assert none is None
    torch.testing.assert_close(grad_a2, earlier2 + expected_a2, rtol=1e-5, atol=1e-5)


def _lora_mlp_middle(gate, up, after_a, b1, b2, s1, s2, a, mask, scale):
    """The reference for kernels.swiglu_lora_forward: what FusedLoRAPair's B adds, SwiGLU and FusedLoRA's A side
    compute between the MLP's frozen matmuls, as torch ops (mask: proj's dropout mask, scale: 1 / keep rate)."""
    r = a.shape[0]
    gate = gate + s1 * after_a[:, :r] @ b1.t()
    up = up + s2 * after_a[:, r:] @ b2.t()
    out = torch.nn.functional.silu(gate) * up
    return out, (out * mask * scale) @ a.t()


@pytest.fixture
def full_fp32_matmuls():
    """fp32 matmuls in full fp32 for the test: an earlier GPU test (a training run) may have allowed TF32, which
    rounds cuBLAS's fp32 products to 10 bits."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits,b_grads,p,stacked", [(1, True, 0.25, False), (2, True, 0.25, True),
                                                      (2, False, 0.25, False), (2, True, 0.0, True)])
def test_swiglu_lora_kernels_are_the_lora_mlps_middle_with_its_gradients(device, splits, b_grads, p, stacked,
                                                                         full_fp32_matmuls):
    """kernels.swiglu_lora_forward is fc_1's and fc_2's B adds, SwiGLU and proj's dropout(out) @ A^T (proj's mask
    that of lora_down with the same seed and salt), and swiglu_lora_backward gives autograd's gradients of the same
    function: with respect to the adapted gate and up, proj's A (added into its .grad) and fc_1's and fc_2's B (added
    into theirs; by the kernel, or with ``b_grads`` False by cuBLAS after it). 70 rows (3 row tiles of 32, one partly
    filled; several row splits), 80 intermediate columns (a column tile of 64 and a partly masked one; forward, one
    or two column splits), r 12 (R padded to 16); and with p 0 (no mask drawn). ``stacked``: gate and up are the
    column halves of one tensor (FusedLoRAMLP's one matmul for fc_1 and fc_2). The backward kernel writes both
    gradients into the halves of one (rows, 2 K) tensor. fp32 against float64 references."""
    torch.manual_seed(0)
    rows, k, r, salt = 70, 80, 12, 7
    seed = torch.tensor([1357911], device=device)
    mask = _lora_mask(rows, k, p, seed + salt, device).double()  # the kernels draw with seed + salt
    scale = 1 / (1 - p)
    s1, s2 = 0.5, 2.0
    gate_up = torch.randn(rows, 2 * k, device=device)
    gate, up = (gate_up[:, :k], gate_up[:, k:]) if stacked else (gate_up[:, :k].clone(), gate_up[:, k:].clone())
    assert gate.is_contiguous() != stacked
    after_a = torch.randn(rows, 2 * r, device=device)
    b1, b2 = torch.randn(k, r, device=device) / 3, torch.randn(k, r, device=device) / 3
    a = torch.randn(r, k, device=device) / 3
    out, after_proj_a = kernels.swiglu_lora_forward(gate, up, after_a, b1, b2, s1, s2, a, p, seed, salt,
                                                    splits=splits, block_k=64)
    leaves = [t.double().requires_grad_() for t in (gate, up, b1, b2, a)]
    expected_out, expected_after = _lora_mlp_middle(leaves[0], leaves[1], after_a.double(), leaves[2], leaves[3],
                                                    s1, s2, leaves[4], mask, scale)
    torch.testing.assert_close(out.double(), expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after_proj_a.double(), expected_after, rtol=1e-5, atol=1e-4)

    grad, grad_after_proj_a = torch.randn(rows, k, device=device), torch.randn(rows, r, device=device)
    expected = torch.autograd.grad((expected_out * grad.double()).sum()
                                   + (expected_after * grad_after_proj_a.double()).sum(), leaves)
    earlier = [torch.randn(r, k, device=device), torch.randn(k, r, device=device), torch.randn(k, r, device=device)]
    grad_a, grad_b1, grad_b2 = (t.clone() for t in earlier)  # .grad from earlier micro-batches: added into
    grad_gate, grad_up = kernels.swiglu_lora_backward(grad, gate, up, after_a, b1, b2, s1, s2, a, grad_after_proj_a,
                                                      p, seed, salt, grad_a, grad_b1, grad_b2, block_k=64,
                                                      b_grads=b_grads)
    torch.testing.assert_close(grad_gate.double(), expected[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad_up.double(), expected[1], rtol=1e-5, atol=1e-4)
    both = grad_gate._base  # one (rows, 2 K) tensor
    assert both is not None and both.shape == (rows, 2 * k) and torch.equal(both, torch.cat([grad_gate, grad_up], 1))
    for got, before, wanted in zip((grad_b1, grad_b2, grad_a), (earlier[1], earlier[2], earlier[0]), expected[2:]):
        torch.testing.assert_close(got.double(), before.double() + wanted, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_lora_down_kernels_in_bf16_on_cuda_match_torch_at_training_sizes():
    """At a TinyLlama layer's sizes (4,096 rows, K = 2,048 and 5,632, r x 3 = 96 for q, k, v) in bf16: the kernels
    against torch's matmuls over the same mask, within bf16 rounding; and a mask rate of p."""
    torch.manual_seed(0)
    p = 0.05
    p16, scale = lora_mask._lora_p16(p)
    assert abs(p16 / 65536 - p) < 1e-5
    for k, r in ((2048, 96), (5632, 32)):
        seed = torch.tensor([4242], device="cuda")
        x = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
        a = (torch.randn(r, k, device="cuda") / k**0.5).to(torch.bfloat16)
        mask = _lora_mask(4096, k, p, seed, "cuda")
        assert abs((1 - mask.float().mean().item()) - p) < 0.002
        dropped = x.double() * mask * scale  # float64 references: no TF32, whatever the session set
        _bf16_close(kernels.lora_down(x, a, p, seed), dropped @ a.double().t())
        grad_after_a = torch.randn(4096, r, device="cuda", dtype=torch.bfloat16)
        frozen_grad = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
        grad_x, grad_a = kernels.lora_down_backward(x, a, grad_after_a, p, seed, frozen_grad.clone())
        expected = frozen_grad.double() + mask * (grad_after_a.double() @ a.double()) * scale
        _bf16_close(grad_x, expected)
        # bf16 products are exact in fp32; the fp32 sums of 4,096 of them differ from float64's by rounding only
        torch.testing.assert_close(grad_a.double(), grad_after_a.double().t() @ dropped, rtol=1e-4, atol=1e-3)


def _lora_up_case(rows, sizes, enabled, r, device, dtype):
    """A B side's inputs and float64 results: out (rows, sum(sizes)), h (rows, r per adapted part), B (its rows, r),
    the output gradient; the parts of the adapted sizes (their output columns, B's rows, h's columns); out + s h B^T,
    h's gradient and B's gradient (added into ones: an earlier micro-batch's .grad)."""
    parts, column, b_row, h_column = [], 0, 0, 0
    for size, on in zip(sizes, enabled):
        if on:
            parts.append((column, column + size, b_row, h_column))
            b_row, h_column = b_row + size, h_column + r
        column += size
    out, grad = (torch.randn(rows, column, device=device).to(dtype) for _ in range(2))
    h = torch.randn(rows, h_column, device=device).to(dtype)
    b = (torch.randn(b_row, r, device=device) / r**0.5).to(dtype)
    scale = 0.5
    want_out, want_h, want_b = out.double().clone(), torch.zeros(h.shape, dtype=torch.float64, device=device), \
        torch.ones(b.shape, dtype=torch.float64, device=device)
    for start, end, first_b, first_h in parts:
        part_b, part_h = b.double()[first_b:first_b + end - start], h.double()[:, first_h:first_h + r]
        want_out[:, start:end] += scale * part_h @ part_b.t()
        want_h[:, first_h:first_h + r] = scale * grad.double()[:, start:end] @ part_b
        want_b[first_b:first_b + end - start] += scale * grad.double()[:, start:end].t() @ part_h
    return tuple(parts), out, h, b, grad, scale, (want_out, want_h, want_b)


@pytest.mark.parametrize("sizes, enabled", [((64, 16, 16), (1, 1, 1)), ((64, 16, 16), (1, 0, 1)),
                                            ((40,), (1,)), ((72, 24, 24), (0, 1, 0))],
                         ids=["q-k-v", "q-v", "one-part", "k-only"])
def test_lora_up_kernels_are_the_b_sides_matmuls(sizes, enabled):
    """kernels.lora_up_ adds s h_p B_p^T into each part's output columns in place, and lora_up_backward returns h's
    gradient s grad_p B_p and adds B's, s grad_p^T h_p, into its .grad, for 1-3 parts (q, k, v of a qkv layer, some
    left out: B's rows and h's columns then skip them). 70 rows (row tiles of 16 and row splits, the last partly
    filled); parts of 16-72 columns in blocks of 16 and 32 (some partly masked). fp32, in the interpreter on the
    CPU: equal to float64 up to summation order."""
    torch.manual_seed(0)
    parts, out, h, b, grad, scale, (want_out, want_h, want_b) = _lora_up_case(70, sizes, enabled, 12, "cpu",
                                                                              torch.float32)
    for block_n in (16, 32):
        got = kernels.lora_up_(out.clone(), h, b, scale, parts, block_m=16, block_n=block_n)
        torch.testing.assert_close(got.double(), want_out, rtol=1e-5, atol=1e-5)
        grad_b = torch.ones_like(b)
        grad_h = kernels.lora_up_backward(grad, h, b, scale, parts, grad_b, h_block_m=16, h_block_n=block_n,
                                          b_block_m=16, b_block_n=block_n)
        torch.testing.assert_close(grad_h.double(), want_h, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad_b.double(), want_b, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_lora_up_kernels_in_bf16_on_cuda_match_torch_at_training_sizes():
    """The B side's kernels at a TinyLlama qkv layer's sizes (4,096 rows; q 2,048, k 256, v 256 columns; r 32) and
    a proj's (one part of 2,048), compiled for the GPU at their default launches, against float64 within bf16
    rounding; B's gradient (fp32 sums over row splits, rounded once) within bf16's rounding of its size."""
    torch.manual_seed(0)
    for sizes in ((2048, 256, 256), (2048,)):
        parts, out, h, b, grad, scale, (want_out, want_h, want_b) = _lora_up_case(
            4096, sizes, (1,) * len(sizes), 32, "cuda", torch.bfloat16)
        _bf16_close(kernels.lora_up_(out.clone(), h, b, scale, parts), want_out)
        grad_b = torch.ones_like(b)
        grad_h = kernels.lora_up_backward(grad, h, b, scale, parts, grad_b)
        torch.testing.assert_close(grad_h.double(), want_h, rtol=2e-2, atol=0.1)  # sums of 2,048 products
        torch.testing.assert_close(grad_b.double(), want_b, rtol=2e-2, atol=0.5)  # sums of 4,096: |B grad| ~ 30


@pytest.mark.gpu
def test_swiglu_lora_kernels_in_bf16_on_cuda_match_torch_at_training_sizes():
    """The LoRA MLP's middle kernels at TinyLlama's sizes (4,096 rows, 5,632 intermediate, r 32, p 0.05), compiled
    for the GPU, against float64 torch over the same mask: outputs and the gate/up gradients within bf16 rounding, the
    adapter gradients (fp32 sums of 4,096 rows, one rounding) within 1%."""
    torch.manual_seed(0)
    rows, k, r, p, salt = 4096, 5632, 32, 0.05, 21
    seed = torch.tensor([8642], device="cuda")
    mask = _lora_mask(rows, k, p, seed + salt, "cuda").double()
    scale = lora_mask._lora_p16(p)[1]

    def bf16(*shape, std=1.0):
        return (torch.randn(*shape, device="cuda") * std).to(torch.bfloat16)

    gate, up, after_a = bf16(rows, k), bf16(rows, k), bf16(rows, 2 * r)
    b1, b2, a = bf16(k, r, std=0.05), bf16(k, r, std=0.05), bf16(r, k, std=k**-0.5)
    out, after_proj_a = kernels.swiglu_lora_forward(gate, up, after_a, b1, b2, 0.5, 0.5, a, p, seed, salt)
    leaves = [t.double().requires_grad_() for t in (gate, up, b1, b2, a)]
    expected_out, expected_after = _lora_mlp_middle(leaves[0], leaves[1], after_a.double(), leaves[2], leaves[3],
                                                    0.5, 0.5, leaves[4], mask, scale)
    _bf16_close(out, expected_out)
    _bf16_close(after_proj_a, expected_after)
    grad, grad_after_proj_a = bf16(rows, k), bf16(rows, r)
    expected = torch.autograd.grad((expected_out * grad.double()).sum()
                                   + (expected_after * grad_after_proj_a.double()).sum(), leaves)
    grad_a, grad_b1, grad_b2 = torch.zeros_like(a), torch.zeros_like(b1), torch.zeros_like(b2)
    grad_gate, grad_up = kernels.swiglu_lora_backward(grad, gate, up, after_a, b1, b2, 0.5, 0.5, a, grad_after_proj_a,
                                                      p, seed, salt, grad_a, grad_b1, grad_b2)
    _bf16_close(grad_gate, expected[0])
    _bf16_close(grad_up, expected[1])
    for got, wanted in zip((grad_b1, grad_b2, grad_a), expected[2:]):
        torch.testing.assert_close(got.double(), wanted, rtol=1e-2, atol=1e-2 * wanted.abs().max().item())


@pytest.mark.gpu
def test_lora_down_pair_in_bf16_on_cuda_is_two_calls_at_training_sizes():
    """The pair launch (LLaMA's fc_1 and fc_2: 4,096 rows, K 2,048, r 32, bf16, compiled for the GPU) gives what two
    single calls give: the same A outputs side by side, the same adapter gradients, and their input-gradient
    shares added into the frozen one, within bf16 rounding."""
    torch.manual_seed(0)
    rows, k, r, p = 4096, 2048, 32, 0.05
    seed, salt, salt2 = torch.tensor([97531], device="cuda"), 11, 12
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    a, a2 = ((torch.randn(r, k, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(2))
    both = kernels.lora_down(x, a, p, seed, salt, a2=a2, salt2=salt2)
    _bf16_close(both, torch.cat([kernels.lora_down(x, a, p, seed, salt), kernels.lora_down(x, a2, p, seed, salt2)], 1))
    grad_after_a = torch.randn(rows, 2 * r, device="cuda", dtype=torch.bfloat16)
    frozen = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    grad_a, grad_a2 = torch.zeros_like(a), torch.zeros_like(a2)
    grad_x, _ = kernels.lora_down_backward(x, a, grad_after_a, p, seed, frozen.clone(), grad_a=grad_a, salt=salt,
                                           a2=a2, salt2=salt2, grad_a2=grad_a2)
    first, expected_a = kernels.lora_down_backward(x, a, grad_after_a[:, :r].contiguous(), p, seed, None, salt=salt)
    second, expected_a2 = kernels.lora_down_backward(x, a2, grad_after_a[:, r:].contiguous(), p, seed, None,
                                                     salt=salt2)
    _bf16_close(grad_x, frozen.double() + first.double() + second.double())
    torch.testing.assert_close(grad_a.float(), expected_a.float(), rtol=1e-2, atol=1e-2)  # grad_a: bf16 sums
    torch.testing.assert_close(grad_a2.float(), expected_a2.float(), rtol=1e-2, atol=1e-2)


_COMPILE_FOR_SM90 = r"""
import itertools
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from litft import kernels
from litft.kernels import lora_a, lora_b, splits, swiglu_lora

def compile_for_sm90(kernel, signature, constexprs):
    num_warps = constexprs.pop("num_warps", 4)
    # the divisibility a real call's pointers, sizes and strides get (multiples of 16): the specialisation under which
    # the first version of these kernels failed to compile on the H100
    divisible = [i for i, (name, kind) in enumerate(signature.items())
                 if kind.startswith("*") or (kind == "i32" and name not in ("M", "rows_per_split", "salt", "salt2", "p16"))]
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})

forward = {"x_ptr": "*bf16", "a_ptr": "*bf16", "a2_ptr": "*bf16", "out_ptr": "*bf16", "seed_ptr": "*i64", "salt": "i32",
           "salt2": "i32", "M": "i32",
           "K": "i32", "R": "i32", "stride_x": "i32", "stride_a": "i32", "stride_out": "i32", "stride_split": "i32",
           "columns_per_split": "i32", "p16": "i32", "inv_keep": "fp32", "BLOCK_M": "constexpr", "BLOCK_K": "constexpr",
           "BLOCK_R": "constexpr", "PRECISION": "constexpr", "PAIR": "constexpr",
           "DROPOUT": "constexpr"}
backward = {"x_ptr": "*bf16", "gate_ptr": "*bf16", "a_ptr": "*bf16", "a2_ptr": "*bf16", "g_ptr": "*bf16",
            "grad_in_ptr": "*bf16", "grad_x_ptr": "*bf16", "partial_ptr": "*fp32", "seed_ptr": "*i64", "salt": "i32",
            "salt2": "i32", "M": "i32", "K": "i32", "R": "i32",
            "stride_x": "i32", "stride_a": "i32", "stride_g": "i32", "stride_grad": "i32", "rows_per_split": "i32", "p16": "i32",
            "inv_keep": "fp32", "HAS_GRAD_IN": "constexpr", "WRITE_GRAD_X": "constexpr", "BLOCK_M": "constexpr",
            "BLOCK_K": "constexpr", "BLOCK_R": "constexpr", "PRECISION": "constexpr",
            "SWIGLU": "constexpr", "PAIR": "constexpr", "DROPOUT": "constexpr"}
for k, r in ((2048, 16), (2048, 32), (2048, 96), (5632, 32)):  # every launch _lora_down*_launch picks
    block_r = max(16, kernels._next_power_of_2(r))
    launch = lora_a._lora_down_launch(k)
    pairs = (False, True) if (k, r) == (2048, 32) else (False,)  # the pair: LLaMA's fc_1 and fc_2 over one input
    for out in ("*bf16", "*fp32"):  # the result, or the splits' partial sums
        for pair, dropout in itertools.product(pairs, (True, False)):  # dropout False: p = 0, no mask drawn
            compile_for_sm90(lora_a._lora_down_kernel, dict(forward, out_ptr=out),
                             {"BLOCK_M": launch["block_m"], "BLOCK_K": launch["block_k"], "BLOCK_R": block_r,
                              "PRECISION": "tf32", "PAIR": pair,
                              "DROPOUT": dropout, "num_warps": launch["num_warps"]})
    launch = lora_a._lora_down_backward_launch(k, r)
    variants = [(True, True, False, False), (False, True, False, False), (False, False, False, False),
                (True, True, True, False)]  # (HAS_GRAD_IN, WRITE_GRAD_X, SWIGLU, PAIR)
    if True in pairs:
        variants += [(True, True, False, True), (False, False, False, True)]
    for has_grad_in, write_grad_x, swiglu, pair in variants:
        compile_for_sm90(lora_a._lora_down_backward_kernel, backward,
                         {"BLOCK_M": launch["block_m"], "BLOCK_K": launch["block_k"], "BLOCK_R": block_r,
                          "HAS_GRAD_IN": has_grad_in, "WRITE_GRAD_X": write_grad_x, "PRECISION": "tf32",
                          "SWIGLU": swiglu, "PAIR": pair,
                          "DROPOUT": has_grad_in, "num_warps": launch["num_warps"]})  # p = 0 runs too
mlp_forward = {"gate_ptr": "*bf16", "up_ptr": "*bf16", "h_ptr": "*bf16", "b1_ptr": "*bf16", "b2_ptr": "*bf16",
               "a_ptr": "*bf16", "out_ptr": "*bf16", "hp_ptr": "*bf16", "seed_ptr": "*i64", "salt": "i32",
               "scale1": "fp32", "scale2": "fp32", "M": "i32", "K": "i32", "R": "i32", "stride_in": "i32",
               "stride_h": "i32", "stride_hp": "i32", "stride_split": "i32", "columns_per_split": "i32", "p16": "i32",
               "inv_keep": "fp32",
               "BLOCK_M": "constexpr", "BLOCK_K": "constexpr", "BLOCK_R": "constexpr", "PRECISION": "constexpr",
               "DROPOUT": "constexpr"}
mlp_backward = {"grad_ptr": "*bf16", "gate_ptr": "*bf16", "up_ptr": "*bf16", "h_ptr": "*bf16", "b1_ptr": "*bf16",
                "b2_ptr": "*bf16", "a_ptr": "*bf16", "gp_ptr": "*bf16", "grad_gate_ptr": "*bf16", "grad_up_ptr": "*bf16",
                "partial_ptr": "*fp32", "seed_ptr": "*i64", "salt": "i32", "scale1": "fp32", "scale2": "fp32",
                "M": "i32", "K": "i32", "R": "i32", "stride_in": "i32", "stride_out": "i32", "stride_h": "i32",
                "stride_gp": "i32", "rows_per_split": "i32",
                "p16": "i32", "inv_keep": "fp32", "BLOCK_M": "constexpr", "BLOCK_K": "constexpr",
                "BLOCK_R": "constexpr", "PRECISION": "constexpr", "B_GRADS": "constexpr",
                "DROPOUT": "constexpr"}
for k in (5632, 2048):  # TinyLlama's intermediate size, and a small one (one split)
    launch = swiglu_lora._swiglu_lora_forward_launch(k)
    for hp, dropout in (("*bf16", True), ("*fp32", True), ("*fp32", False)):
        compile_for_sm90(swiglu_lora._swiglu_lora_forward_kernel, dict(mlp_forward, hp_ptr=hp),
                         {"BLOCK_M": launch["block_m"], "BLOCK_K": launch["block_k"], "BLOCK_R": 32, "PRECISION": "tf32",
                          "DROPOUT": dropout, "num_warps": launch["num_warps"]})
    launch = swiglu_lora._swiglu_lora_backward_launch(k)
    for b_grads in (True, False):
        compile_for_sm90(swiglu_lora._swiglu_lora_backward_kernel, mlp_backward,
                         {"BLOCK_M": launch["block_m"], "BLOCK_K": launch["block_k"], "BLOCK_R": 32,
                          "PRECISION": "tf32", "B_GRADS": b_grads,
                          "DROPOUT": b_grads, "num_warps": launch["num_warps"]})
parts = {f"{name}{i}": "i32" for i in range(3) for name in ("start", "end", "b_row", "h_column")}
up_launch, up_backward_launch = lora_b._lora_up_launch(), lora_b._lora_up_backward_launch()
compile_for_sm90(lora_b._lora_up_kernel,
                 {"out_ptr": "*bf16", "h_ptr": "*bf16", "b_ptr": "*bf16", "M": "i32", "R": "i32", "stride_out": "i32",
                  "stride_h": "i32", "scale": "fp32", "blocks0": "i32", "blocks1": "i32", **parts,
                  "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_R": "constexpr", "PRECISION": "constexpr"},
                 {"BLOCK_M": up_launch["block_m"], "BLOCK_N": up_launch["block_n"], "BLOCK_R": 32, "PRECISION": "tf32",
                  "num_warps": up_launch["num_warps"]})
for count in (1, 3):  # a LoRALinear's one part; q, k and v
    compile_for_sm90(lora_b._lora_up_grad_h_kernel,
                     {"grad_ptr": "*bf16", "b_ptr": "*bf16", "grad_h_ptr": "*bf16", "M": "i32", "R": "i32",
                      "stride_grad": "i32", "stride_grad_h": "i32", "scale": "fp32", **parts, "PARTS": "constexpr",
                      "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_R": "constexpr", "PRECISION": "constexpr"},
                     {"PARTS": count, "BLOCK_M": up_backward_launch["h_block_m"],
                      "BLOCK_N": up_backward_launch["h_block_n"], "BLOCK_R": 32, "PRECISION": "tf32",
                      "num_warps": up_backward_launch["h_warps"]})
compile_for_sm90(lora_b._lora_up_grad_b_kernel,
                 {"grad_ptr": "*bf16", "h_ptr": "*bf16", "partial_ptr": "*fp32", "M": "i32", "R": "i32",
                  "b_rows": "i32", "stride_grad": "i32", "stride_h": "i32", "scale": "fp32", "rows_per_split": "i32",
                  "blocks0": "i32", "blocks1": "i32", **parts, "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                  "BLOCK_R": "constexpr", "PRECISION": "constexpr"},
                 {"BLOCK_M": up_backward_launch["b_block_m"], "BLOCK_N": up_backward_launch["b_block_n"], "BLOCK_R": 32,
                  "PRECISION": "tf32", "num_warps": up_backward_launch["b_warps"]})
for accumulate in (True, False):
    compile_for_sm90(splits._add_partials_kernel, {"partial_ptr": "*fp32", "grad_ptr": "*bf16", "grad2_ptr": "*bf16",
                                                    "grad3_ptr": "*bf16", "n": "i32", "splits": "i32",
                                                    "BLOCK": "constexpr", "ACCUMULATE": "constexpr"},
                     {"BLOCK": splits._PARTIALS_BLOCK, "ACCUMULATE": accumulate, "num_warps": 4})
print("compiled")
"""


def test_lora_down_kernels_compile_for_sm90_as_a_real_call_specialises_them():
    """Triton's compiler, not its interpreter (a subprocess without TRITON_INTERPRET), builds the LoRA kernels for
    the H100 (sm_90) with the specialisations of a real call, which the CPU-only machine can do without a GPU. The
    first version compiled in the interpreter and failed on the H100 (an assertion in Triton's LLVM lowering)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
