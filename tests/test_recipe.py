"""Recipe loading: every shipped YAML parses and validates; config errors name the dotted key with a did-you-mean,
list every problem at once, and exit 2 without creating an out_dir."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from litft.errors import ConfigError
from litft.recipe import (
    Recipe,
    config_hash,
    load_recipe,
    recipe_names,
    recipe_to_yaml,
    validate,
)

SHIPPED = recipe_names()


def test_catalogue_covers_the_lab_set():
    expected = {
        "demo",
        "tiny-llama-full", "tiny-llama-lora", "tiny-llama-qlora",
        "open-llama-3b-full", "open-llama-3b-lora",
        "open-llama-7b-full", "open-llama-7b-lora", "open-llama-7b-qlora",
        "open-llama-13b-full", "open-llama-13b-full-sgd", "open-llama-13b-lora",
    }
    assert expected <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipe_parses_validates_and_round_trips(name, tmp_path):
    recipe = load_recipe(name, validate_paths=False)
    assert validate(recipe, check_paths=False) == []
    # the header says how to run it and what it teaches
    text = (Path(__file__).parents[1] / "recipes" / f"{name}.yaml").read_text()
    assert text.startswith(f"# litft finetune --config recipes/{name}.yaml")
    assert "# About:" in text
    # the resolved config is itself a valid recipe that loads back identical
    saved = tmp_path / "resolved.yaml"
    saved.write_text(recipe_to_yaml(recipe))
    again = load_recipe(saved, validate_paths=False)
    assert again == recipe
    assert config_hash(again) == config_hash(recipe)


@pytest.mark.parametrize("name", SHIPPED)
def test_litft_validate_cli_accepts_each_shipped_recipe(name, capsys):
    from litft.cli import main

    assert main(["validate", name]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"valid: {name}")
    assert "global_batch_size" in out


def test_overrides_by_section_and_by_cli_agree():
    a = load_recipe("tiny-llama-lora", validate_paths=False, train={"micro_batch_size": 2}, precision="bf16-mixed")
    b = load_recipe(
        "tiny-llama-lora", args=["--train.micro_batch_size", "2", "--precision", "bf16-mixed"], validate_paths=False
    )
    assert a == b
    assert a.train.micro_batch_size == 2 and a.precision == "bf16-mixed"
    assert a.grad_accum == a.train.global_batch_size // 2


def test_optimizer_class_and_arguments_from_yaml_and_cli():
    r = load_recipe("open-llama-13b-full-sgd", validate_paths=False)
    assert r.optimizer.class_path == "torch.optim.SGD"
    r = load_recipe("tiny-llama-full", args=["--optimizer.lr", "1e-5"], validate_paths=False)
    assert r.optimizer.class_path == "torch.optim.AdamW" and r.optimizer.init_args["lr"] == 1e-5
    r = load_recipe(
        "tiny-llama-full", args=["--optimizer", "torch.optim.SGD", "--optimizer.momentum", "0.9"], validate_paths=False
    )
    assert r.optimizer.class_path == "torch.optim.SGD" and r.optimizer.init_args["momentum"] == 0.9
    r = load_recipe("tiny-llama-lora", optimizer={"class_path": "bitsandbytes.optim.PagedAdamW8bit"}, validate_paths=False)
    assert r.optimizer.class_path == "bitsandbytes.optim.PagedAdamW8bit"
    # a whole mapping of arguments merges into the recipe's (the recipe's lr stays)
    r = load_recipe("tiny-llama-full", args=["--optimizer.init_args", '{"foreach": true}'], validate_paths=False)
    assert r.optimizer.init_args["foreach"] is True and r.optimizer.init_args["lr"] == 5e-5
    with pytest.raises(ConfigError, match="AdamW has no argument 'fourch'; did you mean 'foreach'"):
        load_recipe("tiny-llama-full", args=["--optimizer.init_args", '{"fourch": true}'], validate_paths=False)
    with pytest.raises(ConfigError, match="tiny-llama-full.yaml with overrides: optimizer.init_args: expected a mapping"):
        load_recipe("tiny-llama-full", args=["--optimizer.init_args", "oops"], validate_paths=False)


def _problems(tmp_path, text, *args):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_recipe(path, args=list(args))
    return info.value.problems


def test_every_unknown_key_and_bad_choice_is_listed_with_did_you_mean(tmp_path):
    problems = _problems(
        tmp_path,
        "precison: bf16-true\nmethod: lorra\ntrain:\n  micro_batch_sise: 3\nlora:\n  targets: [q, x]\n"
        "optimizer:\n  class_path: torch.optim.AdamW\n  init_args:\n    lrr: 0.1\n",
        "--train.epochz", "2", "--precision", "bf17",
    )
    text = "\n".join(problems)
    assert "unknown key 'precison'; did you mean 'precision'?" in text
    assert "method: 'lorra' is not one of 'full', 'lora', 'qlora'; did you mean 'lora'?" in text
    assert "unknown key 'train.micro_batch_sise'; did you mean 'train.micro_batch_size'?" in text
    assert "lora.targets: 'x' is not one of" in text
    assert "AdamW has no argument 'lrr'; did you mean 'lr'?" in text
    assert "unknown key 'train.epochz'; did you mean 'train.epochs'?" in text
    assert "precision: 'bf17' is not one of '32-true', '16-mixed', 'bf16-mixed', 'bf16-true', '16-true'" in text
    assert len(problems) == 7


def test_misplaced_key_points_to_its_section(tmp_path):
    problems = _problems(tmp_path, "micro_batch_size: 8\n")
    assert problems == ["unknown key 'micro_batch_size'; did you mean 'train.micro_batch_size'?"]


def test_wrong_type_names_the_key(tmp_path):
    problems = _problems(tmp_path, "train:\n  epochs: five\n")
    assert problems[0].startswith("train.epochs:") and "five" in problems[0]


def test_contradictions_are_listed_together(tmp_path):
    problems = _problems(
        tmp_path,
        "init: random\nmodel:\n  name: tiny-llama-1.1b\nmethod: qlora\nprecision: bf16-mixed\n"
        "train:\n  global_batch_size: 10\n  micro_batch_size: 4\n",
        "--lora.r", "0",
    )
    text = "\n".join(problems)
    assert "train.global_batch_size: 10 is not a multiple of micro_batch_size x devices = 4 x 1 = 4; try 8 or 12" in text
    assert "quantize: method qlora needs a 4-bit format" in text
    assert "precision: bf16-mixed cannot be combined with 4-bit weights" in text
    assert "lora.r: must be at least 1" in text


def test_quantize_without_qlora_is_refused(tmp_path):
    problems = _problems(tmp_path, "init: random\nmodel:\n  name: tiny-llama-1.1b\nmethod: lora\nquantize: nf4\n")
    assert any(p.startswith("quantize: nf4 applies to method qlora only") for p in problems)


def test_missing_checkpoint_dir_names_what_is_missing_and_never_downloads(tmp_path):
    problems = _problems(tmp_path, f"model:\n  checkpoint_dir: {tmp_path}/checkpoints/TinyLama\n")
    assert "does not exist" in problems[0] and "litgpt download" in problems[0]
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model_config.yaml").write_text("name: x\n")
    problems = _problems(tmp_path, f"model:\n  checkpoint_dir: {tmp_path}/ckpt\n")
    assert "lacks lit_model.pth, tokenizer.json or tokenizer.model" in problems[0]


def test_unknown_model_name_suggests_litgpt_names(tmp_path):
    problems = _problems(tmp_path, "init: random\nmodel:\n  name: tiny-llama-1b\n")
    assert "'tiny-llama-1.1b'" in problems[0]


def test_unknown_recipe_name_suggests_shipped_ones():
    with pytest.raises(ConfigError, match="did you mean 'tiny-llama-lora'"):
        load_recipe("tiny-lama-lora")


def test_cli_config_error_exits_2_without_creating_out_dir(tmp_path):
    out_dir = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"out_dir: {out_dir}\ntrain:\n  micro_batch_sise: 3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "litft.cli", "finetune", "--config", str(recipe)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "did you mean 'train.micro_batch_size'?" in proc.stderr
    assert not out_dir.exists()


def test_every_config_field_has_a_docstring_that_reaches_help():
    import ast
    import inspect

    import litft.recipe.schema as module
    from litft.recipe import build_parser

    tree = ast.parse(inspect.getsource(module))
    undocumented, classes = [], []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any(
            isinstance(d, ast.Name) and d.id == "dataclass" for d in node.decorator_list
        ):
            classes.append(node.name)
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    documented = isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)
                    if not documented:
                        undocumented.append(f"{node.name}.{stmt.target.id}")
    assert undocumented == [] and {"Recipe", "TrainConfig", "DataConfig", "ModelConfig"} <= set(classes)
    help_text = build_parser().format_help()
    assert "Samples per forward/backward pass on each device" in help_text
    assert "--train.micro_batch_size" in help_text and "--lora.targets" in help_text
    assert yaml.safe_load(recipe_to_yaml(Recipe()))["train"]["micro_batch_size"] == 4


def _plan(recipe):
    from litft.model import model_config
    from litft.plan import resolve

    return resolve(recipe, model_config(recipe), "cpu", 1)


def test_pack_steps_is_on_by_default_and_only_takes_effect_with_packing(tiny_recipe):
    """data.pack_steps fills packed micro-batches: on by default, and without packing there is nothing to fill, so
    the loader hands out micro-batches of micro_batch_size samples as before."""
    from litft.recipe import validate
    from litft.train.result import batch_line

    packed = tiny_recipe(train={"global_batch_size": 8, "micro_batch_size": 2}, data={"max_seq_length": 96})
    plan = _plan(packed)
    assert packed.data.pack_steps and plan.pack_steps
    assert plan.loader_batch_size == 8 and plan.step_capacity == 2 * 96  # a step's samples; 2 rows' positions
    assert "micro-batches filled to 192 positions (data.pack_steps)" in batch_line(packed, plan)
    padded = tiny_recipe(train={"global_batch_size": 8, "micro_batch_size": 2}, data={"packing": False})
    plan = _plan(padded)
    assert padded.data.pack_steps and not plan.pack_steps and validate(padded, check_paths=False) == []
    assert plan.loader_batch_size == 2 and "pack_steps" not in batch_line(padded, plan)


def test_pack_capacity_sets_the_positions_per_packed_micro_batch(tiny_recipe):
    """data.pack_capacity replaces micro_batch_size x max_seq_length as a packed micro-batch's positions: in the
    loader's capacity, the batch line and the memory ledger's tokens; it must fit a whole sample, and it needs
    packed steps."""
    from litft.memory.fit import _candidate_changes
    from litft.recipe import validate
    from litft.train.result import batch_line

    roomy = tiny_recipe(train={"global_batch_size": 8, "micro_batch_size": 2}, data={"max_seq_length": 96,
                                                                                    "pack_capacity": 256})
    assert validate(roomy, check_paths=False) == []
    plan = _plan(roomy)
    assert plan.step_capacity == 256 and plan.loader_batch_size == 8
    assert "micro-batches filled to 256 positions (data.pack_steps)" in batch_line(roomy, plan)
    # what would fit drops the capacity first, and with every smaller micro batch
    changes = dict(_candidate_changes(roomy))
    assert changes["data.pack_capacity null (micro-batches of 192 positions, same global batch)"] == \
        {"data": {"pack_capacity": None}}
    assert changes["train.micro_batch_size 1 (same global batch, more accumulation)"] == \
        {"train": {"micro_batch_size": 1}, "data": {"pack_capacity": None}}

    with pytest.raises(ConfigError) as short:
        tiny_recipe(data={"max_seq_length": 96, "pack_capacity": 64})
    assert short.value.problems == [
        "data.pack_capacity: 64 is below data.max_seq_length 96: a sample must fit one micro-batch; use at least"
        " that, or null"]
    with pytest.raises(ConfigError) as unpacked:
        tiny_recipe(data={"max_seq_length": 96, "pack_capacity": 256, "pack_steps": False})
    assert unpacked.value.problems == [
        "data.pack_capacity: 256 needs data.packing and data.pack_steps (both true); set it to null, or turn both on"]



def test_a_source_checkout_without_install_finds_the_shipped_recipes(tmp_path):
    """From a source checkout on PYTHONPATH (no `pip install`: the GPU calls run litft that way) the recipes are the
    recipes/ folder beside litft/, and `litft ls` lists them."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    code = ("import sys; sys.modules['litft.recipes'] = sys.modules['litft.plans'] = None\n"  # as if not installed
            "from litft.recipe import recipe_names, recipes_dir\n"
            "from litft.sweep import find_plan\n"
            "print(recipes_dir()); print(' '.join(recipe_names())); print(find_plan('lab-part1-a100'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    where, names, plan = out.stdout.splitlines()
    assert Path(where) == repo / "recipes" and "tiny-llama-lora" in names.split()
    assert Path(plan) == repo / "plans" / "lab-part1-a100.yaml"


