"""Instruction data: read Alpaca-format records, tokenize them once, batch them, and sample them resumably.

The path from a file to a training batch, in the order :func:`prepare_data` and the training loop run it:

1. :func:`read_records` (``records``) reads a ``.json`` list or a ``.jsonl`` file into ``{"instruction", "input",
   "output"}`` records. Every problem is a :class:`~litft.errors.DataError` (exit 5) that names the file, the line
   (and for JSON the record's index), the key and what was expected. This all happens before any model is loaded.
2. :func:`split_records` (``records``) holds out a fixed, seeded validation share (unless ``data.val_path`` is set).
3. :func:`tokenize_records` (``tokenize``) turns each record into token ids ONCE, up front, with litgpt's
   ``PromptStyle`` and ``Tokenizer`` rules, into one flat int32 tensor plus offsets that forked DataLoader workers
   share.
4. :class:`SFTDataset` (``tokenize``) hands out ``input_ids``/``labels`` that are already shifted for next-token
   prediction: the loss is ``cross_entropy(logits, labels)`` with no further slicing.
5. :class:`EpochBatchSampler` (``sampler``) yields micro-batches of indices per rank. Its position (epoch, batch
   index) can be restored in O(1), so a resumed run continues at exactly the next micro-batch. With
   ``data.fit_steps``, :func:`fit_steps` rearranges each epoch's order so that a step's samples fit its packed
   micro-batches.
6. ``batches`` makes each micro-batch: :func:`collate` pads it; :func:`collate_packed` (``data.packing``)
   concatenates its samples into one row, attention kept within each sample; :func:`collate_step_packed`
   (``data.pack_steps``) fills one optimizer step's samples into as few packed micro-batches as fit. Each counts
   real, padded and loss tokens on the CPU, in the loader, so the training loop logs throughput without device
   syncs.

:func:`build_dataloader` joins a dataset, its sampler and the collate into a DataLoader. Every name the rest of litft
uses is importable from ``litft.data``.

Not here: plain-text data, a cache of tokenized data on disk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from litgpt.tokenizer import Tokenizer
from torch.utils.data import DataLoader

from litft.data.batches import (
    GRAPH_MULTIPLE,
    PACK_MULTIPLE,
    collate,
    collate_function,
    collate_packed,
    collate_step_packed,
    fill_micro_batches,
    largest_batches,
)
from litft.data.records import (
    SUPPORTED_SUFFIXES,
    data_format,
    read_records,
    split_records,
)
from litft.data.sampler import FIT_WINDOW, EpochBatchSampler, fit_steps
from litft.data.tokenize import (
    IGNORE_INDEX,
    SFTDataset,
    TokenizedData,
    TokenStats,
    choose_pad_id,
    resolve_prompt_style,
    tokenize_records,
)
from litft.errors import DataError
from litft.recipe import DataConfig, resolve_path

__all__ = [
    "FIT_WINDOW", "GRAPH_MULTIPLE", "IGNORE_INDEX", "PACK_MULTIPLE", "SUPPORTED_SUFFIXES", "EpochBatchSampler",
    "PreparedData", "SFTDataset", "TokenStats", "TokenizedData", "build_dataloader", "choose_pad_id", "collate",
    "collate_function", "collate_packed", "collate_step_packed", "data_format", "fill_micro_batches", "fit_steps",
    "largest_batches", "prepare_data", "read_records", "split_records", "tokenize_records",
]


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
    style = resolve_prompt_style(cfg.prompt_style)  # a typo in the style should not wait for the file to be read
    path = data_file(cfg.path)
    if data_format(path, cfg.format) == "text":
        return _prepare_documents(cfg, tokenizer, seed, path)
    records = read_records(path, cfg.fields, cfg.format)
    if cfg.val_path is None:
        train_records, val_records = split_records(records, cfg.val_split, seed)
        val_source = f"{len(val_records)} of {len(records)} records of {path} held out (data.val_split {cfg.val_split})"
    else:
        val_path = data_file(cfg.val_path)
        train_records, val_records = records, read_records(val_path, cfg.fields, cfg.format)
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


def _prepare_documents(cfg: DataConfig, tokenizer: Tokenizer, seed: int, path) -> PreparedData:
    """data.format 'text': the documents' chunks (tokenize_documents), val_split of the chunks held out (or
    val_path's documents)."""
    from litft.data.records import read_documents
    from litft.data.tokenize import TokenizedData, tokenize_documents

    documents = read_documents(path)
    data = tokenize_documents([text for _, text in documents], tokenizer, cfg.max_seq_length)
    source = f"{len(documents)} text file(s) under {path}, {len(data)} chunks of up to {cfg.max_seq_length} tokens"
    if cfg.val_path is not None:
        val_docs = read_documents(data_file(cfg.val_path))
        val = tokenize_documents([text for _, text in val_docs], tokenizer, cfg.max_seq_length)
        return PreparedData(SFTDataset(data), SFTDataset(val), choose_pad_id(tokenizer), source, str(cfg.val_path))
    if len(data) < 2:
        raise DataError(f"{path}: the text makes {len(data)} chunk(s) of {cfg.max_seq_length} tokens; holding out a"
                        " validation set needs at least 2: add text, lower data.max_seq_length, or give data.val_path")
    train_idx, val_idx = split_records(list(range(len(data))), cfg.val_split, seed)
    parts = [TokenizedData.subset(data, indices) for indices in (train_idx, val_idx)]
    return PreparedData(SFTDataset(parts[0]), SFTDataset(parts[1]), choose_pad_id(tokenizer), source,
                        f"{len(val_idx)} of {len(data)} chunks held out (data.val_split {cfg.val_split})")


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


def data_file(path: str):
    """data.path or data.val_path as a file: a named data set (litft.data.sources: 'alpaca2k') from the cache,
    fetched once; anything else a path as recipes give them."""
    from litft.data import sources

    return sources.local_path(path) if sources.is_named(path) else resolve_path(path)
