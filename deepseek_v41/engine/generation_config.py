"""Sampling defaults from the checkpoint's ``generation_config.json``, as vLLM's ``--generation-config``.

``auto`` (the default) reads ``generation_config.json`` from the model directory, ``vllm`` ignores it (vLLM's own
defaults: temperature 1, top_p 1, top_k off, no output limit but the context), and any other value is a folder
holding a ``generation_config.json``. The keys vLLM takes from the file are used: ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (-> the default ``max_tokens``); the others
(``do_sample``, token ids, ...) are ignored, as vLLM does. The defaults apply to the fields a request does not
set; a value the request sets always wins (the server, ``dsv41 generate`` and ``LLM.get_default_sampling_params``).
It lives in ``engine/`` so that ``LLM`` reads the file too; ``deepseek_v41.server.generation_config`` re-exports it.
Source: vLLM ``ModelConfig.get_diff_sampling_param`` and ``--generation-config``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

FILE = "generation_config.json"
SOURCES = ("auto", "vllm")  # or a folder
# generation_config.json key -> SamplingParams / request field, as vLLM maps them.
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


class GenerationConfigError(ValueError):
    """A ``generation_config.json`` that cannot be read or holds a value no request could have."""


def _check(key: str, value: Any, path: Path) -> float | int:
    """``value`` of ``key`` if it is in the range a request may give, else GenerationConfigError naming both."""
    number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = number and {
        "temperature": lambda v: v >= 0,
        "top_p": lambda v: 0 < v <= 1,
        "top_k": lambda v: isinstance(v, int) and v >= -1,
        "min_p": lambda v: 0 <= v <= 1,
        "repetition_penalty": lambda v: v > 0,
        "max_new_tokens": lambda v: isinstance(v, int) and v >= 1,
    }[key](value)
    if not ok:
        allowed = {"temperature": "a number >= 0", "top_p": "a number in (0, 1]", "top_k": "an integer >= -1",
                   "min_p": "a number in [0, 1]", "repetition_penalty": "a number > 0",
                   "max_new_tokens": "an integer >= 1"}[key]
        raise GenerationConfigError(f"{path}: {key} must be {allowed}, got {value!r}")
    return value


def load_sampling_defaults(source: str, model_dir: str | Path, override: str | None = None
                           ) -> tuple[dict[str, float | int], str]:
    """The sampling defaults of ``--generation-config source`` for ``model_dir`` and where they come from, with
    ``override`` (``--override-generation-config``: a JSON object of the same keys, vLLM's) on top.

    Returns ``({field: value}, origin)`` with fields among temperature, top_p, top_k, min_p, repetition_penalty,
    max_tokens (only those the file sets) and ``origin`` a phrase for the log ("vLLM's defaults", or the file).
    ``auto`` without a file in the model directory gives no defaults. Raises GenerationConfigError for a folder
    that does not exist or has no ``generation_config.json``, a file that is not a JSON object, or a value outside
    what a request may give, and for an override that is not such a JSON object (unknown keys included).
    """
    defaults, origin = _from_source(source, model_dir)
    if override is None:
        return defaults, origin
    flag = "--override-generation-config"
    try:
        data = json.loads(override)
    except json.JSONDecodeError as exc:
        raise GenerationConfigError(f"{flag} must be a JSON object, e.g. '{{\"temperature\": 0.6}}': {exc}") from exc
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{flag} must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise GenerationConfigError(f"{flag}: unknown keys {unknown}; known: {', '.join(KEYS)}")
    return {**defaults, **{KEYS[k]: _check(k, v, Path(flag)) for k, v in data.items()}}, f"{origin} and {flag}"


def _from_source(source: str, model_dir: str | Path) -> tuple[dict[str, float | int], str]:
    if source == "vllm":
        return {}, "vLLM's defaults (--generation-config vllm)"
    folder = Path(model_dir) if source == "auto" else Path(source)
    path = folder / FILE
    if source != "auto" and not path.is_file():
        raise GenerationConfigError(f"--generation-config {source!r}: no {FILE} in that folder (give 'auto' for "
                                    f"the model directory's, 'vllm' for none, or a folder holding one)")
    if not path.is_file():
        return {}, f"vLLM's defaults (no {FILE} in the model directory)"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GenerationConfigError(f"{path} cannot be read as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{path} must hold a JSON object, got {type(data).__name__}")
    defaults = {field: _check(key, data[key], path) for key, field in KEYS.items() if data.get(key) is not None}
    return defaults, str(path)


def describe(defaults: dict[str, float | int], origin: str) -> str:
    """The startup log's phrase: ``sampling defaults temperature=0.0, max_tokens=256 (from PATH)``."""
    if not defaults:
        return f"sampling defaults: {origin}"
    return f"sampling defaults {', '.join(f'{k}={v}' for k, v in defaults.items())} (from {origin})"
