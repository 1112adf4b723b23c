"""`TPEngine`: the engine on one rank of a tensor-parallel group, built once every rank agrees on the
pool size, the checkpoint and the settings (collectives.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import random

import mlx.core as mx
import numpy as np

from .. import settings
from ..engine.llm_engine import LLMEngine
from ..engine.parts import build_parts
from ..errors import StepError
from ..worker.kv_cache import pool_blocks
from .collectives import (
    RankFailure,
    Watchdog,
    agree_min,
    broadcast_int,
    check_same_everywhere,
    collective,
    peer_lost,
    weights_identity,
)


# -- the engine ---------------------------------------------------------------------------------------
class TPEngine(LLMEngine):
    """`LLMEngine` on one rank of a tensor-parallel group (its model sharded by load_shard).

    Same inputs and seeds on every rank give the same schedule and samples; a failed step ends
    the rank (the others would otherwise wait forever in the next all_sum).
    """

    def __init__(
        self,
        loaded,
        config,
        group: mx.distributed.Group,
        *,
        timeout: float | None = None,
        check_every: int | None = None,
    ):
        """Built once every rank agrees on the pool size, the checkpoint and the settings; `timeout`
        and `check_every` default to the environment's (settings.py)."""
        timeout = settings.tp_timeout() if timeout is None else timeout
        check_every = settings.tp_check_every() if check_every is None else check_every
        check_same_everywhere(
            group,
            {
                "checkpoint config": loaded.config,
                "weights": weights_identity(loaded.path),
                "engine settings": {
                    **config.flat(),
                    "dtype": str(loaded.dtype),
                    "weights": loaded.weights,
                    "world": group.size(),
                    "check_every": check_every,
                    "mlx": mx.__version__,
                },
            },
        )
        # Free memory differs per host (and `generate` caps its pool by it): take what every rank can hold.
        config.cache.num_blocks = agree_min(group, pool_blocks(loaded, config))
        seed = broadcast_int(group, random.getrandbits(62))  # one seed source for every rank
        # The disk tier is namespaced by rank, and its lookups agree on the smallest hit count.
        ranks = (group.rank(), group.size(), lambda n: agree_min(group, n))
        super().__init__(loaded, config, parts=build_parts(loaded, config, ranks=ranks))
        self.group = group
        self.rank = group.rank()
        self._seeds = random.Random(seed)  # the same stream on every rank
        self.watchdog = Watchdog(self.rank, timeout)
        self.check_every = check_every
        self._token_hash = hashlib.sha256()
        self.num_checks = 0

    def add_request(self, prompt, params=None, request_id=None) -> str:
        from ..engine.sampling_params import SamplingParams

        params = params or SamplingParams()
        if params.seed is None:  # the base engine would draw a per-process random seed
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(31))
        return super().add_request(prompt, params, request_id)

    def step(self):
        self.watchdog.arm(f"step {self.stats.steps}")
        try:
            outs = super().step()
            if self.check_every:
                self._hash_step(outs)
                if self.stats.steps % self.check_every == 0:
                    self.check_agreement()
            return outs
        except StepError as e:
            cause = e.__cause__
            if peer_lost(cause):
                raise RankFailure(
                    f"rank {self.rank}: lost the connection to another rank during step {self.stats.steps} "
                    f"({str(cause).splitlines()[0]})"
                ) from None
            raise RankFailure(
                f"rank {self.rank}: step {self.stats.steps} failed ({cause}); the ranks cannot go on apart"
            ) from None
        finally:
            self.watchdog.disarm()

    def _hash_step(self, outs) -> None:
        """Fold this step's visible results (each sample's length and last token) into a running hash."""
        for o in outs:
            for c in o.outputs:
                self._token_hash.update(f"{o.request_id}:{c.index}:{len(c.token_ids)}:{c.token_ids[-1:]}|".encode())
        self._token_hash.update(f"free={self.block_manager.pool.num_free};".encode())

    def check_agreement(self) -> None:
        """Compare the running token hash across ranks; `RankFailure` on every rank if any differs."""
        mine = mx.array(np.frombuffer(self._token_hash.digest()[:16], np.uint8))
        every = np.array(collective(mx.distributed.all_gather, mine, group=self.group)).reshape(self.group.size(), 16)
        self.num_checks += 1
        bad = [r for r in range(1, self.group.size()) if not np.array_equal(every[r], every[0])]
        if bad:
            raise RankFailure(
                f"ranks diverged by step {self.stats.steps}: rank(s) {bad} sampled other tokens than rank 0"
            )
