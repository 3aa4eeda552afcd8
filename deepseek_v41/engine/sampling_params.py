"""``SamplingParams``: what one request asks of the sampler and of the stop checks, shaped like vLLM's.

Field names, defaults, ranges and error messages follow vLLM's ``SamplingParams`` (``vllm/sampling_params.py``),
so a user's vLLM call works here unchanged for the fields we support. Validation happens once, in
``__post_init__``, and raises ``ValueError`` naming the field, the allowed range and the value received.

Normalisation done at construction (as vLLM does): ``stop`` becomes a list of strings, ``stop_token_ids`` a list
of unique ints, ``top_k=-1`` becomes 0 (off), ``seed=-1`` becomes None.

Differences from vLLM: each stop string is at most ``MAX_STOP_STRING_CHARS`` (1024) characters; no upper bound on
``temperature`` (recent vLLM refuses > 2, the OpenAI range; the reference sampler takes any T), and temperatures in
(0, 0.01) are used as given rather than raised to 0.01: the sampler subtracts the row maximum inside ``softmax``,
so small T cannot overflow.

Source: SPEC.md §4.4; MODEL_REFERENCE.md §7 (greedy when T = 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from deepseek_v41.structured.params import STRUCTURED_OUTPUT_KINDS, StructuredOutputsParams  # noqa: F401

# Below this temperature a request is greedy (vLLM's ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5
# Longest stop string, in characters. Stop strings in use are words or short markers; the limit bounds the matcher's
# memory (linear in the stop strings' total length, a few hundred bytes per character) for every sequence.
MAX_STOP_STRING_CHARS = 1024


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request (vLLM names and defaults).

    Raises:
        ValueError: a field outside its allowed range; the message names the field and the range.
    """

    n: int = 1  # outputs per prompt; each child gets its own generator
    temperature: float = 1.0  # logits / T before softmax; < 1e-5 means greedy (argmax)
    top_p: float = 1.0  # keep the smallest most-likely set with mass >= top_p; in (0, 1], 1 = off
    top_k: int = 0  # keep the k most likely tokens (ties at the k-th logit kept); 0 or -1 = off
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob; in [0, 1], 0 = off
    seed: int | None = None  # seeds the request's own generator; None = a fresh random seed per request
    presence_penalty: float = 0.0  # subtracted once from the logit of every token present in the output; [-2, 2]
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output; [-2, 2]
    repetition_penalty: float = 1.0  # > 0; tokens seen in prompt or output: positive logits / r, negative * r
    stop: str | list[str] | None = None  # stop strings (<= MAX_STOP_STRING_CHARS each); the text ends before the first
    stop_token_ids: list[int] | None = None  # token ids that end the output (the token is kept in the ids)
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token text) in the output text
    ignore_eos: bool = False  # EOS is an ordinary token: it neither stops nor is masked by min_tokens
    max_tokens: int | None = 16  # generated tokens at most; None = up to the engine's max_model_len
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated
    logprobs: int | None = None  # top-N logprobs per generated token (plus the chosen token's); None = none
    skip_special_tokens: bool = True  # leave special tokens out of the output text
    # vLLM's flag for slow (Python) tokenizers, which join the text around added tokens with spaces. This project
    # decodes with a fast ``tokenizers`` tokenizer, which never inserts such spaces, so the text is the same for
    # both values (as in vLLM with a fast tokenizer): false is honoured exactly, true is vLLM's fast-tokenizer output.
    spaces_between_special_tokens: bool = True
    # Constrained decoding (vLLM's name): the output must match this schema / regex / choice / grammar / structural
    # tag; None = free text. The engine masks every token the constraint does not allow (deepseek_v41.structured).
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's extra_args: JSON values for the engine's plugins; here ``{"kv_transfer_params": {...}}`` of a
    # disaggregated request (deepseek_v41.disagg.config: {"do_remote_decode": true} = prefill only).
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(dict.fromkeys(self.stop_token_ids))
        if self.seed == -1:
            self.seed = None
        self._verify()
        if self.top_k == -1:
            self.top_k = 0

    def _verify(self) -> None:
        for name, optional in (("n", False), ("top_k", False), ("max_tokens", True), ("min_tokens", False),
                               ("logprobs", True)):
            value = getattr(self, name)
            if (value is not None or not optional) and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer{' or None' if optional else ''}, "
                                 f"got {type(value).__name__} {value!r}.")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be a finite number greater than zero, "
                             f"got {self.repetition_penalty}.")
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be a finite non-negative number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**64), got {self.seed!r}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}.")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            longest = max(len(s) for s in self.stop)
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters long, got one of "
                             f"{longest}.")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must contain only non-negative integers, got {self.stop_token_ids}.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or None, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.is_greedy and self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")

    @property
    def is_greedy(self) -> bool:
        """True when ``temperature < 1e-5``: the sampler takes the argmax and ignores top-k/top-p/min-p."""
        return self.temperature < SAMPLING_EPS

    def min_tokens_stop_ids(self, eos_token_id: int | None) -> list[int]:
        """Token ids masked while fewer than ``min_tokens`` tokens are generated.

        ``stop_token_ids`` plus ``eos_token_id`` unless ``ignore_eos`` (with ``ignore_eos`` EOS is an ordinary
        token, so masking it would only distort the distribution; vLLM masks it anyway).
        """
        ids = list(self.stop_token_ids)
        if eos_token_id is not None and not self.ignore_eos and eos_token_id not in ids:
            ids.append(eos_token_id)
        return ids
