"""LitGPT 0.5.13's own fine-tuning scripts against litft's recipes: one random-weight checkpoint, the same rows.

    python benchmarks/vs_litgpt.py --out DIR [--model tiny-llama-1.1b | --config-file model_config.yaml]
        [--max-steps N] [--only NAME[,NAME]] [--timeout S] [--dry-run] [--precision P] [--accelerator cpu]

One call, top to bottom:

1. data: DIR/data/train.json (1,024 rows) and DIR/data/val.json (48 rows), written by
   benchmarks/make_bench_data.py. 1,024 (not 1,000) so that an epoch is a whole number of optimizer steps at global
   batch 16 and 32: LitGPT then trains on every row and litft (which drops an incomplete last step) on the same rows.
   LitGPT reads the folder (`--data JSON --data.json_path DIR/data`: a folder with train.json and val.json), litft the
   two files (`--data.path .../train.json --data.val_path .../val.json`).
2. checkpoint: DIR/checkpoint, random weights of the architecture (`litgpt.GPT(Config.from_name(...))`, seeded, built
   on the GPU when there is one) saved as bf16 lit_model.pth, model_config.yaml (litgpt.utils.save_config) and the
   demo tokenizer (litft/assets/demo/model: tokenizer.json, tokenizer_config.json). Speed and memory do not depend on
   weight values. The script checks that litgpt's Tokenizer loads from the folder and that every token id is below
   the architecture's vocab_size.
3. runs: for each pair (a litft recipe, and LitGPT's script given the recipe's settings) three processes, each with
   its own log (DIR/runs/NAME/log.txt): LitGPT; litft "like-for-like" (LitGPT's settings: padding instead of
   packing, no gradient clipping, no activation checkpointing, for QLoRA LitGPT's PagedAdamW); litft "defaults"
   (the recipe as shipped). A failure (non-zero exit, out of memory, time-out) is a row, not a crash.
   TinyLlama (default): pairs lora, qlora, full-bf16-true, full-bf16-mixed. OpenLLaMA-7B (`--model open_llama_7b`,
   also spelt open-llama-7b; use --max-steps, an epoch is too long): lora, qlora (recipes open-llama-7b-*).
4. DIR/vs_litgpt.md and DIR/vs_litgpt.json: one table, every figure's definition, the environment, every command.
   They are rewritten after every run, so a time-out keeps what finished.

On the GPU, as a step of a device call after benchmarks/gpu_call.sh's set-up (wheels in /tmp/site,
PYTHONPATH=/tmp/site:$PWD, $OUT = its work folder, whose tarball leaves out *.pth). The `litgpt` console script is
then not on PATH, so LitGPT is started as `python -c <launcher> finetune_lora ...`, the launcher calling
litgpt.__main__.main() as the console script does:

    python3 benchmarks/vs_litgpt.py --out "$OUT/vs-litgpt" --only lora,qlora                 # 6 runs
    python3 benchmarks/vs_litgpt.py --out "$OUT/vs-litgpt" --only full-bf16-true,full-bf16-mixed
    python3 benchmarks/vs_litgpt.py --out "$OUT/vs-litgpt-7b" --model open_llama_7b --max-steps 20

Expect roughly a minute per TinyLlama run (an epoch of 64 or 32 steps, plus start-up, compilation, LitGPT's LoRA
merge): the 12 runs will not fit one 10-minute device call, hence --only. Data and checkpoint are reused when DIR
already holds them. The 7B checkpoint takes 13.5 GB of disk, and LitGPT writes a merged 13.5 GB copy per LoRA run
(deleted after the run).

CPU smoke test (no GPU: LitGPT's QLoRA needs one, so leave qlora out):

    python benchmarks/vs_litgpt.py --out out/vs-litgpt-cpu --config-file litft/assets/demo/model/model_config.yaml \
        --max-steps 3 --precision 32-true --accelerator cpu --only lora,full-bf16-true
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN_ROWS, VAL_ROWS = 1024, 48
DATA_SEEDS = {"train": 0, "val": 1}
WEIGHTS_SEED = 0
LITGPT_DATA_SEED = 42  # litgpt.data.JSON's default shuffle seed; passed explicitly, and used to replay its order
STEADY_SKIP_STEPS = 2  # litft's logging.skip_steps default: the optimizer steps left out of the steady state
NO_EVAL_INTERVAL = 1_000_000  # LitGPT evaluates when step % interval == 0 (0 would divide by zero): never
GB, GIB = 1e9, 2**30
LORA_FLAGS = [("lora_query", "q"), ("lora_key", "k"), ("lora_value", "v"), ("lora_projection", "o"),
              ("lora_mlp", "mlp"), ("lora_head", "head")]

# LitGPT's CLI, as its console script runs it (litgpt.__main__.main), plus two things for the benchmark: the peak
# reserved memory at exit (LitGPT prints only the peak allocated), and, where `requests` is missing, a no-op for
# jsonargparse's set_config_read_mode(urls_enabled=True), which needs it (LitGPT calls it to let configs be read
# from URLs: in its main() and again when it saves hyperparameters.yaml after training).
LITGPT_LAUNCHER = """\
import atexit, sys
import torch

def peak_memory_at_exit():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        print(f"vs_litgpt: at exit max_memory_allocated={torch.cuda.max_memory_allocated()}"
              f" max_memory_reserved={torch.cuda.max_memory_reserved()} bytes", flush=True)

atexit.register(peak_memory_at_exit)
try:
    import requests
except ImportError:
    import jsonargparse
    jsonargparse.set_config_read_mode = lambda *args, **kwargs: None
    print("vs_litgpt: requests is not installed: litgpt's CLI runs without reading configs from URLs", flush=True)
