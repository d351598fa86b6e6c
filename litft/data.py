"""Instruction data: read Alpaca-format records, tokenize them once, batch them, and sample them resumably.

The path from a file to a training batch, in the order ``prepare_data`` runs it:

1. :func:`read_records` reads a ``.json`` list or a ``.jsonl`` file into ``{"instruction", "input", "output"}``
   records. Every problem is a :class:`~litft.errors.DataError` (exit 5) that names the file, the line (and for
   JSON the record's index), the key and what was expected. This all happens before any model is loaded.
2. :func:`split_records` holds out a fixed, seeded validation share (unless ``data.val_path`` is set).
3. :func:`tokenize_records` turns each record into token ids ONCE, up front (litgpt's own ``SFTDataset``
   re-tokenizes on every ``__getitem__``, i.e. every epoch, in every worker). It reuses litgpt's ``PromptStyle``
   and ``Tokenizer`` rules. The ids of all samples live in one flat int32 tensor plus offsets: 50k samples of
   ~300 tokens take ~60 MB, and forked DataLoader workers share those pages. A list of 50k Python lists would be
   copied page by page as the workers touch its reference counts.
4. :class:`SFTDataset` hands out ``input_ids``/``labels`` that are already shifted for next-token prediction:
   the loss is ``cross_entropy(logits, labels)`` with no further slicing.
5. :class:`EpochBatchSampler` yields micro-batches of indices per rank. Its position (epoch, batch index) can be
   restored in O(1), so a resumed run continues at exactly the next micro-batch.
6. :func:`collate` pads a micro-batch and counts its real, padded and loss tokens on the CPU, in the loader, so
   the training loop logs throughput without device syncs.

Not here (yet): plain-text data, sequence packing, a cache of tokenized data on disk.
"""

from __future__ import annotations

import codecs
import difflib
import functools
import hashlib
import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from litgpt.prompts import PromptStyle, prompt_styles
from litgpt.tokenizer import Tokenizer
from torch.utils.data import DataLoader, Dataset, Sampler

from litft.errors import CheckpointError, ConfigError, DataError
from litft.recipe import DataConfig, DataFields, resolve_path

IGNORE_INDEX = -100
"""Label value that gets no loss (``torch.nn.functional.cross_entropy``'s default ``ignore_index``)."""

SUPPORTED_SUFFIXES = (".json", ".jsonl")

# ----------------------------------------------------------------------------------------------------------------------
# Reading records
# ----------------------------------------------------------------------------------------------------------------------


def read_records(path: Path, fields: DataFields) -> list[dict[str, str]]:
    """Read Alpaca-format records: a ``.json`` file holding a list of objects, or a ``.jsonl`` file with one object
    per line (blank lines are skipped).

    Each record becomes ``{"instruction": str, "input": str, "output": str}``, read from the keys named in ``fields``.
    The input may be missing or null, which gives "". Other keys are ignored. Values must be strings. Numbers are
    accepted and converted with ``str()``, because answers such as ``"output": 42`` are common in arithmetic data
    sets and there is only one way to read them. Booleans, null (for instruction or output), lists and objects are
    errors: there is no single right text for them. An output that is empty or only whitespace is an error, because
    the record would teach nothing but the end-of-sequence token.

    Raises DataError with one message naming the file, the line (JSON: also the record's index), the key and what was
    expected.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such data file{_sibling_hint(path)}")
    if not path.is_file():
        raise DataError(f"{path}: is a directory, not a data file; expected a .json or .jsonl file")
    if path.suffix.lower() not in SUPPORTED_SUFFIXES:
        raise DataError(
            f"{path}: unsupported data format '{path.suffix or '(no suffix)'}'; supported are .json (a list of"
            " records) and .jsonl (one record per line), each record an object with instruction, input and output"
        )
    text = _read_utf8(path)
    if not text.strip():
        raise DataError(
            f"{path}: the file is empty ({'0 bytes' if not text else 'only whitespace'}); expected Alpaca-format"
            f" records with keys '{fields.instruction}', '{fields.input}' (optional) and '{fields.output}'"
        )
    if path.suffix.lower() == ".jsonl":
        records = _read_jsonl(path, text, fields)
    else:
        records = _read_json(path, text, fields)
    if not records:
        raise DataError(f"{path}: the file holds no records; expected at least one")
    return records


def _read_utf8(path: Path) -> str:
    """The file's text; non-UTF-8 bytes raise DataError with the line where the first bad byte is."""
    data = path.read_bytes()
    # Editors on Windows often write a UTF-8 byte-order mark; json.loads rejects it, but the text is fine.
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as err:
        position = bom + err.start
        line = data.count(b"\n", 0, position) + 1
        column = position - (data.rfind(b"\n", 0, position) + 1) + 1
        hint = ""
        if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
            hint = " (the file starts with a UTF-16 byte-order mark: it was saved as UTF-16)"
        raise DataError(
            f"{path}: line {line}: byte 0x{data[position]:02x} at byte column {column} is not valid UTF-8{hint};"
            " save the file as UTF-8"
        ) from None


def _read_jsonl(path: Path, text: str, fields: DataFields) -> list[dict[str, str]]:
    records = []
    # Split on "\n" only: str.splitlines() also splits on U+2028, U+0085, ... which may appear unescaped inside
    # JSON strings, and the line numbers would stop matching what an editor shows.
    lines = text.split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            hint = ""
            if number == 1 and line.strip() in ("[", "{"):
                hint = (
                    "; the file looks like one JSON document spread over lines: name it .json, or write one record"
                    " per line"
                )
            elif _ends_early(err, line) and all(not rest.strip() for rest in lines[number:]):
                hint = "; the last record ends early: is the file truncated?"
            raise DataError(f"{path}: line {number}, column {err.colno}: {_json_problem(err)}{hint}") from None
        records.append(_normalise(value, fields, path, f"line {number}"))
    return records


