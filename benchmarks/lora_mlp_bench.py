"""The middle of a LoRA LLaMA MLP at TinyLlama's sizes on the GPU: layers.lora_fused.FusedLoRAMLP's two Triton kernels
(kernels.swiglu_lora_forward / swiglu_lora_backward) against what FusedLoRAPair + SwiGLU + FusedLoRA run for the same
work between the frozen matmuls, over a few launch configurations of the new kernels. Times from
triton.testing.do_bench (median, ms; the L2 cache cleared before each run).

    python benchmarks/lora_mlp_bench.py --out lora-mlp.md

Before, forward: fc_1's and fc_2's B adds (cuBLAS, in place over gate and up), the SwiGLU kernel, proj's lora_down
(K 5,632); backward: proj's lora_down_backward (rebuilding SwiGLU's output from gate and up, adding into the frozen
input gradient), the SwiGLU backward kernel, and fc_1's and fc_2's B backward (B's gradient and the r-wide one, two
cuBLAS matmuls each). After, forward: swiglu_lora_forward; backward: swiglu_lora_backward and the two r-wide
gradients (one matmul each). Both leave the same tensors for the frozen matmuls around them.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

P = 0.05
K, R = 5632, 32  # TinyLlama's intermediate size; the lab's rank


def main() -> int:
    from triton.testing import do_bench

    from litft import kernels
    from litft.layers.lora_math import low_rank_b_backward

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[4096])
    parser.add_argument("--sweep", action="store_true", help="also time other launches of the two kernels")
    args = parser.parse_args()

    torch.manual_seed(0)
    seed = torch.tensor([1234], device="cuda")
    parts = ((slice(None), slice(None), slice(None)),)
    lines = [f"# LoRA MLP middle: fused kernels against the layers apart ({torch.cuda.get_device_name()},"
             f" torch {torch.__version__})", "",
             "| M | variant | forward ms | backward ms | both |", "|---|---|---|---|---|"]
    for rows in args.rows:
        def bf16(*shape, std=1.0):
            return (torch.randn(*shape, device="cuda") * std).to(torch.bfloat16)

        gate0, up0, after_a = bf16(rows, K), bf16(rows, K), bf16(rows, 2 * R)
        b1, b2, a = bf16(K, R, std=0.05), bf16(K, R, std=0.05), bf16(R, K, std=K**-0.5)
        grad_a, grad_b1, grad_b2 = torch.zeros_like(a), torch.zeros_like(b1), torch.zeros_like(b2)
        for t in (b1, b2):
            t.grad = torch.zeros_like(t)
        grad_in, gp = bf16(rows, K), bf16(rows, R)

        def before_forward():
            gate, up = gate0.clone(), up0.clone()  # the clones stand for the frozen matmuls' fresh outputs
            gate.addmm_(after_a[:, :R], b1.t(), alpha=0.5)
            up.addmm_(after_a[:, R:], b2.t(), alpha=0.5)
            out = kernels.swiglu_forward(gate, up)
            return kernels.lora_down(out, a, P, seed, 3)

        def before_backward():
            grad_out, _ = kernels.lora_down_backward(up0, a, gp, P, seed, grad_in.clone(), grad_a=grad_a, salt=3,
                                                     gate=gate0)
            grad_gate, grad_up = kernels.swiglu_backward(grad_out, gate0, up0)
            g = torch.empty_like(after_a)
            low_rank_b_backward(grad_gate, after_a[:, :R], b1, 0.5, parts, out=g[:, :R])
            low_rank_b_backward(grad_up, after_a[:, R:], b2, 0.5, parts, out=g[:, R:])

        def clones():  # what the clones above cost, taken off "before"
            return gate0.clone(), up0.clone(), grad_in.clone()

        def after_backward(**launch):
            grad_gate, grad_up = kernels.swiglu_lora_backward(grad_in, gate0, up0, after_a, b1, b2, 0.5, 0.5, a, gp,
                                                              P, seed, 3, grad_a, grad_b1, grad_b2, **launch)
            g = torch.empty_like(after_a)
            g[:, :R].addmm_(grad_gate, b1, beta=0, alpha=0.5)
            g[:, R:].addmm_(grad_up, b2, beta=0, alpha=0.5)

        clone_ms = do_bench(clones, warmup=10, rep=50)
        fwd, bwd = do_bench(before_forward, warmup=10, rep=50), do_bench(before_backward, warmup=10, rep=50)
        # the forward clones gate and up, the backward grad_in: 2/3 and 1/3 of the three clones
        fwd, bwd = fwd - clone_ms * 2 / 3, bwd - clone_ms / 3
        lines.append(f"| {rows} | before (clones of {clone_ms:.4f} ms taken off) | {fwd:.4f} | {bwd:.4f} |"
                     f" {fwd + bwd:.4f} |")
        default_f = do_bench(lambda: kernels.swiglu_lora_forward(gate0, up0, after_a, b1, b2, 0.5, 0.5, a, P, seed, 3),
                             warmup=10, rep=50)
        default_b = do_bench(after_backward, warmup=10, rep=50)
        lines.append(f"| {rows} | after, default launches | {default_f:.4f} | {default_b:.4f} |"
                     f" {default_f + default_b:.4f} |")
        # the dropout mask's share: p = 0 draws none (the kernels' DROPOUT off)
        no_mask_f = do_bench(lambda: kernels.swiglu_lora_forward(gate0, up0, after_a, b1, b2, 0.5, 0.5, a, 0.0, seed,
                                                                 3), warmup=10, rep=50)
        no_mask_b = do_bench(lambda: kernels.swiglu_lora_backward(grad_in, gate0, up0, after_a, b1, b2, 0.5, 0.5, a,
                                                                  gp, 0.0, seed, 3, grad_a, grad_b1, grad_b2),
                             warmup=10, rep=50)
        lines.append(f"| {rows} | after, default launches, p 0 (no mask drawn; backward without the r-wide matmuls)"
                     f" | {no_mask_f:.4f} | {no_mask_b:.4f} | {no_mask_f + no_mask_b:.4f} |")
        with_mask_b = do_bench(lambda: kernels.swiglu_lora_backward(grad_in, gate0, up0, after_a, b1, b2, 0.5, 0.5,
                                                                    a, gp, P, seed, 3, grad_a, grad_b1, grad_b2),
                               warmup=10, rep=50)
        lines.append(f"| {rows} | after, default launches, p {P} (backward without the r-wide matmuls) | |"
                     f" {with_mask_b:.4f} | |")
        mask_lines = []
        for name, k, r, pair in (("q, k, v", 2048, 96, False), ("fc_1 + fc_2 (pair)", 2048, 32, True),
                                 ("attention's proj", 2048, 32, False)):
            x = bf16(rows, k)
            a_ = bf16(r, k, std=k**-0.5)
            a_grad = torch.zeros_like(a_)
            extra = dict(a2=bf16(r, k, std=k**-0.5), salt2=1) if pair else {}
            g = bf16(rows, 2 * r if pair else r)
            frozen = bf16(rows, k)
            grads = dict(extra, grad_a2=torch.zeros_like(a_)) if pair else {}
            timings = []
            for p in (P, 0.0):
                timings.append(do_bench(lambda: kernels.lora_down(x, a_, p, seed, **extra), warmup=10, rep=50))
                timings.append(do_bench(lambda: kernels.lora_down_backward(x, a_, g, p, seed, frozen, grad_a=a_grad,
                                                                           **grads), warmup=10, rep=50))
            mask_lines.append(f"| {rows} | {name} ({k}, {r}) | " + " | ".join(f"{t:.4f}" for t in timings) + " |")
        lines += ["", f"LoRA's A-side kernels with dropout {P} and without (p 0: no mask drawn), ms:", "",
                  f"| M | layer (K, R) | forward, p {P} | backward, p {P} | forward, p 0 | backward, p 0 |",
                  "|---|---|---|---|---|---|"] + mask_lines + [""]
        best_f, best_b = (default_f, "default"), (default_b, "default")
        if not args.sweep:
            continue
        lines += ["Other launches:", "", "| M | variant | forward ms | backward ms | both |", "|---|---|---|---|---|"]
        forward_launches = [dict(block_m=16, block_k=k_, num_warps=w, splits=s_)
                            for k_, w, s_ in itertools.product((32, 64), (2, 4), (2, 4))]
        forward_launches += [dict(block_m=16, block_k=64, num_warps=4, splits=2, num_stages=n) for n in (1, 2, 4)]
        for launch in forward_launches:
            block_m, block_k, warps, splits = launch["block_m"], launch["block_k"], launch["num_warps"], launch["splits"]
            label = f"forward BLOCK_M {block_m}, BLOCK_K {block_k}, {warps} warps, {splits} splits" + (
                f", {launch['num_stages']} stages" if "num_stages" in launch else "")
            try:
                ms = do_bench(lambda: kernels.swiglu_lora_forward(gate0, up0, after_a, b1, b2, 0.5, 0.5, a, P, seed,
                                                                  3, **launch), warmup=5, rep=30)
            except Exception as error:  # a launch that does not fit the SM (registers, shared memory)
                lines.append(f"| {rows} | {label} | failed: {type(error).__name__} | | |")
                continue
            lines.append(f"| {rows} | {label} | {ms:.4f} | | |")
            best_f = min(best_f, (ms, label))
        # an earlier sweep (BLOCK_M 32-64, BLOCK_K 64-128, 4-8 warps) found the larger tiles slower, down to
        # 4x (registers spilled): here smaller tiles, fewer warps, and the B gradients by cuBLAS (b_grads False)
        backward_launches = [dict(block_m=m_, block_k=k_, num_warps=w, programs_per_sm=s_, b_grads=b)
                             for b, m_, k_, w, s_ in itertools.product((True, False), (16, 32), (32, 64), (2, 4),
                                                                       (2, 4))]
        backward_launches += [dict(block_m=32, block_k=64, num_warps=4, programs_per_sm=2, b_grads=b, num_stages=n)
                              for b, n in itertools.product((True, False), (1, 2, 4))]
        for launch in backward_launches:
            label = (f"backward BLOCK_M {launch['block_m']}, BLOCK_K {launch['block_k']}, {launch['num_warps']} warps,"
                     f" {launch['programs_per_sm']} programs/SM, B gradients by "
                     + ("the kernel" if launch["b_grads"] else "cuBLAS")
                     + (f", {launch['num_stages']} stages" if "num_stages" in launch else ""))
            try:
                ms = do_bench(lambda: after_backward(**launch), warmup=5, rep=30)
            except Exception as error:
                lines.append(f"| {rows} | {label} | | failed: {type(error).__name__} | |")
                continue
            lines.append(f"| {rows} | {label} | | {ms:.4f} | |")
            best_b = min(best_b, (ms, label))
        floor = rows * K * 2 / 3.35e9  # ms for one (rows, K) bf16 pass at 3.35 TB/s
        lines += ["", f"M {rows}: fastest forward {best_f[1]} ({best_f[0]:.4f} ms), backward {best_b[1]}"
                      f" ({best_b[0]:.4f} ms). Bandwidth floor of the fused kernels: forward 3 passes"
                      f" ({3 * floor:.4f} ms: gate, up read; out written), backward 5 ({5 * floor:.4f} ms: grad,"
                      f" gate, up read; their two gradients written).", ""]
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