import litgpt.__main__ as litgpt_cli
sys.argv = ["litgpt"] + sys.argv[1:]
litgpt_cli.main()
"""


@dataclass
class Pair:
    """A litft recipe, and LitGPT's script given the same settings."""

    name: str
    recipe: str
    precision: str | None = None  # overrides the recipe's
    lab: tuple[str, ...] = ()
    """Settings where the shipped recipe differs from the lab's (issue 5's reference runs), as overrides: LitGPT's
    run and litft's like-for-like run take them, the defaults run does not."""


# the lab's LoRA and QLoRA settings: global batch 16 in micro-batches of 4 (the shipped TinyLlama recipes run 8)
LAB_MICRO_4 = ("--train.micro_batch_size", "4")

PAIRS = {
    "tiny": [
        Pair("lora", "tiny-llama-lora", lab=LAB_MICRO_4),
        Pair("qlora", "tiny-llama-qlora", lab=LAB_MICRO_4),
        Pair("full-bf16-true", "tiny-llama-full"),
        Pair("full-bf16-mixed", "tiny-llama-full", precision="bf16-mixed"),
    ],
    "open_llama_7b": [
        Pair("lora", "open-llama-7b-lora"),
        Pair("qlora", "open-llama-7b-qlora"),
    ],
}


@dataclass
class Run:
    name: str
    pair: Pair
    tool: str  # "LitGPT" or "litft"
    variant: str  # "LitGPT script", "like-for-like" or "defaults"
    recipe: object  # litft.recipe.Recipe: the settings the pair follows
    command: list[str]
    out_dir: Path
    env: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------------------
# Options, architecture, plan
# ----------------------------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/vs-litgpt"))
    parser.add_argument("--model", default="tiny-llama-1.1b", help="a litgpt model name (litgpt.Config.from_name)")
    parser.add_argument("--config-file", type=Path, help="a model_config.yaml to use instead of --model")
    parser.add_argument("--max-steps", type=int, help="stop both tools after N optimizer steps (default: 1 epoch)")
    parser.add_argument("--only", help="comma-separated run names or pair names (e.g. lora,litgpt-full-bf16-true)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--precision", help="override every run's precision (e.g. 32-true on the CPU)")
    parser.add_argument("--accelerator", choices=["auto", "cpu", "cuda"], default="auto",
                        help="cpu: litft gets --accelerator cpu, LitGPT runs with CUDA_VISIBLE_DEVICES=''")
    parser.add_argument("--dry-run", action="store_true", help="print every command and exit")
    parser.add_argument("--rescore", type=Path, metavar="DIR",
                        help="run nothing: recompute the table of an earlier call's folder (its vs_litgpt.json, runs'"
                             " logs, LitGPT CSVs, litft result.json files) with this script's definitions, into"
                             " DIR/vs_litgpt.rescored.md and .json (give the earlier call's --model or --config-file)")
    args = parser.parse_args()
    args.out = args.out.resolve()
    return args


def load_architecture(model: str, config_file: Path | None):
    """The litgpt Config: from a model_config.yaml, or by name (open-llama-7b is also accepted for open_llama_7b)."""
    from litgpt.config import Config, name_to_config

    if config_file is not None:
        return Config.from_file(config_file)
    name = model if model in name_to_config else model.replace("-", "_")
    if name not in name_to_config:
        raise SystemExit(f"--model {model}: not a litgpt model name")
    return Config.from_name(name)


def plan_runs(args, config, ckpt: Path, data_dir: Path) -> list[Run]:
    from litft.recipe import load_recipe

    runs = []
    for pair in PAIRS["open_llama_7b" if config.name == "open_llama_7b" else "tiny"]:
        precision = args.precision or pair.precision
        recipe = load_recipe(pair.recipe, args=(["--precision", precision] if precision else []) + list(pair.lab),
                             validate_paths=False)
        runs.append(Run(f"litgpt-{pair.name}", pair, "LitGPT", "LitGPT script", recipe,
                        litgpt_command(recipe, ckpt, data_dir, args.out / "runs" / f"litgpt-{pair.name}", args),
                        args.out / "runs" / f"litgpt-{pair.name}",
                        {"CUDA_VISIBLE_DEVICES": ""} if args.accelerator == "cpu" else {}))
        for variant, suffix, extra in [("like-for-like", "like", list(pair.lab) + like_for_like_overrides(recipe)),
                                       ("defaults", "defaults", [])]:
            out_dir = args.out / "runs" / f"litft-{pair.name}-{suffix}"
            runs.append(Run(f"litft-{pair.name}-{suffix}", pair, "litft", variant, recipe,
                            litft_command(pair, precision, ckpt, data_dir, out_dir, args, extra), out_dir))
    return runs


def litgpt_command(recipe, ckpt: Path, data_dir: Path, out_dir: Path, args) -> list[str]:
    """`litgpt finetune_lora|finetune_full` with the recipe's settings; no validation, no intermediate checkpoints."""
    t = recipe.train
    optimizer = {"class_path": recipe.optimizer.class_path,
                 "init_args": {k: v for k, v in recipe.optimizer.init_args.items()
                               if k in ("lr", "weight_decay", "betas")}}
    command = [
        sys.executable, "-c", LITGPT_LAUNCHER,
        "finetune_full" if recipe.method == "full" else "finetune_lora", str(ckpt),
        "--out_dir", str(out_dir), "--precision", recipe.precision, "--devices", "1", "--seed", str(recipe.seed),
        "--data", "JSON", "--data.json_path", str(data_dir), "--data.mask_prompt", json.dumps(recipe.data.mask_prompt),
        "--data.prompt_style", recipe.data.prompt_style, "--data.seed", str(LITGPT_DATA_SEED),
        "--train.global_batch_size", str(t.global_batch_size), "--train.micro_batch_size", str(t.micro_batch_size),
        "--train.epochs", str(t.epochs), "--train.max_seq_length", str(recipe.data.max_seq_length),
        "--train.lr_warmup_steps", str(t.warmup_steps), "--train.log_interval", "1", "--train.save_interval", "null",
        "--eval.initial_validation", "false", "--eval.final_validation", "false",
        "--eval.interval", str(NO_EVAL_INTERVAL),
        "--optimizer", json.dumps(optimizer), "--logger_name", "csv",
    ]
    if args.max_steps:
        command += ["--train.max_steps", str(args.max_steps)]
    if recipe.method in ("lora", "qlora"):
        lora = recipe.lora
        command += ["--lora_r", str(lora.r), "--lora_alpha", str(lora.alpha), "--lora_dropout", str(lora.dropout)]
        for flag, target in LORA_FLAGS:
            command += [f"--{flag}", json.dumps(target in lora.targets)]
    if recipe.method == "qlora":
        command += ["--quantize", f"bnb.{recipe.quantize}"]
    return command


