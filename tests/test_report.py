"""`litft compare` and litft.report on fixture run dirs (tests/fixtures/runs):

- cpu-demo: a real result.json of `litft finetune --config demo --train.max_steps 12` on the CPU (MFU, GPU memory null);
- h100-sweep/lora-1gpu, h100-sweep/lora-2gpu: hand-made H100 results with known numbers (and memory.predicted);
- h100-sweep/lora-2gpu-mbs16: a run that ran out of memory before writing result.json: only its log.txt.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import pytest

from litft import report
from litft.cli import main
from litft.errors import ConfigError

RUNS = Path(__file__).parent / "fixtures" / "runs"
SWEEP = RUNS / "h100-sweep"


def md_rows(text: str) -> dict[str, dict[str, str]]:
    """The first Markdown table of text as {run: {title: cell}}."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    split = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    header, body = split[0], [row for row in split[1:] if not set("".join(row)) <= set("-:")]
    return {row[0]: dict(zip(header, row)) for row in body if row != header}


@pytest.fixture(scope="module")
def all_runs():
    return report.load_runs([RUNS])


def test_load_runs_finds_every_run_at_any_depth_and_names_them_relative_to_the_common_parent(all_runs):
    assert [r.name for r in all_runs] == [
        "cpu-demo", "h100-sweep/lora-1gpu", "h100-sweep/lora-2gpu", "h100-sweep/lora-2gpu-mbs16",
    ]
    assert [r.status for r in all_runs] == ["ok", "ok", "ok", "out of memory"]
    assert [r.name for r in report.load_runs(SWEEP)] == ["lora-1gpu", "lora-2gpu", "lora-2gpu-mbs16"]
    # one run dir keeps its own name; two paths are named relative to their common parent; duplicates count once
    assert [r.name for r in report.load_runs([RUNS / "cpu-demo"])] == ["cpu-demo"]
    assert [r.name for r in report.load_runs([RUNS / "cpu-demo", SWEEP / "lora-1gpu", RUNS / "cpu-demo"])] == [
        "cpu-demo", "h100-sweep/lora-1gpu",
    ]
    assert [r.name for r in report.load_runs([SWEEP / "lora-1gpu" / "result.json"])] == ["lora-1gpu"]


def test_markdown_table_shows_numbers_for_people(all_runs):
    text = report.table(all_runs)
    rows = md_rows(text)
    one, two, cpu = rows["h100-sweep/lora-1gpu"], rows["h100-sweep/lora-2gpu"], rows["cpu-demo"]
    assert list(one) == [
        "run", "status", "method", "precision", "micro", "accum", "devices", "seq", "steps", "tok/s", "tok/s/dev",
        "MFU", "vs 1 device", "step", "alloc GiB", "reserved GiB", "predicted GiB", "pred. error", "val loss",
    ]
    assert one == {
        "run": "h100-sweep/lora-1gpu", "status": "ok", "method": "lora", "precision": "bf16-true", "micro": "8",
        "accum": "4", "devices": "1", "seq": "1,024", "steps": "25", "tok/s": "12,345", "tok/s/dev": "12,345",
        "MFU": "41.2%", "vs 1 device": "", "step": "234.5 ms", "alloc GiB": "30.12", "reserved GiB": "34.57", "predicted GiB": "33.00",
        "pred. error": "+4.7%", "val loss": "1.5000",
    }
    assert (two["devices"], two["tok/s"], two["tok/s/dev"], two["MFU"], two["reserved GiB"], two["vs 1 device"]) == (
        "2", "23,457", "11,728", "39.2%", "35.25", "1.90x"
    )
    # null on the CPU -> n/a; a key this run's litft did not write (memory.predicted) -> blank
    assert (cpu["tok/s"], cpu["MFU"], cpu["reserved GiB"], cpu["predicted GiB"], cpu["pred. error"]) == (
        "4,366", "n/a", "n/a", "", ""
    )
    # numbers are right-aligned in the GitHub table
    rule = next(line for line in text.splitlines() if line.startswith("|--"))
    assert rule.split("|")[10].endswith(":") and not rule.split("|")[3].endswith(":")


