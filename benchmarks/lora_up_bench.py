"""LoRA's B side at TinyLlama's sizes on the GPU: kernels.lora_up_ / lora_up_backward (one launch forward for every
part, two launches and an add of partial sums backward) against the cuBLAS matmuls model.py ran before them
(add_low_rank_parts_: one addmm_ per part; low_rank_b_backward: two per part), over a sweep of launches. Times from
triton.testing.do_bench_cudagraph (ms per call, replayed from a CUDA graph as a training step runs them: GPU time,
without the host's launch time, which do_bench would count for launches this short), and the largest difference
from float64.

    python benchmarks/lora_up_bench.py --out lora-up.md

Shapes per micro-batch of 4,096 rows: the qkv layer (3 parts: q 2,048, k 256, v 256 columns; R 32 each), 22 per
TinyLlama micro-batch; attention's proj and the MLP's proj (one part of 2,048 columns), 44.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

SHAPES = [("qkv", (2048, 256, 256), 22), ("proj", (2048,), 44)]


def main() -> int:
    from triton.testing import do_bench_cudagraph

    def do_bench(fn):  # ms per call, over 20 ms of replays
        return do_bench_cudagraph(fn, rep=20)

    from litft import kernels
    from litft.kernels import lora_b
    from litft.layers.lora_math import add_low_rank_parts_, low_rank_b_backward

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--quick", action="store_true", help="a few launches only")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows, r, scale = args.rows, 32, 0.5
    lines = [f"# LoRA B side: Triton against cuBLAS ({torch.cuda.get_device_name()}, torch {torch.__version__},"
             f" {rows} rows, R {r})", "", "| shape | variant | forward ms | backward ms | max error fwd / h / B |",
             "|---|---|---|---|---|"]
    for name, sizes, count in SHAPES:
        n = sum(sizes)
        parts, slices, column = [], [], 0
        for i, size in enumerate(sizes):
            parts.append((column, column + size, column, i * r))
            slices.append((slice(column, column + size), slice(column, column + size), slice(i * r, (i + 1) * r)))
            column += size
        parts, slices = tuple(parts), tuple(slices)
        out = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(rows, len(sizes) * r, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(n, r, device="cuda") / r**0.5).to(torch.bfloat16)
        grad = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        b_param = torch.nn.Parameter(b.clone())
        b_param.grad = torch.zeros_like(b)
        grad_b = torch.zeros_like(b)

        # float64 references
        ref_out = out.double().clone()
        ref_h = torch.empty(rows, len(sizes) * r, dtype=torch.float64, device="cuda")
        ref_b = torch.zeros(n, r, dtype=torch.float64, device="cuda")
        for c, b_rows, hc in slices:
            ref_out[:, c] += scale * h.double()[:, hc] @ b.double()[b_rows].t()
            ref_h[:, hc] = scale * grad.double()[:, c] @ b.double()[b_rows]
            ref_b[b_rows] += scale * grad.double()[:, c].t() @ h.double()[:, hc]

        def cublas_forward():
            return add_low_rank_parts_(out.clone(), h, b, scale, slices)

        def cublas_backward():
            return low_rank_b_backward(grad, h, b_param, scale, slices)

        work = out.clone()
        fwd = do_bench(lambda: add_low_rank_parts_(work, h, b, scale, slices))
        bwd = do_bench(cublas_backward)
        b_param.grad.zero_()
        got_h = cublas_backward()
        err = ((cublas_forward().double() - ref_out).abs().max().item(), (got_h.double() - ref_h).abs().max().item(),
               (b_param.grad.double() - ref_b).abs().max().item())
        lines.append(f"| {name} | cuBLAS (before) | {fwd:.4f} | {bwd:.4f} | {err[0]:.3g} / {err[1]:.3g} / {err[2]:.3g} |")
        print(lines[-1], flush=True)

        forward_launches = [(16, 128, 4), (32, 64, 4), (32, 128, 4), (64, 64, 4), (64, 128, 8), (128, 128, 8)]
        backward_launches = [(16, 64, 4), (16, 128, 4), (32, 64, 4), (32, 128, 4), (32, 128, 8), (64, 64, 4),
                             (64, 128, 8)]
        b_launches = [(m, n, w, s) for (m, n, w) in ((32, 64, 4), (32, 128, 4), (64, 64, 4), (64, 128, 4),
                                                     (64, 128, 8), (128, 64, 4)) for s in (1, 2, 4)]
        if args.quick:
            forward_launches, backward_launches, b_launches = forward_launches[:3], backward_launches[:4], b_launches[:4]
        for block_m, block_n, warps in forward_launches:
            try:
                ms = do_bench(lambda: kernels.lora_up_(work, h, b, scale, parts, block_m=block_m, block_n=block_n,
                                                       num_warps=warps))
            except Exception as error:  # a launch that does not compile (registers, shared memory) is a result
                lines.append(f"| {name} | lora_up_ {block_m}x{block_n}, {warps} warps | failed: {type(error).__name__} | | |")
                continue
            got = kernels.lora_up_(out.clone(), h, b, scale, parts, block_m=block_m, block_n=block_n, num_warps=warps)
            lines.append(f"| {name} | lora_up_ BLOCK_M {block_m}, BLOCK_N {block_n}, {warps} warps | {ms:.4f} | |"
                         f" {(got.double() - ref_out).abs().max().item():.3g} |")
        # backward: the h-gradient kernel's launch swept with the B kernel at its default, then the B kernel's
        default = lora_b._lora_up_backward_launch()
        results = []
        for block_m, block_n, warps in backward_launches:
            launch = dict(default, h_block_m=block_m, h_block_n=block_n, h_warps=warps)
            results.append((launch, f"h {block_m}x{block_n} {warps}w"))
        for block_m, block_n, warps, per_sm in b_launches:
            launch = dict(default, b_block_m=block_m, b_block_n=block_n, b_warps=warps, programs_per_sm=per_sm)
            results.append((launch, f"B {block_m}x{block_n} {warps}w {per_sm}/SM"))
        for launch, label in results:
            def run(launch=launch):
                return kernels.lora_up_backward(grad, h, b, scale, parts, grad_b, **launch)
            try:
                ms = do_bench(run)
            except Exception as error:
                lines.append(f"| {name} | lora_up_backward {label} | | failed: {type(error).__name__} | |")
                continue
            grad_b.zero_()
            got_h = run()
            lines.append(f"| {name} | lora_up_backward {label} | | {ms:.4f} |"
                         f" / {(got_h.double() - ref_h).abs().max().item():.3g}"
                         f" / {(grad_b.double() - ref_b).abs().max().item():.3g} |")
        print("\n".join(lines[-len(results) - len(forward_launches):]), flush=True)
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
