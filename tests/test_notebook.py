"""The lab notebooks run top to bottom (their code cells, in one namespace, as Jupyter would) on the CPU."""

import json
import os
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(notebook: Path) -> dict:
    namespace: dict = {}
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{notebook.name} cell", "exec"), namespace)  # noqa: S102
    return namespace


def test_the_batch_size_lab_runs_on_the_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LAB_STEPS", "3")
    monkeypatch.setenv("LAB_OUT", str(tmp_path / "lab"))
    monkeypatch.chdir(tmp_path)
    namespace = _run(EXAMPLES / "lab-batch-size.ipynb")
    out = capsys.readouterr().out
    assert namespace["code"] == 0
    assert "micro-batch  4: activations" in out and "sweep exit code: 0" in out
    assert len(namespace["runs"]) == 3 and all(run.result["status"] == "ok" for run in namespace["runs"])
    assert all(Path(chart).stat().st_size > 0 for chart in namespace["charts"])
    assert os.path.isdir(tmp_path / "lab" / "batch" / "runs")


def test_the_speed_choices_lab_runs_on_the_cpu(tmp_path, monkeypatch, capsys):
    """One run per choice (the CPU's four: LoRA layers on and off, packing off, pack_steps off, fused norm off); the
    same samples per step in each, so the same loss up to rounding."""
    monkeypatch.setenv("LAB_STEPS", "3")
    monkeypatch.setenv("LAB_OUT", str(tmp_path / "lab"))
    monkeypatch.chdir(tmp_path)
    namespace = _run(EXAMPLES / "lab-speed-choices.ipynb")
    out = capsys.readouterr().out
    assert set(namespace["codes"].values()) == {0}, namespace["codes"]
    runs = namespace["runs"]
    assert len(runs) == 5 and all(run.result["status"] == "ok" for run in runs)
    losses = [run.result["losses"]["train_last"] for run in runs]
    assert max(losses) - min(losses) < 1e-3 * max(losses), losses
    passes = {run.result["batch"]["pack_steps"]: run.result["batch"]["micro_batches_run"] for run in runs}
    assert passes[True] <= passes[False]  # filling by positions never makes more passes
    assert "micro-batches" in out and all(Path(chart).stat().st_size > 0 for chart in namespace["charts"])
