"""Images through the engine against the exact forward (issue 27; VISION_DESIGN.md decisions 2, 4, 5, 6, 7).

A tiny random VLM (the tests' tiny text config + a 2-layer ViT of width 16, patch 2, 3x3 merge) in float64, so the
engine and ``Transformer.forward(ids, token_types=..., images=...)`` compute the same numbers in different orders
and agree to ~1e-12: any larger difference is a bug (a span split across chunks, image rows misplaced, image tokens
routed with ``bias`` instead of ``bias_vl``, Engram hashing image positions, causal attention inside a span).
Images are given preprocessed (random patches on a known grid), so the tests do not depend on the resize rules.
"""

import math

import pytest
import torch
from engine_oracles import engine_logits

from deepseek_v41.cache.prefix_cache import chain_hashes, image_block_keys, span_safe_pages
from deepseek_v41.config import VisionConfig, tiny_config
from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.engine.encoder_cache import EncoderCache, VisionEncoder
from deepseek_v41.engine.scheduler import image_safe_end
from deepseek_v41.model.image_processor import ImageGrid, ProcessedImage, expand_image_placeholders
from deepseek_v41.model.transformer import Transformer

W, P = 16, 16  # the tiny config's sliding window and the default page size
IMG = 509  # image_token_id of the tiny VLM (511 is the DSpark noise token)
VISION = VisionConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=12, patch_size=2,
                      rope_theta=100.0, downsample_ratio=3, max_image_tokens=64, min_pixels=16)


def tiny_vlm(dtype=torch.float64, seed=0) -> Transformer:
    """The tiny VLM: vision weights and image routing biases large enough that an image and its routing change
    the tokens (``bias_vl`` differs from ``bias``; the delimiters are not zero)."""
    cfg = tiny_config().replace(max_position_embeddings=8192, vision_config=VISION, image_token_id=IMG)
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("vision.", "aligner.")):
                p.normal_(0.0, 0.3)
            elif name in ("image_start", "image_newline", "image_end") or name.endswith("bias_vl"):
                p.normal_(0.0, 1.0)
    return model.to(dtype)


@pytest.fixture(scope="module")
def vlm():
    return tiny_vlm()


def image(n_vit_h: int, n_vit_w: int, seed: int) -> ProcessedImage:
    """A preprocessed image of random patches on an n_vit_h x n_vit_w patch grid."""
    g = torch.Generator().manual_seed(seed)
    patches = torch.randn(n_vit_h * n_vit_w, 3 * VISION.patch_size ** 2, generator=g)
    p, r = VISION.patch_size, VISION.downsample_ratio
    return ProcessedImage(patches, ImageGrid(n_vit_h * p, n_vit_w * p, n_vit_h, n_vit_w, math.ceil(n_vit_h / r),
                                             math.ceil(n_vit_w / r)))


