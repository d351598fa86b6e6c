"""Using a fine-tuned model (litft.use, litft.evaluate): generate, chat, evaluate and export, on the demo run."""

import json
import math

import pytest
import torch

import litft
from litft.cli import main


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The demo recipe fine-tuned for 30 steps (LoRA on the shipped tiny model), validated before and after."""
    out = tmp_path_factory.mktemp("use") / "demo"
    litft.finetune(litft.load_recipe("demo", out_dir=str(out), train={"max_steps": 30},
                                     eval={"interval": 0}, logging={"progress": "none", "tensorboard": False}))
    return out


def test_generate_is_greedy_at_temperature_0_and_matches_a_plain_loop(demo_run):
    """temperature 0 answers the same every time, and as a loop of full forward passes taking the argmax does
    (litft generates with LitGPT's KV cache)."""
    from litft.use import generate, load_model

    loaded = load_model(demo_run)
    assert loaded.weights == "base + LoRA adapter (merged in memory)"
    prompt = "Give three tips for staying healthy."
    first, second = (generate(loaded, prompt, max_new_tokens=12) for _ in range(2))
    assert first.text == second.text and first.new_tokens == second.new_tokens >= 1
    ids = loaded.tokenizer.encode(loaded.prompt_style.apply(prompt))
    with torch.inference_mode():
        for _ in range(first.new_tokens):
            token = loaded.model(ids.unsqueeze(0))[0, -1].argmax()
            if token == loaded.tokenizer.eos_id:
                break
            ids = torch.cat([ids, token.view(1)])
    prompt_tokens = len(loaded.tokenizer.encode(loaded.prompt_style.apply(prompt)))
    assert loaded.tokenizer.decode(ids[prompt_tokens:]) == first.text
    assert first.prompt_tokens == prompt_tokens and first.time_to_first_token_s > 0


def test_generate_from_the_command_line_and_over_a_file(demo_run, tmp_path, capsys):
    assert main(["generate", str(demo_run), "--prompt", "Name a color.", "--max-new-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "first token after" in captured.err
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Name a color."}\n{"instruction": "Add 2 and 3.", "input": ""}\n')
    answers = tmp_path / "answers.jsonl"
    assert main(["generate", str(demo_run), "--prompts", str(prompts), "--output", str(answers),
                 "--max-new-tokens", "8"]) == 0
    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [row.get("prompt", row.get("instruction")) for row in rows] == ["Name a color.", "Add 2 and 3."]
    assert all("answer" in row and row["new_tokens"] >= 1 for row in rows)
    prompts.write_text('{"prompt": "a"}\n{"text": 1}\n')
    assert main(["generate", str(demo_run), "--prompts", str(prompts), "--output", str(answers)]) == 5
    assert "line 2" in capsys.readouterr().err


def test_chat_answers_each_line_until_an_empty_one(demo_run):
    from litft.use import chat, load_model

    lines = iter(["Name a color.", ""])
    said = []
    chat(load_model(demo_run), read=lambda _: next(lines), write=lambda *a, **k: said.append("".join(map(str, a))),
         max_new_tokens=6, temperature=0.0)
    assert said[0].startswith("litft chat:") and any("tokens," in line for line in said)


def test_evaluate_perplexity_is_the_runs_validation_loss_and_beats_the_base(demo_run, capsys):
    assert main(["evaluate", str(demo_run), "--base", "--samples", "3", "--max-new-tokens", "12"]) == 0
    assert "| finetuned |" in capsys.readouterr().out
    scores = json.loads((demo_run / "eval.json").read_text())
    losses = json.loads((demo_run / "result.json").read_text())["losses"]
    assert scores["finetuned"]["perplexity"] == pytest.approx(math.exp(losses["val_final"]), rel=1e-5)
    assert scores["base"]["perplexity"] == pytest.approx(math.exp(losses["val_initial"]), rel=1e-5)
    assert scores["finetuned"]["perplexity"] < scores["base"]["perplexity"]
    for name in ("base", "finetuned"):
        assert 0 <= scores[name]["bleu"] <= 100 and 0 <= scores[name]["rouge_l"] <= 100
        assert scores[name]["samples"] == 3


def test_bleu_and_rouge_l_are_sacrebleus_and_rouge_scores():
    """A hand-checked pair: 'the cat sat' against 'the cat sat on the mat' shares a longest common subsequence of 3
    words, so ROUGE-L precision 3/3, recall 3/6, F1 2 x 1 x 0.5 / 1.5 = 0.667; BLEU is sacrebleu's corpus BLEU."""
    import sacrebleu

    from litft.evaluate import text_scores

    scores = text_scores(["the cat sat"], ["the cat sat on the mat"])
    assert scores["rouge_l"] == pytest.approx(100 * 2 / 3)
    assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(["the cat sat"], [["the cat sat on the mat"]]).score)
    assert text_scores(["the cat sat on the mat"], ["the cat sat on the mat"]) == pytest.approx(
        {"bleu": 100.0, "rouge_l": 100.0})


def test_the_hugging_face_export_loads_in_transformers_with_the_same_logits(demo_run, tmp_path):
    """float32 on the CPU: transformers' LlamaForCausalLM over the export gives litft's logits to 1e-5."""
    from transformers import AutoModelForCausalLM

    from litft.use import load_model

    assert main(["export", str(demo_run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    loaded = load_model(demo_run)
    ids = loaded.tokenizer.encode(loaded.prompt_style.apply("Name three primary colors.")).unsqueeze(0)
    with torch.inference_mode():
        torch.testing.assert_close(hf(ids).logits, loaded.model(ids), rtol=1e-5, atol=1e-5)
    assert main(["export", str(demo_run), "--format", "litgpt", "--out", str(tmp_path / "lit")]) == 0
    again = load_model(tmp_path / "lit")
    assert again.weights == "full"
    with torch.inference_mode():
        torch.testing.assert_close(again.model(ids), loaded.model(ids))


def test_a_folder_without_a_model_and_an_adapter_without_its_base_are_refused(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "hi"]) == 6
    assert "holds no model" in capsys.readouterr().err
    out = tmp_path / "random"
    litft.finetune(litft.load_recipe("demo", out_dir=str(out), init="random", train={"max_steps": 1},
                                     eval={"interval": 0, "initial": False, "final": False},
                                     logging={"progress": "none", "tensorboard": False}))
    assert main(["generate", str(out), "--prompt", "hi"]) == 6
    assert "base weights are not on disk" in capsys.readouterr().err


def test_weights_and_biases_logs_each_row_offline(tmp_path, monkeypatch):
    """logging.wandb with wandb_mode offline: a W&B run under out_dir/wandb (no account, no network) holding the
    recipe as its config and the logged metrics."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    run = litft.finetune(litft.load_recipe(
        "demo", out_dir=str(out), train={"max_steps": 3}, eval={"interval": 0, "initial": False, "final": False},
        logging={"progress": "none", "tensorboard": False, "wandb": "litft-test", "wandb_mode": "offline",
                 "interval": 1}))
    assert run.status == "ok"
    [log] = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    content = log.read_bytes()
    assert b'"wandb_mode":"offline"' in content  # the recipe, as the run's config
    for key in (b"loss", b"tokens_per_sec", b"lr"):
        assert key in content


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def web_chat(demo_run):
    """`litft chat OUT_DIR --ui` as it serves (Gradio), on a free local port, for the module's tests."""
    from litft.use import chat_ui, load_model

    port = _free_port()
    app = chat_ui(load_model(demo_run), port=port, block=False)
    yield f"http://127.0.0.1:{port}/"
    app.close()


def test_the_web_chat_answers_over_http(web_chat, demo_run):
    """Through Gradio's own client, at temperature 0: the answer litft generate gives."""
    from gradio_client import Client

    from litft.use import generate, load_model

    answer = Client(web_chat, verbose=False).predict("Name three primary colors.", 16, 0.0, 0, 1.0, api_name="/chat")
    assert answer == generate(load_model(demo_run), "Name three primary colors.", max_new_tokens=16).text


def test_the_web_chat_answers_in_a_browser(web_chat, tmp_path):
    """Headless Chromium (Debian's chromium and chromium-driver; .ci/run installs them) driven by Selenium: a prompt
    typed and sent, an answer shown, a screenshot kept."""
    import os
    import shutil

    driver_path, browser = shutil.which("chromedriver"), shutil.which("chromium")
    if not (driver_path and browser):
        if os.environ.get("LITFT_REQUIRE_BROWSER"):
            pytest.fail("LITFT_REQUIRE_BROWSER is set and chromium or chromedriver is missing")
        pytest.skip("needs chromium and chromium-driver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(argument)
    options.binary_location = browser
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    try:
        driver.get(web_chat)
        box = WebDriverWait(driver, 120).until(lambda d: d.find_element(By.CSS_SELECTOR, "textarea"))
        box.send_keys("Name three primary colors.")
        box.send_keys(Keys.ENTER)

        def answer(d):
            bots = d.find_elements(By.CSS_SELECTOR, '[data-testid="bot"]')
            return bots[-1].text.strip() if bots else ""

        shown = WebDriverWait(driver, 120).until(answer)
        asked = [bubble.text for bubble in driver.find_elements(By.CSS_SELECTOR, '[data-testid="user"]')]
        screenshot = tmp_path / "web-chat.png"
        driver.save_screenshot(str(screenshot))
    finally:
        driver.quit()
    assert asked and "Name three primary colors." in asked[-1]
    assert shown and screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