def like_for_like_overrides(recipe) -> list[str]:
    """What litft must change to train as LitGPT's script does (batch, length, LoRA shape, precision already agree)."""
    overrides = ["--data.packing", "false", "--train.max_grad_norm", "null"]  # LitGPT pads, and does not clip
    if recipe.train.activation_checkpointing:  # LitGPT's single-device LoRA has no activation checkpointing
        overrides += ["--train.activation_checkpointing", "false"]
    if recipe.method == "qlora":  # LitGPT's finetune_lora --quantize trains with bitsandbytes' PagedAdamW
        init = recipe.optimizer.init_args
        overrides += ["--optimizer", "bitsandbytes.optim.PagedAdamW", "--optimizer.lr", json.dumps(init["lr"]),
                      "--optimizer.weight_decay", json.dumps(init["weight_decay"]),
                      "--optimizer.betas", json.dumps(list(init["betas"]))]
    return overrides


def litft_command(pair: Pair, precision, ckpt: Path, data_dir: Path, out_dir: Path, args, extra) -> list[str]:
    command = [
        sys.executable, "-m", "litft.cli", "finetune", "--config", pair.recipe,
        "--init", "pretrained", "--model.checkpoint_dir", str(ckpt), "--model.name", "null",
        "--data.path", str(data_dir / "train.json"), "--data.val_path", str(data_dir / "val.json"),
        "--out_dir", str(out_dir), "--overwrite", "--logging.progress", "plain",
        "--eval.initial", "false", "--eval.final", "false", "--eval.interval", "0",
    ]
    if precision:
        command += ["--precision", precision]
    if args.accelerator != "auto":
        command += ["--accelerator", args.accelerator]
    if args.max_steps:
        command += ["--train.max_steps", str(args.max_steps)]
    return command + extra


def select(runs: list[Run], only: str | None) -> list[Run]:
    if not only:
        return runs
    wanted = {name.strip() for name in only.split(",") if name.strip()}
    known = {r.name for r in runs} | {r.pair.name for r in runs}
    if wanted - known:
        raise SystemExit(f"--only: unknown {', '.join(sorted(wanted - known))}; choose from {', '.join(sorted(known))}")
    return [r for r in runs if r.name in wanted or r.pair.name in wanted]


def shown(command: list[str]) -> str:
    """A command as the report shows it: `python` for this interpreter, $LITGPT_LAUNCHER for the launcher code."""
    parts = ["python", *command[1:]]
    if len(parts) > 2 and parts[1] == "-c":
        parts[2] = "$LITGPT_LAUNCHER"
    return shlex.join(parts).replace("'$LITGPT_LAUNCHER'", '"$LITGPT_LAUNCHER"')


# ----------------------------------------------------------------------------------------------------------------------
# Data, checkpoint, tokenizer
# ----------------------------------------------------------------------------------------------------------------------


def data_commands(data_dir: Path) -> list[list[str]]:
    script = str(REPO / "benchmarks" / "make_bench_data.py")
    return [[sys.executable, script, "--out", str(data_dir / f"{part}.json"), "--rows", str(rows),
             "--seed", str(DATA_SEEDS[part])] for part, rows in (("train", TRAIN_ROWS), ("val", VAL_ROWS))]


def make_data(data_dir: Path) -> list[str]:
    """train.json and val.json (kept when they already hold the right number of rows: the generator is seeded)."""
    lines = []
    for command, rows in zip(data_commands(data_dir), (TRAIN_ROWS, VAL_ROWS)):
        path = Path(command[3])
        if path.is_file() and len(json.loads(path.read_text(encoding="utf-8"))) == rows:
            lines.append(f"{path.name}: reused ({rows} rows)")
            continue
        proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            raise SystemExit(f"make_bench_data failed:\n{proc.stdout}{proc.stderr}")
        lines.append(proc.stdout.strip())
    return lines


def build_checkpoint(model: str, config_file: str | None, ckpt: str) -> str:
    """Random weights of the architecture (seeded; on the GPU if there is one, where init takes seconds even at 7B),
    saved in bf16 with model_config.yaml and the demo tokenizer. Runs in its own process (see in_fresh_process)."""
    import torch
    from litgpt import GPT
    from litgpt.utils import save_config

    from litft.recipe import resolve_path

    config = load_architecture(model, Path(config_file) if config_file else None)
    target = Path(ckpt)
    target.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    torch.manual_seed(WEIGHTS_SEED)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: half the memory and time of fp32 then a cast
    with torch.device(device):
        gpt = GPT(config)
    state = {name: tensor.to("cpu") for name, tensor in gpt.state_dict().items()}
    del gpt
    torch.save(state, target / "lit_model.pth")
    save_config(config, target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_path("litft:demo/model") / name, target / name)
    params = sum(t.numel() for t in state.values())
    return (f"{config.name}: {params:,} parameters, random (seed {WEIGHTS_SEED}, built on {device} in"
            f" {time.perf_counter() - started:.0f} s), bf16 lit_model.pth, model_config.yaml"
            " (litgpt.utils.save_config), tokenizer.json + tokenizer_config.json from litft:demo/model")


