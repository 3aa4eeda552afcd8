"""The CPU fast backend: installed once on a loaded model, never consulted per call by the model (issue 24).

``deepseek_v41/model`` is the reference math only (what training, the exact forward and the engine all run).
This package holds the fast paths: for each model class that has one, an *installer* registered with
:func:`~deepseek_v41.kernels.fast.registry.register` (in :mod:`~deepseek_v41.kernels.fast.attention`, ``block``,
``decode``, ``dense`` and ``moe``, which this package imports) looks at one module instance once — its class is exactly
the registered class (not a subclass), it has no hooks, its weights have dtypes and shapes the kernels take — packs what
its fast forward needs (FP4 expert copies, stacked weights) and replaces methods of that instance (``forward``, or a
named method the reference forward calls, e.g. a block's mixing) with fast versions through :func:`override`. A fast
version serves the shapes it is made for (a few tokens, inference mode, CPU tensors) and calls the reference method
otherwise, so results never depend on whether the backend is installed beyond rounding (``tests/kernels``).

:func:`install` walks a model and runs the installers; the engine's model runner calls it once on the model it
serves. It installs nothing on CUDA, on ``meta`` tensors, or when
the C library is unavailable (``DSV41_CPU_KERNELS=0``, no compiler). :func:`uninstall` restores the reference
methods. Installing again replaces earlier overrides, so after changing weights in place, loading a state dict,
or registering a hook on a submodule, call :func:`install` again (or :func:`uninstall`): the fast versions read
weights captured at install time (and the MoE's decode copies, packed at the first few-token step).
:func:`still_valid` detects what is cheap to detect — a global module hook registered after install — and the engine
checks it before each step (``LLMEngine._step``): while such a hook is registered the reference runs (logged once),
and when it is removed the backend is installed again. Changed weights and hooks on submodules are not detected.

Installers work per module instance, so a sharded linear (tensor parallelism) gets its fast path the same way as
an unsharded one. Source: issue 24; vLLM's ``CustomOp`` (``forward_native`` beside ``forward_cpu``) decides an
op's implementation once in the same spirit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from deepseek_v41 import kernels

# The modules whose installers serve model classes: importing them registers the installers.
from deepseek_v41.kernels.fast import attention, block, decode, dense, moe  # noqa: F401
from deepseek_v41.kernels.fast.registry import (
    INSTALLERS,
    KERNEL_DTYPES,
    OVERRIDES,
    Installer,
    fused,
    global_hooks,
    hooked,
    override,
    plain,
    plain_weight,
    register,
)

log = logging.getLogger(__name__)

__all__ = ["INSTALLERS", "KERNEL_DTYPES", "Installed", "Installer", "fused", "global_hooks", "hooked", "install",
           "installed", "override", "plain", "plain_weight", "register", "still_valid", "supported", "uninstall"]

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
        for name in m.__dict__.pop(OVERRIDES, ()):
            m.__dict__.pop(name, None)
        for key in [k for k in m.__dict__ if k.startswith("_fast_")]:
            del m.__dict__[key]


def installed(model: nn.Module) -> Installed | None:
    """What :func:`install` last did on ``model`` (None: never installed or uninstalled)."""
    return model.__dict__.get("_fast_installed")


def still_valid(model: nn.Module) -> bool:
    """Cheap check before a step. A global module hook registered since install: uninstall (the hook then sees
    every module call), log it once, return False. That hook removed again: install again (logged) and return
    True. Hooks on submodules and changed weights are not detected: reinstall after such changes."""
    hooks = global_hooks()
    done = model.__dict__.get("_fast_installed")
    if done and hooks:
        uninstall(model)
        model.__dict__["_fast_suspended"] = True
        log.warning("a global module hook was registered: the engine runs the reference model (no CPU fast paths) "
                    "until it is removed")
        return False
    if hooks or not model.__dict__.get("_fast_suspended"):
        return True
    done = install(model)  # (drops the _fast_suspended mark with the other _fast_ entries)
    log.info("the global module hooks are gone: CPU fast paths installed again (%s)",
             ", ".join(f"{n} {k}" for k, n in done.modules.items()) or done.reason)
    return True
