"""Multi-prompt ``/v1/completions`` submits its prompts together (issue 22 item 17): the 32 prompts of one request
reach the engine before its next step, so they share steps and the first token of all 32 comes as soon as one's
(they were submitted one after another, one engine step each)."""

import threading

import httpx
from serving_helpers import KEYS, MODEL, auth, chunks, sse


def test_prompts_are_submitted_together(server):
    engine = server.llm.engine
    steps, added, lock = [0], [], threading.Lock()
    original_add, original_step = engine.add_request, engine.step

    def add_request(request_id, **kwargs):
        with lock:
            added.append(steps[0])
        return original_add(request_id, **kwargs)

    def step():
        with lock:
            steps[0] += 1
        return original_step()

    engine.add_request, engine.step = add_request, step
    try:
        prompts = [[5 + i, 40 + i, 90 + i] for i in range(32)]
        body = {"model": MODEL, "prompt": prompts, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
        events = chunks(sse(server.v1 + "/completions", body, KEYS[0]))
    finally:
        del engine.add_request, engine.step
    assert len(added) == 32 and len(set(added)) == 1, f"prompts added before engine steps {sorted(set(added))}"
    finishes = sorted(e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"])
    assert finishes == list(range(32))
    full = httpx.post(server.v1 + "/completions", json=body, headers=auth(KEYS[0]), timeout=60).json()
    texts = {c["index"]: c["text"] for c in full["choices"]}
    streamed = {i: "".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == i) for i in texts}
    assert streamed == texts
