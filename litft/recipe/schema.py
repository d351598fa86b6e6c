"""The recipe's schema: typed, nested dataclasses, one per concern, with a docstring on every field (the docstrings
are `litft finetune --help`'s text). YAML recipes set only what differs from these defaults."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

PACKAGE_PREFIX = "litft:"


def resolve_path(path: str | Path | None) -> Path | None:
    """A path as given in a recipe: 'litft:demo/model' lies inside the installed package, anything else is a
    normal path (relative to the working directory)."""
    if path is None:
        return None
    path = str(path)
    if path.startswith(PACKAGE_PREFIX):
        return Path(str(files("litft") / "assets")) / path[len(PACKAGE_PREFIX) :]
    return Path(path).expanduser()


PrecisionName = Literal["32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true"]
LoRATarget = Literal["q", "k", "v", "o", "mlp", "head"]


@dataclass
class ModelConfig:
    """Which model to fine-tune, and where its files are."""

    name: Optional[str] = None
    """LitGPT model name (as in `litgpt.Config.from_name`), e.g. 'tiny-llama-1.1b', 'open_llama_7b'. Needed for
    `init: random`. With `init: pretrained` the architecture is read from the checkpoint's model_config.yaml, and a
    name given here must agree with it."""

    checkpoint_dir: Optional[str] = None
    """LitGPT checkpoint directory (lit_model.pth, model_config.yaml, tokenizer files), as written by
    `litgpt download <repo_id>`. Needed for `init: pretrained`; never downloaded implicitly. A path starting with
    'litft:' points inside the litft package (the shipped demo model)."""

    tokenizer_dir: Optional[str] = None
    """Directory holding tokenizer.json or tokenizer.model, when it is not checkpoint_dir (e.g. `init: random` with a
    tokenizer from elsewhere). Defaults to checkpoint_dir."""


@dataclass
class LoRAConfig:
    """Low-rank adapters (LoRA, arXiv 2106.09685): W x + (alpha / r) * B A x, with A: r x d_in and B: d_out x r."""

    r: int = 8
    """Rank of the adapter matrices. Trainable parameters per adapted d_out x d_in weight: r * (d_in + d_out)."""

    alpha: int = 16
    """Scaling numerator: the update is multiplied by alpha / r."""

    dropout: float = 0.05
    """Dropout on the adapter's input (training only)."""

    targets: list[LoRATarget] = field(default_factory=lambda: ["q", "v"])
    """Which projections get adapters: q, k, v (attention inputs), o (attention output), mlp (all MLP linears),
    head (the output layer)."""


@dataclass
class DataFields:
    """Names of the JSON keys that hold each part of an instruction record."""

    instruction: str = "instruction"
    """Key of the instruction (prompt) text."""

    input: str = "input"
    """Key of the optional extra input; records without it, or with an empty string, have none."""

    output: str = "output"
    """Key of the response the model learns to produce."""

    system: str = "system"
    """Key of an optional system prompt (OpenOrca's system_prompt), given to the prompt style as its sys_prompt."""


@dataclass
class DataConfig:
    """The instruction data set and how it becomes token sequences."""

    path: str = "litft:demo/instructions.jsonl"
    """The data: a .json file holding a list of records, a .jsonl file with one record per line, a folder of
    .txt/.md documents (data.format), or a data set by name, fetched once with `datasets` and cached: 'alpaca2k'
    (the lab's) or 'hf:REPO[:SPLIT]' (any Hugging Face hub data set, e.g. 'hf:Open-Orca/OpenOrca')."""

    format: Literal["auto", "alpaca", "openorca", "chat", "text"] = "auto"
    """How `path` holds its examples. 'alpaca': records with instruction, input and output (data.fields names the
    keys); 'openorca': records with system_prompt, question and response (OpenOrca, instruct-v3); 'chat': records
    with a 'messages' list of {role: system|user|assistant, content}, the last assistant message the response;
    'text': a folder of .txt/.md files (or one file) cut into max_seq_length-token chunks, loss on every token
    (domain adaptation). 'auto': text for a folder, .txt or .md; else chat, openorca or alpaca by the first
    record's keys."""

    val_path: Optional[str] = None
    """A separate validation file in the same format. When unset, `val_split` of `path` is held out."""

    val_split: float = 0.05
    """Fraction of records held out for validation (a fixed, seeded split) when val_path is unset."""

    fields: DataFields = field(default_factory=DataFields)
    """JSON keys of instruction, input and output."""

    prompt_style: str = "alpaca"
    """LitGPT prompt style that turns a record into the prompt text ('alpaca', 'default', 'llama2', ...)."""

    max_seq_length: int = 512
    """Longest token sequence (prompt + response); longer samples are truncated (and counted in the log)."""

    mask_prompt: bool = True
    """Train on the response only: prompt tokens get no loss."""

    packing: bool = True
    """Pack a micro-batch's samples into one row, attention kept within each sample: no compute on padding."""

    pack_steps: bool = True
    """With packing: fill micro-batches by positions (data.pack_capacity), not a count of samples."""

    pack_capacity: Optional[int] = None
    """Positions per micro-batch under pack_steps (null: micro_batch_size x max_seq_length)."""

    fit_steps: bool = True
    """Under pack_steps: reorder nearby samples so each step fits its micro-batches (no short extra pass)."""

    num_workers: int = 2
    """DataLoader worker processes (0 = load in the training process)."""


