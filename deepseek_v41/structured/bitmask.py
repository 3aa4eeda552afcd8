"""The token bitmask both backends fill: int32 ``[rows, ceil(V / 32)]``, bit ``t % 32`` of word ``t // 32`` set
when token t is allowed (xgrammar's and llguidance's layout), and its application to logits."""

from __future__ import annotations

import torch
from torch import Tensor

_SHIFTS: dict[torch.device, Tensor] = {}


def bitmask_width(vocab_size: int) -> int:
    """Words per bitmask row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(rows: int, vocab_size: int) -> Tensor:
    """A CPU int32 bitmask ``[rows, ceil(vocab_size / 32)]`` with every token allowed (all bits set)."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def token_allowed(bitmask: Tensor, row: int, token_id: int) -> bool:
    """Whether ``bitmask[row]`` allows ``token_id``."""
    return bool((int(bitmask[row, token_id >> 5]) >> (token_id & 31)) & 1)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place.

    Args:
        logits: [R, V] float (any device); modified in place.
        bitmask: [R, ceil(V / 32)] int32 (CPU or ``logits``' device); extra words past V are ignored.

    Raises:
        ValueError: the row counts differ or the bitmask is too narrow for V.
    """
    rows, vocab = logits.shape
    if bitmask.shape[0] != rows or bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"a bitmask of shape {tuple(bitmask.shape)} cannot mask logits of shape {(rows, vocab)}")
    device = logits.device
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = bitmask.to(device, non_blocking=True)
    allowed = ((words[:, :, None] >> shifts) & 1).view(rows, -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))
