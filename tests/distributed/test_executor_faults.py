"""Faults of the mp executor (issue 28): a SIGKILLed worker fails the next step naming its rank within seconds; a
stopped (hung) worker fails it after ``distributed_timeout_s`` naming the rank and its state; a worker whose
outputs differ from rank 0's stops with "diverged"; no process is left behind, also when the interpreter exits
without ``LLM.shutdown()``."""

import os
import signal
import subprocess
import sys
import time
from multiprocessing import Pipe
from pathlib import Path

import pytest

from deepseek_v41 import LLM, SamplingParams
from deepseek_v41.distributed import protocol
from deepseek_v41.distributed.worker import follow
from deepseek_v41.engine.engine import EngineArgs, LLMEngine
from deepseek_v41.model.checkpoint import load_model

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"
KW = dict(tensor_parallel_size=2, dtype="float32", max_num_seqs=2, max_model_len=128)
PROMPT = {"prompt_token_ids": [3, 4, 5]}


def gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (reaped, or a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_sigkilled_worker_fails_the_next_step_naming_its_rank():
    llm = LLM(CKPT, **KW)
    (proc,) = llm.engine.executor._procs.values()
    try:
        os.kill(proc.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"worker rank 1 \(pid {proc.pid}\) died: killed by SIGKILL"):
            llm.generate(PROMPT, SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()
    assert gone(proc.pid)


@pytest.mark.slow
def test_stopped_worker_fails_the_step_after_the_timeout_naming_its_rank():
    llm = LLM(CKPT, distributed_timeout_s=3, **KW)
    (proc,) = llm.engine.executor._procs.values()
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"worker rank 1 \(pid {proc.pid}\): stopped"):
            llm.generate(PROMPT, SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - start < 15
        with pytest.raises(RuntimeError, match="stopped"):  # the ranks are out of step: every later step refuses
            llm.generate(PROMPT, SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        llm.shutdown()
    assert gone(proc.pid)


def test_worker_stops_when_its_outputs_differ_from_rank_0():
    engine = LLMEngine(load_model(CKPT, dtype="float32"), EngineArgs(max_num_seqs=2, max_model_len=128))
    driver, worker = Pipe()
    add = protocol.add_event("a", [3, 4, 5], SamplingParams(temperature=0, max_tokens=4), None, 1.0, None)
    driver.send_bytes(protocol.encode({"type": "step", "step": 0, "events": [add], "observation": None,
                                       "digest": None}))
    driver.send_bytes(protocol.encode({"type": "step", "step": 1, "events": [], "observation": None,
                                       "digest": "not-rank-1s"}))
    with pytest.raises(RuntimeError, match="rank 1 diverged from rank 0 at step 0"):
        follow(worker, engine, 1)


@pytest.mark.slow  # ~6 s: .ci/run's slow tests
def test_interpreter_exit_without_shutdown_leaves_no_worker(tmp_path):
    script = ("from deepseek_v41 import LLM, SamplingParams\n"
              f"llm = LLM({str(CKPT)!r}, tensor_parallel_size=2, dtype='float32', max_model_len=128)\n"
              "print(*[p.pid for p in llm.engine.executor._procs.values()], flush=True)\n"
              "llm.generate({'prompt_token_ids': [3, 4, 5]}, SamplingParams(max_tokens=2), use_tqdm=False)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    (pid,) = map(int, done.stdout.split())
    deadline = time.monotonic() + 5
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(pid)
