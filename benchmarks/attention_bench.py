"""Time packed (varlen) causal attention, forward + backward, the way a TinyLlama micro-batch calls it.

    python benchmarks/attention_bench.py [--tokens 4096 --samples 32] [--only litft cuDNN] [--sweep] [--out FILE.md]

A fine-tune's attention sees packed rows: ~16 samples (Alpaca-like lengths, mean ~250 tokens, cut at 512) in a row of
4,096 positions (full fine-tune: micro_batch_size 8 x 512) or ~8 in 2,048 (LoRA: 4 x 512). litft calls torch's
flash-attention varlen op with a fixed segment count (the step's sample count + 1, so every micro-batch of a run has
the same cu_seqlens shape for CUDA graphs) and a fixed max length (max_seq_length), so that one captured graph or
compiled kernel serves every row. This script measures what those fixed bounds cost, and the alternatives:

- torch.nn.attention.varlen's varlen_attn, padded segments, max 512
- varlen, only the row's own segments, max 512
- varlen, own segments, max = the row's longest sample
- litft's own path (model.GroupedFlashAttention: flash attention's varlen ops, k and v at their groups)
- litft's Triton kernels (varlen_attention.VarlenGQAAttention: fixed tiles of positions, a group's query heads
  packed into one tile), with the largest difference from litft's path and a CUDA-graph replay check; `--sweep`
  first times candidate tiles of its three kernels (per-kernel times) and keeps the fastest of each
- cuDNN's varlen attention (aten._cudnn_attention_forward with cu_seqlens, its autograd backward), k and v at their
  groups or repeated to all heads, with the largest difference from litft's path and a CUDA-graph replay check
- flex_attention (compiled) with a document-causal block mask, grouped k/v

TinyLlama's attention: 32 query heads, 4 k/v groups, head size 64, bf16. Each variant runs the same rows; the
figure is the mean forward + backward time per row over `--repeats` passes through them, timed with CUDA events.
`--only` keeps the variants whose names contain one of the given words (litft's flash path, the baseline, always
runs).
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import sys
import time

import torch

HEADS, GROUPS, HEAD_SIZE = 32, 4, 64


def sample_lengths(n: int, rng: random.Random, cap: int = 512) -> list[int]:
    """Alpaca-like prompt + response lengths: lognormal with median ~222 tokens (benchmarks/make_bench_data.py's
    rows: mean 254, median 222, 5.7% over 512), cut at `cap` as a fine-tune's max_seq_length does."""
    return [min(cap, max(8, int(rng.lognormvariate(math.log(222), 0.5)))) for _ in range(n)]


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing into rows of at most `capacity` positions (what data.pack_steps does)."""
    rows: list[list[int]] = []
    for length in sorted(lengths, reverse=True):
        for row in rows:
            if sum(row) + length <= capacity:
                row.append(length)
                break
        else:
            rows.append([length])
    return rows


def cu_seqlens(row: list[int], width: int, segments: int | None, device) -> torch.Tensor:
    bounds = [0]
    for length in row:
        bounds.append(bounds[-1] + length)
    if width > bounds[-1]:
        bounds.append(width)  # the padding tail, its own segment
    if segments is not None:
        bounds += [width] * (segments + 1 - len(bounds))
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def make_inputs(width: int, device):
    q = torch.randn(width, HEADS, HEAD_SIZE, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(width, GROUPS, HEAD_SIZE, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(width, GROUPS, HEAD_SIZE, device=device, dtype=torch.bfloat16, requires_grad=True)
    return q, k, v


def varlen_call(segments_of, max_of):
    from torch.nn.attention.varlen import varlen_attn

    import inspect

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = "enable_gqa" in params

    def run(q, k, v, row, width):
        cu = cu_seqlens(row, width, segments_of(row), q.device)
        longest = max_of(row, width)
        if gqa:
            return varlen_attn(q, k, v, cu, cu, longest, longest, scale=HEAD_SIZE ** -0.5, enable_gqa=True, **causal)
        k2, v2 = (x.repeat_interleave(HEADS // GROUPS, dim=1) for x in (k, v))
        return varlen_attn(q, k2, v2, cu, cu, longest, longest, scale=HEAD_SIZE ** -0.5, **causal)

    return run


def grouped_flash_call(segments_of):
    """litft's own path (model.GroupedFlashAttention): flash attention's varlen ops, k and v at their groups."""
    from litft.layers.attention import GroupedFlashAttention

    def run(q, k, v, row, width):
        cu = cu_seqlens(row, width, segments_of(row), q.device)
        return GroupedFlashAttention.apply(q, k, v, cu, 512, HEAD_SIZE ** -0.5)

    return run


def triton_varlen_call(segments_of):
    """litft's Triton kernels (varlen_attention.VarlenGQAAttention), called as grouped_flash_call calls flash."""
    from litft.kernels.varlen_attention import VarlenGQAAttention

    def run(q, k, v, row, width):
        cu = cu_seqlens(row, width, segments_of(row), q.device)
        return VarlenGQAAttention.apply(q, k, v, cu, 512, HEAD_SIZE ** -0.5)

    return run


