"""The encode server (issue 29, ``ec_producer``): the vision tower + aligner loaded alone, the chat bodies of the
OpenAI server in, every image encoded and its rows written to the EC connector, where a consumer loading the full
model from the same directory reads exactly the rows it would compute itself."""

import base64

import pytest
import torch
from fastapi.testclient import TestClient
from image_helpers import png, text_image

from deepseek_v41.config import VisionConfig, tiny_config
from deepseek_v41.disagg.ec_connector import ec_fingerprint
from deepseek_v41.disagg.vision_only import load_vision_only
from deepseek_v41.engine.encoder_cache import build_vision_encoder
from deepseek_v41.engine.multimodal import ImageItem, image_hash, process_images
from deepseek_v41.model.checkpoint import CheckpointError, load_model
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.model.vision import encode_images
from deepseek_v41.server.encode_app import build_encode_app

# patch 14, 3x3 merge: a 126x42 image is a 3x1 token grid (span 6).
VISION = VisionConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=48,
                      max_image_tokens=64, min_pixels=42 * 42)
IMG = 509


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-vlm")
    torch.manual_seed(0)
    cfg = tiny_config().replace(max_position_embeddings=4096, vision_config=VISION, image_token_id=IMG)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("vision.", "aligner.")):
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return path


def ec_config(path, role):
    return {"ec_connector": "SharedStorageConnector", "ec_role": role,
            "ec_connector_extra_config": {"shared_storage_path": str(path)}}


def data_url(image):
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


def chat(*images, text="what is this?"):
    content = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 5,
            "temperature": 0.0, "kv_transfer_params": {"do_remote_decode": True}}  # fields it does not need pass


def test_encode_server_writes_the_rows_a_consumer_reads(model_dir, tmp_path):
    app = build_encode_app(model_dir, ec_config(tmp_path, "ec_producer"), "float64",
                           served_model_names=["tiny"])
    a, b = text_image("first"), text_image("second", size=(84, 84))
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=chat(a, b))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "ec_transfer" and body["model"] == "tiny" and body["id"].startswith("ec-")
        params = body["ec_transfer_params"]
        full = load_model(model_dir, torch.float64)
        processed = process_images([png(a), png(b)], full.config.vision_config)
        hashes = [image_hash(p) for p in processed]
        assert params["image_hashes"] == hashes and hashes[0] != hashes[1]
        # 126x42 -> a 3x1 token grid: 1 * (3 + 1) + 2 positions; 84x84 -> 2x2: 2 * (2 + 1) + 2.
        assert params["num_image_tokens"] == sum(p.grid.span_length for p in processed) == 6 + 8
        assert (params["encoded"], params["cached"]) == (2, 0)
        assert params["transfer_bytes"] == sum(f.stat().st_size for f in (tmp_path).glob("*-ec/*.page"))

        # A second request with the first image again: from the encoder cache, nothing encoded.
        again = client.post("/v1/chat/completions", json=chat(a, a)).json()["ec_transfer_params"]
        assert again["image_hashes"] == [hashes[0]] * 2 and (again["encoded"], again["cached"]) == (0, 1)

        metrics = client.get("/metrics").text
        assert 'dsv41:ec_transfer_images_total{direction="sent",model_name="tiny"} 2.0' in metrics
        assert 'dsv41:ec_transfer_bytes_total{direction="sent",model_name="tiny"} ' \
            f'{float(params["transfer_bytes"])}' in metrics
        assert 'dsv41:encoder_cache_hits_total{model_name="tiny"} 1.0' in metrics
        assert 'dsv41:ec_requests_total{model_name="tiny",status="ok"} 2.0' in metrics
        assert client.get("/health").status_code == 200
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert "version" in client.get("/version").json()

    # The prefill side: the full model from the same directory, an ec_consumer: it encodes nothing and gets the
    # rows it would have computed (the producer batched the two images apart, as the consumer would).
    consumer = build_vision_encoder(full, None, ec_config(tmp_path, "ec_consumer"), model_dir)
    items = [ImageItem(p, h, 0, p.grid.span_length) for p, h in zip(processed, hashes, strict=True)]
    with torch.no_grad():
        got = consumer.rows(items)
        want = [encode_images(full, [p])[0] for p in processed]
    assert consumer.cache.encoded_images == 0 and consumer.stats()["ec_transfer"]["hits"] == 2
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_bad_requests_are_clear_400s(model_dir, tmp_path):
    app = build_encode_app(model_dir, ec_config(tmp_path, "ec_producer"), "float64",
                           served_model_names=["tiny"])
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_images"
        assert "has no images" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 400 and "carries no images" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", content=b"{not json")
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json={**chat(text_image("x")), "model": "other"})
        assert r.status_code == 404
        bad = chat()
        bad["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})
        r = client.post("/v1/chat/completions", json=bad)
        assert r.status_code == 400 and "messages[0].content[1]" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400
        # A directory that stopped taking writes (the store turns writes off): 503s, so a router falls back.
        app.state.encode_server.connector.store._stats["disabled"] = True
        r = client.post("/v1/chat/completions", json=chat(text_image("y")))
        assert r.status_code == 503 and r.json()["error"]["code"] == "ec_transfer_failed"
        assert client.get("/health").status_code == 503
    with pytest.raises(ValueError, match="ec_producer"):
        build_encode_app(model_dir, ec_config(tmp_path, "ec_consumer"))


def test_vision_only_load_reads_only_the_vision_tensors(model_dir, tmp_path):
    vision = load_vision_only(model_dir, "float64")
    full = load_model(model_dir, torch.float64)
    names = set(vision.state_dict())
    assert names and all(n.startswith(("vision.", "aligner.", "image_")) for n in names)
    assert all(torch.equal(t, full.state_dict()[n]) for n, t in vision.state_dict().items())
    assert ec_fingerprint(vision, model_dir) == ec_fingerprint(full, model_dir)
    assert ec_fingerprint(load_vision_only(model_dir, "float32"), model_dir) != ec_fingerprint(full, model_dir)
    # A checkpoint missing a vision tensor names it.
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model_dir / "config.json").read_text())
    for file in model_dir.glob("*.safetensors"):
        tensors = load_file(file)
        tensors.pop("aligner.w1.weight", None)
        save_file(tensors, broken / file.name)
    with pytest.raises(CheckpointError, match="missing tensor aligner.w1.weight"):
        load_vision_only(broken, "float64")
