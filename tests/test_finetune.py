"""The loop end to end on a 2-layer model on the CPU: full, LoRA and SGD runs write every output, figures add up,
and LoRA is correct (zero-initialised B is a no-op, merge equals base + adapter, only adapters change)."""

import json
import math

import pytest
import torch

import litft
from litft.checkpoint import merge_lora_checkpoint
from litft.model import model_config


def _read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    "method, optimizer",
    [
        ("full", {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}}),
        ("lora", {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-2}}),
        ("full", {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5, "momentum": 0.0}}),
    ],
    ids=["full-adamw", "lora-adamw", "full-sgd"],
)
def test_run_end_to_end_writes_every_output(tiny_recipe, method, optimizer):
    recipe = tiny_recipe(method=method, optimizer=optimizer, lora={"r": 4, "alpha": 8, "targets": ["q", "v", "mlp"]})
    result = litft.finetune(recipe)
    out = result.out_dir
    assert result.status == "ok"

    # resolved config: loads back to the same recipe
    assert litft.load_recipe(out / "config.yaml") == recipe

    # one metrics row per step (logging.interval 1), finite losses, the val losses at the eval interval
    rows = _read_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["tokens_per_sec"] > 0 for r in rows)
    assert "val_loss" in rows[1] and "val_loss" not in rows[0]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))

    r = json.loads((out / "result.json").read_text())
    assert r["steps"] == 4 and r["batch"]["grad_accum"] == 2
    t = r["throughput"]
    # 4 steps x 8 samples; tokens add up; padding counted apart
    assert t["tokens_real"] > 0 and t["tokens_padded"] >= t["tokens_real"]
    assert t["steps_measured"] == 2 and t["steps_skipped"] == 2 and t["steady_state"]
    assert t["tokens_per_sec"] > 0 and t["mfu"] is None  # no MFU on the CPU (no peak in the table)
    assert r["losses"]["val_initial"] is not None and r["losses"]["val_final"] is not None
    assert set(r["definitions"]) >= {"tokens_real", "tokens_per_sec", "mfu", "memory"}
    # the ledger is held against the largest micro-batch the run formed (no CUDA graphs on the CPU)
    assert r["cuda_graphs"] == {"on": False}
    assert r["memory"]["predicted_for_tokens"] == r["memory"]["max_micro_batch_tokens"] > 0

    weights = torch.load(out / r["files"]["weights"], weights_only=True)
    if method == "lora":
        assert weights and all("lora_" in k for k in weights)
        assert r["parameters"]["trainable"] == sum(v.numel() for v in weights.values())
        assert (out / "final" / "hyperparameters.yaml").is_file()
    else:
        assert r["parameters"]["trainable"] == r["parameters"]["total"]
        assert "lm_head.weight" in weights
    assert (out / "final" / "model_config.yaml").is_file() and (out / "final" / "tokenizer.json").is_file()


def test_a_second_run_into_the_same_out_dir_is_refused_without_overwrite(tiny_recipe):
    recipe = tiny_recipe(method="full", train={"max_steps": 1}, eval={"initial": False})
    litft.finetune(recipe)
    with pytest.raises(litft.errors.ConfigError, match="already holds a run"):
        litft.finetune(recipe)
    assert litft.finetune(recipe, overwrite=True).status == "ok"


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(ids)


def test_lora_with_zero_B_leaves_the_output_unchanged(tiny_recipe, tiny_checkpoint_dir):
    from litgpt.lora import GPT as LoRAGPT
    from litgpt.model import GPT

    recipe = tiny_recipe(method="lora", lora={"r": 4, "alpha": 8, "targets": ["q", "k", "v", "o", "mlp", "head"]})
    state = torch.load(tiny_checkpoint_dir / "lit_model.pth", weights_only=True)
    base = GPT(model_config(tiny_recipe(method="full")))
    base.load_state_dict(state)
    lora = LoRAGPT(model_config(recipe))
    lora.load_state_dict(state, strict=False)
    assert any(n.endswith("lora_B") for n, _ in lora.named_parameters())
    ids = torch.randint(0, 300, (2, 16))
    assert torch.equal(_logits(base, ids), _logits(lora, ids))


