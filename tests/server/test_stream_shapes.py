"""Every chat and completions stream shape ends well: n = 1..4, plain text, tool calls, reasoning and stop strings,
with the choices finishing in the same step and in different steps. Each stream has one role chunk and exactly one
finish chunk per choice (nothing for a choice after its finish), the usage chunk last when asked, then ``[DONE]``;
what each choice streams concatenates to the non-streamed answer. The engine is real; only the sampler replays a
fixed completion per sequence (issue 22 item 10: a chat stream with ``n: 2`` broke off with "feed() after
finish()" when its choices finished in different steps)."""

import json
from collections import Counter

import httpx
import pytest
from serving_helpers import KEYS, MODEL, auth, chunks, scripted_each, sse

from deepseek_v41.chat.tokens import CALLS_CLOSE, CALLS_OPEN, INVOKE_CLOSE, INVOKE_OPEN, PARAM_CLOSE, PARAM_OPEN

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = (f"\n\n{CALLS_OPEN}\n{INVOKE_OPEN}get_weather\">\n{PARAM_OPEN}city\" string=\"true\">Paris{PARAM_CLOSE}\n"
        f"{INVOKE_CLOSE}\n{CALLS_CLOSE}")
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
# Scripts of different lengths finish in different steps; the same script n times finishes in one step.
DIFFERENT = ["Hi.", "Hello world!", "The city is Paris, 123.", "Hello world! The city is Paris, 123 ka lo mi."]
SHAPES = {
    "same_step": ([DIFFERENT[2]] * 4, {}),
    "different_steps": (DIFFERENT, {}),
    "tools": (["Let me check." + CALL, "No call needed.", CALL, "Sunny, I think."], {"tools": TOOLS}),
    "reasoning": (["Short.</think>Hello!", "The user greets; answer briefly.</think>Hello world!", "Hm.</think>Hi.",
                   "Think.</think>The city is Paris."], {"chat_template_kwargs": {"thinking": True}}),
    "stop_strings": (DIFFERENT, {"stop": ["Paris", "world"]}),
}


def _chat_choice(message: dict, finish: str) -> tuple:
    calls = tuple((c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or [])
    return message.get("content") or "", message.get("reasoning_content") or "", calls, finish


def _check_stream(events: list[dict], n: int, include_usage: bool, key: str) -> dict[int, list[dict]]:
    """The stream's structure; returns each choice's pieces (role chunk excluded) up to its finish chunk."""
    if include_usage:
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
        events = events[:-1]
    assert all(len(e["choices"]) == 1 for e in events)
    pieces: dict[int, list[dict]] = {}
    finished = set()
    for event in events:
        choice = event["choices"][0]
        index = choice["index"]
        assert 0 <= index < n and index not in finished, f"a piece for choice {index} after its finish"
        if choice["finish_reason"] is not None:
            finished.add(index)
        pieces.setdefault(index, []).append(choice)
    assert finished == set(range(n)), f"finish chunks for {sorted(finished)} of {n} choices"
    for parts in pieces.values():
        assert sum(p["finish_reason"] is not None for p in parts) == 1
        if key == "delta":
            assert parts[0]["delta"] == {"role": "assistant", "content": ""}
    return pieces


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_chat_stream_shapes(server, shape, n):
    texts, extra = SHAPES[shape]
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 80, "n": n, "temperature": 1.0, **extra}
    include_usage = n % 2 == 0
    with scripted_each(server, texts[:n]):
        full = httpx.post(server.v1 + "/chat/completions", json=body, headers=auth(KEYS[0]), timeout=60)
    assert full.status_code == 200, full.text
    with scripted_each(server, texts[:n]):
        events = chunks(sse(server.v1 + "/chat/completions",
                            {**body, "stream_options": {"include_usage": include_usage}}, KEYS[0]))
    pieces = _check_stream(events, n, include_usage, "delta")
    streamed = []
    for parts in pieces.values():
        content = "".join(p["delta"].get("content") or "" for p in parts)
        reasoning = "".join(p["delta"].get("reasoning_content") or "" for p in parts)
        calls: dict[int, list[str]] = {}
        for part in parts:
            for call in part["delta"].get("tool_calls") or []:
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += call.get("function", {}).get("name") or ""
                entry[1] += call.get("function", {}).get("arguments") or ""
        streamed.append((content, reasoning, tuple(tuple(c) for c in calls.values()), parts[-1]["finish_reason"]))
    expected = [_chat_choice(c["message"], c["finish_reason"]) for c in full.json()["choices"]]
    assert Counter(streamed) == Counter(expected)
    if shape == "tools":
        assert "tool_calls" in {e[3] for e in expected if e[2]} or n < 3
        assert all(json.loads(args) == {"city": "Paris"} for e in expected for _, args in e[2])


@pytest.mark.parametrize("shape", ["same_step", "different_steps", "stop_strings"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_completion_stream_shapes(server, shape, n):
    texts, extra = SHAPES[shape]
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 80, "n": n, "temperature": 1.0, **extra}
    include_usage = n % 2 == 1
    with scripted_each(server, texts[:n]):
        full = httpx.post(server.v1 + "/completions", json=body, headers=auth(KEYS[0]), timeout=60)
    assert full.status_code == 200, full.text
    with scripted_each(server, texts[:n]):
        events = chunks(sse(server.v1 + "/completions", {**body, "stream_options": {"include_usage": include_usage}},
                            KEYS[0]))
    pieces = _check_stream(events, n, include_usage, "text")
    streamed = Counter(("".join(p["text"] for p in parts), parts[-1]["finish_reason"]) for parts in pieces.values())
    assert streamed == Counter((c["text"], c["finish_reason"]) for c in full.json()["choices"])


def test_failing_chunk_generator_still_ends_the_stream():
    """A chunk generator that raises mid-stream: the client gets the chunks so far, an error event, then [DONE]."""
    import asyncio

    from deepseek_v41.server.streaming import SSEResponse

    async def broken():
        yield {"n": 1}
        raise RuntimeError("bug")

    async def run():
        sent = []
        never = asyncio.Event()

        async def receive():
            await never.wait()

        async def send(message):
            sent.append(message)

        await SSEResponse(broken())({"type": "http"}, receive, send)
        return b"".join(m.get("body", b"") for m in sent).decode().split("\n\n")

    events = [e for e in asyncio.run(run()) if e]
    assert events[0] == 'data: {"n":1}' and events[-1] == "data: [DONE]"
    assert json.loads(events[1][len("data: "):])["error"]["code"] == "internal_error"
