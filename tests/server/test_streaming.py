"""SSE streaming against a live server: the streamed text equals the non-streamed one, exactly one finish chunk,
usage last, ``[DONE]`` at the end; disconnecting clients are cancelled and give their pages back; drain."""

import asyncio
import threading
import time

import httpx
import openai
import pytest
from serving_helpers import KEYS, MODEL, auth, chunks, metrics, sse, start_server

HELLO = [{"role": "user", "content": "Hello world"}]


def test_chat_stream_matches_non_stream(server):
    client = openai.OpenAI(base_url=server.v1, api_key=KEYS[0], max_retries=0)
    request = dict(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**request)
    stream = client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    parts = list(stream)
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == full.choices[0].message.content
    finishes = [p.choices[0].finish_reason for p in parts if p.choices and p.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert parts[-1].choices == [] and parts[-1].usage == full.usage
    assert all(p.usage is None for p in parts[:-1])


def test_raw_sse_shape(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    events = chunks(sse(server.v1 + "/chat/completions", body, KEYS[0]))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    finish = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"] is not None]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == [] and usage["completion_tokens"] == 5
    assert usage["prompt_tokens"] + usage["completion_tokens"] == usage["total_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_cache_hit_tokens"] == 0
    assert usage["prompt_cache_miss_tokens"] == usage["prompt_tokens"]
    plain = chunks(sse(server.v1 + "/chat/completions", {**body, "stream_options": None}, KEYS[0]))
    assert all("usage" not in e for e in plain) and plain[-1]["choices"][0]["finish_reason"] == "length"


def test_completion_stream_matches_non_stream(server):
    client = openai.OpenAI(base_url=server.v1, api_key=KEYS[1], max_retries=0)
    request = dict(model=MODEL, prompt="Hello world", max_tokens=10, temperature=0, stop=["zu"])
    full = client.completions.create(**request)
    parts = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == full.choices[0].text
    assert [p.choices[0].finish_reason for p in parts if p.choices and p.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]
    assert parts[-1].usage == full.usage


def test_stream_n_choices_each_finish_once(server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "n": 3, "temperature": 1.0, "seed": 3,
            "ignore_eos": True}
    events = chunks(sse(server.v1 + "/completions", body, KEYS[0]))
    finishes = sorted(e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"])
    assert finishes == [0, 1, 2]


async def _client_run(client, prompt: str, max_tokens: int, leave_after: int | None) -> dict:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    text, finishes, seen = "", [], 0
    async for part in stream:
        seen += 1
        if leave_after is not None and seen >= leave_after:
            await stream.close()
            return {"left": True}
        if part.choices:
            text += part.choices[0].delta.content or ""
            if part.choices[0].finish_reason:
                finishes.append(part.choices[0].finish_reason)
    return {"left": False, "text": text, "finishes": finishes}


def test_concurrent_streams_with_disconnects(server):
    """32 streaming clients, 8 of which hang up mid-stream: the 24 others get the text a lone request gets, the 8
    are aborted (their long generations stop) and the page pool returns to its starting size."""
    prompts = ["Hello world", "The city is Paris"]
    solo = openai.OpenAI(base_url=server.v1, api_key=KEYS[0], max_retries=0)
    reference = [solo.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=10,
                                              temperature=0, extra_body={"ignore_eos": True}).choices[0].message.content
                 for p in prompts]
    before = metrics(server.url)
    assert before[("dsv41:kv_pages_used", ())] == 0

    async def run():
        client = openai.AsyncOpenAI(base_url=server.v1, api_key=KEYS[0], max_retries=0, timeout=120)
        jobs = [_client_run(client, prompts[i % 2], 120 if i % 4 == 3 else 10, 3 if i % 4 == 3 else None)
                for i in range(32)]
        try:
            return await asyncio.gather(*jobs)
        finally:
            await client.close()

    results = asyncio.run(run())
    kept = [(i, r) for i, r in enumerate(results) if not r["left"]]
    assert len(kept) == 24
    for i, result in kept:
        assert result["finishes"] == ["length"]
        assert result["text"] == reference[i % 2]
    deadline = time.monotonic() + 30
    while True:
        after = metrics(server.url)
        if after[("dsv41:num_requests_running", ())] == 0 and after[("dsv41:num_requests_waiting", ())] == 0:
            break
        assert time.monotonic() < deadline, "aborted requests kept running"
        time.sleep(0.05)
    assert after[("dsv41:kv_pages_used", ())] == before[("dsv41:kv_pages_used", ())]
    aborted = ("dsv41:request_success_total", (("finished_reason", "abort"),))
    assert after[aborted] - before[aborted] == 8
    generated = after[("dsv41:generation_tokens_total", ())] - before[("dsv41:generation_tokens_total", ())]
    assert generated < 24 * 10 + 8 * 120 / 2, "the disconnected requests were not stopped early"
    assert server.engine.num_requests == 0 and not server.llm.engine.requests


def test_drain_finishes_running_streams(model_dir):
    """Shutdown (what SIGTERM triggers) lets a running stream finish, refuses new work, then stops the engine."""
    live = start_server(model_dir, max_num_seqs=2)
    events, started = [], threading.Event()

    def consume():
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 20, "ignore_eos": True}
        with httpx.stream("POST", live.v1 + "/completions", json={**body, "stream": True}, headers=auth(KEYS[0]),
                          timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    events.append(line)
                    started.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert started.wait(30)
    live.stop()
    reader.join(30)
    assert events[-1] == "data: [DONE]"
    assert sum('"finish_reason":"length"' in e for e in events) == 1
    assert not live.thread.is_alive() and not live.engine.is_running
    with pytest.raises(httpx.ConnectError):
        httpx.get(live.url + "/health")
