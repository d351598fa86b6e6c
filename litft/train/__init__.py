"""Training: the loop (loop.py: finetune -> main -> train -> fit), the steps before it (setup.py), the micro-step
engines with CUDA graphs (engines.py), the optimizer, schedule and clipping (optim.py), profiling (profiling.py), the
loop's state and checkpointed training state (state.py), and what a run reports (result.py)."""

from litft.train.loop import finetune
from litft.train.result import RunResult

__all__ = ["finetune", "RunResult"]
