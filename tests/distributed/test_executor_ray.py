"""The Ray backend (issue 28, opt-in): ``distributed_executor_backend="ray"`` runs the worker ranks as Ray actors in a
placement group (a local Ray started and stopped by the engine) and gives the mp backend's tokens; no Ray process
is left behind. Skipped without Ray, except under CI=true."""

import subprocess
from pathlib import Path

import pytest
from optional_deps import require

from deepseek_v41 import LLM, SamplingParams

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"
KW = dict(dtype="float64", max_num_seqs=4, max_model_len=256, max_num_batched_tokens=32, tensor_parallel_size=2)
PROMPTS = [{"prompt_token_ids": [3 + (7 * i) % 200 for i in range(n)]} for n in (5, 70)]
PARAMS = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0.8, seed=3, max_tokens=6)]


def generate(backend: str) -> list[list[int]]:
    llm = LLM(CKPT, distributed_executor_backend=backend, **KW)
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_ray_backend_gives_the_mp_backends_tokens():
    require("ray")
    assert generate("ray") == generate("mp")
    raylets = subprocess.run(["pgrep", "-f", "raylet"], capture_output=True, text=True).stdout.split()
    assert not raylets