def test_predicted_memory_columns_only_when_some_run_has_them():
    rows = md_rows(report.table(report.load_runs(RUNS / "cpu-demo")))
    assert "predicted GiB" not in rows["cpu-demo"] and "pred. error" not in rows["cpu-demo"]


def test_oom_run_with_only_a_log_is_a_row(all_runs):
    rows = md_rows(report.table(all_runs))
    oom = rows["h100-sweep/lora-2gpu-mbs16"]
    # status from the log's `litft finetune: out of memory: ...` line, batch shape from the lines litft printed first
    assert (oom["status"], oom["method"], oom["precision"], oom["micro"], oom["accum"], oom["devices"]) == (
        "out of memory", "lora", "bf16-true", "16", "1", "2"
    )
    assert oom["tok/s"] == "" and oom["reserved GiB"] == ""
    run = all_runs[-1]
    assert not run.has_result and run.message.startswith("out of GPU memory on rank 0 with micro_batch_size 16")


def test_csv_parses_back_to_the_raw_numbers(all_runs):
    text = report.table(all_runs, fmt="csv")
    rows = {row["run"]: row for row in csv.DictReader(io.StringIO(text))}
    one, two, cpu, oom = (rows[n] for n in ("h100-sweep/lora-1gpu", "h100-sweep/lora-2gpu", "cpu-demo",
                                            "h100-sweep/lora-2gpu-mbs16"))
    assert float(one["throughput.tokens_per_sec"]) == 12345.4
    assert float(one["throughput.mfu"]) == 0.4123
    assert float(one["throughput.median_step_time_s"]) == 0.2345
    assert float(one["memory.peak_reserved_gib"]) == 34.567
    assert float(one["memory.predicted.total_gib"]) == 33.0 and float(one["memory.error_pct"]) == 4.72
    assert float(two["throughput.tokens_per_sec_per_device"]) == 23456.7 / 2
    assert int(two["batch.devices"]) == 2 and int(one["batch.max_seq_length"]) == 1024
    assert float(cpu["throughput.tokens_per_sec"]) == json.loads((RUNS / "cpu-demo/result.json").read_text())[
        "throughput"]["tokens_per_sec"]
    assert cpu["throughput.mfu"] == "" and oom["status"] == "out of memory" and oom["throughput.tokens_per_sec"] == ""


def test_json_is_a_list_of_row_dicts_with_raw_values(all_runs):
    rows = json.loads(report.table(all_runs, "run,status,throughput.mfu,memory.predicted.total_gib", fmt="json"))
    assert rows == [
        {"run": "cpu-demo", "status": "ok", "throughput.mfu": None, "memory.predicted.total_gib": None},
        {"run": "h100-sweep/lora-1gpu", "status": "ok", "throughput.mfu": 0.4123, "memory.predicted.total_gib": 33.0},
        {"run": "h100-sweep/lora-2gpu", "status": "ok", "throughput.mfu": 0.3921, "memory.predicted.total_gib": 33.5},
        {"run": "h100-sweep/lora-2gpu-mbs16", "status": "out of memory", "throughput.mfu": None,
         "memory.predicted.total_gib": None},
    ]
    assert report.to_rows(all_runs, ["tok/s"]) == [
        {"throughput.tokens_per_sec": r.get("throughput.tokens_per_sec", None)} for r in all_runs
    ]


def test_stamp_one_environment_and_config_hashes():
    text = report.table(report.load_runs(SWEEP))
    stamp = text.split("\n\n", 1)[1]
    assert "WARNING" not in stamp
    assert ("- environment: GPU NVIDIA H100 80GB HBM3, driver 550.54.15, torch 2.5.1+cu124, CUDA 12.4, litft 0.1.0,"
            " litgpt 0.5.13, lightning 2.6.6 [lora-1gpu, lora-2gpu]") in stamp.splitlines()
    assert "- environment unknown (no result.json): lora-2gpu-mbs16" in stamp.splitlines()
    assert "- config hash: lora-1gpu a1b2c3d4e5f6, lora-2gpu 0f1e2d3c4b5a, lora-2gpu-mbs16 (none)" in stamp.splitlines()
    assert any(line.startswith("- lora-2gpu-mbs16: out of memory: out of GPU memory") for line in stamp.splitlines())