# ----------------------------------------------------------------------------------------------------------------------
# Strict YAML: nothing a file says is dropped silently; the file and the command line accept the same shapes
# ----------------------------------------------------------------------------------------------------------------------


def _validate(tmp_path, capsys, text, *args):
    """`litft validate FILE ARGS`: the exit code and stderr."""
    from litft.cli import main

    path = tmp_path / "r.yaml"
    path.write_text(text)
    code = main(["validate", str(path), *args])
    return code, capsys.readouterr().err


def test_a_key_given_twice_in_the_yaml_names_both_lines(tmp_path, capsys):
    code, err = _validate(tmp_path, capsys, "init: random\nmodel:\n  name: tiny-llama-1.1b\ntrain:\n  epochs: 1\n"
                                            "  micro_batch_size: 2\n  epochs: 2\n")
    assert code == 2
    assert "train.epochs: given twice, on lines 5 and 7" in err


def test_an_empty_yaml_says_it_is_empty(tmp_path, capsys):
    for text in ("", "# a comment and nothing else\n"):
        code, err = _validate(tmp_path, capsys, text)
        assert code == 2
        assert "r.yaml: the file is empty" in err
    code, _ = _validate(tmp_path, capsys, "{}\n", "--init", "random", "--model.name", "tiny-llama-1.1b")
    assert code == 0  # '{}' is a recipe of the defaults


