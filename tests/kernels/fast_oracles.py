"""Helpers for tests of the fast backend's attention paths (deepseek_v41/kernels/fast/attention.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from deepseek_v41.kernels import fast


@contextmanager
def reference(model: nn.Module, cls: type[nn.Module], *names: str) -> Iterator[None]:
    """Inside: every instance of exactly ``cls`` in ``model`` runs the reference methods ``names`` (their fast
    overrides set aside; every other fast path stays installed)."""
    saved = [(m, name, m.__dict__.pop(name)) for m in model.modules() if type(m) is cls for name in names
             if name in m.__dict__]
    try:
        yield
    finally:
        for m, name, fn in saved:
            m.__dict__[name] = fn


@contextmanager
def hooked(model: nn.Module, module: nn.Module, hook, pre: bool = False) -> Iterator[None]:
    """Inside: ``hook`` registered on ``module`` (a forward pre-hook with ``pre``) and the backend reinstalled on
    ``model`` (hooks added after install need a reinstall); after: the hook removed and the backend reinstalled."""
    handle = module.register_forward_pre_hook(hook) if pre else module.register_forward_hook(hook)
    fast.install(model)
    try:
        yield
    finally:
        handle.remove()
        fast.install(model)


def installed_models(models: dict) -> dict:
    """``models`` (dtype -> model) with the fast backend installed on each."""
    for model in models.values():
        assert fast.install(model), "the fast backend installs on a CPU model"
    return models
