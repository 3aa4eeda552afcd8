"""``dsv41 router`` on the command line: bad flags exit 2 with a message naming the flag; a running router answers
through its backends and drains on SIGTERM, leaving no process behind (issue 29)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from test_router import Fake, Live
from typer.testing import CliRunner

from deepseek_v41.cli import app


@pytest.mark.parametrize("args, message", [
    ([], "at least one --decode URL is required"),
    (["--prefill", "http://127.0.0.1:8100"], "at least one --decode URL is required"),
    (["--decode", "localhost:8200"], "--decode 'localhost:8200' is not an http(s) URL"),
    (["--decode", "http://127.0.0.1:8200", "--prefill", "http://127.0.0.1:8100/v1"],
     "--prefill 'http://127.0.0.1:8100/v1': give the server's base URL only"),
    (["--decode", "http://127.0.0.1:8200", "--encode", "http://[::1"], "--encode 'http://[::1' is not a valid URL"),
    (["--decode", "http://127.0.0.1:8200", "--health-interval-s", "0"], "--health-interval-s must be > 0"),
    (["--decode", "http://127.0.0.1:8200", "--request-timeout-s", "-1"], "--request-timeout-s must be > 0"),
    (["--decode", "http://127.0.0.1:8200", "--log-level", "loud"], "--log-level 'loud' is not one of"),
])
def test_bad_flags_exit_2(args, message):
    result = CliRunner().invoke(app, ["router", *args])
    assert result.exit_code == 2 and f"error: {message}" in result.output, result.output


def test_router_process_serves_and_drains(tmp_path):
    decode = Fake("decode")
    decode.live = Live(decode.app())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "router.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "deepseek_v41.cli", "router", "--decode", decode.live.url,
                                    "--port", str(port), "--health-interval-s", "0.2", "--drain-timeout", "5"],
                                   stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        response = httpx.post(url + "/v1/completions", json={"prompt": "Hi"}, timeout=10)
        assert response.status_code == 200 and response.json()["served_by"] == "decode"
        assert "dsv41:router_requests_total" in httpx.get(url + "/metrics", timeout=5).text
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after the drain
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        decode.live.stop()
    text = log.read_text()
    assert "routing on " + url in text and "prefill none (decode servers prefill)" in text, text
