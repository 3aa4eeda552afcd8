"""The prefill side of the EC transfer (issue 29): an ``ec_consumer`` engine whose connector holds an image's rows
takes them instead of encoding the image, and computes the same prefill logits as an engine that encodes it
(float64, a tiny random VLM; the rows are read back byte-exact, so the logits are equal, not merely close)."""

import copy
import math

import pytest
import torch

from deepseek_v41.config import VisionConfig, tiny_config
from deepseek_v41.disagg.ec_connector import SharedStorageECConnector, ec_fingerprint
from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.engine.encoder_cache import EncoderCache, VisionEncoder, build_vision_encoder
from deepseek_v41.model.image_processor import ImageGrid, ProcessedImage
from deepseek_v41.model.transformer import Transformer

IMG = 509  # image_token_id of the tiny VLM
VISION = VisionConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=12, patch_size=2,
                      rope_theta=100.0, downsample_ratio=3, max_image_tokens=64, min_pixels=16)


@pytest.fixture(scope="module")
def vlm():
    cfg = tiny_config().replace(max_position_embeddings=8192, vision_config=VISION, image_token_id=IMG)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # vision weights and delimiters large enough that an image changes the logits
        for name, p in model.named_parameters():
            if name.startswith(("vision.", "aligner.")):
                p.normal_(0.0, 0.3)
            elif name in ("image_start", "image_newline", "image_end") or name.endswith("bias_vl"):
                p.normal_(0.0, 1.0)
    return model.to(torch.float64)


def image(n_vit_h, n_vit_w, seed):
    patches = torch.randn(n_vit_h * n_vit_w, 3 * VISION.patch_size ** 2, generator=torch.Generator().manual_seed(seed))
    p, r = VISION.patch_size, VISION.downsample_ratio
    return ProcessedImage(patches, ImageGrid(n_vit_h * p, n_vit_w * p, n_vit_h, n_vit_w, math.ceil(n_vit_h / r),
                                             math.ceil(n_vit_w / r)))


def ec_config(path, role):
    return {"ec_connector": "SharedStorageConnector", "ec_role": role,
            "ec_connector_extra_config": {"shared_storage_path": str(path)}}


@torch.no_grad()
def prefill_logits(engine, prompt, images):
    """The logits of every prefill chunk's last position (the engine's own chunking and encode stage)."""
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1), multi_modal_data={"image": images})
    seq, out = engine.requests["r"][0], []
    while seq.num_computed < len(seq.prompt_token_ids):
        plan = engine.scheduler.schedule()
        for s, start, end in plan.prefills:
            logits = engine.runner.prefill(s, start, end)
            s.num_computed = end
            if logits is not None:
                out.append(logits)
        engine.vision.release()
    engine.abort_request("r")
    engine.release("r")
    return out


def test_consumer_takes_rows_from_the_connector_and_computes_the_same_logits(vlm, tmp_path):
    images = [image(6, 9, 1), image(4, 4, 2), image(6, 9, 1)]  # the third repeats the first
    prompt = [5, 6, IMG, 7, 8, 9, IMG, 10, IMG, 11, 12]
    producer = LLM(vlm, max_model_len=256, ec_transfer_config=ec_config(tmp_path, "ec_producer")).engine
    want = prefill_logits(producer, prompt, images)
    ec = producer.vision.stats()["ec_transfer"]
    assert producer.vision.cache.encoded_images == 2 and ec["sent_images"] == 2 and ec["role"] == "ec_producer"
    assert ec["sent_bytes"] > 2 * 3 * vlm.config.hidden_size * 8  # two files of rows (the 4x4 grid gives 2x2)

    consumer = LLM(vlm, max_model_len=256, ec_transfer_config=ec_config(tmp_path, "ec_consumer")).engine
    calls = []
    encode = consumer.vision.encode
    consumer.vision.encode = lambda ims: calls.append(len(ims)) or encode(ims)
    got = prefill_logits(consumer, prompt, images)
    stats = consumer.vision.stats()
    assert calls == [] and stats["encoded_images"] == 0  # nothing encoded
    assert stats["ec_transfer"]["hits"] == 2 and stats["ec_transfer"]["received_images"] == 2
    assert stats["ec_transfer"]["received_bytes"] == ec["sent_bytes"] and stats["ec_transfer"]["misses"] == 0
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    plain = LLM(vlm, max_model_len=256).engine  # no transfer at all: the same numbers again
    assert "ec_transfer" not in plain.vision.stats()
    assert all(torch.equal(a, b) for a, b in zip(prefill_logits(plain, prompt, images), want, strict=True))
    # And the logits depend on the images (the test would notice rows placed wrongly or zero).
    other = prefill_logits(plain, prompt, [image(6, 9, 3), image(4, 4, 2), image(6, 9, 3)])
    assert not torch.allclose(other[-1], want[-1])


def test_consumer_miss_encodes_itself_and_bad_file_is_not_used(vlm, tmp_path):
    consumer = build_vision_encoder(vlm, None, ec_config(tmp_path, "ec_consumer"))
    connector = consumer.ec_connector
    im = image(3, 6, 4)

    class Item:
        hash, image = "3" * 64, im

    with torch.no_grad():
        (want,) = consumer.encode([im])
        other = SharedStorageECConnector(connector.directory, connector.fingerprint, vlm.config.hidden_size,
                                         torch.float64)  # another process writing into the directory
        other.put(Item.hash, want + 1.0)  # rows that are not this image's ...
        path = connector.directory / f"{Item.hash}.page"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x40  # ... and a corrupt file: a miss, never used
        path.write_bytes(bytes(data))
        (got,) = consumer.rows([Item])
    assert torch.equal(got, want)
    ec = consumer.stats()["ec_transfer"]
    assert (ec["hits"], ec["misses"], ec["rejected"], consumer.cache.encoded_images) == (0, 1, 1, 1)
    assert ec["sent_images"] == 0  # a consumer does not write


def test_fingerprint_and_roles(vlm, tmp_path):
    fp = ec_fingerprint(vlm)
    changed = Transformer(vlm.config).to(torch.float64)
    changed.load_state_dict(vlm.state_dict())
    assert ec_fingerprint(changed) == fp
    with torch.no_grad():
        changed.image_start.add_(1.0)  # the delimiters do not reach the rows
        assert ec_fingerprint(changed) == fp
        changed.aligner.w2.bias.add_(1e-9)
    assert ec_fingerprint(changed) != fp
    assert ec_fingerprint(copy.deepcopy(vlm).float()) != fp  # the load dtype
    cache = EncoderCache(0)
    connector = SharedStorageECConnector(tmp_path, fp, vlm.config.hidden_size, torch.float64)
    with pytest.raises(ValueError, match="together"):
        VisionEncoder(lambda ims: [], cache, connector)
    with pytest.raises(ValueError, match="ec_role must be"):
        VisionEncoder(lambda ims: [], cache, connector, "kv_consumer")
    with pytest.raises(ValueError, match="ec_role"):
        LLM(vlm, max_model_len=64, ec_transfer_config=ec_config(tmp_path, "consumer"))
    text_only = Transformer(tiny_config()).to(torch.float64)
    with pytest.raises(ValueError, match="shared_storage_path"):  # checked on a text-only model too
        LLM(text_only, max_model_len=64, ec_transfer_config={"ec_connector": "SharedStorageConnector",
                                                              "ec_role": "ec_consumer"})
    assert LLM(text_only, max_model_len=64, ec_transfer_config=ec_config(tmp_path, "ec_consumer")).engine.vision \
        is None
