"""The figures, checked against hand-computed values: FLOPs and MFU, tokens with padding, steady-state windows, and
the memory ledger's parts for full, LoRA, QLoRA and SGD."""

import pytest
import torch

from litft.memory import ALLOCATOR_OVERHEAD, ALLOCATOR_OVERHEAD_QLORA, estimate_memory
from litft.memory.ledger import _quantized_bytes_per_param
from litft.metrics import GIB, FlopModel, StepRecord, Throughput, peak_flops, snapshot_pools
from litft.recipe import load_recipe


def test_flops_follow_the_rule_6_trainable_4_frozen_plus_attention():
    model = FlopModel(matmul_trainable=100, matmul_frozen=1000, n_layer=2, attn_width=8)
    # two samples of lengths 3 and 5: (6*100 + 4*1000) * 8 tokens + 12*2*8*(3^2 + 5^2)
    assert model.batch_flops([3, 5]) == 4600 * 8 + 12 * 2 * 8 * (9 + 25)


def test_mfu_and_tokens_per_second_by_hand():
    t = Throughput(world_size=2, skip_steps=1, peak_flops_per_device=1e12)
    for step in (1, 2, 3):
        t.add(StepRecord(step=step, tokens_real=900, tokens_padded=1000, samples=4, loss_tokens=300, flops=5e11))
    s = t.summary({1: 9.0, 2: 1.0, 3: 1.0})  # step 1 (warm-up) is slow and left out
    assert s["steady_state"] and s["steps_measured"] == 2 and s["train_time_s"] == 2.0
    assert s["tokens_per_sec"] == 2 * 900 * 2 / 2.0  # 2 steps x 900 tokens x 2 ranks / 2 s
    assert s["tokens_per_sec_per_device"] == 900.0
    assert s["padded_tokens_per_sec"] == 2000.0
    assert s["padding_fraction"] == pytest.approx(0.1)
    assert s["tokens_real"] == 3 * 900 * 2 and s["tokens_padded"] == 3 * 1000 * 2
    # model FLOP/s = 2 steps x 5e11 x 2 ranks / 2 s = 1e12; over 2 devices x 1e12 peak = 50%
    assert s["mfu"] == pytest.approx(0.5)
    assert s["median_step_time_s"] == 1.0


def test_a_run_shorter_than_the_warm_up_says_so():
    t = Throughput(world_size=1, skip_steps=5, peak_flops_per_device=None)
    t.add(StepRecord(1, 10, 10, 1, 5, 1.0))
    s = t.summary({1: 2.0})
    assert not s["steady_state"] and s["tokens_per_sec"] == 5.0 and s["mfu"] is None


def test_peak_table():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert peak_flops("Tesla V100-SXM2-32GB", "fp16") == 125e12
    assert peak_flops("Some Future GPU", "bf16") is None


def _parts(recipe):
    est = estimate_memory(recipe, compiled=False)
    return {p.name: p.gib * GIB for p in est.parts}, est


def _counts(recipe):
    from litft.memory.ledger import _meta_model
    from litft.model import model_config

    model = _meta_model(recipe, model_config(recipe))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


@pytest.fixture
def tiny(tiny_recipe):
    return lambda **kw: tiny_recipe(**kw)


def test_ledger_full_adamw_bf16_true_is_8_bytes_per_parameter(tiny):
    r = tiny(method="full", precision="bf16-true", accelerator="auto")
    parts, _ = _parts(r)
    trainable, total = _counts(r)
    assert trainable == total
    assert parts["weights"] == pytest.approx(2 * total)
    assert parts["gradients"] == pytest.approx(2 * total)
    assert parts["optimizer state"] == pytest.approx(2 * 2 * total)


def test_ledger_mixed_keeps_fp32_weights_gradients_and_state(tiny):
    r = tiny(method="full", precision="bf16-mixed")
    parts, _ = _parts(r)
    _, total = _counts(r)
    assert parts["weights"] == pytest.approx(4 * total)
    assert parts["gradients"] == pytest.approx(4 * total)
    assert parts["optimizer state"] == pytest.approx(8 * total)
    assert "16-bit weight copies" in parts


