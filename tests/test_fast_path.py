"""The fast path computes the same function as the plain one (fp32, CPU): packing, the matmul LoRA QKV layer and
the chunked loss change speed and memory, never the loss or the gradients."""

import copy

import pytest
import torch

import litft
from litft.data import IGNORE_INDEX, collate, collate_packed
from litft.layers import use_fast_layers
from litft.layers.lora import lora_linear_forward, lora_qkv_forward
from litft.layers.loss import chunked_lm_loss
from litft.model import CausalLM, model_config
from litft.plan import LayerPlan

# the Triton LoRA paths as a CUDA run's plan installs them (the interpreter runs the kernels on the CPU)
FUSED = LayerPlan(grad_into_weights=True, triton_kernels=True, fused_lora=True)


def _samples(lengths, vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g)
        labels = torch.randint(0, vocab, (n,), generator=g)
        labels[: n // 3] = IGNORE_INDEX  # a masked prompt
        out.append({"input_ids": ids, "labels": labels})
    return out


def _lora_gpt(tiny_recipe, targets, seed=0, dropout=0.0):
    from litgpt.lora import GPT, mark_only_lora_as_trainable

    recipe = tiny_recipe(method="lora", lora={"r": 4, "alpha": 8, "dropout": dropout, "targets": targets})
    torch.manual_seed(seed)
    gpt = GPT(model_config(recipe))
    for name, p in gpt.named_parameters():  # B != 0, so the adapters matter
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    mark_only_lora_as_trainable(gpt)
    return gpt


def _loss_and_grads(module, batch):
    module.zero_grad(set_to_none=True)
    inputs = {k: batch[k] for k in ("input_ids", "labels")}
    if "cu_seqlens" in batch:
        inputs.update(positions=batch["positions"], cu_seqlens=batch["cu_seqlens"])
    loss = module(**inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_a_packed_row_gives_the_same_loss_and_gradients_as_padded_rows(tiny_recipe):
    gpt = _lora_gpt(tiny_recipe, ["q", "k", "v", "o", "mlp"])
    use_fast_layers(gpt)
    model = CausalLM(gpt, loss_chunk=0, max_seq_length=64)
    samples = _samples([37, 12, 50, 5])
    padded, packed = collate(samples, pad_id=0), collate_packed(samples, pad_id=0)
    assert packed["input_ids"].shape == (1, 112) and padded["input_ids"].shape == (4, 50)
    assert packed["loss_tokens"] == padded["loss_tokens"] and packed["tokens_real"] == padded["tokens_real"] == 104
    loss_padded, grads_padded = _loss_and_grads(model, padded)
    loss_packed, grads_packed = _loss_and_grads(model, packed)
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-5, atol=1e-5)
    assert grads_packed.keys() == grads_padded.keys() and grads_packed
    for name in grads_padded:
        torch.testing.assert_close(grads_packed[name], grads_padded[name], rtol=1e-4, atol=1e-6, msg=name)


def test_fixed_shape_rows_give_the_same_loss_and_gradients(tiny_recipe):
    """The CUDA-graph layout (row padded to a multiple of 256, cu_seqlens of a fixed length with empty trailing
    segments) is the same function of the samples as padding to the longest."""
    gpt = _lora_gpt(tiny_recipe, ["q", "v", "mlp"])
    use_fast_layers(gpt)
    model = CausalLM(gpt, loss_chunk=0, max_seq_length=64)
    three = _samples([37, 12, 50])  # a short last micro-batch of a micro_batch_size-4 run
    fixed = collate_packed(three, pad_id=0, multiple=256, segments=5)
    assert fixed["input_ids"].shape == (1, 256) and fixed["tokens_padded"] == 256 and fixed["tokens_real"] == 99
    assert fixed["cu_seqlens"].tolist() == [0, 37, 49, 99, 256, 256]  # 3 samples, the padding tail, one empty
    loss_fixed, grads_fixed = _loss_and_grads(model, fixed)
    loss_padded, grads_padded = _loss_and_grads(model, collate(three, pad_id=0))
    torch.testing.assert_close(loss_fixed, loss_padded, rtol=1e-5, atol=1e-5)
    for name in grads_padded:
        torch.testing.assert_close(grads_fixed[name], grads_padded[name], rtol=1e-4, atol=1e-6, msg=name)
    assert collate(three, pad_id=0, multiple=64)["input_ids"].shape == (3, 64)


def test_the_varlen_bound_covers_every_segment_of_a_fixed_shape_row(tiny_recipe):
    """On the GPU, flash attention's varlen kernel leaves positions past its max-length bound unwritten; a padding
    tail longer than max_seq_length then put inf into the weight gradients (seen on the H100: max_seq_length 96,
    data.pack_steps, CUDA graphs: a 512-position row of 364 real tokens has a 148-position tail). The model's bound
    must cover the longest segment any collate can make, tails included."""
    from litft.data import GRAPH_MULTIPLE, collate_function

    model = CausalLM(torch.nn.Identity(), loss_chunk=0, max_seq_length=96)
    seven = _samples([52] * 7)  # 364 positions, padded to 512 under the graphs' row multiple
    for collate_fn in (collate_function(0, packing=True, fixed_shapes=True, micro_batch_size=16),
                       collate_function(0, packing=True, fixed_shapes=True, micro_batch_size=16, step_capacity=384),
                       collate_function(0, packing=True, fixed_shapes=False, micro_batch_size=7)):
        batches = collate_fn(seven)
        for batch in batches if isinstance(batches, list) else [batches]:
            segment_lengths = batch["cu_seqlens"].diff()
            assert int(segment_lengths.max()) <= model.max_seq_length
    assert model.max_seq_length == GRAPH_MULTIPLE  # 96 alone would not do: the 148-position tail
    assert CausalLM(torch.nn.Identity(), loss_chunk=0, max_seq_length=2048).max_seq_length == 2048


def test_packing_keeps_samples_apart():
    """Changing one sample must not change the loss terms of another (no attention across samples)."""
    samples = _samples([20, 30])
    packed = collate_packed(samples, pad_id=0)
    assert packed["cu_seqlens"].tolist() == [0, 20, 50, 64]  # 50 real positions, padded to a multiple of 16
    assert packed["positions"][0, :20].tolist() == list(range(20)) and packed["positions"][0, 20:50].tolist() == list(range(30))
    assert (packed["labels"][0, 50:] == IGNORE_INDEX).all()


@pytest.mark.parametrize("targets", [["q", "k", "v"], ["q", "v"], ["k"]])
def test_matmul_lora_qkv_equals_litgpts_conv1d_version(tiny_recipe, targets):
    gpt = _lora_gpt(tiny_recipe, targets)
    layer = gpt.transformer.h[0].attn.qkv
    assert layer.n_head != layer.n_query_groups  # GQA: the uneven split litgpt does with several conv1d calls
    x = torch.randn(2, 7, layer.linear.in_features, requires_grad=True)
    reference = layer(x)
    layer.grads_into_adapters = layer.triton_kernels = False  # as use_fast_layers sets them on a CPU run
    fast = lora_qkv_forward(layer, x)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-6)
    for wrt in (layer.lora_A, layer.lora_B, x):
        (g_ref,) = torch.autograd.grad(reference.square().sum(), wrt, retain_graph=True)
        (g_fast,) = torch.autograd.grad(fast.square().sum(), wrt, retain_graph=True)
        torch.testing.assert_close(g_fast, g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_matmul_lora_linear_equals_litgpts_with_its_dropout_draws(tiny_recipe, dropout):
    """W x + B (s A dropout(x)), the add inside the matmul, is LitGPT's W x + (dropout(x) A^T B^T) s: same output and
    gradients in fp32, with the same dropout masks from the same random state (the base runs first in both)."""
    from litgpt.lora import LoRALinear

    torch.manual_seed(0)
    layer = LoRALinear(24, 40, r=4, lora_alpha=8, lora_dropout=dropout)
    torch.nn.init.normal_(layer.lora_B, std=0.1)
    layer.linear.weight.requires_grad_(False)
    layer.grads_into_adapters = layer.triton_kernels = False
    x = torch.randn(3, 5, 24, requires_grad=True)
    results = {}
    for name, forward in (("litgpt", layer.forward), ("fast", lambda t: lora_linear_forward(layer, t))):
        torch.manual_seed(1)
        out = forward(x)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, 40)).square().sum(), (layer.lora_A, layer.lora_B, x))
        results[name] = (out, *grads)
    assert results["fast"][0].shape == (3, 5, 40)
    for fast, reference in zip(results["fast"], results["litgpt"]):
        torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layer_kind", ["linear", "qkv-q-k-v", "qkv-k", "qkv-q-v"])
