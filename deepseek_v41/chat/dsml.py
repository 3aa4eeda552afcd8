"""Rendering DSML: the system prompt's tools block and assistant tool calls (CHAT_FORMAT.md §3(c), §3(d)).

Everything here is the model's own output format: a parsed tool call rendered back must give the bytes the
model generated, so nothing is escaped, reordered or normalised beyond what the official encoder does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .tokens import (
    CALLS_CLOSE,
    CALLS_OPEN,
    CALLS_SEPARATOR,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
    THINK_END,
    THINK_START,
)

_TOOLS_BLOCK = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing "
    f'a "{CALLS_OPEN}" block like the following:\n\n'
    f"{CALLS_OPEN}\n"
    f'{INVOKE_OPEN}$TOOL_NAME">\n'
    f'{PARAM_OPEN}$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_CLOSE}\n'
    "...\n"
    f"{INVOKE_CLOSE}\n"
    f'{INVOKE_OPEN}$TOOL_NAME2">\n'
    "...\n"
    f"{INVOKE_CLOSE}\n"
    f"{CALLS_CLOSE}\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning "
    f"inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)


def to_json(value: Any) -> str:
    """``json.dumps`` as the official encoder calls it: default separators, non-ASCII kept, keys as given.

    Raises TypeError / ValueError for values JSON cannot hold (sets, objects, circular references).
    """
    return json.dumps(value, ensure_ascii=False)


def render_tools(functions: Sequence[Mapping[str, Any]]) -> str:
    """The ``## Tools`` block for the first system turn (CHAT_FORMAT.md §3(c)).

    functions: the ``function`` objects of the OpenAI ``tools`` list, each rendered as one line of JSON in
    the key order the client sent. Returns the block, ending with ``\\n``.
    """
    return _TOOLS_BLOCK.replace("{schemas}", "\n".join(to_json(f) for f in functions))


def decode_arguments(arguments: str | Mapping[str, Any]) -> dict[str, Any]:
    """``function.arguments`` -> the parameter dict the DSML block is rendered from (CHAT_FORMAT.md §3(d)).

    A mapping is used as is. A string is parsed as JSON up to twice, so double-encoded JSON is unwrapped;
    anything that is still not an object is wrapped as ``{"arguments": <the original string>}``.
    """
    if isinstance(arguments, Mapping):
        return dict(arguments)
    value: Any = arguments
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    return dict(value) if isinstance(value, dict) else {"arguments": arguments}


def render_tool_calls(calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """The DSML block an assistant turn ends with, separator included (CHAT_FORMAT.md §3(d)).

    calls: ``(name, arguments)`` pairs with decoded arguments, in call order. Returns
    ``"\\n\\n<｜DSML｜ calls>\\n" + invokes joined by "\\n" + "\\n</｜DSML｜ calls>"``; a call without
    arguments renders an empty line between its invoke tags. A string value goes in raw, unescaped, with
    ``string="true"``; any other value as JSON with ``string="false"``.
    """
    invokes = []
    for name, arguments in calls:
        params = []
        for key, value in arguments.items():
            if isinstance(value, str):
                params.append(f'{PARAM_OPEN}{key}" string="true">{value}{PARAM_CLOSE}')
            else:
                params.append(f'{PARAM_OPEN}{key}" string="false">{to_json(value)}{PARAM_CLOSE}')
        invokes.append(f'{INVOKE_OPEN}{name}">\n' + "\n".join(params) + f"\n{INVOKE_CLOSE}")
    return f"{CALLS_SEPARATOR}{CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"
