"""Everything tensor-parallel over MLX's own `mx.distributed`: collectives, start-up agreement and
the watchdog (collectives.py), sharded layers (sharding.py), per-rank shard loading
(shard_loading.py) and the per-rank engine (tp_engine.py). Only the engine builder imports it back.
May import: `engine`, `worker`, `loading`, `models`."""
