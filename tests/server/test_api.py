"""The OpenAI-compatible API against a live server with the official ``openai`` client: routes, auth, limits,
errors naming their field, usage invariants, thinking mode, token-id prompts."""

import httpx
import openai
import pytest
from serving_helpers import (
    KEYS,
    MAX_BODY_BYTES,
    MAX_MODEL_LEN,
    MODEL,
    auth,
    chunks,
    metrics,
    save_tiny_model,
    scripted,
    sse,
    start_server,
)

from deepseek_v41.chat import encode_messages

HELLO = [{"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key=KEYS[0], max_retries=0, timeout=60)


def check_usage(usage) -> None:
    assert usage.prompt_tokens + usage.completion_tokens == usage.total_tokens
    cached = usage.prompt_tokens_details.cached_tokens
    assert 0 <= cached <= usage.prompt_tokens
    extra = usage.model_extra
    assert extra["prompt_cache_hit_tokens"] == cached
    assert extra["prompt_cache_hit_tokens"] + extra["prompt_cache_miss_tokens"] == usage.prompt_tokens


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()["error"]
    assert body["type"] == "invalid_request_error" and set(body) == {"message", "type", "param", "code"}
    return body


def test_models_version_health_tokenize(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).model_extra["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello world"}
    body = {"messages": HELLO, "chat_template_kwargs": {"thinking": True}}
    rendered = httpx.post(server.url + "/tokenize", json=body).json()
    expected = server.llm.tokenizer.encode(encode_messages(HELLO, thinking=True), add_special_tokens=False).ids
    assert rendered["tokens"] == expected and rendered["count"] == len(expected)


def test_chat_completion_usage(client):
    response = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0,
                                              extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.model == MODEL
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert response.usage.completion_tokens == 4
    check_usage(response.usage)
    assert response.usage.prompt_tokens_details.cached_tokens == 0


def test_completions_text_and_token_prompts(client):
    text = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert text.usage.completion_tokens == 3 and text.choices[0].finish_reason == "length"
    check_usage(text.usage)
    batch = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, n=2, temperature=1,
                                      seed=1, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.usage.prompt_tokens == 5 and batch.usage.completion_tokens == 8
    assert all(len(c.model_extra["token_ids"]) == 2 for c in batch.choices)
    check_usage(batch.usage)


def test_streamed_token_ids_add_up_when_the_parser_holds_text_back(server):
    """A chat stream's token_ids are every generated id, in order, also when the chat parser held a step's text
    back (a newline or a '<' that might open a tool call or a special block) and sent it with a later step's."""
    body = {"model": MODEL, "messages": HELLO, "stream": True, "return_token_ids": True, "max_tokens": 40}
    text = "The city is\n\nParis. <not a tag> Hello world!\n"
    with scripted(server, text):
        events = sse(server.v1 + "/chat/completions", body, KEYS[0])
        whole = httpx.post(server.v1 + "/chat/completions", json={**body, "stream": False}, headers=auth(KEYS[0]),
                           timeout=60).json()
    streamed = [i for c in chunks(events) for choice in c["choices"] for i in choice.get("token_ids", [])]
    assert streamed == whole["choices"][0]["token_ids"] and len(streamed) == whole["usage"]["completion_tokens"]


def test_logprobs(client):
    chat = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 3 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    text = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=2,
                                     extra_body={"ignore_eos": True})
    assert len(text.choices[0].logprobs.token_logprobs) == 3


def test_api_keys(server):
    for headers in ({}, auth("wrong"), {"Authorization": "Basic key-a"}):
        response = httpx.post(server.v1 + "/chat/completions", json={"messages": HELLO}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.v1, api_key="nope", max_retries=0).models.list()
    second = openai.OpenAI(base_url=server.v1, api_key=KEYS[1], max_retries=0)
    assert second.models.list().data[0].id == MODEL


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"messages": [{"role": "user", "content": "Hello world " * MAX_MODEL_LEN}]}, "messages"),
    ({"messages": HELLO, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"messages": HELLO, "max_completion_tokens": 10**9}, "max_completion_tokens"),
    ({"messages": HELLO, "n": 0}, "n"),
    ({"messages": HELLO, "n": 1000, "temperature": 1.0}, "n"),
    ({"messages": HELLO, "n": 2, "temperature": 0}, "n"),
    ({"messages": HELLO, "extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"messages": HELLO, "temperature": "hot"}, "temperature"),
    ({"messages": HELLO, "extra_body": {"top_k": 1.5}}, "top_k"),
    ({"messages": HELLO, "stream_options": {"include_usage": True, "bogus": 1}}, "stream_options.bogus"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": HELLO, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"messages": HELLO, "extra_body": {"chat_template_kwargs": {"thinking": "yes"}}}, "chat_template_kwargs.thinking"),
    ({"messages": HELLO, "tool_choice": "required"}, "tool_choice"),
    ({"messages": HELLO, "stop": [""]}, "stop"),
    ({"messages": HELLO, "extra_body": {"min_tokens": 9}, "max_tokens": 3}, "min_tokens"),
    ({"messages": HELLO, "logit_bias": {"5": 10}}, "logit_bias"),
    ({"messages": HELLO, "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_chat_requests_name_the_field(client, kwargs, param):
    extra = kwargs.pop("extra_body", None)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, extra_body=extra, **kwargs)
    assert info.value.status_code == 400
    assert error_of(info.value)["param"] == param


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"prompt": "Hello world " * MAX_MODEL_LEN}, "prompt"),
    ({"prompt": [1, 2, 100000]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "Hi", "best_of": 3}, "best_of"),
    ({"prompt": "Hi", "suffix": "bye"}, "suffix"),
    ({"prompt": [[1, 2], [3] * MAX_MODEL_LEN]}, "prompt[1]"),
])
def test_bad_completion_requests_name_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, **kwargs)
    assert error_of(info.value)["param"] == param


