"""A recipe: typed, nested dataclasses (schema.py), loaded from YAML and CLI overrides by jsonargparse (load.py) and
checked for contradictions (validate.py); every problem is reported at once, as a ConfigError (exit 2)."""

from litft.recipe.load import (
    PACKAGE_PREFIX,
    build_parser,
    find_recipe,
    load_recipe,
    recipe_names,
    recipes_dir,
    resolve_path,
)
from litft.recipe.schema import (
    DataConfig,
    DataFields,
    DeepSpeedConfig,
    EvalConfig,
    FSDPConfig,
    LoggingConfig,
    LoRAConfig,
    ModelConfig,
    OptimizerSpec,
    Recipe,
    StrategyConfig,
    TrainConfig,
    config_hash,
    recipe_to_dict,
    recipe_to_yaml,
)
from litft.recipe.validate import checkpoint_dir_problems, parse_memory_cap, validate

__all__ = [
    "PACKAGE_PREFIX", "DataConfig", "DataFields", "DeepSpeedConfig", "EvalConfig", "FSDPConfig", "LoggingConfig",
    "LoRAConfig", "ModelConfig", "OptimizerSpec", "Recipe", "StrategyConfig", "TrainConfig", "build_parser", "checkpoint_dir_problems", "config_hash",
    "find_recipe", "load_recipe", "parse_memory_cap", "recipe_names", "recipe_to_dict", "recipe_to_yaml",
    "recipes_dir", "resolve_path", "validate",
]
