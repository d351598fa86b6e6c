"""litft: LLM fine-tuning recipes on Lightning Fabric and LitGPT; every run is also a measurement."""

__version__ = "0.1.0"

from litft.recipe import Recipe, load_recipe, validate  # noqa: E402


def finetune(recipe: Recipe, **kwargs):
    """Run a recipe and return its RunResult (figures and paths). See litft.finetune.finetune."""
    from litft.finetune import finetune as _finetune

    return _finetune(recipe, **kwargs)


__all__ = ["Recipe", "load_recipe", "validate", "finetune", "__version__"]
