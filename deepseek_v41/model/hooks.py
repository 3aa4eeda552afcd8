"""When a fast path may stand in for calling a module: the module is exactly its class and nothing observes or
wraps the call (a hook of its own, a global module hook, a subclass such as a LoRA wrapper)."""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as _module

# torch's registries of global module hooks (dicts it mutates in place).
_GLOBAL_HOOKS = (_module._global_forward_hooks, _module._global_forward_pre_hooks, _module._global_backward_hooks,
                 _module._global_backward_pre_hooks)


def hooked(m: nn.Module) -> bool:
    """Whether ``m`` has a forward or backward hook of its own."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def global_hooks() -> bool:
    """Whether a global module hook (``torch.nn.modules.module.register_module_forward_hook`` and the like) is
    registered: it observes every module call."""
    return any(_GLOBAL_HOOKS)


def plain_weights(*modules: tuple[nn.Module, type[nn.Module]]) -> list | None:
    """The ``weight`` of each ``(module, cls)`` when every module is :func:`unobserved` as its class and has no
    bias: then a kernel computing from the weights is exactly calling the modules (the caller checks the weights'
    shapes and dtypes); else None."""
    weights = []
    for m, cls in modules:
        if not unobserved(m, cls) or m._parameters.get("bias") is not None:
            return None
        weights.append(m._parameters["weight"])
    return weights


def unobserved(m: nn.Module, cls: type[nn.Module]) -> bool:
    """True when ``m`` is a ``cls`` (not a subclass) with no hook of its own and no global module hook: then
    computing its output directly is exactly calling it."""
    return type(m) is cls and not any(_GLOBAL_HOOKS) and not hooked(m)
