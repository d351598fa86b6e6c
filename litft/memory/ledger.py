"""The predicted memory ledger of a recipe, per GPU: what `litft estimate` prints and every run writes beside its
measured peak.

Model state is counted from the parameters of the real architecture, built on the meta device (no memory, exact
shapes): bytes per parameter by role and precision.

                          weights   compute copies   gradients   optimizer state (AdamW)
    full, bf16-true          2            -              2              2 x 2
    full, bf16-mixed         4 (fp32)     2 (autocast)   4              2 x 4
    LoRA base, bf16-true     2            -              -              -
    LoRA base, bf16-mixed    4            2              -              -
    QLoRA base (nf4)         0.5 + scales -              -              -

Activations are not guessed: one transformer block of the same architecture, method and dtype runs on the CPU for a
few tokens under `torch.autograd.graph.saved_tensors_hooks`, and every tensor autograd keeps for the backward pass
(parameters excluded, shared storage counted once) is summed. That gives bytes per token per layer, exact for what
the block saves; attention is flash/memory-efficient SDPA, which saves O(T) not O(T^2). With activation
checkpointing a block keeps only its input, and one block's activations are live again while it is recomputed.

The peak is taken when one micro-batch's activations are all alive at the start of the backward pass, together
with the weights, the optimizer state, the gradients (present while accumulating) and the loss computation's
buffers (logits and their gradient). torch's caching allocator reserves more than it allocates; the measured
ratio of peak reserved to peak allocated is applied as `allocator_overhead`. The CUDA context (not part of torch's
reserved figure, but part of the GPU's memory) is listed apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from litft import units
from litft.memory.trace import activation_bytes_per_token_layer
from litft.metrics import GIB
from litft.plan import Plan, plan_for_estimate
from litft.recipe import Recipe

# Reserved / allocated at the peak: 1.06 to 1.19 on the H100 ledger runs (TinyLlama full bf16-true 1.08, bf16-mixed
# 1.06, OpenLLaMA-7B LoRA 1.19, QLoRA 1.11); the middle of that range.
ALLOCATOR_OVERHEAD = 1.10
# QLoRA's, with CUDA graphs and the Triton kernels: 1.20 to 1.25 on the H100 (TinyLlama 1.21-1.25, OpenLLaMA-7B 1.20).
# bitsandbytes' dequantized weight copies, one per 4-bit matmul and of every layer's size, are freed and made again
# inside each captured graph's memory pool, which keeps more cached blocks than the plain runs do.
ALLOCATOR_OVERHEAD_QLORA = 1.20
# CUDA context + cuBLAS/cuDNN workspaces: on the GPU but outside torch's reserved figure (measured: device used
# minus torch reserved on an otherwise idle H100).
CUDA_CONTEXT_GIB = 0.5


@dataclass
class Part:
    name: str
    gib: float
    detail: str


@dataclass
class MemoryEstimate:
    """A ledger of predicted GPU memory (GiB, per GPU) and the host memory the run needs."""

    parts: list[Part]
    allocated_gib: float
    """Predicted peak allocated by torch."""
    total_gib: float
    """Predicted peak reserved by torch's allocator (allocated x allocator overhead): compare with the measured peak
    reserved memory."""
    device_gib: float
    """total_gib plus the CUDA context: what the GPU must have."""
    host_gib: float
    activations_per_token_layer: int
    """Bytes one token keeps per transformer block (the traced figure)."""
    tokens: int
    """Tokens per micro-batch the activations were sized for (micro_batch_size x max_seq_length, or
    data.pack_capacity)."""
    notes: list[str] = field(default_factory=list)
    allocator_overhead: float = ALLOCATOR_OVERHEAD
    """The reserved / allocated factor applied (ALLOCATOR_OVERHEAD, or ALLOCATOR_OVERHEAD_QLORA)."""

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["parts"] = {p.name: {"gib": p.gib, "detail": p.detail} for p in self.parts}
        return out

    def lines(self) -> list[str]:
        """The ledger, a part a line, then the totals: peak allocated, peak reserved, and on the device."""
        rows = [(p.name, p.gib, p.detail) for p in self.parts] + [
            ("= peak allocated", self.allocated_gib, sized_for(self.tokens)),
            ("= peak reserved", self.total_gib, f"x {self.allocator_overhead:.2f} allocator overhead"),
            ("= on the device", self.device_gib, f"with the CUDA context (~{units.gib(CUDA_CONTEXT_GIB)})"),
        ]
        width = max(len(name) for name, _, _ in rows)
        return [f"  {name:<{width}}  {units.gib(gib):>10}   {detail}".rstrip() for name, gib, detail in rows]


def sized_for(tokens: int) -> str:
    """What a prediction is sized for: the positions of one micro-batch (a run's own largest, or the recipe's bound
    in `litft estimate` and `litft ls`)."""
    return f"for micro-batches of {units.count(tokens)} positions"


# ----------------------------------------------------------------------------------------------------------------------
# Model state
# ----------------------------------------------------------------------------------------------------------------------


def _meta_model(recipe: Recipe, config):
    """The recipe's model on the meta device: exact parameter shapes and trainable flags, no memory."""
    if recipe.method in ("lora", "qlora"):
        from litgpt.lora import GPT, mark_only_lora_as_trainable
    else:
        from litgpt.model import GPT

        mark_only_lora_as_trainable = None
    with torch.device("meta"):
        model = GPT(config)
    if mark_only_lora_as_trainable is not None:
        mark_only_lora_as_trainable(model)
    return model


