"""The default backend: xgrammar (``TokenizerInfo``, ``GrammarCompiler``, ``GrammarMatcher``).

JSON schemas compile with no properties beyond the schema's (xgrammar's ``strict_mode``, as vLLM) and, unless
``any_whitespace``, with ``json.dumps``' separators and no other whitespace. Choices compile to an EBNF
alternation of string literals.
:func:`unsupported_json_features` lists the schema keywords xgrammar does not enforce (it compiles them but drops
them, or in the case of string length bounds, compiles wrongly); the manager sends such schemas to llguidance, as
vLLM's ``auto`` backend does (llguidance enforces string lengths and refuses the rest: such a schema is refused
rather than silently not enforced).

Source: xgrammar's Python API (``xgrammar/compiler.py``, ``matcher.py``); vLLM
``vllm/v1/structured_output/backend_xgrammar.py`` (behaviour only).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from torch import Tensor

from deepseek_v41.structured.backend import GrammarMatcher, StructuredOutputBackend, Vocabulary

# String formats xgrammar's JSON-schema converter turns into grammar rules; any other "format" is dropped by it.
XGRAMMAR_STRING_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri", "uri-reference",
    "uri-template", "json-pointer", "relative-json-pointer"})
# Keywords xgrammar 0.2.9 compiles without enforcing (checked: a violating instance is accepted).
XGRAMMAR_DROPPED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains", "not", "dependentRequired",
                             "dependentSchemas", "dependencies")
# Keywords whose value maps names to subschemas (the names are not keywords).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("enum", "const", "default", "examples", "required", "dependentRequired")  # values, not schemas


def unsupported_json_features(schema: Any) -> list[str]:
    """The keywords of a JSON schema (walked through every nested schema) that xgrammar 0.2.9 does not enforce
    correctly: those of ``XGRAMMAR_DROPPED_KEYWORDS`` (dropped), a string ``format`` it does not know (dropped),
    and ``minLength`` / ``maxLength`` (dropped beside a ``pattern`` or ``format``; alone, the bounded string lets
    raw control characters through, which is not JSON, and refuses escapes). Sorted, de-duplicated; [] when
    xgrammar enforces the whole schema."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        found.update(k for k in XGRAMMAR_DROPPED_KEYWORDS if k in node)
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt not in XGRAMMAR_STRING_FORMATS:
            found.add(f"format={fmt}")
        if "minLength" in node or "maxLength" in node:
            found.add("minLength/maxLength")
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                for subschema in value.values():
                    walk(subschema)
            elif key not in _DATA:
                walk(value)

    walk(schema)
    return sorted(found)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``: ``root ::= "a" | "b"`` with JSON-escaped literals
    (xgrammar's string literals take the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XgrammarBackend(StructuredOutputBackend):
    """xgrammar for one vocabulary. Its own compile cache is off: the manager's LRU caches compiled grammars.

    Args:
        vocab: the model's :class:`Vocabulary` (special tokens and ids the tokenizer lacks are never allowed).
        any_whitespace: JSON may have any whitespace between its tokens (vLLM's default); False: ``", "`` and
            ``": "`` only.
    """

    name = "xgrammar"

    def __init__(self, vocab: Vocabulary, any_whitespace: bool = False):
        self.any_whitespace = any_whitespace
        import xgrammar as xgr

        self._xgr = xgr
        encoded = [b"" if t is None else t for t in vocab.token_bytes]  # "" = special to xgrammar
        self.stop_token_ids = [vocab.eos_token_id] if vocab.eos_token_id is not None else []
        info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab.vocab_size,
                                 stop_token_ids=self.stop_token_ids or None, add_prefix_space=False)
        self.compiler = xgr.GrammarCompiler(info, max_threads=max(1, min(8, os.cpu_count() or 1)),
                                            cache_enabled=False)

    def compile(self, kind: str, spec: str) -> Any:
        c = self.compiler
        try:
            if kind == "json":
                return c.compile_json_schema(spec, any_whitespace=self.any_whitespace, strict_mode=True)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=self.any_whitespace,
                                             strict_mode=True)
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(json.loads(spec)))
            if kind == "grammar":
                return c.compile_grammar(spec)
            if kind == "structural_tag":
                return c.compile_structural_tag(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"xgrammar cannot compile this {kind}: {_message(exc)}") from exc
        raise ValueError(f"unknown structured output kind {kind!r}")

    def matcher(self, compiled: Any) -> XgrammarMatcher:
        return XgrammarMatcher(self._xgr.GrammarMatcher(compiled, terminate_without_stop_token=not self.stop_token_ids),
                               frozenset(self.stop_token_ids))


class XgrammarMatcher(GrammarMatcher):
    """An ``xgrammar.GrammarMatcher``: a pushdown automaton with unlimited rollback."""

    def __init__(self, matcher, stop_token_ids: frozenset[int]):
        self._matcher = matcher
        self.stop_token_ids = stop_token_ids

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


def _message(exc: BaseException) -> str:
    """xgrammar's error text without its log prefix ("[18:46:57] /project/cpp/regex_converter.cc:94: ")."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", text)
