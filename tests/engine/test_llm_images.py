"""``LLM.generate`` with vLLM's ``multi_modal_data`` and ``LLM.chat`` with image parts, and ``dsv41 generate
--image`` (issue 27, API): every spelling of the same images gives the same tokens; bad inputs are ValueErrors
(exit 2 for the CLI) naming what is wrong.

The model is the bundled checkpoint's config (its tokenizer knows ``<｜deepseek_image｜>`` as ``image_token_id``)
with a small random vision tower, random weights."""

import base64
import json
from pathlib import Path

import pytest
import torch
from image_helpers import png, text_image
from typer.testing import CliRunner

from deepseek_v41.cli import app
from deepseek_v41.config import ModelConfig, VisionConfig
from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.engine.multimodal import process_images
from deepseek_v41.model.transformer import Transformer

BUNDLED = "checkpoints/v41-tiny"
VISION = VisionConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=48,
                      max_image_tokens=64, min_pixels=42 * 42)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)


def vlm_config() -> ModelConfig:
    return ModelConfig.from_pretrained(BUNDLED).replace(vision_config=VISION, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-vl")
    torch.manual_seed(0)
    model = Transformer(vlm_config())
    with torch.no_grad():  # images that change the answer
        for name, p in model.named_parameters():
            if name.startswith(("vision.", "aligner.")) or name in ("image_start", "image_newline", "image_end"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    (path / "tokenizer.json").write_bytes((Path(BUNDLED) / "tokenizer.json").read_bytes())
    return path


@pytest.fixture(scope="module")
def llm(vlm_dir):
    return LLM(vlm_dir, dtype="float32", max_model_len=512, max_num_seqs=4)


A, B = text_image("HELLO"), text_image("WORLD", (84, 84))
QUESTION = "Transcribe the text."


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def first_logprob(outputs) -> float:
    """The log-probability of the first generated token: it depends on every prompt position, images included."""
    completion = outputs[0].outputs[0]
    return completion.logprobs[0][completion.token_ids[0]].logprob


def test_generate_takes_multi_modal_data_as_vllm(llm):
    prompt = f"<｜deepseek_image｜> and <｜image2｜> {QUESTION}"
    by_pil = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [A, B]}}, GREEDY, use_tqdm=False)
    by_bytes = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [png(A), png(B)]}}, GREEDY,
                            use_tqdm=False)
    processed = process_images([A, B], VISION)
    by_processed = llm.generate({"prompt": prompt, "multi_modal_data": {"image": processed}}, GREEDY, use_tqdm=False)
    _, ids, _ = llm.prompt_inputs({"prompt": prompt, "multi_modal_data": {"image": [A, B]}})
    assert ids.count(llm.engine.config.image_token_id) == 2
    by_ids = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [A, B]}}, GREEDY, use_tqdm=False)
    assert tokens(by_pil) == tokens(by_bytes) == tokens(by_processed) == tokens(by_ids)
    # Equal up to float32 rounding: later calls hit the prefix and encoder caches (other summation orders).
    for other in (by_bytes, by_processed, by_ids):
        assert first_logprob(other) == pytest.approx(first_logprob(by_pil), abs=1e-4)
    # The prompt the model saw holds both spans: 126x42 -> 3x1 tokens (span 6), 84x84 -> 2x2 (span 8).
    assert len(by_pil[0].prompt_token_ids) == len(ids) - 2 + 6 + 8
    swapped = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [B, A]}}, GREEDY, use_tqdm=False)
    assert len(swapped[0].prompt_token_ids) == len(by_pil[0].prompt_token_ids)
    assert abs(first_logprob(swapped) - first_logprob(by_pil)) > 1e-2  # the images, in their order, reach the model
    # A single image need not be in a list (vLLM takes both).
    one = llm.generate({"prompt": f"<｜deepseek_image｜>{QUESTION}", "multi_modal_data": {"image": A}}, GREEDY,
                       use_tqdm=False)
    assert len(one[0].prompt_token_ids) > 6


