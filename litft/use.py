"""Using a fine-tuned model: load a run's result (`load_model`), generate from it (`generate`, `stream`,
`generate_file`), chat with it in the terminal (`chat`), and export it (`export`). `litft generate`, `litft chat` and
`litft export` are these functions; `litft evaluate` is litft.evaluate.

What a run leaves is loaded as it is: OUT_DIR/final/merged (a merged LoRA) if there, else OUT_DIR/final with its full
weights (lit_model.pth) or its adapter (lit_model.pth.lora) over the base checkpoint the run trained on (named in
final/hyperparameters.yaml), merged in memory; a plain LitGPT checkpoint folder works too. The prompt style is the
run's (final/prompt_style.yaml), so a prompt is wrapped as the model saw its training samples. A QLoRA run's adapter
is merged into the base weights in 16 bits: generation does not quantize.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

from litft import metrics
from litft.errors import CheckpointError, ConfigError, DataError


@dataclass
class LoadedModel:
    """A model ready to generate: LitGPT's GPT (adapters merged), its tokenizer and prompt style, and what it is."""

    model: torch.nn.Module
    tokenizer: object
    prompt_style: object
    folder: Path
    """The folder the weights and tokenizer came from."""
    weights: str
    """What was loaded: 'full', 'merged LoRA' or 'base + LoRA adapter (merged in memory)'."""
    device: torch.device

    @property
    def config(self):
        return self.model.config


@dataclass
class Generation:
    """One answer and how long it took. Time to first token includes the prompt's forward pass (prefill)."""

    prompt: str
    text: str
    prompt_tokens: int
    new_tokens: int
    time_to_first_token_s: float
    seconds: float
    tokens_per_sec: float | None
    """New tokens per second after the first (decoding speed)."""
    peak_memory_gib: float | None

    def timing_line(self) -> str:
        speed = f"{self.tokens_per_sec:,.1f} tok/s" if self.tokens_per_sec else "n/a tok/s"
        memory = f", peak {self.peak_memory_gib:.2f} GiB" if self.peak_memory_gib is not None else ""
        return (f"{self.new_tokens} token{'s' if self.new_tokens != 1 else ''} in {self.seconds:.2f} s: first token after"
                f" {1000 * self.time_to_first_token_s:.0f} ms, then {speed}{memory}")


def model_folder(source: str | Path) -> Path:
    """The folder to load from: a run's out_dir (its final/merged, else final/), or a checkpoint folder itself."""
    source = Path(source)
    if not source.is_dir():
        raise CheckpointError(f"'{source}' is not a folder: give a run's out_dir or a checkpoint folder")
    for folder in (source / "final" / "merged", source / "final", source / "merged", source):
        if (folder / "model_config.yaml").is_file() and any(
                (folder / name).is_file() for name in ("lit_model.pth", "lit_model.pth.lora")):
            return folder
    raise CheckpointError(f"'{source}' holds no model: a run's out_dir has final/ (after a finished run), a checkpoint"
                          " folder has model_config.yaml and lit_model.pth (or lit_model.pth.lora)")


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on a GPU that has it, float16 on an older one, float32 on the CPU."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16


def load_model(source: str | Path, device: torch.device | str | None = None,
               dtype: torch.dtype | None = None) -> LoadedModel:
    """The model of a run (or a checkpoint folder) on ``device`` in ``dtype``, adapters merged (see the module doc)."""
    from litgpt.config import Config
    from litgpt.prompts import PromptStyle, has_prompt_style, load_prompt_style
    from litgpt.tokenizer import Tokenizer

    folder = model_folder(source)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    config = Config.from_file(folder / "model_config.yaml")
    adapter = folder / "lit_model.pth.lora"
    if (folder / "lit_model.pth").is_file():
        model, weights = _full_model(config, folder / "lit_model.pth"), "full"
        if folder.name == "merged":
            weights = "merged LoRA"
    else:
        model, weights = _adapted_model(folder, adapter), "base + LoRA adapter (merged in memory)"
    model = model.to(device=device, dtype=dtype).eval()
    model.max_seq_length = model.config.block_size
    tokenizer = Tokenizer(folder)
    style = load_prompt_style(folder) if has_prompt_style(folder) else PromptStyle.from_config(config)
    return LoadedModel(model, tokenizer, style, folder, weights, device)


