"""Prefill / decode disaggregation through the OpenAI server (issue 29): a kv_producer server answers a request
with ``kv_transfer_params: {"do_remote_decode": true}`` by writing the prompt's pages and returning their
description; a kv_consumer server given the same request decodes what one colocated server does (float64, exact
replay); both count the bytes in /metrics."""

import httpx
import pytest
import torch
from serving_helpers import MODEL, auth, metrics, save_tiny_model, start_server

from deepseek_v41.analysis.kv import generations_bytes_per_token

KEY = "key-a"
MESSAGES = [{"role": "user", "content": "Hello world! The city is Paris, 123. " * 12}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    save_tiny_model(path)
    return path


def connector(tmp_path, role, **extra):
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv"), **extra}}


def test_prefill_then_decode_equals_colocated(model_dir, tmp_path):
    common = dict(dtype=torch.float64, swa_pool_bytes=0)
    servers = [start_server(model_dir, **common),
               start_server(model_dir, **common, kv_transfer_config=connector(tmp_path, "kv_producer")),
               start_server(model_dir, **common, replay="exact", kv_transfer_config=connector(tmp_path, "kv_consumer"))]
    colocated, prefill, decode = servers
    try:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        want = httpx.post(colocated.v1 + "/chat/completions", json=body, headers=auth(KEY), timeout=120).json()
        pre = httpx.post(prefill.v1 + "/chat/completions", headers=auth(KEY), timeout=120,
                         json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
        params = pre["kv_transfer_params"]
        assert params["do_remote_prefill"] and pre["usage"]["completion_tokens"] == 0
        assert pre["choices"][0]["finish_reason"] == "length"
        got = httpx.post(decode.v1 + "/chat/completions", headers=auth(KEY), timeout=120,
                         json={**body, "kv_transfer_params": params}).json()
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        moved = got["kv_transfer_params"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == moved["cached_tokens"] > 0
        # Another API key salts the prefix cache: the decode server finds nothing of key-a's prompt.
        other = httpx.post(decode.v1 + "/chat/completions", headers=auth("key-b"), timeout=120, json=body).json()
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        sent, received = metrics(prefill.url), metrics(decode.url)
        labels = (("direction", "sent"),)
        assert sent[("dsv41:kv_transfer_pages_total", labels)] == params["num_pages"]
        rlabels = (("direction", "received"),)
        per_token = generations_bytes_per_token(decode.llm.engine.config)["deepseek-v4.1-flash"]
        assert received[("dsv41:kv_transfer_bytes_total", rlabels)] == pytest.approx(
            per_token * received[("dsv41:kv_transfer_prompt_tokens_total", rlabels)])
        assert received[("dsv41:kv_transfer_prompt_tokens_total", rlabels)] == moved["cached_tokens"]
    finally:
        for server in servers:
            server.stop()


def test_remote_decode_on_a_plain_server_is_a_400(model_dir):
    server = start_server(model_dir)
    try:
        r = httpx.post(server.v1 + "/completions", headers=auth(KEY), timeout=60,
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 1,
                             "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 400 and "kv_producer" in r.json()["error"]["message"]
        r = httpx.post(server.v1 + "/completions", headers=auth(KEY), timeout=60,
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 1, "kv_transfer_params": [1]})
        assert r.status_code == 400
    finally:
        server.stop()
