"""Which samples each rank trains on, micro-batch by micro-batch: :class:`EpochBatchSampler`, whose position
(epoch, batch index) is restored exactly on resume, and :func:`fit_steps`, the epoch order fitted to packed steps."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from litft.errors import CheckpointError, DataError

FIT_WINDOW = 64
"""How far ahead in an epoch's order :func:`fit_steps` looks for a sample to swap in: with 64, none of the 60 steps
of a TinyLlama LoRA epoch on Alpaca-like data overflowed its micro-batch (docs/speed.md)."""


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
    steps overflowed unfitted (76 micro-batches), and stretches of steps that held overflowing ones took ~10 ms more
    per step than those of about as many tokens that did not; a capacity of 4,608 instead cuts overflow to 7% of
    steps, at ~1 GiB more reserved memory. Fitted, none of the 60 overflowed (60 micro-batches; docs/speed.md)."""
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


def fit_positions(lengths: Sequence[int], micro_batch_size: int, capacity: int) -> int:
    """The positions a micro-batch of ``micro_batch_size`` samples is fitted to: as many micro-batches of ``capacity``
    positions as the samples' mean length needs (at least one)."""
    mean = sum(lengths) / len(lengths)
    return capacity * max(1, math.ceil(micro_batch_size * mean / capacity))


def balanced_shares(group: Sequence[int], lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """One micro-batch's (or packed step's) samples over all ranks, ``group`` (world_size x m indices), split into
    ``world_size`` shares of m samples each whose position totals are as even as a greedy split makes them: the
    longest sample first, each to the share with the fewest positions that still has room. Each share keeps the
    indices in ``group``'s order.

    Why: ranks wait for each other at every gradient reduction, so a step takes as long as its busiest rank. Dealt
    out in turn, 8 samples of a set with a 10% tail over 512 tokens (mean 278) differ by ~25% (one standard
    deviation) between ranks' totals, and the slower of two ranks carries ~14% more than the mean."""
    m = len(group) // world_size
    totals, shares = [0] * world_size, [[] for _ in range(world_size)]
    for index in sorted(group, key=lambda i: -lengths[i]):  # stable: equal lengths keep group order
        rank = min((r for r in range(world_size) if len(shares[r]) < m), key=lambda r: totals[r])
        shares[rank].append(index)
        totals[rank] += lengths[index]
    place = {index: k for k, index in enumerate(group)}
    return [sorted(share, key=place.__getitem__) for share in shares]


def batches_per_rank(n: int, micro_batch_size: int, world_size: int, drop_last: bool) -> int:
    """Micro-batches per epoch on each rank; DataError when there is none."""
    per_rank = n // world_size
    num_batches = per_rank // micro_batch_size if drop_last else math.ceil(per_rank / micro_batch_size)
    if num_batches == 0:
        full = " full" if drop_last else ""
        raise DataError(
            f"{n} samples over {world_size} rank(s) give no{full} micro-batch of {micro_batch_size} per rank;"
            " the data set is too small for this batch setup: add records, or lower train.micro_batch_size"
            " or devices"
        )
    return num_batches


def epoch_permutation(n: int, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """The order of all ``n`` samples in epoch ``epoch``: ``arange(n)`` without shuffling, else a permutation drawn
    from a generator seeded by a hash of (seed, epoch)."""
    if not shuffle:
        return torch.arange(n)
    # Mix (seed, epoch) through a hash: seed + epoch (DistributedSampler's choice) would give run seed=1 epoch 1
    # the same order as run seed=2 epoch 0, correlating the runs of a seed sweep.
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    return torch.randperm(n, generator=generator)


class EpochBatchSampler(Sampler[list[int]]):
    """Micro-batches of sample indices for one rank, epoch by epoch, with an exactly restorable position.

    For epoch ``e`` all ``n`` indices are permuted by a generator seeded from ``(seed, e)`` (identity order when
    ``shuffle`` is off). Rank ``r`` of ``world_size`` gets ``perm[r::world_size]``, cut so that every rank has the
    same number of batches (otherwise DDP ranks would wait on each other's missing collective at the end of an
    epoch). Micro-batch ``b`` of all ranks together is ``perm[b * m * world_size : (b + 1) * m * world_size]``:
    without the samples' lengths rank ``r`` takes every ``world_size``-th of them from ``r`` on; given the lengths
    (``lengths_or_n`` a sequence) and several ranks, :func:`balanced_shares` splits them so that ranks get about
    equal positions. Either way a step trains on the same samples on any number of devices.

    ``fit_capacity`` (data.fit_steps; needs the samples' lengths as the first argument): the permutation is
    rearranged by :func:`fit_steps` so that each micro-batch (under data.pack_steps: a step's samples) fits in as
    few micro-batches of that many positions per rank as the data's mean length allows (``fit_positions``), where
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
        lengths_or_n: int | Sequence[int] | torch.Tensor,
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
        self.lengths = None if isinstance(lengths_or_n, int) else [int(length) for length in lengths_or_n]
        self.fit_positions: int | None = None
        """What each micro-batch's samples are fitted to (fit_steps): as many fit_capacity micro-batches as the
        data's mean length needs for micro_batch_size samples (one for 16 samples of mean 245 in 4,096)."""
        if fit_capacity is not None and self.lengths:
            self.fit_positions = fit_positions(self.lengths, micro_batch_size, fit_capacity)
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
        self.num_batches = batches_per_rank(n, micro_batch_size, world_size, drop_last)
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
        order = epoch_permutation(self.num_samples, self.shuffle, self.seed, epoch)[: self.samples_per_epoch].tolist()
        group = self.micro_batch_size * self.world_size  # micro-batch b of all ranks together
        if self.fit_positions is not None:
            order = fit_steps(order, self.lengths, group, self.fit_positions * self.world_size)
        balance = self.lengths is not None and self.world_size > 1
        for b in range(start, self.num_batches):
            self._batch_index = b + 1  # before the yield: state_dict() read after receiving batch b counts it
            samples = order[b * group : (b + 1) * group]
            if balance:
                yield balanced_shares(samples, self.lengths, self.world_size)[self.rank]
            else:
                yield samples[self.rank :: self.world_size]

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
        epoch, batch_index = self._checked_position(state)
        self.epoch = epoch
        self._start_batch = batch_index
        self._batch_index = batch_index

    def _checked_position(self, state: dict[str, Any]) -> tuple[int, int]:
        """(epoch, batch_index) of a saved position; CheckpointError when it was saved with another data or batch
        setup, or lies outside this epoch's batches."""
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
        return epoch, batch_index
