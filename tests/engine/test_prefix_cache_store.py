"""The persistent and shared tiers seen from the engine: restarts, bad files, bad directories, Redis (issue 6)."""

import logging

import torch

from deepseek_v41.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def tokens(n, seed):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(llm, prompt):
    return llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]


def engine(model, **args):
    return LLM(model, max_model_len=1024, **args)


def test_bad_page_files_are_misses_and_never_produce_text(model64, tmp_path):
    prompt = tokens(80, 1)
    cold = run(engine(model64, enable_prefix_caching=False), prompt + [7]).outputs[0].token_ids
    run(engine(model64, cache_dir=str(tmp_path), swa_pool_bytes=0), prompt)
    files = sorted(tmp_path.rglob("*.page"), key=lambda f: f.stat().st_mtime)
    assert len(files) == 5
    data = bytearray(files[2].read_bytes())
    data[-10] ^= 0xFF  # corrupt the third page's payload
    files[2].write_bytes(bytes(data))
    files[3].write_bytes(files[3].read_bytes()[:100])  # truncate the fourth
    reader = engine(model64, cache_dir=str(tmp_path), swa_pool_bytes=0, replay="exact")
    hit = run(reader, prompt + [7])
    assert hit.num_cached_tokens == 32  # the two good pages before the first bad one
    assert hit.outputs[0].token_ids == cold
    assert list(tmp_path.rglob("quarantine/*"))


def test_other_models_never_read_the_pages(model64, tmp_path):
    from engine_oracles import tiny_model

    prompt = tokens(80, 2)
    run(engine(model64, cache_dir=str(tmp_path), swa_pool_bytes=0), prompt)
    other = tiny_model(torch.float64, seed=1)
    assert run(engine(other, cache_dir=str(tmp_path), swa_pool_bytes=0), prompt + [7]).num_cached_tokens == 0


def test_an_unusable_cache_dir_degrades_to_no_persistence(model64, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    prompt = tokens(40, 3)
    with caplog.at_level(logging.WARNING):
        llm = engine(model64, cache_dir=str(blocker / "cache"), swa_pool_bytes=0)
        first = run(llm, prompt)
        second = run(llm, prompt + [1])
    assert first.outputs[0].token_ids and second.num_cached_tokens == 32  # the device tier still works
    assert sum("prefix" in r.getMessage().lower() or "cache" in r.getMessage().lower()
               for r in caplog.records if r.levelno >= logging.WARNING) >= 1


def test_two_engines_share_snapshots_through_redis(model64, redis_url, tmp_path):
    prompt = tokens(70, 4)
    cold = run(engine(model64, enable_prefix_caching=False), prompt + [9]).outputs[0].token_ids
    first = engine(model64, cache_dir=str(tmp_path), redis_url=redis_url)
    run(first, prompt)
    second = engine(model64, cache_dir=str(tmp_path), redis_url=redis_url)
    hit = run(second, prompt + [9])
    assert hit.num_cached_tokens == 64 and hit.num_replayed_tokens == 0  # pages from disk, snapshot from Redis
    assert hit.outputs[0].token_ids == cold


def test_a_checkpoint_of_the_same_shape_with_other_weights_never_reads_the_pages(model64, tmp_path, monkeypatch):
    """Issue 22 item 5: the fingerprint hashed config.json, the safetensors headers and the file sizes, so a
    fine-tuned checkpoint of the same shape hit the base model's pages and produced wrong tokens."""
    from engine_oracles import tiny_model

    monkeypatch.setenv("DSV41_CACHE_HOME", str(tmp_path / "digests"))
    model64.save_pretrained(tmp_path / "base")
    tiny_model(torch.float64, seed=1).save_pretrained(tmp_path / "tuned")
    assert (tmp_path / "base" / "model.safetensors").stat().st_size == \
        (tmp_path / "tuned" / "model.safetensors").stat().st_size
    prompt = tokens(80, 5)
    cache = str(tmp_path / "cache")
    base = LLM(str(tmp_path / "base"), dtype=torch.float64, max_model_len=1024, cache_dir=cache, swa_pool_bytes=0)
    run(base, prompt)
    assert run(LLM(str(tmp_path / "base"), dtype=torch.float64, max_model_len=1024, cache_dir=cache,
                   swa_pool_bytes=0), prompt + [7]).num_cached_tokens == 80  # the same checkpoint still hits
    tuned = LLM(str(tmp_path / "tuned"), dtype=torch.float64, max_model_len=1024, cache_dir=cache, swa_pool_bytes=0)
    cold = run(LLM(str(tmp_path / "tuned"), dtype=torch.float64, max_model_len=1024, enable_prefix_caching=False),
               prompt + [7]).outputs[0].token_ids
    out = run(tuned, prompt + [7])
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == cold
