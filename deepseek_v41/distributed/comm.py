"""The process group of one engine and the collectives the sharded model calls (issue 28).

:class:`ParallelState` is what a sharded module holds: its rank's place in tensor / expert parallelism and the
collectives over the engine's one process group (gloo on CPU, NCCL on CUDA; torch.distributed). With one rank every
collective returns its input, so a model sharded for world size 1 is the unsharded model.

Every collective counts the bytes it moved (``ParallelState.comm_bytes``, by kind), so that ``bench/parallel.py``
measures the communication of a step against ``dsv41 report``'s figure. The count is the payload one rank hands
to the collective: all-reduce, the tensor reduced; all-gather, the local shard; all-to-all, the rows sent to the
other ranks. Tensors travel as they are (packed FP4 / FP8 bytes as bytes), except dtypes the backend cannot reduce
(bf16 / fp8 on gloo), which are widened for the reduction and narrowed back.
"""

from __future__ import annotations

import datetime
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from deepseek_v41.distributed.config import ParallelConfig


@dataclass
class ParallelState:
    """One rank's place in the engine's process group.

    ``rank`` / ``world_size``: the global rank and size; ``tp_rank`` / ``tp_size``, ``ep_rank`` / ``ep_size``:
    tensor and expert parallelism (each over the whole group or size 1). ``group``: the torch.distributed process
    group (None for one rank). ``comm_bytes``: bytes moved per collective kind since the last :meth:`reset_counts`.
    """

    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    group: object | None = None
    comm_bytes: Counter = field(default_factory=Counter)
    comm_calls: Counter = field(default_factory=Counter)

    @classmethod
    def single(cls) -> ParallelState:
        """The state of an unsharded, one-process engine."""
        return cls()

    @classmethod
    def of(cls, config: ParallelConfig, rank: int, group: object | None = None) -> ParallelState:
        """The state of ``rank`` under ``config`` (``group``: the initialised process group; None with one rank).
        Raises ValueError for a rank outside the world."""
        world = config.world_size
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        tp, ep = config.tensor_parallel_size, config.ep_size
        return cls(rank, world, rank if tp > 1 else 0, tp, rank if ep > 1 else 0, ep, group)

    def reset_counts(self) -> None:
        self.comm_bytes.clear()
        self.comm_calls.clear()

    def _count(self, kind: str, nbytes: int) -> None:
        self.comm_bytes[kind] += int(nbytes)
        self.comm_calls[kind] += 1

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (any shape) over the tensor-parallel ranks; returns the sum (t itself when it could be reduced
        in place). One rank, or a ``meta`` tensor (planning: counted, not sent): ``t``."""
        if self.tp_size == 1:
            return t
        self._count("all_reduce", t.numel() * t.element_size())
        if t.device.type == "meta":
            return t
        wide = _reducible(t)
        dist.all_reduce(wide, group=self.group)
        if wide is not t:
            t.copy_(wide)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` in rank order (``sizes``: each rank's length along ``dim``
        when they differ, 0 allowed; None: all equal to t's). Every rank gets the same tensor. One rank: ``t``; a
        ``meta`` tensor: counted, not sent. Raises ValueError when t's length is not ``sizes[rank]``."""
        if self.world_size == 1:
            return t
        dim = dim % t.dim()
        sizes = list(sizes) if sizes is not None else [t.shape[dim]] * self.world_size
        if len(sizes) != self.world_size or sizes[self.rank] != t.shape[dim]:
            raise ValueError(f"all_gather: rank {self.rank} holds {t.shape[dim]} rows along dim {dim}, sizes say "
                             f"{sizes} for {self.world_size} ranks")
        self._count("all_gather", t.numel() * t.element_size())
        moved = t.movedim(dim, 0)
        rest = moved.shape[1:]
        if t.device.type == "meta":
            return t.new_empty((sum(sizes), *rest)).movedim(0, dim)
        # Equal lengths on the wire (gloo's all_gather takes one size): shorter shards padded, then trimmed.
        top = max(sizes)
        padded = moved.new_zeros((top, *rest))
        padded[:moved.shape[0]] = moved
        parts = [moved.new_empty((top, *rest)) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)
        out = torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])
        return out.movedim(0, dim)

    def all_to_all(self, rows: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Send ``rows`` [N, ...] split by ``send_counts`` (rows for rank 0, 1, ...; summing to N) to the expert-
        parallel ranks; returns (the rows received, in rank order, [M, ...]; the counts received per rank). One
        rank: (rows, send_counts); ``meta`` rows (planning): counted, and every rank assumed to send as much
        (rows, send_counts)."""
        if self.ep_size == 1:
            return rows, list(send_counts)
        sent_elsewhere = sum(n for r, n in enumerate(send_counts) if r != self.rank)
        row_bytes = rows[0:1].numel() * rows.element_size() if rows.dim() else 0
        self._count("all_to_all", sent_elsewhere * row_bytes)
        if rows.device.type == "meta":
            return rows, list(send_counts)
        counts = torch.tensor(send_counts, dtype=torch.long, device=rows.device)  # (NCCL: CUDA tensors only)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        recv_counts = received.tolist()
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv_counts, list(send_counts), group=self.group)
        return out, recv_counts

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


def _reducible(t: torch.Tensor) -> torch.Tensor:
    """``t`` or a float32 copy where the backend cannot reduce its dtype (gloo: bf16, fp16, fp8)."""
    if t.device.type == "cpu" and t.dtype not in (torch.float32, torch.float64, torch.int32, torch.int64):
        return t.float()
    return t



def init_distributed(config: ParallelConfig, rank: int, init_method: str, device: torch.device | str = "cpu"
                     ) -> ParallelState:
    """Join the engine's process group as ``rank`` (gloo on CPU, NCCL on CUDA) at ``init_method``
    (``tcp://HOST:PORT``), with ``config.distributed_timeout_s`` as the collectives' timeout; returns the rank's
    :class:`ParallelState`. One rank: no process group. Raises ValueError for a bad config or rank."""
    config.validate()
    if config.world_size == 1:
        return ParallelState.single()
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=config.distributed_timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=config.world_size,
                            timeout=timeout)
    return ParallelState.of(config, rank, dist.group.WORLD)
