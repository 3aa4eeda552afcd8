"""The encoder-only prefill model of a kv_producer (issue 29; deepseek_v41/disagg/encoder_only.py): which weights
it holds (from the layer plan), that it writes exactly the global KV of the full model, and that what it does not
hold fails loudly."""

import math

import pytest
import torch

from deepseek_v41 import kernels
from deepseek_v41.analysis.params import build_on_meta, count_params, loaded_bytes
from deepseek_v41.cache.fingerprint import model_fingerprint
from deepseek_v41.config import VisionConfig, flash_config, tiny_config
from deepseek_v41.disagg.encoder_only import (
    BOUNDARY_KEEP,
    Dropped,
    EncoderBoundary,
    describe_load,
    encoder_only_names,
    prune_to_encoder,
)
from deepseek_v41.engine.args import EngineArgs
from deepseek_v41.engine.engine import LLMEngine
from deepseek_v41.engine.sampling_params import SamplingParams
from deepseek_v41.kernels import fast
from deepseek_v41.model.checkpoint import CheckpointError, load_model
from deepseek_v41.model.context import DenseContext
from deepseek_v41.model.image_processor import ImageGrid, ProcessedImage
from deepseek_v41.model.transformer import Transformer

IMG = 509  # image_token_id of the tiny VLM (511 is the DSpark noise token)
VISION = VisionConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=12, patch_size=2,
                      rope_theta=100.0, downsample_ratio=3, max_image_tokens=64, min_pixels=16)
