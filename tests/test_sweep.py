"""litft sweep: a grid of settings, each combination its own `litft finetune` process, one table."""

import json

import pytest

from litft.errors import ConfigError
from litft.sweep import combinations, parse_grid, run_name, split_values

COMMON = ["--train.max_steps", "2", "--eval.initial", "false", "--eval.interval", "0", "--data.num_workers", "0",
          "--logging.tensorboard", "false"]


def test_grid_values_split_on_commas_outside_brackets():
    assert split_values("1,2, 4") == ["1", "2", "4"]
    assert split_values("[0.9,0.95],[0.9,0.999]") == ["[0.9,0.95]", "[0.9,0.999]"]
    grid = parse_grid(["train.micro_batch_size=1,2", "--precision=bf16-true,bf16-mixed"])
    assert grid == {"train.micro_batch_size": ["1", "2"], "precision": ["bf16-true", "bf16-mixed"]}
    # the first key varies slowest; names are short and filesystem-safe
    assert [run_name(c) for c in combinations(grid)] == [
        "micro_batch_size-1_precision-bf16-true", "micro_batch_size-1_precision-bf16-mixed",
        "micro_batch_size-2_precision-bf16-true", "micro_batch_size-2_precision-bf16-mixed"]
    for bad in (["micro_batch_size"], ["x="], ["a=1,,2"]):
        with pytest.raises(ConfigError, match="expected KEY=V1,V2"):
            parse_grid(bad)
    with pytest.raises(ConfigError, match="given twice"):
        parse_grid(["a=1", "a=2"])


def test_every_combination_is_checked_before_any_runs(tmp_path):
    from litft.cli import main

    code = main(["sweep", "--config", "demo", "--grid", "train.micro_batch_size=3,16", "--grid", "precision=32-true",
                 "--out", str(tmp_path / "sweep"), *COMMON])
    assert code == 2 and not (tmp_path / "sweep").exists()


def test_a_dry_run_checks_and_prints_every_command(tmp_path, capsys):
    from litft.cli import main

    code = main(["sweep", "--config", "demo", "--grid", "train.micro_batch_size=8,16", "--dry-run",
                 "--out", str(tmp_path / "sweep"), *COMMON])
    out = capsys.readouterr().out
    assert code == 0 and "2 run(s) checked" in out and not (tmp_path / "sweep").exists()
    assert "--train.micro_batch_size 16 --out_dir" in out


def test_a_failed_run_is_a_row_and_the_sweep_goes_on(tmp_path, capsys):
    from litft.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": \n')
    out = tmp_path / "sweep"
    code = main(["sweep", "--config", "demo", "--grid", f"data.path={bad},litft:demo/instructions.jsonl",
                 "--out", str(out), *COMMON])
    assert code == 1  # a run failed for a reason other than running out of memory
    text = capsys.readouterr().out
    assert "data error in" in text and "ok in" in text
    table = (out / "sweep.md").read_text()
    assert "data error" in table and "| ok " in table and "line 2" in table
    good = next(p for p in (out / "runs").iterdir() if "instructions" in p.name)
    assert json.loads((good / "result.json").read_text())["steps"] == 2
    assert (out / "sweep.csv").read_text().splitlines()[0].startswith("run,status")


