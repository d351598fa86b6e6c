"""LitGPT's finetune configs (`litgpt finetune_lora --config FILE`, `finetune_full`) read as litft recipes.

A lab written for LitGPT hands out its YAML files; `litft finetune --config lab.yaml` takes them as they are (and
`litft convert lab.yaml` prints the recipe they become). Each key is mapped to litft's, the mapping is printed, and a
setting litft cannot honour is refused (exit 2) by name. The method follows the script the file was written for:
LoRA keys (lora_r, lora_query, ...) mean finetune_lora, a quantize format with them QLoRA, none of them
finetune_full.
"""

from __future__ import annotations

from typing import Any

from litft.errors import ConfigError

LITGPT_ONLY_KEYS = {"checkpoint_dir", "lora_r", "lora_alpha", "lora_dropout", "logger_name", "resume"}
"""Top-level keys that a LitGPT finetune config has and a litft recipe does not (checkpoint_dir is model's there)."""

_TARGETS = {"lora_query": "q", "lora_key": "k", "lora_value": "v", "lora_projection": "o", "lora_mlp": "mlp",
            "lora_head": "head"}
_DATA_SETS = {"litgpt.data.Alpaca2k": "alpaca2k"}
_IGNORED = {
    ("eval", "max_new_tokens"): "LitGPT's sample generation after each evaluation; litft does not generate there",
    ("data", "seed"): "litft's one seed (the recipe's seed) splits and shuffles the data",
}


def is_litgpt_config(values: dict) -> bool:
    """Whether a YAML mapping is a LitGPT finetune config rather than a litft recipe."""
    return bool(LITGPT_ONLY_KEYS & set(values)) or (
        isinstance(values.get("data"), dict) and "class_path" in values["data"])


def from_litgpt(values: dict) -> tuple[dict, list[str]]:
    """(the litft recipe's values, the mapping as lines 'litgpt key -> litft key = value'). ConfigError (exit 2)
    listing every setting that has no litft equivalent."""
    recipe: dict[str, Any] = {}
    lines: list[str] = []
    problems: list[str] = []

    def put(source: str, dotted: str, value: Any) -> None:
        node = recipe
        *sections, leaf = dotted.split(".")
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
        lines.append(f"{source} -> {dotted} = {value!r}")

    values = dict(values)
    lora = any(key.startswith("lora_") for key in values)
    quantize = values.pop("quantize", None)
    if quantize:
        name = str(quantize).removeprefix("bnb.")
        if name not in ("nf4", "nf4-dq", "fp4", "fp4-dq"):
            problems.append(f"quantize: {quantize!r} has no litft equivalent (litft trains on 4-bit weights: nf4,"
                            " nf4-dq, fp4, fp4-dq)")
        else:
            put("quantize", "quantize", name)
    put("(finetune_lora)" if lora else "(finetune_full)", "method", ("qlora" if quantize else "lora") if lora else "full")
    simple = {"checkpoint_dir": "model.checkpoint_dir", "out_dir": "out_dir", "precision": "precision",
              "devices": "devices", "num_nodes": "num_nodes", "seed": "seed", "lora_r": "lora.r",
              "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout"}
    targets = []
    for key, value in values.items():
        if key in simple:
            if value is not None:
                put(key, simple[key], value)
        elif key in _TARGETS:
            if value:
                targets.append(_TARGETS[key])
        elif key == "data":
            _data(value, put, problems, lines)
        elif key == "train":
            _train(value or {}, values.get("optimizer"), put, problems)
        elif key == "eval":
            _eval(value or {}, put, problems, lines)
        elif key == "optimizer":
            if isinstance(value, str):
                put("optimizer", "optimizer", value)
            elif isinstance(value, dict):
                put("optimizer", "optimizer", {"class_path": value.get("class_path", "torch.optim.AdamW"),
                                               "init_args": dict(value.get("init_args") or {})})
        elif key == "logger_name":
            if value == "wandb":
                problems.append("logger_name: wandb is not a litft logger yet; use tensorboard or csv")
            else:
                put("logger_name", "logging.tensorboard", value == "tensorboard")
        elif key == "resume":
            if value not in (None, False):
                problems.append(f"resume: {value!r}: pass it to litft finetune as --resume auto (or a checkpoint)")
        else:
            problems.append(f"{key}: not a key of LitGPT's finetune configs that litft knows")
    if targets:
        put("lora_query/key/value/projection/mlp/head", "lora.targets", targets)
    if problems:
        raise ConfigError(problems, source="the LitGPT config")
    return recipe, lines