@pytest.mark.parametrize("grads_allocated", [False, True])  # None before the first pass, or kept and zeroed (graphs)
def test_low_rank_update_adds_the_same_adapter_gradients_as_autograd(tiny_recipe, layer_kind, grads_allocated):
    """train.grad_into_weights for LoRA: the adapters' gradients added into .grad by LowRankUpdate's matmuls equal
    autograd's over three micro-batches, with the same dropout masks (dropout 0.3), for a LoRALinear and for
    LoRAQKVLinear's block-by-block B (all projections adapted, or only some: GQA's uneven blocks); so do the
    outputs and the input gradients."""
    from litgpt.lora import LoRALinear

    if layer_kind == "linear":
        torch.manual_seed(0)
        layer = LoRALinear(24, 40, r=4, lora_alpha=8, lora_dropout=0.3)
        layer.linear.weight.requires_grad_(False)
        forward = lora_linear_forward
    else:
        gpt = _lora_gpt(tiny_recipe, layer_kind.split("-")[1:], dropout=0.3)
        layer = gpt.transformer.h[0].attn.qkv
        forward = lora_qkv_forward
    torch.nn.init.normal_(layer.lora_B, std=0.1)
    adapters = (layer.lora_A, layer.lora_B)
    grads = {}
    for grads_into_adapters in (False, True):
        layer.grads_into_adapters, layer.triton_kernels = grads_into_adapters, False  # as use_fast_layers sets them
        for p in adapters:
            p.grad = torch.zeros_like(p) if grads_allocated else None
        outputs, input_grads = [], []
        for micro_batch in range(3):
            torch.manual_seed(10 + micro_batch)
            x = torch.randn(2, 7, layer.linear.in_features, requires_grad=True)
            out = forward(layer, x)
            (out * torch.linspace(-1, 1, out.shape[-1])).square().sum().backward()
            outputs.append(out.detach())
            input_grads.append(x.grad)
        grads[grads_into_adapters] = (outputs, input_grads, [p.grad.clone() for p in adapters])
    for fast, reference in zip(grads[True], grads[False]):
        for f, r in zip(fast, reference):
            torch.testing.assert_close(f, r, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # inference: no autograd function
        assert forward(layer, torch.randn(3, layer.linear.in_features)).grad_fn is None


class _FixedMask(torch.nn.Module):
    """A LoRA dropout that applies a given mask (kept elements scaled by 1 / (1 - p))."""

    def __init__(self, mask: torch.Tensor, p: float) -> None:
        super().__init__()
        self.mask, self.p = mask, p

    def forward(self, x):
        return x * self.mask.view(x.shape) / (1 - self.p)


@pytest.mark.parametrize("b_side", ["matmuls", "triton"])
@pytest.mark.parametrize("layer_kind", ["linear", "linear-nf4", "qkv-q-k-v", "qkv-k"])
def test_fused_lora_is_litgpts_layer_with_the_kernels_dropout_mask(tiny_recipe, layer_kind, b_side, monkeypatch):
    """layers.lora_fused.FusedLoRA (the dropout inside kernels.lora_down, the input gradient written once) gives LitGPT's
    LoRALinear / LoRAQKVLinear output and gradients (x, A, B) when LitGPT's dropout applies the mask the kernels draw
    from the same seed; also over a 4-bit base (bitsandbytes' nf4 layer on the CPU, its input gradient through the
    dequantized weight as bitsandbytes' own backward computes it). B's side by the matmuls, or by its Triton kernels
    (kernels.lora_up_ / lora_up_backward, as on CUDA: every adapted part of a qkv layer in one launch, and a qkv layer
    with only k adapted, whose one part starts past q's columns). fp32, Triton's interpreter on the CPU."""
    from litgpt.lora import LoRALinear

    from litft import kernels
    from litft.kernels import lora_mask
    from litft.layers import lora_math
    from litft.layers.lora_fused import FusedLoRA
    from litft.layers.lora_math import lora_parts

    if b_side == "triton":
        monkeypatch.setattr(lora_math, "triton_b_side", lambda t, parts: True)

    p = 0.3
    torch.manual_seed(0)
    if layer_kind.startswith("linear"):
        layer = LoRALinear(80, 40, r=4, lora_alpha=8, lora_dropout=p)
        layer.linear.weight.requires_grad_(False)
        if layer_kind == "linear-nf4":
            import bitsandbytes as bnb

            quantized = bnb.nn.Linear4bit(80, 40, bias=False, compute_dtype=torch.float32, quant_type="nf4")
            quantized.weight = bnb.nn.Params4bit(layer.linear.weight.data.clone(), requires_grad=False,
                                                 quant_type="nf4")
            layer.linear = quantized.to("cpu")  # quantizes
            assert layer.linear.weight.quant_state is not None
    else:
        gpt = _lora_gpt(tiny_recipe, layer_kind.split("-")[1:], dropout=p)
        layer = gpt.transformer.h[0].attn.qkv
    torch.nn.init.normal_(layer.lora_B, std=0.1)
    x = torch.randn(2, 7, layer.linear.in_features, requires_grad=True)
    weights = torch.linspace(-1, 1, layer.linear.out_features)

    layer.lora_A.grad = layer.lora_B.grad = None
    seed, salt = torch.tensor([2**40 + 5]), 7  # a forward pass's shared seed, and this layer's salt
    out = FusedLoRA.apply(x.reshape(14, -1), layer.lora_A, layer.lora_B, layer.linear, layer.scaling, p,
                          lora_parts(layer), seed, salt)
    (out * weights).square().sum().backward()
    fused = (out.detach(), x.grad, layer.lora_A.grad, layer.lora_B.grad)

    k = x.shape[-1]
    ones = (torch.ones(14, k), torch.ones(1, k), torch.ones(14, 1))
    grad_x, _ = kernels.lora_down_backward(*ones, p, seed, None, salt=salt)
    mask = grad_x != 0  # the mask the kernels draw from that seed and salt: the input gradient of dropout(x) @ ones^T
    other_salt, _ = kernels.lora_down_backward(*ones, p, seed, None, salt=salt + 1)
    assert not torch.equal(other_salt != 0, mask)  # another layer of the same pass: another mask
    assert 0 < mask.float().mean() < 1
    layer.lora_dropout = _FixedMask(mask, 1 - 1 / lora_mask._lora_p16(p)[1])  # the kernels' scale of kept elements
    reference = layer(x).reshape(14, -1)
    expected = (reference.detach(), *torch.autograd.grad((reference * weights).square().sum(),
                                                         (x, layer.lora_A, layer.lora_B)))
    for actual, wanted in zip(fused, expected):
        torch.testing.assert_close(actual, wanted, rtol=1e-4, atol=1e-5)


def test_dropout_0_adapters_take_the_fused_path_and_the_ledger_counts_it(tiny_recipe, monkeypatch):
    """LitGPT gives a dropout-0 adapter `lambda x: x`; use_fast_layers makes it an nn.Identity, so that the layer
    runs as FusedLoRA (no mask drawn) rather than LowRankUpdate: the same output and gradients as LitGPT's layer. A
    dropout above 0 stays LitGPT's nn.Dropout. The ledger traces that dispatch: the same activation bytes as at
    dropout 0.05 (FusedLoRA keeps the same tensors whatever p), where the unfused path kept more."""
    from litft import kernels
    from litft.layers import lora_fused
    from litft.memory import activation_bytes_per_token_layer
    from litft.plan import plan_for_estimate

    reference = _lora_gpt(tiny_recipe, ["q", "v", "mlp"], dropout=0.0)
    attn = reference.transformer.h[0].attn.qkv
    assert not isinstance(attn.lora_dropout, torch.nn.Module)  # LitGPT's lambda
    torch.nn.init.normal_(attn.lora_B, std=0.1)
    fast = copy.deepcopy(reference)
    use_fast_layers(fast, FUSED)
    fast_attn = fast.transformer.h[0].attn.qkv
    assert isinstance(fast_attn.lora_dropout, torch.nn.Identity)
    assert not any(isinstance(m.lora_dropout, torch.nn.Dropout) for m in fast.modules() if hasattr(m, "lora_dropout"))
    monkeypatch.setattr(kernels, "available", lambda x: True)
    calls = []
    real_apply = lora_fused.FusedLoRA.apply
    monkeypatch.setattr(lora_fused.FusedLoRA, "apply", lambda *args: calls.append(args) or real_apply(*args))
    assert lora_fused.fused_lora_applies(fast_attn, torch.zeros(3, 2, dtype=torch.bfloat16))
    x = torch.randn(2, 7, attn.linear.in_features, requires_grad=True)
    x_fast = x.detach().clone().requires_grad_(True)
    weights = torch.linspace(-1, 1, attn.linear.out_features)
    out = fast_attn(x_fast)  # fp32 rows: the plan decides, the layer does not check the dtype
    assert len(calls) == 1 and calls[0][5] == 0.0  # FusedLoRA, dropout probability 0
    (out * weights).square().sum().backward()
    wanted = attn(x)
    (wanted * weights).square().sum().backward()
    torch.testing.assert_close(out, wanted, rtol=1e-5, atol=1e-5)
    for got, expected in ((x_fast.grad, x.grad), (fast_attn.lora_A.grad, attn.lora_A.grad),
                          (fast_attn.lora_B.grad, attn.lora_B.grad)):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert isinstance(_lora_gpt(tiny_recipe, ["q"], dropout=0.1).transformer.h[0].attn.qkv.lora_dropout,
                      torch.nn.Dropout)
    monkeypatch.undo()

    def ledger(dropout):
        recipe = tiny_recipe(method="lora", precision="bf16-true", lora={"dropout": dropout})
        config = model_config(recipe)
        return activation_bytes_per_token_layer(recipe, config, plan_for_estimate(recipe, config, compiled=False))

    assert ledger(0.0) == ledger(0.05)


@pytest.mark.parametrize("base", ["linear", "nf4"])
def test_fused_lora_pair_is_two_fused_lora_layers_and_their_input_gradients_summed(base):
    """layers.lora_fused.FusedLoRAPair (fc_1 and fc_2 over one input, their A sides in one kernel each way) gives what two
    FusedLoRA layers with the same seed and salts give: each output, each adapter's gradients, and x's gradient as
    autograd's sum of the two; over a 4-bit base too (bitsandbytes' nf4 layer on the CPU). fp32, interpreter."""
    from litgpt.lora import LoRALinear

    from litft.layers.lora_fused import FusedLoRA, FusedLoRAPair
    from litft.layers.lora_math import lora_parts

    p = 0.3
    torch.manual_seed(0)
    layers = [LoRALinear(80, 40, r=4, lora_alpha=8, lora_dropout=p) for _ in range(2)]
    for layer in layers:
        layer.linear.weight.requires_grad_(False)
        torch.nn.init.normal_(layer.lora_B, std=0.1)
        if base == "nf4":
            import bitsandbytes as bnb

            quantized = bnb.nn.Linear4bit(80, 40, bias=False, compute_dtype=torch.float32, quant_type="nf4")
            quantized.weight = bnb.nn.Params4bit(layer.linear.weight.data.clone(), requires_grad=False,
                                                 quant_type="nf4")
            layer.linear = quantized.to("cpu")  # quantizes
    first, second = layers
    x = torch.randn(14, 80, requires_grad=True)
    weights = torch.linspace(-1, 1, 40)
    seed, salt, salt2 = torch.tensor([2**41 + 3]), 4, 9

    def loss(gate, up):
        return (gate * weights).square().sum() + (up * weights.flip(0)).sum()

    def grads():
        found = (x.grad, first.lora_A.grad, first.lora_B.grad, second.lora_A.grad, second.lora_B.grad)
        x.grad = first.lora_A.grad = first.lora_B.grad = second.lora_A.grad = second.lora_B.grad = None
        return found

    gate, up = FusedLoRAPair.apply(x, first, second, first.lora_A, first.lora_B, second.lora_A, second.lora_B, p,
                                   seed, salt, salt2)
    loss(gate, up).backward()
    paired = (gate.detach(), up.detach(), *grads())
    gate, up = (FusedLoRA.apply(x, layer.lora_A, layer.lora_B, layer.linear, layer.scaling, p, lora_parts(layer), seed,
                                layer_salt) for layer, layer_salt in ((first, salt), (second, salt2)))
    loss(gate, up).backward()
    alone = (gate.detach(), up.detach(), *grads())
    for got, wanted in zip(paired, alone):
        torch.testing.assert_close(got, wanted, rtol=1e-5, atol=1e-5)


def test_mlp_forward_runs_fc_1_and_fc_2_as_one_fused_lora_pair(tiny_recipe, monkeypatch):
    """mlp_forward runs a LoRA fc_1 and fc_2 that would each run as FusedLoRA as one FusedLoRAPair, with the
    forward pass's shared seed and each layer's own salt: the same output and gradients as the two layers run
    apart. The CPU stands in for CUDA: kernels.available says yes (the interpreter runs the kernels) and FusedLoRA
    runs where the plan says, in fp32 too. (With proj adapted too the whole MLP runs as FusedLoRAMLP where the plan
    says so, the next test; this plan does not.)"""
    from litft import kernels
    from litft.layers import lora_fused

    gpt = _lora_gpt(tiny_recipe, ["mlp"], dropout=0.25)
    use_fast_layers(gpt, FUSED)  # fused_lora_mlp off
    mlp = gpt.transformer.h[0].mlp
    monkeypatch.setattr(kernels, "available", lambda x: True)
    pairs = []
    real_apply = lora_fused.FusedLoRAPair.apply
    monkeypatch.setattr(lora_fused.FusedLoRAPair, "apply", lambda *args: pairs.append(args) or real_apply(*args))
    gpt.lora_seeds.tensor = torch.tensor([2**35 + 17])
    x = torch.randn(1, 10, mlp.fc_1.linear.in_features, requires_grad=True)

    def run():
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        out = mlp(x)
        out.square().sum().backward()
        return out.detach(), x.grad, *(p.grad for p in mlp.parameters() if p.requires_grad)

    paired = run()
    assert len(pairs) == 1 and pairs[0][-2:] == (mlp.fc_1.lora_salt, mlp.fc_2.lora_salt)
    monkeypatch.setattr(lora_fused, "fused_lora_pair_applies", lambda first, second, rows: False)
    alone = run()
    assert len(pairs) == 1
    for got, wanted in zip(paired, alone, strict=True):
        torch.testing.assert_close(got, wanted, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stacked", [False, True])
def test_mlp_forward_runs_a_lora_mlp_as_one_fused_lora_mlp(tiny_recipe, monkeypatch, stacked):
    """mlp_forward runs a LoRA MLP whose fc_1, fc_2 and proj would each run as FusedLoRA as one FusedLoRAMLP (the
    adapters inside the SwiGLU kernels), each layer's mask from the forward pass's shared seed and its own salt: the
    output, x's gradient and all six adapter gradients of FusedLoRAPair + SwiGLU + FusedLoRA (the path it replaces),
    over two micro-batches (gradients added into .grad). It keeps what that path keeps. Without a shared seed (a
    layer called outside CausalLM's forward), or where the plan does not fuse it (wider than
    FUSED_LORA_MLP_MAX_INTERMEDIATE), the MLP runs that path. ``stacked``: fc_1's and fc_2's weights one tensor
    (lora_fused.stack_fc_weights), FusedLoRAMLP's one matmul for both
    each way; the state_dict unchanged. fp32, Triton's interpreter standing in for CUDA as in the test above."""
    import dataclasses

    from litft import kernels
    from litft.layers import lora_fused

    gpt = _lora_gpt(tiny_recipe, ["mlp"], dropout=0.25)
    use_fast_layers(gpt, dataclasses.replace(FUSED, fused_lora_mlp=True))
    mlp = gpt.transformer.h[0].mlp
    if stacked:
        before = {name: t.clone() for name, t in gpt.state_dict().items()}
        assert lora_fused.stacked_fc_weight(mlp) is None
        assert lora_fused.stack_fc_weights(gpt) == len(gpt.transformer.h)
        after = gpt.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
        both = lora_fused.stacked_fc_weight(mlp)
        assert torch.equal(both, torch.cat([mlp.fc_1.linear.weight, mlp.fc_2.linear.weight]))
        assert both.data_ptr() == mlp.fc_1.linear.weight.data_ptr()
        found = []
        real_stacked = lora_fused.stacked_fc_weight
        monkeypatch.setattr(lora_fused, "stacked_fc_weight", lambda mlp: found.append(real_stacked(mlp)) or found[-1])
    monkeypatch.setattr(kernels, "available", lambda x: True)
    calls = []
    real_apply = lora_fused.FusedLoRAMLP.apply
    monkeypatch.setattr(lora_fused.FusedLoRAMLP, "apply", lambda *args: calls.append(args) or real_apply(*args))
    gpt.lora_seeds.tensor = torch.tensor([2**37 + 5])
    torch.manual_seed(1)
    xs = [torch.randn(1, 10, mlp.fc_1.linear.in_features, requires_grad=True) for _ in range(2)]
    weights = torch.linspace(-1, 1, mlp.proj.linear.out_features)

    def run():
        mlp.zero_grad(set_to_none=True)
        kept, outs, x_grads = 0, [], []
        for x in xs:
            x.grad = None
            saved = {}  # the tensors this forward pass keeps for its backward pass, each once (by address)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.setdefault(t.data_ptr(), t.numel()), t)[1],
                                                          lambda t: t):
                out = mlp(x)
            kept += sum(saved.values())
            (out * weights).square().sum().backward()
            outs.append(out.detach())
            x_grads.append(x.grad)
        return (*outs, *x_grads, *(p.grad for p in mlp.parameters() if p.requires_grad)), kept

    fused, fused_saved = run()
    assert len(calls) == 2 and calls[0][-1] == (mlp.fc_1.lora_salt, mlp.fc_2.lora_salt, mlp.proj.lora_salt)
    if stacked:  # forward and backward of both micro-batches took the one matmul
        assert len(found) == 4 and all(t is not None for t in found)
    monkeypatch.setattr(lora_fused, "fused_lora_mlp_applies", lambda mlp, rows: False)
    apart, apart_saved = run()
    assert len(calls) == 2 and fused_saved == apart_saved
    for got, wanted in zip(fused, apart, strict=True):
        torch.testing.assert_close(got, wanted, rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "available", lambda x: True)
    gpt.lora_seeds.tensor = None
    assert not lora_fused.fused_lora_mlp_applies(mlp, xs[0].reshape(10, -1))
    gpt.lora_seeds.tensor = torch.tensor([3])
    assert lora_fused.fused_lora_mlp_applies(mlp, xs[0].reshape(10, -1))
    mlp.fused_lora_mlp = False  # where the plan does not fuse the MLP
    assert not lora_fused.fused_lora_mlp_applies(mlp, xs[0].reshape(10, -1))
    # the plan fuses an MLP only as wide as it was measured faster at
    from litft.plan import FUSED_LORA_MLP_MAX_INTERMEDIATE, resolve

    recipe = tiny_recipe(method="lora", precision="bf16-true", lora={"targets": ["mlp"]})
    config = model_config(recipe)
    assert resolve(recipe, config, "cuda", 1, triton_available=True).layers.fused_lora_mlp
    wide = copy.copy(config)
    wide.intermediate_size = FUSED_LORA_MLP_MAX_INTERMEDIATE + 1
    assert not resolve(recipe, wide, "cuda", 1, triton_available=True).layers.fused_lora_mlp


def test_fused_lora_after_swiglu_keeps_its_inputs_not_the_product():
    """The MLP's proj as FusedLoRA told SwiGLU's inputs (mlp_forward's swiglu_inputs): it keeps fc_1's and fc_2's
    outputs (which SwiGLU keeps anyway), not silu(gate) * up, and its backward kernel rebuilds that product: the same
    output and gradients (x's path through SwiGLU included) as keeping the product. fp32, Triton's interpreter."""
    from litgpt.lora import LoRALinear

    from litft.layers.lora_fused import FusedLoRA
    from litft.layers.lora_math import lora_parts
    from litft.layers.mlp import SwiGLU

    p = 0.3
    torch.manual_seed(0)
    layer = LoRALinear(80, 40, r=4, lora_alpha=8, lora_dropout=p)
    layer.linear.weight.requires_grad_(False)
    torch.nn.init.normal_(layer.lora_B, std=0.1)
    gate, up = torch.randn(14, 80, requires_grad=True), torch.randn(14, 80, requires_grad=True)
    weights = torch.linspace(-1, 1, 40)
    seed = torch.tensor([2**33 + 1])

    def run(rebuild: bool):
        gate.grad = up.grad = layer.lora_A.grad = layer.lora_B.grad = None
        saved = []

        def pack(t):
            saved.append(t.data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            product = SwiGLU.apply(gate, up, False)
            out = FusedLoRA.apply(product, layer.lora_A, layer.lora_B, layer.linear, layer.scaling, p,
                                  lora_parts(layer), seed, 3, *((gate, up) if rebuild else (None, None)))
        (out * weights).square().sum().backward()
        return (out.detach(), gate.grad, up.grad, layer.lora_A.grad, layer.lora_B.grad), product.data_ptr() in saved

    (rebuilt, keeps_product), (kept, kept_product) = run(True), run(False)
    assert kept_product and not keeps_product
    for got, wanted in zip(rebuilt, kept):
        torch.testing.assert_close(got, wanted, rtol=1e-5, atol=1e-6)


def test_matmul_lora_layers_keep_autocasts_dtype():
    """Under bf16 autocast (precision bf16-mixed) the adapters stay fp32 and the output is bf16: the in-place add
    takes B in the output's dtype."""
    from litgpt.lora import LoRALinear

    layer = LoRALinear(16, 8, r=2, lora_alpha=4, lora_dropout=0.0)
    torch.nn.init.normal_(layer.lora_B, std=0.1)
    layer.grads_into_adapters = layer.triton_kernels = False  # -mixed precision keeps autograd's accumulation
    x = torch.randn(2, 3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast, reference = lora_linear_forward(layer, x), layer(x)
    assert fast.dtype == reference.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), reference.float(), rtol=2e-2, atol=2e-2)
    fast.float().sum().backward()
    assert layer.lora_B.grad.dtype == torch.float32 and layer.lora_A.grad is not None


def test_fast_lora_switch_keeps_litgpts_layers(tiny_recipe):
    gpt = _lora_gpt(tiny_recipe, ["q", "v", "mlp"])
    use_fast_layers(gpt, LayerPlan(fast_lora=False))
    assert "forward" not in vars(gpt.transformer.h[0].attn.qkv) and "forward" not in vars(gpt.transformer.h[0].mlp.fc_1)
    use_fast_layers(gpt)
    assert vars(gpt.transformer.h[0].attn.qkv)["forward"].__func__ is lora_qkv_forward
    assert vars(gpt.transformer.h[0].mlp.fc_1)["forward"].__func__ is lora_linear_forward


def test_chunked_loss_equals_the_whole_loss_with_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(3, 40, 16, requires_grad=True)
    labels = torch.randint(0, 50, (3, 40))
    labels[0, :10] = IGNORE_INDEX
    whole = chunked_lm_loss(head, hidden, labels, chunk=0)
    (g_whole,) = torch.autograd.grad(whole, hidden)
    chunked = chunked_lm_loss(head, hidden, labels, chunk=32)
    (g_chunked,) = torch.autograd.grad(chunked, hidden)
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(g_chunked, g_whole)


def test_packed_and_padded_runs_record_the_same_losses(tiny_recipe, tmp_path):
    common = dict(method="full", eval={"initial": True, "final": True, "interval": 0},
                  optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}})
    a = litft.finetune(tiny_recipe(**common, out_dir=str(tmp_path / "packed"), data={"packing": True}))
    b = litft.finetune(tiny_recipe(**common, out_dir=str(tmp_path / "padded"), data={"packing": False}))
    import json

    rows_a = [json.loads(l) for l in (a.out_dir / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(l) for l in (b.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows_a] == pytest.approx([r["loss"] for r in rows_b], rel=1e-5)
    assert a.result["losses"]["val_final"] == pytest.approx(b.result["losses"]["val_final"], rel=1e-5)
    # the same real tokens; packed rows pad under PACK_MULTIPLE positions per micro-batch
    from litft.data import PACK_MULTIPLE

    ta, tb = a.result["throughput"], b.result["throughput"]
    assert ta["tokens_real"] == tb["tokens_real"]
    micro_batches = a.result["steps"] * a.result["batch"]["grad_accum"]
    assert ta["tokens_padded"] - ta["tokens_real"] < PACK_MULTIPLE * micro_batches


def test_compiled_blocks_keep_to_one_graph_for_every_row_length(tiny_recipe):
    """torch.compile of the blocks builds one graph for a run, however long its rows (on the H100 a TinyLlama LoRA
    run built 4: a first row of 2,048 positions, TinyLlama's hidden size, was specialised to it, and the first
    block's input, behind the frozen embedding, did not require grad while the others' did). 'aot_eager' traces and
    guards as inductor does, without generating kernels. The compiled model computes the eager model's loss."""
    from torch._dynamo.utils import counters

    from litft.model import compile_blocks

    gpt = _lora_gpt(tiny_recipe, ["q", "v", "mlp"])
    use_fast_layers(gpt)
    eager = CausalLM(copy.deepcopy(gpt), loss_chunk=0, max_seq_length=96)
    n_embd = gpt.config.n_embd
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(gpt, backend="aot_eager")
    compiled = CausalLM(gpt, loss_chunk=0, max_seq_length=96, compiled=True)
    for lengths in ([n_embd // 2, n_embd // 2], [40, 30, 26], [60, 30, 26], [20, 12]):  # rows of n_embd, 96, 128, n_embd
        batch = collate_packed(_samples(lengths), pad_id=0)
        loss, grads = _loss_and_grads(compiled, batch)
        loss_eager, grads_eager = _loss_and_grads(eager, batch)
        torch.testing.assert_close(loss, loss_eager, rtol=1e-5, atol=1e-5)
        for name in grads_eager:
            torch.testing.assert_close(grads[name], grads_eager[name], rtol=1e-4, atol=1e-6, msg=name)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_equals_litgpts(dtype):
    """torch's rms_norm in place of LitGPT's RMSNorm: the same output and gradients (fp32 arithmetic, the weight
    applied before the cast back), in fp32 and bf16."""
    from litgpt.model import RMSNorm

    from litft.layers.norm import rms_norm_forward

    torch.manual_seed(0)
    norm = RMSNorm(48, eps=1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.2)
    x = (torch.randn(3, 7, 48) * 3).to(dtype).requires_grad_(True)
    grad_out = torch.randn(3, 7, 48).to(dtype)
    results = {}
    for name, forward in (("litgpt", norm.forward), ("fused", lambda t: rms_norm_forward(norm, t))):
        out = forward(x)
        results[name] = (out, *torch.autograd.grad(out, (x, norm.weight), grad_out))
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    assert results["fused"][0].dtype == dtype
    for fused, reference in zip(results["fused"], results["litgpt"]):
        torch.testing.assert_close(fused.float(), reference.float(), **tolerance)


def test_ledger_counts_what_the_fused_norm_keeps(tiny_recipe):
    """The eager trace counts the fused norm as CUDA runs it: per token, its bf16 input (2 bytes per element) and one
    fp32 scale, where LitGPT's norm keeps fp32 copies of the input and of the normalised input (8 bytes per element)
    and the same scale: 6 x n_embd bytes less per norm, two norms per block."""
    from litft.memory import activation_bytes_per_token_layer
    from litft.plan import plan_for_estimate

    def saved_bytes(recipe, config):
        return activation_bytes_per_token_layer(recipe, config, plan_for_estimate(recipe, config, compiled=False))

    fused = tiny_recipe(method="full", precision="bf16-true", train={"fused_rms_norm": True})
    litgpt = tiny_recipe(method="full", precision="bf16-true", train={"fused_rms_norm": False})
    config = model_config(fused)
    saved_fused, saved_litgpt = saved_bytes(fused, config), saved_bytes(litgpt, config)
    assert saved_litgpt - saved_fused == 2 * 6 * config.n_embd


def test_4bit_compute_dtype_is_settled_after_fabrics_conversion(tiny_recipe):
    """QLoRA compiled: Fabric's BitsandbytesPrecision.convert_module (run by fabric.setup_module) sets each 4-bit
    layer's compute dtype and clears compute_type_is_set, a flag the compiled block's guards read; its flip on the
    first forward recompiled every block (seen on an H100). Settled after
    the conversion, the flag stays set; settled before it, the conversion clears it again."""
    pytest.importorskip("bitsandbytes")
    from lightning.fabric.plugins.precision.bitsandbytes import BitsandbytesPrecision

    from litft.model import settle_4bit_compute_dtype

    def flags(model):
        return {getattr(m, "compute_type_is_set") for m in model.modules() if hasattr(m, "compute_type_is_set")}

    gpt = _lora_gpt(tiny_recipe, ["q", "v", "mlp"])
    plugin = BitsandbytesPrecision("nf4", dtype=torch.bfloat16)
    settle_4bit_compute_dtype(plugin.convert_module(gpt), "bf16-true")
    assert flags(gpt) == {True}
    settle_4bit_compute_dtype(gpt, "bf16-true")
    plugin.convert_module(gpt)  # what setup_module does after the model was built
    assert flags(gpt) == {False}
    settle_4bit_compute_dtype(gpt, "bf16-mixed")  # under autocast the layer chooses from its first input
    assert flags(gpt) == {False}


def test_ledger_traces_mixed_precision_with_an_fp32_residual_stream(tiny_recipe):
    """Under -mixed the residual stream has the fp32 embedding's dtype: each norm keeps an fp32 input (4 bytes per
    element where bf16-true keeps 2) and autocast casts the second norm's output once for fc_1 and once for fc_2
    (bf16-true saves one tensor for both): 2 x 2 x n_embd + 2 x n_embd bytes more per token and block. The trace
    used to feed a bf16 input, which undercounted this (and kept rms_norm off its fused path)."""
    from litft.memory import activation_bytes_per_token_layer
    from litft.plan import plan_for_estimate

    def saved_bytes(recipe, config):
        return activation_bytes_per_token_layer(recipe, config, plan_for_estimate(recipe, config, compiled=False))

    mixed = tiny_recipe(method="full", precision="bf16-mixed")
    true = tiny_recipe(method="full", precision="bf16-true")
    config = model_config(mixed)
    assert config.mlp_class_name == "LLaMAMLP"
    extra = saved_bytes(mixed, config) - saved_bytes(true, config)
    assert extra == 2 * 2 * config.n_embd + 2 * config.n_embd


_REFERENCE_VARLEN_REGISTERED = False
_REFERENCE_VARLEN_CALLS = {"forward": 0, "backward": 0, "aten": 0, "kv_heads": set()}
_ATEN_LIBRARY = torch.library.Library("aten", "IMPL")  # CPU kernels for two of its ops, for this test process


def _register_reference_varlen_kernels() -> None:
    """CPU kernels for torch's varlen attention ops: causal attention within each cu_seqlens segment, in fp32, with
    the backward pass written out. With them the CPU runs packed_attention's CUDA branch (its layouts, and its graph
    under torch.compile); on CUDA the flash kernels run instead. Registered once per process."""
    global _REFERENCE_VARLEN_REGISTERED
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    if _REFERENCE_VARLEN_REGISTERED:
        return

    def probabilities(q, k, scale):  # q, k: (L, H, D) -> (H, L, L), causal
        scores = (q.transpose(0, 1) @ k.transpose(0, 1).transpose(1, 2)) * scale
        causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
        return scores.masked_fill(~causal, float("-inf")).softmax(-1)

    def segments(cu):
        return [(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]

    def all_heads(t, heads):  # grouped k/v heads (flash attention reads each group for its queries) -> (L, H, D)
        return t.repeat_interleave(heads // t.shape[1], dim=1)

    def per_group(t, groups):  # a gradient over all heads -> summed over each group's heads: (L, groups, D)
        return t.unflatten(1, (groups, t.shape[1] // groups)).sum(2)

    def forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, *rest):
        assert is_causal
        _REFERENCE_VARLEN_CALLS["forward"] += 1
        _REFERENCE_VARLEN_CALLS["kv_heads"].add(key.shape[1])
        out = torch.zeros_like(query)
        for a, b in segments(cu_seq_q):
            q, k, v = (all_heads(t[a:b].float(), query.shape[1]) for t in (query, key, value))
            out[a:b] = (probabilities(q, k, scale) @ v.transpose(0, 1)).transpose(0, 1).to(out.dtype)
        lse = torch.zeros(query.shape[1], query.shape[0])
        return out, lse, torch.zeros(2, dtype=torch.int64)

    def backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
                 scale=None, *rest):
        _REFERENCE_VARLEN_CALLS["backward"] += 1
        dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        groups = key.shape[1]
        for a, b in segments(cu_seq_q):
            q, g = query[a:b].float(), grad_out[a:b].float()
            k, v = (all_heads(t[a:b].float(), query.shape[1]) for t in (key, value))
            p = probabilities(q, k, scale)  # (H, L, L)
            g_heads = g.transpose(0, 1)  # (H, L, D)
            dv[a:b] = per_group((p.transpose(1, 2) @ g_heads).transpose(0, 1), groups).to(dv.dtype)
            dp = g_heads @ v.transpose(0, 1).transpose(1, 2)
            ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
            dq[a:b] = (ds @ k.transpose(0, 1)).transpose(0, 1).to(dq.dtype)
            dk[a:b] = per_group((ds.transpose(1, 2) @ q.transpose(0, 1)).transpose(0, 1), groups).to(dk.dtype)
        return dq, dk, dv

    varlen._varlen_attn.register_kernel("cpu")(forward)
    varlen._varlen_attn_backward.register_kernel("cpu")(backward)

    # the flash-attention ops themselves, as model.GroupedFlashAttention calls them (a torch whose varlen_attn does
    # not take grouped heads)
    def aten_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                     *, scale=None, **rest):
        assert dropout_p == 0.0 and not return_debug_mask
        _REFERENCE_VARLEN_CALLS["aten"] += 1
        out, lse, rng_state = forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale)
        return out, lse, rng_state, torch.empty(0), torch.empty(0)

    def aten_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, dropout_p, is_causal,
                      rng_state, unused, *, scale=None, **rest):
        _REFERENCE_VARLEN_CALLS["aten"] += 1
        return backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                        rng_state, scale)

    _ATEN_LIBRARY.impl("_flash_attention_forward", aten_forward, "CPU")
    _ATEN_LIBRARY.impl("_flash_attention_backward", aten_backward, "CPU")
    _REFERENCE_VARLEN_REGISTERED = True


@pytest.mark.parametrize("fast_attention,varlen_gqa", [(True, True), (True, False), (False, True)],
                         ids=["fast", "fast-torch-without-varlen-gqa", "litgpt"])
def test_packed_attentions_varlen_branch_gives_the_masked_branchs_loss_and_compiles_to_one_graph(
        tiny_recipe, monkeypatch, fast_attention, varlen_gqa):
    """packed_attention's CUDA branch (torch's varlen op; CPU tests otherwise take the masked-SDPA branch), run on the
    CPU with reference kernels: the same loss and gradients as the masked branch, eager and compiled, and one
    compiled graph of the block for rows of every length (aot_eager: dynamo's graphs and guards, no kernels). Without
    a varlen_attn that takes grouped heads (torch 2.11), eager blocks call the flash ops with grouped k/v heads
    (layers.attention.GroupedFlashAttention) and compiled ones repeat k and v for varlen_attn."""
    from torch._dynamo.utils import counters

    from litft.layers import attention
    from litft.layers.attention import _VARLEN_KWARGS
    from litft.model import compile_blocks

    if _VARLEN_KWARGS is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    _register_reference_varlen_kernels()
    _REFERENCE_VARLEN_CALLS.update(forward=0, backward=0, aten=0, kv_heads=set())
    monkeypatch.setattr(attention, "_VARLEN_GQA", varlen_gqa)
    gpt = _lora_gpt(tiny_recipe, ["q", "k", "v", "o", "mlp"])
    use_fast_layers(gpt, LayerPlan(fast_attention=fast_attention))
    masked = CausalLM(copy.deepcopy(gpt), loss_chunk=0, max_seq_length=64)
    monkeypatch.setattr(attention, "VARLEN_DEVICES", ("cuda", "cpu"))
    eager = CausalLM(copy.deepcopy(gpt), loss_chunk=0, max_seq_length=64)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(gpt, backend="aot_eager")
    compiled = CausalLM(gpt, loss_chunk=0, max_seq_length=64, compiled=True)
    for lengths in ([37, 12, 50, 5], [40, 30, 26], [20, 12]):
        batch = collate_packed(_samples(lengths), pad_id=0, multiple=64, segments=5)
        monkeypatch.setattr(attention, "VARLEN_DEVICES", ("cuda",))
        loss_masked, grads_masked = _loss_and_grads(masked, batch)
        monkeypatch.setattr(attention, "VARLEN_DEVICES", ("cuda", "cpu"))
        for model in (eager, compiled):
            loss, grads = _loss_and_grads(model, batch)
            torch.testing.assert_close(loss, loss_masked, rtol=1e-5, atol=1e-5)
            for name in grads_masked:
                torch.testing.assert_close(grads[name], grads_masked[name], rtol=1e-4, atol=1e-6, msg=name)
    assert counters["stats"]["unique_graphs"] == 1, (dict(counters["stats"]), dict(counters["graph_break"]))
    # the varlen branch ran: 3 batches x 2 models x the tiny model's blocks, forward and backward (the eager model
    # through the aten ops, each counted here too, when varlen_attn takes no grouped heads)
    config = gpt.config
    calls = 3 * 2 * config.n_layer
    assert _REFERENCE_VARLEN_CALLS["forward"] == _REFERENCE_VARLEN_CALLS["backward"] == calls
    assert _REFERENCE_VARLEN_CALLS["aten"] == (0 if varlen_gqa or not fast_attention else calls)
    # fast attention hands the kernel the grouped k, v heads; LitGPT's forward repeats them to every query head, and
    # so do compiled blocks when varlen_attn takes no grouped heads
    if not fast_attention:
        assert _REFERENCE_VARLEN_CALLS["kv_heads"] == {config.n_head}
    elif varlen_gqa:
        assert _REFERENCE_VARLEN_CALLS["kv_heads"] == {config.n_query_groups}
    else:
        assert _REFERENCE_VARLEN_CALLS["kv_heads"] == {config.n_query_groups, config.n_head}
    torch._dynamo.reset()


def test_rotary_embedding_function_is_litgpts_apply_rope_with_its_gradient():
    from litgpt.model import apply_rope, build_rope_cache

    from litft.layers.attention import RotaryEmbedding

    cos, sin = build_rope_cache(12, 8, device=torch.device("cpu"))
    cos, sin = cos.double()[None, :, None], sin.double()[None, :, None]  # (1, T, 1, D): over every head
    x = torch.randn(2, 12, 3, 8, dtype=torch.float64, requires_grad=True)
    reference = apply_rope(x.transpose(1, 2), cos[:, :, 0], sin[:, :, 0]).transpose(1, 2)
    torch.testing.assert_close(RotaryEmbedding.apply(x, cos, sin), reference)
    assert torch.autograd.gradcheck(lambda t: RotaryEmbedding.apply(t, cos, sin), (x,))


def test_rope_qkv_torch_path_splits_and_ropes_as_litgpt_with_its_gradient():
    """layers.attention.RopeQKV off CUDA (the torch ops the memory ledger's trace runs): q and k as apply_rope gives them, v as
    it is and its own tensor (not a view keeping the qkv output), per-row tables (packed rows); gradcheck in fp64."""
    from litgpt.model import apply_rope, build_rope_cache

    from litft.layers.attention import RopeQKV

    heads, groups, head_size, t = 4, 2, 8, 12
    cos, sin = build_rope_cache(t, head_size, device=torch.device("cpu"))
    index = torch.stack([torch.arange(t), torch.arange(t) % 5])  # row 1: samples restarting at position 0
    cos, sin = cos.double()[index], sin.double()[index]  # (2, T, D)
    qkv = torch.randn(2, t, (heads + 2 * groups) * head_size, dtype=torch.float64, requires_grad=True)
    q, k, v = RopeQKV.apply(qkv, cos, sin, heads, groups)
    parts = qkv.view(2, t, heads + 2 * groups, head_size).split((heads, groups, groups), dim=2)
    for roped, part in zip((q, k), parts):
        torch.testing.assert_close(roped, apply_rope(part.transpose(1, 2), cos, sin).transpose(1, 2))
    torch.testing.assert_close(v, parts[2])
    assert v.untyped_storage().data_ptr() != qkv.untyped_storage().data_ptr()
    assert torch.autograd.gradcheck(lambda x: RopeQKV.apply(x, cos, sin, heads, groups), (qkv,))


@pytest.mark.parametrize("method", ["full", "lora"])
def test_fast_attention_gives_litgpts_loss_and_gradients_packed_and_padded(tiny_recipe, method):
    """attention_forward (RoPE as one function, grouped k/v heads left grouped) against LitGPT's forward, on the
    tiny model's grouped-query attention (4 heads, 2 groups), for padded rows (SDPA, causal) and a packed row."""
    from litgpt.model import GPT

    from litft.layers.attention import attention_forward

    if method == "lora":
        gpt = _lora_gpt(tiny_recipe, ["q", "k", "v", "o", "mlp"])
    else:
        torch.manual_seed(0)
        gpt = GPT(model_config(tiny_recipe(method="full")))
    assert gpt.config.n_query_groups < gpt.config.n_head
    litgpt_attention = copy.deepcopy(gpt)
    use_fast_layers(litgpt_attention, LayerPlan(fast_attention=False))
    use_fast_layers(gpt)
    assert vars(gpt.transformer.h[0].attn)["forward"].__func__ is attention_forward
    assert "forward" not in vars(litgpt_attention.transformer.h[0].attn)
    fast = CausalLM(gpt, loss_chunk=0, max_seq_length=64)
    reference = CausalLM(litgpt_attention, loss_chunk=0, max_seq_length=64)
    samples = _samples([37, 12, 50, 5])
    for batch in (collate(samples, pad_id=0), collate_packed(samples, pad_id=0)):
        loss, grads = _loss_and_grads(fast, batch)
        loss_ref, grads_ref = _loss_and_grads(reference, batch)
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
        assert grads.keys() == grads_ref.keys() and grads
        for name in grads_ref:
            torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)
    # generation (a KV cache) runs LitGPT's own forward
    gpt.set_kv_cache(batch_size=1, max_seq_length=16)
    litgpt_attention.set_kv_cache(batch_size=1, max_seq_length=16)
    ids = torch.randint(0, 300, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(gpt(ids, input_pos=torch.arange(5)), litgpt_attention(ids, input_pos=torch.arange(5)))


def test_swiglu_function_is_litgpts_mlp_with_its_gradient_and_keeps_one_tensor_less(tiny_recipe):
    from litgpt.model import GPT

    from litft.layers.mlp import SwiGLU, mlp_forward

    a, b = (torch.randn(3, 7, dtype=torch.float64, requires_grad=True) for _ in range(2))
    torch.testing.assert_close(SwiGLU.apply(a, b), torch.nn.functional.silu(a) * b)
    assert torch.autograd.gradcheck(SwiGLU.apply, (a, b))
    torch.manual_seed(0)
    gpt = GPT(model_config(tiny_recipe(method="full")))
    mlp = gpt.transformer.h[0].mlp
    use_fast_layers(gpt)
    assert vars(mlp)["forward"].__func__ is mlp_forward
    x = torch.randn(2, 5, gpt.config.n_embd, requires_grad=True)

    def saved_elements(forward):
        count = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: count.append(t.numel()) or t, lambda t: t):
            out = forward(x)
        return out, sum(count)

    lean, lean_saved = saved_elements(mlp)
    litgpt, litgpt_saved = saved_elements(lambda t: type(mlp).forward(mlp, t))
    torch.testing.assert_close(lean, litgpt)
    assert litgpt_saved - lean_saved == 2 * 5 * gpt.config.intermediate_size  # silu(fc_1(x)) no longer kept
    (g_lean,), (g_litgpt,) = torch.autograd.grad(lean.sum(), x), torch.autograd.grad(litgpt.sum(), x)
    torch.testing.assert_close(g_lean, g_litgpt)


def test_mixed_precision_linear_is_autocasts_linear_and_keeps_no_16bit_weight():
    """train.lean_mixed_linear: under autocast, the same output and gradients as autocast's F.linear (bitwise: the
    same casts and matmuls), while the tensors kept for the backward pass hold the fp32 weight, not a bf16 copy."""
    from litft.layers.linear import mixed_linear_forward

    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40, bias=True)
    lean = copy.deepcopy(layer)
    lean.forward = mixed_linear_forward.__get__(lean)
    x = torch.randn(2, 5, 24)

    def run(module):
        module.zero_grad(set_to_none=True)
        inputs = x.clone().requires_grad_(True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = module(inputs)
        (out.float() * torch.linspace(-1, 1, 40)).sum().backward()
        grads = (inputs.grad, module.weight.grad, module.bias.grad)
        return out, grads, saved

    out_autocast, grads_autocast, saved_autocast = run(layer)
    out_lean, grads_lean, saved_lean = run(lean)
    assert out_lean.dtype == out_autocast.dtype == torch.bfloat16
    assert torch.equal(out_lean, out_autocast)
    for lean_grad, autocast_grad in zip(grads_lean, grads_autocast):
        assert lean_grad.dtype == autocast_grad.dtype == torch.float32
        assert torch.equal(lean_grad, autocast_grad)
    weight_shaped = lambda saved: [t.dtype for t in saved if t.numel() == layer.weight.numel()]  # noqa: E731
    assert weight_shaped(saved_autocast) == [torch.bfloat16]  # autocast keeps its cast
    assert weight_shaped(saved_lean) == [torch.float32]  # the parameter itself: no new memory
    assert any(t is lean.weight for t in saved_lean)
    # outside autocast (a model used after training) it is nn.Linear's own forward, in fp32
    torch.testing.assert_close(lean(x), layer(x), rtol=0, atol=0)


def test_lean_mixed_linear_runs_train_alike_and_the_ledger_keeps_one_cast(tiny_recipe, tmp_path):
    """A bf16-mixed full fine-tune (CPU autocast) records the same losses with and without train.lean_mixed_linear;
    its ledger counts one layer's 16-bit cast instead of every weight's."""
    import json

    from litgpt.model import GPT

    from litft.memory import estimate_memory

    common = dict(method="full", precision="bf16-mixed", eval={"initial": False, "final": True, "interval": 0},
                  optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}})
    losses, copies = {}, {}
    for lean in (True, False):
        recipe = tiny_recipe(**common, out_dir=str(tmp_path / str(lean)), train={"lean_mixed_linear": lean})
        result = litft.finetune(recipe)
        rows = (result.out_dir / "metrics.jsonl").read_text().splitlines()
        losses[lean] = [json.loads(row)["loss"] for row in rows] + [result.val_loss]
        copies[lean] = {p.name: p.gib for p in estimate_memory(recipe).parts}["16-bit weight copies"]
    assert losses[True] == losses[False]
    with torch.device("meta"):
        gpt = GPT(model_config(tiny_recipe(method="full")))
    matrices = [p.numel() for n, p in gpt.named_parameters() if p.dim() == 2 and "wte" not in n]
    assert copies[True] == pytest.approx(max(matrices) * 2 / 2**30)
    assert copies[False] == pytest.approx(sum(matrices) * 2 / 2**30)