@dataclass
class TrainConfig:
    """Batch arithmetic, schedule and the training loop's switches."""

    global_batch_size: int = 16
    """Samples per optimizer step over all devices (accumulation derived)."""

    micro_batch_size: int = 4
    """Samples per forward/backward pass on each device (activation memory)."""

    epochs: int = 1
    """Passes over the training set."""

    max_steps: Optional[int] = None
    """Stop after this many optimizer steps (unset: all epochs)."""

    warmup_steps: int = 100
    """Steps of linear learning-rate warm-up from 0."""

    lr_schedule: Literal["cosine", "constant", "linear"] = "cosine"
    """After warm-up: decay to min_lr_ratio x lr, or constant."""

    min_lr_ratio: float = 0.0
    """Final lr as a fraction of the optimizer's lr (cosine, linear)."""

    max_grad_norm: Optional[float] = 1.0
    """Gradient norm clipping threshold (unset: none)."""

    activation_checkpointing: bool = False
    """Recompute blocks in backward: less memory, ~30% more compute."""

    save_interval: Optional[int] = None
    """Checkpoint every N steps, for --resume (unset: final weights only)."""

    keep_last_n: int = 2
    """Committed checkpoints to keep (the oldest goes after a commit)."""

    speed: Literal["fast", "litgpt"] = "fast"
    """'fast': litft's speed choices, as the switches below allow. 'litgpt': what LitGPT's finetune scripts run, for
    the lab's lessons and side-by-side comparisons: LitGPT's layers, padded batches, eager blocks, whole logits and
    torch's default optimizer step (every switch below off); the ledger predicts that path too."""

    compile: Literal["auto", "always", "never"] = "auto"
    """torch.compile blocks; auto: where it pays (the speed line says why)."""

    cuda_graphs: Literal["auto", "always", "never"] = "auto"
    """Replay micro-steps as CUDA graphs; auto: on one CUDA device."""

    fast_lora: bool = True
    """LoRA layers as plain matmuls; false: LitGPT's layers."""

    fused_rms_norm: bool = True
    """torch's fused rms_norm; false: LitGPT's RMSNorm."""

    fast_attention: bool = True
    """Llama attention, one RoPE, grouped k/v kept; false: LitGPT's."""

    lean_swiglu: bool = True
    """Recompute SwiGLU's silu in backward; false: LitGPT's MLP."""

    lean_mixed_linear: bool = True
    """-mixed: recast weights in backward, no kept 16-bit copies."""

    grad_into_weights: bool = True
    """Backward matmuls add into .grad (one device, -true, eager)."""

    triton_kernels: bool = True
    """litft's Triton kernels on CUDA (docs/speed.md); false: torch ops."""

    attention_kernel: Literal["auto", "flash", "triton"] = "auto"
    """Packed attention: auto, flash, or triton (any shape)."""

    loss_chunk: int = 4096
    """Positions per loss chunk, recomputed in backward; 0: all at once."""


@dataclass
class EvalConfig:
    """Validation during and after training."""

    interval: int = 100
    """Validate every this many optimizer steps (0: only before and after training)."""

    max_batches: Optional[int] = None
    """Cap on validation batches per evaluation (unset: the whole validation set)."""

    initial: bool = True
    """Validate before the first step, so the run records the loss it started from."""

    final: bool = True
    """Validate after the last step."""