def _read_json(path: Path, text: str, fields: DataFields) -> list[dict[str, str]]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        hint = ""
        if err.msg == "Extra data":
            hint = "; the file holds more than one JSON value: if it has one record per line, name it .jsonl"
        elif _ends_early(err, text):
            hint = "; the file ends early: is it truncated?"
        raise DataError(f"{path}: line {err.lineno}, column {err.colno}: {_json_problem(err)}{hint}") from None
    if not isinstance(value, list):
        keys = f" with keys {_quoted(value)}" if isinstance(value, dict) else ""
        raise DataError(
            f"{path}: expected a JSON list of records at the top level ([{{...}}, {{...}}]), got {_json_type(value)}"
            f"{keys}"
        )
    records = []
    for index, item in enumerate(value):
        try:
            records.append(_normalise(item, fields, path, f"record [{index}]"))
        except DataError:
            # Found only on this error path (a second scan of the text): the line where the bad record starts.
            # Normalising again with it raises the same error, now saying where to look.
            _normalise(item, fields, path, f"record [{index}] (line {_json_list_item_line(text, index)})")
            raise
    return records


def _json_problem(err: json.JSONDecodeError) -> str:
    # The decoder's messages end in " at" before the position it appends; the position is in our prefix instead.
    message = err.msg[: -len(" at")] + " here" if err.msg.endswith(" at") else err.msg
    return f"invalid JSON: {message}"


def _ends_early(err: json.JSONDecodeError, text: str) -> bool:
    """Whether the JSON error comes from the text ending mid-value: the error is at the end, or a string is never
    closed (the decoder then points at where the string starts; raw newlines inside strings are an error of their
    own, so an unclosed string ran to the end)."""
    return err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated string")


def _json_list_item_line(text: str, index: int) -> int:
    """Line (1-based) where item ``index`` of the top-level JSON list in ``text`` starts (the text parsed fine)."""
    decoder = json.JSONDecoder()
    separator = re.compile(r"[\s,]*")  # JSON whitespace and commas between list items
    position = text.index("[") + 1
    for _ in range(index):
        position = separator.match(text, position).end()
        _, position = decoder.raw_decode(text, position)
    position = separator.match(text, position).end()
    return text.count("\n", 0, position) + 1


def _normalise(value: Any, fields: DataFields, path: Path, where: str) -> dict[str, str]:
    """One raw JSON value -> {"instruction", "input", "output"}, or DataError naming file, place and key."""
    if not isinstance(value, dict):
        raise DataError(
            f"{path}: {where}: expected an object {{\"{fields.instruction}\": ..., \"{fields.output}\": ...}},"
            f" got {_json_type(value)}"
        )
    record: dict[str, str] = {}
    for role, key, required in (
        ("instruction", fields.instruction, True),
        ("input", fields.input, False),
        ("output", fields.output, True),
    ):
        named = f"key '{key}'" if key == role else f"key '{key}' (the {role})"
        if key not in value or value[key] is None:
            if not required:
                record[role] = ""
                continue
            if key not in value:
                raise DataError(
                    f"{path}: {where}: missing {named}; the record has keys {_quoted(value)}. If the {role} is under"
                    f" another key, set data.fields.{role} to it"
                )
            raise DataError(f"{path}: {where}: {named} is null; expected a string")
        item = value[key]
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise DataError(f"{path}: {where}: {named} must be a string, got {_json_type(item)}")
        record[role] = item if isinstance(item, str) else str(item)
    if not record["output"].strip():
        raise DataError(f"{path}: {where}: key '{fields.output}' is empty: there is nothing to learn from this record")
    return record


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _quoted(mapping: dict) -> str:
    return ", ".join(f"'{k}'" for k in mapping) if mapping else "(none)"


def _sibling_hint(path: Path) -> str:
    parent = path.parent
    if not parent.is_dir():
        return f" (the directory '{parent}' does not exist either)"
    close = difflib.get_close_matches(path.name, [p.name for p in parent.iterdir() if p.is_file()], n=1, cutoff=0.8)
    return f"; did you mean '{parent / close[0]}'?" if close else ""


# ----------------------------------------------------------------------------------------------------------------------
# Train/validation split
# ----------------------------------------------------------------------------------------------------------------------


def split_records(
    records: Sequence[dict[str, str]], val_split: float, seed: int
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, val): a fixed, seeded split holding out round(n x val_split) records, at least 1 on each side.

    The split depends only on (number of records, val_split, seed): the same file and seed give the same split on
    every machine. Both parts keep the file's order (the training sampler shuffles anyway).
    """
    n = len(records)
    if not 0.0 < val_split < 1.0:
        raise ValueError(f"val_split must be within (0, 1), got {val_split}")
    if n < 2:
        raise DataError(
            f"the data set is too small to split: {n} record(s); holding out a validation set needs at least 2"
            " (1 to train on, 1 to validate on). Add records, or give a separate data.val_path"
        )
    n_val = min(n - 1, max(1, round(n * val_split)))
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=generator)
    val_indices = sorted(order[:n_val].tolist())
    train_indices = sorted(order[n_val:].tolist())
    return [records[i] for i in train_indices], [records[i] for i in val_indices]


# ----------------------------------------------------------------------------------------------------------------------
# Tokenization, once
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class TokenStats:
    """What tokenization did to a set of records; lengths are those of ``input_ids`` (max_seq_length at most)."""

    records: int
    """Records given to the tokenizer."""
    samples: int
    """Samples kept (records minus dropped)."""
    truncated: int
    """Kept samples that were cut to max_seq_length (their response lost its tail, maybe its end-of-sequence token)."""
    dropped: int
    """Records dropped because the prompt alone is longer than max_seq_length: no response token is left to learn."""
    tokens: int
    """Sum of the kept samples' lengths: the real (non-padding) input tokens of one pass over the set."""
    loss_tokens: int
    """Positions that get a loss in one pass (the response, or everything with mask_prompt off)."""
    min_length: int
    mean_length: float
    max_length: int
    max_seq_length: int

    def describe(self) -> str:
        """One line for the run log, e.g. '950 samples, 114,000 tokens (lengths 34 / 120.0 / 512), 3 truncated ...'."""
        text = (
            f"{self.samples:,} samples, {self.tokens:,} tokens (length min/mean/max {self.min_length} /"
            f" {self.mean_length:.1f} / {self.max_length}), {self.loss_tokens:,} with loss"
        )
        if self.truncated:
            text += f"; {self.truncated:,} truncated to max_seq_length {self.max_seq_length}"
        if self.dropped:
            text += (
                f"; {self.dropped:,} dropped (prompt alone longer than max_seq_length {self.max_seq_length}, no"
                " response left)"
            )
        return text


