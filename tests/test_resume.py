"""Training that survives: committed checkpoints, exact resume, and one clear exit code per kind of failure."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import litft
from litft.checkpoint import committed_checkpoints, load_checkpoint
from litft.errors import CheckpointError, ConfigError, NonFiniteLossError, OutOfMemoryError


def _rows(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _resumable(tiny_recipe, method, train=None, **extra):
    # 72 training samples / micro 4 = 18 micro-batches = 9 steps of accumulation 2 per epoch; 12 steps cross it
    settings = dict(
        method=method,
        lora={"r": 4, "alpha": 8, "dropout": 0.1, "targets": ["q", "v", "mlp"]},
        optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-3}},
        eval={"initial": False, "final": False, "interval": 0},
        data={"val_split": 0.1, "max_seq_length": 128},
    )
    settings.update(extra)
    train_settings = {"max_steps": 12, "epochs": 2, "save_interval": 1, "keep_last_n": 20, "micro_batch_size": 4,
                      "global_batch_size": 8, **(train or {})}
    return tiny_recipe(train=train_settings, **settings)


@pytest.mark.parametrize("method,pack_steps", [("full", False), ("lora", False), ("lora", True)])
def test_resume_reproduces_the_uninterrupted_run_exactly(tiny_recipe, tmp_path, method, pack_steps):
    data = {"val_split": 0.1, "max_seq_length": 128, "pack_steps": pack_steps}
    recipe = _resumable(tiny_recipe, method, data=data)
    whole = litft.finetune(recipe)
    assert whole.result["batch"]["grad_accum"] == 2
    reference_rows = _rows(whole.out_dir)
    reference_weights = {k: v.clone() for k, v in whole.model.state_dict().items()}
    assert len(committed_checkpoints(whole.out_dir)) == 12
    steps_per_epoch = 9

    for k in (4, steps_per_epoch):  # mid-epoch, and exactly at the epoch boundary
        out_dir = tmp_path / f"resume-{k}"
        shutil.copytree(whole.out_dir, out_dir)
        checkpoint = out_dir / "checkpoints" / f"step-{k:06d}"
        again = litft.finetune(_resumable(tiny_recipe, method, out_dir=str(out_dir), data=data), resume=str(checkpoint))
        rows = _rows(out_dir)
        assert [r["step"] for r in rows] == list(range(1, 13))  # no step twice, none missing
        assert [r["loss"] for r in rows] == [r["loss"] for r in reference_rows]  # exact, on the CPU
        for name, value in again.model.state_dict().items():
            assert torch.equal(value, reference_weights[name]), f"{name} differs after resuming at step {k}"


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_and_resume_auto_skips_the_partial_one(
    tiny_checkpoint_dir, tiny_data_path, tmp_path
):
    out_dir = tmp_path / "run"
    args = [
        sys.executable, "-m", "litft.cli", "finetune", "--model.checkpoint_dir", str(tiny_checkpoint_dir),
        "--accelerator", "cpu", "--precision", "32-true", "--method", "full", "--data.path", str(tiny_data_path),
        "--data.max_seq_length", "128", "--data.num_workers", "0", "--train.global_batch_size", "8",
        "--train.epochs", "2",
        "--train.micro_batch_size", "4", "--train.max_steps", "6", "--train.save_interval", "2",
        "--eval.initial", "false", "--eval.interval", "0", "--logging.progress", "plain", "--out_dir", str(out_dir),
    ]
    env = {**os.environ, "LITFT_TEST_SAVE_DELAY": "5"}  # the window the kill lands in
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    proc = subprocess.Popen(args[:4] + ["--config", str(config)] + args[4:], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.time() + 1200  # a guard against a hang: a loaded machine starts the run slowly
    partial = []
    while time.time() < deadline and proc.poll() is None:
        partial = list((out_dir / "checkpoints").glob(".tmp-step-000004-*")) if (out_dir / "checkpoints").is_dir() else []
        if partial:
            break
        time.sleep(0.1)
    assert partial, "the run never reached its step-4 save"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert [p.name for p in committed_checkpoints(out_dir)] == ["step-000002"]
    assert list((out_dir / "checkpoints").glob(".tmp-step-*"))  # the killed save's debris is there

    resumed = subprocess.run(args[:4] + ["--config", str(config)] + args[4:] + ["--resume", "auto"],
                             capture_output=True, text=True, timeout=1800)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "step-000002" in resumed.stdout
    assert [r["step"] for r in _rows(out_dir)] == [1, 2, 3, 4, 5, 6]
    assert not list((out_dir / "checkpoints").glob(".tmp-step-*"))  # cleaned by the next committed save


def test_a_corrupt_or_truncated_checkpoint_is_named_with_the_reason(tiny_recipe, tmp_path):
    recipe = _resumable(tiny_recipe, "full", train={"max_steps": 2, "save_interval": 1})
    litft.finetune(recipe)
    step1 = committed_checkpoints(recipe_out := litft.recipe.resolve_path(recipe.out_dir))[0]
    weights = step1 / "trainable.pth"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="trainable.pth' is truncated or altered"):
        litft.finetune(recipe, resume=str(step1))
    (step1 / "COMMIT.json").unlink()
    with pytest.raises(CheckpointError, match="has no COMMIT.json: the save did not finish"):
        litft.finetune(recipe, resume=str(step1))
    assert recipe_out.is_dir()


def test_resuming_with_a_changed_setting_that_matters_is_refused_with_the_difference(tiny_recipe, tmp_path):
    recipe = _resumable(tiny_recipe, "lora", train={"max_steps": 2, "save_interval": 1})
    litft.finetune(recipe)
    changed = _resumable(tiny_recipe, "lora", train={"max_steps": 2, "save_interval": 1},
                         lora={"r": 8, "alpha": 8, "dropout": 0.1, "targets": ["q", "v", "mlp"]})
    with pytest.raises(ConfigError) as info:
        litft.finetune(changed, resume="auto")
    assert any("lora: checkpoint" in p and "'r': 4" in p and "'r': 8" in p for p in info.value.problems)


def test_resume_auto_without_a_checkpoint_starts_the_run_from_the_beginning(tiny_recipe, tmp_path, capsys):
    """--resume auto as LitGPT means it: the newest committed checkpoint if there is one, else the run from its
    start, said so. It needs no --overwrite for an out_dir holding this recipe's own run that stopped before its
    first checkpoint; an out_dir holding another recipe's run is still refused."""
    no_saves = {"max_steps": 2, "save_interval": None}
    fresh = _resumable(tiny_recipe, "lora", out_dir=str(tmp_path / "empty"), train=no_saves)
    result = litft.finetune(fresh, resume="auto")
    assert result.status == "ok" and result["steps"] == 2
    assert "no committed checkpoint" in capsys.readouterr().out
    # the same recipe's out_dir, no checkpoint in it (save_interval unset): restarted, not refused
    again = litft.finetune(fresh, resume="auto")
    assert again.status == "ok" and again["losses"] == result["losses"]
    other = _resumable(tiny_recipe, "full", out_dir=str(tmp_path / "empty"), train=no_saves)
    with pytest.raises(ConfigError, match="already holds a run"):
        litft.finetune(other, resume="auto")


