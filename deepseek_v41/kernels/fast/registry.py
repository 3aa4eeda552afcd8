"""The fast backend's registry and the checks its installers share: which installer serves which model class,
how a method is replaced on one instance, and when a module is plain enough for a fast path to stand in for it.

The installer modules (``attention``, ``block``, ``decode``, ``dense``, ``moe``) import this, and the package
(:mod:`deepseek_v41.kernels.fast`) imports them, so nothing here imports the package.
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules import module as _module

from deepseek_v41 import kernels

OVERRIDES = "_fast_overrides"  # instance attribute: the names this backend replaced on the module
_GLOBAL_HOOKS = (_module._global_forward_hooks, _module._global_forward_pre_hooks, _module._global_backward_hooks,
                 _module._global_backward_pre_hooks)

Installer = Callable[[nn.Module], bool]
INSTALLERS: dict[type[nn.Module], list[Installer]] = {}


def register(cls: type[nn.Module]) -> Callable[[Installer], Installer]:
    """Decorator: ``fn(module) -> bool`` installs the fast path on one instance of exactly ``cls`` (returns
    whether it installed anything). Several installers may serve one class; they run in registration order."""

    def add(fn: Installer) -> Installer:
        INSTALLERS.setdefault(cls, []).append(fn)
        return fn

    return add


def override(module: nn.Module, name: str, fn: Callable) -> None:
    """Replace ``module.<name>`` for this instance only by ``fn`` bound to the module (``fn(module, *args)``).
    The reference method stays reachable as ``type(module).<name>(module, ...)``."""
    module.__dict__[name] = types.MethodType(fn, module)
    module.__dict__.setdefault(OVERRIDES, set()).add(name)


# A module's own hook dicts (in its __dict__: nn.Module.__init__ sets them) from that __dict__.
HOOK_DICTS = operator.itemgetter("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hooked(m: nn.Module) -> bool:
    """Whether ``m`` has a forward or backward hook of its own."""
    return any(HOOK_DICTS(m.__dict__))


def any_hooked(module_dicts: list[dict]) -> bool:
    """Whether some module of these ``__dict__``s has a hook of its own (:func:`hooked` of each), in one C-level
    pass: no Python frame or attribute lookup per module (the decode plan checks ~60 modules a step, issue 25)."""
    return any(map(any, map(HOOK_DICTS, module_dicts)))


def global_hooks() -> bool:
    """Whether a global module hook (``torch.nn.modules.module.register_module_forward_hook`` and the like) is
    registered: it observes every module call, which a fast path standing in for submodule calls would skip."""
    return any(_GLOBAL_HOOKS)


def plain(m: nn.Module | None, cls: type[nn.Module]) -> bool:
    """True when ``m`` is exactly a ``cls`` (not a subclass such as a LoRA wrapper) with no hook of its own: then
    computing its output from its weights is exactly calling it."""
    return m is not None and type(m) is cls and not hooked(m)


def plain_weight(m: nn.Module | None, cls: type[nn.Module]) -> torch.Tensor | None:
    """``m.weight`` when :func:`plain` and without bias; else None."""
    if not plain(m, cls) or m._parameters.get("bias") is not None:
        return None
    return m._parameters.get("weight")


KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # dtypes the fused CPU kernels take (bf16 widened inside)


def fused(*tensors: torch.Tensor) -> bool:
    """Per call, in a fast version: whether the kernels take these fp32 / bf16 tensors now — CPU, contiguous, and
    under ``torch.inference_mode`` (the engine's steps). The kernels add in another order than ATen and skip the
    bf16 roundings between the steps they fuse, so they agree with the reference to rounding; outside inference
    mode (training, the exact forward with or without ``no_grad``) the reference runs, so those results never
    depend on the grad mode or on whether the backend is installed."""
    if not torch.is_inference_mode_enabled():
        return False
    for t in tensors:  # a plain loop: this runs ~100 times a decode step
        if t.dtype not in KERNEL_DTYPES:
            return False
    return kernels.usable(*tensors)
