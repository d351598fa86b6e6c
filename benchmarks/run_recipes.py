"""Run a named set of litft recipe runs, each in its own process, and record every figure with its command.

    python benchmarks/run_recipes.py SET --out DIR

Each run is `python -m litft.cli finetune --config RECIPE [overrides] --out_dir DIR/runs/NAME`. A run that fails
(out of memory, exit 4; anything else) is recorded with its exit code and last message: in a sweep that is a
result, not a crash. Writes DIR/SET.md (a table, the commands, GPU, driver and versions) and DIR/SET.json (each run's
result.json). Speed and memory do not depend on weight values, so the GPU sets use `--init random` with the demo
tokenizer (no download needed); token counts then follow that tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

RANDOM = ["--init", "random", "--model.tokenizer_dir", "litft:demo/model"]
BENCH_DATA = ["--data.path", "out/bench-data/alpaca_like.json"]  # benchmarks/make_bench_data.py writes it
QUIET = ["--logging.progress", "plain", "--logging.interval", "5", "--eval.initial", "false", "--eval.final", "false",
         "--eval.interval", "0"]
GPU = RANDOM + BENCH_DATA + QUIET
PROFILE = ["--logging.profile", "8-9", "--logging.interval", "1"]
PLAIN = ["--train.cuda_graphs", "never", "--train.compile", "never"]  # eager, launched op by op


# A run of session 11's code: its litft/ and recipes/ folders at out/prev (see the set s12-tiny), instead of this
# checkout on the path (PYTHONSAFEPATH: python -m puts no working directory first); the carried wheels stay first.
PREVIOUS = {"PYTHONPATH": "/tmp/site:out/prev", "PYTHONSAFEPATH": "1"}  # safe path: no cwd first on sys.path
VARIANT = {"PYTHONPATH": "/tmp/site:out/variant", "PYTHONSAFEPATH": "1"}  # a third version of the code, for an A/B/C


# A run of an altered copy of this checkout at out/ab (see the set dropout-ab), the same way.
AB = {"PYTHONPATH": "/tmp/site:out/ab", "PYTHONSAFEPATH": "1"}


def steps(n: int) -> list[str]:
    return ["--train.max_steps", str(n)]


# name -> list of (run name, recipe, overrides)
# Session 14's LoRA runs: session 13's code (out/prev) beside this checkout's, for LoRA and QLoRA, and LoRA at micro
# batch 8 (sets s14-tiny and s14b-tiny, each run at a different commit: results/call-s14.log).
S14_LORA_RUNS = [
    ("lora-s13", "tiny-llama-lora", GPU + steps(30), PREVIOUS),
    ("lora", "tiny-llama-lora", GPU + steps(30) + ["--logging.profile", "20-21"]),
    ("qlora-s13", "tiny-llama-qlora", GPU + steps(30), PREVIOUS),
    ("qlora", "tiny-llama-qlora", GPU + steps(30)),
    ("lora-micro8", "tiny-llama-lora", GPU + steps(30) + ["--train.micro_batch_size", "8"]),
    ("lora-again", "tiny-llama-lora", GPU + steps(30)),
]

SETS: dict[str, list[tuple[str, str, list[str]]]] = {
    # Issue 2: the three TinyLlama recipes run 20+ steps on the GPU with random weights.
    "issue2-tinyllama": [
        ("tiny-llama-full", "tiny-llama-full", GPU + steps(25)),
        ("tiny-llama-lora", "tiny-llama-lora", GPU + steps(25)),
        ("tiny-llama-qlora", "tiny-llama-qlora", GPU + steps(25)),
    ],
    # Issue 3: predicted vs measured peak memory; with issue2-tinyllama (full bf16-true, LoRA, QLoRA) these make the
    # six configurations the issue names.
    "ledger-small": [
        ("tiny-llama-full-bf16-mixed", "tiny-llama-full", GPU + steps(10) + ["--precision", "bf16-mixed"]),
        ("open-llama-7b-lora", "open-llama-7b-lora", GPU + steps(10)),
        ("open-llama-7b-qlora", "open-llama-7b-qlora", GPU + steps(10)),
    ],
    # Issue 3: all six configurations the issue names, predicted (by each run) vs measured.
    "ledger-six": [
        ("tiny-llama-full-bf16-true", "tiny-llama-full", GPU + steps(10)),
        ("tiny-llama-full-bf16-mixed", "tiny-llama-full", GPU + steps(10) + ["--precision", "bf16-mixed"]),
        ("tiny-llama-lora", "tiny-llama-lora", GPU + steps(10)),
        ("tiny-llama-qlora", "tiny-llama-qlora", GPU + steps(10)),
        ("open-llama-7b-lora", "open-llama-7b-lora", GPU + steps(10)),
        ("open-llama-7b-qlora", "open-llama-7b-qlora", GPU + steps(10)),
    ],
    # Issue 3: the 13B trio: AdamW should not fit 80 GB, SGD and LoRA should.
    "ledger-13b": [
        ("open-llama-13b-full", "open-llama-13b-full", GPU + steps(4)),
        ("open-llama-13b-full-sgd", "open-llama-13b-full-sgd", GPU + steps(4)),
        ("open-llama-13b-lora", "open-llama-13b-lora", GPU + steps(4)),
    ],
    # Issue 5: where a LoRA step's time goes. Each run prints the profiler's top ops for steps 8-9 and how busy the
    # device was (kernel time / wall time); logging every step shows the compile steps' cost.
    "profile-tiny": [
        ("lora", "tiny-llama-lora", GPU + steps(12) + PROFILE),
        ("lora-eager", "tiny-llama-lora", GPU + steps(12) + PROFILE + ["--train.compile", "never"]),
        ("lora-micro16", "tiny-llama-lora", GPU + steps(12) + PROFILE + ["--train.micro_batch_size", "16"]),
        ("full", "tiny-llama-full", GPU + steps(12) + PROFILE),
    ],
    # Issue 5: where the defaults' step goes since fast_lora and the fused norm (LoRA 84.3 ms for ~3,900 tokens, of
    # which the matmuls need ~30 ms at 600 TFLOP/s). With graphs the profiler sees the replays' kernels; without
    # them (plain) it also names the ops that launched them.
    "profile-tiny-2": [
        ("lora", "tiny-llama-lora", GPU + steps(12) + PROFILE),
        ("lora-plain", "tiny-llama-lora", GPU + steps(12) + PROFILE + PLAIN),
        ("full-plain", "tiny-llama-full", GPU + steps(12) + PROFILE + PLAIN),
    ],
    # Issue 5: CUDA graphs of the micro-step on and off (each run also reports compile + capture in its first steps).
    "graphs-tiny": [
        ("lora", "tiny-llama-lora", GPU + steps(25)),
        ("lora-eager", "tiny-llama-lora", GPU + steps(25) + ["--train.compile", "never"]),
        ("lora-no-graphs", "tiny-llama-lora", GPU + steps(25) + ["--train.cuda_graphs", "never"]),
        ("full", "tiny-llama-full", GPU + steps(25)),
        ("qlora", "tiny-llama-qlora", GPU + steps(25)),
    ],
    # Issue 5: each speed choice of the defaults switched off alone (40 steps; the first 5 are left out of tok/s).
    # full-mixed: bf16-mixed's peak reserved memory since the graph warm-up allocates the gradients first (33.01 GiB
    # before, results/vs-litgpt-tiny-full).
    "ablation-tiny": [
        ("lora", "tiny-llama-lora", GPU + steps(40)),
        ("lora-no-pack-steps", "tiny-llama-lora", GPU + steps(40) + ["--data.pack_steps", "false"]),
        ("lora-no-packing", "tiny-llama-lora", GPU + steps(40) + ["--data.packing", "false"]),
        ("lora-no-graphs", "tiny-llama-lora", GPU + steps(40) + ["--train.cuda_graphs", "never"]),
        ("lora-loss-unchunked", "tiny-llama-lora", GPU + steps(40) + ["--train.loss_chunk", "0"]),
        ("lora-compiled", "tiny-llama-lora", GPU + steps(40) + ["--train.compile", "always"]),
        ("full", "tiny-llama-full", GPU + steps(40)),
        ("full-unfused-adamw", "tiny-llama-full", GPU + steps(40) + [
            "--optimizer.init_args.foreach", "true"]),  # what torch picks without fused=True
        ("full-no-graphs", "tiny-llama-full", GPU + steps(40) + ["--train.cuda_graphs", "never"]),
        ("full-compiled", "tiny-llama-full", GPU + steps(40) + ["--train.compile", "always"]),
        ("full-mixed", "tiny-llama-full", GPU + steps(40) + ["--precision", "bf16-mixed"]),
    ],
    # Issue 5: the rest of ablation-tiny (its first call ran out of time at lora-compiled; results/ablation-tiny has
    # the five LoRA runs that finished). Without graphs compile 'auto' turns compile on, so "no graphs" runs here
    # keep compile off to change one thing; lora-plain-profile shows where an eager step's GPU time goes.
    "ablation-tiny-2": [
        ("full", "tiny-llama-full", GPU + steps(40)),
        ("full-mixed", "tiny-llama-full", GPU + steps(40) + ["--precision", "bf16-mixed"]),
        ("full-unfused-adamw", "tiny-llama-full", GPU + steps(40) + [
            "--optimizer.init_args.foreach", "true"]),  # what torch picks without fused=True
        ("full-no-graphs", "tiny-llama-full", GPU + steps(40) + PLAIN),
        ("lora-no-graphs-eager", "tiny-llama-lora", GPU + steps(40) + PLAIN),
        ("lora-plain-profile", "tiny-llama-lora", GPU + steps(12) + PROFILE + PLAIN),
        ("lora-compiled", "tiny-llama-lora", GPU + steps(40) + ["--train.compile", "always"]),
    ],
    # Issue 5: compiling's cost and gain once the block compiles to one graph (it built 4 in ablation-tiny-2's
    # lora-compiled: 124 s of process time against ~32 s; 3 in this set's first run, 94 s), with every packed width
    # captured before the first step.
    "compile-tiny": [
        ("lora", "tiny-llama-lora", GPU + steps(60)),
        ("lora-compiled", "tiny-llama-lora", GPU + steps(60) + ["--train.compile", "always"]),
        # the same again in a new process: inductor's on-disk caches (FX graph, AOTAutograd) now hold its kernels, as
        # they would for a lab's second run on the same machine
        ("lora-compiled-again", "tiny-llama-lora", GPU + steps(60) + ["--train.compile", "always"]),
        ("qlora-compiled", "tiny-llama-qlora", GPU + steps(60) + ["--train.compile", "always"]),
        ("full-compiled", "tiny-llama-full", GPU + steps(40) + ["--train.compile", "always"]),
    ],
    # Issue 5: train.fast_lora (the matmul LoRA layers with the add inside the matmul; on by default) and
    # train.fused_rms_norm (torch's rms_norm; off until measured here) against LitGPT's own layers, eager with CUDA
    # graphs as the defaults run these recipes; the memory columns check the ledger's accounting of the fused norm.
    # Run at 2f81623, when the fused norm was off by default (it is on since: "-fused-norm" runs are today's defaults).
    "layers-tiny": [
        ("lora", "tiny-llama-lora", GPU + steps(40)),
        ("lora-litgpt-lora-layers", "tiny-llama-lora", GPU + steps(40) + ["--train.fast_lora", "false"]),
        ("lora-fused-norm", "tiny-llama-lora", GPU + steps(40) + ["--train.fused_rms_norm", "true"]),
        ("qlora", "tiny-llama-qlora", GPU + steps(40)),
        ("qlora-litgpt-lora-layers", "tiny-llama-qlora", GPU + steps(40) + ["--train.fast_lora", "false"]),
        ("full", "tiny-llama-full", GPU + steps(40)),
        ("full-fused-norm", "tiny-llama-full", GPU + steps(40) + ["--train.fused_rms_norm", "true"]),
        ("full-mixed-fused-norm", "tiny-llama-full", GPU + steps(40) + ["--precision", "bf16-mixed",
                                                                        "--train.fused_rms_norm", "true"]),
    ],
    # Issue 5: after the capture fixes (new shapes captured without a plain warm-up; 4-bit layers' compute dtype
    # settled before compiling; the RNG reset after a failed capture).
    "graphs-tiny2": [
        ("lora", "tiny-llama-lora", GPU + steps(25)),
        ("full", "tiny-llama-full", GPU + steps(25)),
        ("qlora", "tiny-llama-qlora", GPU + steps(25)),
        ("qlora-no-graphs", "tiny-llama-qlora", GPU + steps(25) + ["--train.cuda_graphs", "never"]),
        ("lora-micro8", "tiny-llama-lora", GPU + steps(25) + ["--train.micro_batch_size", "8"]),
    ],
    # Issue 5: data.pack_steps (micro-batches filled by positions: a TinyLlama step of 16 ~250-position samples in 2
    # micro-batches of <= 2,048 instead of 4 half-full ones) on and off, same peak memory bound. Run at 5eed6f2, when
    # pack_steps was off by default (it is on since: the "-pack-steps" runs are today's defaults).
    "pack-steps-tiny": [
        ("lora", "tiny-llama-lora", GPU + steps(40)),
        ("lora-pack-steps", "tiny-llama-lora", GPU + steps(40) + ["--data.pack_steps", "true"]),
        ("qlora", "tiny-llama-qlora", GPU + steps(40)),
        ("qlora-pack-steps", "tiny-llama-qlora", GPU + steps(40) + ["--data.pack_steps", "true"]),
        ("full", "tiny-llama-full", GPU + steps(30)),
        ("full-pack-steps", "tiny-llama-full", GPU + steps(30) + ["--data.pack_steps", "true"]),
        ("7b-lora-pack-steps", "open-llama-7b-lora", GPU + steps(12) + ["--data.pack_steps", "true"]),
    ],
    # Issue 5: OpenLLaMA-7B LoRA and QLoRA with the recipes' defaults (fused RMSNorm on since layers-tiny), for the
    # issue's 7B targets: LoRA >= 12,000 real tok/s, QLoRA <= 10 GiB peak reserved at micro-batch 4, sequence 512.
    "defaults-7b": [
        ("7b-lora", "open-llama-7b-lora", GPU + steps(12)),
        ("7b-qlora", "open-llama-7b-qlora", GPU + steps(12)),
    ],
    # Issue 3: the 13B LoRA run (AdamW and SGD are in ledger-13b's recorded results).
    "ledger-13b-lora": [
        ("open-llama-13b-lora", "open-llama-13b-lora", GPU + steps(6)),
    ],
    # Issue 5: OpenLLaMA-7B LoRA runs 8.5k tok/s steady (12k is the target): ~240 ms per 2,048-position micro-batch
    # where its matmuls need ~100 ms at 650 TFLOP/s. The profile's top ops say where the rest goes.
    "profile-7b": [
        ("lora", "open-llama-7b-lora", GPU + steps(8) + PROFILE[:1] + ["5-6"] + PROFILE[2:]),
        # graph replays hide the ops from the profiler's table: the same steps without graphs name them
        ("lora-no-graphs", "open-llama-7b-lora", GPU + steps(8) + PROFILE[:1] + ["5-6"] + PROFILE[2:] + [
            "--train.cuda_graphs", "never"]),
    ],
    # Issue 5: full bf16-mixed reserved 33.0 GiB (peak allocated 25.4) under CUDA graphs, LitGPT 30.9: where the
    # difference sits. Each run writes out_dir/memory_snapshot.pickle (pytorch.org/memory_viz).
    # full-mixed-expandable: the same with the allocator's expandable segments (one growable segment per pool
    # instead of many fixed ones; torch ignored them inside CUDA graph pools until a 2026 release).
    "memory-tiny": [
        ("full-mixed", "tiny-llama-full", GPU + steps(4) + ["--precision", "bf16-mixed", "--logging.memory_snapshot", "3"]),
        ("full-mixed-no-graphs", "tiny-llama-full", GPU + steps(4) + [
            "--precision", "bf16-mixed", "--logging.memory_snapshot", "3", "--train.cuda_graphs", "never"]),
        ("full-mixed-expandable", "tiny-llama-full", GPU + steps(8) + ["--precision", "bf16-mixed"],
         {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
        # without graphs or a snapshot: whether the graphs' own pool is what puts bf16-mixed over LitGPT's 30.88 GiB
        ("full-mixed-no-graphs-plain", "tiny-llama-full", GPU + steps(12) + ["--precision", "bf16-mixed",
                                                                              "--train.cuda_graphs", "never"]),
    ],
    # Issue 5, session 8: train.skip_nonfinite_on_device (the optimizer step launched before the loss is read, skipped
    # on the device when not finite: profile-tiny-2 showed the GPU idle ~20 ms of an 88 ms LoRA step while the host
    # launched the update after reading the loss; measured no faster here, and removed since) and
    # train.fast_attention (RoPE as one function, grouped k/v heads left grouped), each switched off alone against
    # the defaults; the profile shows what is left of the gap.
    "overlap-tiny": [
        ("lora", "tiny-llama-lora", GPU + steps(30)),
        ("lora-read-loss-first", "tiny-llama-lora", GPU + steps(30) + ["--train.skip_nonfinite_on_device", "false"]),
        ("lora-litgpt-attention", "tiny-llama-lora", GPU + steps(30) + ["--train.fast_attention", "false"]),
        ("qlora", "tiny-llama-qlora", GPU + steps(30)),
        ("qlora-read-loss-first", "tiny-llama-qlora", GPU + steps(30) + ["--train.skip_nonfinite_on_device", "false"]),
        ("full", "tiny-llama-full", GPU + steps(24)),
        ("full-read-loss-first", "tiny-llama-full", GPU + steps(24) + ["--train.skip_nonfinite_on_device", "false"]),
        ("full-litgpt-attention", "tiny-llama-full", GPU + steps(24) + ["--train.fast_attention", "false"]),
        ("full-mixed", "tiny-llama-full", GPU + steps(24) + ["--precision", "bf16-mixed"]),
        ("lora-profile", "tiny-llama-lora", GPU + steps(12) + PROFILE),
    ],
    # Issue 5, session 8: train.lean_swiglu (silu recomputed in the backward pass) on and off; full bf16-mixed reserved
    # 31.63 GiB in overlap-tiny against LitGPT's 30.88. lora-profile prints the host's time by op as well.
    "swiglu-tiny": [
        ("full-mixed", "tiny-llama-full", GPU + steps(24) + ["--precision", "bf16-mixed"]),
        ("full-mixed-litgpt-swiglu", "tiny-llama-full", GPU + steps(24) + ["--precision", "bf16-mixed",
                                                                            "--train.lean_swiglu", "false"]),
        ("full", "tiny-llama-full", GPU + steps(24)),
        ("full-litgpt-swiglu", "tiny-llama-full", GPU + steps(24) + ["--train.lean_swiglu", "false"]),
        ("lora", "tiny-llama-lora", GPU + steps(30)),
        ("lora-litgpt-swiglu", "tiny-llama-lora", GPU + steps(30) + ["--train.lean_swiglu", "false"]),
        ("lora-profile", "tiny-llama-lora", GPU + steps(12) + PROFILE),
    ],
    # Issue 5, session 8: compiling's cost with the defaults of overlap-tiny, on cold and then warm inductor caches
    # (a lab's second run on the same machine), and the compiled full fine-tune (MFU target 45%).
    "compile-tiny-2": [
        ("lora-compiled", "tiny-llama-lora", GPU + steps(40) + ["--train.compile", "always"]),
        ("lora-compiled-again", "tiny-llama-lora", GPU + steps(40) + ["--train.compile", "always"]),
        ("full-compiled", "tiny-llama-full", GPU + steps(30) + ["--train.compile", "always"]),
    ],
    # Issue 5, session 9: train.lean_mixed_linear (-mixed: the fp32 weight kept for the backward pass and cast again
    # there, not autocast's 16-bit copy of every weight: 1.9 GiB less predicted for TinyLlama) on and off, against
    # LitGPT's 30.88 GiB reserved for full bf16-mixed (swiglu-tiny: 30.96 with it off, the default then); and the
    # compiled full fine-tune, bf16-true and bf16-mixed, for the 45% MFU target (eager + graphs: 33.3%, swiglu-tiny).
    "mixed-compiled-tiny": [
        ("full-mixed", "tiny-llama-full", GPU + steps(24) + ["--precision", "bf16-mixed"]),
        ("full-mixed-autocast-linear", "tiny-llama-full", GPU + steps(24) + ["--precision", "bf16-mixed",
                                                                              "--train.lean_mixed_linear", "false"]),
        ("full-compiled", "tiny-llama-full", GPU + steps(30) + ["--train.compile", "always"]),
        ("full-mixed-compiled", "tiny-llama-full", GPU + steps(30) + ["--precision", "bf16-mixed",
                                                                       "--train.compile", "always"]),
    ],
    # Issue 5, session 9: the compiled full fine-tune again, with inductor's mix-order reduction off (in
    # mixed-compiled-tiny it guarded on the row count: 3 graphs, a recompile inside a capture, CUDA graphs off).
    "compile-full-tiny": [
        ("full-compiled", "tiny-llama-full", GPU + steps(30) + ["--train.compile", "always"]),
        ("full-mixed-compiled", "tiny-llama-full", GPU + steps(30) + ["--precision", "bf16-mixed",
                                                                       "--train.compile", "always"]),
    ],
    # Issue 5, session 9: the compiled LoRA and QLoRA blocks with inductor's mix-order reduction off (compile-tiny-2:
    # LoRA 71.1 ms per step compiled against 74.7 eager, after 90 s of warm-up; the full fine-tune compiled in 10 s).
    "compile-lora-tiny": [
        ("lora-compiled", "tiny-llama-lora", GPU + steps(40) + ["--train.compile", "always"]),
        ("qlora-compiled", "tiny-llama-qlora", GPU + steps(40) + ["--train.compile", "always"]),
    ],
    # Issue 5, session 9: where the compiled LoRA block's 90 s of warm-up go (result.json compile.seconds_by_phase;
    # the full fine-tune's block compiles in ~9 s), and QLoRA compiled (compile-lora-tiny ran out of time).
    "compile-lora-tiny-2": [
        ("lora-compiled", "tiny-llama-lora", GPU + steps(30) + ["--train.compile", "always"]),
        ("qlora-compiled", "tiny-llama-qlora", GPU + steps(30) + ["--train.compile", "always"]),
    ],
    # Issue 5, session 9: where the compiled full fine-tune's 130 ms step goes (37.3% MFU; the 45% target needs ~109
    # ms), compiling's gain on OpenLLaMA-7B LoRA (the same block code as TinyLlama's, so about the same compile time,
    # for larger steps), and QLoRA compiled (it ran out of time in compile-lora-tiny and -2).
    "compiled-profile": [
        ("full-compiled-profile", "tiny-llama-full", GPU + steps(12) + PROFILE + ["--train.compile", "always"]),
        ("7b-lora-compiled", "open-llama-7b-lora", GPU + steps(12) + ["--train.compile", "always"]),
        ("qlora-compiled", "tiny-llama-qlora", GPU + steps(30) + ["--train.compile", "always"]),
    ],
    # Issue 5, session 9: fused AdamW, now that recipes get it (jsonargparse's foreach=None/fused=None kept every
    # earlier run on torch's foreach AdamW: 17 ms of a 133 ms compiled full fine-tune step in compiled-profile; in
    # the LoRA profile of overlap-tiny the optimizer step and zero_grad spanned 10.8 ms of an ~80 ms step).
    "fused-adamw-tiny": [
        ("full", "tiny-llama-full", GPU + steps(24)),
        ("full-foreach", "tiny-llama-full", GPU + steps(24) + ["--optimizer.init_args.foreach", "true"]),
        ("full-compiled", "tiny-llama-full", GPU + steps(30) + ["--train.compile", "always"]),
        ("full-mixed", "tiny-llama-full", GPU + steps(24) + ["--precision", "bf16-mixed"]),
        ("lora", "tiny-llama-lora", GPU + steps(30)),
        ("lora-foreach", "tiny-llama-lora", GPU + steps(30) + ["--optimizer.init_args.foreach", "true"]),
        ("qlora", "tiny-llama-qlora", GPU + steps(30)),
    ],
    # Issue 5, session 10: a whole optimizer step in one pass (micro_batch_size 16: one micro-batch of up to 8,192
    # positions holds the step's 32 samples, ~7,800 tokens, where micro 8 takes two passes), eager and compiled, for
    # the full fine-tune's MFU target (compiled two-pass: 40.1% in fused-adamw-tiny) against LitGPT's 20.23 GiB
    # reserved; and QLoRA with fused AdamW (fused-adamw-tiny ran out of time before it).
    "one-pass-full-tiny": [
        ("full-one-pass", "tiny-llama-full", GPU + steps(20) + ["--train.micro_batch_size", "16"]),
        ("full-compiled-one-pass", "tiny-llama-full", GPU + steps(24) + ["--train.micro_batch_size", "16",
                                                                          "--train.compile", "always"]),
        ("qlora", "tiny-llama-qlora", GPU + steps(30)),
    ],
    # Issue 5, session 10: CUDA graphs' warm-up for eager blocks cut to one plain micro-step on the largest shape
    # (was two shapes, twice each, which only compiled blocks need). The same runs as fused-adamw-tiny's full, lora
    # and full-mixed and one-pass-full-tiny's qlora (warm-up s there: 2.5, 2.3, 2.7, 2.7).
    "warmup-tiny": [
        ("full", "tiny-llama-full", GPU + steps(24)),
        ("full-mixed", "tiny-llama-full", GPU + steps(24) + ["--precision", "bf16-mixed"]),
        ("lora", "tiny-llama-lora", GPU + steps(30)),
        ("qlora", "tiny-llama-qlora", GPU + steps(30)),
    ],
    # Issue 5, session 11: how LoRA's speed depends on the pass width (micro_batch_size 4, 6, 8: packed passes of at
    # most 2,048, 3,072, 4,096 positions; the 16-sample step of ~3,900 tokens takes 2-3, 2 or 1-2 passes) and on
    # dropout (0.05 vs 0); the graphed default's profile says how busy the device is between graph replays; the plain
    # run's profile table gives the kernel time by op; compiled LoRA and the compiled full fine-tune's profile with
    # fused AdamW (not rerun since foreach).
    "lora-width-tiny": [
        ("lora", "tiny-llama-lora", GPU + steps(30) + ["--logging.profile", "20-21"]),
        ("lora-micro6", "tiny-llama-lora", GPU + steps(30) + ["--train.micro_batch_size", "6", "--train.global_batch_size", "18"]),
        ("lora-micro8", "tiny-llama-lora", GPU + steps(30) + ["--train.micro_batch_size", "8"]),
        ("lora-no-dropout", "tiny-llama-lora", GPU + steps(30) + ["--lora.dropout", "0"]),
        ("lora-plain-profile", "tiny-llama-lora", GPU + steps(12) + PROFILE + PLAIN),
        ("full-compiled-profile", "tiny-llama-full", GPU + steps(24) + ["--logging.profile", "20-21", "--train.compile", "always"]),
        ("lora-compiled", "tiny-llama-lora", GPU + steps(30) + ["--train.compile", "always"]),
    ],
    # Issue 5, session 11: every GPU kernel by full name (the profiler's new kernel table) for the eager and compiled
    # full fine-tune and the LoRA default, to find what besides the matmuls a step spends its time on; and LoRA
    # compiled twice in one call, the second on the first's inductor and Triton caches (a user's second run).
    "kernels-tiny": [
        ("full", "tiny-llama-full", GPU + steps(24) + ["--logging.profile", "20-21"]),
        ("full-compiled", "tiny-llama-full", GPU + steps(24) + ["--logging.profile", "20-21", "--train.compile", "always"]),
        ("lora", "tiny-llama-lora", GPU + steps(24) + ["--logging.profile", "20-21"]),
        ("lora-compiled", "tiny-llama-lora", GPU + steps(24) + ["--train.compile", "always"]),
        ("lora-compiled-warm-cache", "tiny-llama-lora", GPU + steps(24) + ["--train.compile", "always"]),
    ],
    # Issue 5, session 11: weight gradients added by the matmul (train.grad_into_weights, eager full fine-tunes) on
    # and off side by side, and gradient clipping inside the fused AdamW step (no switch: the profiled default run's
    # kernel table shows whether clip_grad_norm_'s multiply, kernels-tiny's TensorListMetadata<1> kernel at 1.85 ms
    # per step, is gone); compiled and bf16-mixed full fine-tunes and LoRA with the clipping change.
    "grads-tiny": [
        ("full", "tiny-llama-full", GPU + steps(24) + ["--logging.profile", "20-21"]),
        ("full-autograd-accumulation", "tiny-llama-full", GPU + steps(24) + ["--train.grad_into_weights", "false"]),
        ("full-again", "tiny-llama-full", GPU + steps(24)),
        ("full-compiled", "tiny-llama-full", GPU + steps(24) + ["--train.compile", "always"]),
        ("full-mixed", "tiny-llama-full", GPU + steps(24) + ["--precision", "bf16-mixed"]),
        ("lora", "tiny-llama-lora", GPU + steps(30)),
    ],
    # Issue 5, session 12: train.triton_kernels (SwiGLU and RoPE as one Triton kernel each way) and
    # train.grad_into_weights for LoRA/QLoRA adapters (model.LowRankUpdate), each switched off alone against the
    # defaults, one process per run; the LoRA default profiled for the kernel table.
    "triton-tiny": [
        ("lora", "tiny-llama-lora", GPU + steps(30) + ["--logging.profile", "20-21"]),
        ("lora-torch-ops", "tiny-llama-lora", GPU + steps(30) + ["--train.triton_kernels", "false"]),
        ("lora-autograd-adapters", "tiny-llama-lora", GPU + steps(30) + ["--train.grad_into_weights", "false"]),
        ("lora-neither", "tiny-llama-lora", GPU + steps(30) + ["--train.triton_kernels", "false",
                                                               "--train.grad_into_weights", "false"]),
        ("lora-again", "tiny-llama-lora", GPU + steps(30)),
        ("qlora", "tiny-llama-qlora", GPU + steps(30)),
        ("qlora-neither", "tiny-llama-qlora", GPU + steps(30) + ["--train.triton_kernels", "false",
                                                                 "--train.grad_into_weights", "false"]),
        ("full", "tiny-llama-full", GPU + steps(24)),
        ("full-torch-ops", "tiny-llama-full", GPU + steps(24) + ["--train.triton_kernels", "false"]),
    ],
    # Issue 5, session 12, side by side in one call: session 11's code (the litft and recipes folders of commit
    # 4605f73, carried to the GPU machine as out/prev: `git archive 4605f73 litft recipes | tar -x -C out/prev`, less
    # the demo weights and corpus, litft/assets/demo/{model/lit_model.pth,pretrain.txt}, to keep the carry under 64 MiB)
    # against this session's defaults (Triton kernels for SwiGLU, RoPE and the loss; LoRA adapters' gradients added
    # by the matmuls), each change off alone, and the whole loss at once (loss_chunk 0) now that it keeps 16-bit
    # logits only.
    "s12-tiny": [
        ("lora-s11", "tiny-llama-lora", GPU + steps(30), PREVIOUS),
        ("lora", "tiny-llama-lora", GPU + steps(30) + ["--logging.profile", "20-21"]),
        ("lora-torch-ops", "tiny-llama-lora", GPU + steps(30) + ["--train.triton_kernels", "false"]),
        ("lora-whole-loss", "tiny-llama-lora", GPU + steps(30) + ["--train.loss_chunk", "0"]),
        ("full-s11", "tiny-llama-full", GPU + steps(24), PREVIOUS),
        ("full", "tiny-llama-full", GPU + steps(24) + ["--logging.profile", "20-21"]),
        ("full-torch-ops", "tiny-llama-full", GPU + steps(24) + ["--train.triton_kernels", "false"]),
        ("full-whole-loss", "tiny-llama-full", GPU + steps(24) + ["--train.loss_chunk", "0"]),
        ("qlora-s11", "tiny-llama-qlora", GPU + steps(30), PREVIOUS),
        ("qlora", "tiny-llama-qlora", GPU + steps(30)),
    ],
    # Issue 5, session 12, call 3: the code of call 2 (commit b536915, carried as out/prev the same way) beside this
    # one's (LoRA dropout as a seeded Triton kernel; the residual adds fused into the norms), and the whole loss at once.
    "s12b-tiny": [
        ("lora-call2", "tiny-llama-lora", GPU + steps(30), PREVIOUS),
        ("lora", "tiny-llama-lora", GPU + steps(30) + ["--logging.profile", "20-21"]),
        ("full-call2", "tiny-llama-full", GPU + steps(24), PREVIOUS),
        ("full", "tiny-llama-full", GPU + steps(24) + ["--logging.profile", "20-21"]),
        ("full-whole-loss", "tiny-llama-full", GPU + steps(24) + ["--train.loss_chunk", "0"]),
        ("qlora-call2", "tiny-llama-qlora", GPU + steps(30), PREVIOUS),
        ("qlora", "tiny-llama-qlora", GPU + steps(30)),
        ("full-mixed", "tiny-llama-full", GPU + steps(24) + ["--precision", "bf16-mixed"]),
    ],
    # Issue 5, session 12: compiled blocks (inductor's fusion; autograd's gradient accumulation; the Triton loss)
    # against eager blocks with the Triton kernels, for `compile: auto`'s choice.
    "compile-s12": [
        ("full-eager", "tiny-llama-full", GPU + steps(24)),
        ("full-compiled", "tiny-llama-full", GPU + steps(24) + ["--train.compile", "always"]),
        ("lora-eager", "tiny-llama-lora", GPU + steps(30)),
        ("lora-compiled", "tiny-llama-lora", GPU + steps(30) + ["--train.compile", "always"]),
    ],
    # Issue 5, session 12: LoRA's dropout as the seeded Triton kernel (4 uniforms per Philox call) against torch's
    # dropout, everything else equal: out/ab is this checkout's litft/ and recipes/ with SeededDropout switched off
    # (made by the command in results/call-s12.log, carried like out/prev).
    "dropout-ab": [
        ("lora", "tiny-llama-lora", GPU + steps(30) + ["--logging.profile", "20-21"]),
        ("lora-torch-dropout", "tiny-llama-lora", GPU + steps(30), AB),
        ("qlora", "tiny-llama-qlora", GPU + steps(30)),
        ("qlora-torch-dropout", "tiny-llama-qlora", GPU + steps(30), AB),
        ("lora-again", "tiny-llama-lora", GPU + steps(30)),
    ],
    # Issue 5, session 13, call 1: session 12's code (commit 0f81773, carried as out/prev) beside this one's (q, k, v
    # out of the qkv output in one Triton kernel each way, model.RopeQKV; grouped k/v heads straight to the flash ops,
    # model.GroupedFlashAttention, where torch 2.11's varlen_attn takes no grouped heads).
    "s13-tiny": [
        ("lora-s12", "tiny-llama-lora", GPU + steps(30), PREVIOUS),
        ("lora", "tiny-llama-lora", GPU + steps(30) + ["--logging.profile", "20-21"]),
        ("full-s12", "tiny-llama-full", GPU + steps(24), PREVIOUS),
        ("full", "tiny-llama-full", GPU + steps(24) + ["--logging.profile", "20-21"]),
        ("qlora-s12", "tiny-llama-qlora", GPU + steps(30), PREVIOUS),
        ("qlora", "tiny-llama-qlora", GPU + steps(30)),
        ("full-mixed-s12", "tiny-llama-full", GPU + steps(24) + ["--precision", "bf16-mixed"], PREVIOUS),
        ("full-mixed", "tiny-llama-full", GPU + steps(24) + ["--precision", "bf16-mixed"]),
    ],
    # Issue 5, session 13, call 2: AdamW's step as kernels.AdamW (default) against torch's fused AdamW, everything else
    # equal: out/ab is this checkout's litft/ and recipes/ with `triton_adamw = False` in finetune.main (made by the
    # command in results/call-s13.log, carried like out/prev).
    "adamw-ab": [
        ("full", "tiny-llama-full", GPU + steps(24) + ["--logging.profile", "20-21"]),
        ("full-torch-adamw", "tiny-llama-full", GPU + steps(24), AB),
        ("lora", "tiny-llama-lora", GPU + steps(30)),
        ("lora-torch-adamw", "tiny-llama-lora", GPU + steps(30), AB),
        ("full-mixed", "tiny-llama-full", GPU + steps(24) + ["--precision", "bf16-mixed"]),
        ("full-mixed-torch-adamw", "tiny-llama-full", GPU + steps(24) + ["--precision", "bf16-mixed"], AB),
        ("qlora", "tiny-llama-qlora", GPU + steps(30)),
        ("full-again", "tiny-llama-full", GPU + steps(24)),
    ],
    # Issue 5, session 13, call 3: kernels.AdamW with its size threshold (LoRA's adapters back on torch's fused op),
    # the recipes as shipped.
    "s13c-tiny": [
        ("lora", "tiny-llama-lora", GPU + steps(30)),
        ("full", "tiny-llama-full", GPU + steps(24)),
        ("qlora", "tiny-llama-qlora", GPU + steps(30)),
        ("lora-again", "tiny-llama-lora", GPU + steps(30)),
    ],
    # Issue 5, session 14, calls 1-3: session 13's code (2abef73, carried as out/prev) beside this one's: LoRA layers
    # as model.FusedLoRA (the dropout inside the A matmuls, kernels.lora_down / lora_down_backward; the input gradient
    # written once). lora-micro8: passes of 4,096 positions, which the memory FusedLoRA frees may allow. Call 2 ran
    # the first kernels (4-word Philox, 64-column tiles); call 3 the second (16-bit uniforms, wider tiles).
    "s14-tiny": S14_LORA_RUNS,
    # Issue 5, session 14, call 4: the same runs with the LoRA kernels' per-shape launches (lora-kernels-s14.md), one
    # dropout seed per forward pass (model.LoRASeeds) and A's gradient added into .grad by one kernel.
    "s14b-tiny": S14_LORA_RUNS,
    # Issue 5, session 15: session 14's code (a06bc29, carried as out/prev) beside this one's: the MLP proj's
    # FusedLoRA keeping SwiGLU's inputs (11,264 bytes per token and block less), lora_down's launches from the
    # column-split sweep (lora-kernels-s15.md); at micro batch 4 and 8 (passes of 2,048 and 4,096 positions).
    "s15-tiny": [
        ("lora-s14", "tiny-llama-lora", GPU + steps(30), PREVIOUS),
        ("lora", "tiny-llama-lora", GPU + steps(30)),
        ("lora-micro8-s14", "tiny-llama-lora", GPU + steps(30) + ["--train.micro_batch_size", "8"], PREVIOUS),
        ("lora-micro8", "tiny-llama-lora", GPU + steps(30) + ["--train.micro_batch_size", "8",
                                                               "--logging.profile", "20-21"]),
        ("qlora-s14", "tiny-llama-qlora", GPU + steps(30), PREVIOUS),
        ("qlora", "tiny-llama-qlora", GPU + steps(30)),
        ("qlora-micro8", "tiny-llama-qlora", GPU + steps(30) + ["--train.micro_batch_size", "8"]),
        ("lora-micro8-again", "tiny-llama-lora", GPU + steps(30) + ["--train.micro_batch_size", "8"]),
    ],
    # Issue 5, session 16: data.pack_capacity, the positions per packed micro-batch. A step of 16 Alpaca-like
    # samples (mean 245 tokens) overflows 4,096 positions in 32% of steps, making one more short micro-batch;
    # 4,352 / 4,608 positions cut that to 17% / 7% (simulated with data.fill_micro_batches on the bench data).
    # 60 steps: each run sees ~20 overflowing steps at 4,096. Peak memory must stay under LitGPT's at micro 4
    # (LoRA 7.51 GiB allocated / 7.98 reserved; QLoRA 6.43 / 6.96).
    "s16-tiny": [
        ("lora", "tiny-llama-lora", GPU + steps(60)),
        ("lora-4608", "tiny-llama-lora", GPU + steps(60) + ["--data.pack_capacity", "4608"]),
        ("lora-again", "tiny-llama-lora", GPU + steps(60)),
        ("lora-4608-again", "tiny-llama-lora", GPU + steps(60) + ["--data.pack_capacity", "4608"]),
        ("qlora", "tiny-llama-qlora", GPU + steps(60)),
        ("qlora-4352", "tiny-llama-qlora", GPU + steps(60) + ["--data.pack_capacity", "4352"]),
        ("qlora-4608", "tiny-llama-qlora", GPU + steps(60) + ["--data.pack_capacity", "4608"]),
    ],
    # Issue 5, session 16: model.FusedLoRAPair (fc_1 and fc_2's A sides in one kernel each way, the second frozen
    # input gradient added by its matmul) against the code before it (cb7daf1, carried as out/prev), the recipes as
    # shipped (micro batch 8), 60 steps, LoRA twice each.
    "s16b-tiny": [
        ("lora-before", "tiny-llama-lora", GPU + steps(60), PREVIOUS),
        ("lora", "tiny-llama-lora", GPU + steps(60)),
        ("lora-before-again", "tiny-llama-lora", GPU + steps(60), PREVIOUS),
        ("lora-again", "tiny-llama-lora", GPU + steps(60)),
        ("qlora-before", "tiny-llama-qlora", GPU + steps(60), PREVIOUS),
        ("qlora", "tiny-llama-qlora", GPU + steps(60)),
    ],
    # Issue 5, session 17: what the adapters cost, place by place, and the step without most of them (the ceiling of
    # LoRA's MFU with these adapters' kernels). Every run keeps an adapter on q: with the head's alone, nothing
    # below the head would need a gradient and autograd would skip the blocks' backward pass. The recipe as shipped
    # otherwise (micro batch 8, r 32, dropout 0.05). MFU counts each run's own FLOPs: the adapters' weight gradients
    # (2 N_trainable per token, 4.0M to 26.3M trainable) are at most 1.2% of them.
    "s17-ceiling": [
        ("lora", "tiny-llama-lora", GPU + steps(60)),
        ("q-head", "tiny-llama-lora", GPU + steps(60) + ["--lora.targets", "[q,head]"]),
        ("qkv-head", "tiny-llama-lora", GPU + steps(60) + ["--lora.targets", "[q,k,v,head]"]),
        ("q-o-head", "tiny-llama-lora", GPU + steps(60) + ["--lora.targets", "[q,o,head]"]),
        ("q-mlp-head", "tiny-llama-lora", GPU + steps(60) + ["--lora.targets", "[q,mlp,head]"]),
        ("lora-again", "tiny-llama-lora", GPU + steps(60)),
        ("q-head-profile", "tiny-llama-lora", GPU + steps(30) + ["--lora.targets", "[q,head]",
                                                                 "--logging.profile", "20-21"]),
        ("lora-profile", "tiny-llama-lora", GPU + steps(30) + ["--logging.profile", "20-21"]),
    ],
    # Issue 5, session 18: model.FusedLoRAMLP (fc_1's and fc_2's B adds, the SwiGLU and proj's A side in one Triton
    # kernel each way) against the code before it (d068a27, carried as out/prev), the recipes as shipped, 60 steps,
    # LoRA twice each way and QLoRA once; then a profile of the new LoRA step.
    "s18-mlp": [
        ("lora-before", "tiny-llama-lora", GPU + steps(60), PREVIOUS),
        ("lora", "tiny-llama-lora", GPU + steps(60)),
        ("lora-before-again", "tiny-llama-lora", GPU + steps(60), PREVIOUS),
        ("lora-again", "tiny-llama-lora", GPU + steps(60)),
        ("qlora-before", "tiny-llama-qlora", GPU + steps(60), PREVIOUS),
        ("qlora", "tiny-llama-qlora", GPU + steps(60)),
        ("lora-profile", "tiny-llama-lora", GPU + steps(30) + ["--logging.profile", "20-21"]),
    ],
    # The same, after the forward kernel's launch from lora-mlp-s18b.md (BLOCK_K 64, 2 splits): the shipped LoRA
    # recipe twice, at 60 steps.
    "s18-mlp-b": [
        ("lora", "tiny-llama-lora", GPU + steps(60)),
        ("lora-again", "tiny-llama-lora", GPU + steps(60)),
    ],
    # The dropout mask's cost in a whole step: LoRA at dropout 0 with the code before this session (d068a27, out/prev:
    # its kernels draw a mask that keeps everything) and with this one (DROPOUT off: none drawn), and the recipe as
    # shipped (dropout 0.05) beside them; 60 steps each.
    "s18-dropout": [
        ("p0-before", "tiny-llama-lora", GPU + steps(60) + ["--lora.dropout", "0"], PREVIOUS),
        ("p0", "tiny-llama-lora", GPU + steps(60) + ["--lora.dropout", "0"]),
        ("p005", "tiny-llama-lora", GPU + steps(60)),
        ("p0-again", "tiny-llama-lora", GPU + steps(60) + ["--lora.dropout", "0"]),
        ("p005-again", "tiny-llama-lora", GPU + steps(60)),
    ],
    # OpenLLaMA-7B LoRA (intermediate 11,008: FusedLoRAMLP's launches were chosen at TinyLlama's 5,632) beside the
    # code before this session (d068a27, out/prev), 12 steps, twice each way.
    "s18-7b": [
        ("7b-lora-before", "open-llama-7b-lora", GPU + steps(12), PREVIOUS),
        ("7b-lora", "open-llama-7b-lora", GPU + steps(12)),
        ("7b-lora-before-again", "open-llama-7b-lora", GPU + steps(12), PREVIOUS),
        ("7b-lora-again", "open-llama-7b-lora", GPU + steps(12)),
    ],
    # Where the 7B step's time goes with and without FusedLoRAMLP (s18-7b: 3.4% slower with it): steps 8-9 profiled.
    "s18-7b-profile": [
        ("7b-lora-before-profile", "open-llama-7b-lora", GPU + steps(10) + ["--logging.profile", "8-9"], PREVIOUS),
        ("7b-lora-profile", "open-llama-7b-lora", GPU + steps(10) + ["--logging.profile", "8-9"]),
    ],
    # After the forward kernel's column splits followed the row count (8 programs per SM): 7B LoRA beside d068a27
    # again, and TinyLlama LoRA beside it too; 12 and 60 steps.
    "s18-splits": [
        ("7b-lora-before", "open-llama-7b-lora", GPU + steps(12), PREVIOUS),
        ("7b-lora", "open-llama-7b-lora", GPU + steps(12)),
        ("lora-before", "tiny-llama-lora", GPU + steps(60), PREVIOUS),
        ("lora", "tiny-llama-lora", GPU + steps(60)),
    ],
    # Dropout-0 LoRA adapters on the fused path (session 19: LitGPT's `lambda x: x` made an nn.Identity) beside the
    # code before (cf861f6, out/prev: those layers ran LowRankUpdate), twice each way; the shipped recipe (dropout
    # 0.05) on this code for the mask's cost; and a profile of the dropout-0 fused step.
    "s19-dropout": [
        ("p0-before", "tiny-llama-lora", GPU + steps(60) + ["--lora.dropout", "0"], PREVIOUS),
        ("p0", "tiny-llama-lora", GPU + steps(60) + ["--lora.dropout", "0"]),
        ("p005", "tiny-llama-lora", GPU + steps(60)),
        ("p0-before-again", "tiny-llama-lora", GPU + steps(60) + ["--lora.dropout", "0"], PREVIOUS),
        ("p0-again", "tiny-llama-lora", GPU + steps(60) + ["--lora.dropout", "0"]),
        ("p0-profile", "tiny-llama-lora", GPU + steps(30) + ["--lora.dropout", "0", "--logging.profile", "20-21"]),
        ("p005-profile", "tiny-llama-lora", GPU + steps(30) + ["--logging.profile", "20-21"]),
    ],
    # The LoRA dropout masks from a hash (this code) against Philox with 10 rounds (3fcf490, out/prev) and with 7
    # (3fcf490 with LORA_PHILOX_ROUNDS = 7, out/variant), the shipped recipe (dropout 0.05), twice each, interleaved.
    "s19-mask": [
        ("philox10", "tiny-llama-lora", GPU + steps(60), PREVIOUS),
        ("hash", "tiny-llama-lora", GPU + steps(60)),
        ("philox7", "tiny-llama-lora", GPU + steps(60), VARIANT),
        ("philox10-again", "tiny-llama-lora", GPU + steps(60), PREVIOUS),
        ("hash-again", "tiny-llama-lora", GPU + steps(60)),
        ("philox7-again", "tiny-llama-lora", GPU + steps(60), VARIANT),
        ("hash-profile", "tiny-llama-lora", GPU + steps(30) + ["--logging.profile", "20-21"]),
    ],
    # fc_1's and fc_2's frozen weights stacked (model.stack_fc_weights: FusedLoRAMLP's one matmul for both each way)
    # beside the code before (60939fb, out/prev), twice each way, and a profile.
    "s19-stack": [
        ("before", "tiny-llama-lora", GPU + steps(60), PREVIOUS),
        ("stacked", "tiny-llama-lora", GPU + steps(60)),
        ("before-again", "tiny-llama-lora", GPU + steps(60), PREVIOUS),
        ("stacked-again", "tiny-llama-lora", GPU + steps(60)),
        ("stacked-profile", "tiny-llama-lora", GPU + steps(30) + ["--logging.profile", "20-21"]),
    ],
    # Session 19's code as shipped: TinyLlama LoRA and QLoRA (60 steps), OpenLLaMA-7B LoRA and QLoRA (12 steps).
    "s19-final": [
        ("lora", "tiny-llama-lora", GPU + steps(60)),
        ("qlora", "tiny-llama-qlora", GPU + steps(60)),
        ("7b-lora", "open-llama-7b-lora", GPU + steps(12)),
        ("7b-qlora", "open-llama-7b-qlora", GPU + steps(12)),
    ],
    # The partial sums of up to three gradients in one launch (kernels._add_partials: swiglu_lora_backward's three,
    # the pair's two) beside the code before (5fc8369, out/prev), twice each way, and a profile.
    "s19-partials": [
        ("before", "tiny-llama-lora", GPU + steps(60), PREVIOUS),
        ("after", "tiny-llama-lora", GPU + steps(60)),
        ("before-again", "tiny-llama-lora", GPU + steps(60), PREVIOUS),
        ("after-again", "tiny-llama-lora", GPU + steps(60)),
        ("after-profile", "tiny-llama-lora", GPU + steps(30) + ["--logging.profile", "20-21"]),
    ],
    # Each epoch's steps fitted to one micro-batch (data.fit_steps) beside the code before (ec342cb, out/prev: the
    # shuffled order, ~26% of steps taking a second, short micro-batch), twice each way, QLoRA once each way, and a
    # profile.
    "s20-fit": [
        ("before", "tiny-llama-lora", GPU + steps(60), PREVIOUS),
        ("fit", "tiny-llama-lora", GPU + steps(60)),
        ("before-again", "tiny-llama-lora", GPU + steps(60), PREVIOUS),
        ("fit-again", "tiny-llama-lora", GPU + steps(60)),
        ("qlora-before", "tiny-llama-qlora", GPU + steps(60), PREVIOUS),
        ("qlora-fit", "tiny-llama-qlora", GPU + steps(60)),
        ("fit-profile", "tiny-llama-lora", GPU + steps(30) + ["--logging.profile", "20-21"]),
    ],
    # Each step's loss read after the next step's forward and backward are queued, the update skipping itself on
    # the device if it was not finite (fit's defer_reads), beside the code before (e83f63f, out/prev: read at once,
    # a host-device sync before each update): LoRA twice each way, QLoRA and the full fine-tune once, and a profile.
    "s20-defer": [
        ("before", "tiny-llama-lora", GPU + steps(60), PREVIOUS),
        ("after", "tiny-llama-lora", GPU + steps(60)),
        ("before-again", "tiny-llama-lora", GPU + steps(60), PREVIOUS),
        ("after-again", "tiny-llama-lora", GPU + steps(60)),
        ("qlora-before", "tiny-llama-qlora", GPU + steps(60), PREVIOUS),
        ("qlora-after", "tiny-llama-qlora", GPU + steps(60)),
        ("full-before", "tiny-llama-full", GPU + steps(30), PREVIOUS),
        ("full-after", "tiny-llama-full", GPU + steps(30)),
        ("after-profile", "tiny-llama-lora", GPU + steps(30) + ["--logging.profile", "20-21"]),
    ],
    # Meant as the same pairs over 200 steps, for the wall time of the whole loop (phases_s.train) with the first
    # steps weighing less (s20-defer's event-timed steps gained 4.5-6.9%, its 60-step loops 1.3%); but the recipes'
    # train.epochs 1 stops them after one epoch (59 steps), so as run (call 5 of session 20) it repeated s20-defer.
    "s20-wall": [
        ("before", "tiny-llama-lora", GPU + steps(200), PREVIOUS),
        ("after", "tiny-llama-lora", GPU + steps(200)),
        ("before-again", "tiny-llama-lora", GPU + steps(200), PREVIOUS),
        ("after-again", "tiny-llama-lora", GPU + steps(200)),
        ("qlora-before", "tiny-llama-qlora", GPU + steps(200), PREVIOUS),
        ("qlora-after", "tiny-llama-qlora", GPU + steps(200)),
    ],
    # Session 21: packed attention in Triton (litft.varlen_attention: grouped heads in one tile, fixed position tiles)
    # and the qkv layer's B side in one launch each way (kernels.lora_up_), beside session 20's code (d936278,
    # out/prev): LoRA twice each way, QLoRA once, and a profile.
    "s21-attn": [
        ("before", "tiny-llama-lora", GPU + steps(60), PREVIOUS),
        ("after", "tiny-llama-lora", GPU + steps(60)),
        ("before-again", "tiny-llama-lora", GPU + steps(60), PREVIOUS),
        ("after-again", "tiny-llama-lora", GPU + steps(60)),
        ("qlora-before", "tiny-llama-qlora", GPU + steps(60), PREVIOUS),
        ("qlora-after", "tiny-llama-qlora", GPU + steps(60)),
        ("after-profile", "tiny-llama-lora", GPU + steps(30) + ["--logging.profile", "20-21"]),
    ],
    # The full fine-tune with session 21's packed attention in Triton, beside session 20's code (d936278, out/prev):
    # not measured in session 21 (its device budget ran out).
    "s21-full": [
        ("full-before", "tiny-llama-full", GPU + steps(30), PREVIOUS),
        ("full-after", "tiny-llama-full", GPU + steps(30)),
        ("full-after-profile", "tiny-llama-full", GPU + steps(30) + ["--logging.profile", "20-21"]),
    ],
    # OpenLLaMA-7B (32 heads of 128, no groups) with packed attention in flash attention's kernels (auto: where the
    # Triton ones were not measured) and in the Triton ones (train.attention_kernel triton), 12 steps each, and the
    # full fine-tune's attention both ways: what would widen train.attention_kernel auto; and TinyLlama LoRA both
    # ways, the attention's share of session 21's gain on its own (s21-attn measured it with the qkv B side).
    "s21-attention-kernel": [
        ("lora-flash", "tiny-llama-lora", GPU + steps(60) + ["--train.attention_kernel", "flash"]),
        ("lora-auto", "tiny-llama-lora", GPU + steps(60)),
        ("7b-lora-flash", "open-llama-7b-lora", GPU + steps(12)),
        ("7b-lora-triton", "open-llama-7b-lora", GPU + steps(12) + ["--train.attention_kernel", "triton"]),
        ("full-flash", "tiny-llama-full", GPU + steps(30) + ["--train.attention_kernel", "flash"]),
        ("full-triton", "tiny-llama-full", GPU + steps(30)),
    ],
    # OpenLLaMA-7B QLoRA on session 21's code, the one issue-5 target not yet re-measured on it (peak reserved
    # memory at most 10 GiB at micro batch 4, sequence 512); the device budget left after session 22's calls fits one run.
    "s22-7b-qlora": [
        ("7b-qlora", "open-llama-7b-qlora", GPU + steps(12)),
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
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as err:
        code, stdout, stderr = 124, err.stdout or "", (err.stderr or "") + f"\ntimed out after {timeout}s"
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
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from litft.metrics import environment

    env = environment()
    rows = []
    for name, recipe, overrides, *run_env in SETS[args.set]:  # an optional 4th item: environment variables for the run
        print(f"[{args.set}] {name} ...", flush=True)
        rows.append(run_one(name, recipe, overrides, args.out, args.timeout, run_env[0] if run_env else None))
        print(f"    exit {rows[-1]['exit_code']} in {rows[-1]['wall_s']:.0f}s {rows[-1]['message'][:120]}", flush=True)
        write_report(args, env, rows)  # after every run: a time-out keeps what finished
    print(write_report(args, env, rows))
    return 0 if all(row["exit_code"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