def test_ledger_lora_counts_gradients_and_state_for_adapters_only(tiny):
    r = tiny(method="lora", precision="bf16-true", lora={"r": 4, "alpha": 8, "targets": ["q", "v"]})
    parts, _ = _parts(r)
    trainable, total = _counts(r)
    assert 0 < trainable < total / 5
    assert parts["weights"] == pytest.approx(2 * total)
    assert parts["gradients"] == pytest.approx(2 * trainable)
    assert parts["optimizer state"] == pytest.approx(4 * trainable)


def test_ledger_qlora_packs_linear_weights_into_4_bits():
    assert _quantized_bytes_per_param("nf4") == 0.5 + 4 / 64
    assert _quantized_bytes_per_param("nf4-dq") == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256))
    lora = load_recipe("open-llama-7b-lora", validate_paths=False)
    qlora = load_recipe("open-llama-7b-qlora", validate_paths=False)
    w_lora = next(p.gib for p in estimate_memory(lora, compiled=False).parts if p.name == "weights")
    w_qlora = next(p.gib for p in estimate_memory(qlora, compiled=False).parts if p.name == "weights")
    # OpenLLaMA-7B: d 4096, 32 layers, MLP 11008, vocab 32000; LoRA r 16 on q,k,v,o,mlp
    d, layers, f, vocab, r = 4096, 32, 11008, 32000, 16
    linear = layers * (d * 3 * d + d * d + 3 * d * f) + vocab * d  # qkv, proj, 3 MLP matrices; the output layer
    embedding, norms = vocab * d, layers * 2 * d + d
    # qkv: A (3r x d) and B (3d x r); proj: r x d and d x r; fc_1, fc_2: r x d and f x r; mlp proj: r x f and d x r
    adapters = layers * (3 * r * d + 3 * d * r + r * d + d * r + 2 * r * (d + f) + r * (f + d))
    assert w_lora == pytest.approx((linear + embedding + norms + adapters) * 2 / GIB, rel=1e-6)
    expected = linear * _quantized_bytes_per_param("nf4-dq") + (embedding + norms + adapters) * 2
    assert w_qlora == pytest.approx(expected / GIB, rel=1e-6)
    # bitsandbytes' dequantized copy of one layer at a time: the largest, the output layer (32,000 x 4,096), in bf16
    copy = next(p.gib for p in estimate_memory(qlora, compiled=False).parts if p.name == "dequantized weight")
    assert copy == pytest.approx(vocab * d * 2 / GIB, rel=1e-6)
    assert "dequantized weight" not in [p.name for p in estimate_memory(lora, compiled=False).parts]
    # reserved / allocated: QLoRA's measured factor (memory.ALLOCATOR_OVERHEAD_QLORA), the general one for LoRA
    for recipe, factor in ((qlora, ALLOCATOR_OVERHEAD_QLORA), (lora, ALLOCATOR_OVERHEAD)):
        estimate = estimate_memory(recipe, compiled=False)
        assert estimate.allocator_overhead == factor
        assert estimate.total_gib == pytest.approx(estimate.allocated_gib * factor)


def test_ledger_sgd_keeps_state_only_with_momentum(tiny):
    plain = tiny(method="full", optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1, "momentum": 0.0}})
    momentum = tiny(method="full", optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1, "momentum": 0.9}})
    _, total = _counts(plain)
    assert _parts(plain)[0]["optimizer state"] == 0
    assert _parts(momentum)[0]["optimizer state"] == pytest.approx(4 * total)  # fp32 on the CPU recipe


def test_activations_scale_with_tokens_and_checkpointing_keeps_block_inputs(tiny):
    r = tiny(method="full", precision="bf16-true")
    a1 = dict((p.name, p.gib) for p in estimate_memory(r, tokens=100, compiled=False).parts)["activations"]
    a2 = dict((p.name, p.gib) for p in estimate_memory(r, tokens=200, compiled=False).parts)["activations"]
    assert a2 == pytest.approx(2 * a1)
    ac = tiny(method="full", precision="bf16-true", train={"activation_checkpointing": True})
    est = estimate_memory(ac, tokens=100, compiled=False)
    acts = dict((p.name, p.gib * GIB) for p in est.parts)["activations"]
    n_layer, n_embd = 2, 32
    assert acts == pytest.approx(100 * (n_layer * n_embd * 2 + est.activations_per_token_layer))


