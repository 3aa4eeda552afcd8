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


class ChoiceParser:
    """One chat choice's :class:`StreamingParser` with the request's tool policy, as ``/v1/chat/completions`` and
    ``LLM.chat`` return an answer.

    thinking: the prompt ended with ``<think>`` (the parser starts inside the reasoning).
    tools_active: DSML calls are returned as ``tool_calls`` (False for ``tool_choice`` "none": they are dropped,
        and the markup never reaches the content either way).
    parallel: ``parallel_tool_calls``; False keeps only the first call.
    """

    def __init__(self, thinking: bool = False, tools_active: bool = True, parallel: bool = True):
        self.parser = StreamingParser(thinking)
        self.thinking, self.tools_active, self.parallel = thinking, tools_active, parallel

    def feed(self, text: str, finished: bool = False) -> list[Delta]:
        """The deltas ``text`` settles (all that is left when ``finished``), tool calls filtered by the policy."""
        deltas = self.parser.feed(text)
        if finished:
            deltas += self.parser.finish()
        return [d for d in (self._filter(d) for d in deltas) if d]

    def _filter(self, delta: Delta) -> Delta | None:
        if "tool_calls" not in delta:
            return delta
        if not self.tools_active:
            return None
        calls = [c for c in delta["tool_calls"] if self.parallel or c["index"] == 0]
        return {"tool_calls": calls} if calls else None

    def message(self, text: str) -> dict[str, Any]:
        """The whole completion ``text`` (special tokens kept; this parser's only input) -> the OpenAI assistant
        message: ``{"role": "assistant", "content": str | None, "reasoning_content": str (thinking only),
        "tool_calls": [...] (only when there are calls)}``; ``content`` is None when calls come with no text
        before them. Calls as :func:`merge_deltas` joins them."""
        parsed = merge_deltas(self.feed(text, finished=True))
        calls = parsed["tool_calls"]
        message: dict[str, Any] = {"role": "assistant", "content": parsed["content"] or (None if calls else "")}
        if self.thinking:
            message["reasoning_content"] = parsed["reasoning_content"]
        if calls:
            message["tool_calls"] = calls
        return message

    def finish_reason(self, reason: str) -> str:
        """The OpenAI ``finish_reason`` of an engine's ``reason``: "tool_calls" for a stop after a completed call."""
        completed = self.parser.completed_tool_calls
        return "tool_calls" if reason == "stop" and self.tools_active and completed else reason


def assistant_message(text: str, thinking: bool = False, tools_active: bool = True,
                      parallel: bool = True) -> dict[str, Any]:
    """A whole completion ``text`` (special tokens kept) -> the OpenAI assistant message the server returns
    (:meth:`ChoiceParser.message`). Never raises on model output."""
    return ChoiceParser(thinking, tools_active, parallel).message(text)
