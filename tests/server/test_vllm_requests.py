"""Requests written for vLLM (issue 23, fresh-user review): the model path as the request's ``model``, the
response echoing the name the request used, vLLM's extra request fields, and ``n > 1`` under a greedy default from
``generation_config.json``. ``dsv41 serve`` runs in-process with the uvicorn server replaced by a TestClient, and the
official ``openai`` client talks to it."""

import json
import shutil
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient
from serving_helpers import KEYS, MODEL, auth
from typer.testing import CliRunner

from deepseek_v41.cli import app as cli_app
from deepseek_v41.engine import LLM
from deepseek_v41.engine.async_engine import AsyncLLMEngine
from deepseek_v41.engine.sampling_params import SamplingParams
from deepseek_v41.server.app import build_app
from deepseek_v41.server.common import ServerConfig

PATH = "checkpoints/v41-tiny"
HI = [{"role": "user", "content": "Hello"}]


def serve_app(model_dir, tmp_path, monkeypatch, *flags: str):
    """``dsv41 serve checkpoints/v41-tiny FLAGS`` from ``tmp_path`` (the tiny model copied there, with a greedy
    ``generation_config.json`` as the bundled checkpoint has); returns the app it would serve."""
    import deepseek_v41.cli.serve as serve_cli

    target = tmp_path / PATH
    shutil.copytree(model_dir, target)
    (target / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 4}))
    monkeypatch.chdir(tmp_path)
    captured = {}

    class _Server:
        exit_code, started = 0, True

        def run(self):
            pass

    def fake_make_server(app, *args, **kwargs):
        captured["app"] = app
        return _Server()

    monkeypatch.setattr(serve_cli, "make_server", fake_make_server)  # where `dsv41 serve` looks it up
    result = CliRunner().invoke(cli_app, ["serve", PATH, "--cache-dir", str(tmp_path / "cache"), "--threads", "1",
                                          "--no-enable-prefix-caching", "--max-model-len", "128", *flags])
    assert result.exit_code == 0, result.output
    return captured["app"]


def openai_client(test_client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=test_client, max_retries=0)


def test_model_path_is_accepted_and_echoed_as_vllm(model_dir, tmp_path, monkeypatch, caplog):
    with caplog.at_level("INFO", logger="deepseek_v41.server"):
        app = serve_app(model_dir, tmp_path, monkeypatch)
    absolute = str((tmp_path / PATH).resolve())
    assert any(r.getMessage().startswith(f"requests may also name the model by its path: {PATH}, ")
               and absolute in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    with TestClient(app) as test_client:
        client = openai_client(test_client)
        assert [m.id for m in client.models.list()] == ["v41-tiny"]  # the listing keeps the served name
        for name in ("v41-tiny", PATH, PATH + "/", absolute):
            reply = client.chat.completions.create(model=name, messages=HI, max_tokens=2)
            assert reply.model == name, name  # vLLM's _get_model_name: the name the request used
            done = client.completions.create(model=name, prompt="Hi", max_tokens=2)
            assert done.model == name
            chunks = list(client.chat.completions.create(model=name, messages=HI, max_tokens=2, stream=True))
            assert chunks and {c.model for c in chunks} == {name}
            chunks = list(client.completions.create(model=name, prompt="Hi", max_tokens=2, stream=True))
            assert chunks and {c.model for c in chunks} == {name}
        assert client.models.retrieve(PATH).id == PATH
        # no model (or an empty one) means the served model, reported by its first name, as vLLM
        reply = test_client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1})
        assert reply.status_code == 200 and reply.json()["model"] == "v41-tiny"
        reply = test_client.post("/v1/completions", json={"model": "", "prompt": "Hi", "max_tokens": 1})
        assert reply.status_code == 200 and reply.json()["model"] == "v41-tiny"
        with pytest.raises(openai.NotFoundError) as caught:
            client.chat.completions.create(model="checkpoints/other", messages=HI, max_tokens=1)
        assert "v41-tiny" in caught.value.body["message"] and caught.value.body["param"] == "model"


def test_served_model_name_replaces_the_path_aliases(model_dir, tmp_path, monkeypatch):
    app = serve_app(model_dir, tmp_path, monkeypatch, "--served-model-name", "mine", "--served-model-name", "other")
    with TestClient(app) as test_client:
        client = openai_client(test_client)
        assert [m.id for m in client.models.list()] == ["mine", "other"]
        for name in ("mine", "other"):  # each served name is echoed, not only the first
            assert client.chat.completions.create(model=name, messages=HI, max_tokens=1).model == name
            assert client.completions.create(model=name, prompt="Hi", max_tokens=1).model == name
        for name in (PATH, "v41-tiny"):
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(model=name, messages=HI, max_tokens=1)


def test_n_above_1_under_a_greedy_default_says_where_it_comes_from(model_dir, tmp_path, monkeypatch):
    """vLLM refuses n > 1 with greedy sampling (all samples would be the same); when the greedy temperature is the
    checkpoint's default the message names generation_config.json and the ways out."""
    app = serve_app(model_dir, tmp_path, monkeypatch)
    with TestClient(app) as test_client:
        client = openai_client(test_client)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=PATH, messages=HI, n=2)
        message = caught.value.body["message"]
        assert caught.value.body["param"] == "n"
        assert "generation_config.json" in message and "temperature" in message, message
        assert "--generation-config vllm" in message, message
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=PATH, prompt="Hi", n=2, temperature=0)
        assert "greedy" in caught.value.body["message"] and "generation_config" not in caught.value.body["message"]
        reply = client.chat.completions.create(model=PATH, messages=HI, n=2, temperature=0.7)
        assert len(reply.choices) == 2