def checkpoint_is_current(ckpt: Path, config) -> bool:
    import yaml

    path = ckpt / "model_config.yaml"
    return (ckpt / "lit_model.pth").is_file() and path.is_file() and yaml.safe_load(path.read_text()) == asdict(config)


def in_fresh_process(fn, *args):
    """fn(*args) in a new Python process: this process never touches the GPU, so every run has it to itself."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def check_tokenizer(ckpt: Path, config) -> str:
    """litgpt's Tokenizer loads from the checkpoint folder, and every id it can produce is a row of the embedding."""
    from litgpt.tokenizer import Tokenizer

    tokenizer = Tokenizer(ckpt)
    if tokenizer.backend == "huggingface":
        ids = tokenizer.processor.get_vocab(with_added_tokens=True).values()
    else:
        ids = range(tokenizer.processor.vocab_size())
    largest = max(ids)
    if largest >= config.vocab_size:
        raise SystemExit(f"the tokenizer's id {largest} does not fit {config.name}'s vocab_size {config.vocab_size}")
    return (f"litgpt.Tokenizer({ckpt.name}) loads: {tokenizer.backend}, {len(ids):,} ids, largest {largest} <"
            f" vocab_size {config.vocab_size} (padded {config.padded_vocab_size}); bos {tokenizer.bos_id},"
            f" eos {tokenizer.eos_id}")


def tokenize_train(data_dir: Path, ckpt: Path, recipe):
    """The training rows as litft tokenizes them (litft.data: alpaca template, BOS, response + EOS, cut so that a
    sample has at most max_seq_length input positions): sample i's length is what both tools' real tokens count."""
    from litgpt.tokenizer import Tokenizer

    from litft.data import read_records, tokenize_records

    records = read_records(data_dir / "train.json", recipe.data.fields)
    data = tokenize_records(records, Tokenizer(ckpt), recipe.data.prompt_style, recipe.data.max_seq_length,
                            recipe.data.mask_prompt)
    if data.stats.dropped:
        raise SystemExit(f"{data.stats.dropped} rows have prompts over max_seq_length: litft drops them, LitGPT does"
                         " not, so the tools would not train on the same rows")
    return data


# ----------------------------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------------------------


