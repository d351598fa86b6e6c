"""DDP on the CPU (gloo): two processes started by the `litft` command line, as a multi-GPU run starts them."""

import json
import subprocess
import sys

import pytest


def _finetune(out_dir, *overrides: str) -> list[dict]:
    command = [sys.executable, "-m", "litft.cli", "finetune", "--config", "demo", "--accelerator", "cpu",
               "--train.max_steps", "4", "--train.global_batch_size", "16", "--eval.initial", "false",
               "--eval.interval", "0", "--logging.progress", "plain", "--logging.interval", "1", "--logging.tensorboard", "false",
               "--data.num_workers", "0", "--out_dir", str(out_dir), *overrides]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1800)  # a hang guard
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("pack_steps", [False, True])
def test_two_ranks_train_like_one_device_accumulating(tmp_path, pack_steps):
    """Each step's 16 samples are split between the 2 ranks (evenly by positions); with the loss normalised by the
    step's loss tokens over both ranks, 2 ranks x micro 8 make the same updates as 1 device x micro 8 x accumulation 2 (global 16).
    With data.pack_steps each rank packs its own 8 samples: the ranks may run different numbers of micro-batches."""
    pack = ["--data.pack_steps", "true", "--train.micro_batch_size", "4"] if pack_steps else []
    one = _finetune(tmp_path / "one", "--devices", "1", "--train.micro_batch_size", "8", *pack)
    two = _finetune(tmp_path / "two", "--devices", "2", "--train.micro_batch_size", "8", *pack)
    assert [r["step"] for r in two] == [1, 2, 3, 4]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    result = json.loads((tmp_path / "two" / "result.json").read_text())
    assert result["batch"]["devices"] == 2 and result["batch"]["grad_accum"] == (2 if pack_steps else 1)
    # real tokens are summed over both ranks: the same samples as the single device
    single = json.loads((tmp_path / "one" / "result.json").read_text())
    assert result["throughput"]["tokens_real"] == single["throughput"]["tokens_real"]


def test_two_ranks_reading_each_loss_a_step_late_train_like_one_device(tmp_path):
    """With a fused optimizer each rank reads step N's loss (all-reduced over the ranks) after step N+1's forward and
    backward are queued, the update told to skip itself through found_inf: 2 ranks still make the updates of 1
    device accumulating 2 micro-batches, and every step is logged once, in order."""
    fused = ["--optimizer.fused", "true"]
    one = _finetune(tmp_path / "one", "--devices", "1", "--train.micro_batch_size", "8", *fused)
    two = _finetune(tmp_path / "two", "--devices", "2", "--train.micro_batch_size", "8", *fused)
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3, 4]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    for run in ("one", "two"):
        result = json.loads((tmp_path / run / "result.json").read_text())
        assert result["loss_read"] == "a step late" and result["optimizer"]["implementation"] == "fused"


def test_two_ranks_spawned_from_python_return_the_figures(tmp_path):
    """From Python (a notebook) Fabric spawns the ranks; rank 0's figures come back, the model stays on disk."""
    import litft

    recipe = litft.load_recipe(
        "demo", devices=2, accelerator="cpu", out_dir=str(tmp_path / "run"),
        train={"micro_batch_size": 8, "global_batch_size": 16, "max_steps": 3},
        eval={"initial": False, "interval": 0}, logging={"progress": "none", "tensorboard": False},
        data={"num_workers": 0},
    )
    run = litft.finetune(recipe)
    assert run.status == "ok" and run.result["steps"] == 3 and run.result["batch"]["devices"] == 2
    assert run.model is None and (run.out_dir / "final").is_dir()
    assert run.result["throughput"]["tokens_real"] > 0


def test_a_data_error_in_spawned_ranks_reaches_the_caller_with_its_exit_code(tmp_path):
    import litft
    from litft.errors import DataError

    data = tmp_path / "bad.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": \n')
    recipe = litft.load_recipe(
        "demo", devices=2, accelerator="cpu", out_dir=str(tmp_path / "run"),
        train={"micro_batch_size": 8, "global_batch_size": 16, "max_steps": 3},
        data={"path": str(data), "num_workers": 0}, logging={"progress": "none"},
    )
    with pytest.raises(DataError) as info:
        litft.finetune(recipe)
    assert info.value.exit_code == 5 and "bad.jsonl" in str(info.value) and "line 2" in str(info.value)


def test_the_cli_called_inside_another_program_spawns_its_ranks(tmp_path):
    """cli.main() inside a test runner (or a notebook) must not have Fabric re-run that program's command line as
    the other ranks: it spawns them, as finetune() from Python does."""
    from litft import strategy
    from litft.cli import main

    code = main(["finetune", "--config", "demo", "--accelerator", "cpu", "--devices", "2",
                 "--train.micro_batch_size", "8", "--train.global_batch_size", "16", "--train.max_steps", "2",
                 "--eval.initial", "false", "--eval.interval", "0", "--logging.progress", "none",
                 "--data.num_workers", "0", "--out_dir", str(tmp_path / "run")])
    assert code == 0 and not strategy.LAUNCHED_FROM_CLI
    assert json.loads((tmp_path / "run" / "result.json").read_text())["batch"]["devices"] == 2