@dataclass
class TokenizedData:
    """Token ids of many samples in one flat tensor.

    Sample i's ids (prompt + response, up to max_seq_length + 1 of them) are ``tokens[offsets[i]:offsets[i + 1]]``.
    Its ``input_ids`` are all but the last and its ``labels`` all but the first. With ``mask_prompt``, the first
    ``prompt_lengths[i] - 1`` labels (those that predict a prompt token) are IGNORE_INDEX.
    """

    tokens: torch.Tensor
    """int32, all samples' ids back to back (int32 halves memory versus int64; vocabularies are < 2**31)."""
    offsets: torch.Tensor
    """int64, shape (samples + 1,)."""
    prompt_lengths: torch.Tensor
    """int32, prompt tokens of each sample (BOS included when the tokenizer adds one)."""
    mask_prompt: bool
    stats: TokenStats

    def __len__(self) -> int:
        return len(self.prompt_lengths)

    @property
    def lengths(self) -> torch.Tensor:
        """int64, length T of each sample's input_ids (ids stored minus the one lost to the shift)."""
        return self.offsets[1:] - self.offsets[:-1] - 1


_ENCODE_CHUNK = 2048
"""Records tokenized per chunk. A tokenizers ``Encoding`` also holds offsets, token strings and masks (~100 bytes
per token): 50k records in one batch call would hold ~1.5 GB at once, a chunk holds a few tens of MB."""


def tokenize_records(
    records: Sequence[dict[str, str]],
    tokenizer: Tokenizer,
    prompt_style: Union[str, PromptStyle],
    max_seq_length: int,
    mask_prompt: bool,
) -> TokenizedData:
    """Tokenize every record once: ``ids = encode(prompt) + encode(output, bos=False, eos=True)``, cut to
    ``max_seq_length + 1`` ids so that ``input_ids = ids[:-1]`` holds at most max_seq_length tokens.

    The prompt is ``prompt_style.apply(prompt=instruction, input=input)``, as in litgpt's SFTDataset, and is
    encoded with the tokenizer's default BOS setting. A record whose prompt alone takes max_seq_length + 1 tokens or
    more keeps no response token: it is dropped and counted (``stats.dropped``), not an error, even with
    mask_prompt off, because a sample without its response would teach only the prompt text.
    """
    style = _prompt_style(prompt_style)
    if tokenizer.eos_id is None:
        raise ConfigError(
            "model.tokenizer_dir: the tokenizer defines no end-of-sequence token (eos_token in tokenizer_config.json"
            " or eos_token_id in generation_config.json); fine-tuning appends it to every response so that the"
            " model learns to stop"
        )
    if max_seq_length < 1:
        raise ValueError(f"max_seq_length must be at least 1, got {max_seq_length}")
    keep = max_seq_length + 1  # ids per sample; the shift turns them into max_seq_length inputs and labels
    chunks: list[torch.Tensor] = []
    lengths: list[int] = []
    prompt_lengths: list[int] = []
    truncated = dropped = loss_tokens = 0
    # Chunk by chunk, so that only one chunk's ids exist as Python ints (~36 bytes each: 50k records of ~300
    # tokens at once would take ~0.5 GB) before they become int32 tensors.
    for start in range(0, len(records), _ENCODE_CHUNK):
        part = records[start : start + _ENCODE_CHUNK]
        prompts = [style.apply(prompt=r["instruction"], input=r["input"]) for r in part]
        prompt_ids = _encode_many(tokenizer, prompts, bos=None, eos=False)
        output_ids = _encode_many(tokenizer, [r["output"] for r in part], bos=False, eos=True)
        for p_ids, o_ids in zip(prompt_ids, output_ids):
            p = len(p_ids)
            if p >= keep:
                dropped += 1
                continue
            ids = p_ids + o_ids
            if len(ids) > keep:
                truncated += 1
                ids = ids[:keep]
            chunks.append(torch.tensor(ids, dtype=torch.int32))
            lengths.append(len(ids) - 1)
            prompt_lengths.append(p)
            loss_tokens += len(ids) - 1 - (_masked_labels(p) if mask_prompt else 0)

    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64) + 1, dim=0)
    stats = TokenStats(
        records=len(records),
        samples=len(lengths),
        truncated=truncated,
        dropped=dropped,
        tokens=sum(lengths),
        loss_tokens=loss_tokens,
        min_length=min(lengths, default=0),
        mean_length=sum(lengths) / len(lengths) if lengths else 0.0,
        max_length=max(lengths, default=0),
        max_seq_length=max_seq_length,
    )
    return TokenizedData(
        tokens=torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.int32),
        offsets=offsets,
        prompt_lengths=torch.tensor(prompt_lengths, dtype=torch.int32),
        mask_prompt=mask_prompt,
        stats=stats,
    )


def _masked_labels(prompt_length: int) -> int:
    """Labels (ids[1:]) that predict a prompt token: the first prompt_length - 1 (the first prompt token is never
    a label). The label at position prompt_length - 1 is the first response token, the first one with a loss."""
    return max(prompt_length - 1, 0)


