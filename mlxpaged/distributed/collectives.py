"""Tensor-parallel ranks over MLX's own `mx.distributed` (ring, JACCL or MPI; started by `mlx.launch`).

Every rank runs the whole engine (scheduler, block manager, sampler) on the same inputs with the
same seeds; only the model is sharded (models/sharding.py), so block tables, forks, prefix hits
and preemptions are identical everywhere with no extra messages. This module holds what keeps
the ranks honest:

- `TPEngine()` (tp_engine.py): agree on the pool size, check at start-up that every rank has the same checkpoint
  and settings (a hash exchanged with all_gather), share one seed source;
- `TPEngine.step`: a watchdog deadline around each step's collectives, a lost peer turned into
  one clear `RankFailure`, and (debug mode) a running hash of the sampled tokens compared
  across ranks every N steps;
- `broadcast_json`: rank 0's object to every rank (the server's new and aborted requests).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time

import mlx.core as mx
import numpy as np

from ..errors import MlxPagedError


class RankFailure(MlxPagedError):
    """Another rank died, hung, diverged or disagrees: this rank cannot go on."""


# -- group and collectives ------------------------------------------------------------------------
def init_group(backend: str = "any") -> mx.distributed.Group:
    """The group `mlx.launch` set up (size 1 when this process was started alone)."""
    try:
        return mx.distributed.init(backend=backend)
    except RuntimeError as e:
        raise MlxPagedError(f"cannot join the distributed group: {str(e).splitlines()[0]}") from None


def launched_group() -> mx.distributed.Group | None:
    """The group when this process is one of several ranks, else None (a plain run)."""
    if not any(k in os.environ for k in ("MLX_HOSTFILE", "MLX_RANK", "OMPI_COMM_WORLD_SIZE", "MLX_JACCL_COORDINATOR")):
        return None
    group = init_group()
    return group if group.size() > 1 else None


def peer_lost(e: BaseException | None) -> bool:
    return isinstance(e, RuntimeError) and ("[ring]" in str(e) or "peer" in str(e) or "[jaccl]" in str(e))


def collective(fn, *args, group):
    """Run one collective now; a lost connection becomes one `RankFailure` line."""
    try:
        out = fn(*args, group=group)
        mx.eval(out)
        return out
    except RuntimeError as e:
        if peer_lost(e):
            raise RankFailure(
                f"rank {group.rank()}: lost the connection to another rank ({str(e).splitlines()[0]})"
            ) from None
        raise


def barrier(group: mx.distributed.Group) -> None:
    if group.size() > 1:
        collective(mx.distributed.all_sum, mx.zeros((1,), mx.int32), group=group)


def agree_min(group: mx.distributed.Group, value: int) -> int:
    """The smallest `value` over the ranks (e.g. the pool size every rank can afford)."""
    return int(collective(mx.distributed.all_min, mx.array([value], mx.int64), group=group).item())


def broadcast_json(group: mx.distributed.Group, obj=None):
    """Rank 0's JSON-able `obj`, on every rank (the others pass anything; it is ignored).

    Two all_sums: the length, then the UTF-8 bytes (the other ranks add zeros).
    """
    mine = json.dumps(obj).encode() if group.rank() == 0 else b""
    n = int(collective(mx.distributed.all_sum, mx.array([len(mine)], mx.int32), group=group).item())
    buf = np.frombuffer(mine, np.uint8) if mine else np.zeros(n, np.uint8)
    data = collective(mx.distributed.all_sum, mx.array(buf), group=group)
    return json.loads(bytes(np.array(data, dtype=np.uint8)).decode())


def broadcast_int(group: mx.distributed.Group, value: int) -> int:
    """Rank 0's `value` (< 2**62) on every rank."""
    mine = value if group.rank() == 0 else 0
    return int(collective(mx.distributed.all_sum, mx.array([mine], mx.int64), group=group).item())


# -- start-up agreement -----------------------------------------------------------------------------
def weights_identity(path) -> str:
    """A hash naming a checkpoint by content, not by path (two Macs store it in different places):
    config.json, every safetensors header, file sizes, and 64 evenly spread 4 KiB samples of
    each file's data, so a fine-tune of the same shape differs too."""
    from pathlib import Path

    h = hashlib.sha256((Path(path) / "config.json").read_bytes())
    for f in sorted(Path(path).glob("model*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}|{size}".encode())
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(n))
            span = size - 8 - n
            for i in range(64):
                fh.seek(8 + n + span * i // 64)
                h.update(fh.read(4096))
    return h.hexdigest()


def check_same_everywhere(group: mx.distributed.Group, parts: dict[str, object]) -> None:
    """Exchange a hash of each part (config, weights identity, engine settings) with all_gather;
    every rank raises the same one-line `RankFailure` naming the first part and rank that differ."""
    names = list(parts)
    digests = [hashlib.sha256(json.dumps(parts[k], sort_keys=True, default=str).encode()).digest()[:16] for k in names]
    mine = mx.array(np.frombuffer(b"".join(digests), np.uint8))
    every = np.array(collective(mx.distributed.all_gather, mine, group=group)).reshape(group.size(), len(names), 16)
    for r in range(1, group.size()):
        for i, name in enumerate(names):
            if not np.array_equal(every[r, i], every[0, i]):
                raise RankFailure(
                    f"rank {r} and rank 0 have different {name}: every rank must run the same checkpoint and settings"
                )


# -- the watchdog ---------------------------------------------------------------------------------------
class Watchdog:
    """A daemon thread that ends the process with one line when an armed deadline passes.

    A peer that exits closes its sockets and the ring backend raises at once; a peer that hangs
    or whose host vanishes never answers, so the collective would block forever: this is the
    bound on that wait. MLX releases the GIL while it evaluates, so the thread runs meanwhile.
    """

    def __init__(self, rank: int, timeout: float):
        self.rank, self.timeout = rank, timeout
        self._deadline: float | None = None
        self._what = ""
        threading.Thread(target=self._watch, daemon=True, name="mlxpaged-tp-watchdog").start()

    def arm(self, what: str) -> None:
        self._what, self._deadline = what, time.monotonic() + self.timeout

    def disarm(self) -> None:
        self._deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(0.25, self.timeout / 4))
            d = self._deadline
            if d is not None and time.monotonic() > d:
                sys.stderr.write(
                    f"error: rank {self.rank}: no answer from the other ranks for {self.timeout:g} s "
                    f"during {self._what} (a rank died or hung); exiting\n"
                )
                sys.stderr.flush()
                os._exit(1)