def execute(run: Run, timeout: int) -> tuple[int, float]:
    """Run in its own process group (the run and its data-loader workers), output to DIR/runs/NAME/log.txt."""
    shutil.rmtree(run.out_dir, ignore_errors=True)
    run.out_dir.mkdir(parents=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **run.env}
    started = time.perf_counter()
    with open(run.out_dir / "log.txt", "w", encoding="utf-8") as log:
        log.write(f"$ {shown(run.command)}\n\n")
        log.flush()
        proc = subprocess.Popen(run.command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = 124
            log.write(f"\nvs_litgpt: timed out after {timeout} s; killed\n")
    return code, time.perf_counter() - started


def remove_weights(out_dir: Path) -> None:
    """Trained weights are not needed for the comparison (merged 7B LoRA weights are 13.5 GB): *.pth go, *.lora stay."""
    for path in out_dir.rglob("*.pth"):
        path.unlink()


LITGPT_REPORT = {
    "input_tokens": r"\| - Input Tokens\s*:\s*(\d+)",
    "tokens_with_prompt": r"\| - Tokens w/ Prompt\s*:\s*(\d+)",
    "tokens_with_padding": r"\| - Total Tokens \(w/ Padding\)\s*:\s*(\d+)",
    "training_time_s": r"\| - Training Time\s*:\s*([\d.]+) s",
    "tok_per_sec": r"\| - Tok/sec\s*:\s*([\d.]+) tok/s",
    "memory_used_gb": r"\| - Memory Used\s*:\s*([\d.]+) GB",
    "exit_max_allocated_bytes": r"vs_litgpt: at exit max_memory_allocated=(\d+)",
    "exit_max_reserved_bytes": r"vs_litgpt: at exit .* max_memory_reserved=(\d+)",
}


def parse_litgpt(out_dir: Path) -> dict:
    """LitGPT's performance report (printed after fit()) and its CSV log (one row per micro-batch at log_interval 1;
    its `step` column is the iteration, `time` is the ThroughputMonitor's, finetune_lora only)."""
    text = (out_dir / "log.txt").read_text(encoding="utf-8", errors="replace")
    found = {key: float(m.group(1)) for key, pattern in LITGPT_REPORT.items() if (m := re.search(pattern, text))}
    csv_path = out_dir / "logs" / "csv" / "version_0" / "metrics.csv"
    if not csv_path.is_file():  # a committed results folder keeps it beside the log
        csv_path = out_dir / "metrics.csv"
    rows = list(csv.DictReader(csv_path.open())) if csv_path.is_file() else []
    iterations = [row for row in rows if row.get("iter_time")]
    monitor_time = [float(row["time"]) for row in rows if row.get("time")]
    monitor_rate = [float(row["device/items_per_sec"]) for row in rows if row.get("device/items_per_sec")]
    found["iterations"] = len(iterations)
    found["iter_times_s"] = [float(row["iter_time"]) for row in iterations]  # litgpt_row takes it out again
    found["sum_iter_time_s"] = sum(found["iter_times_s"]) if iterations else None
    found["monitor_time_s"] = monitor_time[-1] if monitor_time else None
    found["monitor_items_per_sec"] = monitor_rate[-1] if monitor_rate else None
    return found


def failure(code: int, text: str) -> str:
    if code == 124:
        return "timed out"
    if code == 4 or "OutOfMemoryError" in text or "CUDA out of memory" in text:
        return "out of memory"
    lines = [line for line in text.strip().splitlines() if line.strip()]
    litft_lines = [line for line in lines if line.startswith("litft finetune:")]
    return (litft_lines or lines or [""])[-1][:200]


# ----------------------------------------------------------------------------------------------------------------------
# What each run trained on, and its figures
# ----------------------------------------------------------------------------------------------------------------------


def litgpt_batches(n: int, micro_batch_size: int, iterations: int) -> list[list[int]]:
    """The micro-batches LitGPT trained on: its JSON module's loader (shuffle, generator seeded LITGPT_DATA_SEED,
    incomplete last batch kept) replayed over row indices, cut to the iterations its CSV logged."""
    import torch
    from torch.utils.data import DataLoader

    loader = DataLoader(range(n), batch_size=micro_batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(LITGPT_DATA_SEED))
    return [batch.tolist() for batch in loader][:iterations]


def litft_batches(n: int, micro_batch_size: int, seed: int, count: int) -> list[list[int]]:
    """The micro-batches litft trained on in its first epoch: its own sampler, cut to steps x accumulation."""
    from litft.data import EpochBatchSampler

    sampler = EpochBatchSampler(n, micro_batch_size, shuffle=True, seed=seed, drop_last=True)
    sampler.set_epoch(0)
    return list(sampler)[:count]


def flop_model(config, method: str, recipe, counts=None):
    """litft.metrics.FlopModel for the model a run trains. counts: litft's result.json parameters; without them the
    model is built on the meta device the way LitGPT's script builds it and counted with litft's count_parameters."""
    from litft.metrics import FlopModel
    from litft.model import count_parameters

    if counts is None:
        import torch

        if method == "full":
            from litgpt.model import GPT

            with torch.device("meta"):
                gpt = GPT(config)
        else:
            from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

            lora = recipe.lora
            flags = {flag: target in lora.targets for flag, target in LORA_FLAGS}
            lora_config = Config(**{**asdict(config), "lora_r": lora.r, "lora_alpha": lora.alpha,
                                    "lora_dropout": lora.dropout, **flags})
            with torch.device("meta"):
                gpt = GPT(lora_config)
            mark_only_lora_as_trainable(gpt)
        c = count_parameters(gpt)
        counts = {"matmul_trainable": c.matmul_trainable, "matmul_frozen": c.matmul_frozen}
    return FlopModel(counts["matmul_trainable"], counts["matmul_frozen"], config.n_layer,
                     config.n_head * config.head_size)


def work(batches: list[list[int]], lengths: list[int], flops) -> dict:
    """Samples, real tokens (litft's lengths) and model FLOPs of these micro-batches."""
    return {
        "samples": sum(len(b) for b in batches),
        "real_tokens": sum(lengths[i] for b in batches for i in b),
        "flops": sum(flops.batch_flops([lengths[i] for i in b]) for b in batches),
    }


def litgpt_row(run: Run, code: int, config, lengths: list[int], peak) -> dict:
    """LitGPT's figures: its report and CSV, and the real tokens / FLOPs of the rows it trained on (replayed)."""
    text = (run.out_dir / "log.txt").read_text(encoding="utf-8", errors="replace")
    found = parse_litgpt(run.out_dir)
    iter_times = found.pop("iter_times_s")
    row = base_row(run, code)
    row["litgpt"] = found
    if code != 0 or "training_time_s" not in found or not found["iterations"]:
        row["status"] = failure(code, text) if code != 0 else "failed: no performance report in the log"
        return row
    t, max_len = run.recipe.train, run.recipe.data.max_seq_length
    batches = litgpt_batches(len(lengths), t.micro_batch_size, found["iterations"])
    done = work(batches, lengths, flop_model(config, run.recipe.method, run.recipe))
    # LitGPT's forward sees each sample's ids up to max_seq_length: one position more than litft's input for a sample
    # that is not truncated (litft shifts before, LitGPT after the forward). Its own counts, replayed:
    positions = [min(lengths[i] + 1, max_len) for b in batches for i in b]
    padded = sum(len(b) * max(min(lengths[i] + 1, max_len) for i in b) for b in batches)
    row["checks"] += [
        agreement("LitGPT 'Tokens w/ Prompt' vs replayed non-padding positions", found.get("tokens_with_prompt"),
                  sum(positions)),
        agreement("LitGPT 'Total Tokens (w/ Padding)' vs replayed", found.get("tokens_with_padding"), padded),
    ]
    epoch = found["sum_iter_time_s"]
    padded_tokens = found.get("tokens_with_padding", padded)
    # steady state as litft counts its own: the iterations of the first STEADY_SKIP_STEPS optimizer steps left out
    skip = STEADY_SKIP_STEPS * run.recipe.grad_accum
    steady_time = sum(iter_times[skip:])
    steady_real = sum(lengths[i] for b in batches[skip:] for i in b)
    row.update(
        status="ok", steps=found["iterations"] // run.recipe.grad_accum, samples=done["samples"], epoch_time_s=epoch,
        real_tokens=done["real_tokens"], padded_tokens=padded_tokens, real_tok_s=done["real_tokens"] / epoch,
        padded_tok_s=padded_tokens / epoch, reported_tok_s=found["tok_per_sec"],
        steady_real_tok_s=steady_real / steady_time if steady_time > 0 else None,
        peak_allocated_gib=found["memory_used_gb"] * GB / GIB if "memory_used_gb" in found else None,
        peak_reserved_gib=found["exit_max_reserved_bytes"] / GIB if "exit_max_reserved_bytes" in found else None,
        mfu=done["flops"] / epoch / peak if peak else None,
    )
    if "memory_used_gb" in found and "exit_max_allocated_bytes" in found:
        row["checks"].append(agreement("LitGPT 'Memory Used' GB vs max_memory_allocated at exit (GB)",
                                       found["memory_used_gb"], round(found["exit_max_allocated_bytes"] / GB, 2),
                                       ".2f"))
    if found["monitor_time_s"]:
        row["checks"].append(f"LitGPT loop wall (ThroughputMonitor time) {found['monitor_time_s']:.2f} s vs"
                             f" sum of iter_time {epoch:.2f} s: {100 * (found['monitor_time_s'] / epoch - 1):+.1f}%"
                             " between iterations (logging)")
    return row


def litft_row(run: Run, code: int, config, lengths: list[int], peak) -> dict:
    """litft's figures: result.json, and the real tokens / FLOPs of the rows it trained on (its sampler, replayed)."""
    text = (run.out_dir / "log.txt").read_text(encoding="utf-8", errors="replace")
    result_path = run.out_dir / "result.json"
    result = json.loads(result_path.read_text()) if result_path.is_file() else None
    row = base_row(run, code)
    if result is None or result["status"] != "ok" or code != 0:
        row["status"] = failure(code, text)
        row["result"] = result
        return row
    t, m = result["throughput"], result["memory"]
    batches = litft_batches(len(lengths), result["batch"]["micro_batch_size"], result["recipe"]["seed"],
                            result["steps"] * result["batch"]["grad_accum"])
    done = work(batches, lengths, flop_model(config, run.recipe.method, run.recipe, result["parameters"]))
    row["checks"].append(agreement("litft throughput.tokens_real vs replayed", t["tokens_real"], done["real_tokens"]))
    # the training loop and, before it, the CUDA graphs' warm-up and captures (with any compiling they set off):
    # both are work on the training data's shapes that LitGPT's loop does inside its iterations
    epoch = result["phases_s"]["train"] + result["phases_s"].get("warmup", 0.0)
    row.update(
        status="ok", steps=result["steps"], samples=done["samples"], epoch_time_s=epoch,
        real_tokens=done["real_tokens"], padded_tokens=t["tokens_padded"], real_tok_s=done["real_tokens"] / epoch,
        padded_tok_s=t["tokens_padded"] / epoch, reported_tok_s=t["tokens_per_sec"],
        steady_real_tok_s=t["tokens_per_sec"] if t.get("steps_skipped") == STEADY_SKIP_STEPS else None,
        peak_allocated_gib=m["peak_allocated_gib"], peak_reserved_gib=m["peak_reserved_gib"],
        mfu=done["flops"] / epoch / peak if peak else None,
        predicted_reserved_gib=(m.get("predicted") or {}).get("total_gib"), ledger_error_pct=m.get("error_pct"),
        predicted_for_tokens=m.get("predicted_for_tokens"),
        litft={"steady_state_tokens_per_sec": t["tokens_per_sec"], "steady_state_mfu": t["mfu"],
               "median_step_time_s": t["median_step_time_s"], "phases_s": result["phases_s"],
               "compile": result.get("compile"), "recipe": result["recipe"]},
    )
    return row


def base_row(run: Run, code: int) -> dict:
    return {"name": run.name, "pair": run.pair.name, "tool": run.tool, "variant": run.variant,
            "recipe": run.pair.recipe, "method": run.recipe.method, "precision": run.recipe.precision,
            "exit_code": code, "status": None, "command": shown(run.command),
            "log": str(run.out_dir / "log.txt"), "checks": []}


def agreement(what: str, reported, replayed, spec: str = ",.0f") -> str:
    if reported is None:
        return f"{what}: not reported"
    verdict = "agree" if float(reported) == float(replayed) else "DIFFER"
    return f"{what}: {reported:{spec}} / {replayed:{spec}} ({verdict})"


# ----------------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------------

DEFINITIONS = """\
- **epoch s**: wall time of the training loop. LitGPT: the sum of `iter_time` over its CSV log (log_interval 1, so
  every micro-batch; each spans fetching the batch to the loss `.item()` sync after its backward and optimizer step);
  it leaves out what LitGPT's `fit()` does before the loop (a scan of all rows for the longest, 2 sanity-check
  validation batches) and after it (finetune_lora generates a sample), and the logging between iterations (its size
  for finetune_lora is under Checks). litft: `phases_s.train` + `phases_s.warmup` of result.json: the wall time of
  `fit()` and of the CUDA graphs' warm-up and captures before it, compilation and the first steps included.
  (Results recorded before commit 5b161c3 have no warmup phase: their epoch s leaves out that warm-up, 4 plain
  micro-steps and one capture.)
- **samples**, **steps**: what the run trained on. LitGPT's loader keeps an incomplete last micro-batch; litft drops
  an incomplete last step. With 1,024 rows and global batch 16 or 32, an epoch is the same 1,024 rows for both.
- **real tok/s** = real tokens / epoch s, the same count for both tools: each trained sample's input positions as
  litft tokenizes it (`litft.data.tokenize_records`: alpaca template with BOS, response with EOS, at most
  max_seq_length = 512 input positions). Which samples a run trained on is replayed: LitGPT's loader (shuffle,
  generator seed 42) cut to the micro-batches its CSV logged; litft's `EpochBatchSampler` (seed 1337) cut to steps x
  accumulation. Checks compare the replay with each tool's own count. LitGPT's forward sees one position more per
  untruncated sample (it shifts after the forward, litft before): LitGPT's own non-padding count, 'Tokens w/ Prompt',
  is that count.
- **steady real tok/s** = the same real tokens and time with the first 2 optimizer steps (STEADY_SKIP_STEPS) left
  out, for both tools: litft's `throughput.tokens_per_sec` (its warm-up and first steps left out); LitGPT's replayed
  real tokens of its iterations after the first 2 x accumulation, over the sum of their `iter_time`.
- **padded tok/s** = all input positions, padding included, / epoch s. LitGPT: 'Total Tokens (w/ Padding)' of its
  report; litft: `throughput.tokens_padded` (with packing, the padding is at most 15 positions per micro-batch).
- **reported tok/s**: each tool's own headline. LitGPT: 'Tok/sec' of the report it prints after `fit()` =
  'Total Tokens (w/ Padding)' / 'Training Time', where Training Time is the wall time of all of `fit()` (the loop
  and what it does before and after, see epoch s): padding counted. (finetune_lora also logs lightning's
  ThroughputMonitor to its CSV: `device/items_per_sec`, a rolling window of 50 iterations, padding counted; absent
  in shorter runs.) litft: `throughput.tokens_per_sec` = real tokens / steady-state step time (the first 2 steps,
  evaluation and checkpointing left out).
- **peak alloc GiB**: LitGPT: 'Memory Used' of its report, `torch.cuda.max_memory_allocated() / 1e9` printed as GB
  with 2 decimals, converted here to GiB (x 1e9 / 2^30). litft: `memory.peak_allocated_gib`.
- **peak reserved GiB**: LitGPT prints none: the launcher reads `torch.cuda.max_memory_reserved()` when the process
  exits (after the final save and, for LoRA, the merge, which runs on the CPU; Checks compare the peak allocated at
  exit with 'Memory Used'). litft: `memory.peak_reserved_gib`. GiB = 2^30 bytes.
- **MFU**: litft.metrics' rule for both tools: model FLOPs = sum over trained samples of (6 N_trainable + 4 N_frozen) T
  + 12 L d T^2 (N: matmul weights from `litft.model.count_parameters`; for LitGPT its model built on the meta device),
  / epoch s / the GPU's peak dense FLOP/s at the compute dtype (`litft.metrics.peak_flops`). n/a on the CPU.
  litft's own steady-state MFU is in the JSON.
- **litft/LitGPT**: ratios against the pair's LitGPT run: epoch time (below 1: litft faster), real tok/s and
  steady real tok/s (above 1: litft faster). With --max-steps both train the same number of rows but not the same rows (each its own
  shuffle): compare real tok/s there, not time."""

DIFFERENCES = """\
What stays different, each tool's own implementation (like-for-like equalises the settings, not the code): litft
replays each micro-step as a CUDA graph on one GPU, runs eager blocks with its Triton kernels (SwiGLU, RoPE, the
residual adds fused into the norms, LoRA's seeded dropout, the loss's cross-entropy; before commit 3886978,
`compile: auto` compiled blocks for long runs, none of the 1,024-row ones), computes the loss in chunks of
`train.loss_chunk` positions (4,096 since commit 0f5fe38, 1,024 before; LitGPT chunks the output layer by 128 positions),
and uses its own layers (packed rows' varlen attention, matmul LoRA layers, torch's fused rms_norm); LitGPT logs (a device sync) every micro-batch. LitGPT's QLoRA swaps the embedding for bitsandbytes' StableEmbedding after building the optimizer (the
new embedding has requires_grad on but is not in the optimizer). LitGPT has no gradient clipping in these scripts and
no single-device activation checkpointing, hence like-for-like turns both off in litft. After training, LitGPT saves
(and for LoRA merges into a full checkpoint) and litft saves its weights: outside both epoch times; the *.pth files
are deleted after each run to save disk (*.lora adapters kept)."""


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    head = ("| run | tool | recipe | variant | exit | steps | samples | epoch s | real tok/s | steady real tok/s |"
            " padded tok/s | reported tok/s | peak alloc GiB | peak reserved GiB | MFU | epoch time litft/LitGPT |"
            " real tok/s litft/LitGPT | steady real tok/s litft/LitGPT |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    reference = {r["pair"]: r for r in rows if r["tool"] == "LitGPT" and r["status"] == "ok"}
    for r in rows:
        recipe = f"{r['recipe']} ({r['precision']})"
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['tool']} | {recipe} | {r['variant']} | {r['exit_code']} |"
                         f" {r['status']} |" + " |" * 12)
            continue
        ref = reference.get(r["pair"])
        time_ratio = tok_ratio = steady_ratio = ""
        if ref is not None and r["tool"] == "litft":
            time_ratio = f"{r['epoch_time_s'] / ref['epoch_time_s']:.2f}"
            tok_ratio = f"{r['real_tok_s'] / ref['real_tok_s']:.2f}"
            if r.get("steady_real_tok_s") and ref.get("steady_real_tok_s"):
                steady_ratio = f"{r['steady_real_tok_s'] / ref['steady_real_tok_s']:.2f}"
        flag = " (!)" if any("DIFFER" in c for c in r["checks"]) else ""
        lines.append(
            f"| {r['name']}{flag} | {r['tool']} | {recipe} | {r['variant']} | {r['exit_code']} | {r['steps']} |"
            f" {r['samples']:,} | {r['epoch_time_s']:.1f} | {r['real_tok_s']:,.0f} |"
            f" {fmt(r.get('steady_real_tok_s'), ',.0f')} | {r['padded_tok_s']:,.0f} |"
            f" {r['reported_tok_s']:,.0f} | {fmt(r['peak_allocated_gib'], '.2f')} |"
            f" {fmt(r['peak_reserved_gib'], '.2f')} | {fmt(r['mfu'], '.1%')} | {time_ratio} | {tok_ratio} |"
            f" {steady_ratio} |"
        )
    return "\n".join(lines)


