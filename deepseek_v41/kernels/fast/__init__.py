"""The CPU fast backend: installed once on a loaded model, never consulted per call by the model (issue 24).

``deepseek_v41/model`` is the reference math only (what training, the exact forward and the engine all run).
This package holds the fast paths: for each model class that has one, an *installer* registered with
:func:`register` looks at one module instance once — its class is exactly the registered class (not a subclass),
it has no hooks, its weights have dtypes and shapes the kernels take — packs what its fast forward needs (FP4
expert copies, stacked weights) and replaces methods of that instance (``forward``, or a named method the
reference forward calls, e.g. a block's mixing) with fast versions through :func:`override`. A fast version
serves the shapes it is made for (a few tokens, inference mode, CPU tensors) and calls the reference method
otherwise, so results never depend on whether the backend is installed beyond rounding (``tests/kernels``).

:func:`install` walks a model and runs the installers; the engine's model runner calls it once on the model it
serves. It installs nothing on CUDA, on ``meta`` tensors, or when
the C library is unavailable (``DSV41_CPU_KERNELS=0``, no compiler). :func:`uninstall` restores the reference
methods. Installing again replaces earlier overrides, so after changing weights in place, loading a state dict,
or registering a hook on a submodule, call :func:`install` again (or :func:`uninstall`): the fast versions read
weights and packed copies captured at install time. :func:`still_valid` detects what is cheap to detect — a
global module hook registered after install — and the model runner checks it once per step.

Installers work per module instance, so a sharded linear (tensor parallelism) gets its fast path the same way as
an unsharded one. Source: issue 24; vLLM's ``CustomOp`` (``forward_native`` beside ``forward_cpu``) decides an
op's implementation once in the same spirit.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules import module as _module

from deepseek_v41 import kernels

_OVERRIDES = "_fast_overrides"  # instance attribute: the names this backend replaced on the module
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
    module.__dict__.setdefault(_OVERRIDES, set()).add(name)


def hooked(m: nn.Module) -> bool:
    """Whether ``m`` has a forward or backward hook of its own."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


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


@dataclass
class Installed:
    """What :func:`install` did: ``modules`` counts installed instances by class name; ``reason`` says why
    nothing was installed (empty when something was)."""

    modules: dict[str, int] = field(default_factory=dict)
    reason: str = ""

    def __bool__(self) -> bool:
        return bool(self.modules)


def supported(model: nn.Module) -> str:
    """Empty when the backend may be installed on ``model``; else why not (CUDA / meta parameters, no C library,
    a global module hook). Parameters that require grad do not prevent it: the fast versions run only under
    ``torch.inference_mode`` (the engine's steps), so training and the exact forward run the reference."""
    if kernels.library() is None:
        return "the CPU kernels are unavailable (DSV41_CPU_KERNELS=0 or no C compiler)"
    for p in model.parameters():
        if p.device.type != "cpu":
            return f"parameters on {p.device.type} (the fast backend is for CPU tensors)"
        break
    if global_hooks():
        return "a global module hook is registered"
    return ""


def install(model: nn.Module) -> Installed:
    """Install the fast paths on every module of ``model`` that has an installer (see the module docstring);
    earlier overrides are removed first. Returns what was installed. Never raises for a model it cannot serve:
    it installs nothing and says why."""
    _load_installers()
    uninstall(model)
    done = Installed()
    done.reason = supported(model)
    if done.reason:
        return done
    for m in model.modules():
        for fn in INSTALLERS.get(type(m), ()):
            if not hooked(m) and fn(m):
                done.modules[type(m).__name__] = done.modules.get(type(m).__name__, 0) + 1
    if not done.modules:
        done.reason = "no module of this model has a fast path"
    model.__dict__["_fast_installed"] = done
    return done


def uninstall(model: nn.Module) -> None:
    """Remove every override :func:`install` made on ``model``'s modules (the reference methods run again)."""
    for m in model.modules():
        for name in m.__dict__.pop(_OVERRIDES, ()):
            m.__dict__.pop(name, None)
        for key in [k for k in m.__dict__ if k.startswith("_fast_")]:
            del m.__dict__[key]


def installed(model: nn.Module) -> Installed | None:
    """What :func:`install` last did on ``model`` (None: never installed or uninstalled)."""
    return model.__dict__.get("_fast_installed")


def still_valid(model: nn.Module) -> bool:
    """Cheap check before a step: False (after uninstalling) when a global module hook appeared since install.
    Hooks on submodules and changed weights are not detected: reinstall after such changes."""
    if model.__dict__.get("_fast_installed") and global_hooks():
        uninstall(model)
        return False
    return True


def _load_installers() -> None:
    """Import the modules that register installers (kept out of import time of this package)."""
    from deepseek_v41.kernels.fast import installers  # noqa: F401
