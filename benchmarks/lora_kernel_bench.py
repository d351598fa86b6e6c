"""LoRA's A side at TinyLlama's sizes on the GPU: layers.lora_fused.FusedLoRA's two Triton kernels (kernels.lora_down and
kernels.lora_down_backward, the dropout drawn inside) against what LowRankUpdate after SeededDropout runs for the same
work (the dropout kernel, cuBLAS matmuls, and autograd's add of the adapter's input gradient to the frozen layer's),
over a few launch configurations (lora_down's columns split over 1-8 programs per row block among them), then the
fastest launch of each direction at p = 0 (no mask drawn: the mask's share of each kernel), and the bandwidth floor of
each shape. Times from triton.testing.do_bench (median of repeated runs, ms; it clears the L2 cache before each run,
so these are cold-cache times).

    python benchmarks/lora_kernel_bench.py --out lora-kernels.md

Per layer and micro-batch of M positions, the A side's shapes: q, k, v (K = 2,048, R = 3 x 32), attention's proj,
fc_1, fc_2 and the output layer (K = 2,048, R = 32), the MLP's proj (K = 5,632, R = 32); a TinyLlama micro-batch
runs 22, 67 and 22 of them. The table's last column weighs each shape by that count. Last, fc_1 and fc_2's A sides
as layers.lora_fused.FusedLoRAPair runs them (one launch each way over their shared input) against two launches and an add.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

P = 0.05
SHAPES = [("qkv", 2048, 96, 22), ("proj/fc/head", 2048, 32, 67), ("mlp proj", 5632, 32, 22)]


def main() -> int:
    global P  # the mask's share below times the fastest launches again at P = 0
    from triton.testing import do_bench

    from litft import kernels

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[2048, 4096])
    args = parser.parse_args()

    torch.manual_seed(0)
    seed = torch.tensor([1234], device="cuda")
    lines = [f"# LoRA A side: fused kernels against dropout + cuBLAS + autograd's add ({torch.cuda.get_device_name()},"
             f" torch {torch.__version__})", "",
             "| M | shape (K, R) | variant | forward ms | backward ms | per micro-batch x count (ms) |",
             "|---|---|---|---|---|---|"]
    best: dict[tuple[int, str], tuple[float, str, object]] = {}  # (M, shape + direction): (ms, launch, its call)
    mask_lines: list[str] = []
    floor_lines: list[str] = []
    for rows, (name, k, r, count) in itertools.product(args.rows, SHAPES):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        a = (torch.randn(r, k, device="cuda") / k**0.5).to(torch.bfloat16)
        a_grad = torch.zeros_like(a)
        g = torch.randn(rows, r, device="cuda", dtype=torch.bfloat16)
        grad_in = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        dropped = kernels.dropout(x, P, seed)

        def old_forward():
            return kernels.dropout(x, P, seed).mm(a.t())

        def old_backward():
            a_grad.addmm_(g.t(), dropped)
            grad_rows = kernels.dropout(g.mm(a), P, seed)
            return grad_in + grad_rows  # autograd's accumulation of the two input gradients

        variants = [("dropout + cuBLAS + add (before)", old_forward, old_backward)]
        for block_m, block_k, warps, splits in itertools.product((16, 32, 64), (64, 128), (4, 8), (1, 2, 4, 8)):
            variants.append((f"lora_down BLOCK_M {block_m}, BLOCK_K {block_k}, {warps} warps, {splits} splits",
                             lambda bm=block_m, bk=block_k, w=warps, s=splits: kernels.lora_down(
                                 x, a, P, seed, block_m=bm, block_k=bk, num_warps=w, splits=s),
                             None))
        for block_m, block_k, warps, per_sm in itertools.product((32, 64), (64, 128), (4, 8), (2, 4)):
            def new_backward(bm=block_m, bk=block_k, w=warps, s=per_sm):
                kernels.lora_down_backward(x, a, g, P, seed, grad_in, grad_a=a_grad, block_m=bm, block_k=bk,
                                           num_warps=w, programs_per_sm=s)
            variants.append((f"lora_down_backward BLOCK_M {block_m}, BLOCK_K {block_k}, {warps} warps,"
                             f" {per_sm} programs/SM", None, new_backward))
        for label, forward, backward in variants:
            fwd = do_bench(forward, warmup=10, rep=50) if forward else None
            bwd = do_bench(backward, warmup=10, rep=50) if backward else None
            total = ((fwd or 0) + (bwd or 0)) * count
            lines.append(f"| {rows} | {name} ({k}, {r}) | {label} | {'' if fwd is None else f'{fwd:.4f}'} |"
                         f" {'' if bwd is None else f'{bwd:.4f}'} | {total:.3f} |")
            for part, value, fn in (("forward", fwd, forward), ("backward", bwd, backward)):
                if value is not None and "before" not in label:
                    key = (rows, f"{name} {part}")
                    if key not in best or value < best[key][0]:
                        best[key] = (value, label, fn)
        # the mask's share: the fastest launch of each direction at p = 0 (the kernels then draw no mask at all)
        for part in ("backward", "forward"):
            _, label, fn = best[(rows, f"{name} {part}")]
            for p in (0.0, P):
                drawn, P = P, p  # the launches read P when called
                try:
                    value = do_bench(fn, warmup=10, rep=50)
                finally:
                    P = drawn
                mask_lines.append(f"| {rows} | {name} ({k}, {r}) | {part}: {label} | {p} | {value:.4f} |")
        # bytes a pass must move at least: forward reads x; backward reads x and grad_in and writes grad_x
        floor_lines.append(f"| {rows} | {name} ({k}, {r}) | {x.numel() * 2 / 3.35e9:.4f} |"
                           f" {3 * x.numel() * 2 / 3.35e9:.4f} |")
    lines += ["", "The mask's share (the fastest launch of each direction per shape, without and with dropout; ms):", "",
              "| M | shape (K, R) | launch | p | ms |", "|---|---|---|---|---|"] + mask_lines
    lines += ["", "The bandwidth floor at 3.35 TB/s (ms): forward reads x; backward reads x and grad_in, writes grad_x",
              "",
              "| M | shape (K, R) | forward | backward |", "|---|---|---|---|"] + floor_lines
    # layers.lora_fused.FusedLoRAPair's launches (fc_1 and fc_2 over one input: K 2,048, R 32 each) against FusedLoRA's two,
    # the default launches; backward: two kernels, each adding into its own copy of the frozen input gradient, and
    # the add of the two that autograd runs, against one kernel adding both shares
    lines += ["", "fc_1 and fc_2 together (layers.lora_fused.FusedLoRAPair) or apart (two FusedLoRA and autograd's add), ms:", "",
              "| M | forward: apart | forward: pair | backward: apart | backward: pair |", "|---|---|---|---|---|"]
    for rows in args.rows:
        x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
        a, a2 = ((torch.randn(32, 2048, device="cuda") / 2048**0.5).to(torch.bfloat16) for _ in range(2))
        grad_a, grad_a2 = torch.zeros_like(a), torch.zeros_like(a2)
        g = torch.randn(rows, 64, device="cuda", dtype=torch.bfloat16)
        g1, g2 = g[:, :32].contiguous(), g[:, 32:].contiguous()
        grad_in, grad_in2 = (torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(2))

        def apart_backward():
            first, _ = kernels.lora_down_backward(x, a, g1, P, seed, grad_in, grad_a=grad_a, salt=1)
            second, _ = kernels.lora_down_backward(x, a2, g2, P, seed, grad_in2, grad_a=grad_a2, salt=2)
            return first + second

        timings = [do_bench(fn, warmup=10, rep=50) for fn in (
            lambda: (kernels.lora_down(x, a, P, seed, 1), kernels.lora_down(x, a2, P, seed, 2)),
            lambda: kernels.lora_down(x, a, P, seed, 1, a2=a2, salt2=2),
            apart_backward,
            lambda: kernels.lora_down_backward(x, a, g, P, seed, grad_in, grad_a=grad_a, salt=1, a2=a2, salt2=2,
                                               grad_a2=grad_a2))]
        lines.append(f"| {rows} | " + " | ".join(f"{t:.4f}" for t in timings) + " |")
    lines += ["", "Fastest fused variant per shape and direction:", ""]
    lines += [f"- M {rows}, {what}: {label} ({value:.4f} ms)"
              for (rows, what), (value, label, _) in sorted(best.items(), key=lambda item: item[0])]
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