def text(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def expanded(prompt: list[int], images: list[ProcessedImage]) -> tuple[list[int], list[int]]:
    return expand_image_placeholders(prompt, [im.grid for im in images], IMG)


@torch.no_grad()
def exact_loop(model, prompt: list[int], images: list[ProcessedImage], steps: int):
    """The oracle: greedy decoding by re-running the exact forward (with the images) over the whole sequence."""
    ids, types = expanded(prompt, images)
    seq, tt, logits = list(ids), list(types), []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only waits on a busy shared machine (seconds per forward)
    try:
        for _ in range(steps):
            row = model(torch.tensor([seq]), token_types=torch.tensor([tt]), images=images)[0, -1]
            logits.append(row)
            seq.append(int(row.argmax()))
            tt.append(-1)
    finally:
        torch.set_num_threads(threads)
    return seq[len(ids):], logits


def recording(engine) -> list[tuple[str, int, int]]:
    """Every prefill chunk the engine's scheduler plans from now on, as (request id, start, end)."""
    chunks = []
    schedule = engine.scheduler.schedule

    def record():
        plan = schedule()
        chunks.extend((seq.request_id, start, end) for seq, start, end in plan.prefills)
        return plan

    engine.scheduler.schedule = record
    return chunks


def run(engine, requests, max_tokens=8) -> dict[str, list[int]]:
    """Add ``requests`` [(request id, prompt with placeholders, images)] and step until all finished."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    for rid, prompt, images in requests:
        engine.add_request(rid, prompt, params, multi_modal_data={"image": images} if images else None)
    while engine.has_unfinished_requests():
        engine.step()
    out = {rid: engine.request_output(rid) for rid, _, _ in requests}
    for rid in out:
        engine.release(rid)
    return out


def tokens(outs) -> dict[str, list[int]]:
    return {rid: out.outputs[0].token_ids for rid, out in outs.items()}


def assert_same_logprobs(out, ref, tol=1e-9):
    """Same tokens, and the logprobs of every step's top tokens within ``tol`` (float64: only order differs)."""
    a, b = out.outputs[0], ref.outputs[0]
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.keys() == y.keys()
        assert max(abs(x[t].logprob - y[t].logprob) for t in x) <= tol


def forced_logits(engine, prompt, images, forced) -> list[torch.Tensor]:
    """:func:`engine_oracles.engine_logits` with ``images``, on the threads an engine step would take."""
    return engine_logits(engine, prompt, forced, {"image": images}, own_threads=True)


def assert_no_split(chunks, spans):
    for _, start, end in chunks:
        for s, e in spans:
            assert not s < end < e, f"chunk [{start}, {end}) ends inside the image span [{s}, {e})"


def spans_of(prompt, images):
    _, types = expanded(prompt, images)
    spans, s = [], None
    for i, t in enumerate(types):
        if t == 0:
            s = i
        elif t == 3:
            spans.append((s, i + 1))
    return spans


# ------------------------------------------------------------------------------------------- small units
def test_image_safe_end_moves_chunk_ends_out_of_spans():
    spans = [(10, 20), (30, 60)]
    assert image_safe_end(spans, 0, 15, 1000) == 10  # back to the span's start
    assert image_safe_end(spans, 0, 10, 1000) == 10 and image_safe_end(spans, 0, 25, 1000) == 25
    assert image_safe_end(spans, 10, 15, 1000) == 20  # a chunk starting at the span takes it whole
    assert image_safe_end(spans, 30, 34, 1000) == 60  # a span longer than the budget: whole, in its own chunk
    assert image_safe_end(spans, 40, 45, 1000) == 60  # a replay restart inside the span: on to its end
    assert image_safe_end(spans, 30, 34, 50) == 30  # the span's end is beyond the free pages: no chunk now


def test_text_hashes_are_unchanged_and_images_key_the_blocks_they_overlap():
    import hashlib

    import numpy as np

    root, toks = "ab" * 32, text(50, 1)
    prev, want = root, []
    for i in range(3):  # the chain as it was before images: sha256(prev || int32 block)
        prev = hashlib.sha256(bytes.fromhex(prev) + np.asarray(toks[16 * i:16 * i + 16], "<i4").tobytes()).hexdigest()
        want.append(prev)
    assert chain_hashes(root, toks, 16) == want
    assert chain_hashes(root, toks, 16, extra_keys={}) == want
    keys = image_block_keys([(20, 22, "aa"), (42, 4, "bb")], 16)
    assert keys == {1: ["aa"], 2: ["aa", "bb"]}
    with_images = chain_hashes(root, toks, 16, extra_keys=keys)
    assert with_images[0] == want[0] and with_images[1] != want[1] and with_images[2] != want[2]
    other = chain_hashes(root, toks, 16, extra_keys=image_block_keys([(20, 22, "cc"), (42, 4, "bb")], 16))
    assert other[0] == want[0] and other[1] != with_images[1]
    assert span_safe_pages(3, 16, [(20, 42)]) == 3  # 48 is past the span
    assert span_safe_pages(2, 16, [(20, 42)]) == 1  # 32 is inside: back to 16, the boundary below 20
    assert span_safe_pages(2, 16, [(40, 44), (12, 36)]) == 0


def test_encoder_cache_is_lru_within_its_budget_and_counts():
    calls = []

    def encode(images):
        calls.append(len(images))
        return [torch.full((4, 2), float(im.patches[0, 0])) for im in images]  # 64 bytes each in float64

    cache = EncoderCache(capacity_bytes=2 * 64)
    stage = VisionEncoder(lambda ims: [r.double() for r in encode(ims)], cache)

    class Item:
        def __init__(self, h, seed):
            self.hash, self.image = h, image(3, 3, seed)

    a, b, c = Item("a", 1), Item("b", 2), Item("c", 3)
    stage.request([a, b, a])
    assert stage.run() == 2 and calls == [2]  # one batch, each image once
    stage.release()
    stage.request([a])  # a hit, a is now the most recent
    stage.request([c])  # a miss: c evicts b
    stage.run()
    assert cache.stats()["hits"] == 1 and cache.misses == 3 and cache.evictions == 1
    assert "b" not in cache and "a" in cache and "c" in cache
    stage.release()
    small = VisionEncoder(lambda ims: [r.double() for r in encode(ims)], EncoderCache(0))
    assert small.rows([a])[0].shape == (4, 2)  # too big to keep: still handed out for the step
    assert len(small.cache) == 0
    with pytest.raises(ValueError, match="capacity"):
        EncoderCache(-1)


# ------------------------------------------------------------------------------------------- against the exact forward
def engine_of(model, **args):
    return LLM(model, max_model_len=512, **args).engine


def test_exact_prefill_with_two_images_equals_the_exact_forward(vlm):
    images = [image(6, 6, 1), image(9, 6, 2)]  # spans of 8 and 11 positions
    prompt = text(5, 1) + [IMG] + text(7, 2) + [IMG] + text(4, 3)
    ref_tokens, ref_logits = exact_loop(vlm, prompt, images, 8)
    engine = engine_of(vlm, prefill_mode="exact")
    assert tokens(run(engine, [("r", prompt, images)]))["r"] == ref_tokens
    forced = forced_logits(engine_of(vlm, prefill_mode="exact"), prompt, images, ref_tokens)
    assert max((a - b).abs().max().item() for a, b in zip(forced, ref_logits, strict=True)) < 1e-10


@pytest.mark.parametrize(("mode", "budget"), [("exact", 5), ("ced", 7), ("ced", 13)])
def test_chunk_ends_never_fall_inside_a_span(vlm, mode, budget):
    """Budgets of 5, 7 and 13 tokens put the natural chunk ends inside the spans (of 8 and 22 positions): the ends
    move, a span longer than the budget runs whole, and the logits equal the unchunked run."""
    images = [image(6, 6, 3), image(12, 12, 4)]
    prompt = text(3, 4) + [IMG] + text(6, 5) + [IMG] + text(9, 6)
    forced = text(4, 7)
    whole = forced_logits(engine_of(vlm, prefill_mode=mode, max_num_batched_tokens=512), prompt, images, forced)
    engine = engine_of(vlm, prefill_mode=mode, max_num_batched_tokens=budget)
    chunks = recording(engine)
    parts = forced_logits(engine, prompt, images, forced)
    spans = spans_of(prompt, images)
    assert_no_split(chunks, spans)
    assert len(chunks) > 3 and any(e - s > budget for _, s, e in chunks)  # really chunked; the long span whole
    assert max((a - b).abs().max().item() for a, b in zip(whole, parts, strict=True)) < 1e-10


def test_ced_within_the_window_equals_the_exact_forward(vlm):
    """A prompt of at most W positions: CED runs every layer over every token, so it is the exact forward."""
    images = [image(6, 6, 5)]  # 8 positions
    prompt = text(3, 8) + [IMG] + text(4, 9)  # 15 positions
    ref_tokens, ref_logits = exact_loop(vlm, prompt, images, 10)
    forced = forced_logits(engine_of(vlm, prefill_mode="ced", max_num_batched_tokens=6), prompt, images, ref_tokens)
    assert max((a - b).abs().max().item() for a, b in zip(forced, ref_logits, strict=True)) < 1e-10


@pytest.mark.parametrize("mode", ["ced", "exact"])
def test_a_batch_mixing_image_and_text_requests_is_batch_invariant(vlm, mode):
    requests = [("img1", text(4, 10) + [IMG] + text(3, 11), [image(6, 6, 6)]),
                ("text", text(23, 12), []),
                ("img2", [IMG] + text(30, 13) + [IMG], [image(9, 9, 7), image(6, 9, 8)]),
                ("text2", text(5, 14), [])]
    alone = {}
    for req in requests:
        alone |= tokens(run(engine_of(vlm, prefill_mode=mode), [req]))
    engine = engine_of(vlm, prefill_mode=mode, max_num_batched_tokens=24)
    together = tokens(run(engine, requests))
    assert together == alone
    assert engine.stats["max_decode_batch"] == 4
    rid, prompt, images = requests[0]
    assert alone[rid] == exact_loop(vlm, prompt, images, 8)[0]


# ------------------------------------------------------------------------------------------- encoder cache
def test_the_same_image_again_is_an_encoder_cache_hit(vlm):
    calls = []
    hook = vlm.vision.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    try:
        engine = engine_of(vlm, enable_prefix_caching=False)
        first = run(engine, [("a", text(3, 20) + [IMG] + text(2, 21), [image(6, 6, 9)])])["a"]
        assert len(calls) == 1
        second = run(engine, [("b", text(3, 20) + [IMG] + text(2, 21), [image(6, 6, 9)])])["b"]
        assert len(calls) == 1  # not encoded again
        assert_same_logprobs(second, first, tol=0.0)
        stats = engine.stats["encoder_cache"]
        assert (stats["hits"], stats["misses"], stats["encoded_images"]) == (1, 1, 1)
        other = run(engine, [("c", text(3, 20) + [IMG] + text(2, 21), [image(6, 6, 10)])])
        assert len(calls) == 2 and engine.stats["encoder_cache"]["misses"] == 2
        step0 = other["c"].outputs[0].logprobs[0]
        assert any(abs(step0[t].logprob - first.outputs[0].logprobs[0].get(t, step0[t]).logprob) > 1e-6
                   for t in step0) or step0.keys() != first.outputs[0].logprobs[0].keys()
        # Two new images with the same grid in one step: one batch of two.
        run(engine, [("d", [IMG] + text(2, 22), [image(6, 6, 11)]), ("e", [IMG] + text(2, 23), [image(6, 6, 12)])])
        assert calls[-1] == 2
    finally:
        hook.remove()


def test_encoder_cache_counters_reach_metrics(vlm):
    from prometheus_client import generate_latest

    from deepseek_v41.engine.async_engine import AsyncLLMEngine
    from deepseek_v41.server.metrics import ServerMetrics

    engine = engine_of(vlm)
    for rid in ("a", "b", "c"):
        run(engine, [(rid, text(3, 30) + [IMG] + text(2, 31), [image(6, 6, 13)])], max_tokens=2)
    async_engine = AsyncLLMEngine(engine)
    metrics = ServerMetrics(async_engine, "tiny-vl")
    text_out = generate_latest(metrics.registry).decode()
    async_engine._executor.shutdown()
    assert 'dsv41:encoder_cache_hits_total{model_name="tiny-vl"} 2.0' in text_out
    assert 'dsv41:encoder_cache_misses_total{model_name="tiny-vl"} 1.0' in text_out


# ------------------------------------------------------------------------------------------- prefix cache
def test_prefix_hits_only_for_the_same_image_and_never_end_inside_a_span(vlm):
    head, tail = text(20, 40), text(10, 41)
    prompt = head + [IMG] + tail  # span [20, 42)
    same, other = image(12, 12, 14), image(12, 12, 15)
    cold = engine_of(vlm, enable_prefix_caching=False)
    want = run(cold, [("same", prompt + [7], [same]), ("other", prompt + [7], [other])])
    assert want["same"].outputs[0].token_ids != want["other"].outputs[0].token_ids
    engine = engine_of(vlm, swa_pool_bytes=1 << 26)
    run(engine, [("first", prompt, [same])])
    outs = run(engine, [("same", prompt + [7], [same])])
    assert outs["same"].num_cached_tokens == 48
    assert_same_logprobs(outs["same"], want["same"])
    stats = engine.stats["encoder_cache"]
    assert (stats["misses"], stats["hits"]) == (1, 0)  # the cached span needed no rows at all
    outs = run(engine, [("other", prompt + [7], [other])])
    assert outs["other"].num_cached_tokens == 16  # only the text block before the image
    assert_same_logprobs(outs["other"], want["other"])
    # Same image, other text right after the span: the block [32, 48) differs, and a hit of 32 tokens would end
    # inside the span [20, 42): it stops at 16.
    changed = head + [IMG] + text(10, 42)
    outs = run(engine, [("changed", changed, [same])])
    assert outs["changed"].num_cached_tokens == 16
    assert_same_logprobs(outs["changed"], run(cold, [("c", changed, [same])])["c"])


@pytest.mark.parametrize("mode", ["exact", "ced"])
def test_a_snapshot_hit_right_after_a_span_rebuilds_the_engram_history_masked(vlm, mode):
    """The hit restarts at 48 and the positions before it (46, 47) are image positions: the rebuilt Engram history
    must hash them as masked, as the cold run did."""
    prompt = text(26, 50) + [IMG] + text(5, 51)  # span [26, 48)
    images = [image(12, 12, 16)]
    cold = run(engine_of(vlm, prefill_mode=mode, enable_prefix_caching=False), [("c", prompt + [9], images)])["c"]
    engine = engine_of(vlm, prefill_mode=mode, swa_pool_bytes=1 << 26)
    run(engine, [("first", prompt, images)])
    outs = run(engine, [("hit", prompt + [9], images)])
    assert outs["hit"].num_cached_tokens == 48 and outs["hit"].num_replayed_tokens == 0
    assert_same_logprobs(outs["hit"], cold)


def test_the_same_image_hits_across_a_restart_from_disk(vlm, tmp_path):
    prompt = text(20, 60) + [IMG] + text(12, 61)  # span [20, 42), 54 positions
    same, other = image(12, 12, 17), image(12, 12, 18)
    cold = engine_of(vlm, enable_prefix_caching=False)
    want = run(cold, [("s", prompt + [5], [same]), ("o", prompt + [5], [other])])
    args = dict(prefill_mode="ced", cache_dir=str(tmp_path), swa_pool_bytes=0, replay="exact")
    writer = engine_of(vlm, **args)
    run(writer, [("w", prompt, [same])])
    writer.kv_cache_manager.flush()
    del writer
    reader = engine_of(vlm, **args)
    outs = run(reader, [("s", prompt + [5], [same])])
    assert outs["s"].num_cached_tokens == 48 and reader.stats["prefix_cache"]["disk_pages_read"] == 3
    assert_same_logprobs(outs["s"], want["s"])
    assert reader.stats["encoder_cache"]["misses"] == 1  # the replay over the span encoded it once
    restarted = engine_of(vlm, **args)
    outs = run(restarted, [("o", prompt + [5], [other])])
    assert outs["o"].num_cached_tokens == 16
    assert_same_logprobs(outs["o"], want["o"])


def test_bounded_replay_starting_inside_a_span_takes_the_rest_of_its_rows(vlm, monkeypatch):
    """Bounded replay restarts at L' - W = 48 - 16 = 32, inside the span [20, 42) (4x4 rows; IMAGE slots 21-24,
    26-29, 31-34, 36-39): the chunk gets the image's rows 9..15, those of its IMAGE slots 32-34 and 36-39, from the
    encoder cache. (Bounded replay is an approximation: the rows are checked, not the tokens.)"""
    from deepseek_v41.engine import model_runner
    from deepseek_v41.model.vision import encode_images

    prompt = text(20, 70) + [IMG] + text(12, 71)
    images = [image(12, 12, 19)]
    engine = engine_of(vlm, prefill_mode="ced", swa_pool_bytes=0)
    run(engine, [("w", prompt, images)])
    chunks = recording(engine)
    placed = []

    def place(h, token_types, features, *vectors):
        placed.append(features)
        return real_place(h, token_types, features, *vectors)

    real_place = model_runner.place_image_embeddings
    monkeypatch.setattr(model_runner, "place_image_embeddings", place)
    outs = run(engine, [("r", prompt + [5], images)])
    with torch.no_grad():
        rows = encode_images(vlm, images)[0]
    assert len(placed) == 1 and torch.equal(placed[0], rows[9:])
    assert outs["r"].num_cached_tokens == 48 and outs["r"].num_replayed_tokens == 16
    assert chunks[0][1] == 32
    assert outs["r"].outputs[0].token_ids
    assert engine.stats["encoder_cache"]["hits"] == 1  # the replayed rows came from the encoder cache


# ------------------------------------------------------------------------------------------- requests
def test_bad_image_requests_queue_nothing(vlm):
    engine = engine_of(vlm)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="placeholder"):
        engine.add_request("a", text(3, 1) + [IMG, IMG], params, multi_modal_data={"image": [image(6, 6, 1)]})
    with pytest.raises(ValueError, match="placeholder"):
        engine.add_request("b", text(3, 1) + [IMG], params)
    with pytest.raises(ValueError, match="'image'"):
        engine.add_request("c", text(3, 1) + [IMG], params, multi_modal_data={"video": [image(6, 6, 1)]})
    short = LLM(vlm, max_model_len=20).engine
    with pytest.raises(ValueError, match="max_model_len"):  # 12 ids, 33 positions once the 22-position span is in
        short.add_request("d", text(11, 1) + [IMG], params, multi_modal_data={"image": [image(12, 12, 1)]})
    text_only = LLM(tiny_vlm_text_only(), max_model_len=64).engine
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.add_request("e", text(3, 1), params, multi_modal_data={"image": [image(6, 6, 1)]})
    for e in (engine, short, text_only):
        assert not e.has_unfinished_requests() and not e.requests


