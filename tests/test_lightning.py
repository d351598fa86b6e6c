"""The Trainer engine (litft.lightning): the same recipe through Lightning's Trainer trains as the Fabric loop does."""

import json
import subprocess
import sys

import pytest
import torch

import litft
from litft.errors import ConfigError

STEPS = {"max_steps": 4, "global_batch_size": 16, "micro_batch_size": 8}  # 2 micro-batches per step


def _recipe(tmp_path, name: str, **overrides):
    return litft.load_recipe("demo", out_dir=str(tmp_path / name), train=STEPS,
                             eval={"initial": True, "interval": 2}, logging={"progress": "none", "interval": 1},
                             **overrides)


def _losses(out_dir) -> list[float]:
    return [row["loss"] for row in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in row]


def test_the_trainer_engine_gives_the_fabric_engines_losses_and_weights(tmp_path):
    """fp32 on the CPU, LoRA on the demo model, 2 micro-batches per step: the per-step loss, the validation losses
    and the trained adapter agree to 1e-5 (the Trainer normalises by the step's loss tokens after the backward
    passes, the Fabric loop before them: the same sums in another order)."""
    fabric = litft.finetune(_recipe(tmp_path, "fabric"))
    trainer = litft.finetune(_recipe(tmp_path, "trainer", engine="trainer"))
    assert trainer.result["engine"] == "trainer" and trainer.result["steps"] == 4
    assert len(_losses(trainer.out_dir)) == 4
    assert _losses(trainer.out_dir) == pytest.approx(_losses(fabric.out_dir), rel=1e-5)
    for key in ("train_first", "train_last", "val_initial", "val_final"):
        assert trainer.result["losses"][key] == pytest.approx(fabric.result["losses"][key], rel=1e-5), key
    rows = [json.loads(line) for line in (trainer.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "val_loss" in row] == [0, 2, 4]  # before, every 2 steps, after
    adapters = [torch.load(r.out_dir / "final" / "lit_model.pth.lora", weights_only=True) for r in (fabric, trainer)]
    assert adapters[0].keys() == adapters[1].keys()
    for name, value in adapters[0].items():  # Adam divides by sqrt(v): an element whose gradients are ~0 turns
        # rounding into steps of up to lr (3e-3 here), so a few of 2,048 differ by ~1e-5 where most agree to 1e-7
        torch.testing.assert_close(adapters[1][name], value, rtol=1e-3, atol=5e-5)
    assert trainer.result["throughput"]["tokens_real"] == fabric.result["throughput"]["tokens_real"]


def test_the_trainer_engine_under_ddp_gives_one_devices_losses(tmp_path):
    """Two processes (gloo) started by the command line, as `litft finetune --engine trainer --devices 2` starts
    them: each step's 16 samples split between the ranks, the same losses as one device accumulating 2."""
    one = litft.finetune(_recipe(tmp_path, "one", engine="trainer"))
    command = [sys.executable, "-m", "litft.cli", "finetune", "--config", "demo", "--engine", "trainer",
               "--devices", "2", "--train.max_steps", "4", "--train.global_batch_size", "16",
               "--train.micro_batch_size", "8", "--eval.initial", "true", "--eval.interval", "2",
               "--logging.progress", "none", "--logging.interval", "1", "--out_dir", str(tmp_path / "two")]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert _losses(tmp_path / "two") == pytest.approx(_losses(one.out_dir), rel=1e-5)
    result = json.loads((tmp_path / "two" / "result.json").read_text())
    assert result["batch"]["devices"] == 2 and result["engine"] == "trainer"
    assert result["losses"]["val_final"] == pytest.approx(one.result["losses"]["val_final"], rel=1e-5)


def test_the_trainer_engine_refuses_what_it_cannot_run(tmp_path):
    with pytest.raises(ConfigError, match="use engine fabric"):
        litft.load_recipe("demo", engine="trainer", strategy="deepspeed_stage_2")
    recipe = _recipe(tmp_path, "run", engine="trainer")
    with pytest.raises(ConfigError, match="--resume"):
        litft.finetune(recipe, resume=str(tmp_path / "run" / "checkpoints" / "step-000002"))
