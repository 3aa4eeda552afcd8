"""Slow and idle clients cannot hold the server (issue 22 item 8): slowloris heads and bodies get a 408 and are
closed at their deadline however slowly they trickle, idle kept-alive connections are closed, a client that reads
nothing of a large response is dropped, connections beyond
``--limit-concurrency`` get a 503 at once while the server keeps accepting, and responses that take longer than
every timeout still complete. Raw sockets against a real server on 127.0.0.1; every wait is bounded."""

import socket
import threading
import time

import httpx
import pytest
from serving_helpers import KEYS, MODEL, auth, start_server

from deepseek_v41.server.launch import ConnectionLimits

LIMIT = 6
TIMEOUT = 0.6  # seconds, for the head, the body and keep-alive alike
BOUND = 10.0  # no wait in these tests may exceed this


@pytest.fixture(scope="module")
def live(model_dir):
    server = start_server(model_dir, max_num_seqs=4, max_model_len=256, limits=ConnectionLimits(
        timeout_keep_alive=TIMEOUT, timeout_header=TIMEOUT, timeout_body=TIMEOUT, limit_concurrency=LIMIT,
        timeout_write=TIMEOUT))
    yield server
    server.stop()


def connect(live) -> socket.socket:
    host, port = live.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=BOUND)
    sock.settimeout(BOUND)
    return sock


def read_until_closed(sock: socket.socket, trickle: list[bytes] = (), every: float = 0.1) -> tuple[bytes, float]:
    """Send ``trickle`` one piece every ``every`` seconds (and nothing more) while reading; returns everything the
    server sent until it closed the connection, and the seconds that took. Fails past BOUND."""
    start = time.monotonic()
    sock.setblocking(False)
    data, pending, next_send = b"", list(trickle), start
    while time.monotonic() - start < BOUND:
        if pending and time.monotonic() >= next_send:
            try:
                sock.send(pending.pop(0))
            except OSError:  # closed by the server meanwhile
                pending = []
            next_send += every
        try:
            chunk = sock.recv(65536)
        except BlockingIOError:
            time.sleep(0.01)
            continue
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return data, time.monotonic() - start
        data += chunk
    raise AssertionError(f"the server kept the connection open for {BOUND}s; received {data[:200]!r}")


HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


def test_slowloris_head_is_closed_at_the_deadline(live):
    with connect(live) as sock:
        # A header line every 0.1 s: each byte arrives in time, the head never completes.
        data, took = read_until_closed(sock, [HEAD] + [b"x-pad-%d: y\r\n" % i for i in range(200)])
    assert data.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in data, data[:200]
    assert TIMEOUT * 0.9 <= took < BOUND


def test_silent_connection_is_closed(live):
    with connect(live) as sock:
        data, _ = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408 ")


def test_slow_body_is_closed_at_the_deadline(live):
    head = HEAD + b"authorization: Bearer " + KEYS[0].encode() + b"\r\ncontent-length: 400\r\n\r\n"
    with connect(live) as sock:
        data, took = read_until_closed(sock, [head] + [b" "] * 200)
    assert data.startswith(b"HTTP/1.1 408 ") and b"--timeout-body" in data, data[:200]
    assert took < BOUND


def test_idle_keep_alive_connection_is_closed(live):
    with connect(live) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        data, took = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 200 ") and took >= TIMEOUT * 0.9


def test_connections_beyond_the_limit_get_503_and_the_server_keeps_accepting(live):
    idle = [connect(live) for _ in range(LIMIT)]
    try:
        time.sleep(0.1)
        with connect(live) as extra:
            data, took = read_until_closed(extra)
        assert data.startswith(b"HTTP/1.1 503 ") and b"--limit-concurrency" in data, data[:200]
        assert took < TIMEOUT  # refused at once, not after a timeout
    finally:
        for sock in idle:
            sock.close()
    # The idle ones are gone; the server serves again.
    deadline = time.monotonic() + BOUND
    while True:
        try:
            if httpx.get(live.url + "/health", timeout=BOUND).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.08)


def test_long_responses_are_not_cut(live):
    """A stream that lasts several times every timeout completes; so does a slow non-streaming answer."""
    engine = live.llm.engine
    original = engine.step

    def slow_step():
        time.sleep(0.08)
        return original()

    engine.step = slow_step
    try:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 25, "ignore_eos": True}
        start = time.monotonic()
        lines = []
        with httpx.stream("POST", live.v1 + "/completions", json={**body, "stream": True}, headers=auth(KEYS[0]),
                          timeout=60) as response:
            lines = [line for line in response.iter_lines() if line]
        assert time.monotonic() - start > 3 * TIMEOUT
        assert lines[-1] == "data: [DONE]" and sum('"finish_reason":"length"' in x for x in lines) == 1
        full = httpx.post(live.v1 + "/completions", json=body, headers=auth(KEYS[0]), timeout=60)
        assert full.status_code == 200 and full.json()["usage"]["completion_tokens"] == 25
    finally:
        del engine.step


def test_many_slowloris_connections_do_not_stop_the_server(live):
    """Twice the limit of trickling connections at once: the server refuses the extra ones, closes the rest at
    their deadline, and answers /health meanwhile (within the connection limit) and afterwards."""
    socks, results = [], []
    for _ in range(2 * LIMIT):
        sock = connect(live)
        sock.sendall(HEAD)
        socks.append(sock)

    def drain(sock):
        results.append(read_until_closed(sock, [b"x-a: b\r\n"] * 100)[0][:20])

    threads = [threading.Thread(target=drain, args=(s,)) for s in socks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND + 5)
    for sock in socks:
        sock.close()
    assert len(results) == 2 * LIMIT
    assert all(r.startswith((b"HTTP/1.1 408", b"HTTP/1.1 503")) for r in results), results
    assert httpx.get(live.url + "/health", timeout=BOUND).status_code == 200


class FakeTransport:
    """Just enough of an asyncio transport for a protocol that never sees a byte."""

    def __init__(self):
        self.aborted = self.closed = False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5), "sockname": ("127.0.0.1", 6)}.get(name, default)

    def is_closing(self):
        return self.aborted or self.closed

    def abort(self):
        self.aborted = True

    def close(self):
        self.closed = True

    def write(self, data):
        pass


def test_client_that_reads_nothing_is_dropped():
    """Writing paused (the client reads nothing, the buffers are full) for ``timeout_write`` seconds: the
    connection is dropped (aborted: a close would wait for the buffer to drain); resumed in time, it is kept.
    Loopback buffers absorb several MB, so this drives the protocol's flow-control hooks directly."""
    import asyncio
    import functools

    import uvicorn
    from uvicorn.server import ServerState

    from deepseek_v41.server.launch import GuardedH11Protocol

    async def app(scope, receive, send):
        pass

    async def run():
        limits = ConnectionLimits(timeout_header=30, timeout_write=0.05, limit_concurrency=8)
        config = uvicorn.Config(app, http=functools.partial(GuardedH11Protocol, limits=limits), log_level="warning")
        config.load()
        stalled, resumed = FakeTransport(), FakeTransport()
        for transport in (stalled, resumed):
            protocol = GuardedH11Protocol(config=config, server_state=ServerState(), app_state={}, limits=limits)
            protocol.connection_made(transport)
            protocol.pause_writing()
            if transport is resumed:
                protocol.resume_writing()
        await asyncio.sleep(0.5)
        return stalled.aborted, resumed.aborted

    assert asyncio.run(run()) == (True, False)