def tiny_vlm_text_only():
    cfg = tiny_config().replace(max_position_embeddings=8192)
    torch.manual_seed(0)
    return Transformer(cfg).eval().to(torch.float64)


def test_outputs_carry_the_expanded_prompt(vlm):
    prompt, images = text(3, 80) + [IMG] + text(2, 81), [image(6, 6, 20)]
    out = run(engine_of(vlm), [("r", prompt, images)], max_tokens=2)["r"]
    assert out.prompt_token_ids == expanded(prompt, images)[0]


def test_speculative_decoding_with_an_image_equals_plain(vlm):
    COST = [1.0, 1.15, 1.3, 1.45, 1.6]  # a made-up cost curve: the adaptive scheduler speculates at varied lengths
    requests = [("a", text(10, 90) + [IMG] + text(20, 91), [image(9, 9, 21)]), ("b", text(12, 92), [])]
    extended = [("a2", requests[0][1] + text(5, 93), requests[0][2])]  # the image in a cached prefix
    common = dict(max_model_len=512, max_num_batched_tokens=24, replay="exact")
    plain_engine = LLM(vlm, **common).engine
    plain = tokens(run(plain_engine, requests, max_tokens=16)) | tokens(run(plain_engine, extended, max_tokens=16))
    spec = LLM(vlm, speculative="dspark", speculative_cost_table=COST, **common).engine
    assert tokens(run(spec, requests, max_tokens=16)) == {k: plain[k] for k in ("a", "b")}
    hit = run(spec, extended, max_tokens=16)
    assert hit["a2"].num_cached_tokens > 0 and tokens(hit)["a2"] == plain["a2"]
    assert spec.stats["spec_decode_num_drafts"] > 0