def _quantized_bytes_per_param(quantize: str) -> float:
    """4-bit weights: 0.5 byte + one fp32 absmax per block of 64 (4/64 B); double quantization stores the absmax in
    8 bits (1/64 B) plus one fp32 per 256 absmax blocks (bitsandbytes' defaults)."""
    if quantize.endswith("-dq"):
        return 0.5 + 1 / 64 + 4 / (64 * 256)
    return 0.5 + 4 / 64


def _optimizer_state_bytes(recipe: Recipe, trainable: list[torch.Tensor], param_bytes: int) -> tuple[float, str]:
    """Bytes of optimizer state for these trainable parameters, and a description."""
    path = recipe.optimizer.class_path
    args = recipe.optimizer.init_args
    name = path.rpartition(".")[2]
    n = sum(p.numel() for p in trainable)
    if path.startswith("bitsandbytes."):
        eight_bit = "8bit" in name
        states = 1 if "Momentum" in name or name.startswith(("SGD", "Lion", "RMSprop")) else 2
        if eight_bit:
            # blockwise 8-bit state (+ an fp32 absmax per 256 values) for tensors of >= min_8bit_size elements;
            # smaller tensors keep 32-bit state
            small = int(args.get("min_8bit_size", 4096))
            big = sum(p.numel() for p in trainable if p.numel() >= small)
            total = states * (big * (1 + 4 / 256) + (n - big) * 4)
            return total, f"{states} x 8-bit blockwise state ({name})"
        paged = " (paged: may move to host memory under pressure)" if "Paged" in name else ""
        return states * n * 4, f"{states} x fp32 state ({name}){paged}"
    if name in ("AdamW", "Adam", "NAdam", "RAdam", "Adamax"):
        extra = 1 if args.get("amsgrad") else 0
        return (2 + extra) * n * param_bytes, f"{2 + extra} moments x {param_bytes} B (AdamW keeps state in the param dtype)"
    if name == "SGD":
        if float(args.get("momentum", 0) or 0) > 0:
            return n * param_bytes, f"momentum buffer x {param_bytes} B"
        return 0.0, "none (SGD without momentum keeps no state)"
    if name in ("Adagrad", "RMSprop", "Adadelta"):
        return n * param_bytes * (2 if name == "Adadelta" else 1), f"state of {name}"
    return 2 * n * param_bytes, f"unknown optimizer {name}: assumed 2 states x {param_bytes} B"


# ----------------------------------------------------------------------------------------------------------------------
# The ledger
# ----------------------------------------------------------------------------------------------------------------------


