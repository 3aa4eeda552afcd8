"""OpenAI-shaped messages -> validated turns, with tool messages merged into user turns.

This is the preprocessing half of the official encoder (CHAT_FORMAT.md §2 rules 1-3): content parts and
images, tool results folded into user turns and sorted by call order. Every input the official encoder
rejects, and every input it would render into something the client did not mean (a special token typed
into text), raises :class:`ChatFormatError` here, before anything is rendered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from .dsml import decode_arguments, to_json
from .errors import ChatFormatError
from .images import IMAGE_PART_TYPES, ImageSource, image_source
from .tokens import IMAGE, IMAGE_NAMES, RESERVED, RESERVED_IN_VALUES, TASK_TOKENS

Role = Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]
ROLES: tuple[str, ...] = get_args(Role)
_TEXTLESS_ALLOWED = ("system", "assistant")  # roles whose content may be null


@dataclass(frozen=True)
class ImagePart:
    """An image content part: renders as one ``<｜deepseek_image｜>`` placeholder; ``source`` says where its pixels
    come from (:mod:`deepseek_v41.chat.images`)."""

    source: ImageSource


Part = str | ImagePart


def join_parts(parts: list[Part]) -> str:
    """Content parts as text, joined by "\n\n", each image as its placeholder."""
    return "\n\n".join(IMAGE if isinstance(p, ImagePart) else p for p in parts)


@dataclass
class ToolResult:
    """One ``role: "tool"`` message as a block of a user turn; ``call_id`` only orders it; ``images``: the image
    parts inside ``text``, in order."""

    call_id: str
    text: str
    images: list[ImagePart] = field(default_factory=list)


@dataclass
class ToolCall:
    """One assistant tool call with its arguments decoded by the official rule (dsml.decode_arguments)."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class Turn:
    """One message after validation. Fields a role does not use keep their defaults."""

    role: Role  # "tool" only before merge_tool_results
    content: str = ""  # system, developer, assistant, latest_reminder: text parts joined by "\n\n"
    blocks: list[str | ImagePart | ToolResult] = field(default_factory=list)  # user and tool: joined by "\n\n"
    images: list[ImagePart] = field(default_factory=list)  # the image parts of the message, in order
    tools: list[dict[str, Any]] = field(default_factory=list)  # system, developer: OpenAI ``function`` objects
    response_format: Any = None  # system, developer: schema rendered after the tools block
    task: str | None = None  # user: quick-instruction task
    reasoning: str = ""  # assistant: reasoning_content
    tool_calls: list[ToolCall] = field(default_factory=list)  # assistant
    wo_eos: bool = False  # assistant: leave the turn open (continue_final_message / prefill)


def _check_text(text: str, where: str, reserved: tuple[str, ...] = RESERVED) -> str:
    for token in reserved:
        if token in text:
            hint = "send images as image_url content parts" if token in IMAGE_NAMES else "remove or rewrite it"
            raise ChatFormatError(
                where,
                f"contains the special token {token!r}, which the model would read as chat structure, not "
                f"text; special tokens may not appear in message text ({hint})",
            )
    return text


def _json_text(value: Any, where: str) -> str:
    try:
        return to_json(value)
    except (TypeError, ValueError) as exc:
        raise ChatFormatError(where, f"cannot be written as JSON: {exc}") from exc


def _read_parts(content: Any, where: str, nullable: bool) -> list[Part]:
    """Content -> its parts: text parts as strings, image parts as :class:`ImagePart` (CHAT_FORMAT.md §2 rule 1)."""
    if isinstance(content, str):
        return [_check_text(content, where)]
    if content is None and nullable:
        return [""]
    if not isinstance(content, list):
        allowed = "a string, null or a list of parts" if nullable else "a string or a list of parts"
        raise ChatFormatError(where, f"is {type(content).__name__}; content must be {allowed}")
    parts: list[Part] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ChatFormatError(f"{at}.text", "a text part needs a string 'text'")
            parts.append(_check_text(part["text"], f"{at}.text"))
        elif kind in IMAGE_PART_TYPES:
            parts.append(ImagePart(image_source(part, at)))
        else:
            allowed = ", ".join(repr(k) for k in ("text", *IMAGE_PART_TYPES))
            raise ChatFormatError(at, f"part type {kind!r} is not supported; allowed: {allowed}")
    return parts


