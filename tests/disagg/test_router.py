"""``dsv41 router`` against fake encode / prefill / decode servers that record what they receive (issue 29).

Every server (fakes and router) is a real uvicorn server on a free 127.0.0.1 port in a thread, so the tests cover
the HTTP path (SSE relayed chunk by chunk, connections refused and reset, a restarted server on its old port).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from deepseek_v41.disagg.router import build_router_app
from deepseek_v41.disagg.routing import RouterConfig, prefix_hashes
from deepseek_v41.server.launch import bound_port, make_server

HEALTH_S = 0.1
PROMPT_TOKENS = 12
BYTES_PER_TOKEN = 890


class Fake:
    """A backend of one role: records (path, body, headers) of each POST; ``status`` / ``healthy`` steer it;
    a streamed decode response waits for ``release`` after its first chunk."""

    def __init__(self, role: str, name: str = ""):
        self.role, self.name = role, name or role
        self.received: list[tuple[str, dict, dict]] = []
        self.healthy, self.status = True, 200
        self.release = threading.Event()
        self.release.set()
        self.stream_closed = threading.Event()
        self.die_mid_stream = False
        self.delay_s = 0.0

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models(request: Request):
            return {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": self.name,
                                                "auth": request.headers.get("authorization")}]}

        @app.get("/v1/models/{model_id}")
        async def model(model_id: str):
            return {"id": model_id, "object": "model", "owned_by": self.name}

        @app.post("/v1/chat/completions")
        @app.post("/v1/completions")
        async def generate(request: Request):
            body = await request.json()
            self.received.append((request.url.path, body, dict(request.headers)))
            await asyncio.sleep(self.delay_s)
            if self.status != 200:
                return JSONResponse({"error": {"message": f"{self.name} says no", "type": "invalid_request_error",
                                               "param": "messages", "code": "invalid_value"}},
                                    status_code=self.status)
            if self.role == "encode":
                return {"id": "ec-1", "object": "ec_transfer", "ec_transfer_params": {
                    "image_hashes": ["abc"], "num_image_tokens": 4, "transfer_bytes": 64, "encoded": 1, "cached": 0}}
            if self.role == "prefill":
                return {"id": "p-1", "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                        "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 0},
                        "kv_transfer_params": {"do_remote_prefill": True, "num_prompt_tokens": PROMPT_TOKENS,
                                               "num_pages": 1, "transfer_bytes": PROMPT_TOKENS * BYTES_PER_TOKEN,
                                               "block_size": 16, "from": self.name}}
            usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 2, "total_tokens": PROMPT_TOKENS + 2,
                     "prompt_tokens_details": {"cached_tokens": 8}}
            if not body.get("stream"):
                return {"id": "d-1", "object": "text_completion", "model": "tiny", "served_by": self.name,
                        "choices": [{"index": 0, "text": "ab", "finish_reason": "length"}], "usage": usage}

            async def events():
                try:
                    yield b'data: {"choices":[{"text":"a"}]}\n\n'
                    if self.die_mid_stream:
                        raise RuntimeError("the decode server died")  # uvicorn cuts the connection
                    await asyncio.to_thread(self.release.wait, 10)
                    yield b'data: {"choices":[{"text":"b"}],"usage":' + json.dumps(usage).encode() + b"}\n\n"
                    yield b"data: [DONE]\n\n"
                finally:
                    self.stream_closed.set()

            return StreamingResponse(events(), media_type="text/event-stream")

        return app


class Live:
    """A uvicorn server of ``app`` on 127.0.0.1 in a daemon thread."""

    def __init__(self, app, port: int = 0):
        self.server = make_server(app, "127.0.0.1", port, 1.0, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        self.port = bound_port(self.server)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive()


class Dying:
    """A "prefill server" that accepts a request and closes the connection without answering (killed mid-request)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    data = conn.recv(65536)
                    if data.startswith(b"GET /health"):
                        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    else:
                        self.requests += 1

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self.sock.close()
        self.thread.join(5)
        assert not self.thread.is_alive()