def test_training_changes_only_the_adapters_and_merge_equals_base_plus_adapter(tiny_recipe, tiny_checkpoint_dir, tmp_path):
    from litgpt.model import GPT

    recipe = tiny_recipe(
        method="lora", lora={"r": 4, "alpha": 8, "dropout": 0.1, "targets": ["q", "k", "v", "o", "mlp", "head"]},
        optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-2}}, merge=True,
    )
    result = litft.finetune(recipe)
    trained = result.model
    base_state = torch.load(tiny_checkpoint_dir / "lit_model.pth", weights_only=True)

    changed_adapters = 0
    for name, tensor in trained.state_dict().items():
        if "lora_" in name:
            changed_adapters += name.endswith("lora_B") and bool(tensor.abs().sum() > 0)
        else:
            base_name = name.replace("linear.", "")
            assert torch.equal(tensor, base_state[base_name]), f"{name} changed but is frozen"
    assert changed_adapters > 0

    # merged checkpoint (written by the run with merge: true) == base + adapter, in fp32
    merged = GPT(model_config(tiny_recipe(method="full")))
    merged.load_state_dict(torch.load(result.out_dir / "final" / "merged" / "lit_model.pth", weights_only=True))
    ids = torch.randint(0, 300, (2, 24))
    torch.testing.assert_close(_logits(merged, ids), _logits(trained, ids), atol=1e-5, rtol=1e-5)

    # and the stand-alone merge gives the same weights
    again = tmp_path / "again.pth"
    merge_lora_checkpoint(
        tiny_checkpoint_dir / "lit_model.pth", result.out_dir / "final" / "lit_model.pth.lora", model_config(recipe), again
    )
    first = torch.load(result.out_dir / "final" / "merged" / "lit_model.pth", weights_only=True)
    second = torch.load(again, weights_only=True)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_gradient_accumulation_is_equivalent_to_a_bigger_micro_batch(tiny_recipe, tmp_path):
    """micro 8 x accumulation 1 and micro 2 x accumulation 4 see the same samples per step; the loss is normalised
    by the step's loss tokens, so the updates agree to float rounding."""
    common = dict(method="full", eval={"initial": False, "final": False, "interval": 0})
    a = litft.finetune(tiny_recipe(**common, out_dir=str(tmp_path / "a"), train={"max_steps": 3, "micro_batch_size": 8}))
    b = litft.finetune(tiny_recipe(**common, out_dir=str(tmp_path / "b"), train={"max_steps": 3, "micro_batch_size": 2}))
    assert a.result["batch"]["grad_accum"] == 1 and b.result["batch"]["grad_accum"] == 4
    losses_a = [r["loss"] for r in _read_rows(a.out_dir / "metrics.jsonl")]
    losses_b = [r["loss"] for r in _read_rows(b.out_dir / "metrics.jsonl")]
    assert losses_a == pytest.approx(losses_b, abs=1e-5)
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-5, rtol=1e-4, msg=name)


