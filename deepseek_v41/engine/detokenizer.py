"""Incremental detokenization and the stop checks of one output sequence.

``IncrementalDetokenizer.append`` takes the tokens accepted in one engine step (one, or several under
speculative decoding) and returns the text to stream, whether the sequence finished, why, and how many of the
given tokens to keep. Per token, in order (vLLM v1 ``check_stop`` and ``Detokenizer.update``):
  1. a stop token (EOS unless ``ignore_eos`` without ``structured_outputs``, or one of ``stop_token_ids``) once at
     least ``min_tokens`` tokens exist -> finish "stop"; the token is kept, its text dropped unless
     ``include_stop_str_in_output``;
  2. its text is decoded; if a stop string now ends in the text (only checked once more than ``min_tokens``
     tokens exist) -> finish "stop", the text cut before the stop string (after it with
     ``include_stop_str_in_output``), and this token is the last one kept;
  3. ``max_tokens`` reached -> finish "length".
A stop wins over "length" on the same token, as in current vLLM. Tokens after the finishing one are dropped
(``kept`` < ``len(token_ids)``).

Cost per call is O(new tokens): text comes from decoding a small window of ids (vLLM's prefix/read offsets:
``decode(window + new)`` minus ``decode(window)``), and emitted text is kept as a list of chunks. Stop strings are
matched by one Aho-Corasick automaton (:class:`StopMatcher`) over all of them, fed each new character once: memory
linear in the stop strings' total length, time linear in the text produced (amortised O(1) per character), however
long the stop strings. (Searching the last ``max(len(stop)) - 1`` characters again at every token, and a set of
every prefix of every stop string, cost O(L) per token and O(L^2) memory: a 60 KB stop string took 1.7 GB.) Text
held back is kept as pieces, so a long held prefix is not copied again at every token.

Streaming rules: a token whose text ends in U+FFFD (an incomplete UTF-8 sequence split over byte tokens) emits
nothing until a later token completes the character; text that could still be the start of a stop string is held
back (the longest suffix that is a proper prefix of a stop string, so at most ``len(stop) - 1`` characters) and
flushed when the sequence finishes. The concatenation of everything streamed equals ``output_text``.

When several stop strings match, the one completed first in the text wins; of those ending at the same
character, the longest (so "foobar" beats "bar"). A stop string that is a prefix of another always wins.

Source: SPEC.md §4.4; vLLM ``vllm/v1/engine/detokenizer.py``, ``vllm/v1/core/sched/utils.py``; DSPARK.md §6.2
(EOS inside an accepted block truncates right after it).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from typing import Literal, NamedTuple

from tokenizers import Tokenizer

from deepseek_v41.engine.sampling_params import SamplingParams

FinishReason = Literal["stop", "length"]

# Prompt tokens decoded in front of the first output token, so that decoders that drop a leading space at the
# start of a text (Metaspace) render the first output token as they would mid-sequence (vLLM uses 5).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class DetokenizerUpdate(NamedTuple):
    """Result of :meth:`IncrementalDetokenizer.append`; unpacks as ``(new_text, finished, finish_reason, kept)``."""

    new_text: str  # text to stream now
    finished: bool
    finish_reason: FinishReason | None  # "stop" or "length" once finished
    kept: int  # how many of the appended tokens belong to the output (the rest come after the finish)


class StopMatcher:
    """Aho-Corasick automaton over a request's stop strings: finds the first stop string completed in a text fed
    one character at a time, and the longest suffix of that text that could still become one.

    A state is a trie node: the longest suffix of the text fed so far that is a prefix of some stop string. Memory
    is O(total length of the stop strings) (one dict entry and four list slots per trie node); :meth:`step` costs
    O(1) amortised per character (each failure-link hop undoes an earlier one-character descent).

    Args:
        stops: the stop strings (non-empty strings; duplicates allowed).

    Attributes:
        stops: as given.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self._goto: dict[tuple[int, str], int] = {}
        depth, parent, last_char, own = [0], [0], [""], [-1]  # per node
        for index, stop in enumerate(self.stops):
            node = 0
            for ch in stop:
                child = self._goto.get((node, ch))
                if child is None:
                    child = len(depth)
                    self._goto[(node, ch)] = child
                    depth.append(depth[node] + 1)
                    parent.append(node)
                    last_char.append(ch)
                    own.append(-1)
                node = child
            if own[node] < 0:
                own[node] = index
        count = len(depth)
        has_child = [False] * count
        for node in range(1, count):
            has_child[parent[node]] = True
        self._fail = [0] * count
        self._match = [-1] * count  # the longest stop string ending here (index into stops), or -1
        self._hold = [0] * count  # the deepest node on the failure chain that is a proper prefix of a stop string
        self._depth = depth
        # Nodes in order of depth, so a node's failure target (shallower) is done before the node.
        for node in sorted(range(1, count), key=depth.__getitem__):
            up, ch = parent[node], last_char[node]
            if up:
                f = self._fail[up]
                while f and (f, ch) not in self._goto:
                    f = self._fail[f]
                self._fail[node] = self._goto.get((f, ch), 0)
            fail = self._fail[node]
            self._match[node] = own[node] if own[node] >= 0 else self._match[fail]
            self._hold[node] = node if has_child[node] else self._hold[fail]

    def step(self, state: int, ch: str) -> int:
        """The state after feeding ``ch`` in ``state`` (0 = the start: nothing fed, or no prefix pending)."""
        goto, fail = self._goto, self._fail
        while state and (state, ch) not in goto:
            state = fail[state]
        return goto.get((state, ch), 0)

    def match(self, state: int) -> str | None:
        """The longest stop string ending at the last character fed, or None."""
        index = self._match[state]
        return self.stops[index] if index >= 0 else None

    def held(self, state: int) -> int:
        """Length of the longest suffix of the text fed that is a proper prefix of a stop string."""
        return self._depth[self._hold[state]]


