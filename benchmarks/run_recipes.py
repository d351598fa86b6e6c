"""Run a named set of litft recipe runs, each in its own process, and record every figure with its command.

    python benchmarks/run_recipes.py SET --out DIR

Each run is `python -m litft.cli finetune --config RECIPE [overrides] --out_dir DIR/runs/NAME`. A run that fails
(out of memory, exit 4; anything else) is recorded with its exit code and last message: in a sweep that is a
result, not a crash. Writes DIR/SET.md (a table, the commands, GPU, driver and versions) and DIR/SET.json (each run's
result.json). Speed and memory do not depend on weight values, so the GPU sets use `--init random` with the demo
tokenizer (no download needed); token counts then follow that tokenizer.

    python benchmarks/run_recipes.py SET --dry-run          # each run's command, nothing run
    python benchmarks/run_recipes.py SET --only a,b --out DIR

Sets: tiny and open-llama-7b (the recipes as shipped), ledger and ledger-13b (predicted against measured peak memory),
ablation and ablation-full (each speed switch off alone), reorg-check (the previous code at out/prev against this
checkout, alternating), cpu-smoke. A run given PREVIOUS as its 4th item runs the code at out/prev (see
benchmarks/README.md: before/after comparisons in one device call).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

RANDOM = ["--init", "random", "--model.tokenizer_dir", "litft:demo/model"]
BENCH_DATA = ["--data.path", "out/bench-data/alpaca_like.json"]  # benchmarks/make_bench_data.py writes it
QUIET = ["--logging.progress", "plain", "--logging.interval", "5", "--eval.initial", "false", "--eval.final", "false",
         "--eval.interval", "0"]
GPU = RANDOM + BENCH_DATA + QUIET
PROFILE = ["--logging.profile", "20-21"]  # add to a run: the kernels of steps 20-21 in its log.txt and profile_kernels.txt
PLAIN = ["--train.cuda_graphs", "never", "--train.compile", "never"]  # eager, launched op by op


def code_at(folder: str) -> dict:
    """Environment for a run of another copy of litft: its litft/ and recipes/ folders at FOLDER (in the tree a device
    call carries), on the path instead of this checkout's (PYTHONSAFEPATH: python -m puts no working directory first);
    the carried wheels stay first."""
    return {"PYTHONPATH": f"/tmp/site:{folder}", "PYTHONSAFEPATH": "1"}


# The previous code, for before/after runs in one call: `git archive <commit> litft recipes` unpacked at out/prev,
# less the demo model's weights and corpus (the runs use --init random and read neither), carried with the call.
PREVIOUS = code_at("out/prev")


def steps(n: int) -> list[str]:
    return ["--train.max_steps", str(n)]


# the recipes as shipped: TinyLlama LoRA and QLoRA over 60 steps (the bench data's epoch is 59 steps of 16 samples),
# the full fine-tune over 30 (its epoch is 29 steps of 32), OpenLLaMA-7B over 12
LORA = ("tiny-llama-lora", GPU + steps(60))
QLORA = ("tiny-llama-qlora", GPU + steps(60))
FULL = ("tiny-llama-full", GPU + steps(30))
FULL_MIXED = ("tiny-llama-full", GPU + steps(30) + ["--precision", "bf16-mixed"])
LORA_30 = ("tiny-llama-lora", GPU + steps(30))
LORA_7B = ("open-llama-7b-lora", GPU + steps(12))
QLORA_7B = ("open-llama-7b-qlora", GPU + steps(12))


# Several GPUs (nvidia-h100-x2): the held-out-style lengths (mean ~268, 10% over 512: make_bench_data.py --tail10),
# and for TinyLlama one random checkpoint that every strategy starts from (make_checkpoint.py), so that their first
# losses can be compared (FSDP and ZeRO-3 draw random weights shard by shard)
TAIL_DATA = ["--data.path", "out/bench-data/alpaca_tail10.json"]
MULTI = RANDOM + TAIL_DATA + QUIET
TINY_CKPT = ["--model.checkpoint_dir", "out/ckpt/tiny-llama"] + TAIL_DATA + QUIET
TWO = ["--devices", "2"]
FOUR = ["--devices", "4"]


def switched(base: tuple[str, list[str]], *overrides: str) -> tuple[str, list[str]]:
    recipe, args = base
    return recipe, args + list(overrides)


# name -> list of (run name, recipe, overrides[, environment]): an optional 4th item holds environment variables for
# the run (PREVIOUS: the previous code)
SETS: dict[str, list[tuple]] = {
    # The TinyLlama recipes as shipped: real tok/s, MFU, peak memory and the ledger's prediction of it.
    "tiny": [
        ("lora", *LORA),
        ("qlora", *QLORA),
        ("full", *FULL),
        ("full-mixed", *FULL_MIXED),
    ],
    # The OpenLLaMA-7B recipes as shipped (micro batch 4, sequence 512).
    "open-llama-7b": [
        ("7b-lora", *LORA_7B),
        ("7b-qlora", *QLORA_7B),
    ],
    # The memory ledger: each run writes its predicted peak reserved memory beside the measured one (memory.error_pct),
    # for the six configurations: TinyLlama full bf16-true and bf16-mixed, LoRA, QLoRA; OpenLLaMA-7B LoRA and QLoRA.
    "ledger": [
        ("tiny-llama-full-bf16-true", "tiny-llama-full", GPU + steps(10)),
        ("tiny-llama-full-bf16-mixed", "tiny-llama-full", GPU + steps(10) + ["--precision", "bf16-mixed"]),
        ("tiny-llama-lora", "tiny-llama-lora", GPU + steps(10)),
        ("tiny-llama-qlora", "tiny-llama-qlora", GPU + steps(10)),
        ("open-llama-7b-lora", "open-llama-7b-lora", GPU + steps(10)),
        ("open-llama-7b-qlora", "open-llama-7b-qlora", GPU + steps(10)),
    ],
    # OpenLLaMA-13B on 80 GB: the ledger says full AdamW does not fit (the run should exit 4, out of memory), SGD and
    # LoRA do.
    "ledger-13b": [
        ("open-llama-13b-full", "open-llama-13b-full", GPU + steps(4)),
        ("open-llama-13b-full-sgd", "open-llama-13b-full-sgd", GPU + steps(4)),
        ("open-llama-13b-lora", "open-llama-13b-lora", GPU + steps(6)),
    ],
    # Each speed switch of the TinyLlama LoRA recipe turned off alone, beside the recipe as shipped (first and last,
    # for the spread between runs). 30 steps each so that the set fits one device call.
    "ablation": [
        ("lora", *LORA_30),
        ("no-packing", *switched(LORA_30, "--data.packing", "false")),
        ("no-pack-steps", *switched(LORA_30, "--data.pack_steps", "false")),
        ("no-fit-steps", *switched(LORA_30, "--data.fit_steps", "false")),
        # without graphs compile 'auto' would compile: compile stays off here, to change one thing
        ("no-cuda-graphs", *switched(LORA_30, *PLAIN)),
        ("compiled", *switched(LORA_30, "--train.compile", "always")),
        ("no-fast-lora", *switched(LORA_30, "--train.fast_lora", "false")),
        ("no-fused-rms-norm", *switched(LORA_30, "--train.fused_rms_norm", "false")),
        ("no-fast-attention", *switched(LORA_30, "--train.fast_attention", "false")),
        ("no-lean-swiglu", *switched(LORA_30, "--train.lean_swiglu", "false")),
        ("no-grad-into-weights", *switched(LORA_30, "--train.grad_into_weights", "false")),
        ("no-triton-kernels", *switched(LORA_30, "--train.triton_kernels", "false")),
        ("flash-attention", *switched(LORA_30, "--train.attention_kernel", "flash")),
        ("whole-loss", *switched(LORA_30, "--train.loss_chunk", "0")),
        ("lora-again", *LORA_30),
    ],
    # The same for the switches that matter most to the full fine-tune, and bf16-mixed's own.
    "ablation-full": [
        ("full", *FULL),
        ("no-cuda-graphs", *switched(FULL, *PLAIN)),
        ("compiled", *switched(FULL, "--train.compile", "always")),
        ("no-grad-into-weights", *switched(FULL, "--train.grad_into_weights", "false")),
        ("no-triton-kernels", *switched(FULL, "--train.triton_kernels", "false")),
        ("foreach-adamw", *switched(FULL, "--optimizer.init_args.foreach", "true")),  # torch's pick without fused=True
        ("full-mixed", *FULL_MIXED),
        ("full-mixed-no-lean-mixed-linear", *switched(FULL_MIXED, "--train.lean_mixed_linear", "false")),
    ],
    # Before/after a reorganisation of the code: the previous code (out/prev) and this checkout, alternating, on the
    # recipes as shipped, no profiling: TinyLlama LoRA, QLoRA and full bf16-true (30 steps each), OpenLLaMA-7B LoRA
    # (20 steps). The same losses and memory are expected; the speed within the spread between runs.
    "reorg-check": [
        ("lora-prev", *LORA_30, PREVIOUS),
        ("lora", *LORA_30),
        ("qlora-prev", "tiny-llama-qlora", GPU + steps(30), PREVIOUS),
        ("qlora", "tiny-llama-qlora", GPU + steps(30)),
        ("full-prev", *FULL, PREVIOUS),
        ("full", *FULL),
        ("7b-lora-prev", "open-llama-7b-lora", GPU + steps(20), PREVIOUS),
        ("7b-lora", "open-llama-7b-lora", GPU + steps(20)),
    ],
    # TinyLlama on one GPU and on two (DDP, FSDP, DeepSpeed ZeRO-2), the same global batch and checkpoint: scaling
    # and the first step's loss across strategies.
    "multi-gpu-tiny": [
        ("full-1gpu", "tiny-llama-full", TINY_CKPT + steps(30)),
        ("full-ddp2", "tiny-llama-full-ddp", TINY_CKPT + steps(30) + TWO),
        ("full-fsdp2", "tiny-llama-full-fsdp", TINY_CKPT + steps(30) + TWO),
        ("lora-1gpu", "tiny-llama-lora", TINY_CKPT + steps(30)),
        ("lora-ddp2", "tiny-llama-lora", TINY_CKPT + steps(30) + TWO + ["--strategy", "ddp"]),
        ("full-zero2", "tiny-llama-full", TINY_CKPT + steps(10) + TWO + ["--strategy", "deepspeed_stage_2"]),
        ("full-fsdp2-eager", "tiny-llama-full-fsdp", TINY_CKPT + steps(30) + TWO + ["--train.compile", "never"]),
    ],
    # OpenLLaMA-7B LoRA on one GPU and DDP on two; 7B full on one GPU and FSDP on two at the same micro batch;
    # 13B full AdamW under FSDP on two.
    "multi-gpu-large": [
        ("7b-lora-1gpu", "open-llama-7b-lora", MULTI + steps(12)),
        ("7b-lora-ddp2", "open-llama-7b-lora", MULTI + steps(12) + TWO + ["--strategy", "ddp"]),
        ("7b-full-1gpu", "open-llama-7b-full", MULTI + steps(8)),
        ("7b-full-fsdp2", "open-llama-7b-full-fsdp", MULTI + steps(8) + TWO),
        ("13b-full-fsdp2", "open-llama-13b-full", MULTI + steps(20) + TWO + ["--strategy", "fsdp"]),
    ],
    # OpenLLaMA-13B full AdamW with the optimizer on the CPU: ZeRO-Offload on one GPU, ZeRO-3 + offload on two.
    "multi-gpu-offload": [
        ("13b-zero-offload-1gpu", "open-llama-13b-full-zero-offload", MULTI + steps(4)),
        ("13b-zero3-offload2", "open-llama-13b-full-zero3-offload", MULTI + steps(4) + TWO),
    ],
    # Scaling over 1, 2 and 4 GPUs (nvidia-h100-x4): TinyLlama full and LoRA under DDP, the global batch of each
    # recipe fixed (LoRA on 4 GPUs at micro batch 4: 16 samples = 4 x 4); ZeRO-2 on 2 GPUs.
    "scale-tiny": [
        ("full-1gpu", "tiny-llama-full", TINY_CKPT + steps(30)),
        ("full-ddp2", "tiny-llama-full-ddp", TINY_CKPT + steps(30) + TWO),
        ("full-ddp4", "tiny-llama-full-ddp", TINY_CKPT + steps(30) + FOUR),
        ("lora-1gpu", "tiny-llama-lora", TINY_CKPT + steps(30)),
        ("lora-ddp2", "tiny-llama-lora", TINY_CKPT + steps(30) + TWO + ["--strategy", "ddp"]),
        ("lora-ddp4", "tiny-llama-lora", TINY_CKPT + steps(30) + FOUR + ["--strategy", "ddp",
                                                                          "--train.micro_batch_size", "4"]),
        ("full-zero2", "tiny-llama-full", TINY_CKPT + steps(10) + TWO + ["--strategy", "deepspeed_stage_2"]),
        ("full-fsdp4", "tiny-llama-full-fsdp", TINY_CKPT + steps(30) + FOUR),
        ("full-ddp2-profile", "tiny-llama-full-ddp", TINY_CKPT + steps(24) + TWO + PROFILE),
    ],
    # OpenLLaMA-7B over 1, 2 and 4 GPUs: LoRA under DDP; full on one GPU and under FSDP at the same micro batch.
    "scale-7b": [
        ("7b-lora-1gpu", "open-llama-7b-lora", MULTI + steps(12)),
        ("7b-lora-ddp2", "open-llama-7b-lora", MULTI + steps(12) + TWO + ["--strategy", "ddp"]),
        ("7b-lora-ddp4", "open-llama-7b-lora", MULTI + steps(12) + FOUR + ["--strategy", "ddp"]),
        ("7b-full-1gpu", "open-llama-7b-full", MULTI + steps(8)),
        ("7b-full-fsdp2", "open-llama-7b-full-fsdp", MULTI + steps(8) + TWO),
        ("7b-full-fsdp4", "open-llama-7b-full-fsdp", MULTI + steps(8) + FOUR),
        ("13b-full-fsdp2", "open-llama-13b-full", MULTI + steps(20) + TWO + ["--strategy", "fsdp"]),
    ],
    # A CPU smoke test of this script itself.
    "cpu-smoke": [
        ("demo-10-steps", "demo", QUIET + steps(10)),
    ],
}


def run_one(name: str, recipe: str, overrides: list[str], out: Path, timeout: int, env: dict | None = None) -> dict:
    run_dir = out / "runs" / name
    command = [sys.executable, "-m", "litft.cli", "finetune", "--config", recipe, *overrides,
               "--out_dir", str(run_dir), "--overwrite"]
    started = time.perf_counter()
    # a session of its own: a run that times out is killed with the ranks it started (Fabric's other processes)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        code, stderr = 124, (stderr or "") + f"\ntimed out after {timeout}s"
    wall = time.perf_counter() - started
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "log.txt").write_text(f"$ {shlex.join(command)}\n\n{stdout}\n--- stderr ---\n{stderr}")
    result_path = run_dir / "result.json"
    result = json.loads(result_path.read_text()) if result_path.is_file() else None
    message = [line for line in stderr.strip().splitlines() if line.startswith("litft")]
    return {
        "name": name,
        "command": "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())
                   + "litft finetune --config " + shlex.join([recipe, *overrides]),
        "exit_code": code,
        "wall_s": wall,
        "message": message[-1] if message else (stderr.strip().splitlines() or [""])[-1],
        "result": result,
    }


def predicted(memory: dict) -> str:
    p = memory.get("predicted")
    if not p:
        return "n/a"
    error = f" ({memory['error_pct']:+.1f}%)" if memory.get("error_pct") is not None else ""
    return f"{p['total_gib']:.2f}{error}"


def warmup(result: dict) -> str:
    """The warm-up phase, and the part of it spent in plain warm-up micro-steps and in graph captures."""
    graphs = result["cuda_graphs"]
    split = (f" ({graphs['plain_warmup_s']:.1f} + {graphs['capture_s']:.1f})"
             if graphs.get("on") and "capture_s" in graphs else "")
    return f"{result['phases_s'].get('warmup', 0.0):.1f}{split}"


def table(rows: list[dict]) -> str:
    head = ("| run | exit | steps | tok/s (real) | tok/s/GPU | padded tok/s | MFU | median step | peak alloc GiB |"
            " peak reserved GiB | predicted GiB (error) | loss first -> last | warm-up s (plain + captures) | process s |"
            " compiled graphs |"
            " graph shapes |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        r = row["result"]
        if r is None or r.get("status") != "ok":
            lines.append(f"| {row['name']} | {row['exit_code']} | | | | | | | | | | {row['message'][:80]} | |"
                         f" {row['wall_s']:.0f} | | |")
            continue
        t, m, lo = r["throughput"], r["memory"], r["losses"]
        mfu = f"{t['mfu'] * 100:.1f}%" if t["mfu"] is not None else "n/a"
        alloc = f"{m['peak_allocated_gib']:.2f}" if m["peak_allocated_gib"] is not None else "n/a"
        reserved = f"{m['peak_reserved_gib']:.2f}" if m["peak_reserved_gib"] is not None else "n/a"
        lines.append(
            f"| {row['name']} | {row['exit_code']} | {r['steps']} | {t['tokens_per_sec']:,.0f} |"
            f" {t['tokens_per_sec_per_device']:,.0f} | {t['padded_tokens_per_sec']:,.0f} | {mfu} |"
            f" {t['median_step_time_s'] * 1000:.1f} ms | {alloc} | {reserved} | {predicted(m)} |"
            f" {lo['train_first']:.3f} -> {lo['train_last']:.3f} | {warmup(r)} |"
            f" {row['wall_s']:.0f} | {(r.get('compile') or {}).get('unique_graphs', 'n/a')} |"
            f" {r['cuda_graphs'].get('shapes_captured', 'off') if r['cuda_graphs'].get('on') else 'off'} |"
        )
    return "\n".join(lines)


def write_report(args, env: dict, rows: list[dict]) -> str:
    md = [f"# {args.set}", "", f"Command: `python benchmarks/run_recipes.py {args.set} --out DIR`", ""]
    md += [f"- {k}: {v}" for k, v in env.items()]
    md += ["", table(rows), "", "Runs (each: `litft finetune` in its own process):", ""]
    md += [f"- {row['name']}: `{row['command']}`" for row in rows]
    md += ["", "Definitions: tok/s counts real (non-padding) tokens over steady-state train time; see README Metrics."]
    text = "\n".join(md) + "\n"
    (args.out / f"{args.set}.md").write_text(text)
    (args.out / f"{args.set}.json").write_text(json.dumps({"environment": env, "runs": rows}, indent=2, default=str))
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("set", choices=sorted(SETS))
    parser.add_argument("--out", type=Path, default=Path("out/bench"))
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--only", help="comma-separated run names of the set to run (default: all of them)")
    parser.add_argument("--dry-run", action="store_true", help="print each run's command and run nothing")
    args = parser.parse_args()
    runs = SETS[args.set]
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {run[0] for run in runs})
        if unknown:
            parser.error(f"no run {', '.join(unknown)} in set {args.set}: {', '.join(run[0] for run in runs)}")
        runs = [run for run in runs if run[0] in wanted]
    if args.dry_run:
        for name, recipe, overrides, *run_env in runs:
            env = "".join(f"{k}={shlex.quote(v)} " for k, v in (run_env[0] if run_env else {}).items())
            print(f"{name}: {env}python -m litft.cli finetune --config {shlex.join([recipe, *overrides])}"
                  f" --out_dir {args.out / 'runs' / name} --overwrite")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)

    from litft.metrics import environment

    env = environment()
    rows = []
    for name, recipe, overrides, *run_env in runs:  # an optional 4th item: environment variables for the run
        print(f"[{args.set}] {name} ...", flush=True)
        rows.append(run_one(name, recipe, overrides, args.out, args.timeout, run_env[0] if run_env else None))
        print(f"    exit {rows[-1]['exit_code']} in {rows[-1]['wall_s']:.0f}s {rows[-1]['message'][:120]}", flush=True)
        write_report(args, env, rows)  # after every run: a time-out keeps what finished
    print(write_report(args, env, rows))
    return 0 if all(row["exit_code"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