def test_repeats_add_the_spread_of_each_combination(tmp_path):
    from litft.cli import main

    out = tmp_path / "sweep"
    code = main(["sweep", "--config", "demo", "--grid", "train.micro_batch_size=16", "--repeat", "2",
                 "--out", str(out), *COMMON, "--train.max_steps", "4", "--logging.skip_steps", "1"])
    assert code == 0
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["micro_batch_size-16_rep1", "micro_batch_size-16_rep2"]
    rates = [json.loads((out / "runs" / f"micro_batch_size-16_rep{r}" / "result.json").read_text())["throughput"]
             ["tokens_per_sec"] for r in (1, 2)]
    row = next(line for line in (out / "sweep.md").read_text().splitlines() if line.startswith("| micro_batch_size-16 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "2 of 2" and cells[2] == f"{sum(rates) / 2:,.0f}"


PLAN = """\
timeout: 600
set: {train.max_steps: 2, eval.initial: false, eval.interval: 0, data.num_workers: 0, logging.tensorboard: false}
runs:
  - {name: ok, config: demo}
  - {name: bad-data, config: demo, set: {data.path: BAD}}
  - name: mb
    config: demo
    grid: {train.micro_batch_size: [8]}
"""


def _plan(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\nnot json\n')
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("BAD", str(bad)))
    return plan


def test_a_plan_runs_every_entry_records_each_outcome_and_a_second_start_skips_them(tmp_path, capsys):
    from litft.cli import main

    out = tmp_path / "out"
    assert main(["sweep", "--plan", str(_plan(tmp_path)), "--out", str(out)]) == 1  # a data error is not a result
    outcomes = json.loads((out / "outcomes.json").read_text())
    assert {name: o["outcome"] for name, o in outcomes.items()} == {
        "ok": "ok", "bad-data": "data error", "mb_micro_batch_size-8": "ok"}
    assert "line 2" in outcomes["bad-data"]["message"] and outcomes["bad-data"]["exit_code"] == 5
    table = (out / "sweep.md").read_text()
    assert "## Outcomes" in table and "| bad-data | data error | 5 |" in table
    capsys.readouterr()
    assert main(["sweep", "--plan", str(_plan(tmp_path)), "--out", str(out)]) == 1
    assert capsys.readouterr().out.count("in an earlier start of this sweep; skipped") == 3


def test_a_sweep_stopped_midway_goes_on_where_it_stopped(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    command = [sys.executable, "-m", "litft.cli", "sweep", "--plan", str(_plan(tmp_path)), "--out", str(out)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    outcomes = out / "outcomes.json"
    deadline = time.time() + 900  # a hang guard
    while time.time() < deadline and proc.poll() is None and not (
            outcomes.is_file() and len(json.loads(outcomes.read_text())) >= 1):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep and the run it had started
    proc.wait()
    first = json.loads(outcomes.read_text())
    assert len(first) < 3
    log = (out / "runs" / "ok" / "log.txt").read_text()
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    assert rerun.returncode == 1, rerun.stdout[-2000:]
    assert set(json.loads(outcomes.read_text())) == {"ok", "bad-data", "mb_micro_batch_size-8"}
    assert (out / "runs" / "ok" / "log.txt").read_text() == log  # the finished run was not run again
    assert "[1/3] ok: ok in an earlier start" in rerun.stdout


def test_plan_problems_are_reported_at_once(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("runs:\n  - {name: a, config: demo, grid: {train.micro_batch_size: 8}}\n  - {config: demo}\n"
                    "  - {name: a, config: demo, sett: {}}\nextra: 1\n")
    from litft.sweep import read_plan

    with pytest.raises(ConfigError) as err:
        read_plan(plan)
    text = str(err.value)
    assert "unknown key(s) extra" in text and "grid: expected KEY: [V1, V2, ...]" in text
    assert "runs[2]: expected a mapping with name and config" in text and "unknown key(s) sett" in text


def test_every_shipped_plan_checks(capsys):
    """plans/*.yaml: every run of every shipped plan loads and validates (--dry-run runs nothing)."""
    from pathlib import Path

    from litft.cli import main

    plans = sorted((Path(__file__).resolve().parents[1] / "plans").glob("*.yaml"))
    assert plans
    for plan in plans:
        assert main(["sweep", "--plan", str(plan), "--dry-run"]) == 0, plan
        assert "nothing ran" in capsys.readouterr().out


def test_a_plan_runs_on_the_cpu_with_the_demo_model(tmp_path, capsys):
    """--cpu-demo: each run of a GPU plan on the CPU with the demo model, what a CPU cannot run replaced and said:
    float16 weights, QLoRA, FSDP, four devices; the batch arithmetic and the engine kept."""
    from litft.cli import main

    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "set: {init: random, model.tokenizer_dir: 'litft:demo/model', train.max_steps: 20, eval.interval: 0,\n"
        "      eval.initial: false, eval.final: false}\n"
        "runs:\n"
        "  - {name: qlora-16, config: tiny-llama-qlora, set: {precision: 16-true}}\n"
        "  - {name: fsdp-4, config: tiny-llama-full-fsdp, set: {devices: 4, engine: trainer}}\n"
    )
    assert main(["sweep", "--plan", str(plan), "--cpu-demo", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "precision 16-true -> 32-true" in out and "method qlora -> lora" in out
    assert "strategy fsdp -> ddp" in out and "devices 4 x nodes 1 -> 2" in out
    results = {p.parent.name: json.loads(p.read_text()) for p in (tmp_path / "out" / "runs").glob("*/result.json")}
    assert sorted(results) == ["fsdp-4", "qlora-16"] and all(r["status"] == "ok" for r in results.values())
    assert all(r["steps"] == 3 for r in results.values())
    fsdp = results["fsdp-4"]
    assert fsdp["engine"] == "trainer" and fsdp["batch"]["devices"] == 2
    assert fsdp["batch"]["global_batch_size"] == 32 and fsdp["batch"]["grad_accum"] == 2  # 32 / (8 x 2 devices)
