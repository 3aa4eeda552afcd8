"""DSpark speculative decoding on the mp executor (issue 28): with tensor parallelism 2 (and expert parallelism)
every rank runs the same adaptive policy, fed rank 0's step-time measurements one step late, so the ranks
speculate on the same steps; the greedy float64 tokens equal one process's plain decoding."""

from pathlib import Path

import pytest

from deepseek_v41 import LLM, SamplingParams

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny-chat"
KW = dict(dtype="float64", max_num_seqs=4, max_model_len=256, max_num_batched_tokens=48)
PROMPTS = [{"prompt_token_ids": [3 + (11 * i) % 300 for i in range(n)]} for n in (9, 60)]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def plain():
    return tokens(LLM(CKPT, **KW).generate(PROMPTS, PARAMS, use_tqdm=False))


@pytest.mark.slow  # ~5 s each: .ci/run's slow tests
@pytest.mark.parametrize("parallel", [
    {"tensor_parallel_size": 2},
    pytest.param({"tensor_parallel_size": 2, "enable_expert_parallel": True}, marks=pytest.mark.slow),
    pytest.param({"expert_parallel_size": 2}, marks=pytest.mark.slow),
])
def test_dspark_adaptive_on_two_ranks_matches_plain_decoding(plain, parallel):
    llm = LLM(CKPT, speculative="dspark", **parallel, **KW)
    try:
        assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == plain
        stats = llm.stats
        assert stats["spec_decode_num_draft_tokens"] + stats["spec_decode_num_plain_steps"] > 0
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_dspark_fixed_speculates_every_step_on_two_ranks(plain):
    llm = LLM(CKPT, speculative="dspark", speculative_cost_table="fixed", tensor_parallel_size=2, **KW)
    try:
        assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == plain
        assert llm.stats["spec_decode_num_accepted_tokens"] > 0
    finally:
        llm.shutdown()
