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
    assert "exit 5" in text and "ok in" in text
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
