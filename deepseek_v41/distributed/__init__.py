"""Beyond one process (issue 28): process groups, parallel layers and sharding, executors (uni / mp / ray) on
torch.distributed. See ``config`` (ParallelConfig), ``comm`` (ParallelState, collectives), ``layers`` (the parallel
modules), ``shard`` (shard_model, shard_bytes, check_shardable) and ``loader`` (load_sharded: a rank's slices read
straight from the checkpoint)."""