NOT_CED = {"kv_source_layer_ids": [2, 4, 5], "index_source_layer_ids": [2, 4, 5, 6]}  # layer 5 a kv source


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random CED model directory (no tokenizer: the Engram token map stays the identity)."""
    path = tmp_path_factory.mktemp("tiny-ced")
    torch.manual_seed(0)
    Transformer(tiny_config().replace(max_position_embeddings=4096)).save_pretrained(path)
    return path


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _expected_names(model) -> set[str]:
    """The names by the rule of issue 29, written out from the plan: everything of the embedding and the encoder
    layers, of the first decoder layer only the KV path, nothing of the later layers, the norm, the head, mtp."""
    plan = model.plan
    boundary = plan.decoder_layers[0]
    out = set()
    for name in model.state_dict():
        if name.startswith(("norm.", "head.", "mtp.")):
            continue
        if name.startswith("layers."):
            j, inner = name.split(".", 2)[1:]
            if int(j) in plan.encoder_layers or (int(j) == boundary and inner.startswith(
                    ("attn_norm.", "attn.compressor.", "attn.indexer.wk.", "attn.indexer.k_norm."))):
                out.add(name)
            continue
        out.add(name)
    return out


# ------------------------------------------------------------------------------------------------ names
@pytest.mark.parametrize("config", [tiny_config(), tiny_config().replace(
    num_hidden_layers=10, compress_ratios=[0, 0, 2, 2, 0, 1, 1, 1, 1, 1, 0], kv_source_layer_ids=[2, 5],
    index_source_layer_ids=[2, 5, 7], candidate_source_layer_id=5, dspark_target_layer_ids=[6, 7, 8])])
def test_the_names_come_from_the_plan(config):
    with torch.device("meta"):
        model = Transformer(config)
    plan = model.plan
    names = encoder_only_names(model)
    assert names == _expected_names(model)
    boundary = plan.decoder_layers[0]
    assert boundary == config.num_hidden_layers // 2
    kept = {n.split(".", 2)[2] for n in names if n.startswith(f"layers.{boundary}.")}
    assert kept == {"attn_norm.weight", "attn.compressor.wkv.weight", "attn.compressor.norm.weight",
                    "attn.indexer.wk.weight", "attn.indexer.k_norm.weight"}
    dropped = prune_to_encoder(model)
    assert set(model.state_dict()) == names and set(dropped) >= set(_full_names(config)) - names
    assert {n for n in dropped if n.endswith("inv_freq")} == {f"layers.{j}.attn.rope.inv_freq"
                                                              for j in plan.decoder_layers[1:]} | {
        f"mtp.{k}.attn.rope.inv_freq" for k in range(config.num_nextn_predict_layers)}
    assert model.encoder_only and model.mtp is None and isinstance(model.layers[boundary], EncoderBoundary)
    assert all(isinstance(model.layers[j], Dropped) for j in plan.decoder_layers[1:])


def _full_names(config):
    with torch.device("meta"):
        return list(Transformer(config).state_dict())


def _decoder_side_params(model) -> int:
    """What the producer does not hold, counted by module from the full model (an oracle independent of the name
    rule): the later decoder layers, the first decoder layer but its KV projection (analysis/params.py's
    ``active_prefill`` term), the final norm, the LM head and the DSpark draft."""
    plan = model.plan

    def numel(m):
        return sum(p.numel() for p in m.parameters())

    boundary = model.layers[plan.decoder_layers[0]]
    attn = boundary.attn
    kv_projection = numel(boundary.attn_norm) + numel(attn.compressor) + numel(attn.indexer.wk) + numel(
        attn.indexer.k_norm)
    return (sum(numel(model.layers[j]) for j in plan.decoder_layers[1:]) + numel(boundary) - kv_projection
            + numel(model.norm) + numel(model.head) + count_params(model)["dspark"])


def test_the_official_layout_loads_the_encoder_and_the_layer_20_kv_path():
    """The official config on meta (8 routed experts instead of 384 so that it builds in a second: the rule and the
    oracle do not depend on the expert count; the slow test below counts the real one)."""
    model = build_on_meta(flash_config().replace(n_routed_experts=8))
    plan = model.plan
    assert (list(plan.encoder_layers), plan.decoder_layers[0]) == (list(range(20)), 20)
    total = sum(p.numel() for p in model.parameters())
    expected = total - _decoder_side_params(model)
    prune_to_encoder(model)
    assert sum(p.numel() for p in model.parameters()) == expected
    assert getattr(model, "vision", None) is not None  # a producer may encode images


@pytest.mark.slow
def test_an_official_producer_loads_about_half_the_weights():
    model = build_on_meta(flash_config())
    total, full_bytes = sum(p.numel() for p in model.parameters()), loaded_bytes(model, 2)
    expected = total - _decoder_side_params(model)
    engram = count_params(model)["engram"]
    prune_to_encoder(model)
    params, producer_bytes = sum(p.numel() for p in model.parameters()), loaded_bytes(model, 2)
    assert params == expected
    # Measured: 62% of the parameters, 56.6% of the bf16 bytes (Engram FP8); without the Engram tables (all in the
    # encoder) 48.8% of the parameters.
    assert 0.5 < producer_bytes / full_bytes < 0.6
    assert 0.45 < (params - engram) / (total - engram) < 0.52


# ------------------------------------------------------------------------------------------------ KV
def _global_kv(model, ids: list[int]) -> tuple[dict, torch.Tensor]:
    """Entries, index keys and open pairs of every kv-source layer after ``ced_encode`` of ``ids``, and the
    encoder's output streams."""
    x = torch.tensor([ids])
    ctx = DenseContext(1, len(ids), "cpu", model.fake_quant)
    rows = model.hasher(x, None) if model.hasher is not None else None
    streams, pre = model.ced_encode(*model.embed_streams(x), ctx, rows)
    kv = {}
    for layer in model.plan.kv_source_layers:
        kv[f"{layer}.entries"] = ctx.all_entries(layer)
        kv[f"{layer}.index_keys"] = ctx.index_keys(layer)
        for i, t in enumerate(ctx.pending(layer) or ()):
            kv[f"{layer}.pending{i}"] = t
    return kv, streams


def test_the_producer_writes_the_global_kv_of_the_full_model_float64(model_dir):
    full = load_model(model_dir, torch.float64)
    producer = load_model(model_dir, torch.float64, encoder_only=True)
    for n in (5, 41):  # an odd count: the ratio-2 layer keeps an open pair
        with torch.no_grad():
            want, want_streams = _global_kv(full, prompt(n, n))
            got, got_streams = _global_kv(producer, prompt(n, n))
        assert set(got) == set(want) and any(k.startswith("4.") for k in got)
        for key in want:
            assert torch.equal(got[key], want[key]), key
        assert torch.equal(got_streams, want_streams)