def _prompt_style(style: Union[str, PromptStyle]) -> PromptStyle:
    if isinstance(style, PromptStyle):
        return style
    if style not in prompt_styles:
        close = difflib.get_close_matches(style, list(prompt_styles), n=3)
        hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
        raise ConfigError(
            f"data.prompt_style: '{style}' is not a LitGPT prompt style; {hint}choices: {', '.join(prompt_styles)}"
        )
    return PromptStyle.from_name(style)


def _encode_many(tokenizer: Tokenizer, texts: list[str], bos: Optional[bool], eos: bool) -> list[list[int]]:
    """``[tokenizer.encode(t, bos=bos, eos=eos).tolist() for t in texts]``, through the batch call for HF tokenizers.

    Nearly all the time is the Rust encoder's own (litgpt's wrapper adds ~20%): ~0.35 ms per 300-token record on
    one core, so ~20 s for 50k records. ``encode_batch`` runs the encoder on a thread pool over the free cores. On
    the 2 busy cores it was measured on, it was no faster than one call per text; the gain is expected on a GPU
    host's idle cores. litgpt's BOS/EOS rules are applied to the raw ids by :func:`_litgpt_special_tokens`. The
    first text is also encoded by litgpt's own ``encode``. If the two ever disagree (a litgpt release changed its
    rules), every text of the call goes through litgpt's ``encode``: slower, but right. SentencePiece tokenizers
    always use litgpt's ``encode``.
    """
    if not texts:
        return []
    if tokenizer.backend == "huggingface":
        raw = [encoding.ids for encoding in tokenizer.processor.encode_batch(texts)]
        fast = [_litgpt_special_tokens(tokenizer, ids, bos, eos) for ids in raw]
        if fast[0] == tokenizer.encode(texts[0], bos=bos, eos=eos).tolist():
            return fast
    return [tokenizer.encode(text, bos=bos, eos=eos).tolist() for text in texts]


def _litgpt_special_tokens(tokenizer: Tokenizer, tokens: list[int], bos: Optional[bool], eos: bool) -> list[int]:
    """litgpt ``Tokenizer.encode``'s handling of BOS/EOS (litgpt 0.5.13, tokenizer.py) applied to raw ids."""
    if bos or (bos is None and tokenizer.use_bos):
        if tokenizer.bos_id is None:
            raise NotImplementedError("This tokenizer does not have a defined bos token.")
        if not tokens or tokens[0] != tokenizer.bos_id:
            tokens = [tokenizer.bos_id] + tokens
    elif tokens and tokens[0] == tokenizer.bos_id:  # the processor added a BOS nobody asked for
        tokens = tokens[1:]
    if eos and (not tokens or tokens[-1] != tokenizer.eos_id):
        tokens = tokens + [tokenizer.eos_id]
    elif tokens and tokens[-1] == tokenizer.eos_id:  # the processor added an EOS nobody asked for
        tokens = tokens[:-1]
    return tokens


# ----------------------------------------------------------------------------------------------------------------------
# Dataset and collate
# ----------------------------------------------------------------------------------------------------------------------


class SFTDataset(Dataset):
    """Supervised fine-tuning samples over :class:`TokenizedData`; nothing is tokenized here.

    ``dataset[i]`` is ``{"input_ids": LongTensor[T], "labels": LongTensor[T]}``, already shifted for next-token
    prediction (``labels[t]`` is the token that follows ``input_ids[t]``, or IGNORE_INDEX).
    """

    def __init__(self, data: TokenizedData) -> None:
        self.data = data
        self.lengths: torch.Tensor = data.lengths
        """int64, T of each sample (the sampler and the run's statistics read it)."""

    @property
    def stats(self) -> TokenStats:
        return self.data.stats

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, end = self.data.offsets[index].item(), self.data.offsets[index + 1].item()
        ids = self.data.tokens[start:end].long()
        input_ids = ids[:-1]
        labels = ids[1:].clone()  # clone: the mask below must not write into the shared token storage
        if self.data.mask_prompt:
            labels[: _masked_labels(int(self.data.prompt_lengths[index]))] = IGNORE_INDEX
        return {"input_ids": input_ids, "labels": labels}