def _block_params(recipe):
    from litft.memory.ledger import _meta_model
    from litft.model import model_config

    return sum(p.numel() for p in _meta_model(recipe, model_config(recipe)).transformer.h[0].parameters())


def test_ledger_sharded_divides_model_state_and_gathers_two_blocks(tiny):
    r = tiny(method="full", precision="bf16-true", devices=2)
    _, total = _counts(r)
    block = _block_params(r)
    plain = {p.name: p.gib * GIB for p in estimate_memory(r, compiled=False).parts}
    zero3 = {p.name: p.gib * GIB for p in estimate_memory(r, compiled=False, sharding="zero3").parts}
    zero2 = {p.name: p.gib * GIB for p in estimate_memory(r, compiled=False, sharding="zero2").parts}
    # zero3 (FSDP full shard): every part of the model state / 2 GPUs, plus 2 blocks gathered in bf16
    assert zero3["weights"] == pytest.approx(2 * total / 2 + 2 * 2 * block)
    assert zero3["gradients"] == pytest.approx(2 * total / 2)
    assert zero3["optimizer state"] == pytest.approx(2 * 2 * total / 2)
    # zero2: the weights stay whole
    assert zero2["weights"] == pytest.approx(2 * total)
    assert zero2["gradients"] == pytest.approx(2 * total / 2) and zero2["optimizer state"] == pytest.approx(2 * total)
    # activations and the loss are per GPU: sharding leaves them alone
    for part in ("activations", "logits and loss"):
        assert zero3[part] == zero2[part] == plain[part]


def test_ledger_offload_moves_optimizer_state_and_fp32_master_to_the_host(tiny):
    r = tiny(method="full", precision="bf16-mixed", devices=2)
    _, total = _counts(r)
    block = _block_params(r)
    plain = estimate_memory(r, compiled=False)
    est = estimate_memory(r, compiled=False, sharding="zero2", offload="optimizer")
    parts = {p.name: p.gib * GIB for p in est.parts}
    assert parts["optimizer state"] == 0 and "16-bit weight copies" not in parts
    assert parts["weights"] == pytest.approx(2 * total)  # the GPU keeps bf16 weights
    assert parts["gradients"] == pytest.approx(4 * total / 2)
    # host: the checkpoint's one copy (fp32, 4 B) + AdamW's fp32 moments (8 B) + the fp32 master weights (4 B)
    assert est.host_gib * GIB == pytest.approx(plain.host_gib * GIB + 8 * total + 4 * total)
    every = estimate_memory(r, compiled=False, sharding="zero3", offload="optimizer+params")
    weights = next(p.gib * GIB for p in every.parts if p.name == "weights")
    assert weights == pytest.approx(2 * 2 * block)  # only the two gathered blocks stay on the GPU
    assert every.host_gib * GIB == pytest.approx(plain.host_gib * GIB + 8 * total + 4 * total + 2 * total)
    with pytest.raises(ValueError, match="offload needs sharding"):
        estimate_memory(r, compiled=False, offload="optimizer")
    with pytest.raises(ValueError, match="needs sharding zero3"):
        estimate_memory(r, compiled=False, sharding="zero2", offload="optimizer+params")


