"""Loading a recipe from YAML and CLI-style overrides, in three passes so that the user sees every problem at once:

1. keys and choices: every key of the YAML and of the overrides is checked against the dataclasses, with a
   did-you-mean for typos (jsonargparse alone stops at the first unknown key);
2. types: jsonargparse parses the values into the declared types (and checks the optimizer's arguments against the
   optimizer class's own signature);
3. meaning: :func:`litft.recipe.validate.validate` checks settings that contradict each other.

Any failure raises :class:`~litft.errors.ConfigError` (exit code 2) before an out_dir is made or a GPU is touched.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from litft.errors import ConfigError
from litft.recipe.schema import PACKAGE_PREFIX, OptimizerSpec, Recipe, plain, resolve_path  # noqa: F401
from litft.recipe.validate import validate

# ----------------------------------------------------------------------------------------------------------------------
# Paths, recipe lookup
# ----------------------------------------------------------------------------------------------------------------------

SOURCE_RECIPES = Path(__file__).resolve().parents[2] / "recipes"
"""The recipes/ folder beside the litft/ folder in a source checkout (this file is litft/recipe/load.py)."""


def recipes_dir() -> Path:
    """The shipped recipes: the package litft.recipes once installed (a wheel, or `pip install -e .`), else the
    recipes/ folder beside the litft/ folder (a source checkout on PYTHONPATH)."""
    try:
        return Path(str(resources.files("litft.recipes")))
    except ModuleNotFoundError:
        return SOURCE_RECIPES


def recipe_names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def find_recipe(name_or_path: str | Path) -> Path:
    """A recipe file: an existing path, or the name of a shipped recipe (with or without '.yaml')."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = recipes_dir() / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    if shipped.is_file() and (path.parent == Path(".") or not path.exists()):
        return shipped
    names = recipe_names()
    hint = difflib.get_close_matches(path.stem, names, n=3)
    suggestion = f" did you mean {', '.join(repr(h) for h in hint)}?" if hint else ""
    raise ConfigError(
        f"no recipe file or shipped recipe named '{name_or_path}';{suggestion} `litft ls` lists the shipped recipes."
    )


# ----------------------------------------------------------------------------------------------------------------------
# Pass 1: keys and choices, all at once, with did-you-mean
# ----------------------------------------------------------------------------------------------------------------------


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _literal_choices(tp: Any) -> tuple[list[Any], bool, bool] | None:
    """(choices, allows None, is a list of choices) for Literal / Optional[Literal] / list[Literal]; else None."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return list(typing.get_args(tp)), False, False
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and typing.get_origin(args[0]) is Literal:
            return list(typing.get_args(args[0])), True, False
    if origin is list:
        (inner,) = typing.get_args(tp)
        if typing.get_origin(inner) is Literal:
            return list(typing.get_args(inner)), False, True
    return None


def _all_dotted_keys(cls: type = Recipe, prefix: str = "") -> list[str]:
    keys = []
    for name, tp in _hints(cls).items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(tp) and tp is not OptimizerSpec:
            keys += _all_dotted_keys(tp, f"{prefix}{name}.")
    return keys


def _unknown_key(key: str, siblings: list[str]) -> str:
    """'unknown key a.b' with the closest sibling, or the same leaf name in another section."""
    prefix, _, leaf = key.rpartition(".")
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        return f"unknown key '{key}'; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?"
    elsewhere = [k for k in _all_dotted_keys() if k.rpartition(".")[2] == leaf]
    if elsewhere:
        return f"unknown key '{key}'; did you mean '{elsewhere[0]}'?"
    section = f"'{prefix}'" if prefix else "a recipe"
    return f"unknown key '{key}'; {section} accepts: {', '.join(siblings)}"


def _check_choice(key: str, value: Any, tp: Any, problems: list[str]) -> None:
    spec = _literal_choices(tp)
    if spec is None:
        return
    choices, optional, is_list = spec
    values = value if is_list and isinstance(value, list) else [value]
    for v in values:
        if v is None and optional:
            continue
        if v not in choices:
            close = difflib.get_close_matches(str(v), [str(c) for c in choices], n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            allowed = ", ".join(repr(c) for c in choices) + (" or null" if optional else "")
            problems.append(f"{key}: {v!r} is not one of {allowed}{hint}")


def _check_section(values: dict, cls: type, prefix: str, problems: list[str]) -> None:
    hints = _hints(cls)
    for key, value in values.items():
        dotted = prefix + str(key)
        if key not in hints:
            problems.append(_unknown_key(dotted, list(hints)))
            continue
        tp = hints[key]
        if tp is OptimizerSpec:
            continue  # checked against the optimizer class by _check_optimizer
        if dataclasses.is_dataclass(tp):
            if isinstance(value, dict):
                _check_section(value, tp, dotted + ".", problems)
            elif value is not None:
                problems.append(f"{dotted}: expected a section of keys ({', '.join(_hints(tp))}), got {value!r}")
            continue
        _check_choice(dotted, value, tp, problems)


def _check_optimizer(class_path: str, arg_names: list[str], problems: list[str]) -> None:
    """The class must be an importable torch Optimizer, and every argument a parameter of its __init__."""
    import importlib
    import inspect

    import torch

    module_name, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError):
        problems.append(
            f"optimizer.class_path: cannot import '{class_path}' (e.g. torch.optim.AdamW, torch.optim.SGD,"
            " bitsandbytes.optim.AdamW8bit, bitsandbytes.optim.PagedAdamW)"
        )
        return
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        problems.append(f"optimizer.class_path: '{class_path}' is not a torch.optim.Optimizer subclass")
        return
    params = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "params")]
    for name in arg_names:
        if name not in params:
            close = difflib.get_close_matches(name, params, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; it accepts: {', '.join(params)}"
            problems.append(f"optimizer.init_args: {class_name} has no argument '{name}'{hint}")


def _parse_cli_overrides(args: list[str]) -> list[tuple[str, str | None]]:
    """['--a.b', 'v', '--c=w'] -> [('a.b', 'v'), ('c', 'w')]."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        token = args[i]
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument '{token}': overrides look like --train.micro_batch_size 8")
        key, eq, value = token[2:].partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
            i += 1
        pairs.append((key, value if (eq or value is not None) else None))
        i += 1
    return pairs


