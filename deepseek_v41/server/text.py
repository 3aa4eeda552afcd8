"""What the server does with request text before the engine sees it: Unicode validity, the byte bound of a
prompt, and tokenization off the event loop.

- :func:`check_unicode`: a lone UTF-16 surrogate anywhere in a request is a 400 naming the field (JSON can spell
  one, ``"\\ud800"``; Python keeps it in a ``str`` that cannot be encoded as UTF-8, so the tokenizer and the JSON
  response would fail on it).
- :func:`check_text_fits`: a prompt text with more UTF-8 bytes than ``max_model_len`` tokens can cover is refused
  before it is tokenized (:func:`max_token_bytes` bounds the bytes one token covers), so a huge body costs neither
  a long tokenization nor the memory of its tokens.
- :func:`encode` / :func:`decode`: ``encode_batch`` / ``decode_batch`` on a worker thread. They run in Rust without
  the GIL (``Tokenizer.encode`` holds it for the whole text), so the event loop keeps serving meanwhile.

Source: issue 22 items 4 and 14.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from pydantic import BaseModel

from deepseek_v41.server.errors import APIError


class TextState(Protocol):
    """What this module reads of the server's state (:class:`deepseek_v41.server.common.ServerState`, which imports
    this module, so it is named here by what it has): the tokenizer, the byte bound of a prompt text (None: no
    bound) and the engine, for its ``max_model_len``."""

    tokenizer: Any
    max_text_bytes: int | None
    engine: Any


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of input text that one token of ``tokenizer`` covers.

    A token covers at most its own string's bytes (for a byte-level vocabulary, whose token strings spell each byte
    as one character of one or two UTF-8 bytes, up to twice as many). A normalizer may shrink text before it is
    split (NFC composes up to three code points into one), so a tokenizer with one gets a factor 4 on top.
    """
    longest = max((len(token.encode("utf-8", "surrogatepass")) for i in range(tokenizer.get_vocab_size(True))
                   if (token := tokenizer.id_to_token(i)) is not None), default=1)
    normalizer = json.loads(tokenizer.to_str()).get("normalizer") or {}
    shrinks = bool(normalizer) and normalizer != {"type": "Sequence", "normalizers": []}
    return max(1, longest) * (4 if shrinks else 1)


def check_text_fits(state: TextState, text: str, param: str) -> None:
    """Refuse, before tokenizing it, a prompt text too long to fit ``max_model_len`` tokens whatever its
    tokenization: more UTF-8 bytes than ``max_model_len`` tokens can cover (400 ``context_length_exceeded``). So a
    huge body costs neither a long tokenization nor the memory of its tokens."""
    limit = state.max_text_bytes
    if limit is None or len(text) * 4 <= limit:  # a character is at most 4 UTF-8 bytes
        return
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise APIError(f"This model's maximum context length is {state.engine.max_model_len} tokens, which cannot "
                       f"cover more than {limit} bytes of text; your prompt text has {size} bytes.", param,
                       "context_length_exceeded")


