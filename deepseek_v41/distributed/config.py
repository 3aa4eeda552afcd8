"""``ParallelConfig``: how one engine is spread over processes, with vLLM's names (issue 28).

vLLM's ``vllm/config/parallel.py`` names: ``tensor_parallel_size``, ``enable_expert_parallel``,
``data_parallel_size``, ``distributed_executor_backend`` ("uni", "mp", "ray"); multi-node launch flags ``--nnodes``,
``--node-rank``, ``--master-addr``, ``--master-port``, ``--headless``. ``expert_parallel_size`` is SGLang's
``--ep-size``: experts split over ranks while attention stays replicated (tensor parallel size 1).

One process group spans the ``world_size`` ranks; tensor and expert parallelism each use either all of it or none
(``tensor_parallel_size`` and the expert parallel size are 1 or ``world_size``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class ParallelConfig:
    """The parallel layout of one engine (see the module docstring).

    ``tensor_parallel_size``: ranks splitting attention heads, the dense / shared-expert intermediate dimension,
    the routed experts' intermediate dimension (without expert parallelism) and the vocabulary (embedding, LM head).
    ``enable_expert_parallel``: the routed experts are split whole over the tensor-parallel ranks (each owns
    ``n_routed_experts / world_size``; tokens dispatched and combined with all-to-all) instead of sliced.
    ``expert_parallel_size``: SGLang's ``--ep-size``; with ``tensor_parallel_size`` 1 it splits the experts over
    that many ranks that each run the whole attention (None: ``tensor_parallel_size`` when
    ``enable_expert_parallel``, else 1).
    ``data_parallel_size``: engine replicas behind one server, each with its own KV pool.
    ``distributed_executor_backend``: "uni" (one process), "mp" (worker processes), "ray" (Ray actors); None picks
    "uni" for one rank and "mp" otherwise.
    ``nnodes`` / ``node_rank`` / ``master_addr`` / ``master_port`` (0: a free port, single node only) /
    ``headless`` (a worker node: runs its ranks, serves nothing): multi-node launch with the mp backend.
    ``distributed_timeout_s``: how long a collective or a worker's step may take before the engine fails naming
    the rank (seconds).
    ``shard_engram``: split each Engram table by rows over the tensor-parallel ranks (one all-reduce of the looked-up
    rows per Engram layer) instead of keeping it whole on every rank; no effect without tensor parallelism. On by
    default: at the official size the two tables are 189 GiB (FP8), more than a 141 GB device holds beside anything
    else, while the split costs ~49 KB more per decode step at TP=8 (``dsv41 report -tp 8``; README).
    """

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    expert_parallel_size: int | None = None
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    headless: bool = False
    distributed_timeout_s: float = 60.0
    shard_engram: bool = True

    @property
    def ep_size(self) -> int:
        """Ranks the routed experts are split over (1: no expert parallelism)."""
        if self.expert_parallel_size is not None:
            return self.expert_parallel_size
        return self.tensor_parallel_size if self.enable_expert_parallel else 1

    @property
    def world_size(self) -> int:
        """Ranks of one engine replica: max(tensor parallel size, expert parallel size)."""
        return max(self.tensor_parallel_size, self.ep_size)

    @property
    def backend(self) -> str:
        """The executor backend this config runs on ("uni" for one rank unless given)."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"

    @property
    def local_world_size(self) -> int:
        """Ranks per node."""
        return self.world_size // self.nnodes

    def validate(self) -> ParallelConfig:
        """Check the settings; returns self. Raises ValueError naming the setting, what was given and what is
        allowed."""
        for name in ("tensor_parallel_size", "data_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        ep, tp, world = self.ep_size, self.tensor_parallel_size, self.world_size
        if not isinstance(ep, int) or ep < 1:
            raise ValueError(f"expert_parallel_size must be a positive integer, got {ep!r}")
        if tp not in (1, world) or ep not in (1, world):
            raise ValueError(f"tensor_parallel_size {tp} and expert_parallel_size {ep}: each must be 1 or the other "
                             "(one process group; e.g. --tensor-parallel-size 2 --enable-expert-parallel, or "
                             "--expert-parallel-size 2 alone)")
        if self.expert_parallel_size is not None and self.enable_expert_parallel and ep != tp:
            raise ValueError(f"enable_expert_parallel splits the experts over the {tp} tensor-parallel ranks; "
                             f"expert_parallel_size {ep} disagrees (give one of them)")
        if self.backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.backend == "uni" and world > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one process; {world} ranks need 'mp' or 'ray'")
        if world % self.nnodes:
            raise ValueError(f"{world} ranks do not split evenly over nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("several nodes need --master-port (the port node 0 listens on); 0 picks a free port "
                             "on one node only")
        if self.nnodes > 1 and self.backend != "mp":
            raise ValueError(f"several nodes run on the 'mp' backend (Ray places its actors itself), "
                             f"got {self.backend!r}")
        if self.headless and self.node_rank == 0:
            raise ValueError("--headless is for worker nodes (node_rank > 0); node 0 runs the engine's rank 0")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be positive seconds, got {self.distributed_timeout_s!r}")
        return self

    def as_dict(self) -> dict:
        """The fields as a JSON-able dict (workers receive their config this way)."""
        return asdict(self)
