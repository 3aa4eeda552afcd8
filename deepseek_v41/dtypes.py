"""The dtype a model is loaded in: vLLM's ``--dtype`` / ``LLM(dtype=...)`` words, resolved once for every entry
point (``LLM``, :func:`~deepseek_v41.model.checkpoint.load_model`, ``dsv41 serve`` and ``dsv41 generate``).

``auto`` is the checkpoint's own dtype when its ``config.json`` records one (``torch_dtype``, or ``dtype`` as newer
Hugging Face versions write it; top level or ``text_config``), so the same checkpoint loads the same way on every
machine; without one it is bfloat16 where the device computes bf16 natively (a CPU with ``avx512_bf16``,
``amx_bf16`` or Arm's ``bf16``; a CUDA GPU that supports it) and float32 elsewhere. Source: vLLM
``ModelConfig._resolve_auto_dtype`` (the config's dtype first), ``--dtype`` choices.
"""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

# The names a dtype may be given by (vLLM's ``--dtype`` choices, and float64 for numerics checks).
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
# vLLM's aliases, and the short forms Hugging Face configs and users write.
ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16",
           "double": "float64"}
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 flags / Arm features in /proc/cpuinfo
CPUINFO = Path("/proc/cpuinfo")


def config_dtype(model_dir: str | Path) -> str | None:
    """The dtype ``model_dir/config.json`` records its weights in (``torch_dtype`` or ``dtype``, top level first,
    then ``text_config``), as written (e.g. ``"bfloat16"``), or None when it records none or there is no readable
    config (loading reports that)."""
    try:
        data = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    for where in (data, data.get("text_config")):
        if isinstance(where, dict):
            for key in ("torch_dtype", "dtype"):
                if isinstance(where.get(key), str):
                    return where[key]
    return None


def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bf16 natively: ``avx512_bf16`` / ``amx_bf16`` (x86) or ``bf16`` (Arm) among the
    ``/proc/cpuinfo`` flags, or ``hw.optional.arm.FEAT_BF16`` on macOS. False when it cannot be told."""
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return any(flag in value.split() for flag in CPU_BF16_FLAGS)
    except OSError:
        pass
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        try:
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True,
                                 timeout=5, check=False)
        except (OSError, subprocess.SubprocessError):
            return False
        return out.stdout.strip() == "1"
    return False


def device_has_native_bf16(device: Any) -> bool:
    """Whether ``device`` (a ``torch.device`` or its name) computes bf16 natively: CUDA per
    ``torch.cuda.is_bf16_supported``, the CPU per :func:`cpu_has_native_bf16`, anything else (MPS) not assumed."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_has_native_bf16()
    return False


_LOADABLE = ("bfloat16", "float16", "float32", "float64")


def _allowed(option: str) -> str:
    """What ``option`` takes, for an error message: the names and aliases; a torch.dtype (naming the four) only when
    ``option`` is not a command-line flag (``--dtype`` takes a name, only ``LLM`` / ``load_model`` a torch dtype)."""
    names = f"{', '.join(DTYPES)} (aliases: {', '.join(ALIASES)})"
    if option.startswith("--"):
        return names
    return f"{names} or a torch.dtype ({', '.join(f'torch.{name}' for name in _LOADABLE)})"


def _named(name: str) -> Any:
    """The torch dtype of a non-auto dtype name or alias (any case, ``torch.`` prefix allowed as scripts write
    ``"torch.float32"``), or None when it is none of them."""
    name = name.strip().lower().removeprefix("torch.")
    canonical = ALIASES.get(name, name)
    return getattr(torch, canonical) if canonical in _LOADABLE else None


def resolve_dtype(dtype: Any = "auto", device: Any = "cpu", model_dir: str | Path | None = None,
                  option: str = "dtype") -> Any:
    """The ``torch.dtype`` to load weights in for ``dtype`` — a torch floating dtype (bf16, fp16, fp32, fp64), one
    of :data:`DTYPES` or an alias of :data:`ALIASES`, any case, optionally written with ``torch.``
    (``"torch.float32"``) — on ``device`` (a ``torch.device`` or its name).

    ``auto``: the dtype ``model_dir``'s config records (:func:`config_dtype`), else bfloat16 where
    :func:`device_has_native_bf16`, else float32 (see the module docstring). Raises ValueError (naming ``option``,
    e.g. ``--dtype``, and what is allowed) for an unknown name, a torch dtype that is not one of those four, a
    dtype recorded in the config that is none of them (pass an explicit dtype then), and float64 on MPS (which
    has no float64). The message offers a torch.dtype only when ``option`` is not a flag (``--dtype``).
    """
    if isinstance(dtype, torch.dtype):
        resolved = dtype if str(dtype).removeprefix("torch.") in _LOADABLE else None
    elif isinstance(dtype, str) and dtype.lower() == "auto":
        recorded = config_dtype(model_dir) if model_dir is not None else None
        if recorded is None:
            resolved = torch.bfloat16 if device_has_native_bf16(device) else torch.float32
        else:
            resolved = _named(recorded)
            if resolved is None:
                raise ValueError(f"{option} auto: {Path(model_dir) / 'config.json'} records torch_dtype "
                                 f"{recorded!r}, which this model does not load in; pass an explicit {option} (one "
                                 f"of {', '.join(_LOADABLE)})")
    else:
        resolved = _named(dtype) if isinstance(dtype, str) else None
    if resolved is None:
        raise ValueError(f"{option} must be one of {_allowed(option)}, got {type(dtype).__name__} {dtype!r}"
                         if not isinstance(dtype, str | torch.dtype) else
                         f"{option} must be one of {_allowed(option)}, got {dtype!r}")
    if resolved == torch.float64 and torch.device(device).type == "mps":
        raise ValueError(f"{option} float64 does not run on MPS (it has no float64); use float32 or bfloat16")
    return resolved
