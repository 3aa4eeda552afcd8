"""Prefill / decode disaggregation at the engine level (issue 29): a kv_producer engine computes a prompt's global
KV pages into the connector and samples nothing; a kv_consumer engine reads them, replays the window and decodes.
The decode side must generate exactly what one colocated engine does with exact replay (float64), and move exactly
the KV bytes the accounting says per prompt token."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_oracles import tiny_model  # noqa: E402

from deepseek_v41.analysis.kv import generations_bytes_per_token  # noqa: E402
from deepseek_v41.engine import LLM, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def tokens(n, seed):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny64")
    tiny_model(torch.float64).save_pretrained(path)
    return path


def shared(tmp_path, role, **extra):
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv"), **extra}}


def engine(model_dir, **args):
    return LLM(str(model_dir), dtype=torch.float64, max_model_len=1024, swa_pool_bytes=0, **args)


@pytest.mark.parametrize("encoder_only", [pytest.param(False, marks=pytest.mark.slow), True])
def test_decode_side_equals_one_colocated_engine_with_exact_replay(model_dir, tmp_path, encoder_only):
    prompt = tokens(150, 1)
    colocated = engine(model_dir).generate({"prompt_token_ids": prompt}, GREEDY)[0]
    try:
        producer = engine(model_dir, kv_transfer_config=shared(tmp_path, "kv_producer", encoder_only=encoder_only))
    except TypeError as exc:  # load_model(encoder_only=...) lands with the encoder-only loader
        pytest.fail(f"encoder-only load not available: {exc}")
    pre = producer.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert pre.outputs[0].token_ids == [] and pre.outputs[0].finish_reason == "length"
    params = pre.kv_transfer_params
    P = producer.engine.kv_cache_manager.block_size
    assert params["do_remote_prefill"] and params["num_pages"] == len(prompt) // P
    consumer = engine(model_dir, replay="exact", kv_transfer_config=shared(tmp_path, "kv_consumer"))
    out = consumer.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert out.outputs[0].token_ids == colocated.outputs[0].token_ids
    got = out.kv_transfer_params
    assert got["cached_tokens"] == P * ((len(prompt) - 1) // P) and got["transfer_pages"] == (len(prompt) - 1) // P
    # The bytes moved per prompt token are the KV accounting's (analysis/kv.py, what dsv41 report prints).
    per_token = generations_bytes_per_token(consumer.engine.config)["deepseek-v4.1-flash"]
    assert got["transfer_bytes"] / got["cached_tokens"] == pytest.approx(per_token, rel=1e-12)
    stats = consumer.engine.kv_transfer_stats()["received"]
    assert stats["bytes"] == got["transfer_bytes"] and stats["tokens"] == got["cached_tokens"]


def test_bounded_replay_prefills_at_most_one_window(model_dir, tmp_path):
    prompt = tokens(300, 2)
    producer = engine(model_dir, kv_transfer_config=shared(tmp_path, "kv_producer", encoder_only=False))
    producer.generate({"prompt_token_ids": prompt}, GREEDY)
    consumer = engine(model_dir, kv_transfer_config=shared(tmp_path, "kv_consumer"))
    out = consumer.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    window = consumer.engine.config.sliding_window
    assert 0 < out.num_replayed_tokens <= window
    computed = len(prompt) - (out.num_cached_tokens - out.num_replayed_tokens)
    assert computed <= window + consumer.engine.kv_cache_manager.block_size


def test_a_corrupt_page_is_a_miss_and_the_output_is_unchanged(model_dir, tmp_path):
    prompt = tokens(120, 3)
    colocated = engine(model_dir, replay="exact").generate({"prompt_token_ids": prompt}, GREEDY)[0]
    engine(model_dir, kv_transfer_config=shared(tmp_path, "kv_producer", encoder_only=False)).generate(
        {"prompt_token_ids": prompt}, GREEDY)
    pages = sorted((tmp_path / "kv").rglob("*.page"))
    assert pages
    for page in pages[2:]:  # a partial transfer: the later pages truncated
        data = page.read_bytes()
        page.write_bytes(data[: len(data) // 2])
    consumer = engine(model_dir, replay="exact", kv_transfer_config=shared(tmp_path, "kv_consumer"))
    out = consumer.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert out.num_cached_tokens <= 2 * consumer.engine.kv_cache_manager.block_size
    assert out.outputs[0].token_ids == colocated.outputs[0].token_ids


def test_roles_are_checked(model_dir, tmp_path):
    with pytest.raises(ValueError, match="prefix caching"):
        engine(model_dir, enable_prefix_caching=False, kv_transfer_config=shared(tmp_path, "kv_consumer"))
    with pytest.raises(ValueError, match="CED prefill"):
        engine(model_dir, prefill_mode="exact", kv_transfer_config=shared(tmp_path, "kv_consumer"))
    consumer = engine(model_dir, kv_transfer_config=shared(tmp_path, "kv_consumer"))
    remote = SamplingParams(temperature=0, max_tokens=2, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    with pytest.raises(ValueError, match="kv_consumer"):
        consumer.generate({"prompt_token_ids": tokens(20, 4)}, remote)
    both = engine(model_dir, kv_transfer_config=shared(tmp_path, "kv_both"))
    assert both.generate({"prompt_token_ids": tokens(40, 5)}, remote)[0].outputs[0].token_ids == []
    assert len(both.generate({"prompt_token_ids": tokens(40, 5)}, GREEDY)[0].outputs[0].token_ids) == 6


def test_redis_connector_moves_the_pages(model_dir, redis_url):
    prompt = tokens(130, 6)
    colocated = engine(model_dir).generate({"prompt_token_ids": prompt}, GREEDY)[0]
    redis = {"kv_connector": "RedisConnector", "kv_connector_extra_config": {"url": redis_url}}
    producer = engine(model_dir, kv_transfer_config={**redis, "kv_role": "kv_producer"})
    params = producer.generate({"prompt_token_ids": prompt}, GREEDY)[0].kv_transfer_params
    assert params["num_pages"] == len(prompt) // producer.engine.kv_cache_manager.block_size
    consumer = engine(model_dir, replay="exact", kv_transfer_config={**redis, "kv_role": "kv_consumer"})
    out = consumer.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert out.kv_transfer_params["transfer_pages"] == (len(prompt) - 1) // 16 > 0
    assert out.outputs[0].token_ids == colocated.outputs[0].token_ids


@pytest.mark.slow
def test_nixl_connector_pulls_the_pages_from_the_producer_named_in_kv_transfer_params(model_dir):
    """NixlConnector end to end through two engines: the producer's prefill output names its side channel, the
    consumer's request carries it (as the router forwards it) and NIXL-READs the pages (UCX, DRAM to DRAM)."""
    from optional_deps import require

    require("nixl")
    prompt = tokens(140, 7)
    colocated = engine(model_dir).generate({"prompt_token_ids": prompt}, GREEDY)[0]
    producer = engine(model_dir, kv_transfer_config={
        "kv_connector": "NixlConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"side_channel_port": 0, "buffer_bytes": 8 << 20}})
    params = producer.generate({"prompt_token_ids": prompt}, GREEDY)[0].kv_transfer_params
    assert params["remote_port"] > 0 and params["num_pages"] == len(prompt) // 16
    consumer = engine(model_dir, replay="exact", kv_transfer_config={
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"side_channel_port": 0, "buffer_bytes": 8 << 20}})
    decode = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            extra_args={"kv_transfer_params": params})
    out = consumer.generate({"prompt_token_ids": prompt}, decode)[0]
    assert out.kv_transfer_params["transfer_pages"] == (len(prompt) - 1) // 16
    assert out.outputs[0].token_ids == colocated.outputs[0].token_ids


