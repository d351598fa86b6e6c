"""What the `litft` command prints: one verdict per command, every option listed in its help, no foreign log noise,
and one number style (litft.units) across the summary, `litft estimate` and `litft ls`."""

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from litft.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_validate_check_files_prints_one_verdict(capsys):
    assert main(["validate", "open-llama-7b-lora", "--check-files"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "valid:" not in err
    assert err.startswith("litft validate: config error: open-llama-7b-lora: model.checkpoint_dir:")
    # without --check-files the files are notes under the verdict valid
    assert main(["validate", "open-llama-7b-lora"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("valid: open-llama-7b-lora\n") and err == ""
    assert "note (files; --check-files makes it an error): model.checkpoint_dir:" in out
    assert main(["validate", "demo", "--check-files"]) == 0
    assert capsys.readouterr().out.startswith("valid: demo (and the files it names)\n")


def test_finetune_help_lists_resume_and_overwrite(capsys):
    assert main(["finetune", "--help"]) == 0
    out = capsys.readouterr().out
    run_options = out[out.index("the run (options of litft finetune, not recipe keys):"):]
    assert re.search(r"^  --overwrite +Replace the run already in out_dir", run_options, re.M)
    assert re.search(r"^  --resume auto\|CHECKPOINT\n +Continue from a committed checkpoint", run_options, re.M)


def test_estimate_prints_no_bitsandbytes_cpu_kernel_warning():
    """`what_would_fit` checks bitsandbytes' 8-bit AdamW, which imports bitsandbytes; on a CPU with AVX512-BF16 its
    import logs a warning about an optional CPU kernel, which litft drops."""
    code = ("import sys; from litft.cli import main\n"
            "assert main(['estimate', '--config', 'open-llama-13b-full', '--gpu-memory', '80']) == 0\n"
            "assert 'bitsandbytes' in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "does NOT fit in 80.00 GiB" in proc.stdout
    assert "gemm_4bit_forward" not in proc.stderr and "kernels-community" not in proc.stderr


def test_only_the_cpu_kernel_notice_of_bitsandbytes_is_dropped():
    import litft.recipe  # noqa: F401  (installs the filter)

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")

    def record(message):
        return logging.LogRecord(logger.name, logging.WARNING, __file__, 1, message, None, None)

    assert not logger.filter(record("Failed to load CPU gemm_4bit_forward from kernels-community: no module"))
    assert logger.filter(record("Failed to load something else"))


def _summary_result(**memory):
    return {
        "status": "ok", "model": {"name": "tiny-llama-1.1b"}, "recipe": {"method": "lora", "precision": "bf16-true"},
        "batch": {"arithmetic": "micro_batch_size 4 x accumulation 4 x devices 1 = global_batch_size 16"},
        "parameters": {"trainable": 13_015_900, "total": 1_100_048_384},
        "steps": 1200, "epochs_completed": 1.0,
        "losses": {"train_first": 2.3, "train_last": 1.23456, "val_initial": None, "val_final": 1.5},
        "throughput": {"tokens_per_sec": 724.697, "padded_tokens_per_sec": 1021.4, "tokens_per_sec_per_device": 724.697,
                       "mfu": 0.4123, "median_step_time_s": 0.2345, "padding_fraction": 0.0512, "steady_state": True},
        "memory": {"peak_allocated_gib": None, "host_peak_rss_gib": 0.5, "predicted": None, **memory},
        "phases_s": {"train": 12.3}, "out_dir": "out/run",
    }


def test_the_summary_and_the_progress_line_use_one_number_style(capsys):
    from litft.progress import Progress, print_summary

    print_summary(_summary_result(predicted={"total_gib": 0.0466, "tokens": 896}))
    out = capsys.readouterr().out
    assert "13.0M trainable of 1.10B" in out
    assert "725  (padded: 1,021)" in out and "724.697" not in out
    assert "2.3000 -> 1.2346" in out and "n/a -> 1.5000" in out
    assert "41.2%" in out and "5.1% of positions" in out and "1,200 / 1.00" in out
    assert "host peak RSS 0.50 GiB" in out
    assert "47.7 MiB reserved for micro-batches of 896 positions" in " ".join(out.replace("│", " ").split())
    Progress("plain", total_steps=10, enabled=True).update(5, loss=2.0, tok_s=724.697, gib=0.05, lr=1e-4)
    line = capsys.readouterr().out
    assert "| 725 tok/s | 51.2 MiB |" in line


def test_estimate_and_ls_print_the_same_figure_sized_for_the_same_positions(capsys):
    """`litft estimate` lists the parts in one style and ends with a total; `litft ls` shows that total with the
    positions per micro-batch it is sized for."""
    assert main(["estimate", "--config", "open-llama-13b-full"]) == 0
    out = capsys.readouterr().out
    assert "for micro-batches of 512 positions (micro_batch_size 1 x max_seq_length 512)" in out
    assert "13.0B params x 2 B" in out and "13.0B trainable x 2 B" in out and "13015" not in out
    assert not re.search(r"\b\d+\.\d{3}B\b", out)  # no parameter count with three decimals
    last = [line for line in out.splitlines() if line.startswith("  =")][-1]
    total = re.fullmatch(r"  = on the device +(\d+\.\d\d GiB)   with the CUDA context \(~0\.50 GiB\)", last)
    assert total, last
    assert main(["ls", "--model", "open_llama_13b", "--method", "full"]) == 0
    ls = capsys.readouterr().out
    assert f"{total.group(1)} (512)" in ls


def test_matplotlib_is_a_dependency_and_compare_plots(tmp_path):
    """`litft compare --plot` works after `pip install litft`; the plot and test extras still resolve."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(re.match(r"matplotlib\b", dep) for dep in project["dependencies"])
    assert {"plot", "test"} <= set(project["optional-dependencies"])
    runs = REPO / "tests" / "fixtures" / "runs" / "cpu-demo"
    assert main(["compare", str(runs), "--plot", str(tmp_path / "plots")]) == 0
    assert list((tmp_path / "plots").glob("*.png"))