SHARDING = ("none", "zero2", "zero3")
OFFLOAD = ("none", "optimizer", "optimizer+params")


def strategy_sharding(recipe: Recipe) -> tuple[str, str]:
    """The ledger's (sharding, offload) for the recipe's strategy: FSDP FULL_SHARD and HYBRID_SHARD (within a node)
    shard like ZeRO-3, SHARD_GRAD_OP like ZeRO-2, and its cpu_offload keeps everything sharded on the host; DeepSpeed
    by its stage and offload options; one device and DDP replicate."""
    s = recipe.strategy
    if s.name == "fsdp":
        sharding = {"FULL_SHARD": "zero3", "HYBRID_SHARD": "zero3", "SHARD_GRAD_OP": "zero2"}.get(s.fsdp.sharding,
                                                                                                 "none")
        return sharding, "optimizer+params" if s.fsdp.cpu_offload and sharding == "zero3" else "none"
    if s.name == "deepspeed":
        d = s.deepspeed
        offload = "optimizer+params" if d.offload_parameters else "optimizer" if d.offload_optimizer else "none"
        return f"zero{d.stage}", offload
    return "none", "none"


def estimate_memory(
    recipe: Recipe, config=None, tokens: int | None = None, compiled: bool | None = None, cached_only: bool = False,
    sharding: str | None = None, offload: str | None = None, plan: Plan | None = None,
) -> MemoryEstimate | None:
    """Predict the peak GPU memory of a recipe, per GPU, part by part.

    `tokens`: positions in the largest micro-batch (a run passes what its data can form); by default the recipe's
    bound, micro_batch_size x max_seq_length (data.pack_capacity under data.pack_steps). `plan`: the run's plan; by
    default the one `litft estimate` assumes (litft.plan.plan_for_estimate; `compiled` overrides its compile
    decision). `cached_only`: return None rather than trace the activations (used by `litft ls`, which must stay
    instant). `sharding` and `offload`: by default the recipe's strategy's (strategy_sharding), over the run's
    ranks (see shard_model_state)."""
    from litft.model import model_config

    recipe_sharding, recipe_offload = strategy_sharding(recipe)
    sharding = recipe_sharding if sharding is None else sharding
    offload = recipe_offload if offload is None else offload
    config = config or model_config(recipe)
    plan = plan or plan_for_estimate(recipe, config, compiled)
    per_token_layer = activation_bytes_per_token_layer(recipe, config, plan, cached_only)
    if per_token_layer is None:  # cached_only and not traced yet
        return None
    model = _meta_model(recipe, config)
    parts, host = _model_state(recipe, plan, model, sharding)
    host_offloaded = 0.0
    block_params = sum(p.numel() for p in model.transformer.h[0].parameters())
    if recipe.strategy.name == "deepspeed" and sharding == recipe_sharding and offload == recipe_offload:
        parts, host_offloaded = deepspeed_model_state(recipe, model, block_params, plan.precision.compute_bytes)
    elif sharding != "none" or offload != "none":
        ranks = recipe.devices if recipe.strategy.fsdp.sharding == "HYBRID_SHARD" else recipe.world_size
        host_offloaded = shard_model_state(parts, ranks, sharding, offload, block_params,
                                           plan.precision.compute_bytes, plan.precision.mixed)
        host_offloaded /= max(1, recipe.world_size // ranks)  # each node holds its own ranks' part
    tokens = tokens or plan.step_capacity or recipe.train.micro_batch_size * recipe.data.max_seq_length
    parts.append(_activations(plan, config, tokens, per_token_layer))
    parts.append(_loss(plan, config, tokens))
    if recipe.method == "qlora":
        # bitsandbytes multiplies by a 4-bit weight through a dequantized copy in the compute dtype, made for each
        # matmul (its backward pass's input gradient, and FusedLoRA's): one layer's copy is alive at a time, at the
        # peak the output layer's, whose backward pass runs first
        largest = max(_quantized_sizes(model))
        compute_bytes = plan.precision.compute_bytes
        parts.append(Part("dequantized weight", largest * compute_bytes / GIB,
                          f"one 4-bit layer's weight in {compute_bytes} B for its matmul ({units.params(largest)})"))

    allocated = sum(p.gib for p in parts)
    overhead = ALLOCATOR_OVERHEAD_QLORA if recipe.method == "qlora" else ALLOCATOR_OVERHEAD
    total = allocated * overhead
    notes = []
    if recipe.grad_accum == 1 and recipe.method == "full":
        notes.append("accumulation 1: gradients and a micro-batch's activations overlap only in part; the ledger"
                     " counts both in full (an upper bound)")
    if host_offloaded:
        host += host_offloaded
        notes.append(f"offload: {units.gib(host_offloaded)} of host RAM for what all {recipe.devices} ranks of a node"
                     " move there (pinned: it must be free RAM, not swap)")
    return MemoryEstimate(parts=parts, allocated_gib=allocated, total_gib=total, device_gib=total + CUDA_CONTEXT_GIB,
                          host_gib=host, activations_per_token_layer=per_token_layer, tokens=tokens, notes=notes,
                          allocator_overhead=overhead)


DEEPSPEED_BUCKET_ELEMENTS = 2 * 200_000_000
"""Lightning's DeepSpeedStrategy defaults: reduce_bucket_size and allgather_bucket_size, 2e8 elements each."""


def deepspeed_model_state(recipe: Recipe, model, block_params: int, compute_bytes: int) -> tuple[list[Part], float]:
    """The model state of a DeepSpeed ZeRO run, per GPU, and the host RAM its offload pins (GiB, one node).

    DeepSpeed trains 16-bit weights against fp32 master weights whatever the precision's '-true' or '-mixed': its
    optimizer partition holds fp32 master weights, Adam's two fp32 moments and an fp32 gradient (16 B per trainable
    parameter, over the ranks); the GPU keeps the 16-bit weights (ZeRO-3: a partition plus two gathered blocks),
    the 16-bit gradient partition, and the reduce and all-gather buckets. offload_optimizer moves the 16 B to host
    RAM; offload_parameters moves the 16-bit weight partitions too."""
    d, n = recipe.strategy.deepspeed, recipe.world_size
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    cb = compute_bytes
    if d.stage == 3 and d.offload_parameters:
        weights = 2 * block_params * cb
        weights_detail = f"on the host; 2 blocks gathered ({units.params(block_params)} each x {cb} B)"
    elif d.stage == 3:
        weights = total * cb / n + 2 * block_params * cb
        weights_detail = f"{units.params(total)} x {cb} B / {n} ranks + 2 blocks gathered"
    else:
        weights = total * cb
        weights_detail = f"{units.params(total)} x {cb} B (ZeRO-2 keeps whole 16-bit weights)"
    gradients = trainable * cb / n + DEEPSPEED_BUCKET_ELEMENTS * cb
    optimizer = trainable * 16 / n
    parts = [Part("weights", weights / GIB, weights_detail),
             Part("gradients", gradients / GIB, f"{units.params(trainable)} x {cb} B / {n} ranks + DeepSpeed's reduce"
                  " and all-gather buckets (2 x 2e8 elements)")]
    offloaded = 0.0  # GiB pinned in this node's host RAM: its ranks' share of what all ranks offload
    if d.offload_optimizer:
        offloaded += trainable * 16 / GIB / recipe.num_nodes
        parts.append(Part("optimizer state", 0.0, "on the host: fp32 master weights, 2 Adam moments and fp32"
                          f" gradients ({units.gib(trainable * 16 / GIB)} for all ranks)"))
    else:
        parts.append(Part("optimizer state", optimizer / GIB, "fp32 master weights, 2 Adam moments, fp32 gradients:"
                          f" {units.params(trainable)} x 16 B / {n} ranks"))
    if d.stage == 3 and d.offload_parameters:
        offloaded += total * cb / GIB / recipe.num_nodes
    return parts, offloaded


def _quantized_sizes(model) -> list[int]:
    """Elements of each 4-bit layer's weight under QLoRA: LoRA's base linears and the output layer."""
    return [p.numel() for n, p in model.named_parameters()
            if not p.requires_grad and (n.endswith("linear.weight") or n.endswith("lm_head.weight"))]


def _model_state(recipe: Recipe, plan: Plan, model, sharding: str) -> tuple[list[Part], float]:
    """Weights (and -mixed's 16-bit copies), gradients and optimizer state; and the host RAM loading needs (GiB)."""
    precision = plan.precision
    pbytes, compute_bytes = precision.param_bytes, precision.compute_bytes
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    parts: list[Part] = []
    if recipe.method == "qlora":
        linear_frozen = sum(_quantized_sizes(model))
        other_frozen = n_frozen - linear_frozen
        q = _quantized_bytes_per_param(recipe.quantize)
        weights = linear_frozen * q + other_frozen * pbytes + n_trainable * pbytes
        detail = (f"{units.params(linear_frozen)} linear weights x {q:.3f} B ({recipe.quantize}) +"
                  f" {units.params(other_frozen + n_trainable)} others x {pbytes} B")
    else:
        weights = (n_trainable + n_frozen) * pbytes
        detail = f"{units.params(n_trainable + n_frozen)} params x {pbytes} B ({precision.param_dtype})"
        detail = detail.replace("torch.", "") + (": the fp32 master weights of -mixed" if precision.mixed else "")
    parts.append(Part("weights", weights / GIB, detail))
    if precision.mixed:
        matrices = [p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n]
        if plan.layers.lean_mixed_linear and sharding == "none":
            # one layer's cast alive at a time (the largest: usually the output layer). A sharded plan is for
            # FSDP/DeepSpeed, whose own mixed precision keeps the casts (see shard_model_state)
            parts.append(Part("16-bit weight copies", max(matrices) * compute_bytes / GIB,
                              "one layer's cast at a time (train.lean_mixed_linear recasts in the backward pass)"))
        else:  # autocast casts each weight to 16 bits for its matmul and keeps the cast for the backward pass
            parts.append(Part("16-bit weight copies", sum(matrices) * compute_bytes / GIB,
                              "autocast's per-step casts, kept for the backward pass"))
    parts.append(Part("gradients", n_trainable * pbytes / GIB, f"{units.params(n_trainable)} trainable x {pbytes} B"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt_bytes, opt_detail = _optimizer_state_bytes(recipe, trainable, pbytes)
    parts.append(Part("optimizer state", opt_bytes / GIB, opt_detail))
    host = (n_trainable + n_frozen) * pbytes / GIB  # loading a checkpoint memory-maps it; about one copy at most
    return parts, host


def _activations(plan: Plan, config, tokens: int, per_token_layer: int) -> Part:
    """What a micro-batch of ``tokens`` positions keeps for the backward pass: every block's traced bytes, or with
    activation checkpointing each block's input plus one block recomputed."""
    if plan.activation_checkpointing:
        block_input = config.n_embd * plan.precision.compute_bytes
        acts = tokens * (config.n_layer * block_input + per_token_layer)
        detail = (f"{units.count(tokens)} tokens x ({config.n_layer} blocks x {units.count(block_input)} B kept input"
                  f" + one block recomputed {units.count(per_token_layer)} B)")
    else:
        acts = tokens * config.n_layer * per_token_layer
        how = "compiled" if plan.compile else "eager"
        detail = (f"{units.count(tokens)} tokens x {config.n_layer} blocks x {units.count(per_token_layer)}"
                  f" B/token/block (traced, {how})")
    return Part("activations", acts / GIB, detail)


def _loss(plan: Plan, config, tokens: int) -> Part:
    """The loss, one chunk of positions at a time (each chunk's logits are recomputed in the backward pass). With the
    Triton loss (plan.triton_loss), the output layer's logits in the compute dtype with their gradient written over
    them: compute-dtype bytes per (position x vocabulary entry); with torch's cross-entropy, the logits, their fp32
    upcast, log-softmax saved for the backward pass, and the logits' gradient: 2 + 4 + 4 + 2 bytes."""
    vocab = config.padded_vocab_size
    compute_bytes = plan.precision.compute_bytes
    chunk = min(tokens, plan.loss_chunk) if plan.loss_chunk > 0 else tokens
    per_logit = compute_bytes if plan.triton_loss else 2 * compute_bytes + 4 + 4
    return Part("logits and loss", chunk * vocab * per_logit / GIB,
                f"{units.count(chunk)} positions (one loss chunk) x {units.count(vocab)} vocab x {per_logit} B"
                + (" (Triton cross-entropy)" if plan.triton_loss else ""))


def shard_model_state(parts: list[Part], devices: int, sharding: str, offload: str, block_params: int,
                      compute_bytes: int, mixed: bool) -> float:
    """Rewrite the model-state parts of a ledger (in place) for a sharded run over `devices` GPUs; return the GiB
    of host RAM that offload takes, for all ranks together. Activations and the loss are per GPU: unchanged.

        sharding   weights                              gradients   optimizer state
        zero2      full (gathered for forward/backward)  / devices   / devices    (FSDP SHARD_GRAD_OP, ZeRO-2)
        zero3      / devices + 2 blocks gathered         / devices   / devices    (FSDP FULL_SHARD, ZeRO-3)

    Two blocks gathered: the one computing and the next one prefetched, in the compute dtype. With -mixed, zero3
    gathers each block already cast to 16 bits (those are the 16-bit copies); under zero2 every layer's copy stays
    until its backward. Offload (DeepSpeed ZeRO-Offload / ZeRO-Infinity): 'optimizer' moves the
    optimizer state, and under -mixed the fp32 master weights it updates, to host RAM (the GPU keeps the 16-bit
    weights); 'optimizer+params' (zero3 only) also moves the sharded weights, leaving only the gathered blocks."""
    if sharding not in SHARDING:
        raise ValueError(f"sharding '{sharding}': choose one of {', '.join(SHARDING)}")
    if offload not in OFFLOAD:
        raise ValueError(f"offload '{offload}': choose one of {', '.join(OFFLOAD)}")
    if offload != "none" and sharding == "none":
        raise ValueError("offload needs sharding zero2 or zero3 (DeepSpeed offloads its ZeRO partitions)")
    if offload == "optimizer+params" and sharding != "zero3":
        raise ValueError("offload optimizer+params needs sharding zero3 (only ZeRO-3 partitions the weights)")
    by_name = {p.name: p for p in parts}
    n = max(devices, 1)
    gathered = 2 * block_params * compute_bytes / GIB
    host = 0.0
    weights, grads, state = by_name["weights"], by_name["gradients"], by_name["optimizer state"]
    copies = by_name.get("16-bit weight copies")
    full_weights = weights.gib

    grads.gib /= n
    grads.detail += f", sharded over {n} GPUs"
    if offload != "none":
        host += state.gib  # every rank's share, all on the one host
        state.detail += f": moved to host RAM ({units.gib(state.gib)} for all ranks)"
        state.gib = 0.0
    else:
        state.gib /= n
        state.detail += f", sharded over {n} GPUs"

    if mixed and offload != "none":
        # the fp32 master weights go with the optimizer; the GPU trains on the 16-bit copies
        host += full_weights
        sixteen = full_weights * compute_bytes / 4
        weights.gib = sixteen
        weights.detail = f"16-bit weights (fp32 master copy on the host: {units.gib(full_weights)})"
        if copies is not None:
            parts.remove(copies)
            copies = None
        full_weights = sixteen
    if sharding == "zero3":
        if offload == "optimizer+params":
            host += full_weights
            weights.gib = gathered
            weights.detail = f"on the host ({units.gib(full_weights)}); 2 blocks gathered on the GPU at a time"
        else:
            weights.gib = full_weights / n + gathered
            weights.detail += f", sharded over {n} GPUs + 2 blocks gathered ({units.gib(gathered)})"
        if copies is not None:  # FSDP gathers in the compute dtype: the casts are the gathered blocks above
            parts.remove(copies)
    else:
        weights.detail += " (replicated: zero2 shards gradients and optimizer state only)"
    return host
