"""How much slower than a quiet machine this one runs now, for the tests' wall-clock limits.

A test's time limit catches a livelock or a lost wake-up, not a slow machine: a laptop busy with
a browser and a build (load 8 on 2 cores) runs every CPU-bound process several times slower, and
its tests must pass there as they do on a quiet machine.
"""

from __future__ import annotations

import os

# Every test's pytest timeout (pyproject's, or its own mark) is a limit on a quiet machine; the run
# stretches it by this factor at least, or by twice the slowdown when the machine is busier (a
# process that uses both of 2 cores, at load 8, runs 8 times slower than alone).
LIVELOCK_SCALE = 4.0


def slowdown() -> float:
    """Runnable processes per core now (the 1-minute load average over the core count), at least 1:
    about how many times slower a CPU-bound process runs than on a quiet machine.
    MLXPAGED_TEST_SLOWDOWN, where set, is used instead."""
    forced = os.environ.get("MLXPAGED_TEST_SLOWDOWN")
    if forced:
        return max(1.0, float(forced))
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform (Windows)
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def wall(seconds: float) -> float:
    """`seconds`, a limit measured on a quiet machine, stretched for this machine's load now."""
    return seconds * slowdown()


def timeout_scale() -> float:
    """The factor on every test's pytest timeout for this run (see LIVELOCK_SCALE)."""
    return max(LIVELOCK_SCALE, 2 * slowdown())
