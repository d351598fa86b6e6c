"""Data sets by name, fetched once from the Hugging Face hub through the `datasets` library and kept in litft's cache
($LITFT_CACHE, default ~/.cache/litft) for every later run:

- `data.path: alpaca2k` (the lab's data), as LitGPT's Alpaca2k data module fetches it, converted to Alpaca JSON;
- `data.path: hf:REPO` or `hf:REPO:SPLIT` (split train by default), any hub data set (or a local folder `datasets`
  loads), its rows kept as they are in JSONL and read in data.format (auto: OpenOrca's system_prompt, question and
  response; chat messages; Alpaca's keys). E.g. `hf:Open-Orca/OpenOrca`.

Offline, or without `datasets`, the data error says how to supply the file."""

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


HUB_PREFIX = "hf:"


def is_named(path: str | Path | None) -> bool:
    return isinstance(path, str) and (path in NAMED or path.startswith(HUB_PREFIX))


def hub_name(path: str) -> tuple[str, str]:
    """'hf:REPO[:SPLIT]' -> (REPO, SPLIT); DataError for an empty name."""
    repo, _, split = path[len(HUB_PREFIX):].partition(":")
    if not repo:
        raise DataError(f"data.path {path}: expected hf:REPO or hf:REPO:SPLIT (e.g. hf:Open-Orca/OpenOrca)")
    return repo, split or "train"


def local_path(name: str) -> Path:
    """The data set's file in the cache, fetched first if it is not there."""
    if name.startswith(HUB_PREFIX):
        repo, split = hub_name(name)
        target = cache_dir() / f"hf--{repo.strip('/').replace('/', '--')}--{split}.jsonl"
        if not target.is_file():
            fetch_rows(name, repo, split, target)
        return target
    target = cache_dir() / f"{name}.json"
    if not target.is_file():
        fetch(name, target)
    return target


def _load(name: str, repo: str, split: str, how: str):
    try:
        from datasets import load_dataset
    except ImportError:
        raise DataError(f"data.path {name}: fetching {repo} from the Hugging Face hub needs the datasets package (pip"
                        f" install datasets) and network access; {how}") from None
    try:
        return load_dataset(repo, split=split)
    except Exception as err:  # noqa: BLE001 - offline, a missing repository, a hub error: one data error with the reason
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"data.path {name}: cannot fetch {repo} from the Hugging Face hub ({reason}); {how}") from None


def fetch_rows(name: str, repo: str, split: str, target: Path) -> None:
    """``repo``'s ``split`` with `datasets`, every row as a JSON line of ``target`` (written whole: a temporary file
    renamed into place)."""
    from litft.files import make_dir, writing

    how = f"or put its rows (JSONL) at '{target}', or set data.path to a local copy"
    dataset = _load(name, repo, split, how)
    make_dir(target.parent, "litft's data cache", "data.path")
    partial = target.with_name(target.name + ".partial")
    with writing(f"the {name} data set", target, "data.path"):
        dataset.to_json(str(partial), lines=True, force_ascii=False)
        os.replace(partial, target)


def fetch(name: str, target: Path) -> None:
    """Download ``name`` with `datasets`, write its records (instruction, input, output) to ``target`` whole."""
    from litft.files import write_text_atomic

    repo = NAMED[name]
    how = (f"or put its records (a JSON list of {{instruction, input, output}}) at '{target}', or set data.path to"
           " a local copy")
    dataset = _load(name, repo, "train", how)
    records = [{"instruction": row.get("instruction", ""), "input": row.get("input", "") or "",
                "output": row.get("output", "")} for row in dataset]
    write_text_atomic(target, json.dumps(records, indent=1), what=f"the {name} data set", setting="data.path")
