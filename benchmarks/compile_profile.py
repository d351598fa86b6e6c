"""Where torch.compile's time goes for one recipe: a short compiled run under cProfile, top functions written out.

    python benchmarks/compile_profile.py --recipe tiny-llama-lora --out DIR [--steps 3]

Why: on the H100 the compiled TinyLlama LoRA block spends ~61 s in inductor's Scheduler.codegen for its forward graph
where the full fine-tune's block compiles in ~9 s in all (a compiled run's result.json, compile.seconds_by_phase);
on the CPU, where inductor writes C++, the two compile alike. The profile names the
functions. Writes DIR/compile-profile-RECIPE.txt (pstats by own time and by cumulative time); the run's own folder
(with its saved weights) goes to /tmp.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_recipes import GPU, steps  # noqa: E402  (the GPU sets' data and random-init flags)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny-llama-lora")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from litft.cli import main as cli_main

    argv = ["finetune", "--config", args.recipe, *GPU, *steps(args.steps), "--train.compile", "always",
            "--logging.tensorboard", "false", "--out_dir", f"/tmp/litft-compile-profile/{args.recipe}", "--overwrite"]  # its weights stay behind
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    try:
        code = cli_main(argv)
    except SystemExit as exit_:
        code = exit_.code
    profiler.disable()
    wall = time.perf_counter() - started
    text = io.StringIO()
    text.write(f"litft {' '.join(argv)}\nexit {code}, {wall:.1f} s under cProfile\n\n")
    for order in ("tottime", "cumulative"):
        text.write(f"==== by {order}\n")
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(45)
    # who starts the subprocesses (C++ or launcher builds) that took most of a LoRA compile's time
    text.write("==== callers of subprocess calls and of inductor's C++ and Triton builds\n")
    stats = pstats.Stats(profiler, stream=text).sort_stats("cumulative")
    for pattern in (r"subprocess.py.*\(check_call\)", r"subprocess.py.*\(run\)", "check_build", "cpp_builder",
                    "compile_module_from_src", "make_launcher", "CppCodeCache"):
        stats.print_callers(pattern)
    path = args.out / f"compile-profile-{args.recipe}.txt"
    path.write_text(text.getvalue())
    print(f"wrote {path} ({wall:.1f} s, exit {code})")
    return 0 if code in (0, None) else 1


if __name__ == "__main__":
    raise SystemExit(main())
