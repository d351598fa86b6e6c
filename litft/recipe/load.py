"""Loading a recipe from YAML and CLI-style overrides: a strict reading, then three passes, so that the user sees
every problem at once:

0. reading: the YAML strictly (a key given twice in one mapping, an empty file, a setting written two ways are
   errors, never a silent choice), and the optimizer section in the one shape the command line also accepts;
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
import logging
import sys
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from litft.errors import ConfigError
from litft.recipe.litgpt_config import from_litgpt, is_litgpt_config
from litft.recipe.schema import (  # noqa: F401
    PACKAGE_PREFIX,
    STRATEGY_SHORTHANDS,
    OptimizerSpec,
    Recipe,
    plain,
    resolve_path,
)
from litft.recipe.validate import validate

# ----------------------------------------------------------------------------------------------------------------------
# Paths, recipe lookup
# ----------------------------------------------------------------------------------------------------------------------

def shipped_dir(folder: str) -> Path:
    """A folder of shipped YAML files (recipes, plans): the package litft.FOLDER once installed (a wheel, or
    `pip install -e .`), else FOLDER/ beside the litft/ folder (a source checkout on PYTHONPATH; this file is
    litft/recipe/load.py)."""
    try:
        return Path(str(resources.files(f"litft.{folder}")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / folder


def recipes_dir() -> Path:
    """The shipped recipes (recipes/*.yaml)."""
    return shipped_dir("recipes")


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
# Reading: strict YAML, one shape of the optimizer
# ----------------------------------------------------------------------------------------------------------------------


def read_recipe_file(path: Path) -> dict:
    """The mapping a recipe file holds, read strictly: unreadable YAML, an empty file, a file that is not a mapping
    of keys, and a key given twice in one mapping (YAML itself keeps the last one silently) raise ConfigError."""
    source = str(path)
    text = path.read_text(encoding="utf-8")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        values = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"cannot read the YAML: {_yaml_problem(err)}", source=source) from None
    if values is None:  # no document: the file is empty or only comments ('{}' is a recipe of the defaults)
        raise ConfigError("the file is empty: a recipe is a mapping of keys (model:, method:, train:, ...);"
                          " `litft show demo` prints a complete one", source=source)
    if not isinstance(values, dict):
        raise ConfigError("a recipe must be a mapping of keys (model:, train:, ...)", source=source)
    problems = _keys_given_twice(root)
    if problems:
        raise ConfigError(problems, source=source)
    return values


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's error on one line: 'line L, column C: what' (its own text spans several lines with a caret)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    hint = " (YAML indents with spaces, not tabs)" if "\\t" in problem or "'\\t'" in problem else ""
    return f"{where}{problem}{hint}"


def _keys_given_twice(node: yaml.Node, prefix: str = "") -> list[str]:
    """Every key given twice in one mapping of a composed YAML document, with both line numbers."""
    problems: list[str] = []
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key, line = str(key_node.value), key_node.start_mark.line + 1
            if key in lines:
                problems.append(f"{prefix}{key}: given twice, on lines {lines[key]} and {line} (YAML would keep only"
                                " the last); keep one")
            else:
                lines[key] = line
            problems += _keys_given_twice(value_node, f"{prefix}{key}.")
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            problems += _keys_given_twice(item, prefix)
    return problems


def _optimizer_section(value: Any, problems: list[str]) -> dict:
    """The optimizer as a YAML file or keyword overrides write it, in one shape: {'class_path': ..., 'init_args':
    {...}}, each key present when given. It accepts what the command line accepts: a class path alone
    ('torch.optim.SGD', as --optimizer torch.optim.SGD) and arguments beside class_path ({lr: 1e-4}, as
    --optimizer.lr 1e-4). An argument given both beside class_path and in init_args is a problem."""
    if value is None:
        problems.append("optimizer: the section is empty; give a class path (e.g. torch.optim.SGD) or arguments"
                        " (e.g. lr: 1.0e-4), or remove it")
        return {}
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, str):
        return {"class_path": optimizer_class_path(value)}
    if not isinstance(value, dict):
        problems.append(f"optimizer: expected a class path (e.g. torch.optim.SGD) or a section of class_path and"
                        f" arguments (e.g. {{class_path: torch.optim.SGD, lr: 0.01}}), got {value!r}")
        return {}
    section: dict = {"class_path": optimizer_class_path(value["class_path"])} if "class_path" in value else {}
    init_args = value.get("init_args") or {}
    if not isinstance(init_args, dict):
        problems.append(f"optimizer.init_args: expected a mapping of arguments such as {{lr: 1e-4}}, got {init_args!r}")
        init_args = {}
    init_args = dict(init_args)
    for name, arg in value.items():
        if name in ("class_path", "init_args"):
            continue
        if name in init_args:
            problems.append(f"optimizer.init_args.{name}: given twice, as optimizer.{name} and"
                            f" optimizer.init_args.{name}; give it once")
            continue
        init_args[name] = arg
    if init_args or "init_args" in value:
        section["init_args"] = init_args
    return section


def _strategy_section(value: Any, problems: list[str]) -> Any:
    """The strategy as a section: a shorthand string ('fsdp', 'deepspeed_stage_3_offload', Lightning's names) becomes
    the section it means; a section stays as it is (its keys are checked in pass 1)."""
    if isinstance(value, str):
        if value in STRATEGY_SHORTHANDS:
            return json.loads(json.dumps(STRATEGY_SHORTHANDS[value]))  # a copy: the table is shared
        close = difflib.get_close_matches(value, list(STRATEGY_SHORTHANDS), n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        problems.append(f"strategy: {value!r} is not one of {', '.join(repr(k) for k in STRATEGY_SHORTHANDS)}, or a"
                        f" section such as {{name: fsdp, fsdp: {{sharding: SHARD_GRAD_OP}}}}{hint}")
        return {}
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return value


def optimizer_class_path(name: Any) -> Any:
    """LitGPT's short optimizer names ('SGD', 'AdamW': a class of torch.optim) as class paths; a path stays as it
    is."""
    import torch

    if isinstance(name, str) and "." not in name and isinstance(getattr(torch.optim, name, None), type):
        return f"torch.optim.{name}"
    return name


def quantize_name(value: Any) -> Any:
    """LitGPT's --quantize spellings of the 4-bit formats ('bnb.nf4', 'bnb.nf4-dq', 'bnb.fp4', 'bnb.fp4-dq') as
    litft's ('nf4', ...); anything else stays for the choice check to refuse."""
    if isinstance(value, str) and value.startswith("bnb.") and value[4:] in ("nf4", "nf4-dq", "fp4", "fp4-dq"):
        return value[4:]
    return value


def _litgpt_forms(values: dict) -> dict:
    """A recipe's values with LitGPT's spellings read as litft's: the optimizer's short name, and 'bnb.' quantize
    names, where, as in LitGPT's finetune_lora, a LoRA run with a 4-bit format is QLoRA."""
    if "quantize" in values and quantize_name(values["quantize"]) != values["quantize"]:
        values["quantize"] = quantize_name(values["quantize"])
        if values.get("method", "lora") == "lora":
            values["method"] = "qlora"
    return values


def _litgpt_args(args: list[str], yaml_method: str) -> list[str]:
    """The command line's LitGPT spellings as litft's: --optimizer SGD, --quantize bnb.nf4 (which makes a LoRA
    recipe QLoRA, as LitGPT's finetune_lora does with it)."""
    out: list[str] = []
    out_tail: list[str] = []
    method_given = any(a == "--method" or a.startswith("--method=") for a in args)
    for i, token in enumerate(args):
        previous = args[i - 1] if i else ""
        if previous in ("--optimizer", "--optimizer.class_path"):
            token = optimizer_class_path(token)
        elif token.startswith(("--optimizer=", "--optimizer.class_path=")):
            key, _, value = token.partition("=")
            token = f"{key}={optimizer_class_path(value)}"
        if previous == "--quantize" or token.startswith("--quantize="):
            value = token.split("=", 1)[1] if token.startswith("--quantize=") else token
            litft_name = quantize_name(value)
            if litft_name != value and not method_given and yaml_method == "lora":
                method_given = True
                out_tail = ["--method", "qlora"]
            token = f"--quantize={litft_name}" if token.startswith("--quantize=") else litft_name
        out.append(token)
    return out + out_tail


def _strategy_args(args: list[str], problems: list[str]) -> list[str]:
    """--strategy SHORTHAND (or --strategy=SHORTHAND) on the command line as the keys it stands for."""
    out: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        if token == "--strategy" or token.startswith("--strategy="):
            if "=" in token:
                value, i = token.split("=", 1)[1], i + 1
            elif i + 1 < len(args):
                value, i = args[i + 1], i + 2
            else:
                problems.append("--strategy needs a value, e.g. --strategy fsdp")
                return out
            out += _as_args({"strategy": _strategy_section(value, problems)})
            continue
        out.append(token)
        i += 1
    return out


def _setting(key: str) -> str:
    """The setting a command-line key names: --optimizer and --optimizer.class_path are one setting, and so are
    --optimizer.NAME and --optimizer.init_args.NAME."""
    if key in ("optimizer", "optimizer.class_path"):
        return "optimizer.class_path"
    if key.startswith("optimizer."):
        return "optimizer.init_args." + key.removeprefix("optimizer.").removeprefix("init_args.")
    return key


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
            elif value is None:
                problems.append(f"{dotted}: the section is empty; set some of its keys ({', '.join(_hints(tp))}) or"
                                " remove it")
            else:
                problems.append(f"{dotted}: expected a section of keys ({', '.join(_hints(tp))}), got {value!r}")
            continue
        _check_choice(dotted, value, tp, problems)


def _not_the_cpu_4bit_kernel_notice(record: logging.LogRecord) -> bool:
    """bitsandbytes logs on import, as a warning, that its optional CPU kernel for 4-bit matmuls (from the `kernels`
    package) is not installed. litft multiplies by 4-bit weights on CUDA only (method qlora needs a GPU), so that one
    record is dropped; every other record of bitsandbytes passes."""
    return not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward")


# bitsandbytes is imported by the check below (an optimizer of bitsandbytes.optim), and by a 4-bit run
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_the_cpu_4bit_kernel_notice)


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
        if name not in params:  # beside its arguments the optimizer section holds class_path and init_args
            close = difflib.get_close_matches(name, params + ["class_path", "init_args"], n=1)
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


def _check_keys(yaml_values: dict, overrides: list[tuple[str, str | None]], problems: list[str]) -> None:
    """Pass 1 over the YAML's values (their optimizer section in the shape of _optimizer_section) and the overrides:
    append every problem to `problems`."""
    _check_section(yaml_values, Recipe, "", problems)

    # The optimizer: class from the override, else the YAML, else the default; arguments from both.
    yaml_opt = yaml_values.get("optimizer") or {}
    yaml_class = yaml_opt.get("class_path") or OptimizerSpec().class_path
    yaml_args = list(yaml_opt.get("init_args", {}))
    cli_class, cli_args = None, []
    spelled: dict[str, str] = {}  # setting -> how the overrides first spelled it

    def once(setting: str, spelling: str) -> None:
        first = spelled.setdefault(setting, spelling)
        if first != spelling:
            problems.append(f"{setting}: given twice, as {first} and {spelling}; give it once")

    for key, raw in overrides:
        if key == "optimizer.init_args":  # a whole mapping: --optimizer.init_args '{"lr": 1e-4, "foreach": true}'
            mapping = yaml.safe_load(raw) if raw else None
            if not isinstance(mapping, dict):
                problems.append(f"optimizer.init_args: expected a mapping such as '{{\"lr\": 1e-4}}', got {raw!r}")
                continue
            for name in mapping:
                once(_setting(f"optimizer.{name}"), f"--optimizer.init_args '{{\"{name}\": ...}}'")
            cli_args.extend(str(name) for name in mapping)
            continue
        once(_setting(key), f"--{key}")
        if key == "optimizer" or key == "optimizer.class_path":
            cli_class = raw
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


# ----------------------------------------------------------------------------------------------------------------------
# Pass 2: types, through jsonargparse
# ----------------------------------------------------------------------------------------------------------------------


def build_parser(prog: str = "litft finetune"):
    """The jsonargparse parser of a recipe: one --dotted.key per field, with the field docstrings as help."""
    from collections.abc import Callable, Iterable

    import torch
    from jsonargparse import (
        ActionConfigFile,
        ArgumentParser,
        Namespace,
        set_docstring_parse_options,
    )

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


def _as_args(values: dict, prefix: str = "") -> list[str]:
    """{'train': {'micro_batch_size': 8}} -> ['--train.micro_batch_size', '8'] (values as JSON, which YAML reads);
    the optimizer section in the shape of _optimizer_section -> --optimizer CLASS --optimizer.NAME VALUE. The YAML's
    values and the keyword overrides reach jsonargparse this way, as the command line's do."""
    args: list[str] = []
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if dotted == "optimizer":
            if "class_path" in value:
                args += ["--optimizer", str(value["class_path"])]
            for name, arg in value.get("init_args", {}).items():
                args += [f"--optimizer.{name}", cli_value(arg)]
        elif isinstance(value, dict):
            args += _as_args(value, dotted + ".")
        elif dataclasses.is_dataclass(value):
            args += _as_args(dataclasses.asdict(value), dotted + ".")
        else:
            args += [f"--{dotted}", cli_value(value)]
    return args


def cli_value(value: Any) -> str:
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
    problems: list[str] = []
    yaml_values: dict = {}
    if name_or_path is not None:
        path = find_recipe(name_or_path)
        source = str(path)
        yaml_values = read_recipe_file(path)
        if is_litgpt_config(yaml_values):
            yaml_values, mapping = from_litgpt(yaml_values)
            print(f"litft: {path} is a LitGPT finetune config; read as a litft recipe:\n  "
                  + "\n  ".join(mapping), file=sys.stderr)
        if "optimizer" in yaml_values:
            yaml_values["optimizer"] = _optimizer_section(yaml_values["optimizer"], problems)
        if "strategy" in yaml_values:
            yaml_values["strategy"] = _strategy_section(yaml_values["strategy"], problems)
        _litgpt_forms(yaml_values)
    if "optimizer" in overrides:
        overrides["optimizer"] = _optimizer_section(overrides["optimizer"], problems)
    if "strategy" in overrides:
        overrides["strategy"] = _strategy_section(overrides["strategy"], problems)
    _litgpt_forms(overrides)
    if "optimizer" in overrides and "class_path" in overrides["optimizer"]:
        overrides["optimizer"]["class_path"] = optimizer_class_path(overrides["optimizer"]["class_path"])
    yaml_method = yaml_values.get("method", overrides.get("method", Recipe().method))
    extra = _strategy_args(_litgpt_args(list(args or []), yaml_method), problems) + _as_args(overrides)
    if extra:  # a problem may be in the file or in an override: name both places to look
        source = f"{source} with overrides" if source else "overrides"
    _check_keys(yaml_values, _parse_cli_overrides(extra), problems)
    if problems:
        raise ConfigError(problems, source=source)

    parser = build_parser()
    try:
        namespace = parser.parse_args(_as_args(yaml_values) + extra)
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