def test_stamp_warns_loudly_when_environments_differ(all_runs):
    lines = report.table(all_runs).splitlines()
    warning = next(line for line in lines if "WARNING" in line)
    assert warning.startswith("> **WARNING: these runs come from 2 different environments (they differ in gpu,"
                              " driver, torch, cuda)")
    assert sum(line.startswith("- environment 1: CPU") for line in lines) == 1
    assert sum(line.startswith("- environment 2: GPU NVIDIA H100 80GB HBM3") for line in lines) == 1
    plain = report.stamp(all_runs)  # what csv/json print on stderr
    assert plain[0].startswith("WARNING: these runs come from 2 different environments")


def test_failed_result_takes_its_status_from_the_log_and_config_yaml_fills_a_missing_result(tmp_path):
    failed = tmp_path / "sweep" / "nan-run"
    shutil.copytree(SWEEP / "lora-1gpu", failed)
    result = json.loads((failed / "result.json").read_text())
    result["status"] = "failed"
    (failed / "result.json").write_text(json.dumps(result))
    (failed / "log.txt").write_text("$ python -m litft.cli finetune ...\n--- stderr ---\n"
                                    "litft finetune: non-finite loss: the loss is nan at step 7 (rank 0)\n")
    crashed = tmp_path / "sweep" / "killed"  # config.yaml is written before the model loads; then nothing
    crashed.mkdir()
    import yaml

    recipe = json.loads((RUNS / "cpu-demo" / "result.json").read_text())["recipe"]
    (crashed / "config.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    (tmp_path / "sweep" / "notes").mkdir()  # not a run
    (tmp_path / "sweep" / "notes" / "config.yaml").write_text("lr: 1\n")

    runs = {r.name: r for r in report.load_runs(tmp_path / "sweep")}
    assert sorted(runs) == ["killed", "nan-run"]
    assert runs["nan-run"].status == "non-finite loss" and runs["nan-run"].message.startswith("the loss is nan")
    assert runs["killed"].status == "no result"
    # the recovered config hash is the one litft finetune wrote for the same recipe (out_dir and logging excluded)
    assert runs["killed"].config_hash == "22500ab89f17"
    rows = md_rows(report.table(list(runs.values())))
    assert (rows["killed"]["micro"], rows["killed"]["accum"], rows["killed"]["seq"]) == ("16", "1", "256")


def test_fields_sort_and_by(all_runs):
    # a column title, a unique key name and a section (expanded to its keys) all name fields
    rows = report.to_rows(all_runs, "run,tok/s,mfu,losses", sort="-throughput.tokens_per_sec")
    assert list(rows[0]) == ["run", "throughput.tokens_per_sec", "throughput.mfu", "losses.train_first",
                             "losses.train_last", "losses.val_initial", "losses.val_final"]
    assert [r["run"] for r in rows] == ["h100-sweep/lora-2gpu", "h100-sweep/lora-1gpu", "cpu-demo",
                                        "h100-sweep/lora-2gpu-mbs16"]  # missing values last
    extended = report.select_fields(all_runs, "+throughput.padded_tokens_per_sec")
    assert extended[-1].path == "throughput.padded_tokens_per_sec" and extended[0].path == "run"

    text = report.table(all_runs, "run,tok/s", by="recipe.precision")
    assert "**precision = 32-true** (1 run)" in text and "**precision = bf16-true** (3 runs)" in text
    assert "| run " in text and "precision" in text.splitlines()[2]  # the group column is added


def test_unknown_field_says_did_you_mean(all_runs):
    with pytest.raises(ConfigError, match=r"unknown field 'throughput.tokens_per_secc'.*Did you mean"
                                          r" 'throughput.tokens_per_sec'"):
        report.table(all_runs, "run,throughput.tokens_per_secc")
    with pytest.raises(ConfigError, match=r"Did you mean 'memory.peak_reserved_gib'"):
        report.table(all_runs, "memory.peak_reservd_gib")
    with pytest.raises(ConfigError, match=r"unknown field 'nonsense'"):
        report.table(all_runs, sort="nonsense")


def test_no_result_anywhere_is_a_config_error(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(ConfigError, match="no result.json under"):
        report.load_runs(tmp_path / "empty")
    with pytest.raises(ConfigError, match="does not exist"):
        report.load_runs(tmp_path / "missing")


def test_plots_are_pngs_that_open(all_runs, tmp_path):
    from PIL import Image

    paths = report.plot(all_runs, tmp_path / "plots")
    assert [p.name for p in paths] == ["tokens_per_sec.png", "peak_memory.png", "scaling.png"]
    for path in paths:
        assert path.stat().st_size > 10_000
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            assert image.format == "PNG" and image.width >= 600 and image.height >= 400
    # one device count: no scaling chart
    one = report.plot(report.load_runs(RUNS / "cpu-demo"), tmp_path / "cpu")
    assert [p.name for p in one] == ["tokens_per_sec.png", "peak_memory.png"]


def test_cli_compare(capsys, tmp_path):
    assert main(["compare", str(SWEEP), "--sort", "-tok/s", "--plot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert list(md_rows(out)) == ["lora-2gpu", "lora-1gpu", "lora-2gpu-mbs16"]
    assert md_rows(out)["lora-1gpu"]["MFU"] == "41.2%"
    assert f"wrote {tmp_path / 'scaling.png'}" in out and (tmp_path / "scaling.png").is_file()

    assert main(["compare", str(RUNS), "--format", "csv", "--fields", "run,status"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0] == "run,status"  # stdout stays machine-readable...
    assert "h100-sweep/lora-2gpu-mbs16,out of memory" in captured.out.splitlines()
    assert captured.err.startswith("WARNING: these runs come from 2 different environments")  # ...the stamp: stderr


def test_cli_compare_errors_exit_2(capsys, tmp_path):
    assert main(["compare", str(tmp_path)]) == 2
    assert "litft compare: config error: no result.json under" in capsys.readouterr().err
    assert main(["compare", str(SWEEP), "--fields", "tok_per_sec"]) == 2
    assert "unknown field 'tok_per_sec'" in capsys.readouterr().err
    assert main(["compare", str(SWEEP), "--formt", "csv"]) == 2
    assert "did you mean '--format'" in capsys.readouterr().err
    assert main(["compare", str(SWEEP), "--format", "xlsx"]) == 2
    assert main(["compare"]) == 2


def test_format_value():
    f = report.format_value
    assert (f(12345.4, "rate"), f(0.4123, "fraction_pct"), f(0.2345, "ms"), f(34.567, "gib")) == (
        "12,345", "41.2%", "234.5 ms", "34.57"
    )
    assert (f(None), f(report.MISSING), f(True), f(1024, "int"), f(-3.21, "pct"), f(0.003)) == (
        "n/a", "", "yes", "1,024", "-3.2%", "0.003"
    )


def test_compare_shows_each_multi_device_runs_scaling_against_the_one_device_run(tmp_path):
    """A run on N devices is held against the one-device run of the same model, method, precision and global batch
    among those compared: its tok/s over that run's, with the strategy beside it."""
    base = json.loads((RUNS / "cpu-demo" / "result.json").read_text())

    def write(name: str, devices: int, rate: float, strategy: str, precision: str | None = None) -> None:
        result = json.loads(json.dumps(base))
        result["batch"]["devices"] = devices
        result["throughput"]["tokens_per_sec"] = rate
        result["plan"] = {**result.get("plan", {}), "strategy": strategy}
        if precision:
            result["recipe"]["precision"] = precision
        (tmp_path / name).mkdir()
        (tmp_path / name / "result.json").write_text(json.dumps(result))

    write("one", 1, 1000.0, "single")
    write("ddp", 2, 1900.0, "ddp")
    write("other-work", 2, 500.0, "fsdp", precision="bf16-true")  # no one-device run of this work
    runs = {r.name: r for r in report.load_runs(tmp_path)}
    assert runs["ddp"].get("scaling.vs_one_device") == pytest.approx(1.9)
    assert runs["ddp"].get("scaling.one_device_run") == "one"
    assert runs["other-work"].get("scaling.vs_one_device", None) is None
    rows = md_rows(report.table(list(runs.values())))
    assert rows["ddp"]["vs 1 device"] == "1.90x" and rows["ddp"]["strategy"] == "ddp"
