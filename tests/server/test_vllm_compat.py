"""What vLLM users expect of the server (issue 23): sampling defaults from ``generation_config.json``, OpenAI's
sampling ranges, CORS, and the served model name. In-process (TestClient) on a small engine, plus a browser-style
preflight against the session's live server."""

import json

import httpx
import pytest
from fastapi.testclient import TestClient
from serving_helpers import KEYS, MODEL, auth

from deepseek_v41.engine import LLM
from deepseek_v41.engine.async_engine import AsyncLLMEngine
from deepseek_v41.server.app import build_app
from deepseek_v41.server.common import ServerConfig, sampling_params
from deepseek_v41.server.generation_config import GenerationConfigError, load_sampling_defaults
from deepseek_v41.server.protocol import ChatCompletionRequest, CompletionRequest

MAX_MODEL_LEN = 96
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_num_seqs=4, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)


def client_for(llm, **config) -> TestClient:
    """A TestClient on a fresh app over ``llm``'s engine (one app at a time: use it in a ``with`` block)."""
    settings = dict(served_model_names=[MODEL], api_keys=list(KEYS), log_stats_interval_s=0, drain_timeout_s=5)
    settings.update(config)
    return TestClient(build_app(AsyncLLMEngine(llm.engine), ServerConfig(**settings)))


# ---------------------------------------------------------------- generation_config.json


def write_config(folder, **values):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(values))
    return folder


def test_generation_config_sources(tmp_path):
    model = write_config(tmp_path / "model", do_sample=False, temperature=0.0, top_p=0.9, top_k=20,
                         max_new_tokens=256, eos_token_id=1)
    other = write_config(tmp_path / "other", temperature=0.7)
    defaults, origin = load_sampling_defaults("auto", model)
    assert defaults == {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "max_tokens": 256}
    assert origin.endswith("generation_config.json")
    assert load_sampling_defaults("vllm", model)[0] == {}
    assert load_sampling_defaults(str(other), model)[0] == {"temperature": 0.7}
    assert load_sampling_defaults("auto", tmp_path / "other-model-without-one")[0] == {}
    override = load_sampling_defaults("auto", model, '{"temperature": 0.6, "max_new_tokens": 32}')[0]
    assert override == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 32}
    assert load_sampling_defaults("vllm", model, '{"top_k": 5}')[0] == {"top_k": 5}
    with pytest.raises(GenerationConfigError, match="top_p must be a number in"):
        load_sampling_defaults("auto", model, '{"top_p": 2}')
    with pytest.raises(GenerationConfigError, match="no generation_config.json in that folder"):
        load_sampling_defaults(str(tmp_path / "missing"), model)
    for bad in ({"top_p": 0}, {"max_new_tokens": 0}, {"temperature": "hot"}, {"top_k": 2.5}):
        with pytest.raises(GenerationConfigError, match=next(iter(bad))):
            load_sampling_defaults("auto", write_config(tmp_path / "bad", **bad))


def test_defaults_apply_to_fields_the_request_does_not_set(llm):
    defaults = {"temperature": 0.0, "top_p": 0.5, "top_k": 7, "max_tokens": 3}
    with client_for(llm, sampling_defaults=defaults) as client:
        state = client.app.state.server
        unset = sampling_params(state, ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]), 10,
                                max_tokens_field="max_tokens", logprobs=None, logprobs_field="top_logprobs",
                                skip_special_tokens=False)
        assert (unset.temperature, unset.top_p, unset.top_k, unset.max_tokens) == (0.0, 0.5, 7, 3)
        given = sampling_params(state, ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                                             temperature=0.8, top_p=1.0, top_k=0, max_tokens=9), 10,
                                max_tokens_field="max_tokens", logprobs=None, logprobs_field="top_logprobs",
                                skip_special_tokens=False)
        assert (given.temperature, given.top_p, given.top_k, given.max_tokens) == (0.8, 1.0, 0, 9)
        # completions keep OpenAI's default of 16 unless the checkpoint's limit is smaller
        completion = sampling_params(state, CompletionRequest(prompt="x"), 10, max_tokens_field="max_tokens",
                                     logprobs=None, logprobs_field="logprobs", skip_special_tokens=True)
        assert completion.max_tokens == 3

        # end to end: a chat request without max_tokens stops at the checkpoint's max_new_tokens, not at the
        # end of the context; one that sets it gets what it asked for
        reply = client.post("/v1/chat/completions", json=CHAT, headers=auth(KEYS[0]))
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        reply = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5}, headers=auth(KEYS[0]))
        assert reply.json()["usage"]["completion_tokens"] == 5


def test_without_defaults_vllm_behaviour_is_kept(llm):
    with client_for(llm) as client:
        params = sampling_params(client.app.state.server, ChatCompletionRequest(messages=[{"role": "user",
                                                                                            "content": "x"}]),
                                 10, max_tokens_field="max_tokens", logprobs=None, logprobs_field="top_logprobs",
                                 skip_special_tokens=False)
        assert (params.temperature, params.top_p, params.max_tokens) == (1.0, 1.0, MAX_MODEL_LEN - 10)


# ---------------------------------------------------------------- OpenAI's sampling ranges


@pytest.mark.parametrize(("field", "value", "ok"), [
    ("temperature", 2.0, True), ("temperature", 2.01, False), ("temperature", 5, False),
    ("top_p", 1.0, True), ("top_p", 0.0, False), ("top_p", 1.5, False), ("top_p", -0.1, False),
])
def test_openai_sampling_ranges(llm, field, value, ok):
    with client_for(llm) as client:
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": MODEL, "prompt": "Hi"})):
            reply = client.post(path, json={**body, field: value, "max_tokens": 1}, headers=auth(KEYS[0]))
            if ok:
                assert reply.status_code == 200, reply.text
            else:
                assert reply.status_code == 400, reply.text
                error = reply.json()["error"]
                assert error["type"] == "invalid_request_error" and error["param"] == field, error