def test_the_fast_backend_serves_the_producer(model_dir):
    # fake_quant off: the FP4 rounding of the entries would hide a rounding difference in what makes them
    full = load_model(model_dir, torch.float32, fake_quant=False)
    producer = load_model(model_dir, torch.float32, fake_quant=False, encoder_only=True)
    if kernels.library() is None:
        pytest.skip("the CPU kernels are unavailable")
    done = fast.install(producer)
    assert done.modules.get("EncoderBoundary") == 1 and done.modules.get("Attention")
    fast.install(full)
    try:
        for n in (3, 40):  # a few tokens take the fused compress kernel, a chunk the torch code
            with torch.inference_mode():
                want, _ = _global_kv(full, prompt(n, n))
                got, _ = _global_kv(producer, prompt(n, n))
            for key in want:
                assert torch.equal(got[key], want[key]), key
    finally:
        fast.uninstall(full)
        fast.uninstall(producer)


def _prefill_pages(model, model_dir, ids: list[int], prefill_only: bool,
                   images: list | None = None) -> dict[str, torch.Tensor]:
    """The global KV pages an engine over ``model`` writes for prompt ``ids`` (with ``images`` for its image
    placeholders), the decoder skipped when ``prefill_only`` (decoder_start = N, as the lead's prefill-only request
    sets it)."""
    engine = LLMEngine(model, EngineArgs(max_model_len=128, max_num_seqs=2, block_size=16,
                                         enable_prefix_caching=False), model_path=model_dir)
    engine.add_request("p", ids, SamplingParams(temperature=0, max_tokens=1),
                       multi_modal_data={"image": images} if images else None)
    seq = engine.requests["p"][0]
    n = seq.num_tokens
    if prefill_only:
        seq.decoder_start = n
    (s, start, end), = engine.scheduler.schedule().prefills
    assert s is seq and (start, end) == (0, n)
    logits = engine.runner.prefill(seq, start, end)
    assert (logits is None) == prefill_only
    decoded = engine.runner.layer_tokens[model.plan.decoder_layers[-1]]
    assert decoded == (0 if prefill_only else model.config.sliding_window)
    pages = [engine.cache.read_page(p) for p in seq.block_table]
    return {f"{i}.{k}": v for i, page in enumerate(pages) for k, v in page.items()}


def test_an_engine_over_the_producer_prefills_the_same_pages(model_dir):
    full = load_model(model_dir, torch.float64)
    producer = load_model(model_dir, torch.float64, encoder_only=True)
    assert model_fingerprint(producer, model_dir) == model_fingerprint(full, model_dir)  # the pages' key
    ids = prompt(45, 7)
    want = _prefill_pages(full, model_dir, ids, prefill_only=False)
    got = _prefill_pages(producer, model_dir, ids, prefill_only=True)
    assert set(got) == set(want) and len(want) > 0
    for key in want:
        assert torch.equal(got[key], want[key]), key
    with pytest.raises(ValueError, match="DSpark draft"):
        LLMEngine(producer, EngineArgs(max_model_len=128, speculative="dspark"))


def test_a_producer_with_a_vision_tower_prefills_the_same_pages_for_an_image_prompt(tmp_path):
    """The producer keeps the vision tower and aligner: an image prompt's pages are the full model's (float64)."""
    cfg = tiny_config().replace(max_position_embeddings=4096, vision_config=VISION, image_token_id=IMG)
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():  # vision weights large enough that the image changes the KV
        for name, p in model.named_parameters():
            if name.startswith(("vision.", "aligner.")):
                p.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path)
    full = load_model(tmp_path, torch.float64)
    producer = load_model(tmp_path, torch.float64, encoder_only=True)
    assert producer.vision is not None and describe_load(producer).endswith("vision tower and aligner")
    ids = prompt(20, 3) + [IMG] + prompt(9, 4)
    images = [_image(6, 6)]
    want = _prefill_pages(full, tmp_path, ids, False, images)
    got = _prefill_pages(producer, tmp_path, ids, True, images)
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert not torch.equal(_prefill_pages(full, tmp_path, ids, False, [_image(6, 6, seed=2)])["1.4.main_codes"],
                           want["1.4.main_codes"])  # the image reaches the boundary's entries


def _image(n_vit_h: int, n_vit_w: int, seed: int = 1) -> ProcessedImage:
    """A preprocessed image of random patches on an n_vit_h x n_vit_w patch grid (tests/engine's helper)."""
    g = torch.Generator().manual_seed(seed)
    p, r = VISION.patch_size, VISION.downsample_ratio
    patches = torch.randn(n_vit_h * n_vit_w, 3 * p ** 2, generator=g)
    return ProcessedImage(patches, ImageGrid(n_vit_h * p, n_vit_w * p, n_vit_h, n_vit_w, math.ceil(n_vit_h / r),
                                             math.ceil(n_vit_w / r)))


