"""Prefix-cache accounting through the API: per-key salts reach the engine, a key never reports another key's
cached tokens, and a repeated long prompt reports cached tokens once prefix caching exists in the engine."""

import openai
import pytest
from serving_helpers import KEYS, MODEL

LONG = [{"role": "user", "content": "The city is Paris. " * 40}]


def ask(server, key: str, messages=LONG):
    client = openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=60)
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage


def test_each_key_has_its_own_salt(server, monkeypatch):
    """The salt of the key (never the key itself) reaches the engine's add_request as ``cache_salt``."""
    engine = server.llm.engine
    original = engine.add_request
    seen = []

    def add_request(request_id, prompt_token_ids, params, prompt=None, arrival_time=None, cache_salt=None):
        seen.append(cache_salt)
        original(request_id, prompt_token_ids, params, prompt=prompt, arrival_time=arrival_time)

    monkeypatch.setattr(engine, "add_request", add_request)
    for key in (KEYS[0], KEYS[1], KEYS[0]):
        ask(server, key)
    assert seen[0] == seen[2] and seen[0] != seen[1]
    assert all(salt and not any(key in salt for key in KEYS) for salt in seen)


def test_second_key_gets_no_cached_tokens(server):
    for _ in range(2):
        ask(server, KEYS[0])
    usage = ask(server, KEYS[1])
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert usage.model_extra["prompt_cache_hit_tokens"] == 0
    assert usage.model_extra["prompt_cache_miss_tokens"] == usage.prompt_tokens


def test_repeated_long_prompt_hits_the_cache(server):
    ask(server, KEYS[0])
    usage = ask(server, KEYS[0])
    assert 0 < usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
    assert usage.model_extra["prompt_cache_hit_tokens"] == usage.prompt_tokens_details.cached_tokens


def test_llm_text_prompt_dicts(model_dir):
    """vLLM's TextPrompt: {"prompt": text} tokenizes like a plain string, and its cache_salt keeps caches apart."""
    from deepseek_v41.engine import LLM, SamplingParams

    llm = LLM(model_dir, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    text = "The io module provides Python's main facilities for dealing with various types of I/O. " * 2
    plain = llm.generate(text, params)[0]
    salted = llm.generate({"prompt": text, "cache_salt": "tenant-b"}, params)[0]
    assert salted.prompt_token_ids == plain.prompt_token_ids and salted.prompt == text
    assert salted.outputs[0].token_ids == plain.outputs[0].token_ids
    assert plain.num_cached_tokens == 0 and salted.num_cached_tokens == 0  # another salt: no hit
    again = llm.generate({"prompt": text, "cache_salt": "tenant-b"}, params)[0]
    assert again.num_cached_tokens > 0
    with pytest.raises(ValueError, match="'prompt' \\(a string\\)"):
        llm.generate({"text": text}, params)