# ---------------------------------------------------------------- vLLM's extra request fields


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_num_seqs=4, max_model_len=96, enable_prefix_caching=False)


@pytest.fixture
def client(llm):
    config = ServerConfig(served_model_names=[MODEL], api_keys=list(KEYS), log_stats_interval_s=0, drain_timeout_s=5)
    with TestClient(build_app(AsyncLLMEngine(llm.engine), config), headers=auth(KEYS[0])) as test_client:
        yield test_client


CHAT = {"model": MODEL, "messages": HI, "max_tokens": 3, "ignore_eos": True}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}


def test_spaces_between_special_tokens(client, llm):
    """Accepted with both values: the fast tokenizer never puts spaces around special tokens, so false is honoured
    exactly and true gives vLLM's fast-tokenizer text (the same)."""
    assert SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens is False  # LLM API
    tokenizer = llm.engine.tokenizer
    specials = [i for i in range(tokenizer.get_vocab_size()) if tokenizer.id_to_token(i).startswith("<")][:2]
    assert len(specials) == 2
    text = tokenizer.decode([*specials, *tokenizer.encode("Hi").ids, specials[0]], skip_special_tokens=False)
    assert " <" not in text and "> " not in text, text
    texts = []
    for value in (True, False):
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
            reply = client.post(path, json={**body, "spaces_between_special_tokens": value, "seed": 3,
                                            "skip_special_tokens": False})
            assert reply.status_code == 200, reply.text
        texts.append(reply.json()["choices"][0]["text"])
    assert texts[0] == texts[1]


def test_request_id_and_priority(client):
    for path, body, prefix in (("/v1/chat/completions", CHAT, "chatcmpl-"), ("/v1/completions", COMPLETION,
                                                                             "cmpl-")):
        reply = client.post(path, json={**body, "request_id": "job-42", "priority": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["id"] == prefix + "job-42"
        again = client.post(path, json={**body, "request_id": "job-42", "stream": True})  # reused: no clash
        assert again.status_code == 200 and f'"id":"{prefix}job-42"' in again.text
        refused = client.post(path, json={**body, "priority": 1})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
        assert "first come, first served" in refused.json()["error"]["message"]


def test_return_tokens_as_token_ids(client):
    for stream in (False, True):
        chat = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2,
                                                          "return_tokens_as_token_ids": True, "stream": stream})
        done = client.post("/v1/completions", json={**COMPLETION, "logprobs": 2, "return_tokens_as_token_ids": True,
                                                    "stream": stream})
        assert chat.status_code == 200 and done.status_code == 200, (chat.text, done.text)
        if stream:
            events = [json.loads(line[6:]) for r in (chat, done) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            tokens = [t["token"] for e in events for c in e["choices"] if c.get("logprobs")
                      for t in c["logprobs"].get("content") or []]
            tokens += [t for e in events for c in e["choices"] if c.get("logprobs")
                       for t in c["logprobs"].get("tokens") or []]
        else:
            content = chat.json()["choices"][0]["logprobs"]["content"]
            tokens = [t["token"] for t in content] + [t["token"] for e in content for t in e["top_logprobs"]]
            logprobs = done.json()["choices"][0]["logprobs"]
            tokens += logprobs["tokens"] + [t for top in logprobs["top_logprobs"] for t in top]
        assert len(tokens) >= 6 and all(t.startswith("token_id:") and t[9:].isdigit() for t in tokens), tokens


def test_chat_add_special_tokens(client, llm):
    bos = llm.engine.tokenizer.encode("", add_special_tokens=True).ids
    plain = client.post("/tokenize", json={"model": MODEL, "messages": HI}).json()["count"]
    for value, extra in ((False, 0), (True, len(bos))):
        reply = client.post("/v1/chat/completions", json={**CHAT, "add_special_tokens": value})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == plain + extra


@pytest.mark.parametrize(("field", "value", "why"), [
    ("use_beam_search", True, "beam search"), ("bad_words", ["x"], "bad_words"),
    ("allowed_token_ids", [1], "allowed_token_ids"), ("truncate_prompt_tokens", 4, "refused (400) rather than cut"),
    ("prompt_logprobs", 1, "prompt_logprobs"),
])
def test_unimplemented_vllm_fields_say_why(client, field, value, why):
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        reply = client.post(path, json={**body, field: value})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == field and error["code"] == "unsupported_parameter", error
        assert why in error["message"] and "Unrecognized" not in error["message"], error
        default = False if isinstance(value, bool) else None
        assert client.post(path, json={**body, field: default}).status_code == 200  # the default is accepted


def test_model_path_aliases():
    from deepseek_v41.cli.serve import model_path_aliases

    names = model_path_aliases(Path(PATH))
    assert PATH in names and PATH + "/" in names and str(Path(PATH).absolute()) in names
    assert "v41-tiny" not in names
