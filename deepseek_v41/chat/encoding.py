"""``encode_messages``: OpenAI-shaped messages -> the DeepSeek-V4.1 prompt string (CHAT_FORMAT.md §2, §3).

A port of the official Python encoder (``encoding/encoding.py`` of the release): same bytes for every input
it accepts, a :class:`ChatFormatError` for every input it rejects, and also for text holding special tokens.
One addition: OpenAI's ``developer`` role, which the V4.1 release encoder does not render (it raises "Unknown
role", CHAT_FORMAT.md §2), is rendered as DeepSeek's V4 encoder and the SGLang / vLLM V4.1 ports render it: a
user turn followed by the message's own tools and response format, left out before the last user turn in thinking
mode with drop on (the release encoder's drop step). Tokenize the result with ``add_special_tokens=False``: BOS is
already in the text (§0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .dsml import render_tool_calls, render_tools, to_json
from .errors import ChatFormatError
from .images import ImageSource
from .messages import (
    ImagePart,
    ToolResult,
    Turn,
    merge_tool_results,
    read_messages,
    read_tools,
    rendered_images,
    sort_tool_results,
)
from .tokens import (
    ASSISTANT,
    BOS,
    DEFAULT_REASONING_EFFORT,
    EOS,
    IMAGE,
    LATEST_REMINDER,
    REASONING_EFFORT_LINE,
    REASONING_EFFORTS,
    SYSTEM,
    TASK_TOKENS,
    THINK_END,
    THINK_START,
    TOOL_RESULT_CLOSE,
    TOOL_RESULT_OPEN,
    USER,
)

_RESPONSE_FORMAT = "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


def effort_budget(reasoning_effort: int | str | None) -> int:
    """The 1..100 budget written on the effort line (CHAT_FORMAT.md §3(g), released table).

    Accepts an ``int`` in [1, 100] (bools and floats are refused), ``"low"`` / ``"high"`` / ``"max"``
    (50 / 75 / 100) or None (``"high"``). Raises ChatFormatError otherwise; mapping API words such as
    ``"medium"`` or ``"none"`` is the server's job.
    """
    effort = DEFAULT_REASONING_EFFORT if reasoning_effort is None else reasoning_effort
    if type(effort) is int and 1 <= effort <= 100:
        return effort
    if isinstance(effort, str) and effort in REASONING_EFFORTS:
        return REASONING_EFFORTS[effort]
    allowed = f"an int in 1..100 or one of {list(REASONING_EFFORTS)}"
    raise ChatFormatError("reasoning_effort", f"{reasoning_effort!r} is not allowed; use {allowed}")


def _attach_tools(turns: list[Turn], functions: list[dict[str, Any]]) -> None:
    """Put the tools on the first system turn, inserting an empty one at index 0 if there is none (§3(c))."""
    target = next((t for t in turns if t.role == "system"), None)
    if target is None:
        target = Turn("system")
        turns.insert(0, target)
    elif target.tools:
        raise ChatFormatError("tools", "the first system message already carries tools; send them once")
    target.tools = functions


def _last_user_index(turns: Sequence[Turn]) -> int:
    """The last user or developer turn, or system turn after index 0: where the live generation starts (§2 rule
    5)."""
    for i in range(len(turns) - 1, -1, -1):
        if turns[i].role in ("user", "developer") or (turns[i].role == "system" and i > 0):
            return i
    return -1


def _drop_developer_turns(turns: list[Turn]) -> list[Turn]:
    """Thinking mode with drop on: developer turns before the last user turn are left out, as the reference's
    drop step keeps only user / system / tool / latest_reminder turns and assistants there (§2 rule 5)."""
    last_user = _last_user_index(turns)
    return [t for i, t in enumerate(turns) if t.role != "developer" or i >= last_user]


def _block_text(block: str | ImagePart | ToolResult) -> str:
    if isinstance(block, ToolResult):
        return f"{TOOL_RESULT_OPEN}{block.text}{TOOL_RESULT_CLOSE}"
    if isinstance(block, ImagePart):
        return IMAGE
    return block


def _render_turn(
    i: int, turns: Sequence[Turn], thinking: bool, drop: bool, budget: int, last_user: int
) -> str:
    """One turn plus the generation header that follows it (CHAT_FORMAT.md §2, "Per message")."""
    turn = turns[i]
    out = []
    if i == 0:
        effort = REASONING_EFFORT_LINE.format(budget=budget) if thinking else ""
        if effort or turn.role == "system":
            out.append(SYSTEM)
        out.append(effort)
    if turn.role in ("system", "developer"):
        # A developer message is a user turn carrying its own tools and response format (module docstring).
        if turn.role == "developer":
            out.append(USER)
        elif i > 0:
            out.append(SYSTEM)
        out.append(turn.content)
        if turn.tools:
            out.append("\n\n" + render_tools(turn.tools))
        if turn.response_format:
            out.append(_RESPONSE_FORMAT + to_json(turn.response_format))
    elif turn.role == "user":
        out.append(USER + "\n\n".join(_block_text(b) for b in turn.blocks))
    elif turn.role == "latest_reminder":
        out.append(LATEST_REMINDER + turn.content)
    else:  # assistant; its opening <think> belongs to the previous header
        after_task = i > 0 and turns[i - 1].task is not None
        if thinking and not after_task and (not drop or i > last_user):
            out.append(turn.reasoning + THINK_END)
        out.append(turn.content)
        if turn.tool_calls:
            out.append(render_tool_calls([(c.name, c.arguments) for c in turn.tool_calls]))
        if not turn.wo_eos:
            out.append(EOS)

    following = turns[i + 1].role if i + 1 < len(turns) else None
    if following not in (None, "assistant", "latest_reminder"):
        return "".join(out)
    if turn.task == "action":
        out.append(ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS["action"])
    elif turn.task is not None:
        out.append(TASK_TOKENS[turn.task])
    elif turn.role in ("user", "developer") or (turn.role == "system" and i > 0):
        # Earlier turns of a thinking conversation with drop on are rendered chat-style (§3(b)).
        out.append(ASSISTANT + (THINK_START if thinking and (not drop or i >= last_user) else THINK_END))
    return "".join(out)


def encode_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    thinking: bool = False,
    reasoning_effort: int | str | None = None,
    drop_thinking: bool = True,
) -> str:
    """Render a chat request as the DeepSeek-V4.1 prompt string, generation header included.

    messages: OpenAI-shaped messages (see :func:`deepseek_v41.chat.messages.read_messages` for what is
        accepted); tool messages become ``<tool_result>`` blocks of user turns, sorted by call order. A
        ``developer`` message renders as a user turn followed by its own ``tools`` / ``response_format``; in
        thinking mode with drop on, one before the last user message is left out.
        An assistant message may set ``wo_eos: True`` to leave its turn open (continue_final_message); a
        system message may carry ``response_format``; a user message may carry a quick-instruction ``task``.
    tools: the OpenAI ``tools`` list, rendered into the first system turn (an empty one is inserted at
        index 0 when there is none).
    thinking: thinking mode: the prompt ends ``<｜Assistant｜><think>`` instead of ``<｜Assistant｜></think>``
        and index 0 carries the effort line.
    reasoning_effort: int 1..100, "low" / "high" / "max" or None (= "high" = 75); see :func:`effort_budget`.
    drop_thinking: drop the reasoning of turns before the last user message in thinking mode; forced off
        when tools are present (the API rule for agent loops).

    Returns the prompt, starting with BOS. Raises ChatFormatError (a ValueError) for unknown roles,
    malformed content parts, tool calls or tools, invalid efforts or tasks, and special tokens typed into
    text. Source: CHAT_FORMAT.md §2 (rules in order), §3 (cases), §7 (worked examples).
    """
    return render_messages(messages, tools, thinking, reasoning_effort, drop_thinking)[0]


def render_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    thinking: bool = False,
    reasoning_effort: int | str | None = None,
    drop_thinking: bool = True,
) -> tuple[str, list[ImageSource]]:
    """:func:`encode_messages`, plus the image parts whose placeholders the prompt holds, in prompt order (one
    ``<｜deepseek_image｜>`` each; an image of a developer message left out in thinking mode is not among them).
    Same arguments and errors."""
    for name, flag in (("thinking", thinking), ("drop_thinking", drop_thinking)):
        if not isinstance(flag, bool):
            raise ChatFormatError(name, f"must be a bool, got {flag!r}")
    budget = effort_budget(reasoning_effort)
    turns = read_messages(messages)
    if tools:
        _attach_tools(turns, read_tools(tools))
    turns = merge_tool_results(turns)
    sort_tool_results(turns)
    drop = drop_thinking and not any(t.tools for t in turns)
    if thinking and drop:
        turns = _drop_developer_turns(turns)
    last_user = _last_user_index(turns)
    prompt = BOS + "".join(_render_turn(i, turns, thinking, drop, budget, last_user) for i in range(len(turns)))
    return prompt, rendered_images(turns)
