"""The engine's side of constrained decoding: backend choice, the compiled-grammar cache, and masking logits.

Backend choice (``backend="auto"``, vLLM's default): xgrammar, unless the constraint is a JSON schema using
keywords xgrammar does not enforce (:func:`~deepseek_v41.structured.xgrammar_backend.unsupported_json_features`)
or xgrammar refuses to compile it; then llguidance. ``"xgrammar"`` or ``"guidance"`` use that backend only.
``structural_tag`` is xgrammar's format and always goes to xgrammar.

Compiled grammars are kept in an LRU of ``cache_size`` entries keyed by (kind, spec): a repeated schema is
compiled once. Only grammars that compiled are cached; a constraint no backend compiles raises ValueError.

Masking: :meth:`StructuredOutputManager.mask_logits` fills one bitmask row per constrained row and sets the
disallowed logits to -inf; :func:`mask_draft_positions` does it for the positions of one speculative verify.

Source: vLLM ``vllm/v1/structured_output/__init__.py`` (``StructuredOutputManager``), behaviour only.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from deepseek_v41.structured.backend import GrammarMatcher, StructuredOutputBackend, Vocabulary
from deepseek_v41.structured.bitmask import allocate_token_bitmask, apply_token_bitmask, token_allowed

if TYPE_CHECKING:
    from deepseek_v41.structured.params import StructuredOutputsParams

log = logging.getLogger(__name__)

BACKENDS = ("auto", "xgrammar", "guidance")
DEFAULT_CACHE_SIZE = 64  # compiled grammars kept (a JSON schema's grammar over a 129K vocabulary: ~1-10 MB)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Engine-wide structured-output settings (vLLM's ``StructuredOutputsConfig`` names).

    ``backend``: ``"auto"`` (xgrammar, llguidance as the fallback), ``"xgrammar"`` or ``"guidance"``.
    ``disable_any_whitespace``: JSON (schemas, ``json_object``) gets ``json.dumps``' separators and no other
    whitespace. Default True, unlike vLLM's False: small models (the bundled one) given free whitespace emit
    whitespace until max_tokens, and the whitespace of a JSON value carries no meaning.

    Raises:
        ValueError: an unknown backend or a non-bool ``disable_any_whitespace``.
    """

    backend: str = "auto"
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"structured_outputs_config backend must be one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs_config disable_any_whitespace must be true or false, got "
                             f"{self.disable_any_whitespace!r}")

    @classmethod
    def of(cls, value: StructuredOutputsConfig | Mapping[str, Any] | None) -> StructuredOutputsConfig:
        """The config of an engine argument: None (defaults), a dict of these fields or a config. Raises
        ValueError for an unknown key (naming the known ones) or value."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if not isinstance(value, Mapping):
            raise ValueError(f"structured_outputs_config must be a dict or None, got {type(value).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"structured_outputs_config has unknown keys {unknown}; known: {known}")
        return cls(**value)


class CompiledGrammar(NamedTuple):
    """A constraint compiled by one backend: ``backend`` (its name) and the backend's own ``handle``."""

    backend: str
    handle: Any


