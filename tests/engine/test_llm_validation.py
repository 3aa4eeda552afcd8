"""What ``LLM`` and ``LLMEngine`` refuse at the door, and how a failing step leaves them (user review fixes).

Oracles: a fresh ``LLM`` on the same model (the tokens a clean engine gives) and the pool's own page counters
(every page back in the pool once a call ends, however it ends).
"""

import numpy as np
import pytest
import torch

from deepseek_v41.cache import kv_cache_manager
from deepseek_v41.engine import LLM, SamplingParams

VOCAB = 512  # tiny config's vocab_size
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(3, 40))  # 37 tokens: more than two 16-token pages


def tokens(llm, prompt=PROMPT, params=GREEDY):
    return llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids


def assert_clean(llm):
    """Nothing of any request is left in the engine: no pages, slots, queued or running sequences."""
    engine = llm.engine
    assert llm.stats["kv_pages_used"] == 0
    assert len(engine.cache.free_slots) == engine.args.max_num_seqs
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests


def test_logprobs_above_the_vocabulary_are_refused_at_admission(model32):
    llm = LLM(model32, max_model_len=128)
    with pytest.raises(ValueError, match=rf"logprobs must be in \[0, {VOCAB}\] \(the vocabulary size\) or None, "
                                         rf"got {VOCAB + 1}"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3,
                                                                      logprobs=VOCAB + 1))
    assert_clean(llm)
    whole = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=2,
                                                                          logprobs=VOCAB))[0].outputs[0]
    assert [len(entry) for entry in whole.logprobs] == [VOCAB, VOCAB]  # the chosen token is among the top VOCAB
    assert tokens(llm) == tokens(LLM(model32, max_model_len=128))


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failing_step_aborts_the_call_and_the_llm_stays_usable(model64, monkeypatch, error):
    llm = LLM(model64, max_model_len=128)
    decode = llm.engine.runner.decode
    calls = []

    def fails_once(seqs):
        calls.append(len(seqs))
        if len(calls) == 2:  # the prompts are in their pages and decoding has begun
            raise error("boom")
        return decode(seqs)

    monkeypatch.setattr(llm.engine.runner, "decode", fails_once)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:20]}]
    with pytest.raises(error, match="boom"):
        llm.generate(prompts, GREEDY)
    assert_clean(llm)
    fresh = LLM(model64, max_model_len=128)
    assert tokens(llm) == tokens(fresh) and tokens(llm, PROMPT[:20]) == tokens(fresh, PROMPT[:20])
    assert_clean(llm)


def test_a_prompt_refused_at_admission_leaves_nothing_queued(model32):
    llm = LLM(model32, max_model_len=128)
    with pytest.raises(ValueError, match=rf"prompt token ids must be in \[0, {VOCAB}\) \(the vocabulary\), got "
                                         rf"{VOCAB + 88} at position 1"):
        llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": [4, VOCAB + 88]}], GREEDY)
    assert_clean(llm)
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 512\) \(the vocabulary\), got -1"):
        llm.generate({"prompt_token_ids": [-1]}, GREEDY)


@pytest.mark.parametrize("ids, shown", [
    ([1.5], r"prompt_token_ids\[0\] is float 1.5"),
    ([3, True, False], r"prompt_token_ids\[1\] is bool True"),
    ([3, np.float32(2.0)], r"prompt_token_ids\[1\] is float32 np.float32\(2.0\)"),
    ([3, 4, torch.tensor(2.0)], r"prompt_token_ids\[2\] is Tensor tensor\(2.\)"),
    ([np.bool_(True)], r"prompt_token_ids\[0\] is bool"),
    (["7"], r"prompt_token_ids\[0\] is str '7'"),
])
def test_prompt_token_ids_must_be_integers(model32, ids, shown):
    llm = LLM(model32, max_model_len=128)
    with pytest.raises(ValueError, match=shown + r".*integers in \[0, 512\)"):
        llm.generate({"prompt_token_ids": ids}, GREEDY)
    with pytest.raises(ValueError, match=r"prompt_token_ids must be a list of integers in \[0, 512\), got str 'abc'"):
        llm.generate({"prompt_token_ids": "abc"}, GREEDY)
    assert_clean(llm)


