"""What would fit: the single changes to a recipe (or pairs of them) that bring its predicted device memory under a
budget, least intrusive first, each with the GiB it saves (`litft estimate --gpu-memory`)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

from litft.memory.ledger import estimate_memory
from litft.recipe import Recipe

def _candidate_changes(recipe: Recipe) -> list[tuple[str, dict]]:
    t = recipe.train
    out: list[tuple[str, dict]] = []
    # data.pack_capacity overrides micro_batch_size x max_seq_length as a micro-batch's positions: drop it first
    unset_capacity = {"data": {"pack_capacity": None}} if recipe.data.pack_capacity is not None else {}
    if unset_capacity and recipe.data.pack_capacity > t.micro_batch_size * recipe.data.max_seq_length:
        out.append((f"data.pack_capacity null (micro-batches of {t.micro_batch_size * recipe.data.max_seq_length:,}"
                    " positions, same global batch)", unset_capacity))
    micro = t.micro_batch_size // 2
    while micro >= 1:
        out.append((f"train.micro_batch_size {micro} (same global batch, more accumulation)",
                    {"train": {"micro_batch_size": micro}, **unset_capacity}))
        micro //= 2
    if not t.activation_checkpointing:
        out.append(("train.activation_checkpointing true (~30% more compute)", {"train": {"activation_checkpointing": True}}))
    if recipe.precision.endswith("-mixed"):
        out.append(("precision bf16-true (no fp32 master weights or fp32 Adam state)", {"precision": "bf16-true"}))
    if recipe.method == "full":
        out.append(("optimizer bitsandbytes.optim.AdamW8bit (8-bit Adam state)",
                    {"optimizer": {"class_path": "bitsandbytes.optim.AdamW8bit"}}))
        out.append(("optimizer torch.optim.SGD, momentum 0 (no optimizer state)",
                    {"optimizer": {"class_path": "torch.optim.SGD", "init_args": {"momentum": 0.0}}}))
        out.append(("method lora (frozen weights, small adapters)", {"method": "lora"}))
    if recipe.method in ("full", "lora") and not recipe.precision.endswith("-mixed"):
        out.append(("method qlora, quantize nf4-dq (4-bit frozen weights)", {"method": "qlora", "quantize": "nf4-dq"}))
    if recipe.data.max_seq_length >= 256:
        out.append((f"data.max_seq_length {recipe.data.max_seq_length // 2} (truncates long samples)",
                    {"data": {"max_seq_length": recipe.data.max_seq_length // 2}}))
    return out


def _apply(recipe: Recipe, change: dict) -> Recipe:
    updates = {}
    for key, value in change.items():
        if isinstance(value, dict) and key != "optimizer":
            updates[key] = dataclasses.replace(getattr(recipe, key), **value)
        elif key == "optimizer":
            spec = recipe.optimizer
            cls_path = value.get("class_path", spec.class_path)
            module_name, _, class_name = cls_path.rpartition(".")
            params = inspect.signature(getattr(importlib.import_module(module_name), class_name).__init__).parameters
            args = {k: v for k, v in spec.init_args.items() if k in params}
            args.update(value.get("init_args", {}))
            updates[key] = dataclasses.replace(spec, class_path=cls_path, init_args=args)
        else:
            updates[key] = value
    return dataclasses.replace(recipe, **updates)


def what_would_fit(recipe: Recipe, budget_gib: float) -> list[dict[str, Any]]:
    """Single changes (and, when none fits alone, pairs) that bring the predicted device memory under the budget,
    least intrusive first, each with the GiB it saves."""
    base = estimate_memory(recipe)
    changes = _candidate_changes(recipe)
    results = []
    for label, change in changes:
        est = estimate_memory(_apply(recipe, change))
        results.append({"change": label, "overrides": change, "device_gib": est.device_gib,
                        "saving_gib": base.device_gib - est.device_gib, "fits": est.device_gib <= budget_gib})
    fitting = [r for r in results if r["fits"]]
    if fitting:
        return fitting
    pairs = []
    for i, (label_a, change_a) in enumerate(changes):
        for label_b, change_b in changes[i + 1 :]:
            if set(change_a) & set(change_b) - {"train", "data"}:  # these two merge key by key
                continue
            merged = _merge(change_a, change_b)
            est = estimate_memory(_apply(recipe, merged))
            if est.device_gib <= budget_gib:
                pairs.append({"change": f"{label_a} + {label_b}", "overrides": merged, "device_gib": est.device_gib,
                              "saving_gib": base.device_gib - est.device_gib, "fits": True})
    return pairs[:8]


def _merge(a: dict, b: dict) -> dict:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in a.items()}
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out