class StructuredOutputManager:
    """Compiles constraints (cached), makes per-sequence matchers and masks logits.

    Args:
        tokenizer: the model's ``tokenizers.Tokenizer`` (byte-level BPE).
        vocab_size: the model's vocabulary size V (the logits' width).
        eos_token_id: the stop token a finished grammar allows (None: the grammar ends without one).
        config: a :class:`StructuredOutputsConfig` or its dict (None: the defaults).
        cache_size: compiled grammars kept (LRU), at least 1.

    Raises:
        ValueError: a bad config, a cache size below 1, or a tokenizer that is not byte-level BPE.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None,
                 config: StructuredOutputsConfig | Mapping[str, Any] | None = None,
                 cache_size: int = DEFAULT_CACHE_SIZE):
        self.config = StructuredOutputsConfig.of(config)
        if not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"cache_size must be a positive integer, got {cache_size!r}")
        self.vocab = Vocabulary.from_tokenizer(tokenizer, vocab_size, eos_token_id)
        self.backend = self.config.backend
        self.cache_size = cache_size
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self.num_compiled = 0  # grammars compiled (cache misses that compiled)
        self.num_cache_hits = 0

    def _backend(self, name: str) -> StructuredOutputBackend:
        backend = self._backends.get(name)
        if backend is None:
            if name == "xgrammar":
                from deepseek_v41.structured.xgrammar_backend import XgrammarBackend

                backend = XgrammarBackend(self.vocab, not self.config.disable_any_whitespace)
            else:
                from deepseek_v41.structured.guidance_backend import GuidanceBackend

                backend = GuidanceBackend(self.vocab, not self.config.disable_any_whitespace)
            self._backends[name] = backend
        return backend

    def _order(self, kind: str, spec: str) -> tuple[list[str], list[str]]:
        """Backends to try, in order, for one constraint, and why xgrammar was skipped (if it was)."""
        if self.backend != "auto":
            return [self.backend], []
        if kind == "structural_tag":
            return ["xgrammar"], []
        if kind == "json":
            from deepseek_v41.structured.xgrammar_backend import unsupported_json_features

            dropped = unsupported_json_features(json.loads(spec))
            if dropped:
                log.info("JSON schema uses %s, which xgrammar does not enforce: compiled by llguidance", dropped)
                return ["guidance"], [f"xgrammar does not enforce {', '.join(dropped)}"]
        return ["xgrammar", "guidance"], []

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``params`` (from the cache when compiled before).

        Raises:
            ValueError: no backend compiles it; the message names the kind and each backend's reason.
        """
        key = (params.kind, params.spec)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
            return hit
        order, reasons = self._order(*key)
        for name in order:
            try:
                compiled = CompiledGrammar(name, self._backend(name).compile(*key))
                break
            except ValueError as exc:
                reasons.append(str(exc))
        else:
            raise ValueError(f"structured_outputs.{params.kind} is not a valid constraint: {'; '.join(reasons)}")
        self.num_compiled += 1
        self._cache[key] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher of ``compiled`` for one sequence."""
        return self._backend(compiled.backend).matcher(compiled.handle)

    @property
    def cached(self) -> list[tuple[str, str]]:
        """The (kind, spec) keys in the cache, least recently used first."""
        return list(self._cache)

    def mask_logits(self, logits: Tensor, matchers: Sequence[GrammarMatcher | None]) -> None:
        """Mask ``logits`` [B, V] in place: row i keeps only the tokens ``matchers[i]`` allows next (rows whose
        matcher is None are left alone)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = allocate_token_bitmask(len(rows), logits.shape[1])
        for j, i in enumerate(rows):
            matchers[i].fill_bitmask(bitmask, j)
        if len(rows) == logits.shape[0]:
            apply_token_bitmask(logits, bitmask)
        else:
            index = torch.tensor(rows, device=logits.device)
            masked = logits.index_select(0, index)
            apply_token_bitmask(masked, bitmask)
            logits.index_copy_(0, index, masked)


def mask_draft_positions(logits: Tensor, matcher: GrammarMatcher, drafts: Sequence[int]) -> tuple[int, int]:
    """Mask the verify logits of one speculative step, walking ``matcher`` over the drafts.

    Position i (``logits[i]``: the target's distribution after the anchor and ``drafts[:i]``) is masked with the
    matcher's state after accepting ``drafts[:i]``, so verification (greedy or lossless speculative sampling)
    sees exactly the distribution non-speculative constrained decoding samples from. The walk ends at the first
    draft the grammar refuses (it is still verified: the target gives it probability 0, so it is rejected and the
    token comes from the residual, as the lossless rule needs; nothing after it can be reached) or after a draft
    that terminates the grammar (its stop token: the output ends there).

    Args:
        logits: [ℓ+1, V] float, masked in place (rows that cannot be reached are left as they are).
        matcher: the sequence's matcher, at the state after its last emitted token.
        drafts: the ℓ drafts of this step.

    Returns:
        (verified, walked): the drafts worth verifying (``drafts[:verified]``, rows ``0..verified`` meaningful) and
        the drafts the matcher accepted (``walked <= verified``); after verification the caller rolls back
        ``walked - accepted``.
    """
    n = len(drafts)
    bitmask = allocate_token_bitmask(n + 1, logits.shape[1])
    walked, verified, filled = 0, n, 0
    for i in range(n + 1):
        matcher.fill_bitmask(bitmask, i)
        filled = i + 1
        if i == n:
            break
        d = drafts[i]
        if not token_allowed(bitmask, i, d) or not matcher.accept_token(d):
            verified = i + 1
            break
        walked += 1
        if matcher.is_terminated():
            verified = i + 1
            break
    apply_token_bitmask(logits[:filled], bitmask[:filled])
    return verified, walked
