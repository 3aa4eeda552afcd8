"""``AsyncLLMEngine`` without HTTP: streamed deltas concatenate to the final text (stop strings held back and
cut), abort frees pages, refused requests raise at the first iteration, the engine keeps serving after them."""

import asyncio
import contextlib

import pytest

from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.engine.async_engine import ABORT, AsyncLLMEngine, EngineDrainingError
from deepseek_v41.engine.sequence import EngineRequest


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_num_seqs=8, max_model_len=256)


async def collect(engine, request_id, ids, params):
    outputs = []
    async for out in engine.generate(request_id, ids, params):
        outputs.append(out)
    return outputs


def test_deltas_add_up_and_abort_frees_pages(llm):
    async def run():
        engine = AsyncLLMEngine(llm.engine)
        ids = llm.tokenizer.encode("Hello world").ids
        greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        (reference,) = [o for o in await collect(engine, "ref", ids, greedy) if o.finished]
        stop = reference.output.outputs[0].text[8:11]
        stopped = await collect(engine, "stop", ids, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                                    stop=[stop]))
        sampled = await collect(engine, "n", ids, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=7,
                                                                 ignore_eos=True))
        for outputs in (stopped, sampled):
            final = outputs[-1].output
            assert final.finished and sum(o.finished for o in outputs) == 1
            for i, completion in enumerate(final.outputs):
                assert "".join(o.delta_text[i] for o in outputs) == completion.text
                assert [t for o in outputs for t in o.delta_token_ids[i]] == completion.token_ids
                assert [r for o in outputs for r in [o.finish_reasons[i]] if r] == [completion.finish_reason]
        assert stopped[-1].output.outputs[0].text == reference.output.outputs[0].text[:8]

        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        stream = engine.generate("gone", ids, long)
        await anext(stream)
        assert engine.stats["kv_pages_used"] > 0
        await stream.aclose()
        for _ in range(200):
            if engine.stats["kv_pages_used"] == 0 and not llm.engine.requests:
                break
            await asyncio.sleep(0.01)
        assert engine.stats["kv_pages_used"] == 0 and not llm.engine.requests

        with pytest.raises(ValueError, match="token ids"):
            await collect(engine, "bad", [10**6], greedy)
        assert (await collect(engine, "after", ids, greedy))[-1].output.outputs[0].text == \
            reference.output.outputs[0].text
        await engine.shutdown()
        with pytest.raises(EngineDrainingError):
            await collect(engine, "late", ids, greedy)

    asyncio.run(run())


def test_abort_reports_abort_to_observers(llm):
    async def run():
        engine = AsyncLLMEngine(llm.engine)
        seen = []
        engine.add_observer(lambda outputs, stats: seen.extend(r for o in outputs for r in o.finish_reasons if r))
        ids = llm.tokenizer.encode("Hello").ids
        stream = engine.generate("x", ids, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        await anext(stream)
        engine.abort("x")
        with contextlib.suppress(StopAsyncIteration):
            while True:
                out = await anext(stream)
        assert out.finished and out.finish_reasons == [ABORT]
        await engine.shutdown()
        assert seen == [ABORT]

    asyncio.run(run())


def test_engine_failure_fails_requests_and_health(model_dir):
    """A step that raises stops the loop: running and later requests get EngineDeadError (the server's 503)."""
    from deepseek_v41.engine.async_engine import EngineDeadError

    broken = LLM(model_dir, max_num_seqs=2, max_model_len=64)

    def step():
        raise RuntimeError("simulated kernel failure")

    broken.engine.step = step

    async def run():
        engine = AsyncLLMEngine(broken.engine)
        with pytest.raises(EngineDeadError, match="simulated"):
            await collect(engine, "a", [5, 6], SamplingParams(max_tokens=2))
        assert engine.errored
        with pytest.raises(EngineDeadError):
            await collect(engine, "b", [5, 6], SamplingParams(max_tokens=2))
        await engine.shutdown()

    asyncio.run(run())


def test_a_request_crosses_to_the_engine_thread_as_one_typed_object(llm, monkeypatch):
    """``generate`` queues an :class:`EngineRequest` (not a kwargs dict); the worker thread adds it with every
    field, ``cache_salt`` included."""
    added = []
    original = llm.engine.add_request

    def add_request(request_id, **fields):
        added.append((request_id, fields))
        return original(request_id, **fields)

    monkeypatch.setattr(llm.engine, "add_request", add_request)

    async def run():
        engine = AsyncLLMEngine(llm.engine)
        queued, work = [], engine._work
        engine._work = lambda adds, aborts: (queued.extend(adds), work(adds, aborts))[1]
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        async for _ in engine.generate("typed", [5, 6, 7], params, prompt="abc", cache_salt="tenant-a",
                                       arrival_time=123.0):
            pass
        await engine.shutdown()
        return queued

    queued = asyncio.run(run())
    assert queued == [EngineRequest("typed", [5, 6, 7], queued[0].params, "abc", "tenant-a", 123.0)]
    assert added == [("typed", {"prompt_token_ids": [5, 6, 7], "params": queued[0].params, "prompt": "abc",
                                "arrival_time": 123.0, "cache_salt": "tenant-a"})]


def test_engine_built_on_its_engine_thread_steps_there(model_dir):
    """`engine_thread`: the executor that built the engine runs its steps (one thread does all its torch work:
    one OpenMP team, issue 25); an executor of more than one thread is refused."""
    import threading

    from deepseek_v41.engine.async_engine import engine_thread

    thread = engine_thread()
    built_on = thread.submit(threading.get_ident).result()
    llm = thread.submit(LLM, model_dir, max_num_seqs=2, max_model_len=64).result()
    stepped_on = set()
    step = llm.engine.step

    def watched_step():
        stepped_on.add(threading.get_ident())
        return step()

    llm.engine.step = watched_step

    async def run():
        engine = AsyncLLMEngine(llm.engine, executor=thread)
        outputs = await collect(engine, "r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        await engine.shutdown()
        return outputs

    outputs = asyncio.run(run())
    assert len(outputs[-1].output.outputs[0].token_ids) == 4
    assert stepped_on == {built_on}
    from concurrent.futures import ThreadPoolExecutor

    for executor in (ThreadPoolExecutor(max_workers=2), ThreadPoolExecutor(max_workers=1)):
        with pytest.raises(ValueError, match=r"pass engine_thread\(\) \(an EngineThread\), got ThreadPoolExecutor"):
            AsyncLLMEngine(llm.engine, executor=executor)
        executor.shutdown()
