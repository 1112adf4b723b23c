"""On Linux, let MLX's CPU backend use the system OpenBLAS instead of the wheel's reference BLAS.

The `mlx[cpu]` wheel links a slow reference BLAS. Loading OpenBLAS into the global symbol
scope before MLX's library is loaded makes MLX's `cblas_*` calls resolve to it: float32
matmuls run ~15x faster on two cores. Nothing happens on macOS, when MLX is already loaded,
when no OpenBLAS is installed (`apt-get install libopenblas0-pthread`), or with
`MLXPAGED_BLAS=bundled`.
"""

from __future__ import annotations

import ctypes
import os
import sys

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

loaded: str | None = None


def use_system_blas() -> str | None:
    """Load OpenBLAS globally if that can still take effect; returns its path or None."""
    global loaded
    if loaded or not sys.platform.startswith("linux") or "mlx.core" in sys.modules:
        return loaded
    if os.environ.get("MLXPAGED_BLAS", "auto") == "bundled":
        return None
    for path in [os.environ.get("MLXPAGED_BLAS", "")] + list(CANDIDATES):
        if path and os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                loaded = path
                break
            except OSError:
                continue
    return loaded