def test_activation_checkpointing_changes_memory_not_the_result(tiny_recipe, tmp_path):
    common = dict(method="lora", lora={"r": 4, "alpha": 8, "dropout": 0.0, "targets": ["q", "v", "mlp"]},
                  eval={"initial": False, "final": True, "interval": 0})
    plain = litft.finetune(tiny_recipe(**common, out_dir=str(tmp_path / "plain")))
    checkpointed = litft.finetune(
        tiny_recipe(**common, out_dir=str(tmp_path / "ac"), train={"activation_checkpointing": True})
    )
    losses = [[r["loss"] for r in _read_rows(run.out_dir / "metrics.jsonl")] for run in (plain, checkpointed)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    assert checkpointed.val_loss == pytest.approx(plain.val_loss, rel=1e-6)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    assert all(isinstance(block, CheckpointWrapper) for block in checkpointed.model.transformer.h)


def test_compile_auto_compiles_only_runs_long_enough_to_win_back_the_compile_time(tiny_recipe):
    from types import SimpleNamespace

    from litgpt.config import Config

    from litft.plan import COMPILE_PAYS_OFF_S, resolve, weights_per_token

    config = Config.from_name("tiny-llama-1.1b")
    stats = SimpleNamespace(samples=1000, mean_length=250.0)

    def decide(device="cuda", triton=True, **train):
        recipe = tiny_recipe(method="lora", precision="bf16-true",
                             train={"max_steps": None, "triton_kernels": False, **train})
        plan = resolve(recipe, config, device, 1, device_name="NVIDIA H100 80GB HBM3", data_stats=stats,
                       triton_available=triton)
        return plan.compile, plan.compile_why

    # with litft's Triton kernels, eager blocks beat compiled ones (measured): 'auto' stays eager however long the run
    compiled, why = decide(epochs=1000, triton_kernels=True)
    assert not compiled and "Triton kernels" in why
    # an install without Triton: the break-evens below, as with false
    assert decide(epochs=1000, triton_kernels=True, triton=False)[0]

    # one epoch of 1,000 samples, global batch 8: 125 steps x 8 x 250 tokens x 4 x 1.03e9 FLOPs / 989e12 ~ 1 s
    compiled, why = decide(epochs=1)
    assert not compiled and "1 s of work" in why and why.endswith("for lora")
    n = weights_per_token(config)
    epochs_needed = int(COMPILE_PAYS_OFF_S["lora"] * 989e12 / (125 * 8 * 250 * 4 * n)) + 1
    assert decide(epochs=epochs_needed)[0] and not decide(epochs=epochs_needed - 2)[0]
    # a full fine-tune's block compiles ~9x faster than LoRA's (measured): its threshold is lower, in its own units
    # (6 FLOPs per trainable weight); global batch 8 as above
    epochs_full = int(COMPILE_PAYS_OFF_S["full"] * 989e12 / (125 * 8 * 250 * 6 * n)) + 1
    for epochs, expected in ((epochs_full, True), (epochs_full - 2, False)):
        full = tiny_recipe(method="full", precision="bf16-true",
                           train={"max_steps": None, "epochs": epochs, "triton_kernels": False})
        plan = resolve(full, config, "cuda", 1, device_name="NVIDIA H100 80GB HBM3", data_stats=stats)
        assert plan.compile is expected and plan.compile_why.endswith(f"above {COMPILE_PAYS_OFF_S['full']:.0f} s for full")
    # without graphs compiling also cuts the host's launch overhead
    assert decide(cuda_graphs="never") == (True, "")
    assert decide(compile="always") == (True, "") and decide(compile="never", cuda_graphs="never") == (False, "")
    assert decide(device="cpu") == (False, "")


def test_memory_snapshot_is_cuda_only_and_the_cpu_run_says_so(tiny_recipe, capsys):
    result = litft.finetune(tiny_recipe(logging={"memory_snapshot": 2, "progress": "plain"}))
    assert result.result["status"] == "ok"
    assert "memory snapshot: CUDA only" in capsys.readouterr().out
    assert not (result.out_dir / "memory_snapshot.pickle").exists()


@pytest.mark.parametrize("method", ["full", "lora"])
def test_pack_steps_runs_fewer_micro_batches_with_the_same_updates(tiny_recipe, tmp_path, method):
    """data.pack_steps fills micro-batches by positions: the same samples per step and the same normalisation by
    the step's loss tokens, so the same losses and weights (fp32, no dropout: up to summation order). (Without
    data.fit_steps, which would give the packed run other samples per step.)"""
    common = dict(method=method, lora={"r": 4, "alpha": 8, "dropout": 0.0, "targets": ["q", "v", "mlp"]},
                  eval={"initial": False, "final": True, "interval": 0},
                  train={"global_batch_size": 12, "micro_batch_size": 4, "max_steps": 5, "epochs": 2,
                         "warmup_steps": 1})
    runs = {flag: litft.finetune(tiny_recipe(**common, out_dir=str(tmp_path / str(flag)),
                                             data={"pack_steps": flag, "fit_steps": False,
                                                   "max_seq_length": 96}))
            for flag in (False, True)}
    plain, packed = runs[False].result, runs[True].result
    # 37 samples: 9 micro-batches of 4 = 3 steps of 12 per epoch either way; 5 steps cross an epoch boundary
    assert plain["steps"] == packed["steps"] == 5
    assert plain["batch"]["micro_batches_run"] == 5 * 3 and not plain["batch"]["pack_steps"]
    # ~52-position samples, 4 x 96 = 384 positions per micro-batch: 7 samples fit one, so 2 micro-batches a step
    assert packed["batch"]["pack_steps"] and packed["batch"]["micro_batches_run"] == 5 * 2
    assert packed["throughput"]["tokens_real"] == plain["throughput"]["tokens_real"]  # the same samples
    assert packed["throughput"]["loss_tokens"] == plain["throughput"]["loss_tokens"]
    losses = [[r["loss"] for r in _read_rows(run.out_dir / "metrics.jsonl")] for run in runs.values()]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert runs[True].val_loss == pytest.approx(runs[False].val_loss, rel=1e-5)
    for (name, a), b in zip(runs[False].model.state_dict().items(), runs[True].model.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), name


def _plan(recipe, device="cuda", triton=False):
    from litft.plan import resolve

    return resolve(recipe, model_config(recipe), device, 1, triton_available=triton)


def test_torch_optimizers_are_fused_on_cuda_unless_the_recipe_chose(tiny_recipe):
    """A recipe loaded through jsonargparse carries the class's defaults, foreach=None and fused=None among them: those
    are no choice, and AdamW/SGD on CUDA get fused=True (a None there kept every run on torch's foreach default)."""
    from litft.train.optim import optimizer_kwargs

    recipe = litft.load_recipe("tiny-llama-full", init="random", model={"tokenizer_dir": "litft:demo/model"})
    assert {"foreach", "fused"} <= recipe.optimizer.init_args.keys()  # what jsonargparse fills in
    kwargs = optimizer_kwargs(recipe, _plan(recipe))
    assert kwargs["fused"] is True and kwargs["betas"] == (0.9, 0.95)
    assert optimizer_kwargs(recipe, _plan(recipe, "cpu"))["fused"] is None  # the CPU: torch decides
    chose = litft.load_recipe("tiny-llama-full", init="random", model={"tokenizer_dir": "litft:demo/model"},
                              optimizer={"init_args": {"foreach": True}})
    assert chose.optimizer.init_args["foreach"] is True
    assert optimizer_kwargs(chose, _plan(chose)).get("fused") is None
    sgd = tiny_recipe(optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}})
    assert optimizer_kwargs(sgd, _plan(sgd))["fused"] is True

    eight_bit = tiny_recipe(optimizer={"class_path": "bitsandbytes.optim.AdamW8bit", "init_args": {"lr": 1e-4}})
    assert "fused" not in optimizer_kwargs(eight_bit, _plan(eight_bit))  # not torch's: left alone
    assert not _plan(eight_bit).fused_step and not _plan(eight_bit).step_scales


