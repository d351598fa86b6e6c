"""Shared pytest fixtures. Everything here is built locally: tests never touch the network or a model hub."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

# litft.kernels' Triton kernels run on CUDA tensors. On a machine without a GPU the tests run them in Triton's
# interpreter, on CPU tensors; Triton reads this when the kernels are defined (litft.kernels' import), so it is set
# before any test module imports litft.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The memory ledger caches its traces under LITFT_CACHE (default ~/.cache/litft): the tests, and the litft processes
# they start, use a cache of their own, so a test run never changes what the user's `litft ls` shows.
os.environ["LITFT_CACHE"] = tempfile.mkdtemp(prefix="litft-test-cache-")

# A few sentences in the style of the instruction data, enough for BPE to learn merges for common words.
_TOKENIZER_CORPUS = [
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:\nName three primary colors.\n\n### Input:\n\n### Response:\nRed, blue and yellow.",
    "The quick brown fox jumps over the lazy dog.",
    "Fine-tuning adapts a pretrained language model to follow instructions.",
    "Add the numbers 2 and 3. The answer is 5.",
    "Translate to French: good morning. Bonjour.",
]


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory that ``litgpt.tokenizer.Tokenizer`` loads: a byte-level BPE (any text encodes, no unknown
    tokens) trained on a few sentences, with special tokens ``<s>`` (id 0, BOS) and ``</s>`` (id 1, EOS).

    tokenizer_config.json sets no ``add_bos_token``, so litgpt's ``Tokenizer.use_bos`` is False. Copy the directory
    and set ``"add_bos_token": true`` to test the BOS path.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = tmp_path_factory.mktemp("tiny_tokenizer")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TOKENIZER_CORPUS, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


# A handful of instruction records in three learnable families: enough samples for several optimizer steps.
def _tiny_records() -> list[dict[str, str]]:
    records = []
    for i in range(40):
        records.append({"instruction": f"Add {i % 7} and {i % 5}.", "input": "", "output": str(i % 7 + i % 5)})
        word = ["red", "blue", "green", "fox", "dog"][i % 5]
        records.append({"instruction": "Repeat the word twice.", "input": word, "output": f"{word} {word}"})
    return records


@pytest.fixture(scope="session")
def tiny_data_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """80 Alpaca-format records in a .jsonl file."""
    path = tmp_path_factory.mktemp("tiny_data") / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _tiny_records()) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """A LitGPT checkpoint directory of a 2-layer Llama-style model (GQA, RMSNorm, SwiGLU) with random weights:
    lit_model.pth, model_config.yaml (written by litgpt's save_config) and the tiny tokenizer."""
    import shutil

    import torch
    from litgpt.config import Config
    from litgpt.model import GPT
    from litgpt.tokenizer import Tokenizer
    from litgpt.utils import save_config

    directory = tmp_path_factory.mktemp("tiny_checkpoint")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_tokenizer_dir / name, directory / name)
    vocab = Tokenizer(directory).vocab_size
    config = Config(
        name="litft-test-tiny", block_size=128, vocab_size=vocab, padding_multiple=64, n_layer=2, n_embd=32,
        n_head=4, n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False,
        norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64,
    )
    save_config(config, directory)
    torch.manual_seed(0)
    model = GPT(config)
    model.apply(model._init_weights)
    torch.save(model.state_dict(), directory / "lit_model.pth")
    return directory


@pytest.fixture
def tiny_recipe(tiny_checkpoint_dir: Path, tiny_data_path: Path, tmp_path: Path):
    """Build a Recipe for the tiny model and data on the CPU; keyword arguments override sections."""
    from litft.recipe import load_recipe

    def make(**overrides):
        base = {
            "model": {"checkpoint_dir": str(tiny_checkpoint_dir)},
            "accelerator": "cpu",
            "precision": "32-true",
            "data": {"path": str(tiny_data_path), "max_seq_length": 96, "num_workers": 0, "val_split": 0.1},
            "train": {"global_batch_size": 8, "micro_batch_size": 4, "max_steps": 4, "warmup_steps": 1},
            "eval": {"interval": 2, "max_batches": 2},
            "logging": {"progress": "plain", "tensorboard": True},
            "out_dir": str(tmp_path / "run"),
        }
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                base[key] = {**base[key], **value}
            else:
                base[key] = value
        return load_recipe(None, **base)

    return make