def test_non_finite_loss_stops_before_the_update_with_step_and_rank(tiny_recipe):
    recipe = tiny_recipe(
        method="full", optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 1e30}},
        train={"max_steps": 4, "save_interval": 1, "max_grad_norm": None}, eval={"initial": False, "interval": 0},
    )
    with pytest.raises(NonFiniteLossError) as info:
        litft.finetune(recipe)
    message = str(info.value)
    assert info.value.exit_code == 3
    assert "at step 2 (rank 0)" in message and "weights are those of step 1" in message
    out_dir = litft.recipe.resolve_path(recipe.out_dir)
    assert [p.name for p in committed_checkpoints(out_dir)] == ["step-000001"]  # no checkpoint of the bad state


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_non_finite_step_read_after_its_update_was_launched_changes_no_weights(tiny_recipe, tmp_path, monkeypatch,
                                                                                 device):
    """A fused optimizer lets the loop read step N's loss after launching step N's update (which skips itself on
    the device through found_inf) and step N+1's forward and backward: the run still stops at step 2 with the
    weights of step 1, those a run that reads every step at once saved at step 1 (on CUDA: bf16-true, the step's
    numbers copied to the host behind an event, the micro-batches replayed as CUDA graphs)."""
    import litft.train.loop as loop

    def recipe(save_interval):
        return tiny_recipe(
            method="full", optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 1e30, "fused": True}},
            out_dir=str(tmp_path / f"save-{save_interval}"), accelerator=device,
            precision="bf16-true" if device == "cuda" else "32-true",
            train={"max_steps": 4, "save_interval": save_interval, "max_grad_norm": None},
            eval={"initial": False, "interval": 0},
        )

    with pytest.raises(NonFiniteLossError):  # a save every step: every step read at once
        litft.finetune(recipe(save_interval=1))
    saved = load_checkpoint(committed_checkpoints(litft.recipe.resolve_path(recipe(1).out_dir))[0])["trainable"]

    seen = {}
    real_fit = loop.fit

    def fit(run, *args, **kwargs):
        seen["model"], seen["optimizer"] = run.model, run.optimizer
        return real_fit(run, *args, **kwargs)

    monkeypatch.setattr(loop, "fit", fit)
    with pytest.raises(NonFiniteLossError) as info:
        litft.finetune(recipe(save_interval=None))
    assert "at step 2 (rank 0)" in str(info.value) and "weights are those of step 1" in str(info.value)
    inner = getattr(seen["optimizer"], "optimizer", seen["optimizer"])
    assert float(inner.found_inf) == 1.0  # the update of step 2 was launched, told to skip itself
    weights = dict(loop.unwrap(seen["model"]).named_parameters())
    assert saved and all(torch.equal(weights[name].detach().cpu(), value) for name, value in saved.items())