@dataclass
class LoggingConfig:
    """What the run prints and writes."""

    interval: int = 1
    """Write a metrics row (metrics.jsonl, TensorBoard) every this many optimizer steps."""

    tensorboard: bool = True
    """Write TensorBoard event files to out_dir/tensorboard."""

    wandb: Optional[str] = None
    """A Weights & Biases project: each metrics row is logged there too, the recipe as the run's config (needs
    `pip install wandb`). Unset: no W&B."""

    wandb_mode: Literal["online", "offline"] = "online"
    """'offline' writes the W&B run under out_dir/wandb only (`wandb sync` uploads it later): no account or network."""

    progress: Literal["auto", "rich", "plain", "none"] = "auto"
    """Live progress: a rich bar on a terminal, plain log lines otherwise ('auto'), or forced."""

    skip_steps: int = 2
    """Optimizer steps at the start left out of the throughput figures (compilation, allocator and cache warm-up).
    Runs with no more steps than this report all steps and say so."""

    profile: Optional[str] = None
    """Record a torch profiler trace of optimizer steps START-END (e.g. '5-7') to out_dir/profile, viewable in
    TensorBoard or Perfetto (ui.perfetto.dev)."""

    memory_snapshot: int = 0
    """Record the CUDA allocator's history through optimizer step N (or until an out-of-memory error) to
    out_dir/memory_snapshot.pickle, for pytorch.org/memory_viz. 0: off. CUDA only."""

    nvtx: bool = False
    """Mark forward, backward and optimizer phases with NVTX ranges, so an Nsight Systems capture
    (nsys profile -t cuda,nvtx litft finetune ...) shows them by name."""

    gpu_sample_interval: float = 0.5
    """Seconds between NVML samples of device memory used and GPU utilisation while training (0: off)."""


@dataclass
class OptimizerSpec:
    """An optimizer class and its keyword arguments; any `torch.optim.Optimizer` subclass works."""

    class_path: str = "torch.optim.AdamW"
    """Import path of the class: torch.optim.AdamW, torch.optim.SGD, bitsandbytes.optim.AdamW8bit,
    bitsandbytes.optim.PagedAdamW, ..."""

    init_args: dict[str, Any] = field(
        default_factory=lambda: {"lr": 2e-4, "weight_decay": 0.0, "betas": [0.9, 0.95]}
    )
    """Keyword arguments of the class (lr, weight_decay, betas, momentum, ...), checked against its signature."""


@dataclass
class FSDPConfig:
    """Fully sharded data parallel (torch FSDP, through Lightning's FSDPStrategy): each transformer block's weights,
    gradients and optimizer state are split over the devices and gathered block by block as they are used."""

    sharding: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"] = "FULL_SHARD"
    """FULL_SHARD: weights, gradients and optimizer state sharded (least memory, weights gathered in forward and
    again in backward); SHARD_GRAD_OP: weights stay gathered between forward and backward (ZeRO-2-like, more memory,
    less traffic); HYBRID_SHARD: FULL_SHARD within a node, replicas across nodes; NO_SHARD: DDP through FSDP."""

    cpu_offload: bool = False
    """Keep the sharded weights (and their gradients and optimizer state) in host memory between uses: a model
    larger than the devices' memory trains, slowly (the optimizer step runs on the CPU)."""

    checkpoint: Literal["sharded", "full"] = "sharded"
    """Checkpoints as one file per rank ('sharded': fast, no gathering, resumed on the same number of devices) or
    gathered into whole tensors on rank 0 ('full': one file, host memory for the whole model)."""


@dataclass
class DeepSpeedConfig:
    """DeepSpeed ZeRO (the `deepspeed` extra, through Lightning's DeepSpeedStrategy): optimizer state and gradients
    (stage 2), and also the weights (stage 3), partitioned over the devices, optionally kept in host memory."""

    stage: Literal[2, 3] = 2
    """ZeRO stage: 2 partitions optimizer state and gradients; 3 also partitions the weights."""

    offload_optimizer: bool = False
    """ZeRO-Offload: fp32 master weights, Adam moments and the step on the CPU (DeepSpeedCPUAdam); the GPU keeps
    16-bit weights and gradients. Host memory: ~16 bytes per trainable parameter."""

    offload_parameters: bool = False
    """Stage 3 only: the 16-bit weights in host memory too, fetched block by block."""


