"""The lab notebook runs top to bottom (its code cells, in one namespace, as Jupyter would) on the CPU."""

import json
import os
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "lab-batch-size.ipynb"


def test_the_lab_notebook_runs_on_the_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LAB_STEPS", "3")
    monkeypatch.setenv("LAB_OUT", str(tmp_path / "lab"))
    monkeypatch.chdir(tmp_path)
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    namespace: dict = {}
    for cell in cells:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{NOTEBOOK.name} cell", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    assert namespace["code"] == 0
    assert "micro-batch  4: activations" in out and "sweep exit code: 0" in out
    assert len(namespace["runs"]) == 3 and all(run.result["status"] == "ok" for run in namespace["runs"])
    assert all(Path(chart).stat().st_size > 0 for chart in namespace["charts"])
    assert os.path.isdir(tmp_path / "lab" / "batch" / "runs")
