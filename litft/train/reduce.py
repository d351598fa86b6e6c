"""DDP's gradient averaging, done by litft: once per optimizer step, block by block as the step's last backward pass
finishes each block, overlapped with the rest of that pass.

Why not torch's DistributedDataParallel: its hooks run on autograd's gradient accumulation, so they cannot be
captured into a CUDA graph with the micro-step, never fire for weights whose gradient the matmul adds into .grad
itself (train.grad_into_weights, FusedLoRA), and keep a copy of every gradient in their buckets. Here:

- every trainable parameter's .grad is a view into one flat buffer per dtype, laid out block by block, so a block's
  gradients are one contiguous slice (a bucket) and one collective averages them;
- CausalLM calls :meth:`GradientReducer.block_started` with the tensor entering each block's attention; a hook on its
  gradient fires once that block's backward pass is done, and the bucket of the block after it (whose gradients are
  final by then, its first norm included) is averaged on a side stream while the backward pass goes on;
- :meth:`finish` averages what is left (the first block, the embedding) and makes the compute stream wait for the
  collectives, before the gradient norm and the optimizer step read the gradients.

Only the step's last micro-batch reduces (``armed``); the others accumulate locally. Under CUDA graphs the hooks and
collectives of an armed micro-step are captured with it, and every replay repeats them.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist


class GradientReducer:
    """Averages the trainable gradients of ``gpt`` (a LitGPT GPT) over the ranks of the default process group."""

    def __init__(self, gpt: torch.nn.Module, device: torch.device) -> None:
        self.world_size = dist.get_world_size()
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.armed = False
        blocks = list(gpt.transformer.h)
        owner = {id(p): i for i, block in enumerate(blocks) for p in block.parameters()}
        trainable = [p for p in gpt.parameters() if p.requires_grad]
        # bucket n (len(blocks)): what the backward pass finishes first, the output layer and the final norm; then
        # the blocks from the last to the first; the embedding and anything else outside the blocks join block 0's
        groups: dict[int, list[torch.nn.Parameter]] = {}
        for p in trainable:
            index = owner.get(id(p))
            if index is None:
                index = 0 if _is_embedding(gpt, p) else len(blocks)
            groups.setdefault(index, []).append(p)
        self.buckets: dict[int, list[torch.Tensor]] = {}
        self.flat: list[torch.Tensor] = []
        for dtype in {p.dtype for p in trainable}:
            order = [p for i in sorted(groups, reverse=True) for p in groups[i] if p.dtype == dtype]
            flat = torch.zeros(sum(p.numel() for p in order), dtype=dtype, device=device)
            self.flat.append(flat)
            offset = 0
            for i in sorted(groups, reverse=True):
                members = [p for p in groups[i] if p.dtype == dtype]
                if not members:
                    continue
                size = sum(p.numel() for p in members)
                self.buckets.setdefault(i, []).append(flat[offset:offset + size])
                for p in members:
                    p.grad = flat[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
        self.last_block = len(blocks)
        self.done: set[int] = set()
        # the same starting weights on every rank (DDP broadcasts them too); this also sets up the communicator
        # before any graph capture
        with torch.no_grad():
            for p in trainable:
                dist.broadcast(p.data, src=0)

    @property
    def gradient_bytes(self) -> int:
        return sum(flat.numel() * flat.element_size() for flat in self.flat)

    def arm(self, last_micro_batch: bool) -> None:
        """Reduce during the next micro-step's backward pass (the step's last micro-batch) or not."""
        self.armed = last_micro_batch
        self.done = set()

    def block_started(self, index: int, x: torch.Tensor) -> None:
        """Called by CausalLM with the tensor entering block ``index``'s attention (in the forward pass)."""
        if self.armed and index < self.last_block and x.requires_grad:
            x.register_hook(lambda grad, i=index: self._reduce(i + 1))

    def finish(self) -> None:
        """After an armed backward pass: average the buckets not averaged yet, then let the compute stream go on only
        once every collective is done."""
        if not self.armed:
            return
        for index in sorted(self.buckets, reverse=True):
            self._reduce(index)
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)

    def _reduce(self, index: int) -> None:
        if index in self.done or index not in self.buckets:
            return
        self.done.add(index)
        if self.cuda:  # on the side stream, after what the compute stream has queued so far
            self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            for bucket in self.buckets[index]:
                if self.cuda:
                    dist.all_reduce(bucket, op=dist.ReduceOp.AVG)
                else:  # gloo has no AVG
                    dist.all_reduce(bucket, op=dist.ReduceOp.SUM)
                    bucket.div_(self.world_size)


def _is_embedding(gpt: torch.nn.Module, p: torch.nn.Parameter) -> bool:
    wte = getattr(gpt.transformer, "wte", None)
    return wte is not None and any(p is q for q in wte.parameters())