def test_numpy_and_torch_integer_ids_are_taken_as_ints(model32):
    llm = LLM(model32, max_model_len=128)
    reference = tokens(llm)
    assert tokens(llm, [np.int64(t) for t in PROMPT]) == reference
    assert tokens(llm, np.array(PROMPT, dtype=np.int32)) == reference
    assert tokens(llm, torch.tensor(PROMPT)) == reference
    assert tokens(llm, [torch.tensor(t, dtype=torch.int16) for t in PROMPT]) == reference


@pytest.mark.parametrize("salt", ["", 7, b"salt"])
def test_cache_salt_must_be_a_non_empty_string(model32, salt):
    llm = LLM(model32, max_model_len=128)
    with pytest.raises(ValueError, match="cache_salt must be None or a non-empty string, got "):
        llm.generate({"prompt_token_ids": PROMPT, "cache_salt": salt}, GREEDY)
    assert_clean(llm)
    assert tokens(llm) == llm.generate({"prompt_token_ids": PROMPT, "cache_salt": "a"}, GREEDY)[0].outputs[0].token_ids


@pytest.mark.parametrize("setting", [{"speculative_max_len": 2}, {"speculative_cost_table": "fixed"},
                                     {"speculative_cost_table": [1.0, 1.1, 1.2]}])
def test_speculative_settings_need_speculative(model32, setting):
    name = next(iter(setting))
    with pytest.raises(ValueError, match=f"{name} needs speculative='dspark'"):
        LLM(model32, max_model_len=128, **setting)


def test_an_explicit_pool_must_hold_one_sequence_of_max_model_len(model32):
    # 24 pages of 16 tokens = 384 tokens; the default max_model_len (8192, the fixture's max_position_embeddings)
    # needs 512 pages.
    with pytest.raises(ValueError, match=r"the KV pool \(num_kv_pages=24, 384 tokens\) cannot hold one sequence of "
                                         r"max_model_len=8192 tokens: that needs 512 pages of 16 tokens "
                                         r"\(num_kv_pages >= 512 or kv_cache_memory_bytes >= \d+\); raise the pool "
                                         r"or set max_model_len <= 384"):
        LLM(model32, num_kv_pages=24)
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=100: 0 pages of \d+ bytes, 0 tokens.*needs 8 pages"
                                         r".*; raise the pool$"):
        LLM(model32, kv_cache_memory_bytes=100, max_model_len=128)
    with pytest.raises(ValueError, match=r"num_kv_pages=0"):
        LLM(model32, num_kv_pages=0, max_model_len=128)
    page_bytes = LLM(model32, max_model_len=64, num_kv_pages=4).engine.cache.global_bytes // 5
    assert LLM(model32, max_model_len=64, kv_cache_memory_bytes=4 * page_bytes).stats["kv_pages_total"] == 4
    with pytest.raises(ValueError, match="needs 4 pages"):
        LLM(model32, max_model_len=64, kv_cache_memory_bytes=4 * page_bytes - 1)
    # A pool of exactly one sequence: an output runs to max_model_len, not cut short by the pool.
    fits = LLM(model32, max_model_len=64, num_kv_pages=4)
    out = fits.generate({"prompt_token_ids": PROMPT[:10]}, SamplingParams(temperature=0, max_tokens=None,
                                                                         ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 54 and out.finish_reason == "length"


def test_the_default_pool_holds_one_sequence_of_max_model_len_past_its_cap(model32, monkeypatch):
    page_bytes = LLM(model32, max_model_len=64, num_kv_pages=4).engine.cache.global_bytes // 5
    monkeypatch.setattr(kv_cache_manager, "DEFAULT_KV_POOL_BYTES", 3 * page_bytes)
    assert LLM(model32, max_model_len=32, max_num_seqs=4).stats["kv_pages_total"] == 3  # the cap: 3 of 8 pages
    llm = LLM(model32, max_model_len=128, max_num_seqs=4)  # one sequence needs 8 pages, over the cap
    assert llm.stats["kv_pages_total"] == 8
    out = llm.generate({"prompt_token_ids": PROMPT[:10]}, SamplingParams(temperature=0, max_tokens=None,
                                                                        ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 118 and out.finish_reason == "length"