def test_preempted_image_requests_recompute_the_same_tokens(vlm):
    """A pool of 10 pages for 3 image prompts of 40-60 positions: sequences are preempted, come back (their prefix
    looked up with the image keys, the images' rows from the encoder cache) and end with the roomy run's tokens."""
    requests = [(f"r{i}", text(10 + 5 * i, 100 + i) + [IMG] + text(12, 110 + i), [image(12, 9 + 3 * i, 120 + i)])
                for i in range(3)]
    roomy = tokens(run(engine_of(vlm), requests, max_tokens=20))
    tight = LLM(vlm, max_model_len=160, num_kv_pages=10).engine
    assert tokens(run(tight, requests, max_tokens=20)) == roomy
    assert tight.stats["num_preemptions"] > 0 and tight.stats["kv_pages_used"] == 0
    assert tight.stats["encoder_cache"]["hits"] > 0


def test_a_pil_image_and_its_png_bytes_are_the_same_image(vlm):
    """The engine preprocesses PIL images and encoded bytes itself: the same pixels give the same content hash, so
    the PNG bytes of an image already seen as a PIL image are an encoder-cache hit with the same logprobs."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (12, 18, 3), dtype=np.uint8)
    pil = Image.fromarray(pixels, "RGB")
    png = io.BytesIO()
    pil.save(png, format="PNG")
    engine = engine_of(vlm, enable_prefix_caching=False)  # (a prefix hit past the span would need no rows at all)
    prompt = text(3, 130) + [IMG] + text(4, 131)
    first = run(engine, [("pil", prompt, [pil])], max_tokens=4)["pil"]
    second = run(engine, [("png", prompt, [png.getvalue()])], max_tokens=4)["png"]
    stats = engine.stats["encoder_cache"]
    assert (stats["misses"], stats["hits"]) == (1, 1)
    assert_same_logprobs(second, first, tol=0.0)


def test_no_snapshot_is_taken_at_a_boundary_inside_a_span(vlm):
    """A prompt of 42 positions ending with the span [20, 42): its page boundary 32 lies inside the span, where no
    hit may resume, so neither the prompt's nor the finished sequence's snapshot is taken there."""
    engine = engine_of(vlm, swa_pool_bytes=1 << 26)
    run(engine, [("r", text(20, 140) + [IMG], [image(12, 12, 22)])], max_tokens=2)
    assert engine.stats["prefix_cache"]["snapshots_written"] == 0
    run(engine, [("t", text(20, 140) + [IMG] + text(12, 141), [image(12, 12, 22)])], max_tokens=2)
    assert engine.stats["prefix_cache"]["snapshots_written"] == 1  # at 48, past the span