def test_an_empty_section_is_named(tmp_path, capsys):
    code, err = _validate(tmp_path, capsys, "init: random\nmodel:\n  name: tiny-llama-1.1b\ntrain:\n")
    assert code == 2
    assert "train: the section is empty" in err


def test_the_same_setting_given_two_ways_is_refused(tmp_path, capsys):
    head = "init: random\nmodel:\n  name: tiny-llama-1.1b\n"
    code, err = _validate(tmp_path, capsys, head + "optimizer:\n  lr: 1.0e-4\n  init_args: {lr: 2.0e-4}\n")
    assert code == 2
    assert "optimizer.init_args.lr: given twice, as optimizer.lr and optimizer.init_args.lr" in err
    code, err = _validate(tmp_path, capsys, head, "--optimizer.lr", "1e-4", "--optimizer.init_args.lr", "2e-4")
    assert code == 2
    assert "optimizer.init_args.lr: given twice, as --optimizer.lr and --optimizer.init_args.lr" in err
    code, err = _validate(tmp_path, capsys, head, "--optimizer.init_args", '{"lr": 1e-4}', "--optimizer.lr", "2e-4")
    assert code == 2
    assert "optimizer.init_args.lr: given twice, as --optimizer.init_args" in err
    code, err = _validate(tmp_path, capsys, head, "--optimizer", "torch.optim.SGD", "--optimizer.class_path",
                          "torch.optim.AdamW")
    assert code == 2
    assert "optimizer.class_path: given twice, as --optimizer and --optimizer.class_path" in err
    with pytest.raises(ConfigError, match="optimizer.init_args.lr: given twice"):
        load_recipe("tiny-llama-lora", validate_paths=False, optimizer={"lr": 1e-4, "init_args": {"lr": 2e-4}})