def _check_name(name: str, where: str) -> None:
    # Names go raw inside name="..."; a quote would end the attribute and the call would not parse back.
    _check_text(name, where)
    if '"' in name:
        raise ChatFormatError(where, f"{name!r} contains '\"', which DSML cannot quote")


def _read_tool_call(call: Any, where: str) -> ToolCall:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        shape = "{'type': 'function', 'function': {'name': ..., 'arguments': ...}}"
        raise ChatFormatError(where, f"a tool call must be {shape}")
    if call.get("type", "function") != "function":
        raise ChatFormatError(f"{where}.type", f"is {call['type']!r}; only 'function' tool calls exist")
    function = call["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ChatFormatError(f"{where}.function.name", "must be a non-empty string")
    _check_name(name, f"{where}.function.name")
    raw = function.get("arguments")
    if not isinstance(raw, (str, Mapping)):
        raise ChatFormatError(
            f"{where}.function.arguments",
            f"is {type(raw).__name__}; arguments must be a JSON string or an object",
        )
    arguments = decode_arguments(raw)
    for key, value in arguments.items():
        at = f"{where}.function.arguments[{key!r}]"
        _check_name(key, at)
        text = value if isinstance(value, str) else _json_text(value, at)
        _check_text(text, at, RESERVED_IN_VALUES)
    call_id = call.get("id") or ""
    if not isinstance(call_id, str):
        raise ChatFormatError(f"{where}.id", "must be a string")
    return ToolCall(call_id, name, arguments)


def _read_tools(tools: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI ``tools`` -> their ``function`` objects, as sent (CHAT_FORMAT.md §3(c))."""
    if not isinstance(tools, list):
        raise ChatFormatError(where, "tools must be a list of {'type': 'function', 'function': {...}}")
    functions = []
    for j, tool in enumerate(tools):
        at = f"{where}[{j}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise ChatFormatError(at, "a tool must be {'type': 'function', 'function': {'name': ..., ...}}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ChatFormatError(f"{at}.function.name", "must be a non-empty string")
        _check_text(_json_text(function, f"{at}.function"), f"{at}.function")
        functions.append(function)
    return functions


def read_tools(tools: Any) -> list[dict[str, Any]]:
    """Validate the ``tools`` argument of encode_messages; returns the ``function`` objects."""
    return _read_tools(tools, "tools")


def _read_message(msg: Any, where: str) -> Turn:
    if not isinstance(msg, dict):
        raise ChatFormatError(where, f"is {type(msg).__name__}; a message must be an object with a 'role'")
    role = msg.get("role")
    if role not in ROLES:
        raise ChatFormatError(f"{where}.role", f"unknown role {role!r}; allowed: {', '.join(ROLES)}")
    for key in ("tools", "response_format"):
        if role not in ("system", "developer") and msg.get(key) is not None:
            raise ChatFormatError(f"{where}.{key}", f"is only rendered on a system or developer message, not on "
                                                    f"{role!r}")
    if msg.get("task") is not None and (role != "user" or msg["task"] not in TASK_TOKENS):
        raise ChatFormatError(f"{where}.task", f"must be on a user message and one of {list(TASK_TOKENS)}")
    parts = _read_parts(msg.get("content"), f"{where}.content", role in _TEXTLESS_ALLOWED)
    turn = Turn(role, content=join_parts(parts), images=[p for p in parts if isinstance(p, ImagePart)])
    if role == "user":
        turn.blocks, turn.task = list(parts), msg.get("task")
    elif role == "tool":
        call_id = msg.get("tool_call_id") or ""
        if not isinstance(call_id, str):
            raise ChatFormatError(f"{where}.tool_call_id", "must be a string")
        turn.blocks = [ToolResult(call_id, turn.content, list(turn.images))]
    elif role in ("system", "developer"):
        if role == "developer" and not turn.content:
            # DeepSeek's V4 encoder (and the SGLang / vLLM V4.1 ports) render it as a user turn of this text and
            # require the text.
            raise ChatFormatError(f"{where}.content", "a developer message needs non-empty content")
        if msg.get("tools"):
            turn.tools = _read_tools(msg["tools"], f"{where}.tools")
        if msg.get("response_format"):
            turn.response_format = msg["response_format"]
            at = f"{where}.response_format"
            _check_text(_json_text(turn.response_format, at), at)
    elif role == "assistant":
        # The DeepSeek API says reasoning_content; vLLM says reasoning (CHAT_FORMAT.md §5 rule 7).
        reasoning = msg.get("reasoning_content")
        if reasoning is None:
            reasoning = msg.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ChatFormatError(f"{where}.reasoning_content", "must be a string or null")
        turn.reasoning = _check_text(reasoning or "", f"{where}.reasoning_content")
        calls = msg.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ChatFormatError(f"{where}.tool_calls", "must be a list of tool calls")
        turn.tool_calls = [_read_tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
        if not isinstance(msg.get("wo_eos", False), bool):
            raise ChatFormatError(f"{where}.wo_eos", "must be a boolean")
        turn.wo_eos = msg.get("wo_eos", False)
    return turn


def read_messages(messages: Any) -> list[Turn]:
    """Validate OpenAI-shaped messages and return one :class:`Turn` each (tool messages not merged yet).

    Accepts roles system / developer / user / assistant / tool / latest_reminder; content as a string or a list of
    ``text`` parts and image parts (``image_url``, ``input_image``, ``image``, ``image_pil``:
    :mod:`deepseek_v41.chat.images`; null for system and assistant); assistant ``tool_calls``
    with ``function.arguments`` as a JSON string or an object; ``reasoning_content`` (or ``reasoning``).
    Raises ChatFormatError naming the field for anything else (CHAT_FORMAT.md §2, §3(d), §3(h)).
    """
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages", "must be a non-empty list of messages")
    return [_read_message(msg, f"messages[{i}]") for i, msg in enumerate(messages)]


def merge_tool_results(turns: list[Turn]) -> list[Turn]:
    """Fold tool messages into user turns and merge adjacent user turns (CHAT_FORMAT.md §2 rule 2).

    A tool result joins the previous turn if it is a user turn, else starts one; a user message joins a
    previous user turn unless that one carries a task (whose own task is then dropped, as officially).
    """
    merged: list[Turn] = []
    for turn in turns:
        prev = merged[-1] if merged else None
        joins = prev is not None and prev.role == "user" and (turn.role == "tool" or prev.task is None)
        if turn.role in ("user", "tool") and joins:
            prev.blocks.extend(turn.blocks)
        elif turn.role == "tool":
            merged.append(Turn("user", blocks=list(turn.blocks)))
        else:
            merged.append(turn)
    return merged


def sort_tool_results(turns: list[Turn]) -> None:
    """Reorder each user turn's tool results by the preceding assistant's call order, in place (§2 rule 3).

    The sort is stable and an id the assistant did not issue sorts as position 0; text blocks keep their
    places. The order comes from the last assistant that made calls, however far back.
    """
    order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            order = {call.id: k for k, call in enumerate(turn.tool_calls) if call.id}
        elif turn.role == "user" and order:
            results = [b for b in turn.blocks if isinstance(b, ToolResult)]
            if len(results) < 2:
                continue
            ordered = iter(sorted(results, key=lambda r: order.get(r.call_id, 0)))
            turn.blocks = [next(ordered) if isinstance(b, ToolResult) else b for b in turn.blocks]


def rendered_images(turns: list[Turn]) -> list[ImageSource]:
    """The image parts of the turns to be rendered, in the order their placeholders appear in the prompt: a user
    turn's blocks in order (a tool result's images at its sorted place), the images of any other turn in its
    content order. Call it on the turns :func:`deepseek_v41.chat.encoding.render_messages` renders (after merging,
    sorting and dropping)."""
    sources: list[ImageSource] = []
    for turn in turns:
        if turn.role != "user":
            sources += [p.source for p in turn.images]
            continue
        for block in turn.blocks:
            if isinstance(block, ImagePart):
                sources.append(block.source)
            elif isinstance(block, ToolResult):
                sources += [p.source for p in block.images]
    return sources
