"""``tool_choice`` -> the mode and the DSML grammar that enforces it: one mapping for ``/v1/chat/completions``
(:mod:`deepseek_v41.server.chat`) and the offline ``LLM.chat`` (:mod:`deepseek_v41.engine.llm`).

Modes, as the OpenAI API names them: "auto" (the default with tools: free text, and a tool block the model opens
must be valid), "none" (the default without tools: tools are not rendered and no DSML is returned as calls; no
grammar), "required" (one block of at least one call) and a named function ``{"type": "function", "function":
{"name": ...}}`` (one call of it). The grammar is :func:`deepseek_v41.structured.dsml_grammar.tool_call_tag`.

Source: the OpenAI chat completions reference (``tool_choice``), CHAT_FORMAT.md §3(d), §4; issue 26.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from deepseek_v41.structured.dsml_grammar import ToolGrammarError, tool_call_tag

ToolChoiceMode = Literal["auto", "none", "required", "named"]
TOOL_CHOICES = ("auto", "none", "required")


def resolve_tool_choice(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any) -> tuple[ToolChoiceMode,
                                                                                              str | None]:
    """(mode, function name) of a request's ``tool_choice`` given its ``tools``.

    tool_choice: None (``"auto"`` with tools, ``"none"`` without), ``"auto"``, ``"none"``, ``"required"`` or
        ``{"type": "function", "function": {"name": NAME}}`` (mode ``"named"``, NAME returned).

    Raises ToolGrammarError (a ValueError; ``param`` names the field) for another string, ``"required"`` without
    tools, a malformed named choice, or a name that is not among the tools.
    """
    tools = tools or []
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise ToolGrammarError(f"tool_choice must be 'auto', 'none', 'required' or a named function, got "
                                   f"{tool_choice!r}", "tool_choice")
        if tool_choice == "required" and not tools:
            raise ToolGrammarError("tool_choice 'required' needs tools", "tool_choice")
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ToolGrammarError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}",
                               "tool_choice")
    names = [t.get("function", {}).get("name") for t in tools if isinstance(t, Mapping)
             and isinstance(t.get("function"), Mapping)]
    if name not in names:
        raise ToolGrammarError(f"tool_choice names {name!r}, which is not in tools {names}",
                               "tool_choice.function.name")
    return "named", name


def tool_choice_tag(tools: Sequence[Mapping[str, Any]] | None, mode: ToolChoiceMode, name: str | None = None,
                    thinking: bool = False, parallel: bool = True) -> str | None:
    """The structural-tag JSON that enforces ``mode`` (from :func:`resolve_tool_choice`) over ``tools``, with the
    free-reasoning prefix when ``thinking``; None for "none" or no tools (nothing to enforce).
    ``parallel``: ``parallel_tool_calls`` (False: one call per block). Raises ToolGrammarError naming the tool
    field the grammar cannot be built from."""
    if mode == "none" or not tools:
        return None
    return tool_call_tag(tools, mode, name, thinking=thinking, parallel=parallel)
