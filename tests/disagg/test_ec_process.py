"""The EC transfer across processes (issue 29): an encode server (uvicorn, its own process, the vision tower and
aligner of the bundled ``checkpoints/v41-tiny-vl`` only) writes an image's rows; an ``ec_consumer`` LLM in this
process encodes nothing and answers with the tokens of an LLM that encodes the image itself."""

import base64
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deepseek_v41.engine import LLM, SamplingParams

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny-vl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_encode_server_process_feeds_a_consumer_llm(tmp_path):
    cfg = {"ec_connector": "SharedStorageConnector", "ec_role": "ec_producer",
           "ec_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    port = free_port()
    code = ("import json, sys, uvicorn\n"
            "from deepseek_v41.server.encode_app import build_encode_app\n"
            "app = build_encode_app(sys.argv[1], json.loads(sys.argv[2]), 'float32', served_model_names=['vl'])\n"
            "uvicorn.run(app, host='127.0.0.1', port=int(sys.argv[3]), log_level='warning')\n")
    server = subprocess.Popen([sys.executable, "-c", code, str(CHECKPOINT), json.dumps(cfg), str(port)])
    url = "data:image/png;base64," + base64.b64encode((CHECKPOINT / "example.png").read_bytes()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What does it say?"}]}]
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, "the encode server exited"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the encode server did not come up"
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "vl", "messages": messages},
                       timeout=60)
        assert r.status_code == 200, r.text
        params = r.json()["ec_transfer_params"]
        assert len(params["image_hashes"]) == 1 and params["encoded"] == 1
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
    sampling = SamplingParams(temperature=0, max_tokens=8)
    consumer = LLM(str(CHECKPOINT), dtype="float32", ec_transfer_config={**cfg, "ec_role": "ec_consumer"})
    got = consumer.chat(messages, sampling)[0].outputs[0].token_ids
    stats = consumer.engine.vision.stats()
    assert stats["encoded_images"] == 0 and stats["ec_transfer"]["hits"] == 1
    assert stats["ec_transfer"]["received_bytes"] == params["transfer_bytes"]
    plain = LLM(str(CHECKPOINT), dtype="float32")
    assert plain.chat(messages, sampling)[0].outputs[0].token_ids == got
    assert plain.engine.vision.stats()["encoded_images"] == 1