def test_a_producer_persists_its_pages_in_the_connector_only(model_dir, tmp_path):
    """A prefill server writes each page once, to the connector (no --cache-dir store of its own, whose writes its
    responses would wait for too), and a restarted one finds its earlier prefixes there."""
    prompt = tokens(100, 8)
    config = shared(tmp_path, "kv_producer")
    engine(model_dir, cache_dir=str(tmp_path / "own"), kv_transfer_config=config).generate(
        {"prompt_token_ids": prompt}, GREEDY)
    assert not list((tmp_path / "own").rglob("*.page")) and len(list((tmp_path / "kv").rglob("*.page"))) == 100 // 16
    again = engine(model_dir, cache_dir=str(tmp_path / "own"), kv_transfer_config=config)
    assert again.generate({"prompt_token_ids": prompt + [5]}, GREEDY)[0].num_cached_tokens == 96


def test_a_prefill_response_promises_only_the_pages_the_connector_holds(model_dir, redis_server):
    """With Redis down the prefill server still answers, but its kv_transfer_params say that no page moved."""
    process, url = redis_server
    producer = engine(model_dir, kv_transfer_config={"kv_connector": "RedisConnector", "kv_role": "kv_producer",
                                                     "kv_connector_extra_config": {"url": url}})
    prompt = tokens(70, 9)
    assert producer.generate({"prompt_token_ids": prompt}, GREEDY)[0].kv_transfer_params["num_pages"] == 4
    process.kill()
    process.wait()
    params = producer.generate({"prompt_token_ids": tokens(70, 10)}, GREEDY)[0].kv_transfer_params
    assert params["num_pages"] == 0 and params["num_pages_expected"] == 4 and params["transfer_bytes"] == 0
