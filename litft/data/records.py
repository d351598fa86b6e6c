"""Reading Alpaca-format records from a ``.json`` or ``.jsonl`` file, and the seeded train/validation split.

Every problem with a data file is a :class:`~litft.errors.DataError` (exit 5) that names the file, the line (and for
JSON the record's index), the key and what was expected, raised before any model is loaded.
"""

from __future__ import annotations

import codecs
import difflib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from litft.errors import DataError
from litft.recipe import DataFields

SUPPORTED_SUFFIXES = (".json", ".jsonl")

# ----------------------------------------------------------------------------------------------------------------------
# Reading records
# ----------------------------------------------------------------------------------------------------------------------


TEXT_SUFFIXES = (".txt", ".md")
OPENORCA_FIELDS = DataFields(instruction="question", input="input", output="response", system="system_prompt")


def data_format(path: Path, fmt: str) -> str:
    """The format of ``path`` (data.format): as given, or 'text' for a folder, .txt or .md file under 'auto'; the
    record formats ('auto' still) are told apart by their first record's keys (read_records)."""
    if fmt != "auto":
        return fmt
    return "text" if Path(path).is_dir() or Path(path).suffix.lower() in TEXT_SUFFIXES else "auto"


def read_records(path: Path, fields: DataFields, fmt: str = "auto") -> list[dict[str, str]]:
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

    ``fmt`` (data.format): 'openorca' reads system_prompt, question and response; 'chat' reads a 'messages' list
    (:func:`_from_messages`); 'auto' takes the first record's keys to choose among chat, openorca and alpaca. Every
    record also gets "system" ("" without one).
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
        records = _read_jsonl(path, text, fields, fmt)
    else:
        records = _read_json(path, text, fields, fmt)
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


def _read_jsonl(path: Path, text: str, fields: DataFields, fmt: str) -> list[dict[str, str]]:
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
        if not records:
            fmt = _record_format(value, fmt)
        records.append(_normalise(value, fields, path, f"line {number}", fmt))
    return records


def _read_json(path: Path, text: str, fields: DataFields, fmt: str) -> list[dict[str, str]]:
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
    fmt = _record_format(value[0], fmt) if value else fmt
    for index, item in enumerate(value):
        try:
            records.append(_normalise(item, fields, path, f"record [{index}]", fmt))
        except DataError:
            # Found only on this error path (a second scan of the text): the line where the bad record starts.
            # Normalising again with it raises the same error, now saying where to look.
            _normalise(item, fields, path, f"record [{index}] (line {_json_list_item_line(text, index)})", fmt)
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


def _record_format(first: Any, fmt: str) -> str:
    """'auto' resolved by the first record's keys: 'messages' -> chat, 'question' and 'response' -> openorca."""
    if fmt != "auto" or not isinstance(first, dict):
        return "alpaca" if fmt == "auto" else fmt
    if "messages" in first:
        return "chat"
    if "question" in first and "response" in first:
        return "openorca"
    return "alpaca"


def _from_messages(value: Any, path: Path, where: str) -> dict[str, str]:
    """A chat record -> instruction (the conversation before the last assistant message: the one user message, or
    the turns as 'User: ...' / 'Assistant: ...' lines), output (that last assistant message) and system (the system
    message, if any)."""
    messages = value.get("messages") if isinstance(value, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{path}: {where}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}}")
    for k, message in enumerate(messages):
        if not (isinstance(message, dict) and message.get("role") in ("system", "user", "assistant")
                and isinstance(message.get("content"), str)):
            raise DataError(f"{path}: {where}: messages[{k}] must be {{\"role\": \"system\"|\"user\"|\"assistant\","
                            " \"content\": a string}")
    if messages[-1]["role"] != "assistant" or not messages[-1]["content"].strip():
        raise DataError(f"{path}: {where}: the last message must be the assistant's answer (not empty): it is what"
                        " the model learns to say")
    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    turns = [m for m in messages[:-1] if m["role"] != "system"]
    if not turns:
        raise DataError(f"{path}: {where}: no user message before the assistant's answer")
    if len(turns) == 1:
        instruction = turns[0]["content"]
    else:
        instruction = "\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in turns)
    return {"instruction": instruction, "input": "", "output": messages[-1]["content"], "system": system}


def _normalise(value: Any, fields: DataFields, path: Path, where: str, fmt: str = "alpaca") -> dict[str, str]:
    """One raw JSON value -> {"instruction", "input", "output", "system"}, or DataError naming file, place and key."""
    if fmt == "chat":
        return _from_messages(value, path, where)
    if fmt == "openorca" and fields == DataFields():
        fields = OPENORCA_FIELDS
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
        ("system", fields.system, False),
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



def read_documents(path: Path) -> list[tuple[Path, str]]:
    """data.format 'text': the .txt and .md files under a folder (recursively, in name order), or the one file, as
    (path, text); DataError for no files, an empty set or a file that is not UTF-8 (with its line)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such folder or text file{_sibling_hint(path)}")
    files = ([path] if path.is_file() else
             sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES))
    if not files:
        raise DataError(f"{path}: no .txt or .md files in the folder (data.format text reads those)")
    documents = [(file, _read_utf8(file)) for file in files]
    documents = [(file, text) for file, text in documents if text.strip()]
    if not documents:
        raise DataError(f"{path}: every text file is empty")
    return documents
