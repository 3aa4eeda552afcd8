"""Images through ``/v1/chat/completions`` (issue 27, API): content parts in prompt order, the media policy
(data URLs always; http(s) URLs only from ``--allowed-media-domains``, within a byte limit and a timeout, redirects
checked hop by hop; ``--limit-mm-per-prompt``), each refusal a 400 naming the part and the limit.

A tiny random VLM is written by the fixture; images come as data URLs or from a local HTTP server on 127.0.0.1 in
this process (nothing leaves the machine). What the engine is given is recorded by wrapping
``LLMEngine.add_request`` (the recorder refuses the request afterwards, so these tests need no image-capable
engine); the end-to-end run with the official ``openai`` client against ``dsv41 serve`` is in
``test_vision_serve.py``."""

import base64
import contextlib
import threading
import time

import httpx
import openai
import pytest
from PIL import Image
from serving_helpers import KEYS, auth, start_server
from vision_helpers import (
    FETCH_LIMIT,
    VISION,
    data_url,
    image_part,
    local_image_host,
    png,
    save_tiny_vlm,
    text_image,
)

from deepseek_v41.chat import tokens as T
from deepseek_v41.engine.multimodal import image_hash, process_images
from deepseek_v41.server.media import MediaConfig

MODEL = "tiny"
MAX_MODEL_LEN = 512
FETCH_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def image_host():
    with local_image_host({"/ok.png": png(text_image("OK")), "/b.png": png(text_image("B", (84, 84)))}) as server:
        yield server


@pytest.fixture(scope="module")
def media():
    return MediaConfig(allowed_media_domains=["127.0.0.1"], limit_images=4, fetch_timeout_s=FETCH_TIMEOUT_S,
                       max_image_bytes=FETCH_LIMIT)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, media):
    path = tmp_path_factory.mktemp("tiny-vlm")
    save_tiny_vlm(path)
    live = start_server(path, max_model_len=MAX_MODEL_LEN, config_args={"media": media})
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(vlm):
    return openai.OpenAI(base_url=vlm.v1, api_key=KEYS[0], max_retries=0, timeout=60)


class Recorded(Exception):
    pass


@contextlib.contextmanager
def recording(live):
    """Record what ``add_request`` gets, then refuse the request (a ValueError: the client gets a 400 saying
    "recorded"), so the API layer is checked apart from the engine."""
    engine = live.llm.engine
    calls = []

    def add_request(request_id, prompt_token_ids, params, **kwargs):
        calls.append({"ids": list(prompt_token_ids), **kwargs})
        raise ValueError("recorded")

    engine.add_request = add_request
    try:
        yield calls
    finally:
        del engine.add_request


def send(client, messages, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **kwargs)


def refusal(client, messages) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        send(client, messages)
    body = info.value.response.json()["error"]
    assert body["type"] == "invalid_request_error"
    return body


def hashes(images) -> list[str]:
    return [image_hash(im) for im in images]


def test_images_reach_the_engine_in_placeholder_order(vlm, client, image_host):
    a, b, c, d = text_image("A"), text_image("B", (84, 84)), text_image("C", (42, 42)), text_image("OK")
    url = f"http://127.0.0.1:{image_host.server_port}/ok.png"
    messages = [
        {"role": "system", "content": "Read the images."},
        {"role": "user", "content": [{"type": "text", "text": "first"}, image_part(data_url(a)),
                                     {"type": "text", "text": "then"}, {"type": "image_url",
                                                                         "image_url": data_url(b)}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(c)}, image_part(url)]},
    ]
    with recording(vlm) as calls, pytest.raises(openai.BadRequestError, match="recorded"):
        send(client, messages)
    (call,) = calls
    images = call["multi_modal_data"]["image"]
    assert hashes(images) == hashes(process_images([a, b, c, d], VISION))
    image_id = vlm.llm.engine.config.image_token_id
    assert call["ids"].count(image_id) == 4  # one placeholder each; the engine expands them
    # The text around the placeholders is the rendered prompt's, tokenized piece by piece.
    tokenizer = vlm.llm.tokenizer
    text = tokenizer.decode(call["ids"], skip_special_tokens=False)
    assert text.count(T.IMAGE) == 4 and "first" in text and text.index("first") < text.index("then")


