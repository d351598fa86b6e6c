"""A recipe: typed, nested dataclasses (one per concern), loaded from YAML and CLI overrides by jsonargparse.

Loading goes in three passes so that the user sees every problem at once:

1. keys and choices: every key of the YAML and of the overrides is checked against the dataclasses, with a
   did-you-mean for typos (jsonargparse alone stops at the first unknown key);
2. types: jsonargparse parses the values into the declared types (and checks the optimizer's arguments against the
   optimizer class's own signature);
3. meaning: :func:`validate` checks settings that contradict each other (batch arithmetic, QLoRA without a
   quantization format, a missing checkpoint directory, ...).

Any failure raises :class:`~litft.errors.ConfigError` (exit code 2) before an out_dir is made or a GPU is touched.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from litft.errors import ConfigError

# ----------------------------------------------------------------------------------------------------------------------
# The schema
# ----------------------------------------------------------------------------------------------------------------------

Precision = Literal["32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true"]
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


@dataclass
class DataConfig:
    """The instruction data set and how it becomes token sequences."""

    path: str = "litft:demo/instructions.jsonl"
    """Alpaca-format data: a .json file holding a list of records, or a .jsonl file with one record per line."""

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
    """Concatenate each micro-batch's samples into one row, attention kept within each sample: the same samples and
    loss as padding to the longest, without computing the padding (typically a third to a half of the positions)."""

    pack_steps: bool = True
    """With packing (no effect when data.packing is false): fill micro-batches by positions rather than by samples.
    Each optimizer step's samples are packed into as few micro-batches of at most data.pack_capacity
    positions as fit (first-fit decreasing), so short samples make fewer, fuller micro-batches at the same peak
    memory. The same samples per step and the same loss normalisation (by the step's loss tokens): the same update,
    up to rounding. An epoch then ends at its last whole step (without it, a step may take its last micro-batches
    from the next epoch). Measured on the H100 (benchmarks/results/pack-steps-tiny): TinyLlama LoRA 25,382 ->
    28,570 real tok/s, QLoRA 21,697 -> 23,273, full 32,046 -> 32,444, same losses."""

    pack_capacity: Optional[int] = None
    """Positions per micro-batch under data.pack_steps (null: micro_batch_size x max_seq_length): sets peak activation
    memory (TinyLlama LoRA: ~1.1 MiB per position) apart from the sample count. A step whose samples overflow it
    takes one more, short micro-batch: 16 Alpaca-like samples (mean 245 tokens) in shuffled order overflow 4,096
    positions in 27-32% of steps, 4,608 in 7% (s16-tiny; s20-fit: 16 of 60 steps; with data.fit_steps none of
    them). TinyLlama LoRA at 4,608 took 1.0 GiB more reserved memory on the H100 (benchmarks/results/s16-tiny), so
    the recipes leave it null. Must be at least data.max_seq_length; needs data.packing and data.pack_steps."""

    fit_steps: bool = True
    """Under data.pack_steps: arrange each epoch's shuffled samples so that each step's samples fit in as few
    micro-batches of data.pack_capacity positions as the data's mean length allows, by swapping a step's longest
    sample with a nearby later one that makes it fit (data.fit_steps: every sample once per epoch, the same samples
    per step, the order otherwise the shuffled one; steps that no swap within 64 samples can fit keep their
    overflow, and those gather towards the end of an epoch when the mean step nearly fills its micro-batches).
    Without it a step that overflows takes one more, short micro-batch, which runs every kernel of a micro-batch
    for a few hundred positions: on the H100, TinyLlama LoRA took 76 micro-batches for 60 steps without it and 60
    with it, +2.0% / +5.1% real tok/s, QLoRA +6.0% (benchmarks/results/s20-fit). False: the plain shuffled order."""

    num_workers: int = 2
    """DataLoader worker processes (0 = load in the training process)."""


@dataclass
class TrainConfig:
    """Batch arithmetic, schedule and the training loop's switches."""

    global_batch_size: int = 16
    """Samples per optimizer step, summed over devices. gradient accumulation =
    global_batch_size / (micro_batch_size x devices), which must be a whole number."""

    micro_batch_size: int = 4
    """Samples per forward/backward pass on each device. Activation memory grows linearly with it."""

    epochs: int = 1
    """Passes over the training set."""

    max_steps: Optional[int] = None
    """Stop after this many optimizer steps (even within the first epoch). Unset: run all epochs."""

    warmup_steps: int = 100
    """Optimizer steps of linear learning-rate warm-up from 0 (capped at the run's total steps)."""

    lr_schedule: Literal["cosine", "constant", "linear"] = "cosine"
    """Learning rate after warm-up: cosine or linear decay to min_lr_ratio x lr, or constant."""

    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of the optimizer's lr (cosine and linear schedules)."""

    max_grad_norm: Optional[float] = 1.0
    """Clip the global gradient norm to this value before each step. Unset: no clipping."""

    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass: activation memory drops to about one
    block's worth plus the block inputs, for ~30% more compute."""

    save_interval: Optional[int] = None
    """Write a checkpoint every this many optimizer steps (out_dir/checkpoints/step-N, committed atomically), so
    `--resume auto` can continue an interrupted run exactly. Unset: only the final weights are written."""

    keep_last_n: int = 2
    """Committed checkpoints to keep; an older one is deleted only after its successor is committed."""

    compile: Literal["auto", "always", "never"] = "auto"
    """torch.compile each transformer block (regional: one graph for every block and row length). 'auto': eager on
    the CPU (inductor's C++ compile costs minutes for little gain); on CUDA without CUDA graphs, compiled; with CUDA
    graphs, compiled when the planned work repays the compile time (on the H100 a full fine-tune's block compiles in
    ~9 s, a LoRA block in ~80 s; finetune.use_compile has the break-even arithmetic). The run's speed line says why."""

    cuda_graphs: Literal["auto", "always", "never"] = "auto"
    """Replay each micro-batch's forward and backward as one CUDA graph: the host then launches one graph instead of
    thousands of kernels, which is what limits small models and micro-batches (a TinyLlama LoRA step run plainly
    keeps an H100 busy 11% of its 406 ms; replayed, the step takes 109 ms: benchmarks/results/ablation-tiny*).
    Rows are padded to a few fixed lengths (one capture each).
    'auto': on for a single CUDA device; off on the CPU and with DDP (its all-reduce runs inside backward)."""

    fast_lora: bool = True
    """LoRA layers as plain matmuls: the adapter's scale applied to its r-wide product and the adapter's output added
    by its matmul in place (one block-diagonal matmul for q, k, v), instead of LitGPT's forward (a scale and an add
    over each adapted layer's whole output; conv1d and zero-padding for q, k, v). The same function; false runs
    LitGPT's own layers, for comparison."""

    fused_rms_norm: bool = True
    """RMSNorm as torch's rms_norm (one fused kernel each way on CUDA, keeping the bf16 input and an fp32 scale per
    row for the backward pass where LitGPT's keeps fp32 copies: TinyLlama full 106,632 -> 82,056 activation bytes
    per token and block by the ledger's trace, LoRA 122,440 -> 114,248) instead of LitGPT's; the same arithmetic.
    On the H100 (benchmarks/results/layers-tiny) TinyLlama LoRA went from 36,679 to 43,468 real tok/s and 8.09 to
    7.76 GiB peak reserved, full bf16-true from 39,529 to 49,338 and 20.40 to 18.47 GiB. false runs LitGPT's norm."""

    fast_attention: bool = True
    """Attention's training forward with RoPE on q and k as one function of 3 kernels each way, and the grouped k, v
    heads passed to flash attention as they are (model.attention_forward), instead of LitGPT's forward, which runs ~6
    kernels each way per rotated tensor and copies k and v to every query head (TinyLlama: 4 groups to 32 heads). The
    same function; false runs LitGPT's forward, for comparison. Llama-style attention only (others keep LitGPT's)."""

    lean_swiglu: bool = True
    """The LLaMA MLP's silu(fc_1(x)) recomputed in the backward pass rather than kept (model.SwiGLU): one tensor of
    intermediate_size per token and block less (TinyLlama: 11 KB; 1 GiB for a 4,096-position full fine-tune
    micro-batch), for one elementwise pass more. false: LitGPT's MLP forward, for comparison."""

    lean_mixed_linear: bool = True
    """With -mixed precision: each linear layer keeps its fp32 weight for the backward pass and casts it to 16 bits
    again there (model.MixedPrecisionLinear), instead of keeping autocast's 16-bit copy of every weight from the
    forward pass to the backward pass: 2 bytes per weight less at the peak (TinyLlama 1.9 GiB, OpenLLaMA-7B 12.6 GiB)
    for one more cast per weight and micro-batch. The same arithmetic. On the H100 TinyLlama full bf16-mixed reserved
    28.96 GiB instead of 30.96 (LitGPT: 30.88) for 3.9% more step time (benchmarks/results/mixed-compiled-tiny).
    No effect with -true precision or 4-bit layers. false: autocast's own linear, for comparison."""

    grad_into_weights: bool = True
    """-true precision on one device, blocks not compiled: the backward matmuls add the weight gradients into .grad
    themselves, where autograd writes each into a new tensor and adds it in a second kernel per weight and
    micro-batch. Full fine-tuning: every linear layer (model.LinearGradIntoWeight; TinyLlama: 7.8 ms of a 122 ms H100
    step). LoRA and QLoRA with fast_lora: the adapters (model.LowRankUpdate), which also drops the scale's multiply
    each way (~500 small kernels per TinyLlama step). Not with DDP (its all-reduce hooks on autograd's add), -mixed
    precision (fp32 gradients of 16-bit products) or torch.compile (dynamo cannot trace a backward that writes .grad,
    and would split each block at every such layer). false: autograd's accumulation, for comparison."""

    triton_kernels: bool = True
    """Eager runs on CUDA: SwiGLU (with lean_swiglu), RoPE (with fast_attention), the loss's cross-entropy and LoRA's
    dropout (with fast_lora) as Triton kernels (litft.kernels), where torch runs 2 + 4, 3 + 3 and ~4 + 4 kernels that
    each read and write whole activations (the loss: fp32 copies of the logits) and keeps a 1-byte mask per dropped
    element (the kernel keeps a seed and draws the mask again; with grad_into_weights, each LoRA layer runs as
    model.FusedLoRA: the dropout drawn inside A's matmul kernels, no dropped copy written or kept, and the layer's
    input gradient written once); and torch.optim.AdamW's fused step as
    litft.kernels.AdamW (one device or DDP), the same update without writing the clipped gradients back. The same
    arithmetic in fp32, rounded once; dropout with the same distribution, not torch's draws. Triton compiles them in
    seconds on the first step (cached on disk); compiled blocks fuse SwiGLU and RoPE themselves (the loss's and
    AdamW's kernels run either way), and CPU runs or an install without Triton use the torch ops. false: the torch
    ops, for comparison."""

    attention_kernel: Literal["auto", "flash", "triton"] = "auto"
    """Which kernels run packed rows' attention in eager CUDA runs with triton_kernels and fast_attention (elsewhere
    flash attention's, or SDPA on the CPU). auto: litft.varlen_attention's Triton kernels where they were measured
    faster than flash attention's varlen ops, grouped k/v heads of 64 (TinyLlama: forward + backward 160 against
    315 us per 4,096-position row on the H100, benchmarks/results/attention-s21), flash attention elsewhere; flash:
    flash attention's everywhere; triton: the Triton kernels wherever they take the shape (head sizes 16, 32, 64,
    128; OpenLLaMA's 100 keeps flash attention), to measure a model they were not measured on. result.json's
    triton_kernels.packed_attention says which ran."""

    loss_chunk: int = 4096
    """Positions per output-layer chunk in the loss; each chunk's logits are recomputed in the backward pass, so
    (tokens x vocabulary) logits never exist at once. 0: the whole micro-batch at once. With the Triton loss
    (triton_kernels, CUDA) a chunk holds 2 bytes per logit: 4,096 x 32,000 vocab x 2 B = 0.24 GiB, which covers a
    TinyLlama micro-batch of 4,096 positions in one chunk, without the recompute (on the H100 a full fine-tune step
    took 112.6 instead of 113.7 ms at chunks of 1,024, benchmarks/results/s12b-tiny). With torch's cross-entropy
    (CPU, or no Triton) it holds ~12 bytes per logit (fp32 copies): 1.46 GiB at 4,096 positions; set 1024 there if
    memory is tight."""


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

    progress: Literal["auto", "rich", "plain", "none"] = "auto"
    """Live progress: a rich bar on a terminal, plain log lines otherwise ('auto'), or forced."""

    skip_steps: int = 2
    """Optimizer steps at the start left out of the throughput figures (compilation, allocator and cache warm-up).
    Runs with no more steps than this report all steps and say so."""

    profile: Optional[str] = None
    """Record a torch profiler trace of optimizer steps START-END (e.g. '5-7') to out_dir/profile, viewable in
    TensorBoard or Perfetto (ui.perfetto.dev)."""

    memory_snapshot: int = 0
    """Record the CUDA allocator's history from just before the first micro-step (and any CUDA graph capture)
    through optimizer step N, and write out_dir/memory_snapshot.pickle: every allocation, by pool, to open in
    pytorch.org/memory_viz, with its Python stack when the backward pass recomputes nothing (train.loss_chunk 0, no
    activation checkpointing: gathering stacks during a recompute stops torch 2.11). A run that runs out of memory
    first writes it at that point. 0: off. CUDA only."""

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

    precision: Precision = "bf16-true"
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
    """Number of devices (GPUs, or CPU processes) to train on."""

    strategy: Literal["auto", "ddp"] = "auto"
    """How several devices share the work; 'auto' is a single device, or DDP (a full replica per device, gradients
    averaged) when devices > 1."""

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
        return self.devices

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
            + (f"; micro-batches filled to {self.step_capacity:,} positions (data.pack_steps)"
               if self.packs_steps else "")
        )

    @property
    def packs_steps(self) -> bool:
        """data.pack_steps in effect: it fills packed micro-batches, so only with data.packing."""
        return self.data.pack_steps and self.data.packing

    @property
    def adds_grads_in_matmul(self) -> bool:
        """train.grad_into_weights in effect, before torch.compile is decided (compiled blocks keep autograd's)."""
        return self.train.grad_into_weights and not self.precision.endswith("-mixed") and self.devices == 1

    @property
    def recasts_mixed_weights(self) -> bool:
        """train.lean_mixed_linear in effect: it changes only what -mixed precision's autocast keeps."""
        return self.train.lean_mixed_linear and self.precision.endswith("-mixed")

    @property
    def loader_batch_size(self) -> int:
        """Samples per item of the training loader: micro_batch_size, or with data.pack_steps a whole step's samples
        per device (micro_batch_size x grad_accum), which the collate packs into micro-batches."""
        return self.train.micro_batch_size * (self.grad_accum if self.packs_steps else 1)

    @property
    def step_capacity(self) -> int:
        """Positions per micro-batch under data.pack_steps: data.pack_capacity, else the same bound as micro_batch_size
        samples at most max_seq_length long, so the same peak activation memory."""
        if self.data.pack_capacity is not None:
            return self.data.pack_capacity
        return self.train.micro_batch_size * self.data.max_seq_length