def collate(samples: list[dict[str, torch.Tensor]], pad_id: int, multiple: int = 1) -> dict[str, Any]:
    """Right-pad a micro-batch to its longest sample (rounded up to ``multiple``): input_ids with ``pad_id``,
    labels with IGNORE_INDEX.

    Returns ``input_ids`` and ``labels`` of shape (B, T), plus plain-int counts computed here on the CPU, so that
    the loop can log them with no device sync: ``tokens_real`` (sum of the samples' lengths), ``tokens_padded``
    (B x T), ``loss_tokens`` (labels that are not IGNORE_INDEX), ``samples`` (B) and ``lengths`` (each sample's real
    length). Padding never gets a loss, so
    pad_id only has to be a valid token id.
    """
    lengths = [len(sample["input_ids"]) for sample in samples]
    batch, width = len(samples), -(-max(lengths) // multiple) * multiple
    input_ids = torch.full((batch, width), pad_id, dtype=torch.int64)
    labels = torch.full((batch, width), IGNORE_INDEX, dtype=torch.int64)
    for row, (sample, length) in enumerate(zip(samples, lengths)):
        input_ids[row, :length] = sample["input_ids"]
        labels[row, :length] = sample["labels"]
    return {
        "input_ids": input_ids,
        "labels": labels,
        "tokens_real": sum(lengths),
        "tokens_padded": batch * width,
        "loss_tokens": int((labels != IGNORE_INDEX).sum()),
        "samples": batch,
        "lengths": lengths,  # per-sample real lengths: attention FLOPs grow with each sample's own length squared
    }


PACK_MULTIPLE = 16
"""A packed row is padded up to a multiple of this many positions (aligned matmuls; fewer distinct shapes for
torch.compile): at most 15 padded positions per micro-batch."""

GRAPH_MULTIPLE = 256
"""Row-length step when micro-steps replay as CUDA graphs: each distinct shape costs one capture (and a compile for
a static-shape compiler), so rows are padded to a multiple of 256 positions: ~8 shapes for 4 x 512-token samples,
at ~128 padded positions per micro-batch on average."""


def collate_packed(
    samples: list[dict[str, torch.Tensor]], pad_id: int, multiple: int = PACK_MULTIPLE, segments: int | None = None
) -> dict[str, Any]:
    """Concatenate a micro-batch's samples into ONE row, with attention kept within each sample ("padding-free").

    Same samples as :func:`collate` (so the same loss and batch arithmetic), but no padding to the longest sample:
    the model sees B x mean-length positions instead of B x max-length. Each sample restarts its positions at 0
    (rotary embeddings see the same positions as unpacked), and ``cu_seqlens`` marks where each sample starts, so
    attention never crosses a sample boundary. The row is padded to a multiple of ``multiple``; the padding is a
    segment of its own with no loss. ``segments``: give cu_seqlens exactly segments + 1 entries (trailing empty
    segments), so that every micro-batch of a run has the same tensor shapes apart from the row length.

    Returns input_ids/labels/positions of shape (1, N), ``cu_seqlens`` (int32, one more than the segments) and the
    same counts as :func:`collate`.
    """
    lengths = [len(sample["input_ids"]) for sample in samples]
    total = sum(lengths)
    width = -(-total // multiple) * multiple
    input_ids = torch.full((1, width), pad_id, dtype=torch.int64)
    labels = torch.full((1, width), IGNORE_INDEX, dtype=torch.int64)
    positions = torch.zeros((1, width), dtype=torch.int64)
    boundaries = [0]
    for sample, length in zip(samples, lengths):
        start = boundaries[-1]
        input_ids[0, start : start + length] = sample["input_ids"]
        labels[0, start : start + length] = sample["labels"]
        positions[0, start : start + length] = torch.arange(length)
        boundaries.append(start + length)
    if width > total:  # the padding tail: its own segment (no real token attends to it), at position 0 (a tail
        boundaries.append(width)  # longer than the model's context must not index past its rotary table)
    if segments is not None:  # empty segments (zero-length samples) keep the shape fixed; attention skips them
        boundaries += [width] * (segments + 1 - len(boundaries))
    return {
        "input_ids": input_ids,
        "labels": labels,
        "positions": positions,
        "cu_seqlens": torch.tensor(boundaries, dtype=torch.int32),
        "tokens_real": total,
        "tokens_padded": width,
        "loss_tokens": int((labels != IGNORE_INDEX).sum()),
        "samples": len(samples),
        "lengths": lengths,
    }


def fill_micro_batches(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into micro-batches of at most ``capacity`` positions each, as few as first-fit
    decreasing finds (longest sample first, into the first micro-batch with room, else a new one). Each group lists
    its indices in ascending order. Every length must be at most ``capacity``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: equal lengths keep their order
    groups: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] > capacity:
            raise ValueError(f"a sample of {lengths[i]} positions does not fit a micro-batch of {capacity}")
        for g, left in enumerate(room):
            if lengths[i] <= left:
                groups[g].append(i)
                room[g] -= lengths[i]
                break
        else:
            groups.append([i])
            room.append(capacity - lengths[i])
    return [sorted(group) for group in groups]


def collate_step_packed(
    samples: list[dict[str, torch.Tensor]], pad_id: int, capacity: int, multiple: int = PACK_MULTIPLE,
    segments: int | None = None,
) -> list[dict[str, Any]]:
    """One optimizer step's samples (on this rank) as packed micro-batches of at most ``capacity`` positions each
    (:func:`fill_micro_batches`), each made by :func:`collate_packed`. A step of 16 TinyLlama-Alpaca samples (~250
    positions each, capacity 4 x 512) becomes 2 full micro-batches instead of 4 half-full ones."""
    groups = fill_micro_batches([len(sample["input_ids"]) for sample in samples], capacity)
    return [collate_packed([samples[i] for i in group], pad_id, multiple, segments) for group in groups]


def choose_pad_id(tokenizer: Tokenizer) -> int:
    """The tokenizer's pad id if it has one, else its EOS id, else 0. Padded positions get no loss and are masked
    by causality for the real tokens before them, so any valid id will do."""
    for candidate in (getattr(tokenizer, "pad_id", None), tokenizer.eos_id):
        if candidate is not None:
            return int(candidate)
    return 0


# ----------------------------------------------------------------------------------------------------------------------
# Sampling: per epoch, per rank, resumable
# ----------------------------------------------------------------------------------------------------------------------


FIT_WINDOW = 64
"""How far ahead in an epoch's order :func:`fit_steps` looks for a sample to swap in (with 64, none of the 60
TinyLlama LoRA steps of benchmarks/results/s20-fit overflowed its micro-batch)."""


def fit_steps(order: list[int], lengths: Sequence[int], group: int, capacity: int,
              window: int = FIT_WINDOW) -> list[int]:
    """``order`` rearranged so that each consecutive ``group`` of indices (a step's samples) sums to at most
    ``capacity`` positions wherever swapping samples with the next ``window`` indices of the order can do it: the
    step's longest sample changes places with the nearest later sample short enough to make the step fit (or, with
    none, the shortest one in the window, and again). The swapped-out sample keeps its new place for a later step.
    Every index stays in the epoch exactly once, each step keeps ``group`` samples, and the order is otherwise the
    shuffled one; a step that no swap can fit stays over (the packer gives it one more micro-batch).

    Why: a packed step is one micro-batch when its samples fit the capacity and two when they overflow it, and the
    second, short one (a few hundred positions) runs every kernel of a micro-batch for few positions. On the H100
    (TinyLlama LoRA, 16 Alpaca-like samples of mean 245 tokens per step, 4,096 positions per micro-batch) 16 of 60
    steps overflowed (76 micro-batches, benchmarks/results/s20-fit), and 5-step intervals that held overflowing
    steps took ~10 ms more per step than those of about as many tokens that did not (s19-stack, metrics.jsonl;
    s16-tiny's 4,608 capacity cut overflow to 7% of steps, at ~1 GiB more reserved memory). Fitted, none of the 60
    overflowed (60 micro-batches)."""
    order = list(order)
    for start in range(0, len(order), group):
        end = min(start + group, len(order))
        total = sum(lengths[i] for i in order[start:end])
        while total > capacity:
            longest = max(range(start, end), key=lambda j: lengths[order[j]])
            fits = lengths[order[longest]] - (total - capacity)  # a sample at most this long makes the step fit
            ahead = range(end, min(end + window, len(order)))
            swap = next((k for k in ahead if lengths[order[k]] <= fits), None)
            if swap is None:  # none fits it at once: the shortest ahead, if shorter, and try again
                swap = min(ahead, key=lambda k: lengths[order[k]], default=None)
                if swap is None or lengths[order[swap]] >= lengths[order[longest]]:
                    break
            total += lengths[order[swap]] - lengths[order[longest]]
            order[longest], order[swap] = order[swap], order[longest]
    return order


class EpochBatchSampler(Sampler[list[int]]):
    """Micro-batches of sample indices for one rank, epoch by epoch, with an exactly restorable position.

    For epoch ``e`` all ``n`` indices are permuted by a generator seeded from ``(seed, e)`` (identity order when
    ``shuffle`` is off). Rank ``r`` of ``world_size`` gets ``perm[r::world_size]``, cut so that every rank has the
    same number of batches (otherwise DDP ranks would wait on each other's missing collective at the end of an
    epoch). Micro-batch ``b`` of rank ``r`` holds ``perm[(b * m + j) * world_size + r]`` for ``j < m``.

    ``fit_capacity`` (data.fit_steps; needs the samples' lengths as the first argument): each rank's share of the
    permutation is rearranged by :func:`fit_steps` so that each micro-batch (under data.pack_steps: a step's samples)
    fits in as few micro-batches of that many positions as the data's mean length allows (``fit_positions``), where
    swaps with nearby samples can do it.

    ``drop_last=True`` (training) drops the last incomplete micro-batch of each epoch:
    ``unseen_per_epoch = n - len(self) * micro_batch_size * world_size`` samples per epoch are not seen. They are the
    tail of that epoch's permutation, a different set each epoch when shuffling. ``drop_last=False`` (validation,
    with ``shuffle=False``) keeps a short last batch. Only ``n % world_size`` samples are skipped so that ranks stay
    equal (none on one device).

    The position and who advances it:

    * The training loop owns the epoch. It calls ``set_epoch(e)`` at the start of every epoch. ``set_epoch`` with
      a new epoch starts that epoch at batch 0. With the epoch already set it changes nothing, so a position
      restored by ``load_state_dict`` survives the loop's usual ``set_epoch(start_epoch)`` (resetting it there is
      the "mid-epoch resume replays the epoch" bug, accelerate #4071).
    * The loop counts the micro-batches it has consumed. A DataLoader with workers pulls indices from the sampler
      ``prefetch_factor x num_workers`` batches ahead, so the sampler's own counter runs ahead of training. The
      checkpoint therefore stores ``sampler.position(epoch, batches_consumed)``, built from the loop's counters.
      ``state_dict()`` is the sampler's own view (batches handed out so far in this epoch), which is exact only when
      the sampler is iterated directly or with ``num_workers=0``.
    * ``load_state_dict(state)`` (in a fresh process) sets the epoch and the batch to start at. The next
      ``__iter__`` recomputes that epoch's permutation and slices from there: O(1) in the batches already consumed,
      nothing is loaded or iterated to skip them. A position applies to one ``__iter__`` only. After an epoch's
      batches run out, iterating again without ``set_epoch`` replays that epoch from batch 0.
    * The position is the same on every rank (all ranks have the same number of batches), so rank 0 can save it.
      It also records n, micro_batch_size, world_size, seed, shuffle and drop_last. Restoring it under different
      values raises CheckpointError, because batch k would then mean other samples.

    Use it as a DataLoader ``batch_sampler``. Under Fabric, call ``fabric.setup_dataloaders(...,
    use_distributed_sampler=False)``: the sharding is done here, and Fabric cannot inject a DistributedSampler into
    a custom batch sampler. This class deliberately has no ``.sampler`` attribute. Fabric's loader wrapper calls
    ``batch_sampler.sampler.set_epoch(<its own iteration count>)``, and that count restarts at 0 after a resume.
    """

    def __init__(
        self,
        lengths_or_n: Union[int, Sequence[int], torch.Tensor],
        micro_batch_size: int,
        shuffle: bool,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        fit_capacity: int | None = None,
    ) -> None:
        n = lengths_or_n if isinstance(lengths_or_n, int) else len(lengths_or_n)
        if fit_capacity is not None and isinstance(lengths_or_n, int):
            raise ValueError("fit_capacity needs the samples' lengths, not their number")
        self.fit_capacity = fit_capacity
        self.lengths = None if fit_capacity is None else [int(length) for length in lengths_or_n]  # fit_steps reads
        self.fit_positions: int | None = None
        """What each micro-batch's samples are fitted to (fit_steps): as many fit_capacity micro-batches as the
        data's mean length needs for micro_batch_size samples (one for 16 samples of mean 245 in 4,096)."""
        if self.lengths:
            mean = sum(self.lengths) / n
            self.fit_positions = fit_capacity * max(1, math.ceil(micro_batch_size * mean / fit_capacity))
        if micro_batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need micro_batch_size >= 1 and 0 <= rank < world_size, got {micro_batch_size}, {rank}, {world_size}"
            )
        self.num_samples = n
        self.micro_batch_size = micro_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        per_rank = n // world_size
        self.num_batches = per_rank // micro_batch_size if drop_last else math.ceil(per_rank / micro_batch_size)
        if self.num_batches == 0:
            full = " full" if drop_last else ""
            raise DataError(
                f"{n} samples over {world_size} rank(s) give no{full} micro-batch of {micro_batch_size} per rank;"
                " the data set is too small for this batch setup: add records, or lower train.micro_batch_size"
                " or devices"
            )
        self.epoch = 0
        self._start_batch = 0  # where the next __iter__ begins (set by load_state_dict, used once)
        self._batch_index = 0  # batches of self.epoch handed out so far

    @property
    def samples_per_epoch(self) -> int:
        """Samples seen per epoch over all ranks."""
        per_rank = self.num_samples // self.world_size
        return (self.num_batches * self.micro_batch_size if self.drop_last else per_rank) * self.world_size

    @property
    def unseen_per_epoch(self) -> int:
        """Samples left out of each epoch (drop_last's incomplete batch, and the remainder n % world_size)."""
        return self.num_samples - self.samples_per_epoch

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank (a whole epoch, whatever position the next __iter__ starts at)."""
        return self.num_batches

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at batch 0 on the next ``__iter__``; no change when it is already the epoch."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._start_batch = 0
            self._batch_index = 0

    def __iter__(self) -> Iterator[list[int]]:
        # The position is read now, not when the generator first runs, so that set_epoch/load_state_dict calls
        # made before iter() are the ones that count, whenever the DataLoader first asks for indices.
        epoch, start = self.epoch, self._start_batch
        self._start_batch = 0
        self._batch_index = start
        return self._batches(epoch, start)

    def _batches(self, epoch: int, start: int) -> Iterator[list[int]]:
        mine = self._epoch_permutation(epoch)[: self.samples_per_epoch][self.rank :: self.world_size].tolist()
        m = self.micro_batch_size
        if self.fit_positions is not None:
            mine = fit_steps(mine, self.lengths, m, self.fit_positions)
        for b in range(start, self.num_batches):
            self._batch_index = b + 1  # before the yield: state_dict() read after receiving batch b counts it
            yield mine[b * m : (b + 1) * m]

    def _epoch_permutation(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        # Mix (seed, epoch) through a hash: seed + epoch (DistributedSampler's choice) would give run seed=1 epoch 1
        # the same order as run seed=2 epoch 0, correlating the runs of a seed sweep.
        digest = hashlib.blake2b(f"{self.seed}:{epoch}".encode(), digest_size=8).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
        return torch.randperm(self.num_samples, generator=generator)

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "num_samples": self.num_samples,
            "micro_batch_size": self.micro_batch_size,
            "world_size": self.world_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "fit_capacity": self.fit_capacity,
        }

    def position(self, epoch: int, batches_consumed: int) -> dict[str, Any]:
        """The state to checkpoint, from the training loop's own counters: ``batches_consumed`` micro-batches of
        ``epoch`` have been trained on. ``load_state_dict`` of it continues at batch ``batches_consumed``."""
        if epoch < 0 or not 0 <= batches_consumed <= self.num_batches:
            raise ValueError(
                f"position: need epoch >= 0 and 0 <= batches_consumed <= {self.num_batches}, got {epoch},"
                f" {batches_consumed}"
            )
        return {"epoch": epoch, "batch_index": batches_consumed, **self._fingerprint()}

    def state_dict(self) -> dict[str, Any]:
        """The sampler's own position: {"epoch", "batch_index"} (+ fingerprint). It counts batches handed out, which
        runs ahead of training under a prefetching DataLoader: checkpoint ``position(...)`` from the loop instead."""
        return {"epoch": self.epoch, "batch_index": self._batch_index, **self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state["batch_index"]`` of ``state["epoch"]`` on the next ``__iter__`` (see the class doc)."""
        mismatched = [
            f"{key} {state[key]!r} (this run: {value!r})"
            for key, value in self._fingerprint().items()
            if key in state and state[key] != value
        ]
        if mismatched:
            raise CheckpointError(
                "the checkpoint's data position was saved with " + ", ".join(mismatched) + "; batch positions only"
                " carry over with the same data and batch setup. Resume with the original settings, or start a new"
                " run"
            )
        epoch, batch_index = int(state["epoch"]), int(state["batch_index"])
        if epoch < 0 or not 0 <= batch_index <= self.num_batches:
            raise CheckpointError(
                f"the checkpoint's data position (epoch {epoch}, batch {batch_index}) is outside this data set's"
                f" {self.num_batches} micro-batches per epoch"
            )
        self.epoch = epoch
        self._start_batch = batch_index
        self._batch_index = batch_index


def build_dataloader(
    dataset: SFTDataset, sampler: EpochBatchSampler, pad_id: int, num_workers: int, packing: bool = False,
    fixed_shapes: bool = False, step_capacity: int | None = None,
) -> DataLoader:
    """A DataLoader driven by ``sampler`` (as its batch_sampler) and :func:`collate` (or :func:`collate_packed`).

    ``fixed_shapes``: few distinct batch shapes, for CUDA graphs (one capture per shape): rows padded to a multiple
    of GRAPH_MULTIPLE (packed) or 64 (padded batches), and cu_seqlens of one length (micro_batch_size + 2).
    ``step_capacity`` (data.pack_steps): the sampler hands out one optimizer step's samples at a time and each item
    of the loader is that step's list of packed micro-batches (:func:`collate_step_packed`).

    The collate function is a ``functools.partial`` of a module-level function, so it pickles into worker processes
    under any start method. Memory is pinned only when CUDA is present (pinning on a CPU-only machine warns and helps
    nothing). Workers persist across epochs so each epoch does not pay to start them again. The sampler is still
    iterated in the main process, so ``set_epoch``/``load_state_dict`` reach it.
    """
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_function(pad_id, packing, fixed_shapes, sampler.micro_batch_size, step_capacity),
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        # Its own generator: each new iterator draws its workers' base seed from it, not from the global torch
        # RNG, which the model's dropout uses; a resumed run then draws exactly the dropout masks the
        # uninterrupted run drew (the order of samples comes from the sampler, seeded by (seed, epoch)).
        generator=torch.Generator().manual_seed(0),
    )


