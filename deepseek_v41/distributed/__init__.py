"""Beyond one process (issue 28): process groups, parallel layers and sharding, executors (uni / mp / ray) on
torch.distributed. See ``config`` (ParallelConfig), ``comm`` (ParallelState, collectives)."""