def ledger_lines(rows: list[dict]) -> list[str]:
    """litft's predicted peak reserved memory (its ledger, written by each run) against the measured peak (issue 3)."""
    mine = [r for r in rows if r["tool"] == "litft" and r["status"] == "ok" and r.get("predicted_reserved_gib")
            and r.get("peak_reserved_gib") is not None]  # no device memory on the CPU
    if not mine:
        return []
    lines = ["## litft's memory ledger", "",
             "| run | measured peak reserved GiB | predicted GiB | sized for positions | error |", "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['peak_reserved_gib']:.2f} | {r['predicted_reserved_gib']:.2f} |"
              f" {fmt(r.get('predicted_for_tokens'), ',')} | {fmt(r.get('ledger_error_pct'), '+.1f')}% |" for r in mine]
    return lines + [""]


def write_report(out: Path, invocation: str, env: dict, setup: list[str], runs: list[Run], rows: list[dict],
                 name: str = "vs_litgpt", differences: str = DIFFERENCES) -> str:
    md = ["# litft vs LitGPT", "", f"Command: `{invocation}`", "", "Environment (litft.metrics.environment()):", ""]
    md += [f"- {key}: {value}" for key, value in env.items()]
    md += ["", "Set-up:", ""] + [f"- {line}" for line in setup]
    md += ["", table(rows), "", "(!) marks a run whose replayed counts differ from the tool's own (see Checks).", ""]
    md += ledger_lines(rows)
    md += ["## Definitions", "", DEFINITIONS, "", differences, "", "## Checks", ""]
    md += [f"- {r['name']}: {check}" for r in rows for check in r["checks"]]
    md += ["", "## Commands", "", "Each run in its own process; its log is DIR/runs/NAME/log.txt.", ""]
    md += [f"- {run.name}: `{shown(run.command)}`" for run in runs]
    md += ["", "with LITGPT_LAUNCHER (LitGPT's console-script entry point, plus the peak reserved memory at exit):", "",
           "```python", LITGPT_LAUNCHER.rstrip(), "```"]
    text = "\n".join(md) + "\n"
    (out / f"{name}.md").write_text(text, encoding="utf-8")
    (out / f"{name}.json").write_text(json.dumps(
        {"invocation": invocation, "environment": env, "setup": setup, "definitions": DEFINITIONS,
         "differences": differences, "runs": rows}, indent=2, default=str), encoding="utf-8")
    return text


