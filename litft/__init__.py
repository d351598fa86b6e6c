"""litft: LLM fine-tuning recipes on Lightning Fabric and LitGPT; every run is also a measurement.

    cfg = litft.load_recipe("tiny-llama-lora", train={"micro_batch_size": 8})
    result = litft.finetune(cfg)          # a RunResult: figures (result.json) and paths
"""

__version__ = "0.1.0"

from litft.recipe import Recipe, load_recipe, validate  # noqa: E402

from litft.train import RunResult, finetune  # noqa: E402

__all__ = ["Recipe", "RunResult", "load_recipe", "validate", "finetune", "__version__"]
