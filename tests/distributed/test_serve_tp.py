"""``dsv41 serve MODEL --tensor-parallel-size 2`` (mp backend, issue 28): the official ``openai`` client gets the
tokens one process gives; a SIGKILLed worker ends the server with a non-zero status and a message naming the rank
within 30 s, and no process is left behind."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from deepseek_v41 import LLM, SamplingParams

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_healthy(process: subprocess.Popen, url: str, log: Path, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"server not healthy in {timeout_s} s:\n{log.read_text()}")


def test_serve_tp2_answers_openai_and_exits_when_a_worker_is_killed(tmp_path):
    expected = LLM(CKPT, dtype="float32", max_model_len=256, max_num_seqs=4).generate(
        "Hello there", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    port = free_port()
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "deepseek_v41.cli", "serve", str(CKPT), "--port", str(port), "--dtype",
               "float32", "--max-model-len", "256", "--max-num-seqs", "4", "--cache-dir", str(tmp_path / "cache"),
               "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp", "--served-model-name", "tiny",
               "--log-stats-interval", "0"]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    workers: list[int] = []
    try:
        wait_healthy(process, url, log)
        workers = children(process.pid)
        assert len(workers) == 1
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        completion = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert completion.choices[0].text == expected.outputs[0].text
        assert completion.usage.completion_tokens == 6
        os.kill(workers[0], signal.SIGKILL)
        start = time.monotonic()
        status = process.wait(30)
        assert status != 0 and time.monotonic() - start < 30
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text()
    assert f"worker rank 1 (pid {workers[0]}) died: killed by SIGKILL" in text
    assert not any(alive(pid) for pid in workers)
