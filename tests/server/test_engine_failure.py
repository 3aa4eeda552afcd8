"""A failure of the engine loop (issue 22 items 12, 16): every request in flight, streaming or not, chat or
completions, one prompt or several, gets the same 503 ``engine_dead`` (never a 500); the server logs the cause and
shuts down by itself, and ``dsv41 serve`` exits non-zero within seconds so that a supervisor restarts it."""

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from serving_helpers import KEYS, MODEL, auth, serve_process, start_server

HELLO = [{"role": "user", "content": "Hello world"}]
LONG = {"model": MODEL, "max_tokens": 400, "ignore_eos": True}


def _answer(url: str, path: str, body: dict) -> tuple[int, dict]:
    """(status, error object) of a request; for a stream, the error event (which must precede one [DONE])."""
    if not body.get("stream"):
        response = httpx.post(url + path, json=body, headers=auth(KEYS[0]), timeout=60)
        return response.status_code, response.json().get("error")
    with httpx.stream("POST", url + path, json=body, headers=auth(KEYS[0]), timeout=60) as response:
        if response.status_code != 200:
            return response.status_code, json.loads(response.read())["error"]
        events = [line[len("data: "):] for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1, events[-3:]
    return 503 if errors[0]["code"] == "engine_dead" else 500, errors[0]


def test_every_in_flight_request_gets_503_engine_dead(model_dir):
    live = start_server(model_dir, max_num_seqs=16, max_model_len=512)
    engine = live.llm.engine
    original, fail = engine.step, threading.Event()

    def step():
        if fail.is_set():
            raise RuntimeError("simulated kernel failure")
        return original()

    engine.step = step
    requests = [("/chat/completions", {**LONG, "messages": HELLO}),
                ("/chat/completions", {**LONG, "messages": HELLO, "stream": True}),
                ("/completions", {**LONG, "prompt": "Hello"}),
                ("/completions", {**LONG, "prompt": ["Hello", "The city"]}),
                ("/completions", {**LONG, "prompt": "Hello", "stream": True}),
                ("/completions", {**LONG, "prompt": ["Hello", "The city"], "n": 2, "temperature": 1.0,
                                  "stream": True})]
    expected_sequences = 1 + 1 + 1 + 2 + 1 + 4
    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            futures = [pool.submit(_answer, live.v1, path, body) for path, body in requests]
            deadline = time.monotonic() + 60
            while len(engine.scheduler.running) + len(engine.scheduler.waiting) < expected_sequences:
                assert time.monotonic() < deadline, "the requests did not all start"
                time.sleep(0.01)
            fail.set()
            answers = [f.result(60) for f in futures]
        messages = set()
        for (path, body), (status, error) in zip(requests, answers, strict=True):
            assert status == 503 and error["code"] == "engine_dead", (path, body, status, error)
            assert error["type"] == "service_unavailable" and "simulated kernel failure" in error["message"]
            messages.add(error["message"])
        assert len(messages) == 1
        # The server shuts itself down with exit code 1 (dsv41 serve exits with it).
        live.thread.join(30)
        assert not live.thread.is_alive() and live.uvicorn_server.exit_code == 1
    finally:
        live.stop()


# Runs `dsv41 serve` with an engine whose third step raises (the failure is injected, the server is the real one).
FAILING_SERVE = """
import runpy, sys
from deepseek_v41.engine.engine import LLMEngine
original, steps = LLMEngine.step, [0]
def step(self):
    steps[0] += 1
    if steps[0] == 3:
        raise RuntimeError("simulated engine failure")
    return original(self)
LLMEngine.step = step
sys.argv = ["dsv41", *sys.argv[1:]]
runpy.run_module("deepseek_v41.cli", run_name="__main__")
"""


def test_serve_exits_nonzero_after_engine_failure(model_dir, tmp_path):
    log = tmp_path / "serve.log"
    with serve_process(["--model", str(model_dir), "--served-model-name", MODEL, "--max-model-len", "256",
                        "--max-num-seqs", "4", "--log-stats-interval", "0", "--cache-dir", str(tmp_path / "cache"),
                        "--threads", "1"], log, launcher=[sys.executable, "-c", FAILING_SERVE]) as (process, url):
        status, error = _answer(url + "/v1", "/completions", {**LONG, "max_tokens": 200, "prompt": "Hello",
                                                                 "stream": True})
        assert status == 503 and "simulated engine failure" in error["message"]
        failed_at = time.monotonic()
        code = process.wait(60)
        assert code == 1, log.read_text()[-3000:]
        assert time.monotonic() - failed_at < 30
    text = log.read_text()
    assert "simulated engine failure" in text and "exiting with status 1" in text


def test_requests_after_the_failure_get_engine_dead_while_shutting_down(model_dir):
    """Between the failure and the exit the server is draining; new requests still learn why (engine_dead)."""
    live = start_server(model_dir, max_num_seqs=2, max_model_len=128)
    state = live.uvicorn_server.config.app.state.server
    live.engine.on_dead = lambda exc: setattr(state, "draining", True)  # shutting down, not yet gone

    def step():
        raise RuntimeError("simulated kernel failure")

    live.llm.engine.step = step
    try:
        status, error = _answer(live.v1, "/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3})
        assert status == 503 and error["code"] == "engine_dead"
        assert state.draining
        for path, body in (("/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3}),
                           ("/chat/completions", {"model": MODEL, "messages": HELLO, "stream": True})):
            status, error = _answer(live.v1, path, body)
            assert status == 503 and error["code"] == "engine_dead", error
        health = httpx.get(live.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    finally:
        live.stop()