# ----------------------------------------------------------------------------------------------------------------------


def figures(run: Run, code: int, config, lengths: list[int], env: dict) -> dict:
    """One run's row of the table, from what its process left: LitGPT's log and CSV, or litft's result.json."""
    from litft.metrics import peak_flops
    from litft.precision import Precision

    peak = peak_flops(env["gpu"], Precision(run.recipe.precision).peak_flops_key()) if env.get("gpu") else None
    make_row = litgpt_row if run.tool == "LitGPT" else litft_row
    return make_row(run, code, config, lengths, peak)


def rescore(args, invocation: str) -> int:
    """The table of an earlier call, recomputed from what it left (no run): for new columns or definitions. The
    training rows are made again (the generator is seeded) and must tokenize to the lengths that call recorded."""
    import tempfile

    folder = args.rescore.resolve()
    earlier = json.loads((folder / "vs_litgpt.json").read_text(encoding="utf-8"))
    codes = {row["name"]: row["exit_code"] for row in earlier["runs"]}
    config = load_architecture(args.model, args.config_file)
    args.out = folder
    runs = [run for run in plan_runs(args, config, folder / "checkpoint", folder / "data") if run.name in codes]
    with tempfile.TemporaryDirectory() as tmp:
        make_data(Path(tmp))
        train = tokenize_train(Path(tmp), REPO / "litft" / "assets" / "demo" / "model", runs[0].recipe)
    described = f"train.json as litft tokenizes it: {train.stats.describe()}"
    if described not in earlier["setup"]:
        raise SystemExit(f"the rows made now do not match that call's ({described!r} is not in its setup)")
    env = earlier["environment"]
    rows = []
    for run in runs:
        rows.append(figures(run, codes[run.name], config, train.lengths.tolist(), env))
    setup = earlier["setup"] + [f"rescored by `{invocation}`: no run, the figures recomputed from this folder's files"]
    print(write_report(folder, earlier["invocation"], env, setup, runs, rows, name="vs_litgpt.rescored",
                       differences=earlier["differences"]))  # the code then run
    return 0


