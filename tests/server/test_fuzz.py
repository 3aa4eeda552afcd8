"""Property-based fuzz of the request schema against the live server (hypothesis): generated valid requests get
a 200, and nothing (mutated fields, junk values, unknown keys, non-objects) ever gets a 5xx."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_helpers import KEYS, MODEL

TEXT = st.text(alphabet="abcdefghijklmnopqrstuvwxyz ABC.,!?0123456789", min_size=1, max_size=40)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.integers(min_value=2**63) | st.integers(max_value=-(2**63))
    | st.floats(allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": TEXT}),
    st.fixed_dictionaries({"role": st.just("user"),
                           "content": st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                                               min_size=1, max_size=2)}))
SAMPLING = {
    "temperature": st.floats(0.0, 2.0), "top_p": st.floats(0.05, 1.0), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0.0, 1.0), "seed": st.integers(0, 2**32), "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0), "repetition_penalty": st.floats(0.5, 2.0),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)), "ignore_eos": st.booleans(), "user": TEXT,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
CHAT = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": st.lists(MESSAGE, min_size=1, max_size=3), "max_tokens": st.integers(1, 3),
     "stream": st.booleans()},
    optional={**SAMPLING, "logprobs": st.booleans(), "reasoning_effort": st.sampled_from(["low", "medium", "high"]),
              "chat_template_kwargs": st.fixed_dictionaries({"thinking": st.booleans()})})
COMPLETION = st.fixed_dictionaries(
    {"model": st.just(MODEL), "max_tokens": st.integers(1, 3), "stream": st.booleans(),
     "prompt": st.one_of(TEXT, st.lists(st.integers(3, 500), min_size=1, max_size=8))},
    optional={**SAMPLING, "logprobs": st.integers(0, 3), "echo": st.booleans()})
FIELDS = sorted({*SAMPLING, "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "logprobs",
                 "top_logprobs", "tools", "tool_choice", "response_format", "chat_template_kwargs", "thinking",
                 "reasoning_effort", "stream", "stop_token_ids", "min_tokens", "best_of", "echo", "suffix",
                 "continue_final_message", "add_generation_prompt", "return_token_ids", "cache_salt", "unknown_x"})


def _post(server, path: str, body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEYS[0]}", "content-type": "application/json"}
    return httpx.post(server.v1 + path, content=json.dumps(body).encode(), headers=headers, timeout=60)


def _check(response: httpx.Response, valid: bool) -> None:
    assert response.status_code < 500, response.text
    if valid:
        assert response.status_code == 200, response.text
    elif response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


@pytest.fixture(scope="module")
def fuzz_settings():
    return settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.parametrize(("path", "strategy"), [("/chat/completions", CHAT), ("/completions", COMPLETION)])
def test_valid_requests_get_200(server, fuzz_settings, path, strategy):
    @fuzz_settings
    @given(body=strategy)
    def run(body):
        if body.get("logprobs") and path == "/chat/completions":
            body["top_logprobs"] = 2
        if body.get("echo"):
            body.pop("logprobs", None)  # echo with logprobs needs prompt logprobs: a documented 400
        if not body["stream"]:
            body.pop("stream_options", None)  # only allowed with stream: a documented 400
        _check(_post(server, path, body), valid=True)

    run()


@pytest.mark.parametrize(("path", "strategy"), [("/chat/completions", CHAT), ("/completions", COMPLETION)])
def test_mutated_requests_never_5xx(server, fuzz_settings, path, strategy):
    @fuzz_settings
    @given(body=strategy, field=st.sampled_from(FIELDS), value=JSON, drop=st.booleans())
    def run(body, field, value, drop):
        body = dict(body)
        if drop:
            body.pop(field, None)
        else:
            body[field] = value
        if body.get("max_tokens") is None or not isinstance(body.get("max_tokens"), int):
            body["max_tokens"] = 2  # keep generations short; max_tokens itself is mutated through other values
        _check(_post(server, path, body), valid=False)

    run()


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=JSON)
def test_any_json_body_never_5xx(server, body):
    for path in ("/chat/completions", "/completions"):
        _check(_post(server, path, body), valid=False)