def test_lean_mixed_linear_compiles_to_one_graph_under_autocast(tiny_recipe):
    """The blocks with MixedPrecisionLinear, compiled ('aot_eager') under autocast, keep to one graph and give the
    eager model's loss and gradients."""
    from litgpt.model import GPT
    from torch._dynamo.utils import counters

    from litft.layers.linear import mixed_linear_forward
    from litft.model import compile_blocks

    torch.manual_seed(0)
    gpt = GPT(model_config(tiny_recipe(method="full")))
    use_fast_layers(gpt, LayerPlan(lean_mixed_linear=True))
    assert vars(gpt.lm_head)["forward"].__func__ is mixed_linear_forward
    eager = CausalLM(copy.deepcopy(gpt), loss_chunk=0, max_seq_length=96)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(gpt, backend="aot_eager")
    compiled = CausalLM(gpt, loss_chunk=0, max_seq_length=96, compiled=True)
    for lengths in ([40, 30, 26], [60, 30, 26], [20, 12]):
        batch = collate_packed(_samples(lengths), pad_id=0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, grads = _loss_and_grads(compiled, batch)
            loss_eager, grads_eager = _loss_and_grads(eager, batch)
        torch.testing.assert_close(loss, loss_eager, rtol=1e-2, atol=1e-2)
        for name in grads_eager:
            assert grads[name].dtype == torch.float32
            torch.testing.assert_close(grads[name], grads_eager[name], rtol=5e-2, atol=1e-3, msg=name)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


def test_inductor_compiles_blocks_without_mix_order_reduction(tiny_recipe, monkeypatch):
    """compile_blocks turns inductor's mix-order reduction off: it guards on the row count and split a full fine-tune's
    block into 3 graphs on the H100. Other backends get no inductor options."""
    from litgpt.model import GPT
    from torch._inductor import config as inductor_config

    from litft.model import compile_blocks

    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: calls.append(kwargs))
    with torch.device("meta"):
        gpt = GPT(model_config(tiny_recipe(method="full")))
    compile_blocks(gpt)
    assert len(calls) == gpt.config.n_layer
    if hasattr(inductor_config.triton, "mix_order_reduction"):
        assert calls[0]["options"] == {"triton.mix_order_reduction": False}
    calls.clear()
    compile_blocks(gpt, backend="aot_eager")
    assert "options" not in calls[0]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("grads_allocated", [False, True])  # None before the first pass, or kept and zeroed (graphs)
