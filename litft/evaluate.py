"""`litft evaluate OUT_DIR`: how good a fine-tuned model is, on the run's own validation set (or a given file).

- Perplexity: exp of the mean loss per loss token, with the run's tokenization, prompt style and masking: the
  validation loss the run logged, as a perplexity (the same sums: litft's CausalLM over the same batches).
- BLEU and ROUGE-L of generated answers against the references: greedy answers (temperature 0) to the first
  ``samples`` validation records' prompts, scored with sacrebleu (corpus BLEU) and rouge-score (ROUGE-L F1, with
  stemming), both x 100. They need the ``eval`` extra: ``pip install 'litft[eval]'``.
- ``--base``: the same for the base model the run started from, in one table beside the fine-tuned one.

Results go to OUT_DIR/eval.json (and ``litft compare`` shows them: eval.finetuned.perplexity, ...).
Standard benchmarks (MMLU, HellaSwag, ...) are LitGPT's: ``litgpt evaluate OUT_DIR/final/merged --tasks ...``
with lm-eval-harness installed.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from litft.errors import CheckpointError, ConfigError


def run_recipe(out_dir: Path):
    """The recipe a run was made from (its config.yaml)."""
    from litft.recipe import load_recipe

    config = out_dir / "config.yaml"
    if not config.is_file():
        raise CheckpointError(f"'{out_dir}' holds no config.yaml: give the out_dir of a litft run")
    return load_recipe(str(config), validate_paths=False)


def validation_set(recipe, data_path: str | None = None):
    """The run's validation records and tokenized samples, as the run made them (or all of ``data_path``'s, in the
    run's format). Text documents (data.format text) have chunks and no records: perplexity only."""
    import dataclasses

    from litgpt.tokenizer import Tokenizer

    from litft.data import data_file, data_format, prepare_data, read_records, split_records, tokenize_records
    from litft.data.tokenize import SFTDataset
    from litft.recipe import resolve_path

    cfg = recipe.data
    tokenizer = Tokenizer(resolve_path(recipe.model.tokenizer_dir or recipe.model.checkpoint_dir))
    if data_path is not None:  # the whole file (or folder) as the validation set
        cfg = dataclasses.replace(cfg, path=data_path, val_path=data_path)
    if data_format(data_file(cfg.path), cfg.format) == "text":
        return [], prepare_data(cfg, tokenizer, recipe.seed).val
    if cfg.val_path is not None:
        records = read_records(data_file(cfg.val_path), cfg.fields, cfg.format)
    else:
        records = split_records(read_records(data_file(cfg.path), cfg.fields, cfg.format), cfg.val_split,
                                recipe.seed)[1]
    data = tokenize_records(records, tokenizer, cfg.prompt_style, cfg.max_seq_length, cfg.mask_prompt)
    return records, SFTDataset(data)


@torch.inference_mode()
def perplexity(model: torch.nn.Module, dataset, micro_batch_size: int, max_seq_length: int,
               device: torch.device, max_batches: int | None = None) -> dict:
    """exp(mean loss per loss token) of ``model`` (a LitGPT GPT) over ``dataset``, padded batches in order."""
    from litft.data import EpochBatchSampler, build_dataloader
    from litft.model import CausalLM
    from litft.train.engines import model_inputs

    sampler = EpochBatchSampler(len(dataset), micro_batch_size, shuffle=False, seed=0, drop_last=False)
    loader = build_dataloader(dataset, sampler, pad_id=0, num_workers=0, packing=False)  # padding has no loss
    causal = CausalLM(model, loss_chunk=0, max_seq_length=max_seq_length)
    loss_sum, tokens = 0.0, 0
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        loss_sum += float(causal(**model_inputs(batch, device)).double())
        tokens += batch["loss_tokens"]
    loss = loss_sum / max(tokens, 1)
    return {"loss": loss, "perplexity": math.exp(loss), "loss_tokens": tokens}