def _full_model(config, path: Path) -> torch.nn.Module:
    from litgpt.model import GPT

    from litft.model import read_state

    with torch.device("meta"):
        model = GPT(config)
    model.load_state_dict(read_state(path), strict=True, assign=True)
    return _with_rope_cache(model)


def _with_rope_cache(model: torch.nn.Module) -> torch.nn.Module:
    """A model built on the meta device and given its weights: its rotary tables (buffers no checkpoint holds)
    computed for real."""
    model.cos, model.sin = model.rope_cache(device=torch.device("cpu"))
    return model


def _adapted_model(folder: Path, adapter: Path) -> torch.nn.Module:
    """The base checkpoint named in hyperparameters.yaml with the adapter merged into its weights."""
    from litgpt.lora import Config

    from litft.checkpoint import merged_lora_model

    hparams_path = folder / "hyperparameters.yaml"
    hparams = yaml.safe_load(hparams_path.read_text()) if hparams_path.is_file() else {}
    base = hparams.get("checkpoint_dir")
    if not base or not (Path(base) / "lit_model.pth").is_file():
        raise CheckpointError(
            f"'{adapter}' is a LoRA adapter, and its base weights are not on disk"
            f" ({'hyperparameters.yaml names ' + repr(base) if base else 'the run started from random weights'});"
            " an adapter only works on the weights it was trained on")
    lora = {key: value for key, value in hparams.items() if key.startswith("lora_")}
    config = Config.from_file(folder / "model_config.yaml", **lora)
    return _with_rope_cache(merged_lora_model(Path(base) / "lit_model.pth", adapter, config))


# ----------------------------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------------------------


def encode_prompt(loaded: LoadedModel, prompt: str, raw: bool = False) -> torch.Tensor:
    """The prompt's token ids on the model's device: wrapped in the run's prompt style unless ``raw``."""
    text = prompt if raw else loaded.prompt_style.apply(prompt)
    return loaded.tokenizer.encode(text, device=loaded.device)


@torch.inference_mode()
def stream(loaded: LoadedModel, prompt: str, max_new_tokens: int = 128, temperature: float = 0.0,
           top_k: int | None = None, top_p: float = 1.0, raw: bool = False) -> Iterator[str]:
    """The answer, piece by piece as it is decoded (LitGPT's generate_fn, KV cache), until the end-of-sequence
    token, a stop sequence of the prompt style or max_new_tokens. temperature 0: greedy (the same answer each time)."""
    from litgpt.generate.base import generate_fn

    ids = encode_prompt(loaded, prompt, raw)
    model = loaded.model
    total = min(len(ids) + max_new_tokens, model.config.block_size)
    if total <= len(ids):
        raise DataError(f"the prompt takes {len(ids)} tokens, the model's whole context ({model.config.block_size});"
                        " shorten it")
    model.set_kv_cache(batch_size=1, max_seq_length=total, device=loaded.device)
    stop = (([loaded.tokenizer.eos_id],) if loaded.tokenizer.eos_id is not None else ()) + tuple(
        loaded.prompt_style.stop_tokens(loaded.tokenizer))
    tokens: list[int] = []
    shown = ""
    try:
        for token in generate_fn(model, ids, total, temperature=temperature, top_k=top_k, top_p=top_p,
                                 stop_tokens=stop, include_prompt=False, include_eos=False):
            tokens.extend(token.tolist())
            text = loaded.tokenizer.decode(torch.tensor(tokens))
            yield text[len(shown):]  # the new text (a token may complete a character only with the next)
            shown = text
    finally:
        model.clear_kv_cache()