def collate_function(pad_id: int, packing: bool, fixed_shapes: bool, micro_batch_size: int,
                     step_capacity: int | None = None):
    """The collate a loader uses: a ``functools.partial`` of a module-level function (it pickles into workers).
    ``micro_batch_size``: the most samples one collate call gets (with step_capacity, a step's samples)."""
    if step_capacity is not None:  # a micro-batch may hold all of the step's samples: micro_batch_size + 1 segments
        return functools.partial(collate_step_packed, pad_id=pad_id, capacity=step_capacity,
                                 multiple=GRAPH_MULTIPLE if fixed_shapes else PACK_MULTIPLE,
                                 segments=micro_batch_size + 1 if fixed_shapes else None)
    if packing and fixed_shapes:  # samples + the padding tail: micro_batch_size + 1 segments at most
        return functools.partial(collate_packed, pad_id=pad_id, multiple=GRAPH_MULTIPLE, segments=micro_batch_size + 1)
    if packing:
        return functools.partial(collate_packed, pad_id=pad_id)
    return functools.partial(collate, pad_id=pad_id, multiple=64 if fixed_shapes else 1)


def _fill_to(sizes: list[int], capacity: int) -> list[int]:
    """Sample lengths, longest first, taken while they fit ``capacity`` positions; the last one cut to fill it."""
    out: list[int] = []
    for size in sizes:
        take = min(size, capacity - sum(out))
        if take <= 0:
            break
        out.append(take)
    return out


