"""Micro-step engines: one micro-batch's forward and backward, run plainly or replayed as a CUDA graph."""

from __future__ import annotations

import time

import torch

from litft.data import GRAPH_MULTIPLE


def model_inputs(batch: dict, device: torch.device) -> dict:
    """The tensors CausalLM.forward takes, on the device (copies overlap with compute: pinned memory, non_blocking)."""
    inputs = {key: batch[key].to(device, non_blocking=True) for key in ("input_ids", "labels")}
    if "cu_seqlens" in batch:
        inputs["positions"] = batch["positions"].to(device, non_blocking=True)
        inputs["cu_seqlens"] = batch["cu_seqlens"].to(device, non_blocking=True)
    return inputs


class PlainMicroStep:
    """One micro-batch: forward, then backward of loss / denominator; returns the detached loss sum."""

    def __init__(self, fabric, model, reducer=None) -> None:
        self.fabric, self.model, self.reducer = fabric, model, reducer
        # litft's DDP averages into gradients that are views of its buckets: zero them in place, never free them
        self.keeps_gradients = reducer is not None

    def __call__(self, inputs: dict, denominator) -> torch.Tensor:
        loss = self.model(**inputs)
        self.fabric.backward(loss / denominator)
        if self.reducer is not None:
            self.reducer.finish()  # an armed micro-step's gradients averaged over the ranks
        return loss.detach()

    def stats(self) -> dict:
        return {"on": False}


