"""``AsyncLLMEngine.reset_prefix_cache`` (on the engine's worker thread, between steps) and the development route
``POST /reset_prefix_cache`` (vLLM's, served only in dev mode)."""

import asyncio
import threading

import pytest
from fastapi.testclient import TestClient
from serving_helpers import MODEL

from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.engine.async_engine import AsyncLLMEngine
from deepseek_v41.server.app import build_app
from deepseek_v41.server.common import ServerConfig

PROMPT = list(range(5, 5 + 40))  # two full pages of 16 tokens and a rest
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_num_seqs=4, max_model_len=256, swa_pool_bytes=1 << 26)


async def final(engine, request_id, ids, params=GREEDY):
    outputs = [out async for out in engine.generate(request_id, ids, params)]
    return outputs[-1].output


def test_async_reset_runs_on_the_engine_thread_and_is_refused_while_a_request_holds_pages(llm, monkeypatch):
    threads = []
    reset = llm.engine.reset_prefix_cache

    def recording(*args):
        threads.append(threading.current_thread().name)
        return reset(*args)

    monkeypatch.setattr(llm.engine, "reset_prefix_cache", recording)

    async def run():
        engine = AsyncLLMEngine(llm.engine)
        cold = await final(engine, "cold", PROMPT)
        assert (await final(engine, "hit", PROMPT)).num_cached_tokens == 32
        long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        reference = await final(engine, "reference", PROMPT, long)
        stream = engine.generate("busy", PROMPT, long)
        first = await anext(stream)
        assert first.output.num_cached_tokens == 32 and engine.stats["kv_pages_used"] > 0
        assert await engine.reset_prefix_cache() is False
        rest = [out async for out in stream]
        assert rest[-1].output.outputs[0].token_ids == reference.outputs[0].token_ids  # nothing corrupted
        assert await engine.reset_prefix_cache() is True
        again = await final(engine, "again", PROMPT)
        assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == cold.outputs[0].token_ids
        # reset_running_requests: the streamed request is preempted, recomputes and ends as before.
        stream = engine.generate("preempted", PROMPT, long)
        await anext(stream)
        assert await engine.reset_prefix_cache(reset_running_requests=True) is True
        rest = [out async for out in stream]
        assert rest[-1].output.outputs[0].token_ids == reference.outputs[0].token_ids
        assert llm.engine.scheduler.num_preemptions >= 1
        await engine.shutdown()

    asyncio.run(run())
    assert len(threads) == 3 and all(name.startswith("dsv41-engine") for name in threads)


def client_for(llm, **config) -> TestClient:
    settings = dict(served_model_names=[MODEL], log_stats_interval_s=0, drain_timeout_s=5)
    settings.update(config)
    return TestClient(build_app(AsyncLLMEngine(llm.engine), ServerConfig(**settings)))


def complete(client) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_the_route_is_served_in_dev_mode_only(llm):
    with client_for(llm) as client:
        assert client.post("/reset_prefix_cache").status_code == 404
    with client_for(llm, dev_mode=True) as client:
        complete(client)
        assert complete(client)["prompt_tokens_details"]["cached_tokens"] == 32
        assert client.post("/reset_prefix_cache").status_code == 200
        assert complete(client)["prompt_tokens_details"]["cached_tokens"] == 0


def test_the_route_answers_409_when_the_engine_refuses(llm, monkeypatch):
    # (The engine refuses while requests hold KV pages, tested above and in tests/engine; a TestClient cannot hold
    # a request open beside another, so the refusal is the engine's answer here.)
    monkeypatch.setattr(llm.engine, "reset_prefix_cache", lambda reset_running_requests=False: False)
    with client_for(llm, dev_mode=True) as client:
        response = client.post("/reset_prefix_cache")
        assert response.status_code == 409
        assert response.json()["error"]["code"] == "requests_running"


def test_the_route_passes_reset_running_requests(llm, monkeypatch):
    calls = []
    monkeypatch.setattr(llm.engine, "reset_prefix_cache", lambda reset_running_requests=False: calls.append(
        reset_running_requests) or True)
    with client_for(llm, dev_mode=True) as client:
        assert client.post("/reset_prefix_cache").status_code == 200
        assert client.post("/reset_prefix_cache?reset_running_requests=true").status_code == 200
    assert calls == [False, True]


def test_reset_external_is_refused_with_the_reason(llm, monkeypatch):
    """vLLM's reset_external would clear its KV connector; ours keeps the disk / Redis tiers, so the switch is
    refused (400, naming it) rather than ignored, and nothing is reset."""
    calls = []
    monkeypatch.setattr(llm.engine, "reset_prefix_cache", lambda reset_running_requests=False: calls.append(1) or True)
    with client_for(llm, dev_mode=True) as client:
        response = client.post("/reset_prefix_cache?reset_external=true")
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "reset_external"
        assert "persistent tiers" in response.json()["error"]["message"]
    assert calls == []
