"""Encode / prefill / decode as separate processes behind ``dsv41 router``, against one colocated server (issue 29,
"Must show"): greedy float64 through router + 1 encode + 1 prefill + 1 decode server equals the colocated server
with ``--replay exact``, for text and for prompts with images; with bounded replay it equals what bounded replay
gives on one server (the deviation the README documents); the bytes moved per prompt token are the KV
accounting's; the decode side prefills at most one window (bounded); SIGKILL of the prefill server mid-request
falls back to plain prefill without using a partial page, and a restarted prefill server rejoins."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from image_helpers import png, text_image
from serving_helpers import free_port, metrics, serve_process, wait_until_healthy

from deepseek_v41.analysis.kv import generations_bytes_per_token
from deepseek_v41.config import ModelConfig

pytestmark = pytest.mark.slow

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny-vl"
COMMON = ["--dtype", "float64", "--max-model-len", "2048", "--max-num-seqs", "4", "--swa-pool-bytes", "0",
          "--log-level", "warning"]
LONG = "Hello world! The city is Paris, 123. Tell me about the weather there in the spring. " * 12


@contextlib.contextmanager
def router_process(args: list[str], log):
    """``dsv41 router ARGS`` on a free port; yields (process, url) once its /health answers 200; killed after."""
    port = free_port()
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "deepseek_v41.cli", "router", *args, "--port", str(port),
                                    "--health-interval-s", "0.3"], stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url, log)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def kv(tmp_path, role):
    return ["--kv-transfer-config", json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": role,
                                                "kv_connector_extra_config": {"shared_storage_path":
                                                                              str(tmp_path / "kv")}})]


def ec(tmp_path, role):
    return ["--ec-transfer-config", json.dumps({"ec_connector": "SharedStorageConnector", "ec_role": role,
                                                "ec_connector_extra_config": {"shared_storage_path":
                                                                              str(tmp_path / "ec")}})]


def chat(url, messages, **extra):
    body = {"model": "v41-tiny-vl", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 5, **extra}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def answer(body):
    choice = body["choices"][0]
    return choice["message"]["content"], [t["top_logprobs"] for t in choice["logprobs"]["content"]]


def image_message(text):
    url = "data:image/png;base64," + base64.b64encode(png(text_image(text))).decode()
    return [{"role": "user", "content": [{"type": "text", "text": "Read this. " + LONG[:200]},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture
def cluster(tmp_path):
    """A colocated server (exact replay), an encode, a prefill and a decode server (exact replay) and the router."""
    with contextlib.ExitStack() as stack:
        def serve(name, *flags):
            return stack.enter_context(serve_process([str(CKPT), *COMMON, "--cache-dir", str(tmp_path / name),
                                                      *flags], tmp_path / f"{name}.log"))

        _, colocated = serve("colocated", "--replay", "exact")
        _, encode = serve("encode", *ec(tmp_path, "ec_producer"))
        # Small prefill chunks: a prompt's pages reach the connector over many steps (the kill below lands mid-way).
        prefill_process, prefill = serve("prefill", *kv(tmp_path, "kv_producer"), *ec(tmp_path, "ec_consumer"),
                                         "--max-num-batched-tokens", "32")
        _, decode = serve("decode", "--replay", "exact", *kv(tmp_path, "kv_consumer"), *ec(tmp_path, "ec_consumer"))
        _, router = stack.enter_context(router_process(["--encode", encode, "--prefill", prefill, "--decode", decode],
                                                       tmp_path / "router.log"))
        yield {"colocated": colocated, "encode": encode, "prefill": prefill, "prefill_process": prefill_process,
               "decode": decode, "router": router, "tmp": tmp_path}


def test_epd_equals_colocated_exact_and_moves_the_accounted_bytes(cluster):
    config = ModelConfig.from_pretrained(CKPT)
    for messages in ([{"role": "user", "content": LONG}], image_message("HELLO 42")):
        want = answer(chat(cluster["colocated"], messages))
        got = chat(cluster["router"], messages)
        assert answer(got) == want  # text and every top-5 logprob, float64
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    router, decode, encode = metrics(cluster["router"]), metrics(cluster["decode"]), metrics(cluster["encode"])
    assert not any(v for (name, _), v in router.items() if name == "dsv41:router_fallbacks_total")
    received = (("direction", "received"),)
    per_token = generations_bytes_per_token(config)["deepseek-v4.1-flash"]
    tokens = decode[("dsv41:kv_transfer_prompt_tokens_total", received)]
    assert tokens > 0 and decode[("dsv41:kv_transfer_bytes_total", received)] == pytest.approx(per_token * tokens)
    assert router[("dsv41:router_kv_transfer_bytes_total", ())] > 0
    assert encode[("dsv41:ec_transfer_images_total", (("direction", "sent"),))] >= 1
    prefill_ec = metrics(cluster["prefill"])
    assert prefill_ec[("dsv41:ec_transfer_hits_total", ())] >= 1  # the prefill server read the rows, not encoded


def test_a_killed_prefill_server_falls_back_and_a_restarted_one_rejoins(cluster):
    tmp = cluster["tmp"]
    prompt = [{"role": "user", "content": LONG * 4}]
    want = answer(chat(cluster["colocated"], prompt))
    result = {}

    def pages():
        return sum(1 for _ in (tmp / "kv").rglob("*.page"))

    before = pages()
    thread = threading.Thread(target=lambda: result.update(body=chat(cluster["router"], prompt)))
    thread.start()
    prefill = cluster["prefill"]
    deadline = time.monotonic() + 120
    while pages() < before + 2:  # the prompt's first pages are in the connector: the transfer is under way
        assert time.monotonic() < deadline and thread.is_alive(), "the prefill server finished before the kill"
        time.sleep(0.005)
    cluster["prefill_process"].send_signal(signal.SIGKILL)
    written = pages() - before
    thread.join(300)
    assert answer(result["body"]) == want  # completed by the decode server, no partial page used
    prompt_pages = result["body"]["usage"]["prompt_tokens"] // 16
    assert written < prompt_pages  # killed mid-transfer: some of the prompt's pages never arrived
    router = metrics(cluster["router"])
    assert router[("dsv41:router_fallbacks_total", (("reason", "prefill"),))] >= 1
    # The same server restarted on the same port rejoins: the next prompt is prefilled there again.
    port = prefill.rsplit(":", 1)[1]
    with open(tmp / "prefill2.log", "wb") as out:
        again = subprocess.Popen([sys.executable, "-m", "deepseek_v41.cli", "serve", str(CKPT), *COMMON, "--cache-dir",
                                  str(tmp / "prefill"), *kv(tmp, "kv_producer"), *ec(tmp, "ec_consumer"), "--port",
                                  port], stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_until_healthy(again, prefill, tmp / "prefill2.log")
        deadline = time.monotonic() + 30
        while metrics(cluster["router"]).get(("dsv41:router_backend_up", (("role", "prefill"), ("url", prefill)))) != 1:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        other = [{"role": "user", "content": "Another conversation. " + LONG}]
        assert answer(chat(cluster["router"], other)) == answer(chat(cluster["colocated"], other))
        sent = metrics(prefill)[("dsv41:kv_transfer_pages_total", (("direction", "sent"),))]
        assert sent > 0
        assert metrics(cluster["router"])[("dsv41:router_fallbacks_total", (("reason", "prefill"),))] == \
            router[("dsv41:router_fallbacks_total", (("reason", "prefill"),))]
    finally:
        again.kill()
        again.wait()


def test_bounded_replay_equals_one_server_bounded_and_replays_at_most_one_window(tmp_path):
    """1P1D with bounded replay gives what one server gives on a bounded-replay hit of the same pages (the
    deviation the README documents is that of bounded replay itself), and its decode side recomputes at most one
    window of the cached prefix."""
    with contextlib.ExitStack() as stack:
        def serve(name, *flags):
            return stack.enter_context(serve_process([str(CKPT), *COMMON, "--cache-dir", str(tmp_path / name),
                                                      *flags], tmp_path / f"{name}.log"))[1]

        one = serve("one")
        prefill = serve("prefill", *kv(tmp_path, "kv_producer"))
        decode = serve("decode", *kv(tmp_path, "kv_consumer"))
        _, router = stack.enter_context(router_process(["--prefill", prefill, "--decode", decode],
                                                       tmp_path / "router.log"))
        prompt = [{"role": "user", "content": LONG * 2}]
        chat(one, prompt)
        want = chat(one, prompt)  # a hit: pages, bounded replay of one window
        got = chat(router, prompt)
        assert answer(got) == answer(want)
        window = ModelConfig.from_pretrained(CKPT).sliding_window
        replayed = metrics(decode)[("dsv41:prompt_tokens_replayed_total", ())]
        assert 0 < replayed <= window
