"""One state machine from completion text to OpenAI deltas: reasoning, content and DSML tool calls.

The parser sees the decoded completion (special tokens kept) in arbitrary pieces and emits deltas in the
OpenAI streaming shape. Its output does not depend on where the pieces are cut: text is only emitted once
no marker can start inside it (a held-back tail), and markers are acted on in text order. ``parse_output``
is this machine run over the whole text, so streamed and non-streamed results agree by construction.
Source: CHAT_FORMAT.md §4 (parsing and tolerant fallbacks), §5 (streaming state machine and its rules).
"""

from __future__ import annotations

import json
import secrets
from enum import Enum, auto
from typing import Any

from .dsml import to_json
from .tokens import (
    BOS,
    CALLS_CLOSE,
    CALLS_OPEN,
    CALLS_SEPARATOR,
    EOS,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
    THINK_END,
    THINK_START,
)

Delta = dict[str, Any]


class _State(Enum):
    REASONING = auto()  # thinking mode, before </think>
    CONTENT = auto()
    BLOCK = auto()  # inside <｜DSML｜ calls>, between invokes
    INVOKE_NAME = auto()  # after '<｜DSML｜ invoke name="', up to '">'
    INVOKE_BODY = auto()  # inside an invoke, between parameters
    PARAM_NAME = auto()  # after '<｜DSML｜ parameter name="', up to '" string="true|false">'
    STRING_VALUE = auto()  # string="true": raw text, streamed JSON-escaped
    JSON_VALUE = auto()  # string="false": raw JSON text, streamed as is


_NAME_END = '">'
_STRING_VALUE_START = '" string="true">'
_JSON_VALUE_START = '" string="false">'

_S = _State
# (state, marker) -> next state. Markers not listed for a state are absorbed there: BOS / EOS anywhere,
# and outside names and values the stray think tags and DSML closers, so markup never reaches the text.
_NEXT: dict[tuple[_State, str], _State] = {
    (_S.REASONING, THINK_END): _S.CONTENT,
    (_S.REASONING, CALLS_OPEN): _S.BLOCK,  # a block opened inside <think> ends the reasoning (§4)
    (_S.CONTENT, CALLS_OPEN): _S.BLOCK,
    (_S.BLOCK, INVOKE_OPEN): _S.INVOKE_NAME,
    (_S.BLOCK, CALLS_CLOSE): _S.CONTENT,
    (_S.INVOKE_NAME, _NAME_END): _S.INVOKE_BODY,
    (_S.INVOKE_BODY, PARAM_OPEN): _S.PARAM_NAME,
    (_S.INVOKE_BODY, INVOKE_CLOSE): _S.BLOCK,
    (_S.INVOKE_BODY, INVOKE_OPEN): _S.INVOKE_NAME,  # a missing </invoke>: the next invoke closes this one
    (_S.INVOKE_BODY, CALLS_CLOSE): _S.CONTENT,  # likewise a missing </invoke> before </calls>
    (_S.PARAM_NAME, _STRING_VALUE_START): _S.STRING_VALUE,
    (_S.PARAM_NAME, _JSON_VALUE_START): _S.JSON_VALUE,
    (_S.STRING_VALUE, PARAM_CLOSE): _S.INVOKE_BODY,
    (_S.JSON_VALUE, PARAM_CLOSE): _S.INVOKE_BODY,
}
_STRAY = (BOS, EOS, THINK_START, THINK_END, CALLS_OPEN, CALLS_CLOSE, INVOKE_CLOSE, PARAM_CLOSE)
_INSIDE_ATTRIBUTE_OR_VALUE = (_S.INVOKE_NAME, _S.PARAM_NAME, _S.STRING_VALUE, _S.JSON_VALUE)


def _markers(state: _State) -> tuple[str, ...]:
    moves = tuple(m for (s, m) in _NEXT if s is state)
    absorbed = (BOS, EOS) if state in _INSIDE_ATTRIBUTE_OR_VALUE else _STRAY
    return moves + tuple(m for m in absorbed if m not in moves)