def test_the_optimizer_shorthand_reads_the_same_in_yaml_and_on_the_command_line(tmp_path):
    path = tmp_path / "r.yaml"
    for yaml_text, cli in [
        ("optimizer: {lr: 1.0e-4}\n", ["--optimizer.lr", "1e-4"]),
        ("optimizer:\n  class_path: torch.optim.SGD\n  momentum: 0.9\n",
         ["--optimizer", "torch.optim.SGD", "--optimizer.momentum", "0.9"]),
        ("optimizer: torch.optim.SGD\n", ["--optimizer", "torch.optim.SGD"]),
    ]:
        path.write_text("init: random\nmodel:\n  name: tiny-llama-1.1b\n" + yaml_text)
        from_yaml = load_recipe(path, validate_paths=False)
        path.write_text("init: random\nmodel:\n  name: tiny-llama-1.1b\n")
        from_cli = load_recipe(path, args=cli, validate_paths=False)
        assert from_yaml.optimizer == from_cli.optimizer, yaml_text
    assert from_yaml.optimizer.class_path == "torch.optim.SGD"
    shorthand = load_recipe("tiny-llama-full", validate_paths=False, optimizer={"lr": 1e-5})
    assert shorthand.optimizer.init_args["lr"] == 1e-5


def test_missing_weights_name_the_recipes_own_model_and_a_whole_alternative(capsys):
    """The advice names the OpenLLaMA repo (not another model's), and the random-weights alternative it gives is
    complete: following it validates, files included."""
    from litft.cli import main

    assert main(["validate", "open-llama-7b-lora", "--check-files"]) == 2
    err = capsys.readouterr().err
    assert "`litgpt download openlm-research/open_llama_7b`" in err and "TinyLlama" not in err
    assert "--init random --model.tokenizer_dir litft:demo/model" in err
    load_recipe("open-llama-7b-lora", args=["--init", "random", "--model.tokenizer_dir", "litft:demo/model"])
    # init random without a tokenizer: the message says which key to set
    with pytest.raises(ConfigError) as info:
        load_recipe("open-llama-7b-lora", args=["--init", "random"])
    assert len(info.value.problems) == 1 and "set model.tokenizer_dir" in info.value.problems[0]


