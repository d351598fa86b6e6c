"""litft.data: reading and its errors, the split, tokenization and masking, collate, the resumable sampler."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from litgpt.prompts import PromptStyle
from litgpt.tokenizer import Tokenizer

from litft.data import (
    IGNORE_INDEX,
    EpochBatchSampler,
    SFTDataset,
    build_dataloader,
    choose_pad_id,
    collate,
    prepare_data,
    read_records,
    split_records,
    tokenize_records,
)
from litft.data import tokenize as tokenize_module
from litft.errors import CheckpointError, ConfigError, DataError
from litft.recipe import DataConfig, DataFields

FIELDS = DataFields()


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def bos_tokenizer(tiny_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The tiny tokenizer with add_bos_token: every prompt starts with <s>."""
    directory = tmp_path_factory.mktemp("bos_tokenizer")
    shutil.copy(tiny_tokenizer_dir / "tokenizer.json", directory)
    config = json.loads((tiny_tokenizer_dir / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    tokenizer = Tokenizer(directory)
    assert tokenizer.use_bos
    return tokenizer


def write(path: Path, content: str | bytes) -> Path:
    if isinstance(content, str):
        content = content.encode("utf-8")
    path.write_bytes(content)
    return path


def jsonl(*records: object) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


# ----------------------------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------------------------

RAW = [
    {"instruction": "Name a color.", "input": "", "output": "Red."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "No input key here.", "output": "Fine."},
    {"instruction": "Null input.", "input": None, "output": "Also fine.", "extra": [1, 2]},
]
EXPECTED = [  # every record has a system prompt, "" without one (data.fields.system)
    {"instruction": "Name a color.", "input": "", "output": "Red.", "system": ""},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5", "system": ""},
    {"instruction": "No input key here.", "input": "", "output": "Fine.", "system": ""},
    {"instruction": "Null input.", "input": "", "output": "Also fine.", "system": ""},
]


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_read_round_trip_with_optional_input(tmp_path, suffix):
    text = json.dumps(RAW, indent=2) if suffix == ".json" else jsonl(*RAW)
    assert read_records(write(tmp_path / f"d{suffix}", text), FIELDS) == EXPECTED


def test_jsonl_skips_blank_lines_and_accepts_crlf_and_bom(tmp_path):
    text = "\n   \n" + jsonl(RAW[0]).replace("\n", "\r\n") + "\t\n\n" + jsonl(RAW[1])
    path = write(tmp_path / "d.jsonl", b"\xef\xbb\xbf" + text.encode())
    assert read_records(path, FIELDS) == EXPECTED[:2]


def test_field_names_come_from_data_fields(tmp_path):
    fields = DataFields(instruction="prompt", input="context", output="response")
    record = {"prompt": "Say hi.", "context": "politely", "response": "Hello!", "instruction": "ignored"}
    path = write(tmp_path / "d.json", json.dumps([record]))
    assert read_records(path, fields) == [{"instruction": "Say hi.", "input": "politely", "output": "Hello!",
                                           "system": ""}]


def test_numbers_become_strings(tmp_path):
    path = write(tmp_path / "d.jsonl", jsonl({"instruction": "What is 6 x 7?", "input": 3, "output": 42}))
    assert read_records(path, FIELDS) == [{"instruction": "What is 6 x 7?", "input": "3", "output": "42",
                                           "system": ""}]


def test_unicode_line_separator_inside_a_string_does_not_shift_line_numbers(tmp_path):
    # U+2028 is legal unescaped inside a JSON string; str.splitlines() would split the line there.
    first = '{"instruction": "a\u2028b", "output": "c"}\n'
    path = write(tmp_path / "d.jsonl", first + '{"instruction": "x"}\n')
    with pytest.raises(DataError, match=r"line 2: missing key 'output'"):
        read_records(path, FIELDS)


GOOD = {"instruction": "Do it.", "input": "", "output": "Done."}


def _bad_cases() -> list:
    """(file name, content, substrings the message must contain)."""
    return [
        pytest.param("d.csv", "instruction,output\n", [".csv", ".json", ".jsonl"], id="unsupported-suffix"),
        pytest.param("d.jsonl", b"", ["empty", "0 bytes"], id="empty-0-bytes"),
        pytest.param("d.json", "  \n\t\n", ["empty", "only whitespace"], id="empty-whitespace"),
        pytest.param("d.json", "[]", ["no records"], id="json-empty-list"),
        pytest.param(
            "d.jsonl",
            jsonl(GOOD, GOOD).encode() + b'{"instruction": "caf\xe9", "output": "x"}\n',
            ["line 3", "0xe9", "not valid UTF-8"],
            id="jsonl-not-utf8",
        ),
        pytest.param(
            "d.json", b'[\n  {"instruction": "ok", "output": "x"},\n  {"instruction": "\xff"}]', ["line 3", "UTF-8"],
            id="json-not-utf8",
        ),
        pytest.param("d.json", b"\xff\xfe[\x00]\x00", ["line 1", "UTF-16"], id="utf16-file"),
        pytest.param(
            "d.jsonl", jsonl(GOOD) + '{"instruction": "x", "output" "y"}\n' + jsonl(GOOD),
            ["line 2", "column 31", "invalid JSON", "Expecting ':' delimiter"], id="jsonl-invalid-line",
        ),
        pytest.param(
            "d.jsonl", jsonl(GOOD, GOOD) + '{"instruction": "x", "out', ["line 3", "invalid JSON", "truncated"],
            id="jsonl-truncated",
        ),
        pytest.param(
            "d.json", json.dumps([GOOD, GOOD], indent=2)[:-12], ["line 10", "column", "invalid JSON", "truncated"],
            id="json-truncated",
        ),
        pytest.param("d.json", jsonl(GOOD, GOOD), ["line 2", "Extra data", ".jsonl"], id="jsonl-content-in-json"),
        pytest.param("d.jsonl", json.dumps([GOOD], indent=2), ["line 1", ".json"], id="json-list-in-jsonl"),
        pytest.param("d.json", json.dumps({"data": [GOOD]}), ["JSON list", "an object", "'data'"], id="json-dict"),
        pytest.param("d.jsonl", jsonl(GOOD, ["a", "b"]), ["line 2", "expected an object", "a list"], id="jsonl-list"),
        pytest.param(
            "d.json", "[\n" + json.dumps(GOOD) + ",\n\n" + json.dumps("just text") + "\n]",
            ["record [1] (line 4)", "expected an object", "a string"], id="json-not-object",
        ),
        pytest.param(
            "d.jsonl", jsonl(GOOD, GOOD, {"instruction": "x", "response": "y"}),
            ["line 3", "missing key 'output'", "'instruction', 'response'", "data.fields.output"],
            id="jsonl-missing-output",
        ),
        pytest.param(
            "d.json", json.dumps([GOOD, GOOD, {"prompt": "x", "output": "y"}], indent=2),
            ["record [2] (line 12)", "missing key 'instruction'", "'prompt', 'output'"], id="json-missing-instruction",
        ),
        pytest.param(
            "d.jsonl", jsonl({"instruction": "x", "output": ["a", "b"]}),
            ["line 1", "key 'output'", "must be a string", "a list"], id="output-is-list",
        ),
        pytest.param(
            "d.jsonl", jsonl(GOOD, {"instruction": "x", "input": {"k": 1}, "output": "y"}),
            ["line 2", "key 'input'", "must be a string", "an object"], id="input-is-object",
        ),
        pytest.param(
            "d.jsonl", jsonl({"instruction": True, "output": "y"}), ["line 1", "key 'instruction'", "a boolean"],
            id="instruction-is-bool",
        ),
        pytest.param("d.jsonl", jsonl({"instruction": "x", "output": None}), ["line 1", "'output' is null"], id="null"),
        pytest.param(
            "d.json", json.dumps([GOOD, {"instruction": "x", "output": "  \n"}]),
            ["record [1] (line 1)", "'output' is empty", "nothing to learn"], id="empty-output",
        ),
    ]


@pytest.mark.parametrize(("name", "content", "expected"), _bad_cases())
def test_each_data_problem_is_one_clear_data_error(tmp_path, name, content, expected):
    path = write(tmp_path / name, content)
    with pytest.raises(DataError) as info:
        read_records(path, FIELDS)
    message = str(info.value)
    assert name in message
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"
    assert info.value.exit_code == 5
    assert "\n" not in message  # one line: the CLI prints it as is


def test_missing_file_suggests_a_close_name(tmp_path):
    write(tmp_path / "train.jsonl", jsonl(GOOD))
    with pytest.raises(DataError, match=r"trian\.jsonl: no such data file; did you mean '.*train\.jsonl'"):
        read_records(tmp_path / "trian.jsonl", FIELDS)
    with pytest.raises(DataError, match="is a directory"):
        read_records(tmp_path, FIELDS)


# ----------------------------------------------------------------------------------------------------------------------
# Split
# ----------------------------------------------------------------------------------------------------------------------


def test_split_is_seeded_disjoint_and_complete():
    records = [{"instruction": str(i), "input": "", "output": "x"} for i in range(100)]
    train, val = split_records(records, 0.1, seed=7)
    assert (len(train), len(val)) == (90, 10)
    names = sorted(int(r["instruction"]) for r in train + val)
    assert names == list(range(100))
    assert split_records(records, 0.1, seed=7) == (train, val)
    assert split_records(records, 0.1, seed=8)[1] != val
    assert [int(r["instruction"]) for r in val] == sorted(int(r["instruction"]) for r in val)  # file order


def test_split_keeps_one_record_on_each_side():
    records = [{"instruction": str(i), "input": "", "output": "x"} for i in range(3)]
    assert [len(part) for part in split_records(records[:2], 0.01, seed=0)] == [1, 1]
    assert [len(part) for part in split_records(records, 0.99, seed=0)] == [1, 2]
    with pytest.raises(DataError, match=r"too small.*1 record.*data.val_path"):
        split_records(records[:1], 0.5, seed=0)


# ----------------------------------------------------------------------------------------------------------------------
# Tokenization and masking
# ----------------------------------------------------------------------------------------------------------------------

RECORDS = [
    {"instruction": "Name three primary colors.", "input": "", "output": "Red, blue and yellow."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Translate to French.", "input": "good morning", "output": "Bonjour."},
]


def _reference_ids(tokenizer: Tokenizer, record: dict[str, str]) -> tuple[list[int], int]:
    """(prompt + response ids, prompt length) with litgpt's own per-call encode, the way its SFTDataset builds them."""
    prompt = PromptStyle.from_name("alpaca").apply(prompt=record["instruction"], input=record["input"])
    prompt_ids = tokenizer.encode(prompt).tolist()
    return prompt_ids + tokenizer.encode(record["output"], bos=False, eos=True).tolist(), len(prompt_ids)


@pytest.mark.parametrize("with_bos", [False, True])
def test_labels_are_shifted_and_masked_exactly_on_the_prompt(tokenizer, bos_tokenizer, with_bos):
    tok = bos_tokenizer if with_bos else tokenizer
    dataset = SFTDataset(tokenize_records(RECORDS, tok, "alpaca", max_seq_length=1000, mask_prompt=True))
    assert len(dataset) == 3
    for i, record in enumerate(RECORDS):
        ids, p = _reference_ids(tok, record)
        sample = dataset[i]
        assert sample["input_ids"].dtype == sample["labels"].dtype == torch.int64
        assert sample["input_ids"].tolist() == ids[:-1]
        labels = sample["labels"].tolist()
        assert labels[: p - 1] == [IGNORE_INDEX] * (p - 1)  # positions whose next token is still the prompt
        assert labels[p - 1 :] == ids[p:]  # first kept label: the first response token; last: EOS
        assert labels[-1] == tok.eos_id
        assert (sample["input_ids"][0].item() == tok.bos_id) == with_bos
    assert dataset.lengths.tolist() == [len(_reference_ids(tok, r)[0]) - 1 for r in RECORDS]


def test_without_mask_prompt_every_label_is_the_next_token(tokenizer):
    sample = SFTDataset(tokenize_records(RECORDS, tokenizer, "alpaca", 1000, mask_prompt=False))[1]
    ids, _ = _reference_ids(tokenizer, RECORDS[1])
    assert sample["labels"].tolist() == ids[1:]


def test_truncation_and_dropping_are_counted(tokenizer):
    records = [
        {"instruction": "Hi.", "input": "", "output": "The quick brown fox jumps over the lazy dog, twice."},  # cut
        {"instruction": "Hi.", "input": "", "output": "Red."},  # fits
        {"instruction": "Hi. " * 20, "input": "", "output": "Red."},  # prompt alone is too long: dropped
    ]
    prompt_lengths = [_reference_ids(tokenizer, r)[1] for r in records]
    full_lengths = [len(_reference_ids(tokenizer, r)[0]) for r in records]
    msl = prompt_lengths[0] + 2  # record 0 keeps its prompt and 2 response tokens
    assert full_lengths[0] - 1 > msl >= full_lengths[1] - 1 and prompt_lengths[2] >= msl + 1
    data = tokenize_records(records, tokenizer, "alpaca", max_seq_length=msl, mask_prompt=True)
    stats = data.stats
    assert (stats.records, stats.samples, stats.truncated, stats.dropped) == (3, 2, 1, 1)
    dataset = SFTDataset(data)
    truncated = dataset[0]
    assert len(truncated["input_ids"]) == msl
    ids, p = _reference_ids(tokenizer, records[0])
    assert truncated["input_ids"].tolist() == ids[:msl]
    assert truncated["labels"].tolist() == [IGNORE_INDEX] * (p - 1) + ids[p : msl + 1]
    assert truncated["labels"][-1].item() != tokenizer.eos_id  # the EOS was cut off with the tail
    assert dataset[1]["input_ids"].tolist() == _reference_ids(tokenizer, records[1])[0][:-1]
    lengths = [msl, full_lengths[1] - 1]
    assert (stats.tokens, stats.min_length, stats.max_length) == (sum(lengths), min(lengths), max(lengths))
    assert stats.mean_length == pytest.approx(sum(lengths) / 2)
    assert stats.loss_tokens == sum(int((dataset[i]["labels"] != IGNORE_INDEX).sum()) for i in range(2))
    assert "1 truncated" in stats.describe() and "1 dropped" in stats.describe()


def test_a_prompt_of_exactly_max_seq_length_keeps_one_loss_token(tokenizer):
    ids, p = _reference_ids(tokenizer, RECORDS[1])
    sample = SFTDataset(tokenize_records(RECORDS[1:2], tokenizer, "alpaca", max_seq_length=p, mask_prompt=True))[0]
    assert len(sample["input_ids"]) == p
    assert sample["labels"].tolist() == [IGNORE_INDEX] * (p - 1) + [ids[p]]
    too_short = tokenize_records(RECORDS[1:2], tokenizer, "alpaca", max_seq_length=p - 1, mask_prompt=True)
    assert too_short.stats.dropped == 1 and len(too_short) == 0


def test_storage_is_one_flat_int32_tensor(tokenizer):
    data = tokenize_records(RECORDS, tokenizer, "alpaca", 1000, mask_prompt=True)
    assert data.tokens.dtype == torch.int32 and data.tokens.dim() == 1
    stored = sum(len(_reference_ids(tokenizer, r)[0]) for r in RECORDS)  # max_seq_length + 1 ids at most per sample
    assert data.offsets.tolist()[-1] == data.tokens.numel() == stored


@pytest.mark.parametrize("with_bos", [False, True])
def test_batch_fast_path_matches_litgpt_encode(tokenizer, bos_tokenizer, with_bos):
    tok = bos_tokenizer if with_bos else tokenizer
    texts = ["Hello world.", "", "<s> already starts with BOS", "ends with EOS </s>", "ünïcode ✓"]
    for bos, eos in [(None, False), (False, True), (True, True)]:
        expected = [tok.encode(t, bos=bos, eos=eos).tolist() for t in texts]
        assert tokenize_module._encode_many(tok, texts, bos=bos, eos=eos) == expected


def test_fast_path_falls_back_to_litgpt_encode_when_they_disagree(tokenizer):
    class Drifted(Tokenizer):  # stands for a future litgpt whose encode rules changed
        def encode(self, string, device=None, bos=None, eos=False, max_length=-1):
            return torch.tensor([7, *super().encode(string, bos=bos, eos=eos).tolist()], dtype=torch.int)

    drifted = Drifted.__new__(Drifted)
    drifted.__dict__.update(tokenizer.__dict__)
    texts = ["one", "two"]
    assert tokenize_module._encode_many(drifted, texts, bos=False, eos=True) == [
        drifted.encode(t, bos=False, eos=True).tolist() for t in texts
    ]


def test_unknown_prompt_style_is_a_config_error_with_suggestion(tokenizer):
    with pytest.raises(ConfigError, match=r"data.prompt_style: 'alpacca'.*did you mean 'alpaca'"):
        tokenize_records(RECORDS, tokenizer, "alpacca", 100, True)


# ----------------------------------------------------------------------------------------------------------------------
# Collate and the DataLoader
# ----------------------------------------------------------------------------------------------------------------------


def _sample(input_ids: list[int], labels: list[int]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor(input_ids), "labels": torch.tensor(labels)}


def test_collate_pads_and_counts():
    samples = [
        _sample([5, 6, 7], [IGNORE_INDEX, 7, 8]),
        _sample([9], [10]),
        _sample([11, 12, 13, 14], [IGNORE_INDEX, IGNORE_INDEX, 14, 15]),
    ]
    batch = collate(samples, pad_id=3)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 3], [9, 3, 3, 3], [11, 12, 13, 14]]
    assert batch["labels"].tolist() == [
        [IGNORE_INDEX, 7, 8, IGNORE_INDEX],
        [10, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX],
        [IGNORE_INDEX, IGNORE_INDEX, 14, 15],
    ]
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
    counts = {k: batch[k] for k in ("tokens_real", "tokens_padded", "loss_tokens", "samples")}
    assert counts == {"tokens_real": 8, "tokens_padded": 12, "loss_tokens": 5, "samples": 3}
    assert all(type(v) is int for v in counts.values())


def test_dataloader_with_a_worker_yields_the_sampler_batches(tokenizer):
    dataset = SFTDataset(tokenize_records(RECORDS * 4, tokenizer, "alpaca", 1000, mask_prompt=True))
    sampler = EpochBatchSampler(dataset.lengths, micro_batch_size=5, shuffle=True, seed=3)
    loader = build_dataloader(dataset, sampler, pad_id=choose_pad_id(tokenizer), num_workers=1)
    assert pickle.loads(pickle.dumps(loader.collate_fn))([dataset[0]])["samples"] == 1
    assert loader.pin_memory is torch.cuda.is_available() and loader.persistent_workers
    sampler.set_epoch(1)
    expected_batches = list(sampler)
    batches = list(loader)
    assert len(batches) == len(loader) == 2  # 12 samples // 5; 2 not seen this epoch
    for batch, indices in zip(batches, expected_batches):
        expected = collate([dataset[i] for i in indices], pad_id=tokenizer.eos_id)
        assert torch.equal(batch["input_ids"], expected["input_ids"])
        assert torch.equal(batch["labels"], expected["labels"])
        assert batch["tokens_real"] == sum(dataset.lengths[i].item() for i in indices)
    assert build_dataloader(dataset, sampler, 0, num_workers=0).persistent_workers is False


def test_pad_id_prefers_pad_then_eos_then_zero(tokenizer):
    assert choose_pad_id(tokenizer) == tokenizer.eos_id == 1

    class Fake:
        pad_id, eos_id = 9, 1

    assert choose_pad_id(Fake()) == 9
    Fake.pad_id = Fake.eos_id = None
    assert choose_pad_id(Fake()) == 0


# ----------------------------------------------------------------------------------------------------------------------
# The sampler
# ----------------------------------------------------------------------------------------------------------------------


def epoch_batches(sampler: EpochBatchSampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


def test_sampler_is_deterministic_per_seed_and_differs_per_epoch():
    a, b = (EpochBatchSampler(20, 4, shuffle=True, seed=1) for _ in range(2))
    assert epoch_batches(a, 0) == epoch_batches(b, 0)
    assert epoch_batches(a, 0) != epoch_batches(a, 1)
    assert epoch_batches(a, 0) != epoch_batches(EpochBatchSampler(20, 4, shuffle=True, seed=2), 0)
    # Hash-mixed seeds: seed 1 epoch 1 is not seed 2 epoch 0 (seed + epoch would make them equal).
    assert epoch_batches(a, 1) != epoch_batches(EpochBatchSampler(20, 4, shuffle=True, seed=2), 0)
    assert epoch_batches(a, 0) == epoch_batches(b, 0)  # going back to an epoch replays it
    assert sorted(i for batch in epoch_batches(a, 3) for i in batch) == list(range(20))


def test_unshuffled_sampler_keeps_order_and_short_last_batch():
    sampler = EpochBatchSampler(10, 4, shuffle=False, seed=0, drop_last=False)
    assert len(sampler) == 3
    assert epoch_batches(sampler, 5) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize(
    ("n", "m", "world", "drop_last", "batches", "unseen"),
    [(10, 3, 1, True, 3, 1), (10, 3, 1, False, 4, 0), (11, 2, 2, True, 2, 3), (11, 2, 2, False, 3, 1)],
)
def test_sampler_length_and_unseen_samples(n, m, world, drop_last, batches, unseen):
    samplers = [EpochBatchSampler(n, m, True, 0, rank, world, drop_last) for rank in range(world)]
    assert [len(s) for s in samplers] == [batches] * world
    assert samplers[0].unseen_per_epoch == unseen
    seen = [i for s in samplers for batch in epoch_batches(s, 2) for i in batch]
    assert len(seen) == len(set(seen)) == n - unseen


def test_ranks_get_disjoint_equal_shares_of_one_permutation():
    world = 3
    samplers = [EpochBatchSampler(50, 4, True, 11, rank, world) for rank in range(world)]  # no lengths: dealt in turn
    per_rank = [epoch_batches(s, 1) for s in samplers]
    assert len({len(batches) for batches in per_rank}) == 1 and len(per_rank[0]) == 50 // 3 // 4
    flat = [[i for batch in batches for i in batch] for batches in per_rank]
    assert all(set(flat[r]).isdisjoint(flat[q]) for r in range(world) for q in range(r + 1, world))
    # Interleaving the ranks' micro-batches gives back the single-device permutation of this epoch.
    single = [i for batch in epoch_batches(EpochBatchSampler(50, 1, True, 11), 1) for i in batch]
    interleaved = [flat[r][j] for j in range(len(flat[0])) for r in range(world)]
    assert interleaved == single[: len(interleaved)]


def test_ranks_split_each_step_by_positions_when_lengths_are_known():
    from litft.data.sampler import balanced_shares

    # 4 samples over 2 ranks: dealt in turn rank 0 gets 500 + 400 and rank 1 gets 10 + 20; balanced, 500 + 10 / 400 + 20
    assert balanced_shares([0, 1, 2, 3], [500, 10, 400, 20], 2) == [[0, 1], [2, 3]]
    lengths = _lognormal_lengths(640, seed=3)
    world, m = 2, 8
    balanced = [epoch_batches(EpochBatchSampler(lengths, m, True, 5, rank, world), 1) for rank in range(world)]
    dealt = [epoch_batches(EpochBatchSampler(len(lengths), m, True, 5, rank, world), 1) for rank in range(world)]
    assert all(len(batch) == m for batches in balanced for batch in batches)
    for step in range(len(balanced[0])):  # each step trains on the same samples, only split differently
        assert sorted(balanced[0][step] + balanced[1][step]) == sorted(dealt[0][step] + dealt[1][step])

    def busiest(shares) -> int:  # positions of a step's busiest rank, summed over the epoch
        return sum(max(sum(lengths[i] for i in shares[r][step]) for r in range(world)) for step in range(len(shares[0])))

    total = sum(lengths[i] for batches in balanced for batch in batches for i in batch)
    assert busiest(balanced) < 1.02 * total / world < busiest(dealt)


def test_exhausted_epoch_restarts_at_batch_zero_until_set_epoch():
    sampler = EpochBatchSampler(12, 4, True, 5)
    sampler.set_epoch(2)
    first = list(sampler)
    assert sampler.state_dict()["batch_index"] == 3
    assert list(sampler) == first
    assert epoch_batches(sampler, 3) != first


def _training_run(sampler: EpochBatchSampler, epochs: int, start: dict | None = None) -> list[tuple[int, list[int]]]:
    """A training loop's use of the sampler: resume if given a position, set_epoch at each epoch start."""
    if start is not None:
        sampler.load_state_dict(start)
    first_epoch = sampler.epoch if start is not None else 0
    seen = []
    for epoch in range(first_epoch, epochs):
        sampler.set_epoch(epoch)
        seen += [(epoch, batch) for batch in sampler]
    return seen


@pytest.mark.parametrize("consumed", [0, 1, 4, 5, 6, 9, 15])  # 5 batches per epoch, 3 epochs
def test_resume_continues_at_exactly_the_next_micro_batch(consumed):
    make = lambda: EpochBatchSampler(43, 4, shuffle=True, seed=42, rank=1, world_size=2)  # noqa: E731
    reference = _training_run(make(), epochs=3)
    assert len(reference) == 15
    # The loop consumes `consumed` micro-batches, counting them itself, and checkpoints its position.
    epoch, in_epoch = divmod(consumed, 5)
    if consumed and in_epoch == 0:  # the checkpoint was taken right after an epoch's last batch
        epoch, in_epoch = epoch - 1, 5
    saved = make().position(epoch, in_epoch)
    assert _training_run(make(), epochs=3, start=saved) == reference[consumed:]


def test_sampler_state_dict_tracks_batches_handed_out():
    sampler = EpochBatchSampler(20, 4, shuffle=True, seed=0)
    sampler.set_epoch(1)
    iterator = iter(sampler)
    taken = [next(iterator), next(iterator)]
    state = sampler.state_dict()
    assert (state["epoch"], state["batch_index"]) == (1, 2)
    assert state == sampler.position(1, 2)
    fresh = EpochBatchSampler(20, 4, shuffle=True, seed=0)
    fresh.load_state_dict(state)
    assert taken + list(fresh) == epoch_batches(EpochBatchSampler(20, 4, shuffle=True, seed=0), 1)


def test_resume_far_into_a_large_epoch_starts_right_there():
    # The skip is a slice of the recomputed permutation; no consumed batch is produced on the way.
    sampler = EpochBatchSampler(1_000_000, 1, shuffle=False, seed=0)
    sampler.load_state_dict(sampler.position(0, 999_998))
    assert list(sampler) == [[999_998], [999_999]]


def test_set_epoch_keeps_a_restored_position_only_for_its_epoch():
    sampler = EpochBatchSampler(20, 4, shuffle=True, seed=0)
    sampler.load_state_dict(sampler.position(2, 3))
    sampler.set_epoch(2)  # the loop's usual call at the start of the resumed epoch
    assert len(list(sampler)) == 2
    sampler.load_state_dict(sampler.position(2, 3))
    sampler.set_epoch(0)  # another epoch: from its start
    assert len(list(sampler)) == 5


def test_restoring_a_position_from_another_setup_is_refused():
    saved = EpochBatchSampler(20, 4, shuffle=True, seed=0, world_size=2).position(1, 1)
    with pytest.raises(CheckpointError, match=r"world_size 2 \(this run: 1\)"):
        EpochBatchSampler(20, 4, shuffle=True, seed=0).load_state_dict(saved)
    with pytest.raises(CheckpointError, match=r"micro_batch_size 4 \(this run: 2\)"):
        EpochBatchSampler(20, 2, shuffle=True, seed=0, world_size=2).load_state_dict(saved)
    with pytest.raises(CheckpointError, match="outside"):
        EpochBatchSampler(20, 4, shuffle=True, seed=0).load_state_dict({"epoch": 0, "batch_index": 6})


def test_fabric_loader_wrapper_cannot_reset_the_epoch():
    # Fabric's dataloader wrapper calls batch_sampler.sampler.set_epoch(<its own iteration count>), which restarts at
    # 0 after a resume; the sampler must not be reachable that way.
    from lightning.fabric.utilities.data import _set_sampler_epoch

    sampler = EpochBatchSampler(20, 4, shuffle=True, seed=0)
    sampler.load_state_dict(sampler.position(3, 2))
    loader = torch.utils.data.DataLoader(list(range(20)), batch_sampler=sampler)
    _set_sampler_epoch(loader, 0)
    assert sampler.state_dict()["epoch"] == 3 and len(list(loader)) == 3


def test_too_few_samples_for_one_micro_batch_is_a_data_error():
    with pytest.raises(DataError, match=r"3 samples over 2 rank\(s\) give no full micro-batch of 2"):
        EpochBatchSampler(3, 2, shuffle=True, seed=0, world_size=2)
    assert len(EpochBatchSampler(3, 2, shuffle=False, seed=0, world_size=2, drop_last=False)) == 1


# ----------------------------------------------------------------------------------------------------------------------
# prepare_data
# ----------------------------------------------------------------------------------------------------------------------


def _records(n: int) -> list[dict[str, str]]:
    return [{"instruction": f"Repeat the number {i}.", "input": "", "output": f"{i}"} for i in range(n)]


def test_prepare_data_splits_tokenizes_and_picks_pad(tmp_path, tokenizer):
    path = write(tmp_path / "d.jsonl", jsonl(*_records(40)))
    prepared = prepare_data(DataConfig(path=str(path), val_split=0.1, max_seq_length=200), tokenizer, seed=1)
    assert (len(prepared.train), len(prepared.val)) == (36, 4)
    assert prepared.pad_id == tokenizer.eos_id
    again = prepare_data(DataConfig(path=str(path), val_split=0.1, max_seq_length=200), tokenizer, seed=1)
    assert torch.equal(again.val.data.tokens, prepared.val.data.tokens)
    assert any("36 samples" in line for line in prepared.describe())


def test_prepare_data_reads_val_path(tmp_path, tokenizer):
    train = write(tmp_path / "train.jsonl", jsonl(*_records(5)))
    val = write(tmp_path / "val.json", json.dumps(_records(2)))
    prepared = prepare_data(DataConfig(path=str(train), val_path=str(val)), tokenizer, seed=0)
    assert (len(prepared.train), len(prepared.val)) == (5, 2)
    assert prepared.val_source == str(val)


def test_prepare_data_errors_name_their_file(tmp_path, tokenizer):
    train = write(tmp_path / "train.jsonl", jsonl(*_records(5)))
    bad_val = write(tmp_path / "val.jsonl", jsonl({"instruction": "x"}))
    with pytest.raises(DataError, match=r"val\.jsonl: line 1: missing key 'output'"):
        prepare_data(DataConfig(path=str(train), val_path=str(bad_val)), tokenizer, seed=0)
    with pytest.raises(DataError, match=r"every training record was dropped.*data.max_seq_length \(5\)"):
        prepare_data(DataConfig(path=str(train), val_path=str(train), max_seq_length=5), tokenizer, seed=0)
    with pytest.raises(ConfigError, match="prompt_style"):
        prepare_data(DataConfig(path=str(tmp_path / "absent.jsonl"), prompt_style="nope"), tokenizer, seed=0)


def test_largest_batches_have_the_largest_shape_the_data_can_form_and_the_next_smaller():
    from litft.data import GRAPH_MULTIPLE, collate_function, largest_batches

    lengths = torch.tensor([40, 700, 300, 512, 90])
    packed = collate_function(pad_id=0, packing=True, fixed_shapes=True, micro_batch_size=3)
    largest, smaller = largest_batches(lengths, 3, packed, pad_id=0)
    assert largest["input_ids"].shape == (1, 1536)  # 700 + 512 + 300 = 1,512 -> next multiple of 256
    assert smaller["input_ids"].shape == (1, 1536 - GRAPH_MULTIPLE)  # the longest 256 shorter: 1,256 -> 1,280
    assert largest["cu_seqlens"].shape == smaller["cu_seqlens"].shape == (3 + 2,)  # one length for every batch
    assert set(largest) >= {"input_ids", "labels", "positions", "cu_seqlens"}
    padded = collate_function(pad_id=0, packing=False, fixed_shapes=True, micro_batch_size=3)
    largest, smaller = largest_batches(lengths, 3, padded, pad_id=0)
    assert largest["input_ids"].shape == (3, 704) and smaller["input_ids"].shape == (3, 512)  # rows of 64


def test_fill_micro_batches_packs_a_step_into_few_full_micro_batches():
    from litft.data import fill_micro_batches

    lengths = [300, 100, 512, 50, 250, 400, 30, 200]  # 1,842 positions
    groups = fill_micro_batches(lengths, capacity=1024)
    assert sorted(i for g in groups for i in g) == list(range(8))  # every sample once
    assert all(sum(lengths[i] for i in g) <= 1024 for g in groups)
    assert len(groups) == 2  # the fewest possible: 1,842 > 1,024
    assert all(g == sorted(g) for g in groups)
    # first-fit decreasing by hand: 512, 400 (112 left) | 300, 250, 200 (274 left) | 100 fits the first,
    # 50 and 30 only the second
    assert [sorted(lengths[i] for i in g) for g in groups] == [[100, 400, 512], [30, 50, 200, 250, 300]]
    with pytest.raises(ValueError, match="does not fit"):
        fill_micro_batches([2000], capacity=1024)


def _lognormal_lengths(n: int, seed: int, median: float = 212.0) -> list[int]:
    """Alpaca-like lengths (benchmarks/make_bench_data.py's log-normal: mean ~245 at median 212), cut to 20-512."""
    generator = torch.Generator().manual_seed(seed)
    draws = torch.exp(torch.randn(n, generator=generator) * 0.536 + torch.log(torch.tensor(median)))
    return draws.round().clamp(20, 512).int().tolist()


def test_fit_steps_fits_steps_by_swapping_and_keeps_every_sample_once():
    from litft.data import fill_micro_batches, fit_steps

    lengths = _lognormal_lengths(992, seed=0)  # 62 steps of 16, ~3,900 positions each
    order = torch.randperm(992, generator=torch.Generator().manual_seed(1)).tolist()
    fitted = fit_steps(order, lengths, group=16, capacity=4096)
    assert sorted(fitted) == list(range(992))  # a permutation: every sample once

    def overflowing(o: list[int]) -> int:
        return sum(len(fill_micro_batches([lengths[i] for i in o[s:s + 16]], 4096)) > 1 for s in range(0, 992, 16))

    # shuffled, about a quarter of the steps take a second micro-batch; fitted, one or two at most
    assert overflowing(order) >= 10 and overflowing(fitted) <= 2, (overflowing(order), overflowing(fitted))
    # a step that already fits is the shuffled order's own step; the rest differ by a few swapped samples
    for s in range(0, 992, 16):
        if sum(lengths[i] for i in order[s:s + 16]) <= 4096 and fitted[:s] == order[:s]:
            assert fitted[s:s + 16] == order[s:s + 16]
    moved = sum(a != b for a, b in zip(order, fitted))
    assert moved < 0.4 * len(order), moved
    # the swaps reach no further than the window: each sample lands within 64 + 16 places of where it was...
    place = {i: k for k, i in enumerate(order)}
    assert max(k - place[i] for k, i in enumerate(fitted)) <= 16 * 62  # (a long sample may be put off repeatedly)
    assert max(place[i] - k for k, i in enumerate(fitted)) <= 64 + 16  # ...when it is brought forward
    # nothing to swap in (one step), or every sample too long: the order is kept, the step overflows
    assert fit_steps([0, 1, 2], [300, 300, 300], group=3, capacity=512) == [0, 1, 2]
    assert fit_steps([0, 1, 2, 3], [300, 300, 400, 400], group=2, capacity=512) == [0, 1, 2, 3]
    # the nearest sample short enough is the one swapped in: step [0, 1] is 300 + 300 > 512, sample 3 (200) fits
    assert fit_steps([0, 1, 2, 3], [300, 300, 250, 200], group=2, capacity=512) == [3, 1, 2, 0]


def test_sampler_fits_each_ranks_steps_and_records_the_capacity():
    from litft.data import fill_micro_batches

    lengths = _lognormal_lengths(640, seed=2)
    plain = EpochBatchSampler(lengths, 16, shuffle=True, seed=5)
    fitted = EpochBatchSampler(lengths, 16, shuffle=True, seed=5, fit_capacity=4096)
    assert fitted.fit_positions == 4096  # 16 x ~245 needs one micro-batch of 4,096
    assert EpochBatchSampler(lengths, 40, True, 5, fit_capacity=4096).fit_positions == 3 * 4096  # 40 x ~245

    def passes(batches: list[list[int]], capacity: int = 4096) -> int:
        return sum(len(fill_micro_batches([lengths[i] for i in b], capacity)) for b in batches)

    a, b = epoch_batches(plain, 1), epoch_batches(fitted, 1)
    assert len(a) == len(b) == 40 and all(len(x) == 16 for x in b)
    assert sorted(i for x in a for i in x) == sorted(i for x in b for i in x)  # the same samples this epoch
    assert passes(b) <= 41 < passes(a)
    assert epoch_batches(fitted, 1) == b and epoch_batches(fitted, 2) != b  # deterministic per epoch
    # on two ranks: the epoch's order is fitted step by step (16 samples into 2 x 2,048), then split evenly; the
    # greedy split may leave a rank a few positions over (3 of 80 rank-steps here), against 23 unfitted
    shares = [epoch_batches(EpochBatchSampler(lengths, 8, True, 5, rank, 2, fit_capacity=2048), 1) for rank in (0, 1)]
    unfitted = [epoch_batches(EpochBatchSampler(lengths, 8, True, 5, rank, 2), 1) for rank in (0, 1)]
    assert sorted(i for r in (0, 1) for x in shares[r] for i in x) == sorted(i for r in (0, 1) for x in unfitted[r]
                                                                                for i in x)
    assert passes(shares[0] + shares[1], 2048) <= 80 + 3 < 80 + 20 < passes(unfitted[0] + unfitted[1], 2048)
    # the position records the capacity: a resume under another one (other steps) is refused
    state = fitted.position(1, 3)
    assert state["fit_capacity"] == 4096
    with pytest.raises(CheckpointError, match="fit_capacity"):
        EpochBatchSampler(lengths, 16, True, 5, fit_capacity=4608).load_state_dict(state)
    with pytest.raises(ValueError, match="lengths"):
        EpochBatchSampler(640, 16, True, 5, fit_capacity=4096)


def test_step_packed_collate_keeps_every_sample_and_its_loss_tokens():
    from litft.data import collate_packed, collate_step_packed

    samples = [{"input_ids": torch.arange(n) + 1, "labels": torch.arange(n) + 1} for n in (7, 3, 9, 2, 5)]
    for sample in samples:
        sample["labels"][:2] = IGNORE_INDEX  # a prompt of 2
    micro = collate_step_packed(samples, pad_id=0, capacity=12, multiple=4, segments=6)
    whole = collate_packed(samples, pad_id=0)
    assert len(micro) == 3  # 9+3 | 7+5 | 2 (first-fit decreasing into 12 positions)
    assert sum(m["tokens_real"] for m in micro) == whole["tokens_real"] == 26
    assert sum(m["loss_tokens"] for m in micro) == whole["loss_tokens"] == 16
    assert sorted(n for m in micro for n in m["lengths"]) == [2, 3, 5, 7, 9]
    assert all(m["input_ids"].shape[1] <= 12 and m["cu_seqlens"].shape == (7,) for m in micro)


def test_largest_batches_under_pack_steps_fill_the_capacity():
    from litft.data import collate_function, largest_batches

    lengths = torch.tensor([100, 120, 90, 80, 70, 60, 50, 40])
    one_row = collate_function(pad_id=0, packing=True, fixed_shapes=True, micro_batch_size=8)
    largest, smaller = largest_batches(lengths, 8, one_row, pad_id=0, capacity=512)
    assert largest["input_ids"].shape == (1, 512)  # 120+100+90+80+70+52 (the last cut) fill 512 positions
    assert largest["cu_seqlens"].shape == (8 + 2,)


def test_largest_batches_give_every_packed_width_for_up_front_captures():
    """CUDA graphs capture each row width before training: stand-ins of every width GRAPH_MULTIPLE apart, largest
    first, each with the fixed cu_seqlens length of the run's micro-batches and no more samples than they hold."""
    from litft.data import GRAPH_MULTIPLE, collate_function, largest_batches

    lengths = torch.tensor([512] * 10 + [100] * 5)
    packed = collate_function(pad_id=0, packing=True, fixed_shapes=True, micro_batch_size=4)
    batches = largest_batches(lengths, 4, packed, pad_id=0, widths=16)
    assert [b["input_ids"].shape[1] for b in batches] == [2048, 1792, 1536, 1280, 1024, 768, 512, 256]
    assert all(b["tokens_real"] == b["tokens_padded"] for b in batches[2:])  # each exactly fills its width
    assert {tuple(b["cu_seqlens"].shape) for b in batches} == {(4 + 2,)} and max(b["samples"] for b in batches) <= 4
    assert len(largest_batches(lengths, 4, packed, pad_id=0, widths=3)) == 3
    assert len(largest_batches(lengths, 4, packed, pad_id=0)) == 2  # the default: the largest and the next smaller
    padded = collate_function(pad_id=0, packing=False, fixed_shapes=True, micro_batch_size=4)
    assert len(largest_batches(lengths, 4, padded, pad_id=0, widths=16)) == 2  # (B, T) shapes: captured as met
    assert GRAPH_MULTIPLE == 256


def test_a_data_set_by_name_comes_from_the_cache_and_offline_says_how_to_supply_it(tiny_recipe, tmp_path, monkeypatch):
    """data.path alpaca2k: fetched once into litft's cache (the tests' cache is a temporary folder); without the
    `datasets` package or a network, a data error (exit 5) naming the repository and where the file may go."""
    import sys

    from litft.data import sources
    from litft.errors import DataError
    from litft.recipe import validate

    recipe = tiny_recipe(data={"path": "alpaca2k", "val_split": 0.5})
    assert validate(recipe, check_paths=True) == []  # a name, not a missing file
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails, as where it is not installed
    with pytest.raises(DataError, match="mhenrichsen/alpaca_2k_test.*pip install datasets.*alpaca2k.json"):
        sources.local_path("alpaca2k")
    cached = sources.cache_dir() / "alpaca2k.json"
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps([{"instruction": f"Say {i}.", "input": "", "output": f"{i} said."}
                                  for i in range(40)]))
    from litft import finetune

    run = finetune(tiny_recipe(data={"path": "alpaca2k", "val_split": 0.5}, train={"max_steps": 1}))
    assert run.status == "ok" and run.result["data"]["train"]["samples"] == 20
    assert run.result["data"]["train_source"] == str(cached)
