"""MSL emulator: run `mx.fast.metal_kernel` kernels on the CPU, with bug detectors.

    from mlxpaged.metal_emu import metal_kernel        # same signature as mx.fast.metal_kernel
    k = metal_kernel(name=..., input_names=[...], output_names=[...], source=..., header="")
    outs = k(inputs=[...], template=[("T", mx.float16)], grid=(x, y, z), threadgroup=(x, y, z),
             output_shapes=[...], output_dtypes=[...])   # -> list[mx.array]
    k.last_source   # the exact text MLX would compile (utils preamble + generated source)
    k.last_stats    # {input name: bytes the launch read from it}
    k.last_launch   # LaunchStats: threads, barriers, bytes read/written per buffer, ...

The kernel source is compiled as C++ by clang against a Metal shim (metal_shim.h) and each GPU
thread runs as a fiber (runtime.cpp). Bugs it reports as `MetalEmuError`: out-of-bounds reads
and writes (named by buffer), threadgroup-memory data races (a missing barrier), SIMD-group
functions (simdgroup_matrix loads, stores and multiplies included) and barriers in divergent
control flow, deadlocks, endless loops, barriers without
`mem_threadgroup` used to order threadgroup memory, casts between address spaces, misplaced
threadgroup declarations; a register estimate over budget is a `RegisterBudgetWarning`. See README.md.
Threadgroup memory and outputs start as NaN (0xFF bytes), and lanes run in a chosen
order (`MLXPAGED_EMU_ORDER=forward|reverse|random[:seed]`, `lane_order(...)`, or `order=` on
the call) so missing barriers and writes change results.
May import: `attention` (the front-end check reads the kernels' sources).
"""

from __future__ import annotations

import contextlib
import threading

import mlx.core as mx

from .. import settings
from .compiler import CompileError
from .kernel import EmulatedKernel, LaunchStats, MetalEmuError, RegisterBudgetWarning, lane_order, metal_kernel
from .source import metal_utils_preamble, mlx_compiled_source, mlx_generated_source

__all__ = [
    "metal_kernel",
    "get_metal_kernel",
    "emulate",
    "lane_order",
    "mlx_compiled_source",
    "mlx_generated_source",
    "metal_utils_preamble",
    "EmulatedKernel",
    "LaunchStats",
    "MetalEmuError",
    "CompileError",
    "RegisterBudgetWarning",
]

_force = threading.local()


@contextlib.contextmanager
def emulate():
    """Within this block `get_metal_kernel()` returns the emulator even on a Mac."""
    prev = getattr(_force, "on", False)
    _force.on = True
    try:
        yield
    finally:
        _force.on = prev


def get_metal_kernel():
    """`mx.fast.metal_kernel` when Metal is available and not overridden, else the emulator's.

    Overrides: `MLXPAGED_METAL=emulate` in the environment, or an active `emulate()` block.
    """
    if getattr(_force, "on", False) or settings.metal_mode() == "emulate":
        return metal_kernel
    try:
        native = bool(mx.metal.is_available())
    except Exception:
        native = False
    return mx.fast.metal_kernel if native else metal_kernel