def test_a_step_read_late_logs_what_a_step_read_at_once_logs(tiny_recipe, tmp_path):
    """The rows of metrics.jsonl are the same whether each step's numbers are read a step late (a fused optimizer,
    no saves) or at once (the same optimizer, a save every step): loss, lr, gradient norm, epoch, tokens, per step."""
    def run(save_interval):
        return litft.finetune(tiny_recipe(
            method="lora", optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-3, "fused": True}},
            train={"max_steps": 4, "save_interval": save_interval, "keep_last_n": 10},
            eval={"initial": False, "interval": 0}, logging={"interval": 1},
            out_dir=str(tmp_path / f"save-{save_interval}"),
        ))

    late, at_once = run(None), run(1)
    assert late["loss_read"] == at_once["loss_read"] == "a step late"  # the optimizer's way; saves read at once
    keys = ("step", "loss", "lr", "grad_norm", "epoch", "tokens_real")
    rows = []
    for r in (late, at_once):
        logged = [json.loads(line) for line in (r.out_dir / "metrics.jsonl").read_text().splitlines()]
        rows.append([{k: row[k] for k in keys} for row in logged if "loss" in row])
    assert [row["step"] for row in rows[0]] == [1, 2, 3, 4]  # steps 1-3 read late in the first run
    assert rows[0] == rows[1]


def test_data_errors_exit_5_with_file_and_line_before_anything_is_written(tiny_checkpoint_dir, tmp_path, capsys):
    from litft.cli import main

    data = tmp_path / "bad.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": \n')
    out_dir = tmp_path / "run"
    code = main(["finetune", "--config", "demo", "--model.checkpoint_dir", str(tiny_checkpoint_dir),
                 "--data.path", str(data), "--data.max_seq_length", "128", "--out_dir", str(out_dir)])
    err = capsys.readouterr().err
    assert code == 5
    assert "bad.jsonl" in err and "line 2" in err
    assert not out_dir.exists()


def test_out_of_memory_exits_4_naming_the_batch_and_what_would_help(tiny_recipe, monkeypatch, capsys):
    from litft.model import CausalLM

    def exhausted(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(CausalLM, "forward", exhausted)
    recipe = tiny_recipe(method="full", eval={"initial": False})
    with pytest.raises(OutOfMemoryError) as info:
        litft.finetune(recipe)
    message = str(info.value)
    assert info.value.exit_code == 4
    assert "micro_batch_size 4" in message and "max_seq_length 96" in message and "precision 32-true" in message
    assert "train.micro_batch_size 2" in message and "activation_checkpointing" in message


def test_out_of_memory_while_loading_the_model_exits_4(tiny_recipe, monkeypatch):
    import litft.train.setup as setup

    def exhausted(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 26.00 GiB")

    monkeypatch.setattr(setup, "build_model", exhausted)
    with pytest.raises(OutOfMemoryError) as info:
        litft.finetune(tiny_recipe(method="full", precision="32-true"))
    assert info.value.exit_code == 4
    assert "micro_batch_size 4" in str(info.value) and "Tried to allocate 26.00 GiB" in str(info.value)


def test_a_full_disk_fails_the_save_with_exit_6_and_keeps_the_previous_checkpoint(tiny_recipe, monkeypatch):
    import litft.checkpoint as ckpt

    real_save = torch.save
    calls = {"n": 0}

    def save(obj, path, *args, **kwargs):
        if ".tmp-step-000002" in str(path):
            calls["n"] += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save)
    recipe = _resumable(tiny_recipe, "full", train={"max_steps": 3, "save_interval": 1})
    with pytest.raises(CheckpointError) as info:
        litft.finetune(recipe)
    assert info.value.exit_code == 6 and "No space left on device" in str(info.value)
    out_dir = litft.recipe.resolve_path(recipe.out_dir)
    assert [p.name for p in committed_checkpoints(out_dir)] == ["step-000001"]
    assert not list((out_dir / "checkpoints").glob(".tmp-*"))
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    assert ckpt.load_checkpoint(committed_checkpoints(out_dir)[0])["commit"]["step"] == 1


def test_a_field_added_since_the_checkpoint_compares_as_what_its_absence_meant(tiny_recipe):
    from litft.checkpoint import resume_differences
    from litft.recipe import recipe_to_dict

    recipe = tiny_recipe(train={"max_grad_norm": None}, data={"pack_steps": False})
    saved = recipe_to_dict(recipe)
    del saved["data"]["pack_steps"]  # a checkpoint written before data.pack_steps existed: micro-batches by samples
    del saved["data"]["mask_prompt"]  # any other missing field compares as its default (True, as now)
    assert resume_differences(saved, recipe) == ([], [])  # and a saved null (max_grad_norm) stays null
    # pack_steps is on by default now: resuming such a checkpoint with the defaults would change the data order
    refuse, _ = resume_differences(saved, tiny_recipe(train={"max_grad_norm": None}))
    assert refuse == ["data.pack_steps: checkpoint False, now True"]
