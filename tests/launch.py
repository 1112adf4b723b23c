"""Two local ranks under `mlx.launch --backend ring`: the launcher, free port pairs, and why ranks cannot start here."""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

LAUNCH = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or shutil.which("mlx.launch")


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (the ring backend listens on one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port pair")


def ring_command(*args: str) -> list[str]:
    """`mlx.launch -n 2 --backend ring` on a free port pair with this Python, then `args` (a
    script and its arguments, or `-m module ...`)."""
    port = str(_free_port_pair())
    return [LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", port, "--python", sys.executable, "--", *args]


def _ring_can_start() -> str | None:
    """Why two local ring ranks cannot start here, or None when they can."""
    if LAUNCH is None:
        return "mlx.launch is not installed"
    import mlx.core as mx

    if not mx.distributed.is_available():
        return "MLX was built without distributed support"
    return None


def wait_healthy(port: int, procs: list) -> None:
    """Wait (up to 2 minutes) until the server on `port` answers /health; fails with rank 0's
    stderr if a rank ended first."""
    import time
    import urllib.request

    for _ in range(240):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return
        except OSError:
            assert all(p.poll() is None for p in procs), procs[0].stderr.read()
            time.sleep(0.5)