def test_linear_grad_into_weight_adds_the_same_gradients_as_autograd(bias, grads_allocated):
    from litft.layers.linear import grad_into_weight_forward

    torch.manual_seed(0)
    plain = torch.nn.Linear(24, 40, bias=bias)
    fused = copy.deepcopy(plain)
    fused.forward = grad_into_weight_forward.__get__(fused)
    if grads_allocated:
        for p in (*plain.parameters(), *fused.parameters()):
            p.grad = torch.zeros_like(p)
    for _ in range(3):  # three micro-batches into one step's gradients
        x = torch.randn(2, 7, 24, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        fused(x).square().sum().backward()
        plain(x_ref).square().sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad)
    for p, ref in zip(fused.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, ref.grad)
    with torch.no_grad():  # inference: nn.Linear's own forward, no autograd function
        assert fused(torch.randn(3, 24)).grad_fn is None


@pytest.mark.parametrize("method", ["full", "lora"])
def test_grad_into_weights_trains_alike_and_only_where_it_applies(tiny_recipe, tmp_path, method):
    common = dict(method=method, optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}},
                  lora={"r": 4, "alpha": 8, "dropout": 0.1, "targets": ["q", "k", "v", "o", "mlp", "head"]})
    on = litft.finetune(tiny_recipe(**common, out_dir=str(tmp_path / "on")))
    off = litft.finetune(tiny_recipe(**common, out_dir=str(tmp_path / "off"), train={"grad_into_weights": False}))
    assert on.result["grad_into_weights"] is True and off.result["grad_into_weights"] is False
    import json

    losses = [[json.loads(l)["loss"] for l in (r.out_dir / "metrics.jsonl").read_text().splitlines()] for r in (on, off)]
    assert len(losses[0]) == 4 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    # where autograd's accumulation stays: -mixed precision, FSDP and DeepSpeed, compiled blocks
    from litft.plan import resolve

    def plan(recipe, devices=1):
        return resolve(recipe, model_config(recipe), "cpu", devices).layers.grad_into_weights

    assert not plan(tiny_recipe(method=method, precision="bf16-mixed"))
    assert plan(tiny_recipe(method=method, devices=2), devices=2)  # DDP: litft averages .grad itself
    assert not plan(tiny_recipe(method=method, devices=2, accelerator="auto", strategy="fsdp"), devices=2)
    assert not plan(tiny_recipe(method=method, train={"compile": "always"}))
    assert plan(tiny_recipe(method=method))


