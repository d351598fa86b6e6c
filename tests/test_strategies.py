"""The strategy section: shorthands, what each strategy lets the plan do, bad combinations refused before anything
runs (exit 2), and several processes on the CPU (gloo): DDP checkpoint and resume, and two nodes under torchrun."""

import json
import os
import socket
import subprocess
import sys

import pytest

from litft.cli import main
from litft.errors import ConfigError
from litft.recipe import load_recipe


@pytest.mark.parametrize("shorthand, name, fsdp, deepspeed", [
    ("ddp", "ddp", {}, {}),
    ("fsdp", "fsdp", {}, {}),
    ("fsdp_cpu_offload", "fsdp", {"cpu_offload": True}, {}),
    ("deepspeed", "deepspeed", {}, {"stage": 2}),
    ("deepspeed_stage_2_offload", "deepspeed", {}, {"stage": 2, "offload_optimizer": True}),
    ("deepspeed_stage_3", "deepspeed", {}, {"stage": 3, "offload_optimizer": False}),
    ("deepspeed_stage_3_offload", "deepspeed", {}, {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
])
def test_lightning_strategy_names_are_shorthand_for_the_section(shorthand, name, fsdp, deepspeed, tmp_path):
    yaml_file = tmp_path / "r.yaml"
    yaml_file.write_text(f"model: {{name: open_llama_7b}}\ninit: random\nmethod: full\nstrategy: {shorthand}\n")
    for recipe in (load_recipe("tiny-llama-full", args=["--strategy", shorthand], validate_paths=False),
                   load_recipe("tiny-llama-full", args=[f"--strategy={shorthand}"], validate_paths=False),
                   load_recipe("tiny-llama-full", strategy=shorthand, validate_paths=False),
                   load_recipe(yaml_file, validate_paths=False)):
        assert recipe.strategy.name == name
        for key, value in fsdp.items():
            assert getattr(recipe.strategy.fsdp, key) == value
        for key, value in deepspeed.items():
            assert getattr(recipe.strategy.deepspeed, key) == value


def test_a_strategy_section_and_its_keys(tmp_path):
    recipe = load_recipe("tiny-llama-full", args=["--strategy.name", "fsdp", "--strategy.fsdp.sharding",
                                                  "SHARD_GRAD_OP", "--num_nodes", "2", "--devices", "2"],
                         validate_paths=False)
    assert recipe.strategy.fsdp.sharding == "SHARD_GRAD_OP" and recipe.world_size == 4
    assert "micro_batch_size 8 x accumulation 1 x devices 4 = global_batch_size 32" in recipe.batch_arithmetic()


@pytest.mark.parametrize("args, reason", [
    (["--strategy", "fdsp"], "did you mean 'fsdp'?"),
    (["--strategy.deepspeed.offload_optimizer", "true"], "strategy.deepspeed: set, but strategy.name is 'auto'"),
    (["--strategy", "deepspeed_stage_2", "--strategy.deepspeed.offload_parameters", "true"], "needs stage 3"),
    (["--strategy", "fsdp", "--method", "qlora", "--quantize", "nf4"], "use strategy ddp for QLoRA"),
    (["--strategy", "deepspeed_stage_2_offload", "--optimizer", "torch.optim.SGD", "--optimizer.lr", "0.1"],
     "runs Adam or AdamW on the CPU"),
    (["--strategy", "fsdp", "--accelerator", "cpu"], "needs CUDA GPUs"),
    (["--strategy.name", "fsdp", "--strategy.fsdp.sharding", "HYBRID_SHARD"], "num_nodes 1"),
    (["--num_nodes", "0"], "num_nodes: must be at least 1"),
    (["--devices", "3"], "micro_batch_size x devices = 8 x 3 = 24"),
])
def test_bad_strategy_settings_exit_2_with_the_reason(args, reason, capsys):
    assert main(["validate", "tiny-llama-full", *args]) == 2
    err = capsys.readouterr().err
    assert reason in err and "Traceback" not in err


def test_more_devices_than_visible_gpus_is_refused_before_anything_runs(monkeypatch):
    import torch

    from litft.strategy import build_fabric

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    recipe = load_recipe("tiny-llama-full", args=["--devices", "2", "--accelerator", "cuda"], validate_paths=False)
    with pytest.raises(ConfigError, match="devices: 2 asked for, 1 CUDA GPU"):
        build_fabric(recipe)


def test_the_plan_under_each_strategy(tiny_recipe):
    """DDP keeps the one-device fast path (litft reduces the gradients itself); FSDP and DeepSpeed run without CUDA
    graphs, gradients into weights and pack_steps, and say why."""
    from litft.model import model_config
    from litft.plan import resolve

    ddp = tiny_recipe(devices=2, accelerator="auto", precision="bf16-true", train={"global_batch_size": 8})
    plan = resolve(ddp, model_config(ddp), "cuda", 2, triton_available=True)
    assert plan.strategy == "ddp" and plan.reduces_gradients and plan.cuda_graphs and plan.layers.grad_into_weights
    assert plan.step_scales and plan.pack_steps
    fsdp = tiny_recipe(devices=2, accelerator="auto", precision="bf16-true", strategy="fsdp",
                       train={"global_batch_size": 8}, data={"pack_steps": True})
    plan = resolve(fsdp, model_config(fsdp), "cuda", 2, triton_available=True)
    assert not (plan.cuda_graphs or plan.layers.grad_into_weights or plan.reduces_gradients or plan.pack_steps)
    assert not plan.step_scales and not plan.fused_residual_norms
    assert any("CUDA graphs off under fsdp" in note for note in plan.notes)
    assert any("data.pack_steps off under fsdp" in note for note in plan.notes)
    one = tiny_recipe(accelerator="auto", precision="bf16-true")
    assert resolve(one, model_config(one), "cuda", 1, triton_available=True).strategy == "single"


def _run(out_dir, *overrides, env=None, timeout=1800):
    command = [sys.executable, "-m", "litft.cli", "finetune", "--config", "demo", "--accelerator", "cpu",
               "--train.global_batch_size", "16", "--train.micro_batch_size", "8", "--eval.initial", "false",
               "--eval.interval", "0", "--logging.progress", "plain", "--logging.interval", "1",
               "--logging.tensorboard", "false", "--data.num_workers", "0", "--out_dir", str(out_dir), *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)  # hang guard


def _losses(out_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_ddp_resumes_from_its_checkpoint_exactly(tmp_path):
    """Two ranks: stopped after the step-2 checkpoint, resumed, the run gives the uninterrupted run's losses."""
    whole = _run(tmp_path / "whole", "--devices", "2", "--train.max_steps", "4", "--train.save_interval", "2")
    assert whole.returncode == 0, whole.stderr[-3000:]
    part = _run(tmp_path / "part", "--devices", "2", "--train.max_steps", "4", "--train.save_interval", "2")
    assert part.returncode == 0, part.stderr[-3000:]
    # as a kill after the step-2 checkpoint leaves it: drop the later checkpoint, then resume from the step-2 one
    import shutil

    shutil.rmtree(tmp_path / "part" / "checkpoints" / "step-000004")
    resumed = _run(tmp_path / "part", "--devices", "2", "--train.max_steps", "4", "--train.save_interval", "2",
                   "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step 2" in resumed.stdout
    assert _losses(tmp_path / "part") == pytest.approx(_losses(tmp_path / "whole"), rel=1e-6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_under_torchrun_train_like_one_device(tmp_path):
    """torchrun starts one process per node (here two 'nodes' on this machine, one CPU device each); Fabric reads
    torchrun's environment, and the run is the one-device run accumulating over 2 micro-batches."""
    one = _run(tmp_path / "one", "--devices", "1", "--train.max_steps", "3")
    assert one.returncode == 0, one.stderr[-3000:]
    port = str(_free_port())
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--master_addr", "127.0.0.1", "--master_port", port]
    litft = ["-m", "litft.cli", "finetune", "--config", "demo", "--accelerator", "cpu", "--devices", "1",
             "--num_nodes", "2", "--train.global_batch_size", "16", "--train.micro_batch_size", "8",
             "--train.max_steps", "3", "--eval.initial", "false", "--eval.interval", "0", "--logging.progress",
             "plain", "--logging.interval", "1", "--logging.tensorboard", "false", "--data.num_workers", "0",
             "--out_dir", str(tmp_path / "two")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([*command, "--node_rank", str(rank), *litft], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    outputs = [node.communicate(timeout=1800) for node in nodes]
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, out[-2000:] + err[-3000:]
    result = json.loads((tmp_path / "two" / "result.json").read_text())
    assert result["batch"]["devices"] == 2 and len(result["memory"]["per_rank"]) == 2
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)


def test_an_older_gpu_pads_instead_of_packing_and_refuses_bf16(tiny_recipe, monkeypatch):
    """The lab's V100 track (compute capability 7.0): no flash attention for packed rows, no litft Triton kernels
    (each said in one line), and no bfloat16 (exit 2 naming the precisions that run)."""
    import torch

    from litft.model import model_config
    from litft.plan import resolve
    from litft.strategy import build_fabric

    recipe = tiny_recipe(accelerator="auto", precision="16-mixed", data={"pack_steps": True})
    plan = resolve(recipe, model_config(recipe), "cuda", 1, device_name="Tesla V100-SXM2-32GB", capability=(7, 0),
                   triton_available=True)
    assert not plan.packing and not plan.pack_steps and not plan.layers.triton_kernels and not plan.triton_loss
    assert any("data.packing off" in note and "Tesla V100" in note for note in plan.notes)
    assert any("train.triton_kernels off" in note for note in plan.notes)
    ampere = resolve(recipe, model_config(recipe), "cuda", 1, capability=(8, 0), triton_available=True)
    assert ampere.packing and ampere.layers.triton_kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    bf16 = load_recipe("tiny-llama-full", args=["--accelerator", "cuda"], validate_paths=False)
    with pytest.raises(ConfigError, match="bf16-true needs a GPU with bfloat16.*Tesla V100.*use 16-mixed"):
        build_fabric(bf16)


def test_a_checkpoint_resumes_only_under_its_own_strategy_and_ranks():
    from litft.checkpoint import resume_differences
    from litft.recipe import recipe_to_dict

    saved = recipe_to_dict(load_recipe("tiny-llama-full", args=["--devices", "2"], validate_paths=False))
    fsdp = load_recipe("tiny-llama-full", args=["--devices", "2", "--strategy", "fsdp"], validate_paths=False)
    refuse, _ = resume_differences(saved, fsdp)
    assert any(r.startswith("strategy.name: checkpoint 'auto', now 'fsdp'") for r in refuse)
    older = {**saved, "strategy": "auto"}
    older.pop("num_nodes")  # a config written before num_nodes and the strategy section
    same = load_recipe("tiny-llama-full", args=["--devices", "2"], validate_paths=False)
    assert resume_differences(older, same) == ([], [])