@functools.lru_cache(maxsize=16)  # at most 16 x 4 x 1024 characters of automata kept (~16 MB)
def stop_matcher(stops: tuple[str, ...]) -> StopMatcher:
    """The (immutable) matcher of ``stops``, shared by the sequences that stop on the same strings (the ``n``
    samples of a request, repeated requests)."""
    return StopMatcher(stops)


class IncrementalDetokenizer:
    """Turns a stream of accepted token ids into streamed text and decides when the sequence finishes.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``, or None for a token-id-only model (no text; no stop strings).
        prompt_token_ids: the prompt; its last few tokens give the first output token its context.
        params: the request's :class:`SamplingParams` (stop, stop_token_ids, ignore_eos, max_tokens, min_tokens,
            include_stop_str_in_output, skip_special_tokens).
        eos_token_id: the model's EOS id; None = no EOS.
        max_tokens: an engine cap on generated tokens (e.g. ``max_model_len - len(prompt)``); the smaller of it
            and ``params.max_tokens`` applies. None = only ``params.max_tokens``.

    Attributes:
        output_token_ids: the kept output ids so far.
        finished, finish_reason: as last returned.
        stop_reason: the stop string or stop token id that finished the sequence (None for EOS or length).

    Raises:
        ValueError: stop strings without a tokenizer.
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                 eos_token_id: int | None = None, max_tokens: int | None = None):
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        self.tokenizer = tokenizer
        self.params = params
        caps = [m for m in (params.max_tokens, max_tokens) if m is not None]
        self.max_tokens = min(caps) if caps else None
        # A structured output's grammar allows EOS only once it is complete, and the output ends there even with
        # ignore_eos (a grammar has nothing after its end).
        self._eos = None if params.ignore_eos and params.structured_outputs is None else eos_token_id
        self._stop_ids = frozenset(params.stop_token_ids)
        self._stops = stop_matcher(tuple(params.stop)) if params.stop else None
        self._stop_state = 0  # the matcher's state after all text decoded so far
        # With the stop string kept in the output the cut is at its end, after all text already streamed,
        # so nothing needs holding back.
        self._hold_back = self._stops is not None and not params.include_stop_str_in_output

        self.output_token_ids: list[int] = []
        self.finished = False
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self._chunks: list[str] = []  # text streamed so far
        self._pending: deque[str] = deque()  # decoded text held back (pieces): it could still begin a stop string
        self._pending_len = 0  # characters in _pending
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]) if tokenizer is not None else []
        self._prefix_offset = 0  # _ids[prefix_offset:read_offset] is the decoding context
        self._read_offset = len(self._ids)  # ids from here on have not produced text yet

    @property
    def output_text(self) -> str:
        """All text decoded so far, held-back text included (the final text once finished)."""
        if len(self._chunks) > 1:
            # Collapse the chunks so that calling this every step joins only what arrived since the last call.
            self._chunks = ["".join(self._chunks)]
        return (self._chunks[0] if self._chunks else "") + "".join(self._pending)

    def append(self, token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Add the tokens accepted in one step; returns ``(new_text, finished, finish_reason, kept)``.

        Args:
            token_ids: accepted ids in order (speculative decoding may accept several at once).

        Returns:
            :class:`DetokenizerUpdate`; ``kept`` counts the leading ``token_ids`` that belong to the output: all of
            them unless the sequence finished before the last one.

        Raises:
            RuntimeError: the sequence already finished.
        """
        if self.finished:
            raise RuntimeError(f"append() after the sequence finished ({self.finish_reason}); "
                               f"drop the request instead of feeding it more tokens")
        emitted: list[str] = []
        kept = 0
        min_tokens = self.params.min_tokens
        for token in token_ids:
            kept += 1
            self.output_token_ids.append(token)
            n = len(self.output_token_ids)
            if n >= min_tokens and (token == self._eos or token in self._stop_ids):
                self._finish("stop", None if token == self._eos else token)
                if self.params.include_stop_str_in_output:
                    emitted.append(self._push(self._decode_next(token), check=False)[0])
                break
            text, stop = self._push(self._decode_next(token), check=n > min_tokens)
            emitted.append(text)
            if stop is not None:
                self._finish("stop", stop)
                break
            if self.max_tokens is not None and n >= self.max_tokens:
                self._finish("length", None)
                break
        if self.finished:
            emitted.append(self._flush())
        return DetokenizerUpdate("".join(emitted), self.finished, self.finish_reason, kept)

    def stop(self) -> str:
        """Finish now with reason "stop": a structured output's grammar ended without a stop token the checks
        above see (a model without EOS) or refused a token, and nothing may follow. Returns the held-back text
        it releases; "" when already finished."""
        if self.finished:
            return ""
        self._finish("stop", None)
        return self._flush()

    def end(self, reason: FinishReason) -> None:
        """Finish with ``reason`` without another token (a prefill-only request of a disaggregated prefill server,
        which samples nothing: issue 29)."""
        if not self.finished:
            self._finish(reason, None)

    def _finish(self, reason: FinishReason, stop_reason: str | int | None) -> None:
        self.finished = True
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def _decode_next(self, token: int) -> str:
        """Text that ``token`` completes, or "" while it ends inside a character or adds no text."""
        if self.tokenizer is None:
            return ""
        self._ids.append(token)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix):]

    def _push(self, text: str, check: bool) -> tuple[str, str | None]:
        """Add decoded text; returns (text to stream now, the stop string that ended the output or None)."""
        if not text:
            return "", None
        if self._stops is None:
            self._chunks.append(text)
            return text, None
        matcher, state = self._stops, self._stop_state
        for j, ch in enumerate(text):
            state = matcher.step(state, ch)
            stop = matcher.match(state) if check else None
            if stop is not None:
                # The first stop string completed (the longest of those ending on this character). Its start lies
                # in held-back text or in ``text``: a prefix of it was held back, so nothing streamed is cut.
                self._stop_state = state
                end = j + 1 if self.params.include_stop_str_in_output else j + 1 - len(stop)
                out = self._release(max(0, self._pending_len + end), text[:max(0, end)])
                self._pending.clear()
                self._pending_len = 0
                return out, stop
        self._stop_state = state
        self._pending.append(text)
        self._pending_len += len(text)
        hold = min(matcher.held(state), self._pending_len) if self._hold_back else 0
        return self._release(self._pending_len - hold), None

    def _release(self, count: int, extra: str = "") -> str:
        """Stream the first ``count`` characters of (held-back text + ``extra``), ``extra`` not yet in ``_pending``
        (it is all released only when ``count`` reaches it); O(released characters)."""
        parts = []
        while count > 0 and self._pending:
            piece = self._pending[0]
            if len(piece) <= count:
                parts.append(self._pending.popleft())
                self._pending_len -= len(piece)
                count -= len(piece)
            else:
                parts.append(piece[:count])
                self._pending[0] = piece[count:]
                self._pending_len -= count
                count = 0
        if count > 0:
            parts.append(extra[:count])
        out = "".join(parts)
        self._chunks.append(out)
        return out

    def _flush(self) -> str:
        """At finish: release held-back text and any incomplete character (decoded as U+FFFD)."""
        tail = ""
        if self.tokenizer is not None and self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
            tail = self._decode(self._ids[self._prefix_offset:])[len(prefix):]
            self._read_offset = len(self._ids)
        out = "".join(self._pending) + tail
        self._pending.clear()
        self._pending_len = 0
        self._chunks.append(out)
        return out
