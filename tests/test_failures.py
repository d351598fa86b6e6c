"""Settings that cannot work fail before the model is built, with their exit code and one message (no traceback):
weights that do not fit their model_config.yaml, a sequence longer than the model's block, a split that leaves too
little data; and a resumed run reports the validation loss its run started from."""

import json
import shutil

import pytest
import torch
import yaml

import litft
from litft.cli import main


def _finetune(args, capsys):
    code = main(["finetune", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_weights_that_do_not_fit_their_model_config_exit_6_naming_the_shapes(tiny_checkpoint_dir, tiny_data_path,
                                                                               tmp_path, capsys):
    """A model_config.yaml whose sizes differ from the weights beside it (n_embd here): exit 6, one message naming
    the file, a weight whose shape differs and what to do; not torch's state_dict traceback."""
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_checkpoint_dir, checkpoint)
    config = yaml.safe_load((checkpoint / "model_config.yaml").read_text())
    config["n_embd"] = 64
    (checkpoint / "model_config.yaml").write_text(yaml.safe_dump(config))
    code, out, err = _finetune(["--config", "demo", "--model.checkpoint_dir", str(checkpoint), "--data.path",
                                str(tiny_data_path), "--data.max_seq_length", "96", "--train.max_steps", "1",
                                "--out_dir", str(tmp_path / "run")], capsys)
    assert code == 6, err
    assert "lit_model.pth" in err and "differ in shape" in err and "model_config.yaml" in err
    assert "Traceback" not in err + out and len(err.strip().splitlines()) == 1


def test_a_sequence_longer_than_the_models_block_exits_2_before_anything_is_written(tiny_checkpoint_dir,
                                                                                     tiny_data_path, tmp_path,
                                                                                     capsys):
    """data.max_seq_length above the model's block_size (128 for the tiny model): the rotary tables end there, so
    a longer sample would fail mid-run; refused at once, naming both numbers."""
    out_dir = tmp_path / "run"
    code, out, err = _finetune(["--config", "demo", "--model.checkpoint_dir", str(tiny_checkpoint_dir),
                                "--data.path", str(tiny_data_path), "--data.max_seq_length", "129",
                                "--out_dir", str(out_dir)], capsys)
    assert code == 2
    assert "data.max_seq_length: 129" in err and "block_size 128" in err and "use at most 128" in err
    assert "Traceback" not in err and not out_dir.exists()


def test_a_split_that_leaves_too_little_training_data_exits_5_naming_the_split_before_the_model(
        tiny_checkpoint_dir, tiny_data_path, tmp_path, capsys):
    """data.val_split so large that the training set cannot fill one micro-batch: exit 5 before the model is built
    or anything written, and the message names the split that did it."""
    out_dir = tmp_path / "run"
    code, out, err = _finetune(["--config", "demo", "--model.checkpoint_dir", str(tiny_checkpoint_dir),
                                "--data.path", str(tiny_data_path), "--data.max_seq_length", "96",
                                "--data.val_split", "0.99", "--out_dir", str(out_dir)], capsys)
    assert code == 5, err
    assert "training set" in err and "data.val_split 0.99" in err and "micro-batch" in err
    assert "model:" not in out and not out_dir.exists() and "Traceback" not in err


def test_a_resumed_run_reports_the_val_loss_its_run_started_from(tiny_recipe, tmp_path):
    """A run resumed from a checkpoint does not evaluate 'before training' again: result.json's val_initial is the
    loss the run started from, as in the run that was not interrupted."""
    common = dict(method="lora", eval={"initial": True, "final": True, "interval": 0},
                  train={"max_steps": 4, "save_interval": 2})
    whole = litft.finetune(tiny_recipe(**common, out_dir=str(tmp_path / "whole")))
    out_dir = tmp_path / "resumed"
    shutil.copytree(whole.out_dir, out_dir)
    resumed = litft.finetune(tiny_recipe(**common, out_dir=str(out_dir)),
                             resume=str(out_dir / "checkpoints" / "step-000002"))
    assert resumed["losses"]["val_initial"] == whole["losses"]["val_initial"]
    saved = json.loads((out_dir / "result.json").read_text())["losses"]
    assert saved["val_initial"] == whole["losses"]["val_initial"]
    assert saved["val_final"] == pytest.approx(whole["losses"]["val_final"], rel=1e-6)
    assert torch.isfinite(torch.tensor(saved["val_final"]))


def test_a_damaged_tokenizer_exits_6_naming_the_key_and_the_folder(tiny_checkpoint_dir, tiny_data_path, tmp_path,
                                                                    capsys):
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{broken")
    code, out, err = _finetune(["--config", "demo", "--model.checkpoint_dir", str(tiny_checkpoint_dir),
                                "--model.tokenizer_dir", str(tokenizer), "--data.path", str(tiny_data_path),
                                "--data.max_seq_length", "96", "--out_dir", str(tmp_path / "run")], capsys)
    assert code == 6, err
    assert "model.tokenizer_dir" in err and str(tokenizer) in err and "Traceback" not in err + out


def test_too_little_disk_for_the_final_weights_exits_6_before_the_model_is_built(tiny_checkpoint_dir,
                                                                                  tiny_data_path, tmp_path,
                                                                                  monkeypatch, capsys):
    """The final weights' size is known from the model's shapes: a disk without room for them fails the run before
    the model is built or the out_dir made, with the sizes needed and free."""
    import litft.files as files

    monkeypatch.setattr(files, "free_bytes", lambda directory: 1024)
    out_dir = tmp_path / "run"
    code, out, err = _finetune(["--config", "demo", "--model.checkpoint_dir", str(tiny_checkpoint_dir),
                                "--data.path", str(tiny_data_path), "--data.max_seq_length", "96",
                                "--method", "full", "--out_dir", str(out_dir)], capsys)
    assert code == 6, err
    assert "not enough disk space for the final weights" in err and "1.0 KiB" not in err
    assert "model:" not in out and not out_dir.exists() and "Traceback" not in err


def test_cp_into_a_path_under_a_file_exits_6_and_a_checkpoint_dir_that_is_a_file_says_so(tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    assert main(["cp", "demo", str(blocker / "mine.yaml")]) == 6
    err = capsys.readouterr().err
    assert "is a file where a folder belongs" in err and "Traceback" not in err
    assert main(["validate", "demo", "--check-files", "--model.checkpoint_dir", str(blocker)]) == 2
    err = capsys.readouterr().err
    assert f"'{blocker}' is a file, not a checkpoint directory" in err and "does not exist" not in err


def test_ctrl_c_exits_130_with_one_line_and_a_result_that_says_failed(tmp_path):
    """An interrupted run (SIGINT, as Ctrl-C sends it) ends with exit 130 and one line, no traceback (DataLoader
    workers included), and its result.json says the run failed rather than looking like a result."""
    import signal
    import subprocess
    import sys
    import time

    out_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "litft.cli", "finetune", "--config", "demo", "--out_dir",
                             str(out_dir), "--train.epochs", "50", "--logging.progress", "plain"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # A shell that starts the tests in the background ignores SIGINT for them, and Python then
                            # keeps it ignored: give the run the disposition a terminal's foreground process has.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    metrics_log = out_dir / "metrics.jsonl"
    deadline = time.time() + 1200  # a guard against a hang: wait until a step has been logged (training has begun)
    while time.time() < deadline and proc.poll() is None and not (metrics_log.is_file() and metrics_log.stat().st_size):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=1200)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in out + err and "litft finetune: interrupted" in err
    assert json.loads((out_dir / "result.json").read_text())["status"] == "failed"