# ---------------------------------------------------------------- CORS

PREFLIGHT = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_cors_preflight_and_responses_with_vllm_defaults(llm):
    with client_for(llm) as client:
        reply = client.options("/v1/chat/completions", headers=PREFLIGHT)  # no API key: a browser sends none here
        assert reply.status_code == 200, reply.text
        assert reply.headers["access-control-allow-origin"] == "*"
        assert "POST" in reply.headers["access-control-allow-methods"]
        assert "authorization" in reply.headers["access-control-allow-headers"].lower()
        assert "access-control-allow-credentials" not in reply.headers
        origin = {"Origin": "http://localhost:3000"}
        assert client.get("/v1/models", headers={**origin, **auth(KEYS[0])}).headers[
            "access-control-allow-origin"] == "*"
        denied = client.get("/v1/models", headers=origin)  # the 401 is readable by the page too
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"


def test_cors_settings(llm):
    allowed = "https://app.example"
    with client_for(llm, allow_origins=[allowed], allow_methods=["GET", "POST"], allow_headers=["authorization"],
                    allow_credentials=True) as client:
        reply = client.options("/v1/completions", headers={**PREFLIGHT, "Origin": allowed,
                                                           "Access-Control-Request-Headers": "authorization"})
        assert reply.status_code == 200
        assert reply.headers["access-control-allow-origin"] == allowed
        assert reply.headers["access-control-allow-credentials"] == "true"
        other = client.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        put = client.options("/v1/completions", headers={**PREFLIGHT, "Origin": allowed,
                                                         "Access-Control-Request-Method": "PUT"})
        assert put.status_code == 400


def test_browser_preflight_against_live_server(server):
    reply = httpx.options(server.v1 + "/chat/completions", headers=PREFLIGHT, timeout=10)
    assert reply.status_code == 200, reply.text
    assert reply.headers["access-control-allow-origin"] == "*"
    assert "POST" in reply.headers["access-control-allow-methods"]
    posted = httpx.post(server.v1 + "/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                        headers={"Origin": "http://localhost:3000", **auth(KEYS[0])}, timeout=60)
    assert posted.status_code == 200 and posted.headers["access-control-allow-origin"] == "*"


# ---------------------------------------------------------------- vLLM's request metrics


def test_request_phase_and_size_metrics(llm):
    from prometheus_client.parser import text_string_to_metric_families

    with client_for(llm) as client:
        body = {**CHAT, "max_tokens": 4, "n": 2}
        reply = client.post("/v1/chat/completions", json=body, headers=auth(KEYS[0]))
        assert reply.status_code == 200, reply.text
        prompt_tokens = reply.json()["usage"]["prompt_tokens"]
        samples = {}
        for family in text_string_to_metric_families(client.get("/metrics").text):
            for sample in family.samples:
                assert sample.labels.get("model_name") == MODEL, sample
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    value = {name: v for (name, _), v in samples.items()}
    for phase in ("queue", "prefill", "decode", "inference"):
        assert value[f"dsv41:request_{phase}_time_seconds_count"] == 1, phase
        assert value[f"dsv41:request_{phase}_time_seconds_sum"] >= 0, phase
    assert value["dsv41:request_inference_time_seconds_sum"] >= value["dsv41:request_decode_time_seconds_sum"]
    assert value["dsv41:request_prompt_tokens_sum"] == prompt_tokens
    assert value["dsv41:request_generation_tokens_sum"] == 8  # both samples
    # one request with n=2 is one observation, as the phase histograms above
    assert value["dsv41:request_params_max_tokens_count"] == 1 and value["dsv41:request_params_max_tokens_sum"] == 4
    # every computed token is in some step: the prompt (prefilled once per sample or shared) and 3 decode steps
    assert value["dsv41:iteration_tokens_total_count"] >= 4
    assert value["dsv41:iteration_tokens_total_sum"] >= prompt_tokens + 2 * 3
    info = [labels for (name, labels), v in samples.items() if name == "dsv41:cache_config_info" and v == 1]
    assert len(info) == 1 and dict(info[0])["block_size"] == "16" and dict(info[0])["cache_dtype"] == "auto"
    assert dict(info[0])["enable_prefix_caching"] == "False"


def test_openai_client_gets_a_400_for_temperature_above_2(server):
    import openai

    client = openai.OpenAI(base_url=server.v1, api_key=KEYS[0], max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=2.5,
                                       max_tokens=1)
    assert caught.value.body["param"] == "temperature"


def test_enable_log_requests(llm, caplog):
    with client_for(llm, log_requests=True) as client, caplog.at_level("INFO", logger="deepseek_v41.server"):
        reply = client.post("/v1/completions", json={"model": MODEL, "prompt": "secret words", "max_tokens": 2},
                            headers=auth(KEYS[0]))
        assert reply.status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Received request cmpl-")]
    assert len(lines) == 1 and "max_tokens=2" in lines[0] and "secret" not in lines[0], lines
    caplog.clear()
    with client_for(llm) as client, caplog.at_level("INFO", logger="deepseek_v41.server"):
        client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, headers=auth(KEYS[0]))
    assert not [r for r in caplog.records if r.getMessage().startswith("Received request")]
