"""What every kernel wrapper shares: the limits the C code keeps on its stack, and the errors for inputs it would
misread (empty tensors, other dtypes, rows too wide)."""

from __future__ import annotations

import torch

ROW_ON_STACK = 8192  # rows of up to this many floats the kernels widen / build on their stack (csrc/dsv41.h)
FEW_ROWS = 16  # up to this many tokens take the few-token kernels (decode, speculative verify)
FP32_BF16 = (torch.float32, torch.bfloat16)


def ptr(t: torch.Tensor | None) -> int | None:
    """The data pointer of ``t``, or None (a NULL pointer for the C code) when ``t`` is None."""
    return None if t is None else t.data_ptr()


def empty(kernel: str, **inputs: torch.Tensor | None) -> None:
    """Raises the ValueError for an empty input (a dimension of size 0) handed to a kernel, where its wrapper's
    one-line check failed: the C code would read through the tensor's NULL or dangling data pointer, or index the
    other inputs with counts derived from it (a zero-length prefill chunk reached ``window_step`` and crashed)."""
    shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in inputs.items() if t is not None and not t.numel())
    raise ValueError(f"{kernel} kernel: empty input {shapes}; every tensor it takes needs at least one element")


def refuse(kernel: str, wide: tuple[torch.Tensor, ...], fp32: tuple[torch.Tensor | None, ...] = (),
           same: torch.Tensor | None = None, row: int = 0) -> None:
    """Raises the ValueError for inputs a kernel would misread (or overrun a buffer of their size with), where its
    wrapper's one-line check failed: one of ``wide`` not fp32 or bf16, one of ``fp32`` (None skipped) not fp32,
    ``same`` not of ``wide[0]``'s dtype, or bf16 rows of ``row`` values wider than ROW_ON_STACK."""
    for t in wide:
        if t.dtype not in FP32_BF16:
            raise ValueError(f"{kernel} kernel takes fp32 or bf16 tensors here, got {t.dtype}")
    for t in fp32:
        if t is not None and t.dtype != torch.float32:
            raise ValueError(f"{kernel} kernel takes fp32 tensors here, got {t.dtype}")
    if same is not None and same.dtype != wide[0].dtype:
        raise ValueError(f"{kernel} kernel: {same.dtype} beside {wide[0].dtype} (both fp32 or both bf16)")
    raise ValueError(f"{kernel} kernel: bf16 rows of up to {ROW_ON_STACK} values, got {row}")