def test_speed_litgpt_turns_every_speed_choice_off_and_the_ledger_follows(tiny_recipe):
    """train.speed 'litgpt': LitGPT's layers, padded rows, eager, whole logits, torch's default optimizer step; the
    ledger predicts that path (whole logits and unpacked rows: more memory than litft's own)."""
    from litft.memory import estimate_memory
    from litft.model import model_config
    from litft.plan import resolve

    fast = tiny_recipe(accelerator="auto", precision="bf16-true", method="full")
    litgpt = tiny_recipe(accelerator="auto", precision="bf16-true", method="full", train={"speed": "litgpt"})
    plan = resolve(litgpt, model_config(litgpt), "cuda", 1, triton_available=True)
    layers = plan.layers
    assert not (plan.packing or plan.pack_steps or plan.cuda_graphs or plan.compile or plan.loss_chunk
                or plan.triton_loss or plan.fused_step or plan.step_scales or plan.triton_adamw)
    assert not (layers.fast_lora or layers.fused_rms_norm or layers.fast_attention or layers.lean_swiglu
                or layers.grad_into_weights or layers.triton_kernels)
    fast_plan = resolve(fast, model_config(fast), "cuda", 1, triton_available=True)
    assert fast_plan.packing and fast_plan.cuda_graphs and fast_plan.fused_step
    assert (estimate_memory(litgpt, compiled=False).total_gib > estimate_memory(fast, compiled=False).total_gib)


def test_speed_litgpt_trains_like_the_fast_path_on_the_cpu(tiny_recipe, tmp_path):
    """The same samples per step, computed LitGPT's way: the same losses up to rounding."""
    from litft import finetune

    litgpt = finetune(tiny_recipe(train={"speed": "litgpt", "max_steps": 2}, out_dir=str(tmp_path / "litgpt")))
    fast = finetune(tiny_recipe(train={"max_steps": 2}, out_dir=str(tmp_path / "fast")))
    assert litgpt.status == "ok" and litgpt.result["steps"] == 2
    plan = litgpt.result["plan"]
    assert not plan["packing"] and plan["loss_chunk"] == 0 and not plan["layers"]["fast_attention"]
    for key in ("train_first", "train_last"):
        assert litgpt.result["losses"][key] == pytest.approx(fast.result["losses"][key], rel=1e-4)