def test_fused_adamw_becomes_the_triton_step_only_where_asked(tiny_recipe):
    """The plan swaps kernels.AdamW in for torch.optim.AdamW that would run fused where Triton's kernels run on CUDA
    (whole parameters, no fp16 scaler); not for another choice of implementation, amsgrad, or another optimizer.
    (fused=True chosen here: the optimizer is built on the CPU, where torch leaves fused to the recipe.)"""
    from litft import kernels
    from litft.train.optim import build_optimizer, optimizer_summary

    model = torch.nn.Linear(4, 4)

    def built(triton: bool, precision="32-true", **init_args):
        recipe = tiny_recipe(precision=precision,
                             optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3, **init_args}})
        return build_optimizer(recipe, model, _plan(recipe, triton=triton))

    triton_step = built(True, fused=True)
    assert type(triton_step) is kernels.AdamW and triton_step.defaults["fused"]
    assert optimizer_summary(triton_step)["implementation"] == "Triton kernel (litft.kernels.AdamW)"
    assert type(built(False, fused=True)) is torch.optim.AdamW
    assert type(built(True, foreach=True)) is torch.optim.AdamW
    assert type(built(True, fused=True, amsgrad=True)) is torch.optim.AdamW
    sgd = tiny_recipe(optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1, "fused": True}})
    assert type(build_optimizer(sgd, model, _plan(sgd, triton=True))) is torch.optim.SGD
    # an fp16 loss scaler owns the fused step's grad_scale: neither the Triton step nor clipping inside the step
    scaled = tiny_recipe(precision="16-mixed", optimizer={"class_path": "torch.optim.AdamW",
                                                          "init_args": {"lr": 1e-3, "fused": True}})
    assert not _plan(scaled, triton=True).triton_adamw and not _plan(scaled, triton=True).step_scales