def largest_batches(
    lengths: torch.Tensor, micro_batch_size: int, collate_fn, pad_id: int, capacity: int | None = None,
    widths: int = 2,
) -> list[dict[str, Any]]:
    """Stand-in micro-batches, largest first: the shape of the data's ``micro_batch_size`` longest samples, and the
    next smaller shape (the longest sample shortened by 256 positions), made by the run's own ``collate_fn`` (one
    packed micro-batch per call). ``capacity`` (data.pack_steps, where ``micro_batch_size`` is a step's samples):
    the longest samples only as far as they fill that many positions. ``widths`` > 2, for packed rows: also the
    next smaller row widths, GRAPH_MULTIPLE positions apart, down to GRAPH_MULTIPLE (at most ``widths`` batches
    in all); padded batches stop at two.

    For CUDA graphs: warming up on the first two before training makes torch.compile settle its shape-generic
    kernels, and capturing the largest shape first sizes the graphs' memory pool once; smaller shapes then fit in
    it, and capturing them too before the first step keeps those captures out of the training steps. The tokens
    are all ``pad_id`` (any valid id: the numbers do not matter, only the shapes)."""
    longest = torch.sort(lengths, descending=True).values[: min(micro_batch_size, len(lengths))].tolist()
    if capacity is not None:  # data.pack_steps: the fullest micro-batch a step's samples can fill
        longest = _fill_to(longest, capacity)

    def stand_in(sizes: list[int]) -> dict[str, Any]:
        return collate_fn([{"input_ids": torch.full((n,), pad_id, dtype=torch.int64),
                            "labels": torch.full((n,), pad_id, dtype=torch.int64)} for n in sizes])

    batches = [stand_in(longest), stand_in([max(1, longest[0] - 256)] + longest[1:])]
    if "cu_seqlens" in batches[0] and widths > 2:  # packed rows: (1, width) each
        # a row of exactly `width` positions: the longest samples cut to fill it (so no more samples than a real
        # micro-batch has, and cu_seqlens keeps its length)
        for width in range(batches[1]["input_ids"].shape[1] - GRAPH_MULTIPLE, 0, -GRAPH_MULTIPLE):
            if len(batches) == widths:
                break
            batches.append(stand_in(_fill_to(longest, width)))
    return batches