@pytest.fixture
def stack():
    """``start(prefill=[Fake|Dying], decode=[...], encode=[...], **config)``: the servers up, the router on top."""
    started: list = []

    def start(prefill=(), decode=(), encode=(), **config):
        urls = {}
        for role, fakes in (("prefill", prefill), ("decode", decode), ("encode", encode)):
            urls[role] = []
            for fake in fakes:
                if isinstance(fake, Fake):
                    fake.live = Live(fake.app())
                    started.append(fake.live)
                    urls[role].append(fake.live.url)
                else:
                    started.append(fake)
                    urls[role].append(fake.url)
        config.setdefault("health_interval_s", HEALTH_S)
        config.setdefault("health_timeout_s", 1.0)
        config.setdefault("request_timeout_s", 10.0)
        router = Live(build_router_app(RouterConfig(**urls, **config)))
        started.append(router)
        return router

    yield start
    for server in started:  # all asked at once: each uvicorn loop notices within its 0.1 s tick, together
        if isinstance(server, Live):
            server.server.should_exit = True
    for server in reversed(started):
        server.stop()


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name")))] = \
                sample.value
    return out


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


CHAT = {"model": "tiny", "messages": [{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": "Hi"}],
        "max_tokens": 5, "max_completion_tokens": 5, "stream_options": {"include_usage": True}, "n": 1,
        "min_tokens": 2}
AUTH = {"Authorization": "Bearer k1"}


def test_prefill_then_decode_with_the_prefill_params(stack):
    prefill, decode = Fake("prefill"), Fake("decode")
    router = stack(prefill=[prefill], decode=[decode])
    response = httpx.post(router.url + "/v1/chat/completions", json=CHAT, headers=AUTH, timeout=10)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["served_by"] == "decode" and data["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    [(path, sent, headers)] = prefill.received
    assert path == "/v1/chat/completions"
    assert sent["stream"] is False and sent["max_tokens"] == 1 and sent["max_completion_tokens"] == 1
    assert sent["kv_transfer_params"] == {"do_remote_decode": True}
    assert "stream_options" not in sent and "min_tokens" not in sent and "n" not in sent
    assert sent["messages"] == CHAT["messages"] and headers["authorization"] == "Bearer k1"
    [(path, sent, dheaders)] = decode.received
    assert sent == {**CHAT, "kv_transfer_params": {"do_remote_prefill": True, "num_prompt_tokens": PROMPT_TOKENS,
                                                   "num_pages": 1, "transfer_bytes": PROMPT_TOKENS * BYTES_PER_TOKEN,
                                                   "block_size": 16, "from": "prefill"}}
    assert dheaders["authorization"] == "Bearer k1" and dheaders["x-request-id"] == headers["x-request-id"]
    m = metrics(router.url)
    assert m[("dsv41:router_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))] == 1
    assert m[("dsv41:router_kv_transfer_bytes_total", ())] == PROMPT_TOKENS * BYTES_PER_TOKEN
    assert m[("dsv41:router_prompt_tokens_total", ())] == PROMPT_TOKENS
    assert m[("dsv41:router_stage_seconds_count", (("stage", "prefill"),))] == 1
    assert m[("dsv41:router_stage_seconds_count", (("stage", "decode"),))] == 1
    assert m[("dsv41:router_backend_up", (("role", "decode"), ("url", decode.live.url)))] == 1
    assert ("dsv41:router_fallbacks_total", (("reason", "prefill"),)) not in m


def test_completions_prefill_sets_max_tokens_only(stack):
    prefill, decode = Fake("prefill"), Fake("decode")
    router = stack(prefill=[prefill], decode=[decode])
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 9}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=10).status_code == 200
    [(path, sent, _)] = prefill.received
    assert path == "/v1/completions" and sent["max_tokens"] == 1 and "max_completion_tokens" not in sent
    assert decode.received[0][1]["max_tokens"] == 9


def test_stream_is_relayed_chunk_by_chunk(stack):
    prefill, decode = Fake("prefill"), Fake("decode")
    decode.release.clear()  # the decode server holds its second chunk until the client has the first
    router = stack(prefill=[prefill], decode=[decode])
    lines = []
    # Buffering would hold the first chunk until the decode server's 10 s wait ran out: past the 5 s read timeout.
    with httpx.stream("POST", router.url + "/v1/completions", timeout=5,
                      json={"model": "tiny", "prompt": "Hi", "stream": True,
                            "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                lines.append(line)
                if len(lines) == 1:
                    assert line == 'data: {"choices":[{"text":"a"}]}'
                    decode.release.set()
    assert lines[-1] == "data: [DONE]" and '"cached_tokens": 8' in lines[1]
    assert prefill.received[0][1]["stream"] is False and "stream_options" not in prefill.received[0][1]
    assert decode.received[0][1]["stream"] is True and decode.received[0][1]["stream_options"]


@contextlib.contextmanager
def held_stream(stack):
    """A streaming completion through a router whose decode server holds the stream after its first chunk until
    ``decode.release`` is set; yields (decode, router, router state, the response's line iterator past that
    chunk)."""
    decode = Fake("decode")
    decode.release.clear()
    router = stack(decode=[decode])
    state = router.server.config.app.state.router
    with httpx.stream("POST", router.url + "/v1/completions", json={"prompt": "Hi", "stream": True},
                      timeout=5) as response:
        lines = response.iter_lines()  # kept: a dropped iterator closes the connection
        assert next(lines).startswith("data: ")
        yield decode, router, state, lines


def test_a_client_that_leaves_closes_the_decode_stream(stack):
    with held_stream(stack) as (decode, _, state, _lines):
        assert state.num_requests == 1 and state.pool.backends["decode"][0].outstanding == 1
    decode.stream_closed.wait(5)  # the router closed its connection: the decode server aborts the request
    assert decode.stream_closed.is_set()
    wait_for(lambda: state.num_requests == 0 and state.pool.backends["decode"][0].outstanding == 0)
    decode.release.set()


def test_a_decode_server_dying_mid_stream_ends_the_stream_with_an_error(stack):
    decode = Fake("decode")
    decode.die_mid_stream = True
    router = stack(decode=[decode])
    with httpx.stream("POST", router.url + "/v1/completions", json={"prompt": "Hi", "stream": True},
                      timeout=5) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[0] == 'data: {"choices":[{"text":"a"}]}' and lines[-1] == "data: [DONE]"
    assert json.loads(lines[1][len("data: "):])["error"]["code"] == "backend_failed"


def test_shutdown_drains_a_running_stream(stack, caplog):
    with held_stream(stack) as (decode, router, state, lines):
        with caplog.at_level("INFO", logger="deepseek_v41.server"):
            router.server.should_exit = True  # what SIGTERM does
            wait_for(lambda: state.draining)
        assert "draining: 1 requests running" in caplog.text
        decode.release.set()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"cached_tokens": 8' in rest[0]  # the running stream finished
    router.thread.join(10)
    assert not router.thread.is_alive() and state.num_requests == 0


def test_prefill_4xx_is_returned_as_is(stack):
    prefill, decode = Fake("prefill"), Fake("decode")
    prefill.status = 400
    router = stack(prefill=[prefill], decode=[decode])
    response = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 400 and response.json()["error"]["message"] == "prefill says no"
    assert decode.received == []


def test_decode_errors_pass_through(stack):
    decode = Fake("decode")
    decode.status = 400
    router = stack(prefill=[Fake("prefill")], decode=[decode])
    response = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_value"
    m = metrics(router.url)
    assert m[("dsv41:router_requests_total", (("route", "/v1/chat/completions"), ("status", "400")))] == 1


@pytest.mark.parametrize("failure", ["5xx", "timeout", "dies mid-request", "refused"])
def test_no_prefill_answer_falls_back_to_the_decode_server(stack, failure):
    decode = Fake("decode")
    if failure in ("5xx", "timeout"):
        prefill = Fake("prefill")
        prefill.status = 500 if failure == "5xx" else 200
        prefill.delay_s = 0 if failure == "5xx" else 3.0  # past --request-timeout-s below
    elif failure == "dies mid-request":
        prefill = Dying()
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # nothing listens there once closed
        prefill = type("Gone", (), {"url": f"http://127.0.0.1:{port}", "stop": lambda self: None})()
    router = stack(prefill=[prefill], decode=[decode], health_interval_s=30.0, request_timeout_s=1.0)
    if failure == "refused":  # marked down by the first health poll: straight to the decode server
        assert metrics(router.url)[("dsv41:router_backend_up", (("role", "prefill"), ("url", prefill.url)))] == 0
    response = httpx.post(router.url + "/v1/chat/completions", json={**CHAT, "kv_transfer_params": {"x": 1}},
                          timeout=10)
    assert response.status_code == 200, response.text
    [(_, sent, _)] = decode.received
    assert "kv_transfer_params" not in sent and sent["max_tokens"] == 5  # the client's request, plain prefill
    if failure == "dies mid-request":
        assert prefill.requests == 1
    if failure == "timeout":
        assert len(prefill.received) == 1
    assert metrics(router.url)[("dsv41:router_fallbacks_total", (("reason", "prefill"),))] == 1


def test_a_second_prefill_server_takes_over(stack):
    dying, prefill, decode = Dying(), Fake("prefill"), Fake("decode")
    router = stack(prefill=[dying, prefill], decode=[decode])
    for _ in range(3):
        assert httpx.post(router.url + "/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 200
    assert all(sent.get("kv_transfer_params", {}).get("from") == "prefill" for _, sent, _ in decode.received)
    assert ("dsv41:router_fallbacks_total", (("reason", "prefill"),)) not in metrics(router.url)


def test_a_restarted_prefill_server_rejoins(stack):
    prefill, decode = Fake("prefill"), Fake("decode")
    router = stack(prefill=[prefill], decode=[decode])
    port, up = prefill.live.port, ("dsv41:router_backend_up", (("role", "prefill"), ("url", prefill.live.url)))
    prefill.live.stop()
    wait_for(lambda: metrics(router.url)[up] == 0)
    assert httpx.post(router.url + "/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 200
    assert "kv_transfer_params" not in decode.received[-1][1]
    prefill.live = Live(prefill.app(), port)  # the restarted server, same port
    try:
        wait_for(lambda: metrics(router.url)[up] == 1)
        assert httpx.post(router.url + "/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 200
        assert decode.received[-1][1]["kv_transfer_params"]["do_remote_prefill"] is True
    finally:
        prefill.live.stop()
    prefill.live = Live(prefill.app())  # for the fixture's teardown


def test_health_follows_the_decode_servers(stack):
    decode = Fake("decode")
    router = stack(prefill=[Fake("prefill")], decode=[decode])
    assert httpx.get(router.url + "/health", timeout=5).status_code == 200
    decode.healthy = False
    wait_for(lambda: httpx.get(router.url + "/health", timeout=5).status_code == 503)
    response = httpx.post(router.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert response.status_code == 503 and response.json()["error"]["code"] == "no_backend"
    decode.healthy = True
    wait_for(lambda: httpx.get(router.url + "/health", timeout=5).status_code == 200)


def test_prefix_affinity_keeps_a_conversation_on_its_decode_server(stack):
    prefill, d1, d2 = Fake("prefill"), Fake("decode", "d1"), Fake("decode", "d2")
    router = stack(prefill=[prefill], decode=[d1, d2])
    turn1 = {"model": "tiny", "messages": [{"role": "system", "content": "S" * 300},
                                           {"role": "user", "content": "first question"}]}
    turn2 = {**turn1, "messages": [*turn1["messages"], {"role": "assistant", "content": "an answer"},
                                   {"role": "user", "content": "follow-up"}]}
    other = {"model": "tiny", "messages": [{"role": "user", "content": "unrelated"}]}

    def served_by(body, headers=AUTH) -> str:
        return httpx.post(router.url + "/v1/chat/completions", json=body, headers=headers, timeout=10).json()[
            "served_by"]

    first = served_by(turn1)
    assert served_by(other) != first  # no shared prefix: the less used server
    assert served_by(turn2) == first and served_by(turn2) == first  # the conversation stays where its KV is
    m = metrics(router.url)
    assert m[("dsv41:router_affinity_hits_total", ())] == 2
    assert m[("dsv41:router_prefill_affinity_hits_total", ())] == 2
    # Another API key salts the servers' caches differently: no affinity across keys.
    assert prefix_hashes("/v1/chat/completions", turn1, "Bearer k1", 512) != \
        prefix_hashes("/v1/chat/completions", turn1, "Bearer k2", 512)
    assert metrics(router.url)[("dsv41:router_affinity_hits_total", ())] == 2


def test_concurrent_requests_spread_and_leave_no_count_behind(stack):
    prefill, d1, d2 = Fake("prefill"), Fake("decode", "d1"), Fake("decode", "d2")
    router = stack(prefill=[prefill], decode=[d1, d2])
    state = router.server.config.app.state.router

    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"model": "tiny", "prompt": f"distinct prompt {i}", "stream": i % 2 == 0}
        response = await client.post(router.url + "/v1/completions", json=body)
        assert response.status_code == 200
        return response.text

    async def all_of_them() -> list[str]:
        async with httpx.AsyncClient(timeout=10) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    texts = asyncio.run(all_of_them())
    assert sum("[DONE]" in text for text in texts) == 8
    assert len(d1.received) + len(d2.received) == 16 and d1.received and d2.received
    # (a response's last byte reaches the client just before the router's bookkeeping of its end)
    wait_for(lambda: state.num_requests == 0 and
             all(b.outstanding == 0 for backends in state.pool.backends.values() for b in backends))


def test_completion_prompt_chunks_share_a_prefix():
    long = "word " * 300
    a = prefix_hashes("/v1/completions", {"prompt": long}, "", 512)
    b = prefix_hashes("/v1/completions", {"prompt": long + "more text"}, "", 512)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    ids = prefix_hashes("/v1/completions", {"prompt": list(range(300))}, "", 512)
    assert len(ids) == 3 and ids[:2] == prefix_hashes("/v1/completions", {"prompt": list(range(260))}, "", 512)[:2]


def test_images_go_through_the_encode_server_first(stack):
    encode, prefill, decode = Fake("encode"), Fake("prefill"), Fake("decode")
    router = stack(prefill=[prefill], decode=[decode], encode=[encode])
    image = {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}
    assert httpx.post(router.url + "/v1/chat/completions", json=image, headers=AUTH, timeout=10).status_code == 200
    assert httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
    [(_, sent, headers)] = encode.received  # text-only requests skip the encode stage
    assert sent == image and headers["authorization"] == "Bearer k1"
    assert len(prefill.received) == len(decode.received) == 2
    encode.status = 500
    assert httpx.post(router.url + "/v1/chat/completions", json=image, timeout=10).status_code == 200
    m = metrics(router.url)
    assert m[("dsv41:router_fallbacks_total", (("reason", "encode"),))] == 1
    assert m[("dsv41:router_stage_seconds_count", (("stage", "encode"),))] == 2


def test_router_api_key_and_models(stack):
    decode = Fake("decode")
    router = stack(prefill=[Fake("prefill")], decode=[decode], api_keys=["k1"])
    response = httpx.post(router.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(router.url + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"},
                      timeout=10).status_code == 401
    assert decode.received == []
    models = httpx.get(router.url + "/v1/models", headers=AUTH, timeout=10).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["auth"] == "Bearer k1"
    assert httpx.get(router.url + "/v1/models/tiny", headers=AUTH, timeout=10).json()["owned_by"] == "decode"
    response = httpx.get(router.url + "/v1/nothing", headers=AUTH, timeout=10)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    assert httpx.get(router.url + "/health", timeout=5).status_code == 200  # not a /v1 route
    assert httpx.post(router.url + "/v1/completions", json={"prompt": "x"}, headers=AUTH, timeout=10).status_code \
        == 200
    assert 'model_name="tiny"' in httpx.get(router.url + "/metrics", timeout=5).text


def test_bad_bodies_get_openai_errors(stack):
    decode = Fake("decode")
    router = stack(decode=[decode], max_body_bytes=1000)
    response = httpx.post(router.url + "/v1/completions", content=b"{not json", timeout=10)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    response = httpx.post(router.url + "/v1/completions", json={"prompt": "x" * 2000}, timeout=10)
    assert response.status_code == 413
    chunked = (b'{"prompt": "' + b"x" * 300 + b'"' if i == 0 else b" " * 300 for i in range(4))  # no content-length
    response = httpx.post(router.url + "/v1/completions", content=chunked, timeout=10)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    # No prefill server configured: the decode server prefills, and that is no fallback.
    assert httpx.post(router.url + "/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 200
    assert ("dsv41:router_fallbacks_total", (("reason", "prefill"),)) not in metrics(router.url)


def test_a_large_body_arrives_whole(stack):
    prefill, decode = Fake("prefill"), Fake("decode")
    router = stack(prefill=[prefill], decode=[decode])
    prompt = "0123456789" * 300_000  # 3 MB, read by the router in many chunks
    assert httpx.post(router.url + "/v1/completions", json={"prompt": prompt}, timeout=10).status_code == 200
    assert prefill.received[0][1]["prompt"] == prompt and decode.received[0][1]["prompt"] == prompt


@pytest.mark.parametrize("kwargs, message", [
    ({"decode": []}, "at least one --decode"),
    ({"decode": ["localhost:8000"]}, "--decode 'localhost:8000' is not an http(s) URL"),
    ({"decode": ["http://127.0.0.1:8000/v1"]}, "base URL only"),
    ({"decode": ["http://127.0.0.1:99999"]}, "not a valid URL"),
    ({"decode": ["http://a:1", "http://a:1/"]}, "given twice"),
    ({"decode": ["http://a:1"], "prefill": ["ftp://a:2"]}, "--prefill 'ftp://a:2'"),
    ({"decode": ["http://a:1"], "health_interval_s": 0}, "--health-interval-s must be > 0"),
])
def test_config_errors(kwargs: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RouterConfig(**kwargs)
