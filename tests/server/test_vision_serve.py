"""``dsv41 serve`` as a process on a tiny random VLM written by the test: the official ``openai`` client sends an
image of rendered text (as a data URL, and as an http URL the server fetches from a local 127.0.0.1 host it is
allowed) and gets a completion back; ``/metrics`` counts the encoder cache. (That the tiny *trained* VLM reads the
text back is the ``checkpoints/v41-tiny-vl`` check; a random model only has to answer.)"""

import signal

import httpx
import openai
from serving_helpers import serve_process
from vision_helpers import FETCH_LIMIT, data_url, image_part, local_image_host, png, save_tiny_vlm, text_image


def test_openai_client_sends_an_image_to_dsv41_serve(tmp_path):
    model = tmp_path / "tiny-vlm"
    save_tiny_vlm(model)
    log = tmp_path / "serve.log"
    with local_image_host({"/hello.png": png(text_image("HELLO"))}) as host, serve_process([
            str(model), "--served-model-name", "tiny-vl", "--max-model-len", "512", "--max-num-seqs", "4",
            "--cache-dir", str(tmp_path / "cache"), "--threads", "1", "--log-stats-interval", "0",
            "--allowed-media-domains", "127.0.0.1", "--limit-mm-per-prompt", '{"image": 2}',
            "--max-image-bytes", str(FETCH_LIMIT), "--media-fetch-timeout", "5"], log) as (process, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        hello = f"http://127.0.0.1:{host.server_port}/hello.png"
        answer = client.chat.completions.create(
            model="tiny-vl", max_tokens=3, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [image_part(data_url(text_image("HELLO"))), image_part(hello),
                                                   {"type": "text", "text": "Transcribe the text."}]}])
        assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 3
        assert isinstance(answer.choices[0].message.content, str)
        # The same picture twice (data URL, then fetched): the same content hash, encoded once.
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'dsv41:encoder_cache_misses_total{model_name="tiny-vl"} 1.0' in metrics, metrics
        try:
            client.chat.completions.create(model="tiny-vl", max_tokens=1, messages=[
                {"role": "user", "content": [image_part(hello)] * 3}])
            raise AssertionError("three images must be refused")
        except openai.BadRequestError as exc:
            assert "at most 2 per prompt" in exc.response.json()["error"]["message"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) in (0, -signal.SIGTERM)
    text = log.read_text()
    assert "images: data URLs, image URLs fetched from 127.0.0.1" in text, text
