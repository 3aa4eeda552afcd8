"""``dsv41 serve`` as a process: it serves, logs throughput, and drains on SIGTERM (a running stream finishes,
then the process exits)."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


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


def run_serve(*flags: str):
    """``dsv41 serve FLAGS`` in this process (for settings refused before the server starts)."""
    from typer.testing import CliRunner

    from deepseek_v41.cli import app

    return CliRunner().invoke(app, ["serve", *flags])


def bad_device() -> str:
    import torch

    return "cuda:99" if torch.cuda.is_available() else "cuda"


@pytest.mark.parametrize(("flags", "message"), [
    (["--port", "99999"], "'--port'"),
    (["--port", "0"], "'--port'"),
    (["--max-model-len", "0"], "'--max-model-len'"),
    (["--max-num-seqs", "-1"], "'--max-num-seqs'"),
    (["--max-num-batched-tokens", "0"], "'--max-num-batched-tokens'"),
    (["--block-size", "0"], "'--block-size'"),
    (["--num-kv-pages", "0"], "'--num-kv-pages'"),
    (["--kv-cache-memory-bytes", "0"], "'--kv-cache-memory-bytes'"),
    (["--swa-pool-bytes", "-1"], "'--swa-pool-bytes'"),
    (["--threads", "0"], "'--threads'"),
    (["--speculative-max-len", "0"], "'--speculative-max-len'"),
    (["--drain-timeout", "-1"], "'--drain-timeout'"),
    (["--max-body-mb", "0"], "--max-body-mb must be > 0"),
    (["--timeout-header", "0"], "--timeout-header must be > 0 seconds"),
    (["--timeout-body", "-1"], "--timeout-body must be > 0 seconds"),
    (["--timeout-keep-alive", "0"], "--timeout-keep-alive must be > 0 seconds"),
    (["--timeout-write", "0"], "--timeout-write must be > 0 seconds"),
    (["--limit-concurrency", "0"], "'--limit-concurrency'"),
    (["--log-level", "loud"], "--log-level must be one of critical, error"),
    (["--replay", "sometimes"], "--replay must be one of bounded, exact"),
    (["--dtype", "int8"], "--dtype must be one of auto, float32, bfloat16, float16, float64"),
    (["--device", "foo"], "'foo' is not a torch device name; available here: cpu"),
    (["--device", "meta"], "device type 'meta' is not supported"),
    (["--device", bad_device()], "available here: cpu"),
    (["--speculative-max-len", "2"], "--speculative-max-len needs --speculative dspark"),
    (["--num-kv-pages", "1"], "cannot hold one sequence"),  # an engine check, after the model is loaded
])
def test_serve_refuses_bad_settings_cleanly(model_dir, tmp_path, monkeypatch, flags, message):
    """Exit 2 with the message on stderr (no traceback, no silent default), and no cache directory created."""
    import deepseek_v41.server.cli as serve_cli

    monkeypatch.setattr(serve_cli, "DEFAULT_CACHE_DIR", tmp_path / "home" / ".cache" / "prefix-cache")
    result = run_serve("--model", str(model_dir), *flags)
    assert result.exit_code == 2, (result.output, result.exception)
    assert message in " ".join(result.stderr.split()), result.stderr
    assert not (tmp_path / "home").exists()
    explicit = run_serve("--model", str(model_dir), "--cache-dir", str(tmp_path / "a" / "b"), *flags)
    assert explicit.exit_code == 2 and not (tmp_path / "a").exists()


def test_serve_failed_start_removes_the_cache_dir_it_created(model_dir, tmp_path):
    """A start that fails after the engine made its cache directory (here: the port is taken) removes it again;
    the startup line names the cache directory and the speculative mode."""
    home = tmp_path / "home"
    home.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "deepseek_v41.cli", "serve", "--model", str(model_dir),
                                 "--port", str(port), "--threads", "1", "--speculative", "dspark"],
                                capture_output=True, text=True, timeout=300,
                                env={**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0 and "address already in use" in result.stderr, result.stderr[-2000:]
    cache = home / ".cache" / "deepseek_v41" / "prefix-cache"
    assert f"prefix caching on, cache dir {cache}" in result.stderr
    assert "speculative decoding dspark (up to" in result.stderr
    # The prefix-cache directory it made is gone; what may stay is the remembered weight digest of the checkpoint
    # (cache/fingerprint.py: kept so the next start does not rehash the weights), and nothing else.
    assert not cache.exists()
    left = sorted(p.relative_to(home).as_posix() for p in home.rglob("*"))
    assert all(p == ".cache" or p.startswith(".cache/deepseek_v41") and (p.count("/") < 2 or "/weight-digests" in p)
               for p in left), left
    assert not [p for p in left if p.startswith(".cache/deepseek_v41/") and "weight-digests" not in p], left