def test_chat_takes_image_parts(llm, tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(png(A))
    url = "data:image/png;base64," + base64.b64encode(png(A)).decode()
    outs = []
    for part in ({"type": "image_url", "image_url": {"url": url}}, {"type": "image_pil", "image_pil": A},
                 {"type": "input_image", "image_url": path.as_uri()}):
        outs.append(llm.chat([{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}], GREEDY,
                             use_tqdm=False))
    by_generate = llm.generate({"prompt": f"<｜begin▁of▁sentence｜><｜User｜><｜deepseek_image｜>\n\n{QUESTION}"
                                          "<｜Assistant｜></think>", "multi_modal_data": {"image": [A]}}, GREEDY,
                               use_tqdm=False, add_special_tokens=False)
    assert tokens(outs[0]) == tokens(outs[1]) == tokens(outs[2]) == tokens(by_generate)
    for out in (*outs[1:], by_generate):
        assert first_logprob(out) == pytest.approx(first_logprob(outs[0]), abs=1e-4)
    other = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": B},
                                                   {"type": "text", "text": QUESTION}]}], GREEDY, use_tqdm=False)
    assert abs(first_logprob(other) - first_logprob(outs[0])) > 1e-2


@pytest.mark.parametrize(("prompt", "message"), [
    ({"prompt": QUESTION, "multi_modal_data": {"image": [A]}}, "0 image placeholder"),
    ({"prompt": "<｜deepseek_image｜>", "multi_modal_data": {"video": [A]}}, "this model takes images only"),
    ({"prompt": "<｜deepseek_image｜>", "multi_modal_data": [A]}, "multi_modal_data must be a dict"),
    ({"prompt": "<｜deepseek_image｜>", "multi_modal_data": {"image": ["a.png"]}}, "is a str"),
    ({"prompt": "<｜deepseek_image｜>", "multi_modal_data": {"image": [b"not an image"]}}, "cannot decode"),
    ({"prompt": "x", "multimodal_data": {"image": [A]}}, "unknown prompt keys ['multimodal_data']"),
])
def test_bad_image_prompts_are_value_errors(llm, prompt, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_chat_does_not_fetch_urls(llm):
    with pytest.raises(ValueError, match="not fetched in-process"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}},
                                               {"type": "text", "text": "x"}]}], GREEDY, use_tqdm=False)


def test_text_only_model_refuses_images():
    llm = LLM(BUNDLED, dtype="float32", max_model_len=256, max_num_seqs=2)
    with pytest.raises(ValueError, match="no vision tower"):
        llm.generate({"prompt": "<｜deepseek_image｜>", "multi_modal_data": {"image": [A]}}, GREEDY, use_tqdm=False)


def run_generate(*args: str):
    return CliRunner().invoke(app, ["generate", *args])


def test_generate_cli_image(vlm_dir, llm, tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(png(A))
    result = run_generate(str(vlm_dir), "--image", str(path), "--prompt", QUESTION, "--chat", "--json",
                          "--max-tokens", "4", "--dtype", "float32")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    expected = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": A},
                                                      {"type": "text", "text": QUESTION}]}],
                        SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert out["token_ids"] == tokens(expected)[0]
    assert out["prompt_tokens"] == len(expected[0].prompt_token_ids)


@pytest.mark.parametrize(("args", "message"), [
    (["--image", "missing.png", "--prompt", "x", "--chat"], "--image missing.png: no such file"),
    (["--image", "{png}", "--prompt", "x", "--no-chat"], "the prompt must hold one <｜deepseek_image｜> per image"),
    (["--image", "{txt}", "--prompt", "x", "--chat"], "cannot decode"),
])
def test_generate_cli_image_errors(vlm_dir, tmp_path, args, message):
    (tmp_path / "a.png").write_bytes(png(A))
    (tmp_path / "a.txt").write_text("not an image")
    args = [a.format(png=tmp_path / "a.png", txt=tmp_path / "a.txt") for a in args]
    result = run_generate(str(vlm_dir), *args, "--max-tokens", "2", "--dtype", "float32")
    assert result.exit_code == 2 and message in result.output, result.output


def test_generate_cli_image_on_a_text_model(tmp_path):
    (tmp_path / "a.png").write_bytes(png(A))
    result = run_generate(BUNDLED, "--image", str(tmp_path / "a.png"), "--prompt", "x", "--chat", "--max-tokens", "1")
    assert result.exit_code == 2 and "has no vision tower" in result.output, result.output
