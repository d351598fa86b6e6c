"""The `litft` command: thin wrappers over the library. Every failure prints one message and exits with the code of
its kind (docs/design.md): 2 config/usage, 3 non-finite loss, 4 out of memory, 5 data, 6 checkpoint/IO, 1 internal."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

from litft import units
from litft.errors import ConfigError, LitftError

USAGE = """usage: litft <command> [options]

commands:
  ls [--model M] [--method full|lora|qlora]   the shipped recipes (est. GiB once `litft estimate` traced one)
  show NAME|PATH [--resolved]                 a recipe's YAML (with its comments), or the resolved config
  cp NAME DEST [--force]                      copy a shipped recipe to edit it
  validate NAME|PATH [--check-files] [--key value ...]
                                              check a recipe and overrides without running it; --check-files:
                                              the files it names must be there too
  estimate --config NAME|PATH [--gpu-memory 80] [--json] [--key value ...]
                                              predicted GPU memory, part by part, and what would fit
  finetune --config NAME|PATH [--key value ...] [--overwrite] [--resume auto|CHECKPOINT]
                                              run a recipe; overrides are dotted keys: --train.micro_batch_size 8
  sweep --config NAME|PATH --grid KEY=V1,V2 [--grid ...] [--out DIR] [--repeat N] [--timeout S] [--dry-run]
        [--rerun] [--key value ...]
  sweep --plan FILE [--out DIR] [--timeout S] [--dry-run] [--rerun] [--cpu-demo] [--key value ...]
                                              every run in its own process; out of memory is a row; started again,
                                              it goes on where it stopped
  find-batch-size --config NAME|PATH [--memory-cap 32GiB] [--max 256] [--steps 3] [--write RECIPE.yaml]
                                              the largest micro batch that fits, found by running it
  convert FILE [--out RECIPE.yaml]            a LitGPT finetune config as a litft recipe (finetune --config takes it
                                              as it is, too)
  generate OUT_DIR --prompt TEXT [--max-new-tokens N --temperature T --top-k K --top-p P]
  generate OUT_DIR --prompts FILE.jsonl --output FILE.jsonl
                                              answers from a run's model, with time to first token and tok/s
  chat OUT_DIR [--ui [--port 7860]]           a terminal chat with a run's model, or a web chat (Gradio)
  evaluate OUT_DIR [--data FILE] [--base] [--samples 20]
                                              perplexity, BLEU and ROUGE-L (and the base model's), into eval.json
  export OUT_DIR --format hf|litgpt --out DIR the model (adapters merged) for transformers, or as a LitGPT folder
  env                                         versions, GPUs and what litft can use on this machine
  compare PATH... [--format md|csv|json] [--fields f1,f2] [--by KEY] [--sort [-]KEY] [--plot DIR]
                                              a table (and charts) of runs: run dirs or sweep/bench dirs

`litft finetune --help` lists every recipe key with its meaning.
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        import litft

        print(f"litft {litft.__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    handler = COMMANDS.get(command)
    if handler is None:
        close = difflib.get_close_matches(command, list(COMMANDS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        print(f"litft: unknown command '{command}'.{hint}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return handler(rest) or 0
    except LitftError as err:
        print(f"litft {command}: {err.kind}: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"litft {command}: interrupted", file=sys.stderr)
        return 130


def _take_flag(args: list[str], flag: str) -> bool:
    if flag in args:
        args.remove(flag)
        return True
    return False


def _take_option(args: list[str], option: str) -> str | None:
    """Remove `--option value` or `--option=value` from args and return the value."""
    for i, token in enumerate(args):
        if token == option:
            if i + 1 >= len(args):
                raise ConfigError(f"{option} needs a value")
            value = args[i + 1]
            del args[i : i + 2]
            return value
        if token.startswith(option + "="):
            del args[i]
            return token.split("=", 1)[1]
    return None


# ----------------------------------------------------------------------------------------------------------------------


def cmd_finetune(args: list[str]) -> int:
    from litft import strategy
    from litft.recipe import build_parser, load_recipe

    if "-h" in args or "--help" in args:
        parser = build_parser()
        run = parser.add_argument_group("the run (options of litft finetune, not recipe keys)")
        run.add_argument("--overwrite", action="store_true",
                         help="Replace the run already in out_dir (its config, metrics and result).")
        run.add_argument("--resume", metavar="auto|CHECKPOINT",
                         help="Continue from a committed checkpoint: 'auto' takes the newest in out_dir (and starts"
                              " from the beginning when there is none), or give a checkpoint folder.")
        parser.print_help()
        return 0
    overwrite = _take_flag(args, "--overwrite")
    resume = _take_option(args, "--resume")
    print_config = _take_flag(args, "--print_config")
    config = _take_option(args, "--config")
    if config is None:
        raise ConfigError("finetune needs --config NAME|PATH (a shipped recipe name, or a YAML file); `litft ls`")
    if print_config:
        from litft.recipe import recipe_to_yaml

        print(recipe_to_yaml(load_recipe(config, args=args, validate_paths=False)), end="")
        return 0
    recipe = load_recipe(config, args=args)
    from litft.train import finetune

    # Fabric starts the other ranks by running this process's command line again: right when that command is
    # `litft ...`, wrong when cmd_finetune is called inside another program (a test runner, a notebook), whose
    # command line would then run again; there the ranks are spawned
    strategy.LAUNCHED_FROM_CLI = _process_is_the_litft_command()
    try:
        result = finetune(recipe, overwrite=overwrite, resume=resume)
    finally:
        strategy.LAUNCHED_FROM_CLI = False
    return 0 if result.status == "ok" else 1


def _process_is_the_litft_command() -> bool:
    """True when this process was started as `litft` (the console script) or `python -m litft.cli`."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return (spec is not None and spec.name == "litft.cli") or Path(sys.argv[0]).name == "litft"


def cmd_estimate(args: list[str]) -> int:
    """Predicted GPU memory of a recipe, part by part, a verdict against a GPU's memory, and what would fit."""
    import json as json_module

    from litft.memory import estimate_memory, what_would_fit
    from litft.memory.ledger import sized_for
    from litft.recipe import load_recipe, parse_memory_cap

    gpu_memory = _take_option(args, "--gpu-memory")
    retired_options = {"--sharding": "--strategy fsdp or deepspeed_stage_3",
                       "--offload": "--strategy deepspeed_stage_3_offload"}
    for retired, key in retired_options.items():
        if _take_option(args, retired) is not None:
            raise ConfigError(f"{retired}: litft estimate plans the recipe's strategy; set it as a recipe key,"
                              f" e.g. {key}")
    as_json = _take_flag(args, "--json")
    config = _take_option(args, "--config")
    if config is None:
        if args and not args[0].startswith("--"):
            config = args.pop(0)
        else:
            raise ConfigError("estimate needs a recipe: litft estimate --config NAME|PATH [--gpu-memory 80] [overrides]")
    recipe = load_recipe(config, args=args, validate_paths=False)
    budget = None
    if gpu_memory is not None:
        try:
            budget = parse_memory_cap(gpu_memory if gpu_memory.lower().endswith("gib") else f"{gpu_memory}GiB", 1.0)
        except ValueError as err:
            raise ConfigError(f"--gpu-memory: {err}") from None
    elif recipe.memory_cap is not None:
        import torch

        total = torch.cuda.get_device_properties(0).total_memory / units.GIB if torch.cuda.is_available() else 80.0
        budget = parse_memory_cap(recipe.memory_cap, total)
    from litft.memory.ledger import strategy_sharding

    est = estimate_memory(recipe)
    sharding, offload = strategy_sharding(recipe)
    sharded = sharding != "none"
    fits = what_would_fit(recipe, budget) if budget is not None and est.device_gib > budget and not sharded else []
    if as_json:
        print(json_module.dumps({"estimate": est.as_dict(), "budget_gib": budget, "would_fit": fits,
                                 "sharding": sharding, "offload": offload}, indent=2))
        return 0
    print(f"{config}: {recipe.method} {recipe.precision}, {recipe.batch_arithmetic()}")
    if sharded or offload != "none":
        print(f"strategy: {recipe.strategy.name} over {recipe.world_size} GPU(s), sharded like {sharding}, offload"
              f" {offload}; host RAM {units.gib(est.host_gib)} per node")
    print(f"predicted GPU memory per device ({recipe.world_size} device(s)), {sized_for(est.tokens)}"
          f" ({_positions_bound(recipe)}):")
    print("\n".join(est.lines()))
    for note in est.notes:
        print(f"  note: {note}")
    print("  note: sized for the recipe's bound; a run sizes its prediction for the largest micro-batch its data"
          " forms, and its summary says how many positions that is")
    if budget is not None:
        verdict = "fits" if est.device_gib <= budget else "does NOT fit"
        print(f"verdict: {units.gib(est.device_gib)} {verdict} in {units.gib(budget)}")
        if fits:
            print("changes that would fit, least intrusive first (predicted on the device, saving):")
            for f in fits:
                print(f"  - {f['change']}: {units.gib(f['device_gib'])} (-{units.gib(f['saving_gib'])})")
        elif est.device_gib > budget:
            print("no single change or pair of changes fits; consider more GPUs with sharding (e.g. --devices 4"
                  " --strategy fsdp) or a smaller model")
    return 0


def _positions_bound(recipe) -> str:
    """Where `litft estimate`'s positions per micro-batch come from (litft.memory.estimate_memory's default)."""
    d = recipe.data
    if d.packing and d.pack_steps and d.pack_capacity is not None:
        return f"data.pack_capacity {d.pack_capacity}"
    return f"micro_batch_size {recipe.train.micro_batch_size} x max_seq_length {d.max_seq_length}"


def cmd_validate(args: list[str]) -> int:
    from litft.recipe import load_recipe, resolve_path, validate

    if not args or args[0].startswith("--"):
        raise ConfigError("validate needs a recipe: litft validate NAME|PATH [--key value ...]")
    source, overrides = args[0], args[1:]
    strict_files = _take_flag(overrides, "--check-files")
    recipe = load_recipe(source, args=overrides, validate_paths=False)
    file_problems = [p for p in validate(recipe, check_paths=True) if p not in validate(recipe, check_paths=False)]
    if strict_files and file_problems:
        raise ConfigError(file_problems, source=source)
    print(f"valid: {source}" + (" (and the files it names)" if strict_files else ""))
    print(f"  {recipe.method} on {recipe.model.name or resolve_path(recipe.model.checkpoint_dir)}, init {recipe.init},"
          f" precision {recipe.precision}, {recipe.devices} device(s), strategy {recipe.strategy}")
    print(f"  {recipe.batch_arithmetic()}")
    for problem in file_problems:
        print(f"  note (files; --check-files makes it an error): {problem}")
    return 0


def cmd_ls(args: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from litft.recipe import load_recipe, recipe_names

    model_filter = _take_option(args, "--model")
    method_filter = _take_option(args, "--method")
    if args:
        raise ConfigError(f"ls: unexpected arguments {' '.join(args)} (filters: --model M, --method full|lora|qlora)")
    table = Table(title="litft recipes (litft show NAME for details)", title_justify="left")
    for column in ("name", "model", "method", "precision", "optimizer", "micro x accum x devices", "seq",
                   "est. on the device (positions per micro-batch)", "about"):
        table.add_column(column)
    from litft.memory import estimate_memory

    for name in recipe_names():
        recipe = load_recipe(name, validate_paths=False)
        model = recipe.model.name or str(recipe.model.checkpoint_dir)
        if model_filter and model_filter.lower().replace("-", "_") not in model.lower().replace("-", "_"):
            continue
        if method_filter and recipe.method != method_filter:
            continue
        method = recipe.method + (f" ({recipe.quantize})" if recipe.quantize else "")
        table.add_row(
            name, model, method, recipe.precision, recipe.optimizer.class_path.rpartition(".")[2],
            f"{recipe.train.micro_batch_size} x {recipe.grad_accum} x {recipe.devices}",
            str(recipe.data.max_seq_length), _known_estimate(estimate_memory, recipe), _recipe_summary(name),
        )
    Console(width=200 if not sys.stdout.isatty() else None).print(table)
    return 0


def _known_estimate(estimate_memory, recipe) -> str:
    """Predicted memory on each GPU, with the positions per micro-batch it is sized for, when the activation trace
    is cached (after `litft estimate` or a run), else '-'."""
    try:
        est = estimate_memory(recipe, cached_only=True)
    except Exception:
        return "-"
    return f"{units.gib(est.device_gib)} ({units.count(est.tokens)})" if est is not None else "-"


def _recipe_summary(name: str) -> str:
    """The recipe's one-line teaching point: its header line starting with '# About:'."""
    from litft.recipe import find_recipe

    for line in find_recipe(name).read_text(encoding="utf-8").splitlines():
        if line.startswith("# About:"):
            return line[len("# About:") :].strip()
    return ""


def cmd_show(args: list[str]) -> int:
    from litft.recipe import find_recipe, load_recipe, recipe_to_yaml

    resolved = _take_flag(args, "--resolved")
    if len(args) != 1:
        raise ConfigError("show needs one recipe: litft show NAME|PATH [--resolved]")
    if resolved:
        print(recipe_to_yaml(load_recipe(args[0], validate_paths=False)), end="")
    else:
        print(find_recipe(args[0]).read_text(encoding="utf-8"), end="")
    return 0


def cmd_cp(args: list[str]) -> int:
    from litft.recipe import find_recipe

    force = _take_flag(args, "--force")
    if len(args) != 2:
        raise ConfigError("cp needs a recipe and a destination: litft cp NAME ./mine.yaml [--force]")
    source = find_recipe(args[0])
    dest = Path(args[1])
    if dest.is_dir():
        dest = dest / source.name
    if dest.exists() and not force:
        raise ConfigError(f"'{dest}' exists; pass --force to replace it")
    from litft.files import make_dir, write_text_atomic

    make_dir(dest.parent, "the recipe's folder", setting="the destination")
    write_text_atomic(dest, source.read_text(encoding="utf-8"), what="the recipe copy", setting="the destination")
    print(f"copied {source.name} -> {dest}; run it with: litft finetune --config {dest}")
    return 0


def cmd_env(args: list[str]) -> int:
    import torch

    from litft.metrics import environment

    env = environment()
    for key, value in env.items():
        print(f"{key:>14}: {value}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"{'gpu ' + str(i):>14}: {p.name}, {units.size(p.total_memory)}, {p.multi_processor_count} SMs,"
                  f" bf16 {'yes' if torch.cuda.is_bf16_supported() else 'no'}")
        if torch.distributed.is_nccl_available():
            print(f"{'nccl':>14}: {'.'.join(map(str, torch.cuda.nccl.version()))}")
    else:
        print(f"{'note':>14}: no CUDA GPU: litft runs on the CPU (32-true, bf16-*), qlora needs a GPU")
    return 0


def cmd_compare(args: list[str]) -> int:
    from litft import report

    if "-h" in args or "--help" in args:
        print(report.__doc__)
        return 0
    fmt = _take_option(args, "--format") or "md"
    fields = _take_option(args, "--fields")
    by = _take_option(args, "--by")
    sort = _take_option(args, "--sort")
    plot_dir = _take_option(args, "--plot")
    options = [a for a in args if a.startswith("--")]
    if options:
        known = ["--format", "--fields", "--by", "--sort", "--plot"]
        hints = [f"'{o}'" + (f" (did you mean '{c[0]}'?)" if (c := difflib.get_close_matches(o.split("=")[0], known,
                 n=1)) else "") for o in options]
        raise ConfigError(f"compare: unknown option {', '.join(hints)}; options: {', '.join(known)}")
    if not args:
        raise ConfigError("compare needs at least one PATH: a run dir (with result.json) or a sweep/bench dir;"
                          " litft compare --help")
    return report.compare(args, fmt=fmt, fields=fields, by=by, plot_dir=plot_dir, sort=sort)


def cmd_sweep(args: list[str]) -> int:
    """One recipe over a grid of settings, each run in its own process (litft.sweep)."""
    from litft import sweep

    if "-h" in args or "--help" in args:
        print(sweep.__doc__)
        return 0
    config = _take_option(args, "--config")
    plan = _take_option(args, "--plan")
    out = _take_option(args, "--out")
    timeout = _take_option(args, "--timeout")
    dry_run = _take_flag(args, "--dry-run")
    rerun = _take_flag(args, "--rerun")
    cpu_demo = _take_flag(args, "--cpu-demo")
    repeat = _take_option(args, "--repeat")
    specs = []
    while (spec := _take_option(args, "--grid")) is not None:
        specs.append(spec)
    try:
        seconds = float(timeout) if timeout is not None else None
    except ValueError:
        raise ConfigError(f"--timeout: expected seconds, got '{timeout}'") from None
    if plan is not None:
        if config is not None or specs or repeat is not None:
            raise ConfigError("sweep --plan FILE lists its runs itself: leave out --config, --grid and --repeat")
        # overrides on the command line apply to every run of the plan
        return sweep.run_plan(plan, out, overrides=args, timeout=seconds, cpu_demo=cpu_demo, dry_run=dry_run,
                              rerun=rerun)
    if cpu_demo:
        raise ConfigError("sweep --cpu-demo runs a plan's runs on the CPU: give --plan FILE")
    if config is None:
        raise ConfigError("sweep needs --config NAME|PATH and at least one --grid KEY=V1,V2,..., or --plan FILE;"
                          " litft sweep --help")
    grid = sweep.parse_grid(specs)
    if repeat is not None and not repeat.isdigit():
        raise ConfigError(f"--repeat: expected a number of runs per combination, got '{repeat}'")
    out = out or f"out/sweep-{Path(config).stem}"
    return sweep.run_sweep(config, grid, out, common=args, timeout=seconds, dry_run=dry_run,
                           repeat=int(repeat) if repeat else 1, rerun=rerun)


def cmd_convert(args: list[str]) -> int:
    """A LitGPT finetune config (or any recipe) as the litft recipe it reads as, in YAML."""
    from litft.recipe import load_recipe, recipe_to_yaml

    out = _take_option(args, "--out")
    if len(args) != 1 or args[0].startswith("--"):
        raise ConfigError("convert needs one file: litft convert LITGPT_CONFIG.yaml [--out RECIPE.yaml]")
    text = recipe_to_yaml(load_recipe(args[0], validate_paths=False))
    if out is None:
        print(text, end="")
        return 0
    from litft.files import write_text_atomic

    write_text_atomic(Path(out), text, what="the converted recipe", setting="--out")
    print(f"wrote {out}")
    return 0


def cmd_find_batch_size(args: list[str]) -> int:
    """The largest micro batch that fits, found by running it (litft.batch_size)."""
    from litft import batch_size

    if "-h" in args or "--help" in args:
        print(batch_size.__doc__)
        return 0
    config = _take_option(args, "--config")
    cap = _take_option(args, "--memory-cap")
    maximum = _take_option(args, "--max") or "256"
    steps = _take_option(args, "--steps") or "3"
    write = _take_option(args, "--write")
    if config is None:
        raise ConfigError("find-batch-size needs --config NAME|PATH; litft find-batch-size --help")
    if not (maximum.isdigit() and int(maximum) >= 1 and steps.isdigit() and int(steps) >= 1):
        raise ConfigError(f"--max and --steps: expected whole numbers from 1, got {maximum} and {steps}")
    best, trials = batch_size.find_batch_size(config, args, cap, int(maximum), int(steps))
    if best is None:
        print("no micro batch fits, not even 1: see `litft estimate` for what takes the memory")
        return 4
    rate = next((t["tokens_per_sec"] for t in trials if t["micro"] == best), None)
    print(f"largest micro batch that fits: {best}" + (f" ({units.rate(rate)} tok/s)" if rate else "")
          + f", after {len(trials)} trial(s)")
    if write is not None:
        from litft.files import write_text_atomic
        from litft.recipe import load_recipe, recipe_to_yaml

        recipe = load_recipe(config, args=args + (["--memory_cap", cap] if cap else []), validate_paths=False)
        per_step = best * recipe.world_size
        global_batch = max(per_step, -(-recipe.train.global_batch_size // per_step) * per_step)
        recipe = load_recipe(config, args=args + (["--memory_cap", cap] if cap else []) + [
            "--train.micro_batch_size", str(best), "--train.global_batch_size", str(global_batch)],
            validate_paths=False)
        write_text_atomic(Path(write), recipe_to_yaml(recipe), what="the recipe copy", setting="--write")
        print(f"wrote {write}: micro_batch_size {best}, global_batch_size {global_batch}")
    return 0


def _generation_settings(args: list[str]) -> dict:
    """--max-new-tokens, --temperature, --top-k, --top-p from the arguments."""
    settings = {}
    for option, key, kind in (("--max-new-tokens", "max_new_tokens", int), ("--temperature", "temperature", float),
                              ("--top-k", "top_k", int), ("--top-p", "top_p", float)):
        value = _take_option(args, option)
        if value is not None:
            try:
                settings[key] = kind(value)
            except ValueError:
                raise ConfigError(f"{option}: expected a number, got '{value}'") from None
    if settings.get("temperature", 0.0) < 0 or not 0.0 <= settings.get("top_p", 1.0) <= 1.0:
        raise ConfigError("--temperature must be 0 or more (0: greedy) and --top-p within [0, 1]")
    return settings


def _model_source(args: list[str], command: str) -> str:
    if len(args) != 1 or args[0].startswith("--"):
        extra = f" (not understood: {' '.join(args[1:])})" if len(args) > 1 else ""
        raise ConfigError(f"{command} needs one OUT_DIR (a run's) or checkpoint folder{extra}; litft {command} --help")
    return args[0]


def cmd_generate(args: list[str]) -> int:
    """Answer a prompt (or a JSONL file of prompts) with a run's model (litft.use)."""
    from litft import use

    if "-h" in args or "--help" in args:
        print("litft generate OUT_DIR|CHECKPOINT --prompt TEXT [--max-new-tokens 128] [--temperature 0] [--top-k K]"
              " [--top-p P] [--device cpu|cuda]\n"
              "litft generate OUT_DIR --prompts PROMPTS.jsonl --output ANSWERS.jsonl [...]\n\n" + use.__doc__)
        return 0
    prompt = _take_option(args, "--prompt")
    prompts = _take_option(args, "--prompts")
    output = _take_option(args, "--output")
    device = _take_option(args, "--device")
    settings = _generation_settings(args)
    source = _model_source(args, "generate")
    if (prompt is None) == (prompts is None) or (prompts is not None and output is None):
        raise ConfigError("generate needs --prompt TEXT, or --prompts FILE.jsonl with --output FILE.jsonl")
    loaded = use.load_model(source, device=device)
    print(f"model: {loaded.folder} ({loaded.weights}, {loaded.device})", file=sys.stderr)
    if prompts is not None:
        results = use.generate_file(loaded, Path(prompts), Path(output), **settings)
        tokens = sum(r.new_tokens for r in results)
        seconds = sum(r.seconds for r in results)
        print(f"wrote {len(results)} answers to {output}: {tokens} tokens in {seconds:.1f} s")
        return 0
    result = use.generate(loaded, prompt, **settings)
    print(result.text)
    print(result.timing_line(), file=sys.stderr)
    return 0


def cmd_chat(args: list[str]) -> int:
    """A terminal chat with a run's model (litft.use.chat)."""
    from litft import use

    if "-h" in args or "--help" in args:
        print("litft chat OUT_DIR|CHECKPOINT [--max-new-tokens 256] [--temperature 0.7] [--top-k K] [--top-p P]"
              " [--device cpu|cuda]\nlitft chat OUT_DIR --ui [--host 127.0.0.1] [--port 7860]\n\nEach line typed is"
              " a prompt; the answer streams back. An empty line or Ctrl-D ends. --ui serves a web chat (Gradio)"
              " with the generation settings as sliders.")
        return 0
    device = _take_option(args, "--device")
    ui = _take_flag(args, "--ui")
    host = _take_option(args, "--host") or "127.0.0.1"
    port = _take_option(args, "--port") or "7860"
    if not port.isdigit():
        raise ConfigError(f"--port: expected a port number, got '{port}'")
    settings = {"max_new_tokens": 256, "temperature": 0.7, **_generation_settings(args)}
    loaded = use.load_model(_model_source(args, "chat"), device=device)
    if ui:
        print(f"litft chat: serving {loaded.folder} at http://{host}:{port} (Ctrl-C stops)")
        use.chat_ui(loaded, host=host, port=int(port))
        return 0
    use.chat(loaded, **settings)
    return 0


def cmd_evaluate(args: list[str]) -> int:
    """Perplexity, BLEU and ROUGE-L of a run's model, and of its base with --base (litft.evaluate)."""
    from litft import evaluate

    if "-h" in args or "--help" in args:
        print("litft evaluate OUT_DIR [--data FILE] [--base] [--samples 20] [--max-new-tokens 64] [--max-batches N]"
              " [--device cpu|cuda]\n\n" + evaluate.__doc__)
        return 0
    data = _take_option(args, "--data")
    base = _take_flag(args, "--base")
    device = _take_option(args, "--device")
    numbers = {}
    for option, default in (("--samples", "20"), ("--max-new-tokens", "64"), ("--max-batches", None)):
        value = _take_option(args, option) or default
        if value is not None and not value.isdigit():
            raise ConfigError(f"{option}: expected a whole number, got '{value}'")
        numbers[option] = int(value) if value is not None else None
    out_dir = _model_source(args, "evaluate")
    result = evaluate.evaluate(out_dir, data, base=base, samples=numbers["--samples"],
                               max_new_tokens=numbers["--max-new-tokens"], max_batches=numbers["--max-batches"],
                               device=device)
    print(evaluate.table(result))
    print(f"wrote {Path(out_dir) / 'eval.json'}")
    return 0


def cmd_export(args: list[str]) -> int:
    """A run's model (adapters merged) as a Hugging Face transformers folder or a LitGPT checkpoint (litft.use)."""
    from litft import use

    if "-h" in args or "--help" in args:
        print("litft export OUT_DIR|CHECKPOINT --format hf|litgpt --out DIR\n\n" + use.export.__doc__)
        return 0
    fmt = _take_option(args, "--format") or "hf"
    out = _take_option(args, "--out")
    if out is None:
        raise ConfigError("export needs --out DIR (where the exported model goes)")
    folder = use.export(_model_source(args, "export"), out, fmt)
    print(f"wrote {folder} ({'Hugging Face transformers' if fmt == 'hf' else 'LitGPT checkpoint'})")
    return 0


COMMANDS = {
    "finetune": cmd_finetune,
    "find-batch-size": cmd_find_batch_size,
    "convert": cmd_convert,
    "sweep": cmd_sweep,
    "validate": cmd_validate,
    "estimate": cmd_estimate,
    "ls": cmd_ls,
    "show": cmd_show,
    "cp": cmd_cp,
    "env": cmd_env,
    "compare": cmd_compare,
    "generate": cmd_generate,
    "chat": cmd_chat,
    "evaluate": cmd_evaluate,
    "export": cmd_export,
}

if __name__ == "__main__":
    sys.exit(main())
