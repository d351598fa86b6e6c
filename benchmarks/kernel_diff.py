"""Two runs' GPU time per optimizer step by kind of kernel, side by side, from their profile_kernels.txt (written by
`litft finetune --logging.profile A-B` on CUDA: every kernel of the window, ms per step).

    python benchmarks/kernel_diff.py DIR/runs/before-profile/profile_kernels.txt \\
        DIR/runs/after-profile/profile_kernels.txt

Rows named like a record_function range (Optimizer.step#AdamW.step) span kernels that are listed anyway; files
written before litft left them out still hold them, and they are skipped here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# (kind, test on the kernel name): the first that matches names the kind
KINDS = [
    ("LoRA A side (Triton: lora_down, lora_down_backward, partial sums)",
     lambda n: n.startswith(("_lora_down", "_add_partials"))),
    ("flash attention (forward, backward, dq convert, do.o)", lambda n: "pytorch_flash" in n),
    ("cuBLAS matmuls (frozen weights; LoRA's B side and r-wide gradients)",
     lambda n: n.startswith("nvjet") or "cublasLt::splitKreduce" in n),
    ("Triton elementwise (SwiGLU, residual + RMSNorm, RoPE q/k/v, loss)",
     lambda n: n.startswith(("_swiglu", "_add_rms_norm", "_rope", "_cross_entropy"))),
    ("AdamW (Triton kernel, torch's fused op) and the clipping norm",
     lambda n: n.startswith("_adamw") or "FusedOptimizer" in n or "multi_tensor_apply" in n),
    ("other (reductions, copies, memsets, ...)", lambda n: True),
]


def read(path: Path) -> dict[str, float]:
    """kind -> ms per step (annotation rows skipped)."""
    totals = {kind: 0.0 for kind, _ in KINDS}
    for line in path.read_text().splitlines()[2:]:  # a heading and the column names first
        fields = line.split(None, 4)
        if len(fields) < 5:
            continue
        name = fields[4]
        if "#" in name and "(" not in name:  # kernel names hold '#' only inside C++ signatures ({lambda()#1})
            continue  # a record_function range such as Optimizer.step#AdamW.step
        kind = next(kind for kind, matches in KINDS if matches(name))
        totals[kind] += float(fields[0])
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path)
    parser.add_argument("other", type=Path)
    args = parser.parse_args()
    base, other = read(args.base), read(args.other)
    print(f"| kernels, ms per step | {args.base.parent.name} | {args.other.parent.name} | difference |")
    print("|---|---|---|---|")
    for kind, _ in KINDS:
        print(f"| {kind} | {base[kind]:.2f} | {other[kind]:.2f} | {other[kind] - base[kind]:+.2f} |")
    b, o = sum(base.values()), sum(other.values())
    print(f"| all | {b:.2f} | {o:.2f} | {o - b:+.2f} |")


if __name__ == "__main__":
    main()
