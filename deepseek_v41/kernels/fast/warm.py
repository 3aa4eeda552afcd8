"""Warming a block's Python objects before a few-token forward reads them (the fast ``Transformer.run_layers`` of
:mod:`deepseek_v41.kernels.fast.block` calls :func:`warm` before each block of a decode / verify step).

A decode step streams the model's weights through the caches (~35 MB for the bench model, more than its L3), so
when a block's Python code runs again one step later, the objects it reads (modules, their ``__dict__`` and hook
dicts, parameters and their C++ tensors) have been evicted, and each attribute read waits for memory, one at a
time: the checks a fast path makes before standing in for module calls cost ~3x as much inside an engine step
as in a microbenchmark (bench/README.md). :func:`warm` issues prefetch hints for all of them at once, so the
misses overlap. Only hints: the addresses are gathered once per :data:`REFRESH` forwards of a block and may go
stale when the model changes (a prefetch of a stale address reads nothing and never faults); every check still
reads the objects themselves, so results and behaviour are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from deepseek_v41 import kernels

_KEY = "_fast_warm_addresses"  # on the module's __dict__: uninstalling the backend drops it (a "_fast_" name)
REFRESH = 256  # forwards of a block between two gatherings of its objects' addresses
MAX_CHILDREN = 64  # a container with more submodules than this is left out (see object_addresses)
_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_modules", "_parameters",
          "_buffers")


def object_addresses(module: nn.Module) -> torch.Tensor:
    """int64 [n]: where the objects a forward of ``module`` reads live: each submodule, its ``__dict__`` and the
    dicts of hooks, submodules, parameters and buffers in it, and each parameter and buffer (the Python tensor
    and its C++ TensorImpl). CPython's ``id`` is the object's address. A ``ModuleList`` / ``ModuleDict`` of more
    than :data:`MAX_CHILDREN` modules is left out with all it holds: the routed experts of a large MoE (384 in
    the flash config), of which a step reads only the few it picks, would be thousands of lines of hints."""
    out: list[int] = []
    stack = [module]
    while stack:
        m = stack.pop()
        d = m.__dict__
        out += [id(m), id(d)]
        out += [id(d[k]) for k in _DICTS if k in d]
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:
                out.append(id(t))
                impl = getattr(t, "_cdata", None)  # (torch's own handle: the TensorImpl's address)
                if isinstance(impl, int):
                    out.append(impl)
        for child in m._modules.values():
            if child is not None and not (isinstance(child, (nn.ModuleList, nn.ModuleDict))
                                          and len(child) > MAX_CHILDREN):
                stack.append(child)
    return torch.tensor(out, dtype=torch.int64)


def warm(module: nn.Module) -> None:
    """Prefetch the objects a forward of ``module`` is about to read (see the module docstring); its addresses are
    kept on the module and gathered again every :data:`REFRESH` calls, the first time after a count that differs
    from block to block, so that the blocks of a model do not all gather on the same step."""
    state = module.__dict__.get(_KEY)
    if state is None or state[1] >= REFRESH:
        state = [object_addresses(module), 0 if state is not None else (id(module) >> 6) % REFRESH]
        module.__dict__[_KEY] = state
    state[1] += 1
    kernels.prefetch(state[0])
