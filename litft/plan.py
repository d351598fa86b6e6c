"""Every speed decision of a run, made once.

A recipe's `train.*` and `data.*` switches say what the user allows. Whether each one takes effect also depends on
the device, the number of devices, the precision, the method and the architecture. :func:`resolve` decides all of
them here, and everything else reads the :class:`Plan` it returns: the loop (CUDA graphs, torch.compile, the
optimizer step), the layers (:func:`litft.layers.use_fast_layers` installs what ``plan.layers`` names), the memory
ledger's trace of a block, the run's speed line and result.json. A layer switch set to false runs LitGPT's own layer
(or autocast's, or torch's ops), for comparison. What each choice is worth, measured: docs/speed.md.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field

import torch

from litft.errors import ConfigError
from litft.precision import Precision
from litft.recipe import Recipe

# ---- the thresholds behind the decisions below; the measurements are in docs/speed.md ----

COMPILE_PAYS_OFF_S = {"full": 40.0, "lora": 350.0, "qlora": 170.0}
"""Seconds of work at the GPU's peak FLOP/s above which train.compile 'auto' compiles a run that replays CUDA graphs
(blocks without litft's Triton kernels), by method: half as much again as the break-even measured for TinyLlama on
an H100, a margin for models and GPUs not measured. Full fine-tune: the block compiles in ~9 s and saves ~17 ms per
~7,700-token step (break-even 25 s of work); LoRA: ~80 s for ~5 ms per ~3,900-token step (238 s); QLoRA: 114 s."""

TRITON_ATTENTION_HEAD_SIZES = (64,)
"""train.attention_kernel 'auto' takes litft's packed-attention kernels for grouped k/v heads of these sizes, where
they were measured faster than flash attention's varlen ops (TinyLlama: half the kernel time); OpenLLaMA's 128-wide
heads without groups ran 1.6% slower, so others keep flash attention."""

FUSED_LORA_MLP_MAX_INTERMEDIATE = 5632
"""A LoRA MLP at most this wide (intermediate size) runs as one FusedLoRAMLP: measured faster at TinyLlama's 5,632
(+3.4% real tok/s) and slower at OpenLLaMA-7B's 11,008 (-2.0%); widths in between keep the layers apart."""


@dataclass(frozen=True)
class LayerPlan:
    """Which of litft's layers replace LitGPT's, as :func:`litft.layers.use_fast_layers` installs them. Each field is
    a decision already made; a layer itself checks only what depends on the tensor in hand (a CUDA tensor, a training
    pass). The defaults are the layers any device runs; the Triton ones are off."""

    fast_lora: bool = True
    """train.fast_lora: LoRA layers as plain matmuls."""
    fused_rms_norm: bool = True
    """train.fused_rms_norm: torch's rms_norm."""
    fast_attention: bool = True
    """train.fast_attention, for an architecture attention_forward covers (Llama-style)."""
    lean_swiglu: bool = True
    """train.lean_swiglu: SwiGLU's silu recomputed in the backward pass."""
    lean_mixed_linear: bool = False
    """train.lean_mixed_linear under -mixed precision."""
    grad_into_weights: bool = False
    """train.grad_into_weights: one device, -true precision, eager blocks."""
    triton_kernels: bool = False
    """train.triton_kernels in eager CUDA blocks: SwiGLU, RoPE with the qkv split, LoRA's dropout."""
    triton_attention: bool = False
    """Packed rows' attention in litft's Triton kernels (train.attention_kernel)."""
    fused_lora: bool = False
    """Whole LoRA layers as FusedLoRA: triton_kernels and grad_into_weights with fast_lora, 16-bit compute."""
    fused_lora_mlp: bool = False
    """A LoRA MLP as one FusedLoRAMLP (fused_lora, all three layers adapted, at most FUSED_LORA_MLP_MAX_INTERMEDIATE
    wide)."""


@dataclass(frozen=True)
class Plan:
    """The speed decisions of one run (or of one planned run, for `litft estimate`)."""

    device: str
    """'cuda' or 'cpu'."""
    world_size: int
    precision: Precision
    method: str
    strategy: str
    """strategy.name as it runs: 'single' (one device), 'ddp', 'fsdp' or 'deepspeed'."""
    reduces_gradients: bool
    """DDP without torch's DDP wrapper: litft averages the gradients itself, once per optimizer step, block by block
    as the last micro-batch's backward pass finishes them (litft.train.reduce), so that CUDA graphs, gradients
    written by the matmul and the fused step all run as on one device."""

    # ---- data ----
    packing: bool
    """data.packing: a micro-batch's samples in one row, attention within each sample."""
    pack_steps: bool
    """data.pack_steps in effect (it needs packing): micro-batches filled by positions."""
    fit_steps: bool
    """data.fit_steps in effect (it needs pack_steps)."""
    step_capacity: int | None
    """Positions per micro-batch under pack_steps (data.pack_capacity, else micro_batch_size x max_seq_length)."""
    loader_batch_size: int
    """Samples per training-loader item: micro_batch_size, or a whole step's per device under pack_steps."""

    # ---- the loop ----
    cuda_graphs: bool
    compile: bool
    compile_why: str
    """Why train.compile 'auto' decided as it did ('' when the recipe decided)."""
    activation_checkpointing: bool
    loss_chunk: int
    triton_loss: bool
    """The loss's cross-entropy as a Triton kernel (outside the blocks: compiled runs too)."""
    fused_residual_norms: bool
    """Residual adds fused into the RMSNorm after them (Triton, eager blocks of LitGPT's Block, no checkpointing)."""
    stack_fc_weights: bool
    """LoRA MLPs' frozen fc_1 and fc_2 stacked into one weight (FusedLoRAMLP over plain nn.Linear bases)."""
    layers: LayerPlan

    # ---- the optimizer step ----
    fused_step: bool
    """torch's fused AdamW/Adam/SGD kernel (on CUDA unless the recipe chose fused or foreach itself)."""
    step_scales: bool
    """Clipping's scale and a non-finite step's skip go into the fused step (grad_scale, found_inf), so each step's
    loss is read a step late: one device or whole parameters on every rank, no fp16 loss scaler."""
    triton_adamw: bool
    """AdamW's fused step as litft.kernels.AdamW."""

    notes: tuple[str, ...] = field(default=())
    """Switches the recipe turned on that cannot take effect here, and why (printed by the run)."""

    def speed_line(self) -> str:
        """The run's `speed:` line: what runs, in the recipe's words."""
        on = {True: "on", False: "off"}
        lay = self.layers
        parts = [f"packing {on[self.packing]}", f"pack_steps {on[self.pack_steps]}",
                 f"torch.compile {on[self.compile]}" + (f" ({self.compile_why})" if self.compile_why else ""),
                 f"CUDA graphs {on[self.cuda_graphs]}", f"loss chunk {self.loss_chunk or 'off'}",
                 f"activation checkpointing {on[self.activation_checkpointing]}",
                 f"RMSNorm {'fused' if lay.fused_rms_norm else 'LitGPT'}",
                 f"attention {'fast' if lay.fast_attention else 'LitGPT'}",
                 f"SwiGLU {'lean' if lay.lean_swiglu else 'LitGPT'}"]
        if self.precision.mixed:
            parts.append(f"-mixed weights {'recast in backward' if lay.lean_mixed_linear else 'kept by autocast'}")
        if lay.grad_into_weights:
            parts.append("weight gradients added by the matmul")
        if lay.triton_kernels:
            parts.append("SwiGLU, RoPE and LoRA dropout in Triton kernels")
        if lay.triton_attention:
            parts.append("packed attention in Triton kernels")
        if self.fused_residual_norms:
            parts.append("residual adds fused into the norms")
        if self.triton_loss:
            parts.append("the loss in a Triton kernel")
        if self.method != "full":
            parts.append(f"LoRA layers {'fast' if lay.fast_lora else 'LitGPT'}")
        if self.reduces_gradients:
            parts.append(f"DDP over {self.world_size} ranks, gradients averaged by litft block by block in each step's"
                         " last backward pass")
        elif self.strategy in ("fsdp", "deepspeed"):
            parts.append(f"{self.strategy} over {self.world_size} rank(s)")
        return ", ".join(parts)

    def loss_read(self) -> str:
        return "a step late" if self.step_scales else "before each update"

    def triton_summary(self) -> dict[str, bool]:
        """result.json's triton_kernels: which Triton kernels the run used."""
        return {"swiglu_rope": self.layers.triton_kernels, "loss": self.triton_loss,
                "residual_norms": self.fused_residual_norms, "packed_attention": self.layers.triton_attention,
                "adamw": self.triton_adamw}

    def as_dict(self) -> dict:
        values = dataclasses.asdict(self)
        values["precision"] = self.precision.name
        return values


# ----------------------------------------------------------------------------------------------------------------------
# Deciding
# ----------------------------------------------------------------------------------------------------------------------


AMPERE = (8, 0)
"""The compute capability (A100) from which flash attention's kernels (litft's packed rows) run; litft's Triton
kernels are measured on 9.0 (H100) only and kept to 8.0 and above."""


def resolve(recipe: Recipe, config, device: str, world_size: int, *, device_name: str | None = None,
            data_stats=None, triton_available: bool | None = None, capability: tuple[int, int] | None = None) -> Plan:
    """Decide every speed switch of ``recipe`` for ``config`` (its litgpt Config) on ``world_size`` devices of type
    ``device``. A run passes what it knows: the GPU's name and its training set's TokenStats (train.compile 'auto'
    weighs the tokens its steps will train on against the compile time). `litft estimate` plans a CUDA run without
    them: 'auto' then plans an eager one (an eager block keeps more activations, so the plan does not promise a fit an eager run would
    miss). ``triton_available``: whether Triton can run here (default: imported); a plan for another machine says
    True."""
    from litft import kernels

    recipe = as_litgpt_runs(recipe) if recipe.train.speed == "litgpt" else recipe
    t, d = recipe.train, recipe.data
    precision = Precision(recipe.precision)
    cuda = device == "cuda"
    notes: list[str] = []
    older_gpu = cuda and capability is not None and tuple(capability) < AMPERE
    if older_gpu:  # a V100 (7.0): padded rows (torch's attention kernels) and torch ops instead of litft's kernels
        gpu = f"this GPU ({device_name or 'compute capability'} {capability[0]}.{capability[1]})"
        if d.packing:
            notes.append(f"data.packing off: packed rows need flash attention (compute capability 8.0+), and {gpu}"
                         " has not; samples are padded instead")
            d = dataclasses.replace(d, packing=False)
        if t.triton_kernels:
            notes.append(f"train.triton_kernels off on {gpu}: litft's Triton kernels run from compute capability"
                         " 8.0")
            t = dataclasses.replace(t, triton_kernels=False)
        recipe = dataclasses.replace(recipe, data=d, train=t)
    if triton_available is None:
        triton_available = kernels.triton is not None
    if t.triton_kernels and cuda and not triton_available:
        notes.append("train.triton_kernels is on but Triton is not installed: torch ops run instead")

    strategy = "single" if world_size == 1 and recipe.strategy.name in ("auto", "ddp") else (
        "ddp" if recipe.strategy.name == "auto" else recipe.strategy.name)
    sharded = strategy in ("fsdp", "deepspeed")
    graphs = _cuda_graphs(t.cuda_graphs, device, strategy)
    compiled, compile_why = _compile(recipe, config, device, world_size, graphs, device_name, data_stats,
                                     triton_available, strategy)
    triton = t.triton_kernels and cuda and triton_available  # the loss's and AdamW's kernels: compiled runs too
    triton_layers = triton and not compiled  # compiled blocks fuse SwiGLU and RoPE themselves
    fast_attention = t.fast_attention and fast_attention_fits(config)
    grad_into_weights = t.grad_into_weights and not precision.mixed and not sharded and not compiled
    fused_lora = (triton_layers and grad_into_weights and t.fast_lora and recipe.method in ("lora", "qlora")
                  and precision.half_compute)
    fused_lora_mlp = (fused_lora and "mlp" in recipe.lora.targets
                      and config.mlp_class_name == "LLaMAMLP"
                      and config.intermediate_size <= FUSED_LORA_MLP_MAX_INTERMEDIATE)
    layers = LayerPlan(
        fast_lora=t.fast_lora, fused_rms_norm=t.fused_rms_norm, fast_attention=fast_attention,
        lean_swiglu=t.lean_swiglu, lean_mixed_linear=t.lean_mixed_linear and precision.mixed,
        grad_into_weights=grad_into_weights, triton_kernels=triton_layers,
        triton_attention=(triton_layers and d.packing and fast_attention and precision.half_compute
                          and triton_attention_fits(config.head_size, config.n_head, config.n_query_groups,
                                                    t.attention_kernel)),
        fused_lora=fused_lora, fused_lora_mlp=fused_lora_mlp and t.lean_swiglu,
    )
    # FSDP and ZeRO gather or reduce with the other ranks in every micro-batch, so every rank must run as many
    # micro-batches per step as the others; data.pack_steps gives each rank as many as its own samples fill
    pack_steps = d.pack_steps and d.packing and not sharded
    if d.pack_steps and d.packing and sharded:
        notes.append(f"data.pack_steps off under {strategy}: each rank runs grad_accum micro-batches of"
                     " micro_batch_size samples, as its collectives need the same number on every rank")
    step_capacity = (d.pack_capacity or t.micro_batch_size * d.max_seq_length) if pack_steps else None
    fused_step, step_scales, triton_adamw = _optimizer_step(recipe, precision, cuda, triton, sharded)
    if sharded and t.cuda_graphs == "auto" and cuda:
        notes.append(f"CUDA graphs off under {strategy}: its gathers and reductions run from hooks on the host,"
                     " between the kernels a graph would replay")
    return Plan(
        device=device, world_size=world_size, precision=precision, method=recipe.method, strategy=strategy,
        reduces_gradients=strategy == "ddp",
        packing=d.packing, pack_steps=pack_steps, fit_steps=pack_steps and d.fit_steps, step_capacity=step_capacity,
        loader_batch_size=t.micro_batch_size * (recipe.grad_accum if pack_steps else 1),
        cuda_graphs=graphs, compile=compiled, compile_why=compile_why,
        activation_checkpointing=t.activation_checkpointing, loss_chunk=t.loss_chunk, triton_loss=triton,
        fused_residual_norms=(triton_layers and t.fused_rms_norm and not t.activation_checkpointing
                              and not sharded and residual_norms_fuse(config)),  # FSDP/ZeRO-3 wrap whole blocks
        stack_fc_weights=layers.fused_lora_mlp and recipe.method == "lora",
        layers=layers, fused_step=fused_step, step_scales=step_scales, triton_adamw=triton_adamw,
        notes=tuple(notes),
    )


def as_litgpt_runs(recipe: Recipe) -> Recipe:
    """train.speed 'litgpt': the recipe with every speed switch off (LitGPT's layers, padded rows, eager, whole
    logits) and torch's default optimizer step (foreach, not fused), as LitGPT's finetune scripts run."""
    train = dataclasses.replace(
        recipe.train, compile="never", cuda_graphs="never", fast_lora=False, fused_rms_norm=False,
        fast_attention=False, lean_swiglu=False, lean_mixed_linear=False, grad_into_weights=False,
        triton_kernels=False, loss_chunk=0)
    data = dataclasses.replace(recipe.data, packing=False, pack_steps=False, fit_steps=False, pack_capacity=None)
    init_args = dict(recipe.optimizer.init_args)
    if init_args.get("fused") is None and init_args.get("foreach") is None:
        init_args["fused"] = False  # torch's own choice (foreach on CUDA), not litft's fused=True
    optimizer = dataclasses.replace(recipe.optimizer, init_args=init_args)
    return dataclasses.replace(recipe, train=train, data=data, optimizer=optimizer)


def plan_for_estimate(recipe: Recipe, config, compiled: bool | None = None) -> Plan:
    """The plan `litft estimate` and the ledger assume: recipe.devices CUDA devices with Triton, compiled blocks only
    for train.compile 'always' (or as a run decided, when it passes ``compiled``)."""
    plan = resolve(recipe, config, "cuda", recipe.devices, triton_available=True)
    if compiled is None or compiled == plan.compile:
        return plan
    return resolve(dataclasses.replace(recipe, train=dataclasses.replace(
        recipe.train, compile="always" if compiled else "never")), config, "cuda", recipe.devices,
        triton_available=True)


def _cuda_graphs(mode: str, device: str, strategy: str) -> bool:
    """train.cuda_graphs: 'auto' on CUDA, one device or DDP (litft's gradient reduction is captured with the
    micro-step); not under FSDP or DeepSpeed, whose gathers run from host-side hooks."""
    possible = device == "cuda" and strategy in ("single", "ddp")
    if mode == "always" and not possible:
        raise ConfigError(f"train.cuda_graphs: 'always' needs CUDA and one device or DDP (this run: {strategy} on"
                          f" {device}); use 'auto' or 'never'")
    return possible and mode != "never"


def _compile(recipe: Recipe, config, device: str, world_size: int, graphs: bool, device_name: str | None,
             data_stats, triton_available: bool, strategy: str) -> tuple[bool, str]:
    """train.compile, and why when 'auto' decided. 'auto': never on the CPU (inductor's C++ compile costs minutes for
    little gain); on CUDA without CUDA graphs, compiled (compiling also cuts the host's launch overhead); with CUDA
    graphs, eager where litft's Triton kernels run (eager blocks with them measured faster than compiled ones),
    else compiled when the planned work repays the compile time (COMPILE_PAYS_OFF_S)."""
    mode = recipe.train.compile
    if mode != "auto":
        return mode == "always", ""
    if device != "cuda" or data_stats is None:  # a plan without a run: as `estimate` assumes, eager
        return False, ""
    if strategy == "deepspeed":
        return False, "auto: DeepSpeed's engine runs eager blocks"
    if strategy == "fsdp":  # the eager FSDP path is the one measured to run (benchmarks/results/multi-gpu-2xh200)
        return False, "auto: eager blocks under FSDP until compiled ones are measured; train.compile always tries"
    if not graphs:
        return True, ""
    if recipe.train.triton_kernels and triton_available:
        return False, "auto: eager blocks with litft's Triton kernels run faster than compiled ones"
    from litft import metrics

    peak = metrics.peak_flops(device_name or "", Precision(recipe.precision).peak_flops_key())
    if peak is None:
        return True, "no peak FLOP/s known for this GPU"
    n = weights_per_token(config)
    batches_per_epoch = data_stats.samples // world_size // recipe.train.micro_batch_size
    planned_tokens = planned_steps(recipe, batches_per_epoch) * recipe.train.global_batch_size * data_stats.mean_length
    seconds = planned_tokens * (6 * n if recipe.method == "full" else 4 * n) / peak  # metrics.FlopModel's rule
    threshold = COMPILE_PAYS_OFF_S[recipe.method]
    verdict = "pays off" if seconds > threshold else "would not pay off"
    return seconds > threshold, (f"auto: {seconds:,.0f} s of work at peak FLOP/s, compiling {verdict} above"
                                 f" {threshold:.0f} s for {recipe.method}")


def planned_steps(recipe: Recipe, batches_per_epoch: int) -> int:
    """Optimizer steps of the run: all epochs' micro-batches in steps of grad_accum, capped by train.max_steps."""
    steps = recipe.train.epochs * batches_per_epoch // recipe.grad_accum
    if steps < 1:
        raise ConfigError(
            f"train.global_batch_size: one optimizer step needs {recipe.train.global_batch_size} samples, but the"
            f" training set gives each of {recipe.devices} device(s) only {batches_per_epoch} micro-batch(es) of"
            f" {recipe.train.micro_batch_size} per epoch; lower global_batch_size or use more data"
        )
    if recipe.train.max_steps is not None:
        steps = min(steps, recipe.train.max_steps)
    return steps


def weights_per_token(config) -> int:
    """Weights a token passes through in a Llama-style model: attention, the MLP's 3 matrices, the output head."""
    attention = config.n_embd * (config.n_head + 2 * config.n_query_groups) * config.head_size
    attention += config.n_head * config.head_size * config.n_embd
    mlp = 3 * config.n_embd * config.intermediate_size
    return config.n_layer * (attention + mlp) + config.padded_vocab_size * config.n_embd


def _optimizer_step(recipe: Recipe, precision: Precision, cuda: bool, triton: bool,
                    sharded: bool) -> tuple[bool, bool, bool]:
    """(fused_step, step_scales, triton_adamw). torch's AdamW, Adam and SGD run fused on CUDA unless the recipe set
    fused or foreach itself (a None is no choice: jsonargparse fills in the class defaults, None included). A fused
    torch step takes grad_scale and found_inf on the device where each rank holds whole parameters (one device,
    DDP) and no fp16 loss scaler owns grad_scale."""
    module_name, _, class_name = recipe.optimizer.class_path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    args = recipe.optimizer.init_args
    fusable = cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
    fused = bool(args.get("fused")) or (fusable and cuda and args.get("fused") is None and args.get("foreach") is None)
    whole_parameters = not sharded and not precision.loss_scaled
    step_scales = fused and fusable and whole_parameters  # their fused kernels take grad_scale and found_inf
    triton_adamw = triton and whole_parameters and cls is torch.optim.AdamW and fused and not args.get("amsgrad")
    return fused, step_scales, triton_adamw


# ----------------------------------------------------------------------------------------------------------------------
# What the layers cover
# ----------------------------------------------------------------------------------------------------------------------


def fast_attention_fits(config) -> bool:
    """attention_forward covers Llama-style attention: RoPE over the whole head, no q/k norms, no interleaved RoPE."""
    return (config.rope_n_elem == config.head_size and not config.norm_qk
            and not getattr(config, "rope_interleave", False))


def triton_attention_fits(head_size: int, heads: int, groups: int, attention_kernel: str = "auto") -> bool:
    """Whether train.attention_kernel picks litft's packed-attention kernels for this shape: 'auto' where they were
    measured faster (grouped heads of a size in TRITON_ATTENTION_HEAD_SIZES); 'triton' wherever the kernels take the
    shape; 'flash' nowhere."""
    if attention_kernel == "auto":
        return head_size in TRITON_ATTENTION_HEAD_SIZES and groups < heads
    from litft.kernels import varlen_attention

    return attention_kernel == "triton" and varlen_attention.supports(heads, groups, head_size)


def residual_norms_fuse(config) -> bool:
    """Whether CausalLM can run the blocks as AddRMSNorm + attention + AddRMSNorm + MLP: sequential residuals,
    RMSNorm before attention and the MLP, no post-norms, and LitGPT's own attention."""
    return (config.norm_class_name == "RMSNorm" and not config.parallel_residual and config.norm_1 and config.norm_2
            and not config.post_attention_norm and not config.post_mlp_norm
            and not getattr(config, "latent_attention", None))
