"""benchmarks/ scripts against files a device call left on the H100, kept small under tests/fixtures/: recomputing a
recorded vs_litgpt call's table from its files gives back the figures it wrote (and adds the steady-state columns), and
kernel_diff.py sums a recorded profile by kind of kernel."""

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
# a recorded `benchmarks/vs_litgpt.py --only lora,qlora` call on the H100 (TinyLlama LoRA and QLoRA, commit 4c8e2d2):
# its vs_litgpt.json and, per run, what the rescoring reads (LitGPT's log and CSV, litft's log and result.json)
RECORDED = FIXTURES / "vs-litgpt-call"
# the kernel table of a profiled TinyLlama LoRA step (--logging.profile 20-21) on the H100, written by a litft that
# still listed the optimizer's record_function range among the kernels
PROFILE = FIXTURES / "profile_kernels_lora.txt"


def _vs_litgpt():
    spec = importlib.util.spec_from_file_location("vs_litgpt", REPO / "benchmarks" / "vs_litgpt.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["vs_litgpt"] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def test_rescoring_a_recorded_call_gives_back_its_figures_and_the_steady_state(tmp_path):
    vs_litgpt = _vs_litgpt()
    folder = tmp_path / "call"
    shutil.copytree(RECORDED, folder)
    args = argparse.Namespace(rescore=folder, model="tiny-llama-1.1b", config_file=None, max_steps=None, only=None,
                              timeout=900, precision=None, accelerator="auto", dry_run=False, out=folder)
    assert vs_litgpt.rescore(args, "python benchmarks/vs_litgpt.py --rescore DIR") == 0
    recorded = {row["name"]: row for row in json.loads((RECORDED / "vs_litgpt.json").read_text())["runs"]}
    rescored = {row["name"]: row for row in json.loads((folder / "vs_litgpt.rescored.json").read_text())["runs"]}
    assert rescored.keys() == recorded.keys() and len(rescored) == 6
    for name, row in rescored.items():
        for key in ("real_tok_s", "padded_tok_s", "reported_tok_s", "epoch_time_s", "peak_reserved_gib", "mfu"):
            assert row[key] == pytest.approx(recorded[name][key]), (name, key)
        assert row["steady_real_tok_s"] > 0
    # LitGPT's first 2 optimizer steps (8 iterations) are its slowest: steady state is faster than the epoch average
    assert rescored["litgpt-lora"]["steady_real_tok_s"] > rescored["litgpt-lora"]["real_tok_s"]
    # litft's steady state is its own throughput.tokens_per_sec
    assert rescored["litft-lora-defaults"]["steady_real_tok_s"] == recorded["litft-lora-defaults"]["reported_tok_s"]
    assert "steady real tok/s litft/LitGPT" in (folder / "vs_litgpt.rescored.md").read_text()


def test_kernel_diff_sums_a_recorded_profile_by_kind_without_the_optimizer_range():
    """benchmarks/kernel_diff.py on a recorded LoRA profile gives that profile's totals by kind; the
    Optimizer.step#AdamW.step range (1.57 ms per step, written before litft left such ranges out) is not counted."""
    spec = importlib.util.spec_from_file_location("kernel_diff", REPO / "benchmarks" / "kernel_diff.py")
    kernel_diff = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel_diff)
    profile = PROFILE
    assert "Optimizer.step#AdamW.step" in profile.read_text()
    totals = kernel_diff.read(profile)
    assert totals[kernel_diff.KINDS[0][0]] == pytest.approx(9.49, abs=0.005)  # LoRA's A side
    assert sum(totals.values()) == pytest.approx(52.97, abs=0.01)
