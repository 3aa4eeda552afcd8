"""What every constrained-decoding backend implements, and the vocabulary they read.

A backend compiles a constraint (kind + spec, :data:`KINDS`) into a grammar for one tokenizer, and makes a
:class:`GrammarMatcher` per sequence from it. A matcher follows the tokens a sequence generates and writes the set
of tokens the grammar allows next into one row of an int32 token bitmask ``[rows, ceil(V / 32)]`` (bit ``t % 32`` of
word ``t // 32`` set = token t allowed; xgrammar's and llguidance's shared layout), which
:func:`deepseek_v41.structured.bitmask.apply_token_bitmask` turns into -inf logits.

Source: vLLM ``vllm/v1/structured_output/backend_types.py`` (the interface's shape and names).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

# The constraint kinds, as the fields of StructuredOutputsParams name them.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class GrammarMatcher(ABC):
    """One sequence's state in its grammar: which tokens may come next, given the tokens accepted so far.

    ``stop_token_ids``: the tokens that end the output once the grammar is complete (the model's EOS); accepting
    one terminates the matcher.
    """

    stop_token_ids: frozenset[int] = frozenset()

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one generated token; False (state unchanged) when the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32 [R, ceil(V / 32)], CPU, contiguous)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding's rejected drafts)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted after a complete grammar: nothing may follow."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer and makes matchers of the compiled grammars.

    ``name``: the backend's vLLM name (``"xgrammar"``, ``"guidance"``).
    """

    name: ClassVar[str]

    @abstractmethod
    def compile(self, kind: str, spec: str) -> Any:
        """The compiled grammar of a constraint (``kind`` in :data:`KINDS`, ``spec`` its text as
        :attr:`StructuredOutputsParams.spec` gives it). Raises ValueError naming what the backend refused."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""


@dataclass(frozen=True)
class Vocabulary:
    """The model's vocabulary as the grammar engines read it.

    Attributes:
        token_bytes: per token id in ``[0, vocab_size)``, the bytes the token adds to the text, or None for a
            special token (never allowed by a grammar except as a stop token) or an id the tokenizer lacks.
        vocab_size: the model's vocabulary size V (the logits' width; may exceed the tokenizer's).
        eos_token_id: the model's EOS (the grammars' stop token), or None.
        tokenizer_json: the tokenizer serialised (``tokenizers.Tokenizer.to_str()``), for llguidance.
    """

    token_bytes: tuple[bytes | None, ...]
    vocab_size: int
    eos_token_id: int | None
    tokenizer_json: str

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, eos_token_id: int | None) -> Vocabulary:
        """Read a ``tokenizers.Tokenizer`` whose decoder is byte-level BPE (DeepSeek's): each vocabulary entry is
        mapped back through the byte-to-unicode alphabet; added tokens give their text (special ones None).

        Raises ValueError for another decoder (e.g. SentencePiece's byte fallback) or a token id >= vocab_size.
        """
        tokenizer_json = tokenizer.to_str()
        decoder = json.loads(tokenizer_json).get("decoder") or {}
        types = {d.get("type") for d in decoder.get("decoders", [decoder])}
        if "ByteLevel" not in types:
            raise ValueError(f"structured outputs need a byte-level BPE tokenizer (a ByteLevel decoder, as "
                             f"DeepSeek's); this tokenizer's decoder is {sorted(t for t in types if t) or 'none'}")
        alphabet = _byte_level_alphabet()
        tokens: list[bytes | None] = [None] * vocab_size
        for text, token_id in tokenizer.get_vocab(with_added_tokens=False).items():
            _check_id(token_id, vocab_size)
            if all(c in alphabet for c in text):
                tokens[token_id] = bytes(alphabet[c] for c in text)
            else:
                tokens[token_id] = text.encode("utf-8")
        for token_id, added in tokenizer.get_added_tokens_decoder().items():
            _check_id(token_id, vocab_size)
            tokens[token_id] = None if added.special else added.content.encode("utf-8")
        return cls(tuple(tokens), vocab_size, eos_token_id, tokenizer_json)


def _check_id(token_id: int, vocab_size: int) -> None:
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"the tokenizer has token id {token_id}, outside the model's vocabulary [0, {vocab_size})")


def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of byte-level BPE (GPT-2's ``bytes_to_unicode``): printable Latin-1 bytes stand for
    themselves, the other 68 bytes for the code points from 256 up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    char_of = {b: chr(b) for b in printable}
    for b in range(256):
        if b not in char_of:
            char_of[b] = chr(256 + len(char_of) - len(printable))
    return {c: b for b, c in char_of.items()}
