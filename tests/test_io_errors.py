"""Every write litft makes fails the same way: exit 6 and one message naming what was being written, the path, the
OS reason and what to try; no traceback, and nothing partial left behind (no *.tmp, a result.json whole or absent).

The tests run as root, where permissions do not stop a write: full, read-only and forbidden disks are simulated by
raising the OSError the system would raise."""

from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from litft import files, metrics, sweep
from litft.cli import main
from litft.recipe import recipe_to_yaml

RUNS = Path(__file__).parent / "fixtures" / "runs"
FAST = dict(
    eval={"initial": False, "final": False, "interval": 0},
    train={"global_batch_size": 8, "micro_batch_size": 4, "max_steps": 2, "warmup_steps": 1},
    logging={"progress": "plain", "tensorboard": False, "interval": 1},
)


def oserror(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def finetune(tiny_recipe, tmp_path: Path, out_dir: Path, capsys, **overrides) -> tuple[int, str]:
    """`litft finetune` of the tiny recipe through the CLI: (exit code, everything it printed)."""
    settings = {**FAST, **overrides}
    config = tmp_path / "recipe.yaml"
    config.write_text(recipe_to_yaml(tiny_recipe(**settings)), encoding="utf-8")
    code = main(["finetune", "--config", str(config), "--out_dir", str(out_dir)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def assert_one_message(code: int, output: str, *parts: str) -> str:
    """Exit 6, the message on one line of its own with every part in it, and no traceback."""
    assert "Traceback" not in output, output
    assert code == 6, output
    message = next(line for line in output.splitlines() if "I/O error" in line or "checkpoint error" in line)
    for part in parts:
        assert part in message, f"{part!r} missing from: {message}"
    return message


def assert_nothing_partial(folder: Path) -> None:
    leftovers = [p for p in folder.rglob("*") if p.name.endswith(".tmp") or ".tmp-" in p.name]
    assert not leftovers, leftovers
    result = folder / "result.json"
    if result.exists():
        json.loads(result.read_text(encoding="utf-8"))  # whole


def fail_writes_to(monkeypatch, name: str, code: int) -> None:
    """Path.write_text raises ``code`` for the file ``name`` (its temporary file beside it included)."""
    real = Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name == name or self.name.startswith(name + "."):
            raise oserror(code)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)


# ----------------------------------------------------------------------------------------------------------------------
# The out_dir
# ----------------------------------------------------------------------------------------------------------------------


def test_an_out_dir_that_is_a_file(tiny_recipe, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("not a folder\n")
    code, output = finetune(tiny_recipe, tmp_path, taken, capsys)
    assert_one_message(code, output, f"'{taken}'", "File exists", "It is a file where a folder belongs",
                       "set out_dir to another folder")
    assert taken.read_text() == "not a folder\n"
    assert "litft: lora fine-tune" not in output  # refused before anything ran


def test_an_out_dir_under_a_file(tiny_recipe, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("not a folder\n")
    code, output = finetune(tiny_recipe, tmp_path, taken / "run", capsys)
    assert_one_message(code, output, f"'{taken / 'run'}'", "Not a directory", f"'{taken}' is a file")
    assert taken.read_text() == "not a folder\n"


@pytest.mark.parametrize("code_, exists, reason", [
    (errno.EROFS, True, "Read-only file system"),
    (errno.EACCES, False, "Permission denied"),
])
def test_a_read_only_out_dir_is_refused_before_the_run(tiny_recipe, tmp_path, capsys, monkeypatch, code_, exists,
                                                        reason):
    locked = tmp_path / "locked"  # nothing can be created in it
    out_dir = locked / "run"
    out_dir.mkdir(parents=True) if exists else locked.mkdir()
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        if Path(path).parent in (locked, out_dir):
            raise oserror(code_)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    code, output = finetune(tiny_recipe, tmp_path, out_dir, capsys)
    assert_one_message(code, output, f"'{out_dir}'", "into out_dir", reason, "Set out_dir to a folder")
    assert "litft: lora fine-tune" not in output
    if exists:
        assert list(out_dir.iterdir()) == []  # the probe left nothing
    else:
        assert not out_dir.exists()


def test_a_config_yaml_that_cannot_be_written(tiny_recipe, tmp_path, capsys, monkeypatch):
    fail_writes_to(monkeypatch, "config.yaml", errno.EROFS)
    out_dir = tmp_path / "run"
    code, output = finetune(tiny_recipe, tmp_path, out_dir, capsys)
    assert_one_message(code, output, f"'{out_dir / 'config.yaml'}'", "Read-only file system")
    assert_nothing_partial(out_dir)
    assert not (out_dir / "config.yaml").exists()


# ----------------------------------------------------------------------------------------------------------------------
# A full disk at each write of a run
# ----------------------------------------------------------------------------------------------------------------------


def test_a_disk_that_fills_at_the_final_save(tiny_recipe, tmp_path, capsys, monkeypatch):
    import torch

    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if "lit_model.pth" in str(getattr(f, "name", f)):
            f.write(b"part of the weights")
            raise oserror(errno.ENOSPC)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    out_dir = tmp_path / "run"
    code, output = finetune(tiny_recipe, tmp_path, out_dir, capsys)
    assert_one_message(code, output, "the final weights", f"'{out_dir / 'final' / 'lit_model.pth.lora'}'",
                       "No space left on device", "free). Free space on that disk")
    assert not (out_dir / "final").exists()  # no config without its weights
    assert_nothing_partial(out_dir)
    assert json.loads((out_dir / "result.json").read_text())["status"] == "failed"


def test_a_disk_too_full_for_the_final_weights_says_how_much_is_needed(tiny_recipe, tmp_path, capsys, monkeypatch):
    free = shutil.disk_usage(tmp_path)._replace(free=1000)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: free)
    out_dir = tmp_path / "run"
    code, output = finetune(tiny_recipe, tmp_path, out_dir, capsys, method="full")
    message = assert_one_message(code, output, "not enough disk space for the final weights", f"'{out_dir}'",
                                 "MiB are free", "Free space on that disk")
    assert "0.00 GiB" not in message
    assert not (out_dir / "final").exists()
    assert_nothing_partial(out_dir)


def test_final_weights_bytes_counts_what_save_final_writes(tiny_recipe):
    from litft.checkpoint import final_weights_bytes
    from litft.model import model_config

    full, lora = tiny_recipe(method="full"), tiny_recipe(method="lora")
    full_bytes, lora_bytes = final_weights_bytes(full, model_config(full)), final_weights_bytes(lora, model_config(lora))
    weights = sum(t.numel() * 4 for t in __import__("torch").load(
        Path(full.model.checkpoint_dir) / "lit_model.pth", weights_only=True).values())  # 32-true: 4 bytes each
    assert full_bytes - lora_bytes > 0.9 * weights and full_bytes > weights


def test_a_disk_that_fills_at_result_json(tiny_recipe, tmp_path, capsys, monkeypatch):
    fail_writes_to(monkeypatch, "result.json", errno.ENOSPC)
    out_dir = tmp_path / "run"
    code, output = finetune(tiny_recipe, tmp_path, out_dir, capsys)
    assert_one_message(code, output, "result.json", f"'{out_dir / 'result.json'}'", "No space left on device")
    assert not (out_dir / "result.json").exists()
    assert_nothing_partial(out_dir)


def test_a_disk_that_fills_at_metrics_jsonl(tiny_recipe, tmp_path, capsys, monkeypatch):
    class FillsUp:
        """metrics.jsonl on a disk that takes the first row and half of the second."""

        def __init__(self, file):
            self.file, self.rows = file, 0

        def write(self, text):
            self.rows += 1
            if self.rows == 2:
                self.file.write(text[: len(text) // 2])
                self.file.flush()
                raise oserror(errno.ENOSPC)
            return self.file.write(text)

        def __getattr__(self, name):
            return getattr(self.file, name)

    monkeypatch.setattr(metrics, "open", lambda *a, **k: FillsUp(builtins.open(*a, **k)), raising=False)
    out_dir = tmp_path / "run"
    code, output = finetune(tiny_recipe, tmp_path, out_dir, capsys)
    assert_one_message(code, output, "the metrics log", f"'{out_dir / 'metrics.jsonl'}'", "No space left on device")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1]  # the half row is cut off
    assert_nothing_partial(out_dir)
    assert json.loads((out_dir / "result.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("when", ["creation", "write"])
def test_tensorboard_that_cannot_write(tiny_recipe, tmp_path, capsys, monkeypatch, when):
    import torch.utils.tensorboard as tensorboard

    class Writer(tensorboard.SummaryWriter):
        def __init__(self, *args, **kwargs):
            if when == "creation":
                raise oserror(errno.EROFS)
            super().__init__(*args, **kwargs)

        def add_scalar(self, *args, **kwargs):
            raise oserror(errno.ENOSPC)

    monkeypatch.setattr(tensorboard, "SummaryWriter", Writer)
    out_dir = tmp_path / "run"
    code, output = finetune(tiny_recipe, tmp_path, out_dir, capsys,
                            logging={**FAST["logging"], "tensorboard": True})
    reason = "Read-only file system" if when == "creation" else "No space left on device"
    assert_one_message(code, output, "the TensorBoard log", f"'{out_dir / 'tensorboard'}'", reason,
                       "logging.tensorboard false")
    assert_nothing_partial(out_dir)


# ----------------------------------------------------------------------------------------------------------------------
# The sweep's tables and the charts
# ----------------------------------------------------------------------------------------------------------------------


def test_a_disk_that_fills_at_a_sweep_table(tmp_path, capsys, monkeypatch):
    def run(command, **kwargs):  # each run "finishes" at once with the fixture's result
        run_dir = Path(command[command.index("--out_dir") + 1])
        shutil.copy(RUNS / "cpu-demo" / "result.json", run_dir / "result.json")
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(sweep.subprocess, "run", run)
    fail_writes_to(monkeypatch, "sweep.md", errno.ENOSPC)
    out = tmp_path / "sweep"
    code = main(["sweep", "--config", "demo", "--grid", "train.micro_batch_size=8", "--out", str(out)])
    captured = capsys.readouterr()
    assert_one_message(code, captured.out + captured.err, "the sweep's table", f"'{out / 'sweep.md'}'",
                       "No space left on device", "set --out to a folder on another disk")
    assert not (out / "sweep.md").exists()
    assert_nothing_partial(out)


@pytest.mark.parametrize("failure", ["full disk", "a file in the way"])
def test_a_chart_that_cannot_be_written(tmp_path, capsys, monkeypatch, failure):
    plots = tmp_path / "plots"
    if failure == "full disk":
        from matplotlib.figure import Figure

        def savefig(self, path, **kwargs):
            Path(path).write_bytes(b"\x89PNG part")
            raise oserror(errno.ENOSPC)

        monkeypatch.setattr(Figure, "savefig", savefig)
        parts = ("the chart", f"'{plots / 'tokens_per_sec.png'}'", "No space left on device")
    else:
        plots.write_text("a file\n")
        parts = (f"'{plots}'", "It is a file where a folder belongs", "set --plot to another folder")
    code = main(["compare", str(RUNS / "cpu-demo"), "--plot", str(plots)])
    captured = capsys.readouterr()
    assert_one_message(code, captured.out + captured.err, *parts)
    if plots.is_dir():
        assert list(plots.iterdir()) == []


def test_a_failed_write_after_another_reports_the_first(tmp_path):
    """A failed run's result.json on the disk that just failed its final weights: one message, the cause first."""
    with pytest.raises(files.WriteError) as info:
        try:
            with files.writing("the final weights", tmp_path / "final"):
                raise oserror(errno.ENOSPC)
        finally:
            files.write_text_atomic(tmp_path / "missing" / "result.json", "{}")
    message = str(info.value)
    assert message.startswith(f"cannot write the final weights '{tmp_path / 'final'}': No space left on device")
    assert "Then result.json" in message and "could not be written either" in message
    assert isinstance(info.value, OSError) and info.value.exit_code == 6
