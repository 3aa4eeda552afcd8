"""The paged engine on a sharded model, 2 gloo ranks in lockstep (issue 28): every rank builds
``LLMEngine(sharded_model, EngineArgs(...))``, gets the same ``add_request`` calls and steps until done.

Oracle: the same engine on the unsharded float64 model in this process; greedy tokens must be identical (float64:
the sharded sums differ in the last bits only). Cases (shard_worker.ENGINE_CASES): chunked prefill (16 tokens a
step, 4-token pages) with exact prefill, with CED prefill, and DSpark speculative decoding with the fixed cost
table (every step speculates, so both ranks speculate alike), and an fp32 run (CED, chunked) where the fast
backend's kernels serve the decode steps. Prompts share a 20-token prefix (a prefix-cache hit on the device tier).
``engine_disk``: KV pages on disk read back by a new engine (a prefix hit from disk, exact replay).
"""

from __future__ import annotations

import pytest
from shard_worker import ENGINE_CASES, run_case, spawn

from deepseek_v41.distributed.comm import ParallelState

CASES = [*sorted(ENGINE_CASES), "engine_disk"]


@pytest.fixture(scope="module")
def oracle():
    return {case: run_case(case, ParallelState.single())[0] for case in CASES}


def check(layout: str, oracle: dict, tmp_path) -> None:
    ranks = spawn(layout, CASES, tmp_path, timeout=240)
    # Each rank wrote its KV pages to its own cache_dir and a new engine read them back (exact replay): the hit is
    # as long as one process's and the tokens are the same (one shared directory with rank 0 as its only writer is
    # the executor's, tests/distributed/test_executor*.py).
    disk = oracle["engine_disk"]
    assert disk["cached"]["reader"] > 0
    for got in ranks:
        assert got["engine_disk"][0]["tokens"] == disk["tokens"] and got["engine_disk"][0]["cached"] == disk["cached"]
    for case in sorted(ENGINE_CASES):
        ref = oracle[case]["tokens"]
        assert all(len(t) == 12 for t in ref.values())
        for r, got in enumerate(ranks):
            assert got[case][0]["tokens"] == ref, (layout, case, r)
        assert ranks[0][case][0]["steps"] == ranks[1][case][0]["steps"]
        assert ranks[0][case][0]["spec"] == ranks[1][case][0]["spec"] == oracle[case]["spec"]
    # The draft ran (through the vocab-parallel embed / head) and verified drafts.
    assert oracle["engine_dspark"]["spec"]["spec_decode_num_draft_tokens"] > 0


@pytest.mark.slow  # ~12 s: .ci/run's slow tests (test_executor.py covers TP=2 lockstep in make test)
@pytest.mark.timeout(300)
def test_tp2_ep_engine_equal_one_process(oracle, tmp_path):
    """TP=2 + EP: vocab-parallel embed / head / draft, head-split attention, expert-parallel MoE (decode batches
    smaller than 2 leave a rank with no rows to route)."""
    check("tp2ep", oracle, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["ep2", "tp2"])
def test_engine_equal_one_process(layout, oracle, tmp_path):
    check(layout, oracle, tmp_path)



@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["tp2", "tp2ep"])
def test_bundled_checkpoint_loaded_by_slices(layout, tmp_path):
    """checkpoints/v41-tiny read slice by slice on each rank (load_sharded, fp32), DSpark on: the same greedy
    tokens as one process, and each rank holds less than the whole model."""
    ref = run_case("bundled", ParallelState.single())[0]
    assert ref["spec"]["spec_decode_num_draft_tokens"] > 0
    for got in spawn(layout, ["bundled"], tmp_path, timeout=360):
        data = got["bundled"][0]
        assert data["tokens"] == ref["tokens"]
        assert data["bytes"]["total"] < ref["bytes"]["total"]