@dataclass
class StrategyConfig:
    """How several devices share the work. A shorthand string works where the section does: 'ddp', 'fsdp',
    'fsdp_cpu_offload', 'deepspeed', 'deepspeed_stage_2_offload', 'deepspeed_stage_3', 'deepspeed_stage_3_offload'
    (Lightning's and LitGPT's names)."""

    name: Literal["auto", "ddp", "fsdp", "deepspeed"] = "auto"
    """'auto': one device, or DDP when devices x num_nodes > 1. 'ddp': a whole replica per device, gradients
    averaged once per step. 'fsdp' and 'deepspeed': sharded (see their sections)."""

    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Options of name: fsdp."""

    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    """Options of name: deepspeed."""

    @property
    def sharded(self) -> bool:
        """Weights, gradients or optimizer state split over the ranks (FSDP, DeepSpeed)."""
        return self.name in ("fsdp", "deepspeed")


STRATEGY_SHORTHANDS: dict[str, dict[str, Any]] = {
    "auto": {"name": "auto"},
    "ddp": {"name": "ddp"},
    "ddp_spawn": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
    "fsdp_cpu_offload": {"name": "fsdp", "fsdp": {"cpu_offload": True}},
    "deepspeed": {"name": "deepspeed"},
    "deepspeed_stage_2": {"name": "deepspeed", "deepspeed": {"stage": 2}},
    "deepspeed_stage_2_offload": {"name": "deepspeed", "deepspeed": {"stage": 2, "offload_optimizer": True}},
    "deepspeed_stage_3": {"name": "deepspeed", "deepspeed": {"stage": 3}},
    "deepspeed_stage_3_offload": {"name": "deepspeed", "deepspeed": {"stage": 3, "offload_optimizer": True,
                                                                     "offload_parameters": True}},
}
"""Strategy names as Lightning registers them (and LitGPT's --strategy takes), as the sections they mean."""


@dataclass
class Recipe:
    """A complete fine-tuning run. Recipes in YAML set only what differs from these defaults."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model and its files."""

    init: Literal["pretrained", "random"] = "pretrained"
    """'pretrained' loads checkpoint_dir/lit_model.pth; 'random' builds the named architecture with random weights
    (speed and memory do not depend on weight values, so any recipe can be measured without a download)."""

    method: Literal["full", "lora", "qlora"] = "lora"
    """'full' trains every weight; 'lora' trains adapters on frozen weights; 'qlora' is LoRA on 4-bit frozen weights."""

    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Adapter shape (methods lora and qlora)."""

    quantize: Optional[Literal["nf4", "nf4-dq", "fp4", "fp4-dq"]] = None
    """4-bit format of the frozen weights (method qlora only): nf4 or fp4 (bitsandbytes), '-dq' adds double
    quantization of the scales (~0.4 bit/parameter less)."""

    precision: PrecisionName = "bf16-true"
    """Fabric precision: '32-true'; '16-mixed'/'bf16-mixed' (16-bit compute over fp32 weights, +fp32 master copy);
    '16-true'/'bf16-true' (weights, gradients and optimizer state in 16 bits)."""

    data: DataConfig = field(default_factory=DataConfig)
    """The data set."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Batch arithmetic and schedule."""

    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    """Optimizer class and arguments."""

    eval: EvalConfig = field(default_factory=EvalConfig)
    """Validation."""

    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Logging and progress."""

    accelerator: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to run: 'auto' picks CUDA when a GPU is present, else the CPU."""

    devices: int = 1
    """Devices per node (GPUs, or CPU processes) to train on."""

    num_nodes: int = 1
    """Machines the run spans (torchrun or SLURM start one process per device on each; docs/multi-gpu.md)."""

    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    """How several devices share the work: a section, or a shorthand such as 'fsdp' or 'deepspeed_stage_3_offload'."""

    engine: Literal["fabric", "trainer"] = "fabric"
    """What runs the training loop: 'fabric', litft's own loop on Lightning Fabric (every speed feature), or
    'trainer', Lightning's Trainer with litft's LightningModule and DataModule (litft.lightning: the same model,
    data, optimizer and files; no CUDA graphs or litft DDP reducer; one device, DDP or FSDP)."""

    out_dir: str = "out/run"
    """Where the run writes its config, metrics, TensorBoard events, result.json and weights."""

    seed: int = 1337
    """Seed for weights init, LoRA dropout, data split and shuffling."""

    merge: bool = False
    """LoRA/QLoRA: also write a merged full checkpoint (base + adapter) to out_dir/final/merged."""

    memory_cap: Optional[str] = None
    """Make a large GPU behave like a smaller one: '24GiB' (an absolute cap) or '0.3' (a fraction of the GPU's
    memory). torch's allocator then fails past the cap exactly as it would on the smaller GPU."""

    # ---- derived values: one definition each ----

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on each device: global / (micro x devices)."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.world_size)

    def batch_arithmetic(self) -> str:
        t = self.train
        return (
            f"micro_batch_size {t.micro_batch_size} x accumulation {self.grad_accum} x devices {self.world_size}"
            f" = global_batch_size {t.global_batch_size}; up to {t.global_batch_size * self.data.max_seq_length:,}"
            f" tokens per step at max_seq_length {self.data.max_seq_length}"
        )


# ----------------------------------------------------------------------------------------------------------------------
# Saving and identity
# ----------------------------------------------------------------------------------------------------------------------


def recipe_to_dict(recipe: Recipe) -> dict:
    return plain(dataclasses.asdict(recipe))


def recipe_to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, default_flow_style=None)


def config_hash(recipe: Recipe) -> str:
    """A short hash of everything that shapes the training result (not where it is written or how it is shown)."""
    values = recipe_to_dict(recipe)
    for key in ("out_dir", "logging"):
        values.pop(key, None)
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:12]


def plain(value: Any) -> Any:
    """Namespaces, tuples and Paths to plain dicts, lists and strings (what YAML and JSON hold)."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value