def test_a_missing_tokenizer_is_reported_once(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model_config.yaml").write_text("name: x\n")
    (tmp_path / "ckpt" / "lit_model.pth").write_bytes(b"")
    problems = _problems(tmp_path, f"model:\n  checkpoint_dir: {tmp_path}/ckpt\n")
    assert [p for p in problems if "tokenizer" in p] == [
        f"model.checkpoint_dir: '{tmp_path}/ckpt' lacks tokenizer.json or tokenizer.model; a LitGPT checkpoint"
        " directory holds lit_model.pth, model_config.yaml and the tokenizer (`litgpt download` writes all three)"]


def test_negative_evaluation_and_logging_counts_are_refused(tiny_recipe):
    with pytest.raises(ConfigError) as info:
        tiny_recipe(eval={"max_batches": -1}, logging={"skip_steps": -2, "gpu_sample_interval": -0.5})
    assert info.value.problems == [
        "eval.max_batches: must be at least 1 or null (the whole set), got -1",
        "logging.skip_steps: must be 0 or more, got -2",
        "logging.gpu_sample_interval: must be 0 or more, got -0.5",
    ]


def test_yaml_syntax_errors_are_one_line_with_the_place(tmp_path, capsys):
    from litft.cli import main

    recipe = tmp_path / "tabs.yaml"
    recipe.write_text("train:\n\tmicro_batch_size: 4\n")
    assert main(["validate", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "line 2, column 1" in err and "spaces, not tabs" in err


def test_litgpt_short_forms_of_optimizer_and_quantize(tmp_path):
    """What the lab types with LitGPT: --optimizer SGD (a class of torch.optim), --quantize bnb.nf4 (which makes a
    LoRA recipe QLoRA, as LitGPT's finetune_lora does), on the command line, as keywords and in YAML."""
    sgd = load_recipe("tiny-llama-lora", args=["--optimizer", "SGD", "--optimizer.lr", "0.01"], validate_paths=False)
    assert sgd.optimizer.class_path == "torch.optim.SGD" and sgd.optimizer.init_args["lr"] == 0.01
    assert load_recipe("tiny-llama-lora", optimizer="AdamW", validate_paths=False).optimizer.class_path == (
        "torch.optim.AdamW")
    for recipe in (load_recipe("tiny-llama-lora", args=["--quantize", "bnb.nf4"], validate_paths=False),
                   load_recipe("tiny-llama-lora", args=["--quantize=bnb.nf4"], validate_paths=False),
                   load_recipe("tiny-llama-lora", quantize="bnb.nf4", validate_paths=False)):
        assert (recipe.method, recipe.quantize) == ("qlora", "nf4")
    path = tmp_path / "lab.yaml"
    path.write_text("model: {name: tiny-llama-1.1b}\ninit: random\nmethod: lora\nquantize: bnb.nf4-dq\n"
                    "optimizer: SGD\n")
    recipe = load_recipe(path, validate_paths=False)
    assert (recipe.method, recipe.quantize, recipe.optimizer.class_path) == ("qlora", "nf4-dq", "torch.optim.SGD")
    with pytest.raises(ConfigError, match="'bnb.int8' is not one of"):
        load_recipe("tiny-llama-lora", args=["--quantize", "bnb.int8"], validate_paths=False)


LITGPT_LAB_CONFIG = """\
checkpoint_dir: CKPT
out_dir: out/finetune/lora-tiny-llama-1.1b
precision: 32-true
quantize:
devices: 1
num_nodes: 1
lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_query: true
lora_key: true
lora_value: true
lora_projection: true
lora_mlp: true
lora_head: true
data:
  class_path: litgpt.data.JSON
  init_args: {json_path: DATA, mask_prompt: false, val_split_fraction: 0.5, prompt_style: alpaca, ignore_index: -100,
              seed: 42, num_workers: 0}
train: {save_interval: 100, log_interval: 1, global_batch_size: 16, micro_batch_size: 4, lr_warmup_steps: 10,
        epochs: 1, max_tokens: null, max_steps: 2, max_seq_length: 96, tie_embeddings: null, max_norm: null,
        min_lr: 6.0e-05}
eval: {interval: 25, max_new_tokens: 100, max_iters: 100, initial_validation: false, final_validation: false}
logger_name: csv
seed: 1337
optimizer:
  class_path: torch.optim.AdamW
  init_args: {lr: 0.0002, weight_decay: 0.0, betas: [0.9, 0.95]}
"""


def test_a_litgpt_lab_config_reads_as_a_recipe_with_its_mapping_printed(tmp_path, capsys, tiny_checkpoint_dir,
                                                                         tiny_data_path):
    from litft.cli import main

    path = tmp_path / "lab.yaml"
    path.write_text(LITGPT_LAB_CONFIG.replace("CKPT", str(tiny_checkpoint_dir)).replace("DATA", str(tiny_data_path)))
    recipe = load_recipe(path)
    err = capsys.readouterr().err
    assert "is a LitGPT finetune config" in err and "lora_r -> lora.r = 32" in err
    assert "data.init_args.seed -> (not used" in err
    assert (recipe.method, recipe.lora.r, recipe.lora.alpha, recipe.lora.targets) == (
        "lora", 32, 16, ["q", "k", "v", "o", "mlp", "head"])
    assert (recipe.data.path, recipe.data.val_split, recipe.data.max_seq_length) == (str(tiny_data_path), 0.5, 96)
    assert recipe.train.max_grad_norm is None and recipe.train.min_lr_ratio == pytest.approx(0.3)
    assert recipe.train.warmup_steps == 10 and recipe.eval.max_batches == 100 and not recipe.logging.tensorboard
    assert main(["convert", str(path), "--out", str(tmp_path / "recipe.yaml")]) == 0
    assert load_recipe(tmp_path / "recipe.yaml").lora.targets == recipe.lora.targets  # a litft recipe now
    qlora = tmp_path / "qlora.yaml"
    qlora.write_text(path.read_text().replace("quantize:", "quantize: bnb.nf4"))
    assert (load_recipe(qlora, validate_paths=False).method, load_recipe(qlora, validate_paths=False).quantize) == (
        "qlora", "nf4")


def test_litgpt_settings_without_an_equivalent_are_refused_by_name(tmp_path, capsys):
    from litft.cli import main

    path = tmp_path / "lab.yaml"
    path.write_text("checkpoint_dir: x\nlogger_name: wandb\ntrain: {max_tokens: 1000}\n"
                    "data: {class_path: litgpt.data.Deita}\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "logger_name: wandb" in err and "train.max_tokens: 1000" in err and "litgpt.data.Deita" in err