def test_images_unknown_model_and_bodies(server, client):
    image = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=image)
    body = error_of(info.value)
    assert "does not take images" in body["message"] and body["param"] == "messages[0].content[1]"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    headers = {**auth(KEYS[0]), "content-type": "application/json"}
    for raw in (b"{not json", b"[1, 2]", b'"text"', b"", b'{"messages": [{"role": "user", "content": "x"}], "n": NaN}'):
        response = httpx.post(server.v1 + "/chat/completions", content=raw, headers=headers)
        assert response.status_code == 400, raw
        assert response.json()["error"]["type"] == "invalid_request_error"
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (MAX_BODY_BYTES + 10) + b'"}]}'
    response = httpx.post(server.v1 + "/chat/completions", content=big, headers=headers)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert httpx.get(server.url + "/nope").status_code == 404


def test_thinking_mode_puts_reasoning_apart(client):
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, extra_body={"ignore_eos": True})
    assert "reasoning_content" not in plain.choices[0].message.model_extra
    for extra in ({"chat_template_kwargs": {"thinking": True}}, {"thinking": {"type": "enabled"}},
                  {"reasoning_effort": "medium"}):
        response = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0,
                                                  extra_body={"ignore_eos": True, **extra})
        message = response.choices[0].message
        # The random model never closes </think>: everything it says is reasoning.
        assert isinstance(message.model_extra["reasoning_content"], str) and message.content == ""


def test_metrics_names(server, client):
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, extra_body={"ignore_eos": True})
    names = {name for name, _ in metrics(server.url)}
    for name in ("dsv41:time_to_first_token_seconds_count", "dsv41:inter_token_latency_seconds_count",
                 "dsv41:e2e_request_latency_seconds_count", "dsv41:request_success_total", "dsv41:prompt_tokens_total",
                 "dsv41:prompt_tokens_cached_total", "dsv41:prompt_tokens_replayed_total",
                 "dsv41:generation_tokens_total", "dsv41:kv_pages_used", "dsv41:kv_pages_total",
                 "dsv41:kv_cache_bytes", "dsv41:swa_pool_occupancy",
                 "dsv41:spec_decode_num_accepted_tokens_per_pos_total", "dsv41:num_requests_running"):
        assert name in names, name
    values = metrics(server.url)
    assert values[("dsv41:kv_cache_bytes", (("kind", "global"),))] == server.llm.engine.stats["kv_global_bytes"]
    assert values[("dsv41:generation_tokens_total", ())] >= 2


def test_response_format_text_is_served_and_unknown_types_name_the_field(client):
    """json_object / json_schema are served by constrained decoding (tests/server/test_structured_outputs.py);
    an unknown type names response_format.type."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, response_format={"type": "xml"})
    assert error_of(info.value)["param"] == "response_format.type"
    text = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, response_format={"type": "text"})
    assert text.choices[0].finish_reason in ("length", "stop")


def test_draining_refuses_new_work(server):
    state = server.uvicorn_server.config.app.state.server
    state.draining = True
    try:
        assert httpx.get(server.url + "/health").status_code == 503
        response = httpx.post(server.v1 + "/completions", json={"prompt": "Hi"}, headers=auth(KEYS[0]))
        assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down"
    finally:
        state.draining = False
    assert httpx.get(server.url + "/health").status_code == 200


def test_token_id_prompts_without_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("no-tokenizer")
    save_tiny_model(path, with_tokenizer=False)
    live = start_server(path, api_keys=(), max_num_seqs=4)
    try:
        client = openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0)
        response = client.completions.create(model=MODEL, prompt=[3, 4, 5], max_tokens=3,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
        assert response.choices[0].text == "" and len(response.choices[0].model_extra["token_ids"]) == 3
        for call in (lambda: client.completions.create(model=MODEL, prompt="text"),
                     lambda: client.chat.completions.create(model=MODEL, messages=HELLO)):
            with pytest.raises(openai.BadRequestError):
                call()
    finally:
        live.stop()
