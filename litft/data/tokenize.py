"""Tokenizing records once, up front, into one flat tensor; the dataset that serves them already shifted.

litgpt's own ``SFTDataset`` re-tokenizes on every ``__getitem__``, i.e. every epoch, in every worker. Here each record
is tokenized ONCE with litgpt's ``PromptStyle`` and ``Tokenizer`` rules, and the ids of all samples live in one flat
int32 tensor plus offsets: 50k samples of ~300 tokens take ~60 MB, and forked DataLoader workers share those pages. A
list of 50k Python lists would be copied page by page as the workers touch its reference counts.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch
from litgpt.prompts import PromptStyle, prompt_styles
from litgpt.tokenizer import Tokenizer
from torch.utils.data import Dataset

from litft.errors import ConfigError

IGNORE_INDEX = -100
"""Label value that gets no loss (``torch.nn.functional.cross_entropy``'s default ``ignore_index``)."""


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

    def subset(self, indices: Sequence[int]) -> TokenizedData:
        """The samples at ``indices``, in that order, with their statistics (no truncated or dropped counts)."""
        pieces = [self.tokens[self.offsets[i]:self.offsets[i + 1]] for i in indices]
        lengths = [len(piece) - 1 for piece in pieces]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        if lengths:
            offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64) + 1, dim=0)
        prompts = self.prompt_lengths[list(indices)] if len(indices) else self.prompt_lengths[:0]
        masked = sum(_masked_labels(int(p)) for p in prompts) if self.mask_prompt else 0
        stats = dataclasses.replace(
            self.stats, records=len(lengths), samples=len(lengths), truncated=0, dropped=0, tokens=sum(lengths),
            loss_tokens=sum(lengths) - masked, min_length=min(lengths, default=0),
            mean_length=sum(lengths) / len(lengths) if lengths else 0.0, max_length=max(lengths, default=0))
        return TokenizedData(torch.cat(pieces) if pieces else self.tokens[:0], offsets, prompts, self.mask_prompt,
                             stats)


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
    style = resolve_prompt_style(prompt_style)
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
        prompts = [prompt_text(style, r) for r in part]
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


def prompt_text(style: PromptStyle, record: dict[str, str]) -> str:
    """A record's prompt as the style writes it: ``style.apply(instruction, input=..., sys_prompt=system)``, the
    system prompt only when the record has one (LitGPT's Alpaca puts it where its own preamble goes, so it ends with
    a blank line there)."""
    from litgpt.prompts import Alpaca

    system = record.get("system") or ""
    if not system:
        return style.apply(prompt=record["instruction"], input=record.get("input", ""))
    if isinstance(style, Alpaca):
        system = system.rstrip() + "\n\n"
    return style.apply(prompt=record["instruction"], input=record.get("input", ""), sys_prompt=system)


def tokenize_documents(texts: Sequence[str], tokenizer: Tokenizer, max_seq_length: int) -> TokenizedData:
    """data.format 'text': each document encoded (BOS by the tokenizer's rule, EOS after it), the documents joined
    and cut into samples of max_seq_length + 1 ids (max_seq_length inputs and labels after the shift), the last
    shorter; no prompt, a loss on every token."""
    ids: list[int] = []
    for encoded in _encode_many(tokenizer, list(texts), bos=None, eos=True):
        ids.extend(encoded)
    keep = max_seq_length + 1
    chunks = [torch.tensor(ids[start:start + keep], dtype=torch.int32) for start in range(0, len(ids), keep)]
    chunks = [chunk for chunk in chunks if len(chunk) >= 2]  # a sample needs an input and a label
    lengths = [len(chunk) - 1 for chunk in chunks]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64) + 1, dim=0)
    stats = TokenStats(records=len(texts), samples=len(lengths), truncated=0, dropped=0, tokens=sum(lengths),
                       loss_tokens=sum(lengths), min_length=min(lengths, default=0),
                       mean_length=sum(lengths) / len(lengths) if lengths else 0.0, max_length=max(lengths, default=0),
                       max_seq_length=max_seq_length)
    return TokenizedData(tokens=torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.int32), offsets=offsets,
                         prompt_lengths=torch.zeros(len(lengths), dtype=torch.int32), mask_prompt=False, stats=stats)


def _masked_labels(prompt_length: int) -> int:
    """Labels (ids[1:]) that predict a prompt token: the first prompt_length - 1 (the first prompt token is never
    a label). The label at position prompt_length - 1 is the first response token, the first one with a loss."""
    return max(prompt_length - 1, 0)


def resolve_prompt_style(style: Union[str, PromptStyle]) -> PromptStyle:
    """A LitGPT prompt style, or its name; ConfigError (with close names) for a name LitGPT does not know."""
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

    Nearly all the time is the Rust encoder's own (litgpt's wrapper adds ~20%): ~0.35 ms per 300-token record on one
    core, so ~20 s for 50k records. ``encode_batch`` runs the encoder on a thread pool over the free cores: on 2 busy
    cores it is no faster than one call per text, the gain is on a GPU host's idle cores. litgpt's BOS/EOS rules are
    applied to the raw ids by :func:`_litgpt_special_tokens`. The first text is also encoded by litgpt's own ``encode``.
    If the two ever disagree (a litgpt release changed its rules), every text of the call goes through litgpt's
    ``encode``: slower, but right. SentencePiece tokenizers always use litgpt's ``encode``.
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


def choose_pad_id(tokenizer: Tokenizer) -> int:
    """The tokenizer's pad id if it has one, else its EOS id, else 0. Padded positions get no loss and are masked
    by causality for the real tokens before them, so any valid id will do."""
    for candidate in (getattr(tokenizer, "pad_id", None), tokenizer.eos_id):
        if candidate is not None:
            return int(candidate)
    return 0
