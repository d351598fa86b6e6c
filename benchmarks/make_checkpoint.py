"""A LitGPT checkpoint folder with random weights of a named architecture, for runs that must start from the same
weights whatever their strategy (FSDP and DeepSpeed ZeRO-3 draw random weights shard by shard; a checkpoint is the
same for all):

    python benchmarks/make_checkpoint.py --model tiny-llama-1.1b --out out/ckpt/tiny-llama [--dtype bfloat16]

Writes lit_model.pth, model_config.yaml and the demo tokenizer's files (the bench data is tokenized with it).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

import torch
import yaml


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a LitGPT model name, e.g. tiny-llama-1.1b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from litgpt.config import Config
    from litgpt.model import GPT

    from litft.recipe import resolve_path

    config = Config.from_name(args.model)
    torch.manual_seed(args.seed)
    torch.set_default_dtype(getattr(torch, args.dtype))
    model = GPT(config)
    args.out.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items() if k not in ("cos", "sin")}
    torch.save(state, args.out / "lit_model.pth")
    (args.out / "model_config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(config)))
    tokenizer = resolve_path("litft:demo/model")
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "generation_config.json"):
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, args.out / name)
    print(f"wrote {args.out}: {sum(v.numel() for v in state.values()):,} parameters in {args.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