def cudnn_call(segments_of, repeat: bool):
    """cuDNN's varlen attention: aten._cudnn_attention_forward with cu_seqlens (q (N, heads, D), k and v (N, groups,
    D) or repeated to every head), its backward by the op's own autograd formula (aten._cudnn_attention_backward)."""

    def run(q, k, v, row, width):
        cu = cu_seqlens(row, width, segments_of(row), q.device)
        if repeat:
            k, v = (x.repeat_interleave(HEADS // GROUPS, dim=1) for x in (k, v))
        return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, 512, 512, True, 0.0, True, False,
                                                       scale=HEAD_SIZE ** -0.5)[0]

    return run


def max_errors(run, reference, rows, width) -> str:
    """Largest |difference| from the reference path, output and q, k, v gradients, over the rows (bf16 inputs)."""
    worst = [0.0] * 4
    q, k, v = make_inputs(width, "cuda")
    grad = torch.randn(width, HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16)
    for row in rows:
        results = []
        for fn in (run, reference):
            q.grad = k.grad = v.grad = None
            out = fn(q, k, v, row, width)
            out.backward(grad)
            used = sum(row)  # the padding tail's own segment is not compared
            results.append([t[:used].float() for t in (out, q.grad, k.grad, v.grad)])
        worst = [max(w, (a - b).abs().max().item()) for w, a, b in zip(worst, *results)]
    return "out %.3g, dq %.3g, dk %.3g, dv %.3g" % tuple(worst)


def graph_replay_error(run, rows, width) -> str:
    """Capture forward + backward of the first row in a CUDA graph, replay it with each other row's cu_seqlens
    copied into the captured tensor, and compare with an eager call: the largest |difference| in the output."""
    q, k, v = make_inputs(width, "cuda")
    grad = torch.randn(width, HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16)
    segments = max(len(r) for r in rows) + 1
    cu = cu_seqlens(rows[0], width, segments, q.device)

    def step(cu_now):
        q.grad = k.grad = v.grad = None
        out = run(q, k, v, cu_now)
        out.backward(grad)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(cu)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(cu)
    worst = 0.0
    for row in rows[1:]:
        cu.copy_(cu_seqlens(row, width, segments, q.device))
        graph.replay()
        replayed = captured.clone()
        eager = run(q, k, v, cu_seqlens(row, width, segments, q.device))
        worst = max(worst, (replayed[:sum(row)].float() - eager[:sum(row)].float()).abs().max().item())
    return f"{worst:.3g}"


def flex_call():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def run(q, k, v, row, width):
        key = (tuple(row), width)
        if key not in masks:
            doc = torch.zeros(width, dtype=torch.int32, device=q.device)
            start = 0
            for i, length in enumerate(row):
                doc[start:start + length] = i
                start += length
            doc[start:] = len(row)

            def causal_in_doc(b, h, qi, ki):
                return (doc[qi] == doc[ki]) & (qi >= ki)

            masks[key] = create_block_mask(causal_in_doc, 1, None, width, width, device=q.device)
        y = compiled(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=masks[key],
                     enable_gqa=True, scale=HEAD_SIZE ** -0.5)
        return y[0].transpose(0, 1)

    return run


def time_variant(run, rows, width, repeats: int) -> tuple[float, float]:
    """(kernel time, wall time) per row in microseconds. Kernel time is the sum of the GPU kernels' durations
    (torch.profiler): what a row costs when the host keeps ahead of the GPU, as under CUDA graphs; wall time (CUDA
    events) also counts the GPU waiting for Python to launch the next kernel."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v = make_inputs(width, "cuda")
    grad = torch.randn(width, HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16)
    for row in rows:  # warm-up: compiles flex, builds every row's mask
        q.grad = k.grad = v.grad = None
        run(q, k, v, row, width).backward(grad)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(repeats):
            for row in rows:
                q.grad = k.grad = v.grad = None
                run(q, k, v, row, width).backward(grad)
        end.record()
        torch.cuda.synchronize()
    calls = repeats * len(rows)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_us = sum(e.device_time_total for e in kernels) / calls
    return kernel_us, start.elapsed_time(end) / calls * 1000


def kernel_times(run, rows, width, repeats: int) -> dict[str, float]:
    """Microseconds per row of each GPU kernel name (torch.profiler), after a warm-up pass (which compiles)."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v = make_inputs(width, "cuda")
    grad = torch.randn(width, HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16)
    for row in rows:
        q.grad = k.grad = v.grad = None
        run(q, k, v, row, width).backward(grad)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            for row in rows:
                q.grad = k.grad = v.grad = None
                run(q, k, v, row, width).backward(grad)
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name] = times.get(e.name, 0.0) + e.device_time_total / (repeats * len(rows))
    return times