_MARKERS = {state: _markers(state) for state in _State}
# Text is held back while its tail could still become one of these. In reasoning and content that
# includes the "\n\n" before a tool block, which belongs to the block (§5 rule 2).
_HOLD = {
    state: markers + ((CALLS_SEPARATOR + CALLS_OPEN,) if state in (_S.REASONING, _S.CONTENT) else ())
    for state, markers in _MARKERS.items()
}


def _hold_start(buf: str, start: int, patterns: tuple[str, ...]) -> int:
    """The first index from which ``buf`` is a proper prefix of a pattern (``len(buf)`` if none)."""
    longest = max(len(p) for p in patterns) - 1
    for i in range(max(start, len(buf) - longest), len(buf)):
        tail = buf[i:]
        if any(p.startswith(tail) for p in patterns):
            return i
    return len(buf)


def new_call_id() -> str:
    """A fresh OpenAI tool-call id, ``call_`` + 24 hex digits (vLLM's form, CHAT_FORMAT.md §4 step 6)."""
    return "call_" + secrets.token_hex(12)


class StreamingParser:
    """Incremental parser of one completion: ``feed`` each decoded text delta, then ``finish`` once.

    thinking: the request's thinking flag, the same one the prompt was encoded with (§5: decide it once).
        In thinking mode the text starts inside the reasoning.

    ``feed(text) -> list[delta]`` and ``finish() -> list[delta]`` return OpenAI chat-completion deltas:
    ``{"reasoning_content": str}``, ``{"content": str}``, and for tool calls
    ``{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments"}}]}`` once the
    name is complete, then ``{"tool_calls": [{"index", "function": {"arguments": str}}]}`` pieces: the
    arguments stream as the JSON text ``{"key": value, ...}`` of the official rule (§4 step 4), string
    values JSON-escaped piece by piece, other values raw. Consecutive pieces of one kind are merged.
    Feed whole decoded characters: holding back an incomplete UTF-8 sequence is the detokenizer's job.

    Rules (§4, §5): text that could start a marker is held back until the next delta settles it, including
    the ``\\n\\n`` before a tool block; only the full spaced ``<｜DSML｜ calls>`` starts a block; a block
    opened inside the reasoning ends it; stray BOS / EOS / think tags / DSML closers are dropped; text
    inside a block but outside any invoke goes to content, and raw text inside an invoke (the JSON-body
    spelling) goes to its arguments; a missing ``</invoke>`` is closed by the next invoke or ``</calls>``.
    At ``finish`` held text is flushed; an unfinished invoke or parameter header is discarded; an invoke cut
    inside its body keeps the arguments streamed so far, unclosed (``completed_tool_calls`` tells
    ``finish_reason: "tool_calls"`` apart from a truncated call).
    """

    def __init__(self, thinking: bool = False):
        if not isinstance(thinking, bool):
            raise TypeError(f"thinking must be a bool, got {type(thinking).__name__}")
        self._state = _S.REASONING if thinking else _S.CONTENT
        self._buf = ""  # text not yet consumed: at most a held-back tail between calls
        self._pending = ""  # text of a name, a parameter name, or block/invoke filler, decided later
        self._out: list[Delta] = []
        self._index = -1  # index of the current tool call
        self._params = 0  # parameters opened in the current invoke
        self._raw = False  # raw body text emitted in the current invoke
        self._completed = 0
        self._finished = False

    @property
    def completed_tool_calls(self) -> int:
        """How many invokes were closed; 0 with a started call means the call was cut off."""
        return self._completed

    def feed(self, text: str) -> list[Delta]:
        """Consume one decoded delta; returns the deltas it settles (possibly none)."""
        if self._finished:
            raise RuntimeError("feed() after finish(): use one StreamingParser per completion")
        self._buf += text
        self._drain(final=False)
        return self._take()

    def finish(self) -> list[Delta]:
        """End of the completion: flush held text and close what is open; returns the last deltas."""
        if self._finished:
            raise RuntimeError("finish() called twice: use one StreamingParser per completion")
        self._finished = True
        self._drain(final=True)
        if self._state is _S.BLOCK:
            self._flush_filler()
        elif self._state is _S.INVOKE_BODY:
            self._flush_raw_arguments()
        self._pending = ""  # an unfinished name is markup, never text
        return self._take()

    def _drain(self, final: bool) -> None:
        buf, pos = self._buf, 0
        while True:
            hits = [(k, m) for m in _MARKERS[self._state] if (k := buf.find(m, pos)) >= 0]
            if not hits:
                break
            at, marker = min(hits)
            text = buf[pos:at]
            opens_block = marker == CALLS_OPEN and self._state in (_S.REASONING, _S.CONTENT)
            if opens_block and text.endswith(CALLS_SEPARATOR):
                text = text[: -len(CALLS_SEPARATOR)]
            self._on_text(text)
            pos = at + len(marker)
            self._on_marker(marker)
        cut = _hold_start(buf, pos, _HOLD[self._state])
        # At the end a held tail is text ("2 <", "\n\n"), unless it reaches the fullwidth bar: then it is a
        # DSML tag or special token cut off, and markup never leaks.
        if final and "｜" not in buf[cut:]:
            cut = len(buf)
        self._on_text(buf[pos:cut])
        self._buf = "" if final else buf[cut:]

    def _on_text(self, text: str) -> None:
        if not text:
            return
        if self._state is _S.REASONING:
            self._emit("reasoning_content", text)
        elif self._state is _S.CONTENT:
            self._emit("content", text)
        elif self._state is _S.STRING_VALUE:
            self._emit_arguments(json.dumps(text, ensure_ascii=False)[1:-1])
        elif self._state is _S.JSON_VALUE:
            self._emit_arguments(text)
        else:
            self._pending += text

    def _on_marker(self, marker: str) -> None:
        state = self._state
        following = _NEXT.get((state, marker))
        if following is None:
            return  # a stray marker, absorbed
        if state is _S.BLOCK:
            self._flush_filler()
        elif state is _S.INVOKE_NAME:
            self._start_call(self._pending)
        elif state is _S.INVOKE_BODY:
            self._flush_raw_arguments()
            if marker != PARAM_OPEN:
                self._end_call()
        elif state is _S.PARAM_NAME:
            opener = "{" if self._params == 0 else ", "
            quote = '"' if marker == _STRING_VALUE_START else ""
            self._emit_arguments(f"{opener}{to_json(self._pending)}: {quote}")
            self._params += 1
        elif state is _S.STRING_VALUE:
            self._emit_arguments('"')
        self._pending = ""
        self._state = following

    def _start_call(self, name: str) -> None:
        self._index += 1
        self._params, self._raw = 0, False
        call = {"index": self._index, "id": new_call_id(), "type": "function",
                "function": {"name": name, "arguments": ""}}
        self._out.append({"tool_calls": [call]})

    def _end_call(self) -> None:
        if self._params:
            self._emit_arguments("}")
        elif not self._raw:
            self._emit_arguments("{}")
        self._completed += 1

    def _flush_filler(self) -> None:
        """Non-blank text between invokes is the model talking, not markup: keep it as content."""
        if self._pending.strip():
            self._emit("content", self._pending.strip())
        self._pending = ""

    def _flush_raw_arguments(self) -> None:
        """Non-blank text in an invoke body outside parameters is argument text (a JSON-object body)."""
        if self._pending.strip():
            self._emit_arguments(self._pending.strip())
            self._raw = True
        self._pending = ""

    def _emit(self, key: str, text: str) -> None:
        if self._out and key in self._out[-1]:
            self._out[-1][key] += text
        else:
            self._out.append({key: text})

    def _emit_arguments(self, text: str) -> None:
        last = self._out[-1]["tool_calls"][0] if self._out and "tool_calls" in self._out[-1] else None
        if last is not None and last["index"] == self._index:
            last["function"]["arguments"] += text
        else:
            self._out.append({"tool_calls": [{"index": self._index, "function": {"arguments": text}}]})

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out