def main() -> int:
    args = parse_args()
    invocation = shlex.join(["python", "benchmarks/vs_litgpt.py", *sys.argv[1:]])
    if args.rescore:
        return rescore(args, invocation)
    config = load_architecture(args.model, args.config_file)
    ckpt, data_dir = args.out / "checkpoint", args.out / "data"
    runs = select(plan_runs(args, config, ckpt, data_dir), args.only)
    if args.dry_run:
        print("# data")
        for command in data_commands(data_dir):
            print(shown(command))
        print(f"# checkpoint: random {config.name} in {ckpt} (built in a child process)")
        for run in runs:
            print(f"# {run.name} ({run.tool}, {run.variant})\n{shown(run.command)}")
        print(f"# LITGPT_LAUNCHER:\n{LITGPT_LAUNCHER}")
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    setup = make_data(data_dir)
    if checkpoint_is_current(ckpt, config):
        setup.append(f"checkpoint: reused {ckpt}")
    else:
        setup.append("checkpoint: " + in_fresh_process(build_checkpoint, args.model,
                                                       str(args.config_file) if args.config_file else None, str(ckpt)))
    setup.append(check_tokenizer(ckpt, config))
    train = tokenize_train(data_dir, ckpt, runs[0].recipe)
    lengths = train.lengths.tolist()
    setup.append(f"train.json as litft tokenizes it: {train.stats.describe()}")
    if args.precision:
        setup.append(f"precision: {args.precision} for every run (--precision)")
    if args.max_steps:
        setup.append(f"both tools stop after {args.max_steps} optimizer steps (--max-steps)")

    from litft.metrics import environment

    env = in_fresh_process(environment)
    rows: list[dict] = []
    for i, run in enumerate(runs, start=1):
        print(f"[{i}/{len(runs)}] {run.name} ...", flush=True)
        code, wall = execute(run, args.timeout)
        try:
            row = figures(run, code, config, lengths, env)
        except Exception as err:  # an output the parser did not expect must not lose the other runs
            row = base_row(run, code)
            row["status"] = f"figures unreadable: {type(err).__name__}: {err}"
        row["process_wall_s"] = wall
        rows.append(row)
        remove_weights(run.out_dir)
        print(f"    exit {code} in {wall:.0f} s: {row['status']}", flush=True)
        write_report(args.out, invocation, env, setup, runs, rows)
    print(write_report(args.out, invocation, env, setup, runs, rows))
    return 0 if all(row["status"] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
