"""The lab notebooks run top to bottom on the CPU in a real Jupyter kernel (nbclient), as a student's would."""

import json
import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _run(notebook: Path, workdir: Path) -> str:
    """Execute every cell in a python3 kernel started in ``workdir`` (any error fails the test); return the text the
    cells printed."""
    nb = nbformat.read(notebook, as_version=4)
    NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}).execute()
    return "".join(output.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                   for output in cell.get("outputs", []) if output.get("output_type") == "stream")


def _runs(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("**/runs/*/result.json"))]


def test_every_notebook_is_tested():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == ["lab-batch-size.ipynb", "lab-speed-choices.ipynb"]


def test_the_batch_size_lab_runs_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_STEPS", "3")
    monkeypatch.setenv("LAB_OUT", str(tmp_path / "lab"))
    out = _run(NOTEBOOKS / "lab-batch-size.ipynb", tmp_path)
    assert "micro-batch  4: activations" in out and "sweep exit code: 0" in out
    results = _runs(tmp_path / "lab" / "batch")
    assert len(results) == 3 and all(r["status"] == "ok" for r in results)
    charts = list((tmp_path / "lab" / "plots").glob("*.png"))
    assert charts and all(chart.stat().st_size > 0 for chart in charts)
    assert os.path.isdir(tmp_path / "lab" / "batch" / "runs")


def test_the_speed_choices_lab_runs_on_the_cpu(tmp_path, monkeypatch):
    """One run per choice (the CPU's: LoRA layers on and off, packing off, pack_steps off, fused norm off); the same
    samples per step in each, so the same loss up to rounding."""
    monkeypatch.setenv("LAB_STEPS", "3")
    monkeypatch.setenv("LAB_OUT", str(tmp_path / "lab"))
    out = _run(NOTEBOOKS / "lab-speed-choices.ipynb", tmp_path)
    assert "sweep exit codes:" in out and "micro-batches" in out
    results = _runs(tmp_path / "lab" / "speed")
    assert len(results) == 5 and all(r["status"] == "ok" for r in results)
    losses = [r["losses"]["train_last"] for r in results]
    assert max(losses) - min(losses) < 1e-3 * max(losses), losses
    passes = {r["batch"]["pack_steps"]: r["batch"]["micro_batches_run"] for r in results}
    assert passes[True] <= passes[False]  # filling by positions never makes more passes
    charts = list((tmp_path / "lab" / "speed-plots").glob("*.png"))
    assert charts and all(chart.stat().st_size > 0 for chart in charts)