# ----------------------------------------------------------------------------------------------------------------------
# All of it, from the recipe
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class PreparedData:
    """The training and validation sets, tokenized, and the id that pads batches."""

    train: SFTDataset
    val: SFTDataset
    pad_id: int
    train_source: str
    """Where the training records came from (the file)."""
    val_source: str
    """Where the validation records came from: a file, or the held-out share of the training file."""

    def describe(self) -> list[str]:
        """Lines for the run log."""
        return [
            f"train: {self.train.stats.describe()} [{self.train_source}]",
            f"val:   {self.val.stats.describe()} [{self.val_source}]",
        ]


def prepare_data(cfg: DataConfig, tokenizer: Tokenizer, seed: int) -> PreparedData:
    """Read, split (or read ``val_path``), tokenize. Every data problem raises DataError here, before any model is
    loaded; an unknown prompt style raises ConfigError."""
    style = _prompt_style(cfg.prompt_style)  # a typo in the style should not wait for the file to be read
    path = resolve_path(cfg.path)
    records = read_records(path, cfg.fields)
    if cfg.val_path is None:
        train_records, val_records = split_records(records, cfg.val_split, seed)
        val_source = f"{len(val_records)} of {len(records)} records of {path} held out (data.val_split {cfg.val_split})"
    else:
        val_path = resolve_path(cfg.val_path)
        train_records, val_records = records, read_records(val_path, cfg.fields)
        val_source = str(val_path)

    sets = {}
    for name, part in (("training", train_records), ("validation", val_records)):
        data = tokenize_records(part, tokenizer, style, cfg.max_seq_length, cfg.mask_prompt)
        if len(data) == 0:
            raise DataError(
                f"every {name} record was dropped: each prompt alone takes more than data.max_seq_length"
                f" ({cfg.max_seq_length}) tokens, leaving no response to learn. Raise data.max_seq_length (the"
                f" {name} records come from {path if name == 'training' else val_source})"
            )
        sets[name] = SFTDataset(data)
    return PreparedData(
        train=sets["training"],
        val=sets["validation"],
        pad_id=choose_pad_id(tokenizer),
        train_source=str(path),
        val_source=val_source,
    )
