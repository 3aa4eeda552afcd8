"""Two "nodes" on one machine (issue 28): ``dsv41 generate --nnodes 2 --node-rank 0 --master-port P`` and
``--nnodes 2 --node-rank 1 --headless`` (two launches on 127.0.0.1, one rank each, tensor parallel 2) give the
tokens of one process; both exit 0 and leave no process behind."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deepseek_v41 import LLM, SamplingParams

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"


def free_port_pair() -> int:
    """A port P with P and P + 1 free on 127.0.0.1 now."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", port + 1))
                    return port
            except OSError:
                continue
    raise AssertionError("no free port pair")


@pytest.mark.slow  # two launches of dsv41 generate, ~8 s: .ci/run's slow tests
def test_two_launches_give_one_process_tokens(tmp_path):
    expected = LLM(CKPT, dtype="float64", max_model_len=256).generate(
        "Hello there", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0].token_ids
    port = free_port_pair()
    common = [sys.executable, "-m", "deepseek_v41.cli", "generate", str(CKPT), "--dtype", "float64",
              "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port",
              str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DSV41_DIST_AUTHKEY": "test-secret"}
    with open(tmp_path / "node1.log", "wb") as log:
        node1 = subprocess.Popen([*common, "--node-rank", "1", "--headless"], stdout=log, stderr=subprocess.STDOUT,
                                 env=env)
    try:
        node0 = subprocess.run([*common, "--node-rank", "0", "-p", "Hello there", "-m", "6", "--no-chat", "--json"],
                               capture_output=True, text=True, env=env, timeout=120)
        assert node0.returncode == 0, node0.stderr
        assert json.loads(node0.stdout)["token_ids"] == expected
        assert node1.wait(30) == 0, (tmp_path / "node1.log").read_text()
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
