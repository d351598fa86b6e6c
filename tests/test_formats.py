"""Data beyond Alpaca (data.format): OpenOrca-style records with a system prompt, chat messages, plain-text
documents; each read with its errors (exit 5, file and line) and each training the demo end to end."""

import json

import pytest

import litft
from litft.cli import main
from litft.data import read_records
from litft.data.records import read_documents
from litft.data.tokenize import prompt_text, resolve_prompt_style
from litft.errors import DataError
from litft.recipe import DataFields

DEMO = [json.loads(line) for line in
        litft.recipe.resolve_path("litft:demo/instructions.jsonl").read_text().splitlines()][:240]


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_openorca_records_carry_their_system_prompt_into_the_prompt(tmp_path):
    path = _write(tmp_path / "orca.jsonl", [{"system_prompt": "Answer in one word.", "question": "Sky color?",
                                             "response": "Blue."}])
    [record] = read_records(path, DataFields())  # auto: question + response -> openorca
    assert record == {"instruction": "Sky color?", "input": "", "output": "Blue.", "system": "Answer in one word."}
    prompt = prompt_text(resolve_prompt_style("alpaca"), record)
    assert prompt.startswith("Answer in one word.\n\n### Instruction:\nSky color?")
    plain = prompt_text(resolve_prompt_style("alpaca"), {**record, "system": ""})
    assert plain.startswith("Below is an instruction")  # no system prompt: the style's own preamble


def test_chat_records_learn_the_last_assistant_message(tmp_path):
    path = _write(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}]}])
    [record] = read_records(path, DataFields())
    assert record == {"instruction": "User: Hi\nAssistant: Hello.\nUser: 2+2?", "input": "", "output": "4",
                      "system": "Be brief."}
    _write(path, [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
                  {"messages": [{"role": "user", "content": "Hi"}]}])
    with pytest.raises(DataError, match=r"chat.jsonl: line 2: the last message must be the assistant's"):
        read_records(path, DataFields())


def test_text_documents_become_chunks_with_a_loss_on_every_token(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("First document. " * 200)
    (docs / "notes.txt").write_text("Second document. " * 200)
    (docs / "skip.json").write_text("{}")
    assert [path.name for path, _ in read_documents(docs)] == ["a.md", "notes.txt"]
    (docs / "bad.txt").write_bytes(b"fine\n\xff\xfe broken")
    with pytest.raises(DataError, match=r"bad.txt: line 2: byte 0xff .* is not valid UTF-8"):
        read_documents(docs)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no .txt or .md files"):
        read_documents(empty)


@pytest.mark.parametrize("kind", ["openorca", "chat", "text"])
def test_each_format_trains_the_demo_end_to_end(tmp_path, kind, capsys):
    if kind == "openorca":
        data = _write(tmp_path / "orca.jsonl", [{"system_prompt": "Be careful.", "question": r["instruction"],
                                                 "response": r["output"]} for r in DEMO])
    elif kind == "chat":
        data = _write(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": r["instruction"]},
                                                              {"role": "assistant", "content": r["output"]}]}
                                                for r in DEMO])
    else:
        data = tmp_path / "docs"
        data.mkdir()
        for k in range(3):
            (data / f"doc{k}.txt").write_text(" ".join(r["output"] for r in DEMO[k * 80:(k + 1) * 80]) * 6)
    out = tmp_path / "run"
    code = main(["finetune", "--config", "demo", "--data.path", str(data), "--train.max_steps", "6",
                 "--train.global_batch_size", "8", "--train.micro_batch_size", "8", "--data.max_seq_length", "64",
                 "--eval.interval", "0", "--logging.progress", "none", "--out_dir", str(out)])
    assert code == 0, capsys.readouterr().err
    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == 6 and result["losses"]["val_final"] < result["losses"]["val_initial"]
    if kind == "text":
        assert result["data"]["train"]["loss_tokens"] == result["data"]["train"]["tokens"]  # every token learns


def test_a_hub_data_set_by_name_is_fetched_once_through_datasets(tmp_path, monkeypatch, capsys):
    """data.path hf:REPO goes through datasets.load_dataset (here a local folder it loads as it would a hub
    repository), its rows kept in litft's cache and read in data.format auto (OpenOrca's keys)."""
    monkeypatch.setenv("LITFT_CACHE", str(tmp_path / "cache"))
    repo = tmp_path / "orca"
    repo.mkdir()
    _write(repo / "train.jsonl", [{"system_prompt": "Be careful.", "question": r["instruction"],
                                   "response": r["output"]} for r in DEMO])
    args = ["finetune", "--config", "demo", "--data.path", f"hf:{repo}", "--train.max_steps", "2",
            "--eval.interval", "0", "--eval.initial", "false", "--logging.progress", "none"]
    assert main([*args, "--out_dir", str(tmp_path / "one")]) == 0
    [cached] = list((tmp_path / "cache" / "data").glob("hf--*--train.jsonl"))
    assert len(cached.read_text().splitlines()) == len(DEMO)
    stamp = cached.stat().st_mtime_ns
    assert main([*args, "--out_dir", str(tmp_path / "two")]) == 0
    assert cached.stat().st_mtime_ns == stamp  # the second run reads the cache
    capsys.readouterr()
    assert main([*args[:3], "--data.path", f"hf:{tmp_path / 'missing'}", *args[5:], "--out_dir",
                 str(tmp_path / "three")]) == 5
    assert "cannot fetch" in capsys.readouterr().err