# candidate tiles of varlen_attention's kernels (rows, keys, warps, stages[, splits]), the i-th of each timed
# together; the first of each is the module's default at the time of writing
SWEEP = {
    "forward": [(64, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 4), (128, 64, 8, 3), (128, 32, 8, 3)],
    "dq": [(64, 32, 4, 4), (64, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 5), (128, 64, 8, 3)],
    "dkdv": [(64, 64, 4, 3, 2), (32, 64, 4, 3, 2), (64, 64, 4, 4, 2), (32, 64, 4, 4, 2), (64, 64, 4, 3, 3),
             (16, 64, 4, 3, 2), (32, 64, 4, 3, 3), (32, 128, 8, 3, 2)],
}


def sweep_triton(rows, width, per_step, repeats: int) -> list[str]:
    """Time SWEEP's candidates of the Triton kernels (per kernel, microseconds per row), then keep the fastest of
    each in varlen_attention.TILES for the rest of the run. Returns markdown lines."""
    from litft.kernels import varlen_attention

    names = {"forward": ("_forward_kernel",), "dq": ("_dq_kernel",), "dkdv": ("_dkdv_kernel", "_sum_splits_kernel")}
    run = triton_varlen_call(lambda row: per_step + 1)
    best = {kernel: (float("inf"), None) for kernel in names}
    lines = [f"Triton varlen tiles, {width} positions: microseconds per row of each kernel (rows, keys, warps,"
             " stages[, splits]; dk/dv with its splits' sum)", "", "| forward | us | dq | us | dk/dv | us |", "|---|---|---|---|---|---|"]
    default = dict(varlen_attention.TILES[HEAD_SIZE])
    for i in range(max(len(c) for c in SWEEP.values())):
        candidate = {kernel: tuple(SWEEP[kernel][min(i, len(SWEEP[kernel]) - 1)]) for kernel in names}
        tiles = {kernel: varlen_attention.Tiles(*candidate[kernel]) for kernel in names}
        varlen_attention.TILES[HEAD_SIZE] = tiles
        cells = []
        try:
            times = kernel_times(run, rows, width, repeats)
        except Exception as err:  # a shape that does not fit (shared memory, registers): recorded, not fatal
            cells = [f"{candidate[kernel]} | failed: {type(err).__name__}" for kernel in names]
        else:
            for kernel, name in names.items():
                us = sum(t for n, t in times.items() if any(part in n for part in name))
                cells.append(f"{candidate[kernel]} | {us:.1f}")
                if us < best[kernel][0]:
                    best[kernel] = (us, tiles[kernel])
        lines.append("| " + " | ".join(cells) + " |")
    varlen_attention.TILES[HEAD_SIZE] = {kernel: best[kernel][1] or default[kernel] for kernel in names}
    lines += ["", "kept: " + ", ".join(f"{kernel} {varlen_attention.TILES[HEAD_SIZE][kernel]}" for kernel in names),
              ""]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 2048], help="row capacities to measure")
    parser.add_argument("--samples", type=int, nargs="+", default=[32, 16], help="samples per step, one per capacity")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps' worth of rows to time")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="also write the table here (markdown)")
    parser.add_argument("--only", nargs="+", default=None,
                        help="time only variants whose names contain one of these words (case-insensitive)")
    parser.add_argument("--sweep", action="store_true",
                        help="first time candidate tiles of the Triton varlen kernels and keep the fastest")
    parser.add_argument("--shape", type=int, nargs=3, default=None, metavar=("HEADS", "GROUPS", "HEAD_SIZE"),
                        help="attention's shape (default TinyLlama's: 32 4 64; OpenLLaMA-7B's: 32 32 128)")
    args = parser.parse_args()
    global HEADS, GROUPS, HEAD_SIZE  # the functions above read them when called
    if args.shape:
        HEADS, GROUPS, HEAD_SIZE = args.shape
    if not torch.cuda.is_available():
        print("attention_bench: needs a CUDA device", file=sys.stderr)
        return 2
    rng = random.Random(0)
    lines = [f"# Packed causal attention, forward + backward per row ({torch.cuda.get_device_name()}, torch"
             f" {torch.__version__}, python {platform.python_version()})", "",
             f"Command: `python {' '.join(sys.argv)}`", "",
             f"Attention: {HEADS} query heads over {GROUPS} k/v groups, head size {HEAD_SIZE}, bf16.", "",
             "| row capacity | samples/step | rows | mean samples/row | variant | kernel us per row (fwd+bwd) | vs litft today |"
             " wall us per row | max abs difference from litft's path (bf16) |",
             "|---|---|---|---|---|---|---|---|---|"]
    checks, sweeps = [], []
    litft_name = "litft GroupedFlashAttention (flash varlen ops, grouped k/v), padded segments, max 512"

    def wanted(name: str) -> bool:
        return args.only is None or name == litft_name or any(w.lower() in name.lower() for w in args.only)

    for capacity, per_step in zip(args.tokens, args.samples):
        rows = [row for _ in range(args.steps) for row in pack_rows(sample_lengths(per_step, rng), capacity)]
        # every row at the capacity's width (the widest captured shape), the padding tail its own segment
        width = capacity
        if args.sweep and not sweeps:  # once, at the first capacity
            sweeps = sweep_triton(rows, width, per_step, args.repeats)
        variants = {
            "litft GroupedFlashAttention (flash varlen ops, grouped k/v), padded segments, max 512":
                grouped_flash_call(lambda row: per_step + 1),
            "litft Triton varlen GQA (varlen_attention, fixed tiles, grouped heads packed), padded segments":
                triton_varlen_call(lambda row: per_step + 1),
            "varlen_attn, segments padded to samples/step + 1, max 512":
                varlen_call(lambda row: per_step + 1, lambda row, w: 512),
            "varlen_attn, the row's own segments, max 512": varlen_call(lambda row: None, lambda row, w: 512),
            "varlen_attn, own segments, max = longest in the row":
                varlen_call(lambda row: None, lambda row, w: max(max(row), w - sum(row), 1)),
            "cuDNN varlen, grouped k/v, padded segments": cudnn_call(lambda row: per_step + 1, repeat=False),
            "cuDNN varlen, k/v repeated, padded segments": cudnn_call(lambda row: per_step + 1, repeat=True),
            "cuDNN varlen, grouped k/v, own segments": cudnn_call(lambda row: None, repeat=False),
            "flex_attention, document-causal block mask": flex_call(),
        }
        base = None
        reference = variants[litft_name]
        for name, run in variants.items():
            if not wanted(name):
                continue
            try:
                us, wall = time_variant(run, rows, width, args.repeats)
            except Exception as err:  # a variant this torch lacks: recorded, not fatal
                lines.append(f"| {capacity} | {per_step} | {len(rows)} | | {name} | failed: {type(err).__name__}:"
                             f" {str(err).splitlines()[0][:120] if str(err) else ''} | | |")
                continue
            base = base or us
            mean = sum(len(r) for r in rows) / len(rows)
            errors = max_errors(run, reference, rows[:4], width) if "cuDNN" in name or "Triton" in name else ""
            lines.append(f"| {capacity} | {per_step} | {len(rows)} | {mean:.1f} | {name} | {us:.1f} | {us / base:.2f}x"
                         f" | {wall:.1f} | {errors} |")
        from litft.layers.attention import GroupedFlashAttention
        from litft.kernels.varlen_attention import VarlenGQAAttention

        scale = HEAD_SIZE ** -0.5
        for name, fn in {
            "litft GroupedFlashAttention": lambda q, k, v, cu: GroupedFlashAttention.apply(q, k, v, cu, 512, scale),
            "litft Triton varlen GQA": lambda q, k, v, cu: VarlenGQAAttention.apply(q, k, v, cu, 512, scale),
            "cuDNN varlen, grouped k/v": lambda q, k, v, cu: torch.ops.aten._cudnn_attention_forward(
                q, k, v, None, cu, cu, 512, 512, True, 0.0, True, False, scale=scale)[0],
        }.items():
            if not wanted(name):
                continue
            try:
                checks.append(f"- {capacity} positions, {name}: CUDA-graph replay vs eager, max abs difference"
                              f" {graph_replay_error(fn, rows[:6], width)}")
            except Exception as err:
                checks.append(f"- {capacity} positions, {name}: CUDA-graph capture failed: {type(err).__name__}:"
                              f" {str(err).splitlines()[0][:160] if str(err) else ''}")
    lines += [""] + checks + ([""] + sweeps if sweeps else [])
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