def generate(loaded: LoadedModel, prompt: str, max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int | None = None, top_p: float = 1.0, raw: bool = False) -> Generation:
    """One answer with its timing: time to first token, decoding tok/s, peak GPU memory."""
    cuda = loaded.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(loaded.device)
        torch.cuda.synchronize(loaded.device)
    prompt_tokens = len(encode_prompt(loaded, prompt, raw))
    start = time.perf_counter()
    first = None
    pieces = []
    count = 0
    for piece in stream(loaded, prompt, max_new_tokens, temperature, top_k, top_p, raw):
        if first is None:
            first = time.perf_counter() - start
        pieces.append(piece)
        count += 1
    seconds = time.perf_counter() - start
    after_first = seconds - (first or 0.0)
    peak = metrics.memory_stats(loaded.device)["peak_allocated_gib"] if cuda else None
    return Generation(prompt=prompt, text="".join(pieces), prompt_tokens=prompt_tokens, new_tokens=count,
                      time_to_first_token_s=first or seconds, seconds=seconds,
                      tokens_per_sec=(count - 1) / after_first if count > 1 and after_first > 0 else None,
                      peak_memory_gib=peak)


def read_prompts(path: Path) -> list[dict]:
    """A JSONL file of prompts: each line an object with "prompt" (or an Alpaca "instruction" and optional "input")."""
    prompts = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise DataError(f"cannot read '{path}': {err.strerror or err}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}, line {number}: not JSON ({err.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt", row.get("instruction")), str):
            raise DataError(f"{path}, line {number}: expected an object with a \"prompt\" (or \"instruction\") string")
        prompts.append(row)
    if not prompts:
        raise DataError(f"{path}: no prompts (one JSON object per line, each with a \"prompt\")")
    return prompts


def generate_file(loaded: LoadedModel, prompts_path: Path, output_path: Path, **settings) -> list[Generation]:
    """Every prompt of a JSONL file answered in turn, each answer a line of ``output_path`` (the input row, with
    "answer" and its timing), written as it comes."""
    from litft.data.tokenize import prompt_text
    from litft.files import writing

    rows = read_prompts(prompts_path)
    results = []
    with writing("the answers", output_path):
        output_path.parent.mkdir(parents=True, exist_ok=True)
        with open(output_path, "w", encoding="utf-8") as out:
            for row in rows:
                prompt = row.get("prompt") or prompt_text(loaded.prompt_style, {
                    "instruction": row["instruction"], "input": row.get("input", ""), "system": row.get("system", "")})
                raw = "prompt" not in row  # an instruction is wrapped here, with its input
                result = generate(loaded, prompt, raw=raw, **settings)
                results.append(result)
                out.write(json.dumps({**row, "answer": result.text, **{k: v for k, v in asdict(result).items()
                                                                       if k not in ("prompt", "text")}}) + "\n")
                out.flush()
    return results


def chat(loaded: LoadedModel, read=input, write=print, **settings) -> None:
    """A terminal chat: each line typed is a prompt, the answer streams back; an empty line, 'quit' or Ctrl-D ends."""
    write(f"litft chat: {loaded.folder} ({loaded.weights}, {loaded.device}); an empty line or Ctrl-D ends")
    while True:
        try:
            prompt = read(">> ")
        except EOFError:
            break
        if prompt.strip() in ("", "quit", "exit"):
            break
        start = time.perf_counter()
        count = 0
        for piece in stream(loaded, prompt, **settings):
            write(piece, end="", flush=True)
            count += 1
        write(f"\n[{count} tokens, {time.perf_counter() - start:.2f} s]")


def chat_ui(loaded: LoadedModel, host: str = "127.0.0.1", port: int = 7860, block: bool = True):
    """A web chat (Gradio's ChatInterface) over the model, served at http://HOST:PORT: answers stream as they are
    decoded; max new tokens, temperature, top-k and top-p are sliders. Its HTTP API is Gradio's (`/chat`, for
    gradio_client). ``block``: serve until interrupted; else return the running app (``.close()`` stops it).
    Needs the ui extra: pip install 'litft[ui]' (Gradio 5: Gradio 6 needs a huggingface-hub that litgpt refuses)."""
    try:
        import gradio as gr
    except ImportError:
        raise ConfigError("chat --ui: needs Gradio: pip install 'litft[ui]'") from None

    def respond(message, history, max_new_tokens, temperature, top_k, top_p):
        text = ""
        for piece in stream(loaded, message, max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                            top_k=int(top_k) or None, top_p=float(top_p)):
            text += piece
            yield text

    app = gr.ChatInterface(
        respond, type="messages", title="litft chat", description=f"{loaded.folder} ({loaded.weights}, {loaded.device})",
        additional_inputs=[
            gr.Slider(1, loaded.config.block_size, value=256, step=1, label="max new tokens"),
            gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="temperature (0: greedy)"),
            gr.Slider(0, 200, value=0, step=1, label="top-k (0: off)"),
            gr.Slider(0.0, 1.0, value=1.0, step=0.05, label="top-p"),
        ],
    )
    app.queue(default_concurrency_limit=1)  # one model, one KV cache: answers one at a time
    app.launch(server_name=host, server_port=port, prevent_thread_lock=not block, quiet=not block)
    return app


