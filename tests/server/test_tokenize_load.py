"""Huge prompts neither freeze the event loop nor get tokenized when they cannot fit (issue 22 item 4): a text with
more bytes than ``max_model_len`` tokens can cover is refused before tokenizing, and tokenization runs on a worker
thread with the GIL released, so ``/health`` answers while a large one runs."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from serving_helpers import KEYS, MODEL, auth

from deepseek_v41.server.text import encode


class Watched:
    """Wraps the server's tokenizer: records what it tokenizes and when a tokenization starts and ends."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts = tokenizer, []
        self.started, self.done = threading.Event(), threading.Event()

    def _run(self, fn, texts, *args, **kwargs):
        self.texts.extend([texts] if isinstance(texts, str) else texts)
        self.started.set()
        try:
            return fn(texts, *args, **kwargs)
        finally:
            self.done.set()

    def encode(self, text, *args, **kwargs):
        return self._run(self.tokenizer.encode, text, *args, **kwargs)

    def encode_batch(self, texts, *args, **kwargs):
        return self._run(self.tokenizer.encode_batch, texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture
def watched(server):
    original = server.engine.tokenizer
    server.engine.tokenizer = Watched(original)
    try:
        yield server.engine.tokenizer
    finally:
        server.engine.tokenizer = original


def test_text_that_cannot_fit_is_refused_before_tokenizing(server, watched):
    state = server.uvicorn_server.config.app.state.server
    limit = state.max_text_bytes
    assert limit is not None and limit < 300_000
    big = "ka lo " * (limit // 6 + 1)
    assert len(big.encode()) > limit
    cases = [("/tokenize", {"model": MODEL, "prompt": big}, "prompt"),
             ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": big}]}, "messages"),
             ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": big}]}, "messages"),
             ("/v1/completions", {"model": MODEL, "prompt": ["Hi", big]}, "prompt[1]")]
    for path, body, param in cases:
        response = httpx.post(server.url + path, json=body, headers=auth(KEYS[0]), timeout=60)
        assert response.status_code == 400, response.text[:300]
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", param), error
        assert f"cannot cover more than {limit} bytes" in error["message"]
    assert watched.texts == []  # nothing was tokenized
    # Text that may fit is tokenized as before, also when it is over max_model_len tokens (/tokenize says so).
    fits = "ka lo " * 2000
    assert len(fits.encode()) <= limit
    response = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": fits}, timeout=60).json()
    assert response["count"] > response["max_model_len"] and watched.texts == [fits]


def test_health_answers_while_a_large_tokenize_runs(server, watched):
    """By structure, not by timing: /health must answer before the tokenization it runs beside has finished. With
    the GIL held for the whole tokenization (``Tokenizer.encode``) it could only answer afterwards."""
    state = server.uvicorn_server.config.app.state.server
    limit, state.max_text_bytes = state.max_text_bytes, None  # as if max_model_len could take it
    try:
        big = "Hello world, the city is Paris. " * 28_000  # ~0.9 MB: about a second of tokenizing here
        with ThreadPoolExecutor(1) as pool:
            job = pool.submit(httpx.post, server.url + "/tokenize", json={"model": MODEL, "prompt": big}, timeout=120)
            assert watched.started.wait(60)
            health = httpx.get(server.url + "/health", timeout=60)
            answered_during = not watched.done.is_set()
            assert job.result().status_code == 200
    finally:
        state.max_text_bytes = limit
    assert health.status_code == 200 and answered_during, "/health waited for the tokenization to end"


def test_encode_releases_the_gil(server):
    """The helper every route tokenizes with lets other Python threads run meanwhile."""
    import asyncio
    import time

    tokenizer = server.engine.tokenizer
    text = "Hello world, the city is Paris. " * 28_000
    done, ticks = threading.Event(), [0]

    def count():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    try:
        (ids,) = asyncio.run(encode(SimpleNamespace(tokenizer=tokenizer), [text], False))
    finally:
        done.set()
        counter.join()
    assert ids == tokenizer.encode(text, add_special_tokens=False).ids
    assert ticks[0] > 20, f"another thread ran only {ticks[0]} times during the tokenization"


def test_multi_prompt_over_the_context_stops_tokenizing_at_the_first_refusal(server, watched):
    """Prompts that each pass the byte bound but not max_model_len: the request is refused after tokenizing about
    one prompt's bound of text, not every prompt (failed before: all 6 prompts were tokenized, so 24 prompts of
    2.4 MB in two requests cost 135 s of tokenizing and 3 GB on the bundled checkpoint before the 400)."""
    state = server.uvicorn_server.config.app.state.server
    fits = "ka lo " * 2000
    assert len(fits.encode()) <= state.max_text_bytes
    body = {"model": MODEL, "prompt": [fits + str(i) for i in range(6)], "max_tokens": 1}
    response = httpx.post(server.v1 + "/completions", json=body, headers=auth(KEYS[0]), timeout=60)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt[0]"), error
    assert sum(map(len, watched.texts)) <= state.max_text_bytes // 4 + len(body["prompt"][0]), len(watched.texts)
    # Prompts that fit are still tokenized and served together, in order.
    watched.texts.clear()
    body = {"model": MODEL, "prompt": ["Hello", "The city", "Hi"], "max_tokens": 1, "temperature": 0}
    response = httpx.post(server.v1 + "/completions", json=body, headers=auth(KEYS[0]), timeout=60)
    assert response.status_code == 200 and len(response.json()["choices"]) == 3
    assert watched.texts == body["prompt"]


def test_short_prompts_do_not_wait_behind_large_tokenizations(server, watched, monkeypatch):
    """Many large texts being tokenized (``/tokenize`` needs no key) must not hold every worker thread a short
    request's tokenization needs. Failed before: 40 large /tokenize held all of asyncio's default pool, so a chat
    request for "Hi" waited for them (on the bundled checkpoint 10 concurrent 2.5 MB /tokenize made it wait 32 s)."""
    from deepseek_v41.server import text

    state = server.uvicorn_server.config.app.state.server
    # This server's byte bound is small: a lower threshold for "large" (raising=False: absent before the fix).
    monkeypatch.setattr(text, "LARGE_TEXT_CHARS", LARGE_TEXT_CHARS := 16 * 1024, raising=False)
    big = "ka lo " * (LARGE_TEXT_CHARS // 6 + 100)
    assert LARGE_TEXT_CHARS < len(big.encode()) <= state.max_text_bytes
    release = threading.Event()
    tokenize = watched.tokenizer.encode_batch

    def encode_batch(texts, *args, **kwargs):
        if sum(map(len, texts)) > LARGE_TEXT_CHARS:
            release.wait(120)  # a large tokenization that takes its time
        return tokenize(texts, *args, **kwargs)

    watched.encode_batch = encode_batch
    try:
        with ThreadPoolExecutor(40) as pool:
            jobs = [pool.submit(httpx.post, server.url + "/tokenize", json={"model": MODEL, "prompt": big},
                                timeout=120) for _ in range(40)]
            deadline = time.monotonic() + 30
            while not any(job.running() for job in jobs) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)  # let them reach the server
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            response = httpx.post(server.v1 + "/chat/completions", json=body, headers=auth(KEYS[0]), timeout=20)
            assert response.status_code == 200, response.text[:300]
            release.set()
            assert all(job.result(120).status_code == 200 for job in jobs)
    finally:
        release.set()
