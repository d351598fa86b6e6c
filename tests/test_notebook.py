"""The lab notebooks run top to bottom on the CPU in a real Jupyter kernel (nbclient), as a student's would."""

import json
import os
from pathlib import Path

import nbformat
import pytest
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
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == [
        "lab-2x2x2.ipynb", "lab-batch-size.ipynb", "lab-part1.ipynb", "lab-part2.ipynb", "lab-precision.ipynb",
        "lab-speed-choices.ipynb"]


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


def _one_step(monkeypatch, tmp_path) -> None:
    """The lab notebooks' plans in CPU mode, one step per run: each run is its own process, whose start-up is most
    of its time on the CPU."""
    monkeypatch.setenv("LAB_STEPS", "1")
    monkeypatch.setenv("LAB_OUT", str(tmp_path / "lab"))


def _outcomes(out: Path) -> dict[str, str]:
    return {name: o["outcome"] for name, o in json.loads((out / "outcomes.json").read_text()).items()}


def test_the_part1_lab_runs_its_plan_on_the_cpu(tmp_path, monkeypatch):
    """Part 1 in CPU mode: the ledger's predictions for the lab's GPU runs (the baseline and 13B AdamW do not fit
    80 GB), every step of the plan on the demo model, the lab's figures beside them, and one step again at litft's
    speed with the same loss."""
    _one_step(monkeypatch, tmp_path)
    out = _run(NOTEBOOKS / "lab-part1.ipynb", tmp_path)
    assert "01-tiny-llama-full-32-true-b32                 93.23 GiB  DOES NOT FIT" in out
    assert "08-open-llama-13b-full-adamw" in out and "sweep exit code: 0" in out
    assert "34.82 GB, 57 s, 7,646 tok/s" in out  # the lab's reported figures in the table
    outcomes = _outcomes(tmp_path / "lab" / "part1" / "lab-part1-a100")
    assert len(outcomes) == 14 and set(outcomes.values()) == {"ok"}
    speeds = _runs(tmp_path / "lab" / "part1")
    step4 = [r for r in speeds if r["out_dir"].endswith("04-tiny-llama-full-bf16-true")]
    assert sorted(r["recipe"]["train"]["speed"] for r in step4) == ["fast", "litgpt"]
    assert step4[0]["losses"]["train_last"] == pytest.approx(step4[1]["losses"]["train_last"], rel=1e-2)


def test_the_part2_lab_runs_both_tracks_and_both_engines_on_the_cpu(tmp_path, monkeypatch):
    _one_step(monkeypatch, tmp_path)
    out = _run(NOTEBOOKS / "lab-part2.ipynb", tmp_path)
    assert "sweep exit codes: [0, 0]" in out and "per rank:" in out
    a100 = _runs(tmp_path / "lab" / "part2" / "lab-part2-a100")
    v100 = _runs(tmp_path / "lab" / "part2" / "lab-part2-v100")
    assert len(a100) == 9 and len(v100) == 5 and all(r["status"] == "ok" for r in a100 + v100)
    assert {r["engine"] for r in a100} == {"fabric", "trainer"}
    assert {r["batch"]["devices"] for r in a100 + v100} == {1, 2}  # 4 GPUs: 2 CPU processes


@pytest.mark.parametrize(("notebook", "runs"), [("lab-precision", 4), ("lab-2x2x2", 8)])
def test_the_precision_and_2x2x2_labs_run_on_the_cpu(tmp_path, monkeypatch, notebook, runs):
    _one_step(monkeypatch, tmp_path)
    out = _run(NOTEBOOKS / f"{notebook}.ipynb", tmp_path)
    assert "sweep exit code: 0" in out
    results = _runs(tmp_path / "lab")
    assert len(results) == runs and all(r["status"] == "ok" for r in results)
    charts = list((tmp_path / "lab").glob("*/plots/*.png"))
    assert charts and all(chart.stat().st_size > 0 for chart in charts)
