"""Where a micro-batch's time goes: the host (Python, dispatch, kernel launches) or the device.

    python benchmarks/host_overhead.py --recipe tiny-llama-lora --tokens 1024,4096 --out DIR

Builds the recipe's model (random weights) once, then times one forward+backward of a packed row of T tokens
(samples of 256 tokens each, attention kept within each sample, as litft's packed batches are) under each way of
running the transformer blocks:

- eager:        no torch.compile
- dynamic:      each block compiled with dynamic shapes (litft's default until issue 5)
- static:       each block compiled for the exact shape (one compile per distinct row length)
- cudagraphs:   static, plus CUDA graphs (torch.compile mode="reduce-overhead"): the host launches one graph
                per block instead of every kernel

For each it prints the wall time per micro-batch, the device's kernel time in it (torch.profiler, summed over CUDA
kernels), the first call's time (compilation) and the peak allocated memory, so "host-bound" is a measured ratio.
Writes DIR/host_overhead.md and .json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from litft.layers import use_fast_layers  # noqa: E402
from litft.model import CausalLM, build_model, model_config  # noqa: E402
from litft.plan import resolve  # noqa: E402
from litft.recipe import load_recipe  # noqa: E402
from litft.strategy import build_fabric  # noqa: E402
from litft.train.optim import build_optimizer  # noqa: E402

SAMPLE_TOKENS = 256  # the benchmark data's mean sample is ~250 tokens


def packed_row(tokens: int, vocab: int, device: torch.device) -> dict:
    """One packed row of `tokens` positions: samples of SAMPLE_TOKENS, each restarting its positions at 0."""
    n = tokens // SAMPLE_TOKENS
    lengths = [SAMPLE_TOKENS] * n
    ids = torch.randint(0, vocab, (1, tokens), device=device)
    positions = torch.cat([torch.arange(length) for length in lengths]).view(1, -1).to(device)
    cu = torch.tensor([0] + [SAMPLE_TOKENS * (i + 1) for i in range(n)], dtype=torch.int32, device=device)
    return {"input_ids": ids, "labels": ids.clone(), "positions": positions, "cu_seqlens": cu}


def set_mode(gpt: torch.nn.Module, mode: str) -> None:
    torch._dynamo.reset()
    for block in gpt.transformer.h:
        block._compiled_call_impl = None  # undo an earlier block.compile()
        if mode == "dynamic":
            block.compile(dynamic=True)
        elif mode == "static":
            block.compile(dynamic=False)
        elif mode == "cudagraphs":
            block.compile(dynamic=False, mode="reduce-overhead")


def micro_step(fabric, model, batch: dict, cudagraphs: bool) -> None:
    if cudagraphs:
        torch.compiler.cudagraph_mark_step_begin()
    loss = model(**batch)
    fabric.backward(loss / 1000.0)


def kernel_ms(fabric, model, batch: dict, cudagraphs: bool, iters: int = 2) -> tuple[float, str]:
    """Device kernel time per micro-batch (sum of CUDA kernels' self time), and a top-ops table by host time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            micro_step(fabric, model, batch, cudagraphs)
        torch.cuda.synchronize()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    table = events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60)
    return device_us / 1000 / iters, table


def measure(fabric, model, gpt, mode: str, tokens: list[int], vocab: int, iters: int) -> list[dict]:
    set_mode(gpt, mode)
    cudagraphs = mode == "cudagraphs"
    rows = []
    for t in tokens:
        batch = packed_row(t, vocab, fabric.device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        micro_step(fabric, model, batch, cudagraphs)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - started
        for _ in range(3):
            micro_step(fabric, model, batch, cudagraphs)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(iters):
            micro_step(fabric, model, batch, cudagraphs)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - started) * 1000 / iters
        device_ms, table = kernel_ms(fabric, model, batch, cudagraphs)
        row = {
            "mode": mode, "tokens": t, "wall_ms": wall_ms, "device_ms": device_ms,
            "device_busy_pct": 100 * device_ms / wall_ms, "tok_s": t / wall_ms * 1000, "first_call_s": first_s,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
        rows.append(row)
        print(f"{mode:>10} T={t:>5}: {wall_ms:7.1f} ms/micro-batch, device {device_ms:6.1f} ms"
              f" ({row['device_busy_pct']:.0f}% busy), {row['tok_s']:,.0f} tok/s, first call {first_s:.1f}s,"
              f" peak {row['peak_allocated_gib']:.2f} GiB", flush=True)
        if t == tokens[0] and mode in ("dynamic", "cudagraphs"):
            print(f"--- top ops by host time, {mode}, T={t} (2 micro-batches) ---\n{table}", flush=True)
        model.zero_grad(set_to_none=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny-llama-lora")
    parser.add_argument("--tokens", default="1024,4096", help="row lengths to time (multiples of 256)")
    parser.add_argument("--modes", default="eager,dynamic,static,cudagraphs")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("out/host-overhead"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokens = [int(t) for t in args.tokens.split(",")]

    recipe = load_recipe(args.recipe, args=["--init", "random", "--model.tokenizer_dir", "litft:demo/model"],
                         validate_paths=False)
    fabric = build_fabric(recipe)
    config = model_config(recipe)
    fabric.seed_everything(0)
    gpt = build_model(fabric, recipe, config)
    use_fast_layers(gpt)  # the layers any device runs (the Triton ones off: compile modes are measured here)
    model = fabric.setup_module(CausalLM(gpt, recipe.train.loss_chunk, recipe.data.max_seq_length))
    optimizer = fabric.setup_optimizers(build_optimizer(recipe, model, resolve(recipe, config, fabric.device.type, 1)))
    del optimizer  # built so memory matches a run's layout; only forward+backward are timed

    rows = []
    for mode in args.modes.split(","):
        try:
            rows += measure(fabric, model, gpt, mode, tokens, config.padded_vocab_size, args.iters)
        except Exception as err:  # a mode that fails is a result
            print(f"{mode}: failed: {type(err).__name__}: {str(err)[:400]}", flush=True)
            rows.append({"mode": mode, "error": f"{type(err).__name__}: {str(err)[:400]}"})
    head = "| mode | T | ms / micro-batch | device ms | device busy | tok/s | first call s | peak alloc GiB |"
    lines = [f"# host overhead: {args.recipe} on {torch.cuda.get_device_name()}", "",
             f"Command: `python benchmarks/host_overhead.py --recipe {args.recipe} --tokens {args.tokens}`"
             f" (torch {torch.__version__})", "", head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | | failed: {r['error'][:100]} | | | | | |")
        else:
            lines.append(f"| {r['mode']} | {r['tokens']} | {r['wall_ms']:.1f} | {r['device_ms']:.1f} |"
                         f" {r['device_busy_pct']:.0f}% | {r['tok_s']:,.0f} | {r['first_call_s']:.1f} |"
                         f" {r['peak_allocated_gib']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    (args.out / f"host_overhead-{args.recipe}.md").write_text(text)
    (args.out / f"host_overhead-{args.recipe}.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
