"""The fallback backend: llguidance (``LLTokenizer``, ``LLMatcher``), for what xgrammar refuses or does not enforce.

llguidance reads the tokenizer itself (its serialised ``tokenizer.json``: no transformers), compiles a grammar
when a matcher is made (the "compiled" grammar cached by the manager is llguidance's grammar text, validated once)
and never raises for a bad grammar or token: the matcher enters an error state, which this wrapper turns into a
ValueError at compile time and a False from :meth:`GuidanceMatcher.accept_token`. ``structural_tag`` is
xgrammar's format and is not read here.

Source: llguidance's Python API (``llguidance/_lib.pyi``, ``_grammar_from.py``); vLLM
``vllm/v1/structured_output/backend_guidance.py`` (behaviour only).
"""

from __future__ import annotations

import json
from typing import Any

from torch import Tensor

from deepseek_v41.structured.backend import GrammarMatcher, StructuredOutputBackend, Vocabulary
from deepseek_v41.structured.xgrammar_backend import choice_grammar


class GuidanceBackend(StructuredOutputBackend):
    """llguidance for one vocabulary.

    Args:
        vocab: the model's :class:`Vocabulary` (its ``tokenizer_json``, ``vocab_size`` and ``eos_token_id``).
        any_whitespace: JSON may have any whitespace between its tokens; False: ``", "`` and ``": "`` only.
    """

    name = "guidance"

    def __init__(self, vocab: Vocabulary, any_whitespace: bool = False):
        self.any_whitespace = any_whitespace
        import llguidance

        self._llg = llguidance
        eos = vocab.eos_token_id
        self.tokenizer = llguidance.LLTokenizer(vocab.tokenizer_json, n_vocab=vocab.vocab_size,
                                                eos_token=eos if eos is not None else None)
        self.stop_token_ids = frozenset([eos] if eos is not None else [])

    def compile(self, kind: str, spec: str) -> str:
        llg = self._llg
        whitespace = ({"whitespace_flexible": True} if self.any_whitespace else
                      {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        try:
            if kind == "json":
                grammar = llg.LLMatcher.grammar_from_json_schema(spec, defaults=whitespace)
            elif kind == "json_object":
                grammar = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=whitespace)
            elif kind == "regex":
                grammar = llg.grammar_from("regex", spec)
            elif kind == "choice":
                grammar = llg.grammar_from("grammar", choice_grammar(json.loads(spec)))
            elif kind == "grammar":
                grammar = llg.grammar_from("grammar", spec)
            else:
                raise ValueError(f"llguidance does not read {kind}")
        except (ValueError, TypeError) as exc:
            raise ValueError(f"llguidance cannot compile this {kind}: {' '.join(str(exc).split())}") from exc
        error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"llguidance cannot compile this {kind}: {' '.join(error.split())}")
        return grammar

    def matcher(self, compiled: Any) -> GuidanceMatcher:
        matcher = self._llg.LLMatcher(self.tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise ValueError(f"llguidance cannot start this grammar: {matcher.get_error()}")
        return GuidanceMatcher(matcher, self.stop_token_ids)


class GuidanceMatcher(GrammarMatcher):
    """An ``llguidance.LLMatcher``. Stop tokens are not fed to it: llguidance does not count an EOS taken in its
    stopped state as a token (a rollback over it would undo a real token), so termination is kept here: a stop
    token is accepted when the grammar is complete, and rolling it back only clears the flag."""

    def __init__(self, matcher, stop_token_ids: frozenset[int]):
        self._matcher = matcher
        self.stop_token_ids = stop_token_ids
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self.stop_token_ids:
            self._terminated = self._matcher.is_accepting()
            return self._terminated
        # A token the grammar refuses would put the matcher in its error state for good: check first.
        return self._matcher.validate_tokens([token_id]) == 1 and self._matcher.consume_token(token_id)

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        target = bitmask[row]
        if not (bitmask.device.type == "cpu" and target.is_contiguous() and bitmask.dtype.itemsize == 4):
            raise ValueError("the token bitmask must be a contiguous int32 CPU tensor")
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise ValueError(f"llguidance cannot roll back {num_tokens} tokens: {self._matcher.get_error()}")

    def is_terminated(self) -> bool:
        return self._terminated