def test_tokenize_counts_the_expanded_image_spans(vlm):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, image_part(data_url(text_image("A")))]}]
    with_image = httpx.post(vlm.url + "/tokenize", json={"messages": messages}).json()
    text_only = httpx.post(vlm.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    # 126x42 pixels -> 9x3 patches -> 3x1 tokens: span 1 * (3 + 1) + 2 = 6, in place of "\n\n" + a placeholder.
    image_id = vlm.llm.engine.config.image_token_id
    assert with_image["tokens"].count(image_id) == 6 and with_image["count"] == len(with_image["tokens"])
    assert with_image["count"] > text_only["count"]


def test_url_fetch_follows_redirects_to_allowed_hosts(vlm, client, image_host):
    base = f"http://127.0.0.1:{image_host.server_port}"
    with recording(vlm) as calls, pytest.raises(openai.BadRequestError, match="recorded"):
        send(client, [{"role": "user", "content": [image_part(base + "/to-ok")]}])
    assert hashes(calls[0]["multi_modal_data"]["image"]) == hashes(process_images([text_image("OK")], VISION))


@pytest.mark.parametrize(("path", "words", "code"), [
    ("/to-localhost", "a redirect to host 'localhost' is not in this server's --allowed-media-domains",
     "image_url_not_allowed"),
    ("/loop", "more than 5 redirects", "image_fetch_failed"),
    ("/declared-big", f"larger than the {FETCH_LIMIT} bytes allowed per image", "image_too_large"),
    ("/streamed-big", f"larger than the {FETCH_LIMIT} bytes allowed per image", "image_too_large"),
    ("/slow", f"took longer than the {FETCH_TIMEOUT_S:g} s allowed", "image_fetch_failed"),
    ("/missing.png", "answered HTTP 404", "image_fetch_failed"),
    ("/text", "cannot decode the image data", "invalid_image"),
])
def test_url_refusals_are_400s_naming_the_reason(vlm, client, image_host, path, words, code):
    url = f"http://127.0.0.1:{image_host.server_port}{path}"
    start = time.monotonic()
    body = refusal(client, [{"role": "user", "content": [{"type": "text", "text": "x"}, image_part(url)]}])
    assert words in body["message"] and body["param"] == "messages[0].content[1]" and body["code"] == code
    assert time.monotonic() - start < 10


def test_other_hosts_and_disabled_fetching_are_refused(vlm, client, image_host, media, monkeypatch):
    url = f"http://localhost:{image_host.server_port}/ok.png"
    body = refusal(client, [{"role": "user", "content": [image_part(url)]}])
    assert "host 'localhost' is not in this server's --allowed-media-domains (127.0.0.1)" in body["message"]
    monkeypatch.setattr(media, "allowed_media_domains", [])
    url = f"http://127.0.0.1:{image_host.server_port}/ok.png"
    body = refusal(client, [{"role": "user", "content": [image_part(url)]}])
    assert "does not fetch image URLs" in body["message"] and "--allowed-media-domains" in body["message"]
    assert body["code"] == "image_url_not_allowed"
    body = refusal(client, [{"role": "user", "content": [image_part("file:///etc/passwd")]}])
    assert "--allowed-local-media-path" in body["message"]
    body = refusal(client, [{"role": "user", "content": [image_part("ftp://example.com/a.png")]}])
    assert "must be a data URL" in body["message"]


def test_local_files_only_below_the_allowed_path(vlm, client, media, monkeypatch, tmp_path):
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "a.png").write_bytes(png(text_image("A")))
    (tmp_path / "secret.png").write_bytes(png(text_image("S")))
    monkeypatch.setattr(media, "allowed_local_media_path", str(inside))
    with recording(vlm) as calls, pytest.raises(openai.BadRequestError, match="recorded"):
        send(client, [{"role": "user", "content": [image_part(f"file://{inside}/a.png")]}])
    assert hashes(calls[0]["multi_modal_data"]["image"]) == hashes(process_images([text_image("A")], VISION))
    body = refusal(client, [{"role": "user", "content": [image_part(f"file://{inside}/../secret.png")]}])
    assert "is outside --allowed-local-media-path" in body["message"]


def test_too_many_images_names_the_limit(client):
    part = image_part(data_url(text_image("A", (42, 42))))
    body = refusal(client, [{"role": "user", "content": [part] * 3}, {"role": "assistant", "content": "ok"},
                            {"role": "user", "content": [part] * 2}])
    assert "has 5 images, but this server takes at most 4 per prompt" in body["message"]
    assert "--limit-mm-per-prompt '{\"image\": 4}'" in body["message"] and body["code"] == "too_many_images"


