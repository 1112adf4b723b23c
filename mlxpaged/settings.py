"""Every environment switch mlxpaged reads, in one place: name, meaning and default.

Read at the moment of use (not at import), so a test or a launcher may set them in-process.
`MLXPAGED_BLAS` alone is read by `_blas.py` itself, before MLX loads.
"""

from __future__ import annotations

import os
from pathlib import Path

# Metal kernels: unset (use them on an Apple GPU, fall back with one warning when one fails),
# "strict" (a kernel that fails to build or check raises), "emulate" (run them in the MSL emulator).
METAL = "MLXPAGED_METAL"
# "1": extra checks of the kernels' inputs on every call.
DEBUG = "MLXPAGED_DEBUG"
# Where converted checkpoints and downloaded data live (default ~/.cache/mlxpaged).
CACHE = "MLXPAGED_CACHE"
# Tensor parallelism: seconds a step's collectives may take; compare sampled tokens every N steps.
TP_TIMEOUT = "MLXPAGED_TP_TIMEOUT"
TP_CHECK_EVERY = "MLXPAGED_TP_CHECK_EVERY"
DEFAULT_TP_TIMEOUT = 60.0


def metal_mode() -> str | None:
    """None, "strict" or "emulate" (see METAL)."""
    return os.environ.get(METAL) or None


def metal_strict() -> bool:
    """A kernel failure raises instead of falling back (strict, and the emulator, where failures are bugs)."""
    return metal_mode() in ("strict", "emulate")


def debug() -> bool:
    return os.environ.get(DEBUG) == "1"


def cache_dir() -> Path:
    env = os.environ.get(CACHE)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mlxpaged"


def tp_timeout() -> float:
    return float(os.environ.get(TP_TIMEOUT, DEFAULT_TP_TIMEOUT))


def tp_check_every() -> int:
    return int(os.environ.get(TP_CHECK_EVERY, 0))
