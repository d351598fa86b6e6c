"""Pass 3 of loading a recipe: the settings that contradict each other or name what is not there, every problem at
once, each as 'dotted.key: what is wrong and what to do'."""

from __future__ import annotations

import difflib
from pathlib import Path

from litft.recipe.schema import Recipe, resolve_path

# ----------------------------------------------------------------------------------------------------------------------
# Pass 3: meaning
# ----------------------------------------------------------------------------------------------------------------------

_CHECKPOINT_FILES = ("lit_model.pth", "model_config.yaml")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def validate(recipe: Recipe, check_paths: bool = True) -> list[str]:
    """Every contradiction in the recipe, as 'dotted.key: what is wrong and what to do'. Empty list: valid.
    ``check_paths``: also that the files it names are there."""
    return (_value_problems(recipe) + _method_problems(recipe) + _strategy_problems(recipe)
            + _model_problems(recipe, check_paths))


def _value_problems(recipe: Recipe) -> list[str]:
    """Values out of range, and the batch arithmetic."""
    problems: list[str] = []
    t, d = recipe.train, recipe.data

    for key, value in [
        ("train.micro_batch_size", t.micro_batch_size),
        ("train.global_batch_size", t.global_batch_size),
        ("train.epochs", t.epochs),
        ("devices", recipe.devices),
        ("num_nodes", recipe.num_nodes),
        ("data.max_seq_length", d.max_seq_length),
        ("logging.interval", recipe.logging.interval),
    ]:
        if value < 1:
            problems.append(f"{key}: must be at least 1, got {value}")
    if t.micro_batch_size >= 1 and recipe.devices >= 1 and recipe.num_nodes >= 1 and t.global_batch_size >= 1:
        per_step = t.micro_batch_size * recipe.world_size
        if t.global_batch_size % per_step:
            lower = max(per_step, t.global_batch_size // per_step * per_step)
            ranks = f"devices {recipe.devices} x num_nodes {recipe.num_nodes}" if recipe.num_nodes > 1 else "devices"
            problems.append(
                f"train.global_batch_size: {t.global_batch_size} is not a multiple of micro_batch_size x {ranks} ="
                f" {t.micro_batch_size} x {recipe.world_size} = {per_step}; try {lower} or {lower + per_step}"
            )
    if d.pack_capacity is not None:
        if not (d.packing and d.pack_steps):
            problems.append(f"data.pack_capacity: {d.pack_capacity} needs data.packing and data.pack_steps (both true);"
                            " set it to null, or turn both on")
        elif d.pack_capacity < d.max_seq_length:
            problems.append(f"data.pack_capacity: {d.pack_capacity} is below data.max_seq_length {d.max_seq_length}:"
                            " a sample must fit one micro-batch; use at least that, or null")
    if t.save_interval is not None and t.save_interval < 1:
        problems.append(f"train.save_interval: must be at least 1 or null, got {t.save_interval}")
    if t.keep_last_n < 1:
        problems.append(f"train.keep_last_n: must be at least 1 (the checkpoint to resume from), got {t.keep_last_n}")
    if t.loss_chunk < 0:
        problems.append(f"train.loss_chunk: must be 0 (no chunking) or positive, got {t.loss_chunk}")
    if t.max_steps is not None and t.max_steps < 1:
        problems.append(f"train.max_steps: must be at least 1 or null, got {t.max_steps}")
    if t.warmup_steps < 0:
        problems.append(f"train.warmup_steps: must be 0 or more, got {t.warmup_steps}")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        problems.append(f"train.min_lr_ratio: must be within [0, 1], got {t.min_lr_ratio}")
    if t.max_grad_norm is not None and t.max_grad_norm <= 0:
        problems.append(f"train.max_grad_norm: must be positive or null, got {t.max_grad_norm}")
    if recipe.eval.interval < 0:
        problems.append(f"eval.interval: must be 0 or more, got {recipe.eval.interval}")
    if recipe.eval.max_batches is not None and recipe.eval.max_batches < 1:
        problems.append(f"eval.max_batches: must be at least 1 or null (the whole set), got {recipe.eval.max_batches}")
    for key, value in (("logging.skip_steps", recipe.logging.skip_steps),
                       ("logging.memory_snapshot", recipe.logging.memory_snapshot),
                       ("logging.gpu_sample_interval", recipe.logging.gpu_sample_interval)):
        if value < 0:
            problems.append(f"{key}: must be 0 or more, got {value}")
    if d.val_path is None and not 0.0 < d.val_split < 1.0:
        problems.append(f"data.val_split: must be within (0, 1) when data.val_path is unset, got {d.val_split}")
    if d.num_workers < 0:
        problems.append(f"data.num_workers: must be 0 or more, got {d.num_workers}")

    if recipe.logging.profile is not None:
        start, _, end = recipe.logging.profile.partition("-")
        if not (start.isdigit() and end.isdigit() and 1 <= int(start) <= int(end)):
            problems.append(f"logging.profile: '{recipe.logging.profile}' should be a step window START-END, e.g. 5-7")
    if recipe.memory_cap is not None:
        try:
            parse_memory_cap(recipe.memory_cap, total_gib=80.0)
        except ValueError as err:
            problems.append(f"memory_cap: {err}")

    lr = recipe.optimizer.init_args.get("lr")
    if lr is not None and not (isinstance(lr, (int, float)) and lr > 0):
        problems.append(f"optimizer.init_args.lr: must be a positive number, got {lr!r}")
    return problems


def _method_problems(recipe: Recipe) -> list[str]:
    """LoRA's shape, and QLoRA's quantization and precision."""
    problems: list[str] = []
    if recipe.method in ("lora", "qlora"):
        lo = recipe.lora
        if lo.r < 1:
            problems.append(f"lora.r: must be at least 1, got {lo.r}")
        if not lo.targets:
            problems.append("lora.targets: choose at least one of q, k, v, o, mlp, head")
        if not 0.0 <= lo.dropout < 1.0:
            problems.append(f"lora.dropout: must be within [0, 1), got {lo.dropout}")
    if recipe.method == "qlora":
        if recipe.quantize is None:
            problems.append("quantize: method qlora needs a 4-bit format: nf4, nf4-dq, fp4 or fp4-dq")
        if recipe.precision.endswith("-mixed"):
            problems.append(
                f"precision: {recipe.precision} cannot be combined with 4-bit weights; use bf16-true (or 16-true,"
                " 32-true): the 4-bit weights are dequantized to that dtype for each matmul"
            )
        if recipe.accelerator == "cpu":
            problems.append("method: qlora needs a CUDA GPU (bitsandbytes' 4-bit training path in Fabric is GPU-only)")
    elif recipe.quantize is not None:
        problems.append(
            f"quantize: {recipe.quantize} applies to method qlora only (frozen 4-bit weights under LoRA adapters);"
            f" method is {recipe.method}. Set method: qlora, or quantize: null"
        )
    return problems


def _strategy_problems(recipe: Recipe) -> list[str]:
    """Strategy options that do not belong to the chosen strategy, or that do not combine with the recipe."""
    problems: list[str] = []
    s = recipe.strategy
    defaults = type(s)()
    if recipe.engine == "trainer" and s.name == "deepspeed":
        problems.append("engine: trainer runs one device, DDP and FSDP; DeepSpeed keeps the gradients inside its"
                        " engine, where the Trainer engine's per-step loss normalisation cannot reach: use engine"
                        " fabric (the default) for strategy deepspeed")
    if s.name != "fsdp" and s.fsdp != defaults.fsdp:
        problems.append(f"strategy.fsdp: set, but strategy.name is {s.name!r}; set strategy.name: fsdp, or remove"
                        " the fsdp options")
    if s.name != "deepspeed" and s.deepspeed != defaults.deepspeed:
        offload = " (CPU offload of the optimizer or weights is DeepSpeed's; FSDP has strategy.fsdp.cpu_offload)" if (
            s.deepspeed.offload_optimizer or s.deepspeed.offload_parameters) else ""
        problems.append(f"strategy.deepspeed: set, but strategy.name is {s.name!r}; set strategy.name: deepspeed, or"
                        f" remove the deepspeed options{offload}")
    if s.name == "deepspeed":
        d = s.deepspeed
        if d.offload_parameters and d.stage != 3:
            problems.append("strategy.deepspeed.offload_parameters: needs stage 3 (only ZeRO-3 partitions the"
                            " weights); set strategy.deepspeed.stage: 3, or offload_parameters: false")
        optimizer = recipe.optimizer.class_path.rpartition(".")[2]
        if d.offload_optimizer and optimizer not in ("AdamW", "Adam"):
            problems.append(f"strategy.deepspeed.offload_optimizer: runs Adam or AdamW on the CPU (DeepSpeedCPUAdam),"
                            f" not {recipe.optimizer.class_path}; use torch.optim.AdamW, or offload_optimizer: false")
        if recipe.optimizer.class_path.startswith("bitsandbytes."):
            problems.append(f"optimizer: {recipe.optimizer.class_path} does not run under DeepSpeed, which partitions"
                            " the optimizer state itself; use torch.optim.AdamW")
    if s.sharded:
        if recipe.accelerator == "cpu":
            problems.append(f"strategy: {s.name} needs CUDA GPUs (Lightning's FSDP and DeepSpeed strategies refuse the"
                            " CPU); on the CPU use strategy ddp")
        if recipe.method == "qlora":
            problems.append(f"method: qlora under strategy {s.name}: Fabric's 4-bit weights (bitsandbytes, stored in"
                            " uint8) cannot be sharded; use strategy ddp for QLoRA on several GPUs, or method lora with"
                            f" strategy {s.name}")
    if s.name == "fsdp" and s.fsdp.sharding == "HYBRID_SHARD" and recipe.num_nodes == 1:
        problems.append("strategy.fsdp.sharding: HYBRID_SHARD shards within a node and replicates across nodes, and"
                        " this run has num_nodes 1; use FULL_SHARD")
    return problems


def _model_problems(recipe: Recipe, check_paths: bool) -> list[str]:
    """The model's name and files, the tokenizer's, and (``check_paths``) the data files."""
    problems: list[str] = []
    m, d = recipe.model, recipe.data
    if recipe.init == "random" and m.name is None and m.checkpoint_dir is None:
        problems.append("model.name: init random needs an architecture name, e.g. tiny-llama-1.1b or open_llama_7b")
    if m.name is not None:
        from litgpt.config import name_to_config

        if m.name not in name_to_config:
            close = difflib.get_close_matches(m.name, list(name_to_config), n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            problems.append(f"model.name: '{m.name}' is not a LitGPT model name{hint}")
    if recipe.init == "pretrained":
        if m.checkpoint_dir is None:
            repo = _repo_id(m.name, None)
            problems.append(
                f"model.checkpoint_dir: init pretrained needs a LitGPT checkpoint directory. {_download(repo, None)};"
                f" or {_without_weights(m.name, repo)}"
            )
        elif check_paths:
            problems += checkpoint_dir_problems(resolve_path(m.checkpoint_dir), "model.checkpoint_dir", m.name)
    if check_paths:
        problems += _tokenizer_problems(recipe)
        from litft.data.sources import is_named  # a data set by name is fetched when the run reads it

        folders = d.format in ("auto", "text")  # data.format text reads a folder of .txt/.md files
        for key, value in [("data.path", d.path), ("data.val_path", d.val_path)]:
            if value is None or is_named(value):
                continue
            where = resolve_path(value)
            if not (where.is_file() or (folders and where.is_dir())):
                problems.append(f"{key}: no such file{' or folder' if folders else ''} '{value}'")
    return problems


def _tokenizer_problems(recipe: Recipe) -> list[str]:
    """Where the tokenizer should be and is not. A pretrained model's tokenizer in its checkpoint directory is
    the checkpoint directory's problem (checkpoint_dir_problems, or its absence), so it is reported once."""
    m = recipe.model
    if recipe.init == "pretrained" and m.tokenizer_dir is None:
        return []
    tok_dir = resolve_path(m.tokenizer_dir or m.checkpoint_dir)
    use = ("set model.tokenizer_dir to a directory holding tokenizer.json or tokenizer.model (litft:demo/model, or"
           " the model's own tokenizer)")
    if tok_dir is None:
        return [f"model.tokenizer_dir: no tokenizer: {use}"]
    if m.tokenizer_dir is not None:
        if not tok_dir.is_dir():
            return [f"model.tokenizer_dir: '{tok_dir}' does not exist; {use}"]
        if not any((tok_dir / f).is_file() for f in _TOKENIZER_FILES):
            return [f"model.tokenizer_dir: '{tok_dir}' has no tokenizer.json or tokenizer.model; {use}"]
        return []
    # init random, the tokenizer read from checkpoint_dir
    if not tok_dir.is_dir():
        return [f"model.checkpoint_dir: '{tok_dir}' does not exist, and init random reads the tokenizer from it; {use}"]
    if not any((tok_dir / f).is_file() for f in _TOKENIZER_FILES):
        return [f"model.checkpoint_dir: '{tok_dir}' has no tokenizer.json or tokenizer.model, and init random reads the"
                f" tokenizer from it; {use}"]
    return []


def parse_memory_cap(text: str, total_gib: float) -> float:
    """'24GiB' / '24' GiB -> 24.0; '0.3' (a fraction, < 1) -> 0.3 x total. Returns GiB."""
    value = str(text).strip()
    unit = value.lower()
    if unit.endswith("gib") or unit.endswith("gb"):
        if unit.endswith("gb") and not unit.endswith("gib"):
            raise ValueError(f"'{text}': write GiB (2^30 bytes), the unit torch and litft report")
        number = value[: -3]
        gib = float(number)
    else:
        number = float(value)
        gib = number * total_gib if number < 1 else number
    if gib <= 0:
        raise ValueError(f"'{text}' must be positive")
    return gib


def checkpoint_dir_problems(path: Path, key: str, model_name: str | None = None) -> list[str]:
    """What a LitGPT checkpoint directory lacks; never a download (a typo must not turn into network traffic). The
    advice names the repo of `model_name` (a LitGPT model name), or of the directory when it is laid out as
    `litgpt download` writes it."""
    if not path.is_dir():
        parent = path.parent
        close = difflib.get_close_matches(path.name, [p.name for p in parent.iterdir()], n=1) if parent.is_dir() else []
        hint = f" Did you mean '{parent / close[0]}'?" if close and parent / close[0] != path else ""
        repo = _repo_id(model_name, path)
        what = "is a file, not a checkpoint directory" if path.exists() else "does not exist"
        return [f"{key}: '{path}' {what}.{hint} {_download(repo, path)};"
                f" or {_without_weights(model_name, repo)}"]
    missing = [f for f in _CHECKPOINT_FILES if not (path / f).is_file()]
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        missing.append("tokenizer.json or tokenizer.model")
    if missing:
        return [
            f"{key}: '{path}' lacks {', '.join(missing)}; a LitGPT checkpoint directory holds lit_model.pth,"
            " model_config.yaml and the tokenizer (`litgpt download` writes all three)"
        ]
    return []


def _repo_id(model_name: str | None, path: Path | None) -> str | None:
    """The Hugging Face repo id (org/name) of a LitGPT model name (its Config's hf_config), else of a checkpoint
    directory ORG/NAME that is a LitGPT model's repo; None when neither tells."""
    from litgpt.config import name_to_config

    repos = {name: f"{c['hf_config']['org']}/{c['hf_config']['name']}"
             for name, c in name_to_config.items() if c.get("hf_config")}
    if model_name in repos:
        return repos[model_name]
    if path is not None and f"{path.parent.name}/{path.name}" in repos.values():
        return f"{path.parent.name}/{path.name}"
    return None


def _download(repo: str | None, path: Path | None) -> str:
    """How to get the weights: `litgpt download REPO`, which writes checkpoints/REPO."""
    if repo is None:
        return "Download the weights with `litgpt download <repo_id>` (`litgpt download list` lists the repo ids)"
    written = Path("checkpoints") / repo
    where = "" if path == written else f" (it writes {written}: set model.checkpoint_dir to it)"
    return f"Download the weights with `litgpt download {repo}`{where}"


def _without_weights(model_name: str | None, repo: str | None) -> str:
    """The whole command-line alternative to downloading weights: random weights of the named architecture with a
    tokenizer (speed and memory do not depend on the weights' values)."""
    name = "" if model_name else " --model.name NAME (a LitGPT model name, e.g. open_llama_7b)"
    own = (f"; the model's own tokenizer comes with `litgpt download {repo} --tokenizer_only true`, then"
           f" --model.tokenizer_dir checkpoints/{repo}") if repo else ""
    return (f"measure speed and memory with random weights: --init random{name} --model.tokenizer_dir litft:demo/model"
            f" (the demo's tokenizer{own})")