# ------------------------------------------------------------------------------------------------ errors
def test_what_the_producer_does_not_hold_fails_clearly(model_dir):
    producer = load_model(model_dir, torch.float64, encoder_only=True)
    streams, pre = producer.embed_streams(torch.tensor([prompt(4)]))
    ctx = DenseContext(1, 4, "cpu")
    with pytest.raises(RuntimeError, match=r"norm is not loaded: this is an encoder-only prefill model \(kv_producer"):
        producer.logits(streams, pre)
    with pytest.raises(RuntimeError, match=r"layers\.4 \(the first decoder layer\).*kv_producer"):
        producer.ced_decode(streams, pre, ctx)
    with pytest.raises(RuntimeError, match=r"layers\.6 is not loaded.*kv_producer"):
        producer.layers[6](streams, pre, ctx)
    with pytest.raises(RuntimeError, match=r"layers\.4\.attn\.wq_a is not loaded.*kv_producer"):
        producer.layers[4].attn(streams[:, :, 0], ctx)
    with pytest.raises(AttributeError, match=r"layers\.5\.ffn: layers\.5 is not loaded"):
        _ = producer.layers[5].ffn
    assert not list(Dropped("x").parameters())


def test_a_model_without_the_ced_layout_is_refused():
    config = tiny_config().replace(**NOT_CED)
    with torch.device("meta"):
        model = Transformer(config)
    with pytest.raises(ValueError, match="needs the CED layout.*decoder layers \\[5\\] must have compress ratio 1"):
        encoder_only_names(model)
    with pytest.raises(ValueError, match="needs the CED layout"):
        prune_to_encoder(model)


@pytest.mark.slow
def test_loading_a_model_without_the_ced_layout_encoder_only_is_refused(tmp_path):
    config = tiny_config().replace(**NOT_CED)
    torch.manual_seed(0)
    Transformer(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="needs the CED layout"):
        load_model(tmp_path, encoder_only=True)


# ------------------------------------------------------------------------------------------------ loading
def test_the_default_load_is_unchanged_and_says_what_it_loaded(model_dir):
    torch.manual_seed(0)
    reference = Transformer(tiny_config().replace(max_position_embeddings=4096))
    full = load_model(model_dir)
    assert not full.encoder_only
    state, want = full.state_dict(), reference.state_dict()
    assert set(state) == set(want) and all(torch.equal(state[k], want[k]) for k in want)
    held = sum(t.numel() * t.element_size() for t in (*full.parameters(), *full.buffers()))
    assert full.loaded_weight_bytes == full.full_weight_bytes == held
    assert describe_load(full) == f"full model: loaded {held / 1e6:,.1f} MB of weights in {len(state):,} tensors"


def test_the_producer_load_reads_only_what_it_keeps(model_dir):
    full = load_model(model_dir, torch.bfloat16)
    producer = load_model(model_dir, torch.bfloat16, encoder_only=True)
    state = producer.state_dict()
    assert set(state) == encoder_only_names(full)
    assert all(torch.equal(state[k], full.state_dict()[k]) for k in state)
    held = sum(t.numel() * t.element_size() for t in (*producer.parameters(), *producer.buffers()))
    assert producer.loaded_weight_bytes == held < full.loaded_weight_bytes
    assert producer.full_weight_bytes == full.loaded_weight_bytes
    line = describe_load(producer)
    assert line.startswith(f"encoder-only prefill model: loaded {held / 1e6:,.1f} MB of weights in {len(state):,} "
                           f"tensors (of {producer.full_weight_bytes / 1e6:,.1f} MB, ")
    assert line.endswith("embedding, layers 0-3, layer 4's compressor and index keys")
    assert len(BOUNDARY_KEEP) == 5


def test_an_unexpected_tensor_is_still_refused(model_dir, tmp_path):
    import shutil

    from safetensors.torch import save_file

    for f in model_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    save_file({"layers.99.attn.wq_a.weight": torch.zeros(2)}, str(tmp_path / "extra.safetensors"))
    (tmp_path / "model.safetensors.index.json").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="unexpected tensor layers.99.attn.wq_a.weight"):
        load_model(tmp_path, encoder_only=True)
