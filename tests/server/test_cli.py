"""``dsv41 serve`` as a process: it serves, logs throughput, and drains on SIGTERM (a running stream finishes,
then the process exits)."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_drains_on_sigterm(model_dir, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "deepseek_v41.cli", "serve", "--model", str(model_dir), "--port", str(port),
               "--api-key", "k1", "--api-key", "k2", "--served-model-name", "tiny", "--max-model-len", "256",
               "--max-num-seqs", "4", "--log-stats-interval", "0.3", "--cache-dir", str(tmp_path / "cache"),
               "--threads", "1"]
    with open(log, "wb") as out:
        # One OpenMP thread: on a shared 2-core machine spinning OpenMP workers slow a tiny model 10x.
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ,
                                                                                      "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "dsv41 serve did not come up"
            time.sleep(0.2)
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": "Bearer k2"},
                          timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 2:
                        process.send_signal(signal.SIGTERM)
        assert lines[-1] == "data: [DONE]" and sum('"finish_reason":"length"' in x for x in lines) == 1
        # uvicorn re-raises the signal once the drain is done, so the process ends "killed by SIGTERM".
        assert process.wait(60) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text()
    assert "draining" in text and "Avg generation throughput" in text
    # The prompt's full pages went to the persistent prefix cache under --cache-dir.
    assert list((tmp_path / "cache").rglob("*.page"))


def test_serve_missing_model_dir(tmp_path):
    result = subprocess.run([sys.executable, "-m", "deepseek_v41.cli", "serve", "--model", str(tmp_path / "none")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "not found" in result.stderr


def test_serve_rejects_bad_engine_settings(model_dir, tmp_path):
    for flags, message in ((["--replay", "sometimes"], "replay must be"),
                           (["--speculative", "medusa"], "speculative must be one of"),
                           (["--speculative", "dspark", "--speculative-max-len", "99"], "speculative_max_len")):
        result = subprocess.run([sys.executable, "-m", "deepseek_v41.cli", "serve", "--model", str(model_dir),
                                 "--cache-dir", str(tmp_path / "cache"), *flags],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and message in result.stderr, (flags, result.stderr[-500:])
