"""Constrained decoding (structured outputs): the output of a request matches a JSON schema, a regex, one of a
list of strings, an EBNF grammar, any JSON object, or an xgrammar structural tag.

Per decode step, each constrained row's matcher writes the tokens its grammar allows next into an int32 token
bitmask; the engine sets every other logit to -inf before penalties, temperature and top-k/top-p/min-p, samples,
and advances the matcher by the sampled token. A matcher that accepted the stop token (EOS, allowed only once the
grammar is complete) finishes the request. Speculative decoding masks each verified position with the matcher's
state after the drafts before it and rolls the rejected drafts back.

Backends (vLLM's names): xgrammar (default) and llguidance (``"guidance"``, the fallback for schemas xgrammar
rejects or does not enforce). Modules: :mod:`.backend` (the interface and the vocabulary), :mod:`.xgrammar_backend`,
:mod:`.guidance_backend`, :mod:`.bitmask`, :mod:`.manager` (choice of backend, compiled-grammar LRU, masking),
:mod:`.dsml_grammar` (V4.1's DSML tool-call block and the thinking prefix as xgrammar structural tags, built from
a request's ``tools``; the server's ``tool_choice`` and ``response_format`` use it), :mod:`.tool_choice`
(``tool_choice`` -> mode and grammar, for the server and ``LLM.chat``), :mod:`.schema_check` (a JSON-schema validator
that knows no grammar: the tests' oracle and ``dsv41 eval-chat``'s check of tool arguments).

Source: vLLM ``vllm/v1/structured_output/`` (behaviour and names); xgrammar and llguidance's Python APIs.
"""

from deepseek_v41.structured.backend import KINDS, GrammarMatcher, StructuredOutputBackend, Vocabulary
from deepseek_v41.structured.bitmask import allocate_token_bitmask, apply_token_bitmask
from deepseek_v41.structured.manager import (
    BACKENDS,
    CompiledGrammar,
    StructuredOutputManager,
    StructuredOutputsConfig,
    mask_draft_positions,
)

__all__ = ["BACKENDS", "KINDS", "CompiledGrammar", "GrammarMatcher", "StructuredOutputBackend",
           "StructuredOutputManager", "StructuredOutputsConfig", "Vocabulary", "allocate_token_bitmask",
           "apply_token_bitmask", "mask_draft_positions"]