def text_scores(hypotheses: list[str], references: list[str]) -> dict:
    """Corpus BLEU (sacrebleu) and mean ROUGE-L F1 (rouge-score, stemmed), both x 100."""
    try:
        import sacrebleu
        from rouge_score import rouge_scorer
    except ImportError as err:
        raise ConfigError(f"evaluate: BLEU and ROUGE-L need the eval extra ({err.name} is missing):"
                          " pip install 'litft[eval]', or pass --samples 0 for perplexity alone") from None
    bleu = sacrebleu.corpus_bleu(hypotheses, [references]).score
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    rouge = [scorer.score(ref, hyp)["rougeL"].fmeasure for hyp, ref in zip(hypotheses, references)]
    return {"bleu": bleu, "rouge_l": 100 * sum(rouge) / max(len(rouge), 1)}


def score_model(loaded, records, dataset, recipe, samples: int, max_new_tokens: int,
                max_batches: int | None) -> dict:
    """Perplexity over the set and BLEU/ROUGE-L over the first ``samples`` records' greedy answers."""
    from litft.data.tokenize import prompt_text
    from litft.use import generate

    result = perplexity(loaded.model, dataset, recipe.train.micro_batch_size, recipe.data.max_seq_length,
                        loaded.device, max_batches)
    result["weights"] = loaded.weights
    if samples and records:
        chosen = records[:samples]
        answers = []
        for record in chosen:
            prompt = prompt_text(loaded.prompt_style, record)
            answers.append(generate(loaded, prompt, max_new_tokens=max_new_tokens, raw=True).text.strip())
        result.update(text_scores(answers, [r["output"] for r in chosen]))
        result["samples"] = len(chosen)
        result["examples"] = [{"instruction": r["instruction"], "reference": r["output"], "answer": a}
                              for r, a in zip(chosen[:3], answers[:3])]
    return result


def evaluate(out_dir: str | Path, data_path: str | None = None, base: bool = False, samples: int = 20,
             max_new_tokens: int = 64, max_batches: int | None = None, device: str | None = None) -> dict:
    """Score a run's model (and with ``base`` its base model) and write OUT_DIR/eval.json; returns its content."""
    import json

    from litft.files import write_text_atomic
    from litft.recipe import resolve_path
    from litft.use import load_model

    out_dir = Path(out_dir)
    recipe = run_recipe(out_dir)
    records, dataset = validation_set(recipe, data_path)
    models = {"finetuned": load_model(out_dir, device=device)}
    if base:
        checkpoint = resolve_path(recipe.model.checkpoint_dir)
        if recipe.init != "pretrained" or checkpoint is None or not (checkpoint / "lit_model.pth").is_file():
            raise CheckpointError("evaluate --base: the run's base weights are not on disk (model.checkpoint_dir"
                                  f" {recipe.model.checkpoint_dir!r}, init {recipe.init})")
        models["base"] = load_model(checkpoint, device=device)
        models["base"].prompt_style = models["finetuned"].prompt_style  # the same prompts for both
    scores = {name: score_model(loaded, records, dataset, recipe, samples, max_new_tokens, max_batches)
              for name, loaded in models.items()}
    result = {**scores, "data": data_path or "the run's validation set", "records": len(records),
              "samples_generated": min(samples, len(records)), "max_new_tokens": max_new_tokens}
    write_text_atomic(out_dir / "eval.json", json.dumps(result, indent=2))
    return result


def table(result: dict) -> str:
    """The scores as a markdown table, one row per model."""
    lines = ["| model | perplexity | val loss | BLEU | ROUGE-L |", "|---|---:|---:|---:|---:|"]
    for name in ("base", "finetuned"):
        if name in result:
            r = result[name]
            bleu = f"{r['bleu']:.2f}" if "bleu" in r else "-"
            rouge = f"{r['rouge_l']:.2f}" if "rouge_l" in r else "-"
            lines.append(f"| {name} | {r['perplexity']:.3f} | {r['loss']:.4f} | {bleu} | {rouge} |")
    return "\n".join(lines)