def _check_keys(yaml_values: dict, overrides: list[tuple[str, str | None]]) -> None:
    problems: list[str] = []
    _check_section(yaml_values, Recipe, "", problems)

    # The optimizer: class from the override, else the YAML, else the default; arguments from both.
    yaml_opt = yaml_values.get("optimizer") or {}
    if not isinstance(yaml_opt, dict):
        problems.append(f"optimizer: expected class_path and init_args, got {yaml_opt!r}")
        yaml_opt = {}
    for key in yaml_opt:
        if key not in ("class_path", "init_args"):
            problems.append(_unknown_key(f"optimizer.{key}", ["class_path", "init_args"]))
    yaml_class = yaml_opt.get("class_path") or OptimizerSpec().class_path
    yaml_args = list((yaml_opt.get("init_args") or {}).keys())
    cli_class, cli_args = None, []

    for key, raw in overrides:
        if key == "optimizer" or key == "optimizer.class_path":
            cli_class = raw
            continue
        if key == "optimizer.init_args":  # a whole mapping: --optimizer.init_args '{"lr": 1e-4, "foreach": true}'
            mapping = yaml.safe_load(raw) if raw else None
            if not isinstance(mapping, dict):
                problems.append(f"optimizer.init_args: expected a mapping such as '{{\"lr\": 1e-4}}', got {raw!r}")
                continue
            cli_args.extend(str(name) for name in mapping)
            continue
        if key.startswith("optimizer."):
            cli_args.append(key.removeprefix("optimizer.").removeprefix("init_args."))
            continue
        # walk the dataclasses along the dotted key
        cls: type = Recipe
        parts = key.split(".")
        for depth, part in enumerate(parts):
            hints = _hints(cls)
            dotted = ".".join(parts[: depth + 1])
            if part not in hints:
                problems.append(_unknown_key(dotted, list(hints)))
                break
            tp = hints[part]
            if depth == len(parts) - 1:
                if raw is not None and _literal_choices(tp) is not None:
                    try:
                        value = yaml.safe_load(raw)
                    except yaml.YAMLError:
                        value = raw
                    _check_choice(dotted, value, tp, problems)
            elif dataclasses.is_dataclass(tp):
                cls = tp
            else:
                problems.append(f"unknown key '{key}': '{dotted}' is a value, not a section")
                break
    if cli_class is None or cli_class == yaml_class:
        _check_optimizer(yaml_class, yaml_args + cli_args, problems)
    else:
        # Switching the class on the command line keeps the recipe's arguments the new class accepts and drops the
        # rest (jsonargparse's rule), so only the recipe's class is held to the recipe's arguments.
        _check_optimizer(yaml_class, yaml_args, problems)
        _check_optimizer(cli_class, cli_args, problems)
    if problems:
        raise ConfigError(problems)


# ----------------------------------------------------------------------------------------------------------------------
# Pass 2: types, through jsonargparse
# ----------------------------------------------------------------------------------------------------------------------


def build_parser(prog: str = "litft finetune"):
    """The jsonargparse parser of a recipe: one --dotted.key per field, with the field docstrings as help."""
    from collections.abc import Callable, Iterable

    import torch
    from jsonargparse import ActionConfigFile, ArgumentParser, Namespace, set_docstring_parse_options

    set_docstring_parse_options(attribute_docstrings=True)  # field docstrings become --help text
    parser = ArgumentParser(prog=prog, exit_on_error=False, description="Fine-tune a LitGPT model from a recipe.")
    parser.add_argument("--config", action=ActionConfigFile, help="A recipe YAML file (or a shipped recipe's name).")
    parser.add_class_arguments(Recipe, None, skip={"optimizer"}, fail_untyped=True)
    default = OptimizerSpec()
    # jsonargparse's own optimizer type: `--optimizer torch.optim.SGD --optimizer.momentum 0.9` switches the class
    # and sets its arguments, and the arguments are checked against the class's signature.
    parser.add_argument(
        "--optimizer",
        type=Callable[[Iterable], torch.optim.Optimizer],
        default=Namespace(class_path=default.class_path, init_args=Namespace(**default.init_args)),
        help="Optimizer class (e.g. torch.optim.SGD) and, as --optimizer.NAME, its arguments.",
    )
    return parser


