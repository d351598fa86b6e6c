"""Micro-batches from samples: padded (:func:`collate`), packed into one row (:func:`collate_packed`), or a step's
samples filled into as few packed micro-batches as fit (:func:`collate_step_packed`); and the stand-in batches that
warm up CUDA graphs (:func:`largest_batches`).

Every collate counts real, padded and loss tokens on the CPU, in the loader, so the training loop logs throughput
without device syncs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from litft.data.tokenize import IGNORE_INDEX


def collate(samples: list[dict[str, torch.Tensor]], pad_id: int, multiple: int = 1) -> dict[str, Any]:
    """Right-pad a micro-batch to its longest sample (rounded up to ``multiple``): input_ids with ``pad_id``,
    labels with IGNORE_INDEX.

    Returns ``input_ids`` and ``labels`` of shape (B, T), plus plain-int counts computed here on the CPU, so that
    the loop can log them with no device sync: ``tokens_real`` (sum of the samples' lengths), ``tokens_padded``
    (B x T), ``loss_tokens`` (labels that are not IGNORE_INDEX), ``samples`` (B) and ``lengths`` (each sample's real
    length). Padding never gets a loss, so pad_id only has to be a valid token id.
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
    positions each, capacity 4 x 512) becomes 2 full micro-batches instead of 4 half-full ones.

    The fullest micro-batch comes last: under DDP the gradient reduction overlaps the step's last backward pass,
    and a short one (a few hundred positions left over) would leave most of the 2.2 GB (TinyLlama, bf16) all-reduce
    exposed after it."""
    lengths = [len(sample["input_ids"]) for sample in samples]
    groups = fill_micro_batches(lengths, capacity)
    groups.sort(key=lambda group: sum(lengths[i] for i in group))  # stable: equal totals keep their order
    return [collate_packed([samples[i] for i in group], pad_id, multiple, segments) for group in groups]


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

