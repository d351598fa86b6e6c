"""Alpaca-like benchmark data with realistic lengths, from the shipped synthetic text (no third-party text).

    python benchmarks/make_bench_data.py --out out/bench-data/alpaca_like.json [--rows 1000] [--seed 0]

Throughput and activation memory depend on sequence lengths, and the demo instructions are short. The reference
figures (../shared/reference/measured-h100.md) used rows of mean ~245 tokens with ~5% over 512. A log-normal with
median 212 and sigma 0.536 has that mean and tail: mean = 212 x exp(0.536^2 / 2) = 245, and
P(L > 512) = P(Z > (ln 512 - ln 212) / 0.536) = P(Z > 1.645) = 5%. Each row's target length (prompt template
included, in tokens of the tokenizer given) is drawn from it, and sentences of litft/assets/demo/pretrain.txt fill
the instruction (~15%), an optional input (~25%) and the output (the rest) until the row reaches its target.

`--tail10`: the held-out-style lengths of the multi-GPU measurements (mean ~268, 10% over 512): median 211 and sigma
0.692 give mean = 211 x exp(0.692^2 / 2) = 268 and P(L > 512) = P(Z > (ln 512 - ln 211) / 0.692) = P(Z > 1.28) = 10%.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path

MEDIAN, SIGMA = 212, 0.536


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default="litft:demo/model", help="a directory with tokenizer.json")
    parser.add_argument("--tail10", action="store_true", help="mean ~268 tokens, 10%% over 512 (see above)")
    args = parser.parse_args()

    from litgpt.prompts import PromptStyle
    from litgpt.tokenizer import Tokenizer

    from litft.recipe import resolve_path

    tokenizer = Tokenizer(resolve_path(args.tokenizer))
    style = PromptStyle.from_name("alpaca")
    text = resolve_path("litft:demo/pretrain.txt").read_text(encoding="utf-8")
    sentences = [s.strip() + "." for s in text.replace("\n", " ").split(".") if len(s.strip()) > 3]
    rng = random.Random(args.seed)

    def count(record: dict) -> int:
        prompt = style.apply(prompt=record["instruction"], input=record["input"])
        return len(tokenizer.encode(prompt)) + len(tokenizer.encode(record["output"], bos=False, eos=True))

    rows, lengths = [], []
    for _ in range(args.rows):
        median, sigma = (211, 0.692) if args.tail10 else (MEDIAN, SIGMA)
        target = max(48, int(math.exp(rng.gauss(math.log(median), sigma))))
        record = {"instruction": rng.choice(sentences), "input": "", "output": ""}
        if rng.random() < 0.4:
            record["input"] = " ".join(rng.choice(sentences) for _ in range(max(1, target // 60)))
        record["output"] = rng.choice(sentences)  # every row teaches something, however long its prompt
        while count(record) < target:
            record["output"] = record["output"] + " " + rng.choice(sentences)
        rows.append(record)
        lengths.append(count(record))

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    over = sum(n > 512 for n in lengths) / len(lengths)
    print(f"wrote {len(rows)} rows to {args.out}: tokens mean {statistics.fmean(lengths):.0f}, median"
          f" {statistics.median(lengths):.0f}, max {max(lengths)}, {over:.1%} over 512")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
