"""Data sets by name: `data.path: alpaca2k` (the lab's data) is fetched once from the Hugging Face hub through the
`datasets` library, as LitGPT's Alpaca2k data module fetches it, converted to Alpaca-format JSON and kept in litft's
cache ($LITFT_CACHE, default ~/.cache/litft) for every later run. Offline, or without `datasets`, the data error
says how to supply the file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from litft.errors import DataError

NAMED = {
    "alpaca2k": "mhenrichsen/alpaca_2k_test",
}
"""Data set names -> their repositories on the Hugging Face hub (the same as LitGPT's data modules use)."""


def cache_dir() -> Path:
    return Path(os.environ.get("LITFT_CACHE", Path.home() / ".cache" / "litft")) / "data"


def is_named(path: str | Path | None) -> bool:
    return isinstance(path, str) and path in NAMED


def local_path(name: str) -> Path:
    """The data set's file in the cache, fetched first if it is not there."""
    target = cache_dir() / f"{name}.json"
    if not target.is_file():
        fetch(name, target)
    return target


def fetch(name: str, target: Path) -> None:
    """Download ``name`` with `datasets`, write its records (instruction, input, output) to ``target`` whole."""
    from litft.files import write_text_atomic

    repo = NAMED[name]
    how = (f"or put its records (a JSON list of {{instruction, input, output}}) at '{target}', or set data.path to"
           " a local copy")
    try:
        from datasets import load_dataset
    except ImportError:
        raise DataError(f"data.path {name}: fetching {repo} from the Hugging Face hub needs the datasets package (pip"
                        f" install datasets) and network access; {how}") from None
    try:
        dataset = load_dataset(repo, split="train")
    except Exception as err:  # noqa: BLE001 - offline, a missing repository, a hub error: one data error with the reason
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"data.path {name}: cannot fetch {repo} from the Hugging Face hub ({reason}); {how}") from None
    records = [{"instruction": row.get("instruction", ""), "input": row.get("input", "") or "",
                "output": row.get("output", "")} for row in dataset]
    write_text_atomic(target, json.dumps(records, indent=1), what=f"the {name} data set", setting="data.path")
