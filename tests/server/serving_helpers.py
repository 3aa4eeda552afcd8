"""Helpers of the server tests: raw SSE reads, /metrics parsing, and a scripted-output sampler (a test backend
that makes the real engine emit a fixed text, for tool-call and thinking round trips)."""

import contextlib
import json

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from deepseek_v41.engine.sampler import SampleOutput


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def sse(url: str, body: dict, key: str, timeout: float = 60.0) -> list[str]:
    """POST ``body`` with ``stream: true`` and return the raw ``data:`` payloads in order (``[DONE]`` included)."""
    events = []
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=auth(key), timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                assert line.startswith("data: "), line
                events.append(line[len("data: "):])
    return events


def chunks(events: list[str]) -> list[dict]:
    """The JSON chunks of an SSE stream, checking that it ends with exactly one ``[DONE]``."""
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    return [json.loads(e) for e in events[:-1]]


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """``/metrics`` as {(sample name, sorted label items without model_name): value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


class ScriptedSampler:
    """Stands in for the engine's sampler: every sequence emits the token ids of ``script`` in order, then EOS."""

    def __init__(self, token_ids: list[int], eos_token_id: int):
        self.token_ids, self.eos = list(token_ids), eos_token_id

    def sample(self, logits, rows) -> SampleOutput:
        picked = [self.token_ids[len(r.output_token_ids)] if len(r.output_token_ids) < len(self.token_ids)
                  else self.eos for r in rows]
        return SampleOutput(torch.tensor(picked, dtype=torch.int64))


@contextlib.contextmanager
def scripted(live, text: str):
    """Make ``live``'s engine answer every request with ``text`` (then EOS) inside the block."""
    engine = live.llm.engine
    ids = engine.tokenizer.encode(text, add_special_tokens=False).ids
    assert engine.tokenizer.decode(ids, skip_special_tokens=False) == text, "the script must round-trip"
    original = engine.sampler
    engine.sampler = ScriptedSampler(ids, engine.config.eos_token_id)
    try:
        yield
    finally:
        engine.sampler = original
