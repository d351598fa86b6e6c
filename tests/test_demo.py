"""The README's demo: `litft finetune --config demo` fine-tunes the shipped tiny model on the shipped instructions on
the CPU, and its validation loss ends far below where it started. (How long it takes is a figure of the run,
result.json's phases_s, not a pass/fail: on a loaded 2-core machine it takes several times longer.)"""

import json
import subprocess
import sys


def test_the_demo_recipe_learns_on_the_cpu(tmp_path):
    out_dir = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "litft.cli", "finetune", "--config", "demo", "--out_dir", str(out_dir),
         "--logging.progress", "plain"],
        capture_output=True, text=True, timeout=3600,  # a guard against a hang, not a speed limit
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((out_dir / "result.json").read_text())
    losses = result["losses"]
    assert result["phases_s"]["train"] > 0
    assert result["epochs_completed"] >= 1.9
    # the shipped model has never seen the Alpaca template: the loss starts near 6.7 and ends near 0.65
    assert losses["val_final"] < 0.3 * losses["val_initial"]
    assert (out_dir / "final" / "lit_model.pth.lora").is_file()
