"""SamplingParams: vLLM defaults, normalisation and validation messages that name the field and its range."""

import pytest

from deepseek_v41.engine.sampling_params import SAMPLING_EPS, SamplingParams


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids, p.include_stop_str_in_output, p.ignore_eos) == ([], [], False, False)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.skip_special_tokens) == (16, 0, None, True)
    assert not p.is_greedy


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[5, 7, 5], top_k=-1, seed=-1)
    assert p.stop == ["###"]
    assert p.stop_token_ids == [5, 7]
    assert p.top_k == 0
    assert p.seed is None
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop="x" * 1024).stop == ["x" * 1024]  # the longest allowed
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_greedy_threshold():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=SAMPLING_EPS / 2).is_greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).is_greedy


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n": 0}, r"n must be at least 1, got 0"),
    ({"n": 2.0}, r"n must be an integer, got float"),
    ({"temperature": -0.1}, r"temperature must be a finite non-negative number, got -0.1"),
    ({"temperature": float("nan")}, r"temperature must be a finite non-negative number, got nan"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"top_k": -2}, r"top_k must be 0 \(disable\), or at least 1, got -2"),
    ({"top_k": 1.5}, r"top_k must be an integer, got float"),
    ({"min_p": 1.1}, r"min_p must be in \[0, 1\], got 1.1"),
    ({"min_p": -0.1}, r"min_p must be in \[0, 1\], got -0.1"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\], got -3"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be a finite number greater than zero, got 0.0"),
    ({"max_tokens": 0}, r"max_tokens must be at least 1, got 0"),
    ({"max_tokens": 2.5}, r"max_tokens must be an integer or None, got float"),
    ({"min_tokens": -1}, r"min_tokens must be greater than or equal to 0, got -1"),
    ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens must be less than or equal to max_tokens=4, got 5"),
    ({"logprobs": -1}, r"logprobs must be non-negative, got -1"),
    ({"stop": ["ok", ""]}, r"stop cannot contain an empty string"),
    ({"stop": [3]}, r"stop must be a string or a list of strings"),
    ({"stop": ["ok", "x" * 1025]}, r"stop strings must be at most 1024 characters long, got one of 1025"),
    ({"stop_token_ids": [1, -4]}, r"stop_token_ids must contain only non-negative integers"),
    ({"seed": 2**64}, r"seed must be None or an integer in \[-2\*\*63, 2\*\*64\)"),
    ({"n": 2, "temperature": 0.0}, r"n must be 1 when using greedy sampling, got 2"),
])
def test_validation_messages(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_min_tokens_stop_ids():
    p = SamplingParams(stop_token_ids=[7, 9])
    assert p.min_tokens_stop_ids(1) == [7, 9, 1]
    assert p.min_tokens_stop_ids(None) == [7, 9]
    assert p.min_tokens_stop_ids(7) == [7, 9]
    # With ignore_eos, EOS is an ordinary token: min_tokens does not mask it.
    assert SamplingParams(stop_token_ids=[7], ignore_eos=True).min_tokens_stop_ids(1) == [7]