def _data(value: Any, put, problems: list[str], lines: list[str]) -> None:
    if not isinstance(value, dict):
        problems.append(f"data: expected class_path and init_args, got {value!r}")
        return
    class_path = value.get("class_path")
    args = dict(value.get("init_args") or {})
    if class_path in _DATA_SETS:
        put(f"data.class_path {class_path}", "data.path", _DATA_SETS[class_path])
    elif class_path == "litgpt.data.JSON" and args.get("json_path"):
        put("data.init_args.json_path", "data.path", str(args.pop("json_path")))
    else:
        problems.append(f"data.class_path: {class_path!r} has no litft equivalent yet (litft reads Alpaca-format"
                        " JSON/JSONL files and the named set alpaca2k)")
    args.pop("json_path", None)
    for key, arg in args.items():
        if key == "mask_prompt":
            put("data.init_args.mask_prompt", "data.mask_prompt", bool(arg))
        elif key == "val_split_fraction":
            put("data.init_args.val_split_fraction", "data.val_split", arg)
        elif key == "prompt_style":
            put("data.init_args.prompt_style", "data.prompt_style", arg)
        elif key == "num_workers":
            put("data.init_args.num_workers", "data.num_workers", arg)
        elif key == "ignore_index":
            if arg != -100:
                problems.append(f"data.init_args.ignore_index: {arg}: litft masks with -100 only")
        elif key == "seed":
            lines.append(f"data.init_args.seed -> (not used: {_IGNORED[('data', 'seed')]})")
        else:
            problems.append(f"data.init_args.{key}: has no litft equivalent")


def _train(train: dict, optimizer: Any, put, problems: list[str]) -> None:
    mapping = {"save_interval": "train.save_interval", "log_interval": "logging.interval",
               "global_batch_size": "train.global_batch_size", "micro_batch_size": "train.micro_batch_size",
               "lr_warmup_steps": "train.warmup_steps", "epochs": "train.epochs", "max_steps": "train.max_steps",
               "max_seq_length": "data.max_seq_length"}
    for key, value in train.items():
        if key in mapping:
            if value is not None:
                put(f"train.{key}", mapping[key], value)
        elif key == "max_norm":
            put("train.max_norm", "train.max_grad_norm", value)  # None: LitGPT does not clip, nor will litft
        elif key == "min_lr":
            lr = ((optimizer or {}).get("init_args") or {}).get("lr") if isinstance(optimizer, dict) else None
            if value is not None and lr:
                put("train.min_lr (over optimizer lr)", "train.min_lr_ratio", value / lr)
        elif key in ("max_tokens", "tie_embeddings", "lr_warmup_fraction"):
            if value not in (None, False):
                problems.append(f"train.{key}: {value!r} has no litft equivalent")
        else:
            problems.append(f"train.{key}: has no litft equivalent")


def _eval(evaluation: dict, put, problems: list[str], lines: list[str]) -> None:
    mapping = {"interval": "eval.interval", "max_iters": "eval.max_batches", "initial_validation": "eval.initial",
               "final_validation": "eval.final"}
    for key, value in evaluation.items():
        if key in mapping:
            if value is not None:
                put(f"eval.{key}", mapping[key], value)
        elif key == "max_new_tokens":
            lines.append(f"eval.max_new_tokens -> (not used: {_IGNORED[('eval', 'max_new_tokens')]})")
        else:
            problems.append(f"eval.{key}: has no litft equivalent")