def _from_dict(cls: type, values: dict) -> Any:
    hints = _hints(cls)
    kwargs = {}
    for name, value in values.items():
        if name not in hints:
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = _from_dict(tp, value)
        kwargs[name] = value
    return cls(**kwargs)


def _optimizer_from_parsed(value: Any) -> OptimizerSpec:
    """Keep every argument jsonargparse resolved (the recipe's and the class defaults it filled in): the saved config
    then rebuilds exactly this optimizer, whatever litft's own default optimizer is."""
    value = plain(value)
    return OptimizerSpec(class_path=value["class_path"], init_args=dict(value.get("init_args") or {}))


def _flatten_overrides(overrides: dict, prefix: str = "") -> list[str]:
    """{'train': {'micro_batch_size': 8}} -> ['--train.micro_batch_size', '8'] (values as JSON, which YAML reads)."""
    args: list[str] = []
    for key, value in overrides.items():
        dotted = f"{prefix}{key}"
        if dotted == "optimizer" and isinstance(value, dict):
            if "class_path" in value:
                args += ["--optimizer", str(value["class_path"])]
            init_args = value.get("init_args", {k: v for k, v in value.items() if k != "class_path"})
            for name, arg in init_args.items():
                args += [f"--optimizer.{name}", _cli_value(arg)]
        elif isinstance(value, dict):
            args += _flatten_overrides(value, dotted + ".")
        elif dataclasses.is_dataclass(value):
            args += _flatten_overrides(dataclasses.asdict(value), dotted + ".")
        else:
            args += [f"--{dotted}", _cli_value(value)]
    return args


def _cli_value(value: Any) -> str:
    """A Python value as a CLI string: strings as they are (jsonargparse takes a str/Literal value verbatim), the rest
    as JSON, which jsonargparse reads as YAML."""
    return value if isinstance(value, str) else json.dumps(plain(value))


def load_recipe(
    name_or_path: str | Path | None = None, args: list[str] | None = None, validate_paths: bool = True, **overrides: Any
) -> Recipe:
    """Load a recipe: a file or shipped recipe name, then CLI-style `args` and/or keyword overrides by section.

    >>> cfg = load_recipe("tiny-llama-lora", train={"micro_batch_size": 8}, precision="bf16-mixed")
    >>> cfg = load_recipe("demo", args=["--train.max_steps", "20"])

    Raises ConfigError (exit code 2) listing every problem found.
    """
    from jsonargparse import ArgumentError

    source = None
    yaml_values: dict = {}
    argv: list[str] = []
    if name_or_path is not None:
        path = find_recipe(name_or_path)
        source = str(path)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise ConfigError(f"cannot read the YAML: {err}", source=source) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError("a recipe must be a mapping of keys (model:, train:, ...)", source=source)
        yaml_values = loaded or {}
        argv += ["--config", str(path)]
    extra = list(args or []) + _flatten_overrides(overrides)
    if extra:  # a problem may be in the file or in an override: name both places to look
        source = f"{source} with overrides" if source else "overrides"
    pairs = _parse_cli_overrides(extra)
    try:
        _check_keys(yaml_values, pairs)
    except ConfigError as err:
        raise ConfigError(err.problems, source=source) from None

    parser = build_parser()
    try:
        namespace = parser.parse_args(argv + extra)
    except ArgumentError as err:
        raise ConfigError(_tidy_jsonargparse_message(str(err)), source=source) from None
    values = plain(namespace)
    values.pop("config", None)
    optimizer = _optimizer_from_parsed(values.pop("optimizer"))
    recipe = _from_dict(Recipe, values)
    recipe.optimizer = optimizer
    problems = validate(recipe, check_paths=validate_paths)
    if problems:
        raise ConfigError(problems, source=source)
    return recipe


def _tidy_jsonargparse_message(message: str) -> str:
    """jsonargparse says 'Parser key "train.epochs":\\n  Expected a <class 'int'>. Got value: five'; keep it on one
    line, as 'train.epochs: expected int, got five'."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    text = " ".join(lines)
    if text.startswith('Parser key "'):
        key, _, rest = text[len('Parser key "') :].partition('":')
        rest = rest.strip().replace("<class '", "").replace("'>", "")
        rest = rest.replace("Expected a int.", "expected an int,").replace("Expected a ", "expected a ")
        rest = rest.replace(". Got value:", ", got").replace("Got value:", "got")
        return f"{key}: {rest}"
    return text