def test_a_run_records_which_optimizer_implementation_it_used(tiny_recipe, capsys):
    """result.json and the run's log say which implementation the optimizer's step ran: the CPU run gets torch's
    default, a CUDA run fused (test_torch_optimizers_are_fused_on_cuda_unless_the_recipe_chose)."""
    result = litft.finetune(tiny_recipe(method="lora"))
    assert result["optimizer"] == {"class": "torch.optim.adamw.AdamW",
                                   "implementation": "torch's default: foreach on CUDA, for-loop elsewhere",
                                   "clipping": "fabric.clip_gradients"}
    chose = litft.finetune(tiny_recipe(method="lora", out_dir=str(result.out_dir) + "-foreach",
                                       optimizer={"class_path": "torch.optim.AdamW",
                                                  "init_args": {"lr": 1e-3, "foreach": True}}))
    assert chose["optimizer"]["implementation"] == "foreach"
    # only a fused optimizer can skip a non-finite update on the device, so only it lets the loss be read late
    assert result["loss_read"] == chose["loss_read"] == "before each update"
    capsys.readouterr()
    fused = litft.finetune(tiny_recipe(method="lora", out_dir=str(result.out_dir) + "-fused",
                                       optimizer={"class_path": "torch.optim.AdamW",
                                                  "init_args": {"lr": 1e-3, "fused": True}}))
    assert fused["optimizer"]["implementation"] == "fused" and fused["loss_read"] == "a step late"
    assert "each step's loss read a step late" in capsys.readouterr().out


def clip_then_step(device: str, max_norm: float, clip_in_step: bool, dtype: torch.dtype = torch.float32):
    """Three AdamW(fused) steps of a small model on ``device``, clipped by litft's clip_gradients or Fabric's."""
    import lightning as L

    from litft.train.optim import clip_gradients

    torch.manual_seed(0)
    fabric = L.Fabric(accelerator=device, devices=1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).to(dtype)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True))
    norms = []
    for _ in range(3):
        model(torch.randn(8, 16, device=fabric.device, dtype=dtype)).float().square().sum().backward()
        if clip_in_step:
            norms.append(clip_gradients(fabric, model, optimizer, max_norm, in_step=True))
        else:
            norms.append(fabric.clip_gradients(model, optimizer, max_norm=max_norm))
        optimizer.step()
        optimizer.zero_grad()
    return torch.stack(norms), [p.detach().clone() for p in model.parameters()]


def assert_clipping_in_step_matches(device: str, max_norm: float, dtype: torch.dtype = torch.float32) -> None:
    norms, params = clip_then_step(device, max_norm, clip_in_step=True, dtype=dtype)
    ref_norms, ref_params = clip_then_step(device, max_norm, clip_in_step=False, dtype=dtype)
    torch.testing.assert_close(norms, ref_norms)
    assert bool((norms > max_norm).all()) == (max_norm < 1)  # the small cap really clips
    # bf16: clip_grad_norm_ rounds each clipped gradient to bf16, the fused kernel divides in fp32: the weights after
    # three lr-0.1 steps may differ by a bf16 step (2^-9 at 0.5)
    tolerance = {"rtol": 0.0, "atol": 4e-3} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    for p, ref in zip(params, ref_params):
        torch.testing.assert_close(p, ref, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the fused kernel wants an fp32 scale
@pytest.mark.parametrize("max_norm", [0.05, 100.0])  # clipped, and a norm already under the cap
def test_clipping_inside_the_fused_step_equals_clip_grad_norm_then_step(max_norm, dtype):
    """(AdamW normalises the update by the gradient's scale, but not across steps whose clip factors differ: with the
    division left out this test fails.) The CUDA kernel: tests/test_gpu.py."""
    assert_clipping_in_step_matches("cpu", max_norm, dtype)


def test_clipping_stays_with_fabric_for_optimizers_without_a_fused_step(tiny_recipe):
    def plan(class_path, **init_args):
        return _plan(tiny_recipe(optimizer={"class_path": class_path, "init_args": {"lr": 1e-3, **init_args}}))

    assert plan("torch.optim.AdamW", fused=True).step_scales  # what clip_then_step above runs
    assert not plan("torch.optim.AdamW", foreach=True).step_scales
    assert not plan("torch.optim.RMSprop").step_scales


def test_profile_window_writes_a_trace_and_the_op_table(tiny_recipe, capsys):
    """logging.profile on the CPU: a torch profiler trace of the window's steps in out_dir/profile and the op table in
    the run's log (the per-kernel table and profile_kernels.txt are CUDA's: tests/test_gpu.py)."""
    result = litft.finetune(tiny_recipe(logging={"profile": "2-3"}))
    traces = list((result.out_dir / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1 and json.loads(traces[0].read_text())["traceEvents"]
    log = capsys.readouterr().out
    assert "Self CPU time total" in log and "profiler: steps 2-3 written to" in log
    assert not (result.out_dir / "profile_kernels.txt").exists()
