"""The vLLM serve flags a script may pass, checked and turned into what they mean here.

``vllm serve`` scripts carry flags this server has no use for or serves differently; each one is either accepted
with its meaning here or refused with the reason (never silently ignored when it would change the result):

- ``--allowed-origins`` / ``--allowed-methods`` / ``--allowed-headers``: JSON lists (vLLM's form) or one bare
  value; CORS (FastAPI's ``CORSMiddleware``), vLLM's defaults ``["*"]``.
- ``--tool-call-parser``: only ``deepseek_v41`` (the official DSML format is always parsed).
- ``--chat-template``: refused; V4.1 prompts come from the official encoder, which no Jinja template reproduces.
- ``--max-model-len``: an integer with vLLM's suffixes (:func:`human_readable_int`).

The engine options ``--pipeline-parallel-size``, ``--kv-cache-dtype``,
``--gpu-memory-utilization`` and ``--trust-remote-code`` mean what they mean for ``LLM(...)``: their checks live in
:mod:`deepseek_v41.engine.options` (the engine never imports the server); the parallel flags
(``--tensor-parallel-size``, ``--enable-expert-parallel``, ...) are checked by ``ParallelConfig.validate``.

Source: vLLM ``vllm/entrypoints/openai/cli_args.py``, ``vllm/engine/arg_utils.py``.
"""

from __future__ import annotations

import json
import re

TOOL_CALL_PARSERS = ("deepseek_v41",)


def json_list(value: str, flag: str) -> list[str]:
    """``value`` as a list of strings: a JSON list (``'["http://a", "http://b"]'``, as vLLM) or one bare value
    (``http://a`` or ``*``). Raises ValueError naming ``flag`` for JSON that is not a list of strings, a value
    starting with ``[`` included (a list with a typo is never taken as one literal origin)."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        if value.lstrip().startswith("["):
            raise ValueError(f"{flag} {value!r} starts with '[' but is not a JSON list ({exc.msg} at character "
                             f"{exc.pos}); give a JSON list of strings such as '[\"*\"]' or one value") from exc
        return [value]
    if isinstance(parsed, str):
        return [parsed]
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise ValueError(f"{flag} takes a JSON list of strings such as '[\"*\"]' or one value, got {value!r}")
    return parsed


_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int:
    """``value`` as an integer, with vLLM's suffixes (``--max-model-len 32k``): a lowercase ``k`` / ``m`` / ``g`` /
    ``t`` multiplies by 10**3 / 10**6 / 10**9 / 10**12 and may follow a decimal (``25.6k`` = 25600), an uppercase
    ``K`` / ``M`` / ``G`` / ``T`` by 2**10 / 2**20 / 2**30 / 2**40 and needs a whole number (``32K`` = 32768).
    Raises ValueError saying what is allowed for anything else. Source: vLLM ``human_readable_int``."""
    text = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text)
    if match is None:
        raise ValueError(f"{value!r} is not an integer (a number, optionally with a suffix: k = 1000, K = 1024, "
                         f"m = 10**6, M = 2**20, ...)")
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise ValueError(f"{value!r}: a decimal number takes a decimal suffix (k, m, g, t), not {suffix or 'none'}"
                         + (f"; did you mean {number}{suffix.lower()}?" if suffix else ""))
    return int(number) * _BINARY_SUFFIXES.get(suffix, 1)


def check_tool_call_parser(name: str | None) -> str | None:
    """Why ``--tool-call-parser name`` is refused, or None when it is accepted (None or ``deepseek_v41``)."""
    if name is None or name in TOOL_CALL_PARSERS:
        return None
    return (f"--tool-call-parser {name!r} is not available: this server always parses the model's own DSML tool "
            f"calls; give {', '.join(TOOL_CALL_PARSERS)} or leave the flag out")


def chat_template_refusal(template: str) -> str:
    """Why ``--chat-template`` is refused (always: see the module docstring)."""
    return (f"--chat-template {template!r}: DeepSeek-V4.1 has no Jinja chat template; prompts are rendered by the "
            f"official encoder (deepseek_v41.chat.encode_messages), which a template cannot reproduce (thinking, "
            f"DSML tools, reasoning effort). Leave the flag out; per-request options go in chat_template_kwargs")