# ----------------------------------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json")


def export(source: str | Path, out: str | Path, fmt: str = "hf") -> Path:
    """The model (adapters merged) as a Hugging Face transformers folder (``fmt`` 'hf': config.json,
    model.safetensors and the tokenizer, through LitGPT's convert_lit_checkpoint) or a clean LitGPT checkpoint folder
    (``fmt`` 'litgpt': lit_model.pth, model_config.yaml, the tokenizer and prompt style). Returns the folder."""
    import shutil

    from litft.files import make_dir, torch_save_atomic, write_text_atomic

    if fmt not in ("hf", "litgpt"):
        raise ConfigError(f"--format: '{fmt}' is not one of hf, litgpt")
    out = Path(out)
    loaded = load_model(source, device="cpu", dtype=None)
    state = {k: v for k, v in loaded.model.state_dict().items() if "lora_" not in k and k not in ("cos", "sin")}
    state = {k.replace(".linear.", "."): v for k, v in state.items()}  # LoRA layers wrap the base as .linear
    make_dir(out, "the export folder", "OUT")
    for name in TOKENIZER_FILES:
        if (loaded.folder / name).is_file():
            shutil.copy(loaded.folder / name, out / name)
    if fmt == "litgpt":
        torch_save_atomic(state, out / "lit_model.pth", "the exported weights")
        config = {k: v for k, v in asdict(loaded.config).items() if not k.startswith("lora_")}
        write_text_atomic(out / "model_config.yaml", yaml.safe_dump(config))
        if (loaded.folder / "prompt_style.yaml").is_file():
            shutil.copy(loaded.folder / "prompt_style.yaml", out / "prompt_style.yaml")
        return out
    return _export_hf(loaded, state, out)


def _export_hf(loaded: LoadedModel, state: dict, out: Path) -> Path:
    """LitGPT's convert_lit_checkpoint on the merged weights, saved as safetensors with a LlamaConfig."""
    import tempfile

    from litgpt.scripts.convert_lit_checkpoint import convert_lit_checkpoint
    from safetensors.torch import save_file

    from litft.files import write_text_atomic

    config = loaded.config
    if config.mlp_class_name != "LLaMAMLP" or config.norm_class_name != "RMSNorm" or config.bias:
        raise ConfigError(f"export --format hf: writes LLaMA-architecture models (LLaMAMLP, RMSNorm, no bias);"
                          f" {config.name} has {config.mlp_class_name}/{config.norm_class_name}; use --format litgpt")
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        torch.save(state, work / "lit_model.pth")
        base = {k: v for k, v in asdict(config).items() if not k.startswith("lora_")}
        (work / "model_config.yaml").write_text(yaml.safe_dump(base))
        with contextlib.redirect_stdout(io.StringIO()):  # it prints its arguments
            convert_lit_checkpoint(work, work / "hf")
        hf_state = torch.load(work / "hf" / "model.pth", weights_only=True)
    save_file({k: v.contiguous() for k, v in hf_state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    dtype = next(iter(hf_state.values())).dtype
    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.padded_vocab_size, "hidden_size": config.n_embd,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head, "num_key_value_heads": config.n_query_groups,
        "head_dim": config.head_size, "max_position_embeddings": config.block_size,
        "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_base, "hidden_act": "silu",
        "tie_word_embeddings": "lm_head.weight" not in hf_state, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": loaded.tokenizer.bos_id, "eos_token_id": loaded.tokenizer.eos_id,
    }
    write_text_atomic(out / "config.json", json.dumps(hf_config, indent=2))
    return out
