"""``dsv41 serve MODEL --tensor-parallel-size 2`` (mp backend, issue 28): the official ``openai`` client gets the
tokens one process gives; a SIGKILLed worker ends the server with a non-zero status and a message naming the rank
within 30 s, and no process is left behind; SIGTERM (slow test) stops the workers too."""

import os
import signal
import time
from pathlib import Path

import openai
import pytest
from process_helpers import alive, children
from serving_helpers import serve_process

from deepseek_v41 import LLM, SamplingParams

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"


@pytest.mark.slow  # ~8 s: .ci/run's slow tests
def test_serve_tp2_answers_openai_and_exits_when_a_worker_is_killed(tmp_path):
    expected = LLM(CKPT, dtype="float32", max_model_len=256, max_num_seqs=4).generate(
        "Hello there", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    log = tmp_path / "serve.log"
    workers: list[int] = []
    with serve_process([str(CKPT), "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4",
                        "--cache-dir", str(tmp_path / "cache"), "--tensor-parallel-size", "2",
                        "--distributed-executor-backend", "mp", "--served-model-name", "tiny",
                        "--log-stats-interval", "0"], log) as (process, url):
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
    text = log.read_text()
    assert f"worker rank 1 (pid {workers[0]}) died: killed by SIGKILL" in text
    assert not any(alive(pid) for pid in workers)


@pytest.mark.slow
def test_serve_tp2_sigterm_stops_the_workers(tmp_path):
    log = tmp_path / "serve.log"
    with serve_process([str(CKPT), "--dtype", "float32", "--max-model-len", "256", "--cache-dir",
                        str(tmp_path / "cache"), "-tp", "2", "--enable-expert-parallel", "--log-stats-interval", "0"],
                       log) as (process, _):
        workers = children(process.pid)
        assert len(workers) == 1
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) in (0, -signal.SIGTERM)
    assert not any(alive(pid) for pid in workers), log.read_text()