# Texts longer than this (characters, all of a call's texts together) are tokenized on their own small pool, one
# or a few at a time, so that many large ones (``/tokenize`` needs no key) neither hold every thread of asyncio's
# default pool, where the short prompts of other requests would queue behind them, nor all their tokens' memory at
# once. Before: 10 concurrent 2.5 MB /tokenize made a 5-token chat request wait 32 s and took RSS 0.6 -> 3.3 GB.
LARGE_TEXT_CHARS = 64 * 1024
_large_pool = ThreadPoolExecutor(max(1, (os.cpu_count() or 2) // 2), thread_name_prefix="dsv41-tokenize-large")


async def encode(state: TextState, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Tokenize ``texts`` on a worker thread with the GIL released (``encode_batch`` runs in Rust without it;
    ``encode`` holds it for the whole text), so the event loop keeps answering (``/health``) meanwhile. Large texts
    go to their own pool (:data:`LARGE_TEXT_CHARS`), so short prompts never wait behind them."""
    run = functools.partial(state.tokenizer.encode_batch, texts, add_special_tokens=add_special_tokens)
    if sum(map(len, texts)) > LARGE_TEXT_CHARS:
        encodings = await asyncio.get_running_loop().run_in_executor(_large_pool, run)
    else:
        encodings = await asyncio.to_thread(run)
    return [list(e.ids) for e in encodings]


async def decode(state: TextState, sequences: list[list[int]]) -> list[str]:
    """Detokenize on a worker thread with the GIL released (``decode_batch``), special tokens kept."""
    return await asyncio.to_thread(state.tokenizer.decode_batch, sequences, skip_special_tokens=False)


_SURROGATE = re.compile("[\ud800-\udfff]")


_KEY = object()  # in a location: "the key of the dict just named"
_WALKED = {str, dict, list, tuple}  # exact types that may hold a string (and request models, checked apart)


def _is_number_list(value: Any) -> bool:
    """A validated ``list[int]`` / ``list[list[int]]`` field (token ids): pydantic's strict unions keep such lists
    homogeneous, so one look at the first element tells that no string is inside (and 16M ids are not walked)."""
    if not isinstance(value, list) or not value:
        return False
    first = value[0]
    return type(first) is int or (type(first) is list and bool(first) and type(first[0]) is int)


def _find_surrogate(root: Any) -> tuple[tuple, re.Match] | None:
    """The location (field names, list indices, _KEY) and match of a lone surrogate in ``root``, or None.
    Iterative (a deeply nested body cannot overflow the stack); locations are built only along the way down."""
    stack: list[tuple[Any, tuple]] = [(root, ())]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and (bad := _SURROGATE.search(value)) is not None:
                return where, bad
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and not key.isascii() and (bad := _SURROGATE.search(key)) is not None:
                    return (*where, _KEY), bad
                if type(item) in _WALKED or isinstance(item, BaseModel):
                    stack.append((item, (*where, key)))
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                if type(item) in _WALKED or isinstance(item, BaseModel):
                    stack.append((item, (*where, i)))
        elif isinstance(value, BaseModel):
            for name in type(value).model_fields:
                item = getattr(value, name)
                if not _is_number_list(item):
                    stack.append((item, (*where, name)))
    return None


def _fields(value: Any) -> Any:
    """A request model as the list of its field values (validated token-id lists left out), for ``json.dumps``."""
    if isinstance(value, BaseModel):
        return [item for name in type(value).model_fields if not _is_number_list(item := getattr(value, name))]
    return value


def _location(where: tuple) -> str | None:
    """``("messages", 0, "content")`` -> ``messages[0].content``; a _KEY part -> `` (a key)``."""
    path = ""
    for part in where:
        if part is _KEY:
            path += " (a key)" if path else "a key"
        elif isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or None


def check_unicode(value: Any) -> None:
    """Every string in ``value`` (a request model, dicts, lists; keys included) is valid Unicode; APIError 400
    naming the field otherwise. JSON may spell a lone UTF-16 surrogate (``"\\ud800"``), which decodes to a Python
    string that cannot be encoded as UTF-8, so the tokenizer and the JSON response would fail on it. Linear in the
    request's strings and containers; validated token-id lists are not walked."""
    try:  # the fast path (C): UTF-8 encoding the JSON text fails exactly when a lone surrogate is somewhere
        json.dumps(_fields(value), ensure_ascii=False, check_circular=False, default=_fields).encode("utf-8")
        return
    except (UnicodeEncodeError, TypeError, ValueError, RecursionError):
        pass
    found = _find_surrogate(value)
    if found is not None:
        where, bad = found
        path = _location(where)
        raise APIError(f"{path or 'the request'} contains a lone UTF-16 surrogate (U+{ord(bad.group()):04X}) at "
                       f"character {bad.start()}: text must be valid Unicode (a high surrogate \\ud800-\\udbff "
                       f"must be followed by a low one \\udc00-\\udfff)", path, "invalid_value")
