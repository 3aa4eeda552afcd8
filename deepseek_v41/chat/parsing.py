"""``parse_output``: a whole completion -> one OpenAI assistant message (CHAT_FORMAT.md §4).

It runs the streaming state machine over the full text, so a streamed response, concatenated, is always
the non-streamed one. On a well-formed completion the result is the official strict parser's; on anything
else the tolerant rules of §4 / §5 apply and nothing is raised.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .streaming import Delta, StreamingParser


def merge_deltas(deltas: Iterable[Delta]) -> dict[str, Any]:
    """Concatenate StreamingParser deltas into one message.

    Returns ``{"content": str, "reasoning_content": str, "tool_calls": [{"id", "type": "function",
    "function": {"name", "arguments"}}, ...]}`` with calls in index order and each call's argument pieces
    joined; empty strings where nothing was produced.
    """
    message: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": []}
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        message["content"] += delta.get("content", "")
        message["reasoning_content"] += delta.get("reasoning_content", "")
        for piece in delta.get("tool_calls", ()):
            call = calls.setdefault(piece["index"], {"id": None, "type": "function",
                                                     "function": {"name": None, "arguments": ""}})
            call["id"] = piece.get("id", call["id"])
            call["function"]["name"] = piece["function"].get("name", call["function"]["name"])
            call["function"]["arguments"] += piece["function"].get("arguments", "")
    message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def parse_output(text: str, thinking: bool = False) -> dict[str, Any]:
    """Parse a completion (the generated text after the prompt, special tokens kept) into a message.

    text: in thinking mode it starts inside the reasoning (the prompt ended with ``<think>``).
    thinking: the flag the prompt was encoded with.

    Returns ``{"content", "reasoning_content", "tool_calls"}`` as :func:`merge_deltas` describes: the
    reasoning up to ``</think>``, the content up to EOS or the ``\\n\\n`` before ``<｜DSML｜ calls>``, and
    one call per invoke with ``id = "call_<24 hex>"`` and ``arguments`` built by the official rule
    ``{"name": V, ...}`` (V JSON-escaped for ``string="true"``, raw text for ``string="false"``).
    Never raises on model output; truncated or malformed output follows the rules listed on
    :class:`StreamingParser` (CHAT_FORMAT.md §4, §5). A call cut off inside its body keeps the arguments
    generated so far; use ``StreamingParser.completed_tool_calls`` to set ``finish_reason``.
    """
    parser = StreamingParser(thinking=thinking)
    return merge_deltas(parser.feed(text) + parser.finish())
