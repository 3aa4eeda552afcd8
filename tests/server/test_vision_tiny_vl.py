"""The Must-show check of issue 27 on the shipped tiny VLM: the official ``openai`` client sends images of rendered
text to ``dsv41 serve checkpoints/v41-tiny-vl`` and gets the text back (character accuracy clearly above the same
requests without the image).

Renders come from the training renderer (:mod:`deepseek_v41.train.vision_data`, Debian fonts when installed) on
words that are not the training text's. Skipped when the checkpoint is not there (it is built by ``dsv41
train-vlm``), failing under CI=true."""

import os
import signal
from pathlib import Path

import numpy as np
import openai
import pytest
from serving_helpers import serve_process
from vision_helpers import data_url

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny-vl"
WORDS = ["hello world", "open door", "blue river", "quiet night", "seven apples", "paper kite", "green field",
         "north wind"]


@pytest.mark.slow
def test_tiny_vl_reads_rendered_text_back(tmp_path):
    if not (CHECKPOINT / "config.json").is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{CHECKPOINT} is required in CI (built by dsv41 train-vlm; its card says how)")
        pytest.skip(f"{CHECKPOINT} is not built")
    from deepseek_v41.train.vision_data import PROMPT, char_accuracy, find_fonts, render_text

    fonts = find_fonts()
    renders = [render_text(text, np.random.default_rng([7, i]), fonts)[0] for i, text in enumerate(WORDS)]
    log = tmp_path / "serve.log"
    with serve_process([str(CHECKPOINT), "--served-model-name", "tiny-vl", "--max-model-len", "1024",
                        "--cache-dir", str(tmp_path / "cache"), "--threads", "1", "--log-stats-interval", "0",
                        "--generation-config", "vllm"], log) as (process, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(content) -> str:
            answer = client.chat.completions.create(model="tiny-vl", temperature=0, max_tokens=40,
                                                    messages=[{"role": "user", "content": content}])
            return (answer.choices[0].message.content or "").strip()

        seen = [ask([{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": PROMPT}])
                for image in renders]
        blind = [ask(PROMPT)] * len(WORDS)
        with_image = char_accuracy(WORDS, seen)["char_accuracy"]
        without = char_accuracy(WORDS, blind)["char_accuracy"]
        print(f"tiny-vl char accuracy {with_image:.3f} with the image, {without:.3f} without; answers {seen}")
        assert with_image >= without + 0.2, (with_image, without, seen)
        process.send_signal(signal.SIGTERM)
        process.wait(60)