def test_nothing_is_fetched_for_a_request_refused_anyway(client, image_host):
    url = f"http://127.0.0.1:{image_host.server_port}/ok.png?refused"
    body = refusal(client, [{"role": "user", "content": [image_part(url)] * 5}])
    assert body["code"] == "too_many_images"
    body = refusal(client, [{"role": "user", "content": [image_part(url), {"type": "text", "text": "a " * 600}]}])
    assert body["code"] == "context_length_exceeded"
    assert not [hit for hit in image_host.hits if hit.endswith("?refused")]


def test_image_tokens_over_the_context_name_the_limit(client, media, monkeypatch):
    monkeypatch.setattr(media, "limit_images", 16)
    big = image_part(data_url(Image.new("RGB", (1000, 1000), "white")))  # shrunk to the 64-position budget
    body = refusal(client, [{"role": "user", "content": [big] * 9}])
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in body["message"]
    assert body["code"] == "context_length_exceeded"


@pytest.mark.parametrize(("part", "words"), [
    (image_part("data:image/png;base64,@@@@"), "not valid base64"),
    (image_part("data:text/plain;base64,aGk="), "is not an image"),
    (image_part("data:image/png,rawbytes"), "only base64 data URLs"),
    (image_part("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n broken").decode()),
     "cannot decode the image data"),
    (image_part("data:image/png;base64," + "A" * (FETCH_LIMIT * 2)), "larger than the"),
    ({"type": "input_image", "file_id": "file-123"}, "images by file_id are not supported"),
    ({"type": "image_url", "image_url": {"url": ""}}, "an image_url part needs"),
])
def test_bad_image_parts_are_400s_naming_the_part(client, part, words):
    body = refusal(client, [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}])
    assert words in body["message"] and body["param"].startswith("messages[0].content[1]")


def test_decompression_bomb_is_refused_before_decoding(client, media, monkeypatch):
    monkeypatch.setattr(media, "max_image_pixels", 100 * 100)
    body = refusal(client, [{"role": "user", "content": [image_part(data_url(Image.new("RGB", (101, 100))))]}])
    assert "10,100 pixels" in body["message"] and "10,000 pixels" in body["message"]


def test_the_event_loop_keeps_serving_while_an_image_is_fetched(vlm, image_host, media, monkeypatch):
    """A slow fetch (2 s: a byte every 0.1 s) awaits the network, not the event loop: /health answers meanwhile."""
    monkeypatch.setattr(media, "fetch_timeout_s", 10.0)
    url = f"http://127.0.0.1:{image_host.server_port}/slow"
    body = {"model": MODEL, "messages": [{"role": "user", "content": [image_part(url)]}], "max_tokens": 2}
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=httpx.post(
        vlm.v1 + "/chat/completions", json=body, headers=auth(KEYS[0]), timeout=30)))
    seen = len(image_host.hits)
    started = time.monotonic()
    thread.start()
    while "/slow" not in image_host.hits[seen:]:  # the fetch is under way
        assert time.monotonic() - started < 10
        time.sleep(0.01)
    start = time.monotonic()
    assert httpx.get(vlm.url + "/health", timeout=5).status_code == 200
    assert time.monotonic() - start < 1.0
    thread.join(30)
    assert result["r"].status_code == 400 and time.monotonic() - started > 1.5  # the fetch did take its time


def test_image_requests_complete_and_repeat_with_the_encoder_cache(vlm, client):
    """The real engine: a chat request with two images completes (usage counts the image spans), streamed and not;
    the same images after another text (so the prefix cache cannot cover them) come from the encoder cache."""
    def messages(before):
        return [{"role": "user", "content": [{"type": "text", "text": before}, image_part(data_url(text_image("HI"))),
                                             image_part(data_url(text_image("B", (84, 84)))),
                                             {"type": "text", "text": "Transcribe the text."}]}]

    first = send(client, messages("one"), temperature=0, extra_body={"ignore_eos": True})
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 2
    text_only = send(client, [{"role": "user", "content": "one\n\n\n\nTranscribe the text."}])
    assert first.usage.prompt_tokens >= text_only.usage.prompt_tokens + 6 + 8  # the two spans
    hits = vlm.llm.engine.stats["encoder_cache"]["hits"]
    events = list(client.chat.completions.create(model=MODEL, messages=messages("two"), max_tokens=2, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason] == ["length"]
    assert vlm.llm.engine.stats["encoder_cache"]["hits"] == hits + 2
