"""``--data-parallel-size``: engine replicas behind one server (issue 28; deepseek_v41/engine/data_parallel.py).

Two replicas of the bundled checkpoint give one engine's greedy tokens, route a prompt sharing a recent prompt's
first pages to that prompt's replica (a device-tier hit there), share the prefix cache directory (a page one replica
wrote is a disk hit for the other), and fail together when one fails (the server exits non-zero from ``on_dead``).
"""

import asyncio
from pathlib import Path

import pytest
from serving_helpers import run_serve, serve_process

from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.engine.async_engine import AsyncLLMEngine, EngineDeadError
from deepseek_v41.engine.data_parallel import DataParallelEngine, merge_stats

BUNDLED = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ARGS = dict(dtype="float32", max_model_len=256, max_num_seqs=4, block_size=16)


def prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 500 for i in range(n)]


async def run(front, requests: dict[str, list[int]], params=GREEDY) -> dict[str, object]:
    """Every request's last RequestOutput, all sent at once."""
    async def one(rid, ids):
        last = None
        async for step in front.generate(rid, ids, params):
            last = step.output
        return rid, last

    return dict(await asyncio.gather(*(one(rid, ids) for rid, ids in requests.items())))


@pytest.fixture(scope="module")
def single():
    return LLM(str(BUNDLED), **ARGS, enable_prefix_caching=False)


def test_merge_stats_sums_counts_and_keeps_the_largest_batch():
    a = {"kv_pages_total": 8, "max_decode_batch": 3, "layer_tokens": [1, 2], "prefix_cache": {"hits": 1},
         "prefill_mode": "ced"}
    b = {"kv_pages_total": 8, "max_decode_batch": 5, "layer_tokens": [3, 4], "prefix_cache": {"hits": 2},
         "prefill_mode": "ced"}
    assert merge_stats([a, b]) == {"kv_pages_total": 16, "max_decode_batch": 5, "layer_tokens": [4, 6],
                                   "prefix_cache": {"hits": 3}, "prefill_mode": "ced"}
    with pytest.raises(ValueError, match="at least one"):
        merge_stats([])


def test_two_replicas_route_share_the_disk_cache_and_match_one_engine(single, tmp_path):
    replicas = [LLM(str(BUNDLED), **ARGS, cache_dir=str(tmp_path / "cache")) for _ in range(2)]

    async def scenario():
        front = DataParallelEngine([AsyncLLMEngine(r.engine) for r in replicas])
        front.start()
        try:
            # Four different prompts at once: spread over both replicas, each the single engine's tokens.
            requests = {f"r{i}": prompt(40 + 5 * i, i) for i in range(4)}
            outs = await run(front, requests)
            assert [front.routed[i]["least_loaded"] for i in range(2)] == [2, 2]
            ref = single.generate([{"prompt_token_ids": ids} for ids in requests.values()], GREEDY, use_tqdm=False)
            assert [list(outs[rid].outputs[0].token_ids) for rid in requests] == \
                [list(o.outputs[0].token_ids) for o in ref]
            # A prompt sharing r1's first 32 tokens goes to r1's replica, whose device tier holds them.
            shared = requests["r1"][:32] + prompt(20, 9)
            owner, reason = front.route(shared)
            assert reason == "prefix_affinity"
            out = (await run(front, {"follow": shared}))["follow"]
            assert out.num_cached_tokens == 32
            # The other replica reads the same prompt's pages from the shared directory (disk tier): the three full
            # pages (48 of its 52 tokens) the owner wrote for "follow".
            other = 1 - owner
            replicas[owner].engine.kv_cache_manager.flush()
            steps = [step async for step in front.replicas[other].generate("cross", shared, GREEDY)]
            assert steps[-1].output.num_cached_tokens == 48
            assert front.replicas[other].stats["prefix_cache"]["disk"]["pages_read"] >= 2
        finally:
            await front.shutdown()

    asyncio.run(scenario())


def test_a_failing_replica_fails_the_front_once_naming_it(tmp_path):
    replicas = [LLM(str(BUNDLED), **ARGS, enable_prefix_caching=False) for _ in range(2)]

    def step():
        raise RuntimeError("simulated replica failure")

    replicas[1].engine.step = step
    dead = []

    async def scenario():
        front = DataParallelEngine([AsyncLLMEngine(r.engine) for r in replicas], on_dead=dead.append)
        front.start()
        try:
            front._turn = 1  # the next request goes to replica 1
            with pytest.raises(EngineDeadError):
                await run(front, {"a": prompt(30, 1)})
            await asyncio.sleep(0.05)
            assert front.errored and len(dead) == 1
            with pytest.raises(EngineDeadError, match="replica 1"):
                await run(front, {"b": prompt(30, 2)})
        finally:
            await front.shutdown()

    asyncio.run(scenario())


def test_data_parallel_over_several_ranks_is_refused_naming_the_flags(tmp_path):
    result = run_serve(str(BUNDLED), "--cache-dir", str(tmp_path / "c"), "--data-parallel-size", "2",
                       "--tensor-parallel-size", "2")
    assert result.exit_code == 2
    assert "--data-parallel-size 2" in result.output and "not served yet" in result.output


@pytest.mark.slow
def test_openai_client_against_two_replicas(single, tmp_path):
    import concurrent.futures

    import httpx
    import openai

    texts = ["The history of the city", "In 1990 the team", "A function that returns", "The river flows"]
    ref = [o.outputs[0].text for o in single.generate(texts, SamplingParams(temperature=0, max_tokens=10),
                                                       use_tqdm=False)]
    with serve_process([str(BUNDLED), "--data-parallel-size", "2", "--max-model-len", "256", "--dtype", "float32",
                        "--cache-dir", str(tmp_path / "cache"), "--log-stats-interval", "0"],
                       tmp_path / "serve.log") as (process, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda t: client.completions.create(model="v41-tiny", prompt=t, max_tokens=10,
                                                                    temperature=0).choices[0].text, texts))
        assert got == ref
        assert "dsv41:num_requests_running" in httpx.get(url + "/metrics", timeout=10).text
    assert "data parallel: 2 engine replicas" in (tmp_path / "serve.log").read_text()
