"""``StructuredOutputsParams``: what a request's output must match (vLLM's names), checked once at construction.

``SamplingParams(structured_outputs=...)`` carries it (:mod:`deepseek_v41.engine.sampling_params` re-exports it);
it lives here, below the engine, so that the grammar manager can name it.

Source: vLLM ``vllm/sampling_params.py`` (``StructuredOutputsParams``); issue 26.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """What a request's output must match (vLLM's ``StructuredOutputsParams``); exactly one field is set.

    ``json``: a JSON schema (a dict or its JSON text); the output is one JSON value valid under it.
    ``regex``: a regular expression the whole output matches. ``choice``: the output is exactly one of these
    strings. ``grammar``: an EBNF grammar (xgrammar's dialect, GBNF-like, with a ``root`` rule).
    ``json_object``: True = any JSON object. ``structural_tag``: a JSON string in xgrammar's structural-tag format
    (what ``xgrammar.Grammar.from_structural_tag`` takes: ``{"type": "structural_tag", "format": ...}``), e.g.
    free text up to ``</think>`` then a JSON schema, or tool calls opened by trigger strings.

    The text is checked here (one field set, the right types, a ``json`` string that parses, a non-empty
    ``choice`` of strings); whether the schema, regex or grammar compiles is checked when the engine takes the
    request (``LLMEngine.add_request`` raises ValueError then, queueing nothing).

    Raises:
        ValueError: none or several fields set, or a field of the wrong type; the message names the fields.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            names = ", ".join(STRUCTURED_OUTPUT_KINDS)
            got = f"got {', '.join(given)}" if given else "got none"
            raise ValueError(f"StructuredOutputsParams needs exactly one of {names} set; {got}")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or JSON text): {exc}") \
                    from exc
            if not isinstance(schema, dict | bool):
                raise ValueError(f"structured_outputs.json must be a JSON object schema, got {type(schema).__name__}")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a dict or a JSON string, got {type(self.json).__name__}")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be True or None, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """The field that is set: one of ``STRUCTURED_OUTPUT_KINDS``."""
        return next(name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one string (a dict schema or the choices as JSON text; ``json_object``: ``"{}"``);
        with :attr:`kind` it keys the compiled-grammar cache."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json_object":
            return "{}"
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