def test_estimate_cli_plans_the_recipes_strategy(capsys):
    from litft.cli import main

    assert main(["estimate", "--config", "open-llama-13b-full", "--gpu-memory", "80", "--devices", "4",
                 "--strategy", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert "strategy: fsdp over 4 GPU(s), sharded like zero3" in out and "fits in 80.00 GiB" in out
    assert "sharded over 4 GPUs" in out
    assert main(["estimate", "--config", "open-llama-13b-full", "--sharding", "zero3"]) == 2
    assert "set it as a recipe key, e.g. --strategy fsdp" in capsys.readouterr().err


def test_ledger_deepspeed_keeps_fp32_master_weights_and_moments_per_rank_or_on_the_host(tiny):
    """DeepSpeed trains 16-bit weights against fp32 master weights, Adam moments and gradients (16 B per trainable
    parameter) split over the ranks, or pinned in host RAM with offload_optimizer."""
    r = tiny(method="full", precision="bf16-true", devices=2, strategy="deepspeed_stage_3",
             accelerator="auto")
    _, total = _counts(r)
    block = _block_params(r)
    parts = {p.name: p.gib * GIB for p in estimate_memory(r, compiled=False).parts}
    assert parts["weights"] == pytest.approx(2 * total / 2 + 2 * 2 * block)
    assert parts["optimizer state"] == pytest.approx(16 * total / 2)
    offload = tiny(method="full", precision="bf16-true", devices=1, strategy="deepspeed_stage_2_offload",
                   accelerator="auto")
    est = estimate_memory(offload, compiled=False)
    parts = {p.name: p.gib * GIB for p in est.parts}
    assert parts["optimizer state"] == 0 and parts["weights"] == pytest.approx(2 * total)
    plain = estimate_memory(tiny(method="full", precision="bf16-true"), compiled=False)
    assert est.host_gib * GIB == pytest.approx(plain.host_gib * GIB + 16 * total)


def test_estimate_cli_gives_a_verdict_and_ranked_fixes(capsys):
    from litft.cli import main

    assert main(["estimate", "--config", "open-llama-13b-full", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit in 80.00 GiB" in out
    fixes = [line for line in out.splitlines() if line.startswith("  - ")]
    assert fixes and "SGD" in out
    assert main(["estimate", "--config", "open-llama-13b-full-sgd", "--gpu-memory", "80"]) == 0
    assert "fits in 80.00 GiB" in capsys.readouterr().out


def test_snapshot_pools_split_reserved_memory_by_pool():
    gib = 2**30
    snapshot = {"segments": [
        {"segment_pool_id": (0, 0), "total_size": 2 * gib, "allocated_size": gib + gib // 2},
        {"segment_pool_id": (0, 0), "total_size": gib, "allocated_size": gib},
        {"segment_pool_id": (1, 0), "total_size": 4 * gib, "allocated_size": gib // 4},
    ]}
    assert snapshot_pools(snapshot) == [
        "default pool: 3.00 GiB reserved in 2 segments, 2.50 GiB allocated, 0.50 GiB free",
        "graph pool (1, 0): 4.00 GiB reserved in 1 segments, 0.25 GiB allocated, 3.75 GiB free",
    ]
    assert snapshot_pools({}) == []


def test_the_eta_counts_from_the_first_step_not_from_loading_and_compiling(monkeypatch, capsys):
    """A compile of 90 s before the first step made the ETA at step 5 of 40 read 10m45s for a run that had 4 s
    left (H100, TinyLlama LoRA compiled). The ETA extrapolates the steps' own time."""
    import litft.progress as progress_module

    now = [1000.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: now[0])
    progress = progress_module.Progress("plain", total_steps=40, enabled=True)
    now[0] += 90.0  # loading, compiling, capturing
    progress.start()
    now[0] += 5 * 0.1  # five steps of 100 ms
    progress.update(5, loss=2.0, tok_s=1000.0, gib=1.0, lr=1e-4)
    assert capsys.readouterr().out.strip().endswith("ETA 3s")  # 35 steps x 0.1 s = 3.5 s (whole seconds)


def test_kernel_table_groups_kernels_by_full_name_most_time_first():
    from types import SimpleNamespace

    from litft.train.profiling import kernel_table

    long_name = "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>(int)"
    kernels = [SimpleNamespace(name=long_name, device_time_total=30.0) for _ in range(4)]
    kernels += [SimpleNamespace(name="nvjet_gemm", device_time_total=200.0) for _ in range(2)]
    lines = kernel_table(kernels, steps=2)
    assert "2 distinct" in lines[0]
    gemm, add = lines[2].split(), lines[3].split()
    assert gemm[:4] == ["0.20", "1", "200.0", "76.9%"] and gemm[4] == "nvjet_gemm"  # 400 us of 520 over 2 steps
    assert add[:4] == ["0.06", "2", "30.0", "23.1%"] and lines[3].endswith("CUDAFunctor_add<c10::BFloat16>>(int)")
    assert len(kernel_table(kernels, steps=2, rows=1)) == 3  # heading, column names, the gemm
    assert len(kernel_table(kernels, steps=2, rows=None)) == 4  # every kernel (profile_kernels.txt)