class GraphedMicroSteps:
    """One micro-batch's forward and backward, replayed as a CUDA graph: one per distinct batch shape.

    Why: a TinyLlama LoRA step launches ~11,000 kernels, and run plainly the GPU is busy 11% of the step's time
    (H100: 406 ms per step plainly, 109 ms replayed). A
    graph replays a micro-step's kernels with one launch.
    How: before training (prepare), stand-in batches run plainly (compiled blocks: the largest shape and the next
    smaller one, WARMUP times each, so that torch.compile builds its shape-generic kernels; eager blocks: the largest
    shape once, which allocates the gradients and lets a layer settle what it sets on its first call: nothing
    recompiles or initialises during a capture), and the largest shape is captured, then the smaller packed widths.
    A new shape met in training is captured straight away, with no plain warm-up: a plain run would need a second
    set of activations beside the graphs' pool; if that capture fails (a recompile for the new shape, say), the
    shape warms up plainly and is captured again. Micro-batches of a captured shape copy their tensors
    into the graph's inputs and replay it. Backward adds into the gradients in place, at the addresses captured, so
    the loop zeroes gradients in place (keeps_gradients). The scale 1/denominator is a device tensor filled before
    each replay (a plain number would be frozen into the graph). All graphs share one memory pool: they never run
    at the same time, and each one's output is copied out before the next replay. If a capture after warm-up fails
    (an op that cannot be captured), the run says why once and continues plainly.
    """

    keeps_gradients = True
    WARMUP = 2  # plain micro-batches before a capture (torch's CUDA graph docs warm up a few, too)
    EAGER_WARMUP = 1  # the same, before training, for eager blocks: nothing of theirs depends on the shapes seen
    UPFRONT_SHAPES = 16  # packed row widths captured before training, at least (TinyLlama at 4 x 512: 8 widths of 256)

    @classmethod
    def upfront_shapes(cls, step_capacity: int | None) -> int:
        """Packed row widths to capture before training: every width a step's micro-batch can take under
        data.pack_steps (capacity / GRAPH_MULTIPLE), at least UPFRONT_SHAPES. With 16 only, a 4,608-position
        capacity left 2 of its 18 widths to be captured during training, and the 60-step runs that met them ran at
        ~60,000 real tok/s for those intervals against ~69,000 (H100)."""
        widths = -(-step_capacity // GRAPH_MULTIPLE) if step_capacity else 0
        return max(cls.UPFRONT_SHAPES, widths)

    def __init__(self, fabric, model, say, compiled: bool = False, reducer=None) -> None:
        self.fabric, self.model, self.say = fabric, model, say
        self.compiled = compiled  # torch.compile'd blocks: warm up on two shapes (their kernels are built for both)
        self.reducer = reducer  # DDP: a step's last micro-batch is a graph of its own, with the collectives in it
        self.plain = PlainMicroStep(fabric, model, reducer)
        self.graphs: dict[tuple, tuple] = {}
        self.warming: dict[tuple, int] = {}  # shapes that run plainly before their capture: plain runs so far
        self.replays = 0
        self.retries = 0  # new shapes whose direct capture failed and that were captured after a warm-up
        self.failure: str | None = None
        self.pool = torch.cuda.graph_pool_handle()
        self.scale = torch.ones((), device=fabric.device)
        self.failed = False
        self.pool_tokens = 0  # positions of the largest captured micro-batch: what sized the graphs' pool
        self.captured_before_training = 0  # shapes prepare() captured
        self.plain_warmup_s = 0.0  # wall seconds of the plain warm-up micro-steps (prepare's and retries')
        self.warmup_micro_batches = 0  # plain micro-steps on stand-in batches (not training): prepare's and retries'
        self.capture_s = 0.0  # wall seconds of the captures, graph instantiation included

    def prepare(self, batches: list[dict]) -> None:
        """Before training: warm up plainly on the first stand-in batch (largest first; data.largest_batches),
        compiled on the first two, give back their gradients, and capture the largest shape, so the graphs' pool is
        sized once by the largest micro-batch; then capture the other stand-ins' shapes (packed rows: every width
        up to UPFRONT_SHAPES), so that the training steps replay instead of capturing (a 40-step TinyLlama LoRA run
        captured 8 widths during its steps, each capture costing about a plain micro-step's launch time).
        The warm-up's dropout draws come from a forked random state: the run's own random numbers (and a resumed
        run's) are those it would draw without it."""
        device = self.fabric.device
        # The gradients first, in segments of their own, so that none is carved out of the warm-up's activation
        # segments, which empty_cache() before the capture gives back.
        with torch.no_grad():
            for p in self.model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        with torch.random.fork_rng(devices=[device]):
            inputs = [model_inputs(batch, device) for batch in batches]
            # compiled: the largest shape and the next smaller, so that dynamo builds shape-generic kernels and no
            # later width recompiles during its capture; eager: one plain micro-step (~0.25 s for TinyLlama)
            shapes, times = (2, self.WARMUP) if self.compiled else (1, self.EAGER_WARMUP)
            self._warm_up(inputs[:shapes], times)
            # DDP: each shape twice, accumulating and (armed) averaging; a capture runs no collective's numbers
            variants = (False, True) if self.reducer is not None else (False,)
            if self.reducer is not None:
                self.reducer.arm(False)
            if not self._capture(self.key(inputs[0]), inputs[0], last_try=True):
                return
            self.pool_tokens = int(batches[0]["tokens_padded"])
            for batch_inputs in inputs:  # a capture does not run the micro-step: the gradients stay zero
                for armed in variants:
                    if self.reducer is not None:
                        self.reducer.arm(armed)
                    key = self.key(batch_inputs)
                    if key in self.graphs or self._capture(key, batch_inputs, last_try=False):
                        continue
                    self.retries += 1  # as in training: warm this shape up plainly, then capture it
                    self._warm_up([batch_inputs], self.WARMUP)
                    if not self._capture(key, batch_inputs, last_try=True):
                        return
            self.captured_before_training = len(self.graphs)

    def _warm_up(self, inputs: list[dict], times: int) -> None:
        """``times`` plain micro-steps on each stand-in, then their gradients zeroed: they are not training."""
        start = time.perf_counter()
        armed = self.reducer.armed if self.reducer is not None else False
        if self.reducer is not None:
            self.reducer.arm(False)  # a warm-up is not a step: no averaging
        for batch_inputs in inputs:
            for _ in range(times):
                self.plain(batch_inputs, 1.0)
                self.warmup_micro_batches += 1
        if self.reducer is not None:
            self.reducer.arm(armed)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
        torch.cuda.synchronize()
        self.plain_warmup_s += time.perf_counter() - start

    def key(self, inputs: dict) -> tuple:
        shapes = tuple((name, tuple(t.shape)) for name, t in inputs.items())
        return shapes + ((("armed", self.reducer.armed),) if self.reducer is not None else ())

    def __call__(self, inputs: dict, denominator) -> torch.Tensor:
        if self.failed:
            return self.plain(inputs, denominator)
        key = self.key(inputs)
        if key not in self.graphs:
            if not self.graphs or key in self.warming:
                loss = self.plain(inputs, denominator)  # this micro-batch's real contribution, and a warm-up
                self.warming[key] = self.warming.get(key, 0) + 1
                if self.warming[key] >= self.WARMUP:
                    self._capture(key, inputs, last_try=True)
                return loss
            if not self._capture(key, inputs, last_try=False):
                self.retries += 1
                self.warming[key] = 0
                return self(inputs, denominator)
        graph, static_inputs, static_loss = self.graphs[key]
        for name, tensor in inputs.items():
            static_inputs[name].copy_(tensor, non_blocking=True)
        self.scale.fill_(1.0 / denominator)
        graph.replay()
        self.replays += 1
        return static_loss.clone()  # the next replay of any graph may overwrite static_loss (one shared pool)

    def _capture(self, key: tuple, inputs: dict, last_try: bool) -> bool:
        static_inputs = {name: tensor.clone() for name, tensor in inputs.items()}
        stream = torch.cuda.current_stream()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # plain runs' activations go back; the graphs' pool holds theirs
        graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        try:
            # thread_local: the DataLoader's pin-memory thread keeps calling CUDA during the capture (it touches
            # no captured stream); the default mode ("global") makes those calls fail the capture
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                static_loss = self.model(**static_inputs)
                self.fabric.backward(static_loss * self.scale)
                if self.reducer is not None:
                    self.reducer.finish()
        except Exception as err:  # noqa: BLE001 - any capture failure: retry after a warm-up, or fall back
            self.capture_s += time.perf_counter() - start
            # A capture that raised as it ended leaves its side stream current and (torch 2.11) the allocator
            # recording into the pool, so that every later capture into it fails ("beginAllocateToPool: already
            # recording to mempool_id"; benchmarks/capture_pool_probe.py). Later captures go to a new pool; the
            # graphs captured so far keep theirs.
            torch.cuda.set_stream(stream)
            reset_capture_state()
            self.pool = torch.cuda.graph_pool_handle()
            if not last_try:
                return False
            self.failed = True
            self.graphs.clear()
            self.failure = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            self.say(f"CUDA graphs off for the rest of the run: capturing a micro-step failed ({self.failure});"
                     " set train.cuda_graphs: never to skip the attempt")
            return False
        self.capture_s += time.perf_counter() - start
        self.graphs[key] = (graph, static_inputs, static_loss.detach())
        return True

    def stats(self) -> dict:
        """For result.json: shapes captured, replays, plain warm-up micro-batches, retried captures, a failure."""
        return {"on": not self.failed, "shapes_captured": len(self.graphs),
                "captured_before_training": self.captured_before_training, "replays": self.replays,
                "plain_micro_batches": sum(self.warming.values()), "retried_captures": self.retries,
                "warmup_micro_batches": self.warmup_micro_batches,
                "failure": self.failure, "pool_tokens": self.pool_tokens if not self.failed else 0,
                "plain_warmup_s": round(self.plain_warmup_s, 3), "capture_s": round(self.capture_s, 3)}


def reset_capture_state() -> None:
    """After a capture that raised, let random ops (dropout) run plainly again.

    A capture marks the CUDA random generator as capturing and unmarks it when the capture ends; a capture that
    raised never unmarks it, and the next plain dropout then fails ("Offset increment outside graph capture").
    Capturing an empty graph marks and unmarks it again."""
    try:
        torch.cuda.synchronize()
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pass
    except Exception:  # noqa: BLE001 - the plain path will raise its own, clearer error if the device is unusable
        pass