# ----------------------------------------------------------------------------------------------------------------------
# Paths, recipe lookup
# ----------------------------------------------------------------------------------------------------------------------

PACKAGE_PREFIX = "litft:"


def resolve_path(path: str | Path | None) -> Path | None:
    """A path as given in a recipe: 'litft:demo/model' lies inside the installed package, anything else is a
    normal path (relative to the working directory)."""
    if path is None:
        return None
    path = str(path)
    if path.startswith(PACKAGE_PREFIX):
        return Path(str(resources.files("litft") / "assets")) / path[len(PACKAGE_PREFIX) :]
    return Path(path).expanduser()


def recipes_dir() -> Path:
    """The shipped recipes: the package litft.recipes once installed (a wheel, or `pip install -e .`), else the
    recipes/ folder beside the litft/ folder (a source checkout on PYTHONPATH)."""
    try:
        return Path(str(resources.files("litft.recipes")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[1] / "recipes"


def recipe_names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def find_recipe(name_or_path: str | Path) -> Path:
    """A recipe file: an existing path, or the name of a shipped recipe (with or without '.yaml')."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = recipes_dir() / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    if shipped.is_file() and (path.parent == Path(".") or not path.exists()):
        return shipped
    names = recipe_names()
    hint = difflib.get_close_matches(path.stem, names, n=3)
    suggestion = f" did you mean {', '.join(repr(h) for h in hint)}?" if hint else ""
    raise ConfigError(
        f"no recipe file or shipped recipe named '{name_or_path}';{suggestion} `litft ls` lists the shipped recipes."
    )


# ----------------------------------------------------------------------------------------------------------------------
# Pass 1: keys and choices, all at once, with did-you-mean
# ----------------------------------------------------------------------------------------------------------------------


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _literal_choices(tp: Any) -> tuple[list[Any], bool, bool] | None:
    """(choices, allows None, is a list of choices) for Literal / Optional[Literal] / list[Literal]; else None."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return list(typing.get_args(tp)), False, False
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and typing.get_origin(args[0]) is Literal:
            return list(typing.get_args(args[0])), True, False
    if origin is list:
        (inner,) = typing.get_args(tp)
        if typing.get_origin(inner) is Literal:
            return list(typing.get_args(inner)), False, True
    return None


def _all_dotted_keys(cls: type = Recipe, prefix: str = "") -> list[str]:
    keys = []
    for name, tp in _hints(cls).items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(tp) and tp is not OptimizerSpec:
            keys += _all_dotted_keys(tp, f"{prefix}{name}.")
    return keys


def _unknown_key(key: str, siblings: list[str]) -> str:
    """'unknown key a.b' with the closest sibling, or the same leaf name in another section."""
    prefix, _, leaf = key.rpartition(".")
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        return f"unknown key '{key}'; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?"
    elsewhere = [k for k in _all_dotted_keys() if k.rpartition(".")[2] == leaf]
    if elsewhere:
        return f"unknown key '{key}'; did you mean '{elsewhere[0]}'?"
    section = f"'{prefix}'" if prefix else "a recipe"
    return f"unknown key '{key}'; {section} accepts: {', '.join(siblings)}"


def _check_choice(key: str, value: Any, tp: Any, problems: list[str]) -> None:
    spec = _literal_choices(tp)
    if spec is None:
        return
    choices, optional, is_list = spec
    values = value if is_list and isinstance(value, list) else [value]
    for v in values:
        if v is None and optional:
            continue
        if v not in choices:
            close = difflib.get_close_matches(str(v), [str(c) for c in choices], n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            allowed = ", ".join(repr(c) for c in choices) + (" or null" if optional else "")
            problems.append(f"{key}: {v!r} is not one of {allowed}{hint}")


def _check_section(values: dict, cls: type, prefix: str, problems: list[str]) -> None:
    hints = _hints(cls)
    for key, value in values.items():
        dotted = prefix + str(key)
        if key not in hints:
            problems.append(_unknown_key(dotted, list(hints)))
            continue
        tp = hints[key]
        if tp is OptimizerSpec:
            continue  # checked against the optimizer class by _check_optimizer
        if dataclasses.is_dataclass(tp):
            if isinstance(value, dict):
                _check_section(value, tp, dotted + ".", problems)
            elif value is not None:
                problems.append(f"{dotted}: expected a section of keys ({', '.join(_hints(tp))}), got {value!r}")
            continue
        _check_choice(dotted, value, tp, problems)


def _check_optimizer(class_path: str, arg_names: list[str], problems: list[str]) -> None:
    """The class must be an importable torch Optimizer, and every argument a parameter of its __init__."""
    import importlib
    import inspect

    import torch

    module_name, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError):
        problems.append(
            f"optimizer.class_path: cannot import '{class_path}' (e.g. torch.optim.AdamW, torch.optim.SGD,"
            " bitsandbytes.optim.AdamW8bit, bitsandbytes.optim.PagedAdamW)"
        )
        return
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        problems.append(f"optimizer.class_path: '{class_path}' is not a torch.optim.Optimizer subclass")
        return
    params = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "params")]
    for name in arg_names:
        if name not in params:
            close = difflib.get_close_matches(name, params, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; it accepts: {', '.join(params)}"
            problems.append(f"optimizer.init_args: {class_name} has no argument '{name}'{hint}")


def _parse_cli_overrides(args: list[str]) -> list[tuple[str, str | None]]:
    """['--a.b', 'v', '--c=w'] -> [('a.b', 'v'), ('c', 'w')]."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        token = args[i]
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument '{token}': overrides look like --train.micro_batch_size 8")
        key, eq, value = token[2:].partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
            i += 1
        pairs.append((key, value if (eq or value is not None) else None))
        i += 1
    return pairs


def _check_keys(yaml_values: dict, overrides: list[tuple[str, str | None]]) -> None:
    problems: list[str] = []
    _check_section(yaml_values, Recipe, "", problems)

    # The optimizer: class from the override, else the YAML, else the default; arguments from both.
    yaml_opt = yaml_values.get("optimizer") or {}
    if not isinstance(yaml_opt, dict):
        problems.append(f"optimizer: expected class_path and init_args, got {yaml_opt!r}")
        yaml_opt = {}
    for key in yaml_opt:
        if key not in ("class_path", "init_args"):
            problems.append(_unknown_key(f"optimizer.{key}", ["class_path", "init_args"]))
    yaml_class = yaml_opt.get("class_path") or OptimizerSpec().class_path
    yaml_args = list((yaml_opt.get("init_args") or {}).keys())
    cli_class, cli_args = None, []

    for key, raw in overrides:
        if key == "optimizer" or key == "optimizer.class_path":
            cli_class = raw
            continue
        if key == "optimizer.init_args":  # a whole mapping: --optimizer.init_args '{"lr": 1e-4, "foreach": true}'
            mapping = yaml.safe_load(raw) if raw else None
            if not isinstance(mapping, dict):
                problems.append(f"optimizer.init_args: expected a mapping such as '{{\"lr\": 1e-4}}', got {raw!r}")
                continue
            cli_args.extend(str(name) for name in mapping)
            continue
        if key.startswith("optimizer."):
            cli_args.append(key.removeprefix("optimizer.").removeprefix("init_args."))
            continue
        # walk the dataclasses along the dotted key
        cls: type = Recipe
        parts = key.split(".")
        for depth, part in enumerate(parts):
            hints = _hints(cls)
            dotted = ".".join(parts[: depth + 1])
            if part not in hints:
                problems.append(_unknown_key(dotted, list(hints)))
                break
            tp = hints[part]
            if depth == len(parts) - 1:
                if raw is not None and _literal_choices(tp) is not None:
                    try:
                        value = yaml.safe_load(raw)
                    except yaml.YAMLError:
                        value = raw
                    _check_choice(dotted, value, tp, problems)
            elif dataclasses.is_dataclass(tp):
                cls = tp
            else:
                problems.append(f"unknown key '{key}': '{dotted}' is a value, not a section")
                break
    if cli_class is None or cli_class == yaml_class:
        _check_optimizer(yaml_class, yaml_args + cli_args, problems)
    else:
        # Switching the class on the command line keeps the recipe's arguments the new class accepts and drops the
        # rest (jsonargparse's rule), so only the recipe's class is held to the recipe's arguments.
        _check_optimizer(yaml_class, yaml_args, problems)
        _check_optimizer(cli_class, cli_args, problems)
    if problems:
        raise ConfigError(problems)


# ----------------------------------------------------------------------------------------------------------------------
# Pass 2: types, through jsonargparse
# ----------------------------------------------------------------------------------------------------------------------


def build_parser(prog: str = "litft finetune"):
    """The jsonargparse parser of a recipe: one --dotted.key per field, with the field docstrings as help."""
    from collections.abc import Callable, Iterable

    import torch
    from jsonargparse import ActionConfigFile, ArgumentParser, Namespace, set_docstring_parse_options

    set_docstring_parse_options(attribute_docstrings=True)  # field docstrings become --help text
    parser = ArgumentParser(prog=prog, exit_on_error=False, description="Fine-tune a LitGPT model from a recipe.")
    parser.add_argument("--config", action=ActionConfigFile, help="A recipe YAML file (or a shipped recipe's name).")
    parser.add_class_arguments(Recipe, None, skip={"optimizer"}, fail_untyped=True)
    default = OptimizerSpec()
    # jsonargparse's own optimizer type: `--optimizer torch.optim.SGD --optimizer.momentum 0.9` switches the class
    # and sets its arguments, and the arguments are checked against the class's signature.
    parser.add_argument(
        "--optimizer",
        type=Callable[[Iterable], torch.optim.Optimizer],
        default=Namespace(class_path=default.class_path, init_args=Namespace(**default.init_args)),
        help="Optimizer class (e.g. torch.optim.SGD) and, as --optimizer.NAME, its arguments.",
    )
    return parser


def _from_dict(cls: type, values: dict) -> Any:
    hints = _hints(cls)
    kwargs = {}
    for name, value in values.items():
        if name not in hints:
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = _from_dict(tp, value)
        kwargs[name] = value
    return cls(**kwargs)


def _plain(value: Any) -> Any:
    """Namespaces, tuples and Paths to plain dicts, lists and strings (what YAML and JSON hold)."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def _optimizer_from_parsed(value: Any) -> OptimizerSpec:
    """Keep every argument jsonargparse resolved (the recipe's and the class defaults it filled in): the saved config
    then rebuilds exactly this optimizer, whatever litft's own default optimizer is."""
    value = _plain(value)
    return OptimizerSpec(class_path=value["class_path"], init_args=dict(value.get("init_args") or {}))


def _flatten_overrides(overrides: dict, prefix: str = "") -> list[str]:
    """{'train': {'micro_batch_size': 8}} -> ['--train.micro_batch_size', '8'] (values as JSON, which YAML reads)."""
    args: list[str] = []
    for key, value in overrides.items():
        dotted = f"{prefix}{key}"
        if dotted == "optimizer" and isinstance(value, dict):
            if "class_path" in value:
                args += ["--optimizer", str(value["class_path"])]
            init_args = value.get("init_args", {k: v for k, v in value.items() if k != "class_path"})
            for name, arg in init_args.items():
                args += [f"--optimizer.{name}", _cli_value(arg)]
        elif isinstance(value, dict):
            args += _flatten_overrides(value, dotted + ".")
        elif dataclasses.is_dataclass(value):
            args += _flatten_overrides(dataclasses.asdict(value), dotted + ".")
        else:
            args += [f"--{dotted}", _cli_value(value)]
    return args


def _cli_value(value: Any) -> str:
    """A Python value as a CLI string: strings as they are (jsonargparse takes a str/Literal value verbatim), the rest
    as JSON, which jsonargparse reads as YAML."""
    return value if isinstance(value, str) else json.dumps(_plain(value))


def load_recipe(
    name_or_path: str | Path | None = None, args: list[str] | None = None, validate_paths: bool = True, **overrides: Any
) -> Recipe:
    """Load a recipe: a file or shipped recipe name, then CLI-style `args` and/or keyword overrides by section.

    >>> cfg = load_recipe("tiny-llama-lora", train={"micro_batch_size": 8}, precision="bf16-mixed")
    >>> cfg = load_recipe("demo", args=["--train.max_steps", "20"])

    Raises ConfigError (exit code 2) listing every problem found.
    """
    from jsonargparse import ArgumentError

    source = None
    yaml_values: dict = {}
    argv: list[str] = []
    if name_or_path is not None:
        path = find_recipe(name_or_path)
        source = str(path)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise ConfigError(f"cannot read the YAML: {err}", source=source) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError("a recipe must be a mapping of keys (model:, train:, ...)", source=source)
        yaml_values = loaded or {}
        argv += ["--config", str(path)]
    extra = list(args or []) + _flatten_overrides(overrides)
    if extra:  # a problem may be in the file or in an override: name both places to look
        source = f"{source} with overrides" if source else "overrides"
    pairs = _parse_cli_overrides(extra)
    try:
        _check_keys(yaml_values, pairs)
    except ConfigError as err:
        raise ConfigError(err.problems, source=source) from None

    parser = build_parser()
    try:
        namespace = parser.parse_args(argv + extra)
    except ArgumentError as err:
        raise ConfigError(_tidy_jsonargparse_message(str(err)), source=source) from None
    values = _plain(namespace)
    values.pop("config", None)
    optimizer = _optimizer_from_parsed(values.pop("optimizer"))
    recipe = _from_dict(Recipe, values)
    recipe.optimizer = optimizer
    problems = validate(recipe, check_paths=validate_paths)
    if problems:
        raise ConfigError(problems, source=source)
    return recipe


def _tidy_jsonargparse_message(message: str) -> str:
    """jsonargparse says 'Parser key "train.epochs":\\n  Expected a <class 'int'>. Got value: five'; keep it on one
    line, as 'train.epochs: expected int, got five'."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    text = " ".join(lines)
    if text.startswith('Parser key "'):
        key, _, rest = text[len('Parser key "') :].partition('":')
        rest = rest.strip().replace("<class '", "").replace("'>", "")
        rest = rest.replace("Expected a int.", "expected an int,").replace("Expected a ", "expected a ")
        rest = rest.replace(". Got value:", ", got").replace("Got value:", "got")
        return f"{key}: {rest}"
    return text


# ----------------------------------------------------------------------------------------------------------------------
# Pass 3: meaning
# ----------------------------------------------------------------------------------------------------------------------

_CHECKPOINT_FILES = ("lit_model.pth", "model_config.yaml")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def validate(recipe: Recipe, check_paths: bool = True) -> list[str]:
    """Every contradiction in the recipe, as 'dotted.key: what is wrong and what to do'. Empty list: valid."""
    problems: list[str] = []
    t, d = recipe.train, recipe.data

    for key, value in [
        ("train.micro_batch_size", t.micro_batch_size),
        ("train.global_batch_size", t.global_batch_size),
        ("train.epochs", t.epochs),
        ("devices", recipe.devices),
        ("data.max_seq_length", d.max_seq_length),
        ("logging.interval", recipe.logging.interval),
    ]:
        if value < 1:
            problems.append(f"{key}: must be at least 1, got {value}")
    if t.micro_batch_size >= 1 and recipe.devices >= 1 and t.global_batch_size >= 1:
        per_step = t.micro_batch_size * recipe.devices
        if t.global_batch_size % per_step:
            lower = max(per_step, t.global_batch_size // per_step * per_step)
            problems.append(
                f"train.global_batch_size: {t.global_batch_size} is not a multiple of micro_batch_size x devices ="
                f" {t.micro_batch_size} x {recipe.devices} = {per_step}; try {lower} or {lower + per_step}"
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

    # Methods, quantization and precision
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
        if recipe.devices > 1:
            problems.append("method: qlora runs on one device in litft for now; set devices: 1")
    elif recipe.quantize is not None:
        problems.append(
            f"quantize: {recipe.quantize} applies to method qlora only (frozen 4-bit weights under LoRA adapters);"
            f" method is {recipe.method}. Set method: qlora, or quantize: null"
        )

    # Model files
    m = recipe.model
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
            problems.append(
                "model.checkpoint_dir: init pretrained needs a LitGPT checkpoint directory (get one with"
                " `litgpt download <repo_id>`), or set init: random to measure with random weights"
            )
        elif check_paths:
            problems += checkpoint_dir_problems(resolve_path(m.checkpoint_dir), "model.checkpoint_dir")
    if check_paths:
        tok_dir = resolve_path(m.tokenizer_dir or m.checkpoint_dir)
        if tok_dir is None:
            problems.append("model.tokenizer_dir: no tokenizer: set model.checkpoint_dir or model.tokenizer_dir")
        elif tok_dir.is_dir() and not any((tok_dir / f).is_file() for f in _TOKENIZER_FILES):
            key = "model.tokenizer_dir" if m.tokenizer_dir else "model.checkpoint_dir"
            problems.append(f"{key}: '{tok_dir}' has no tokenizer.json or tokenizer.model")
        elif not tok_dir.is_dir() and recipe.init == "random":
            key = "model.tokenizer_dir" if m.tokenizer_dir else "model.checkpoint_dir"
            problems.append(f"{key}: '{tok_dir}' is not a directory (it should hold the tokenizer files)")
        for key, value in [("data.path", d.path), ("data.val_path", d.val_path)]:
            if value is not None and not resolve_path(value).is_file():
                problems.append(f"{key}: no such file '{value}'")
    return problems


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


def checkpoint_dir_problems(path: Path, key: str) -> list[str]:
    """What a LitGPT checkpoint directory lacks; never a download (a typo must not turn into network traffic)."""
    if not path.is_dir():
        parent = path.parent
        close = difflib.get_close_matches(path.name, [p.name for p in parent.iterdir()], n=1) if parent.is_dir() else []
        hint = f" Did you mean '{parent / close[0]}'?" if close else ""
        return [
            f"{key}: '{path}' does not exist.{hint} Download weights with `litgpt download <repo_id>` (e.g."
            " TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T), or use init: random"
        ]
    missing = [f for f in _CHECKPOINT_FILES if not (path / f).is_file()]
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        missing.append("tokenizer.json or tokenizer.model")
    if missing:
        return [
            f"{key}: '{path}' lacks {', '.join(missing)}; a LitGPT checkpoint directory holds lit_model.pth,"
            " model_config.yaml and the tokenizer (`litgpt download` writes all three)"
        ]
    return []


# ----------------------------------------------------------------------------------------------------------------------
# Saving and identity
# ----------------------------------------------------------------------------------------------------------------------


def recipe_to_dict(recipe: Recipe) -> dict:
    return _plain(dataclasses.asdict(recipe))


def recipe_to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, default_flow_style=None)


def config_hash(recipe: Recipe) -> str:
    """A short hash of everything that shapes the training result (not where it is written or how it is shown)."""
    values = recipe_to_dict(recipe)
    for key in ("out_dir", "logging"):
        values.pop(key, None)
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:12]
