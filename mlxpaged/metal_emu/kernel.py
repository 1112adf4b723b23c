"""`metal_kernel`: a drop-in for `mx.fast.metal_kernel` that runs kernels on the CPU.

A call builds the exact source MLX would compile (`last_source`), lowers and compiles it
once (cached), copies each input into a guarded buffer, runs the launch in runtime.cpp and
returns the outputs as MLX arrays. Invariants:
  * Buffers are passed in the order and form of the generated signature (`source.ParamInfo`).
  * Outputs start as `init_value` when given, else 0xFF in every byte (NaN for float16,
    bfloat16 and float32), as do threadgroup arrays, so a missed write shows; outputs also
    keep a written-byte bitmap (`LaunchStats.bytes_unwritten`).
  * Inputs are always passed row-contiguous (with matching `_strides`), whatever
    `ensure_row_contiguous` says: MLX's strided views have no Python-visible storage.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import warnings
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from . import compiler
from .lower import lower
from .source import Generated, generated_source, metal_utils_preamble

ATTR_OFFSETS = {
    "thread_position_in_grid": 0,
    "threadgroup_position_in_grid": 3,
    "thread_position_in_threadgroup": 6,
    "threads_per_threadgroup": 9,
    "dispatch_threads_per_threadgroup": 12,
    "threadgroups_per_grid": 15,
    "threads_per_grid": 18,
    "grid_size": 18,
    "grid_origin": 21,
    "thread_index_in_threadgroup": 24,
    "simdgroup_index_in_threadgroup": 25,
    "thread_index_in_simdgroup": 26,
    "threads_per_simdgroup": 27,
    "simdgroups_per_threadgroup": 28,
    "dispatch_simdgroups_per_threadgroup": 29,
    "quadgroup_index_in_threadgroup": 30,
    "thread_index_in_quadgroup": 31,
    "quadgroups_per_threadgroup": 32,
    "dispatch_quadgroups_per_threadgroup": 33,
    "thread_execution_width": 34,
}
ORDERS = {"forward": 0, "reverse": 1, "random": 2}
# Register model: Apple GPUs spill beyond about 128 live 32-bit values per thread.
DEFAULT_REGISTER_BUDGET = 128
# A threadgroup's registers must fit one GPU core's register file; Apple7/8 cores (M1, M2),
# the smallest, hold about 208 KB. A launch whose threads per threadgroup x register estimate
# x 4 bytes exceeds it is refused ($MLXPAGED_EMU_REGFILE_BYTES overrides; 0 disables).
DEFAULT_REGISTER_FILE_BYTES = 208 * 1024
# Threads per threadgroup a launch may use. Metal's limit is 1024, but MLX checks each compiled
# pipeline's maxTotalThreadsPerThreadgroup, which the compiler lowers for register-heavy kernels
# (896 on an M2 Ultra in mlx-vlm#1799); 256 is what every pipeline we know of allows (MLX's steel
# attention runs 128). A launch over it is refused ($MLXPAGED_EMU_MAX_THREADS overrides).
DEFAULT_MAX_THREADS = 256
# Attribute pairs Metal rejects together in one kernel signature (two names for one value).
CONFLICTING_ATTRIBUTES = (("thread_execution_width", "threads_per_simdgroup"),)
DEFAULT_STACK = 256 * 1024
DEFAULT_TIMEOUT = 600  # seconds; 0 disables the watchdog


class MetalEmuError(RuntimeError):
    """A kernel misbehaved under the emulator: out-of-bounds access (named buffer or threadgroup
    array), threadgroup-memory data race, divergent barrier or SIMD-group function, deadlock,
    endless loop, stack overflow, too much threadgroup memory."""


class RegisterBudgetWarning(UserWarning):
    """A launch's register estimate (`LaunchStats.registers`) exceeds the stated budget."""


class _Buffer(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("lo", ctypes.c_void_p),
        ("hi", ctypes.c_void_p),
        ("map_lo", ctypes.c_void_p),
        ("map_hi", ctypes.c_void_p),
        ("bytes_read", ctypes.c_uint64),
        ("bytes_written", ctypes.c_uint64),
        ("is_output", ctypes.c_int64),
        ("written_map", ctypes.c_void_p),
        ("bytes_unwritten", ctypes.c_uint64),
    ]


class _LaunchDesc(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_int32 * 3),
        ("tg", ctypes.c_int32 * 3),
        ("order", ctypes.c_int32),
        ("strict_barriers", ctypes.c_int32),
        ("race_check", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("seed", ctypes.c_uint64),
        ("timeout_s", ctypes.c_int64),
        ("stack_size", ctypes.c_int64),
        ("entry", ctypes.c_void_p),
        ("args", ctypes.POINTER(ctypes.c_void_p)),
        ("buffers", ctypes.POINTER(_Buffer)),
        ("n_buffers", ctypes.c_int64),
        ("stats", ctypes.c_uint64 * 24),
        ("pool", ctypes.c_void_p),
    ]


@dataclass
class LaunchStats:
    """What one launch did. `bytes_read`/`bytes_written` cover every buffer by name (inputs,
    their `_shape`/`_strides`/`_ndim` arrays and outputs); counts are exact: every load and store
    the compiled code executes is traced."""

    order: str
    threads: int
    threadgroups: int
    barriers: int
    simd_ops: int
    barriers_with_exited_threads: int
    threadgroup_memory_bytes: int
    bytes_read: dict = field(default_factory=dict)
    bytes_written: dict = field(default_factory=dict)
    bytes_unwritten: dict = field(default_factory=dict)  # output name -> bytes no store touched
    # Register model: live 32-bit values per thread estimated from the thread-private arrays
    # (and structs holding arrays) and built-in scalars and vectors the launch declared, summed
    # (each declaration once, however often it ran); an upper bound, not a compile.
    registers: int = 0
    scalar_registers: int = 0  # the scalars' and vectors' part of `registers`
    register_budget: int = DEFAULT_REGISTER_BUDGET
    threads_per_threadgroup: int = 0
    register_file_bytes: int = DEFAULT_REGISTER_FILE_BYTES
    # Cost model (runtime.cpp STAT_*): exp/exp2 calls and device loads are per lane (by width in
    # bytes: {1: n, 2: n, 4: n, 8: n, 16: n}); shuffles/reductions per simdgroup-wide call.
    exp_calls: int = 0
    exp2_calls: int = 0
    simd_shuffles: int = 0
    simd_reductions: int = 0
    barriers_without_threadgroup_fence: int = 0
    device_loads: dict = field(default_factory=dict)
    # simdgroup_matrix functions (simdgroup-wide calls): multiply(-accumulate)s, loads, stores.
    simdgroup_mma: int = 0
    simdgroup_matrix_loads: int = 0
    simdgroup_matrix_stores: int = 0

    @property
    def array_registers(self) -> int:
        """The arrays' part of `registers`: what spills first (indexed storage)."""
        return self.registers - self.scalar_registers

    @property
    def over_register_budget(self) -> bool:
        # The spill budget is about indexed storage; scalars count against the register file.
        return self.array_registers > self.register_budget

    @property
    def threadgroup_register_bytes(self) -> int:
        """Registers a threadgroup holds: threads per threadgroup x estimate x 4 bytes."""
        return 4 * self.threads_per_threadgroup * self.registers

    @property
    def over_register_file(self) -> bool:
        return 0 < self.register_file_bytes < self.threadgroup_register_bytes


# ---------------------------------------------------------------------------------------------
# Lane order: call kwarg > `lane_order()` context > $MLXPAGED_EMU_ORDER > forward.
_order_override = threading.local()


def parse_order(text: str) -> tuple[str, int]:
    """ "forward" | "reverse" | "random[:seed]" -> (name, seed)."""
    name, _, seed = text.strip().partition(":")
    if name not in ORDERS:
        raise ValueError(f"lane order must be forward, reverse or random[:seed], not {text!r}")
    return name, int(seed) if seed else 0


@contextlib.contextmanager
def lane_order(order: str):
    """Run emulated launches in this block with the given lane (and threadgroup) order."""
    parse_order(order)
    prev = getattr(_order_override, "value", None)
    _order_override.value = order
    try:
        yield
    finally:
        _order_override.value = prev


def current_order(explicit: str | None = None) -> tuple[str, int]:
    text = explicit or getattr(_order_override, "value", None) or os.environ.get("MLXPAGED_EMU_ORDER") or "forward"
    return parse_order(text)


# ---------------------------------------------------------------------------------------------
_libs: dict[str, ctypes.CDLL] = {}
_lock = threading.Lock()  # one launch at a time, process-wide: they share _POOL
# Every library links its own runtime; all of them run on this one set of fiber stacks and
# threadgroup arena (runtime.cpp `Pool`, zero-initialised, filled by the first launch), so the
# process's memory mappings do not grow by ~520 per compiled kernel.
_POOL = ctypes.create_string_buffer(64)


def _load(path) -> ctypes.CDLL:
    key = str(path)
    if key not in _libs:
        lib = ctypes.CDLL(key)
        lib.mlxemu_launch.argtypes = [ctypes.POINTER(_LaunchDesc), ctypes.c_char_p, ctypes.c_int]
        lib.mlxemu_launch.restype = ctypes.c_int
        lib.mlxemu_alloc.argtypes = [
            ctypes.c_int64,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_void_p),
        ]
        lib.mlxemu_alloc.restype = ctypes.c_void_p
        lib.mlxemu_free.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        _libs[key] = lib
    return _libs[key]


def _driver(gen: Generated) -> str:
    """C++ entry point calling the kernel with each parameter cast from the argument array."""
    args = []
    for i, p in enumerate(gen.params):
        if p.msl_type.endswith("&"):
            args.append(f"*({p.msl_type[:-1]}*)a[{i}]")
        else:
            args.append(f"({p.msl_type})a[{i}]")
    for name, ty in gen.attributes:
        o = ATTR_OFFSETS[name]
        args.append(f"metal::uint3{{t[{o}], t[{o + 1}], t[{o + 2}]}}" if ty == "uint3" else f"t[{o}]")
    fn = gen.kernel_name + gen.template_def
    return (
        '\nextern "C" __attribute__((visibility("default"), used))\n'
        "void mlxemu_entry(void* const* a, const unsigned int* t) {\n"
        f"  (void)a; (void)t;\n  {fn}(\n    " + ",\n    ".join(args) + ");\n}\n"
    )


def _raw_dtype(itemsize: int):
    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]


def _bytes_of(x: mx.array) -> bytes:
    """Row-contiguous bytes of an MLX array of any dtype (bfloat16 included)."""
    raw = x.view(getattr(mx, f"uint{8 * x.dtype.size}")) if x.dtype != mx.bool_ else x.astype(mx.uint8)
    return np.ascontiguousarray(np.array(raw)).tobytes()


def _array_from(buf: bytes, shape, dtype: mx.Dtype) -> mx.array:
    raw = np.frombuffer(buf, dtype=_raw_dtype(dtype.size)).reshape(shape)
    if dtype == mx.bool_:
        return mx.array(raw.astype(bool))
    return mx.array(raw).view(dtype)


class EmulatedKernel:
    """The callable `metal_kernel(...)` returns. After each call: `last_source` (the exact MSL
    MLX would compile), `last_stats` ({input name: bytes read}) and `last_launch`
    (`LaunchStats`)."""

    def __init__(
        self, name, input_names, output_names, source, header="", ensure_row_contiguous=True, atomic_outputs=False
    ):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self.last_source: str | None = None
        self.last_stats: dict[str, int] = {}
        self.last_launch: LaunchStats | None = None
        self._libs: dict[str, ctypes.CDLL] = {}  # generated source -> its library

    def __call__(
        self,
        *,
        inputs,
        output_shapes,
        output_dtypes,
        grid,
        threadgroup,
        template=None,
        init_value=None,
        verbose=False,
        stream=None,
        order=None,
    ):
        inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        for got, want, what in (
            (len(inputs), len(self.input_names), "inputs"),
            (len(output_shapes), len(self.output_names), "output_shapes"),
            (len(output_dtypes), len(self.output_names), "output_dtypes"),
        ):
            if got != want:
                raise ValueError(f"[metal_kernel] Expected `{what}` to have size {want} but got size {got}.")
        grid, threadgroup = tuple(int(v) for v in grid), tuple(int(v) for v in threadgroup)
        if len(grid) != 3 or len(threadgroup) != 3 or min(grid + threadgroup) < 1:
            raise ValueError(f"[metal_kernel] bad grid {grid} or threadgroup {threadgroup}")
        gen = generated_source(
            name=self.name,
            input_names=self.input_names,
            output_names=self.output_names,
            source=self.source,
            header=self.header,
            atomic_outputs=self.atomic_outputs,
            inputs=inputs,
            output_dtypes=output_dtypes,
            template=template,
        )
        preamble = metal_utils_preamble()
        full = preamble + gen.source
        self.last_source = full
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{gen.source}\n```", flush=True)
        lib = self._libs.get(gen.source)
        if lib is None:
            for a, b in CONFLICTING_ATTRIBUTES:
                if (a, "uint") in gen.attributes and (b, "uint") in gen.attributes:
                    raise compiler.CompileError(
                        f"{self.name}.metal: attributes [[{a}]] and [[{b}]] conflict (one kernel "
                        "may declare only one of them)"
                    )
            body = (
                len(preamble) + gen.source.index(") {\n", gen.source.index(f"[[kernel]] void {gen.kernel_name}(")) + 4
            )
            lowered = lower(full, len(preamble), f"{self.name}.metal", kernel_span=(body, body + len(self.source)))
            lib = self._libs[gen.source] = _load(compiler.build(lowered, _driver(gen)))

        # MLX clamps the threadgroup to the grid (group_dims = min(tg, grid)).
        tg = tuple(min(t, g) for t, g in zip(threadgroup, grid))
        cap = int(os.environ.get("MLXPAGED_EMU_MAX_THREADS", DEFAULT_MAX_THREADS))
        if 0 < cap < tg[0] * tg[1] * tg[2]:
            raise MetalEmuError(
                f"[{self.name}] launch refused: a threadgroup of {tg[0] * tg[1] * tg[2]} threads is over "
                f"{cap}, what every Mac's pipelines allow (MLX raises when a pipeline's "
                "maxTotalThreadsPerThreadgroup is lower)"
            )
        order_name, seed = current_order(order)
        with _lock:
            return self._launch(lib, gen, inputs, output_shapes, output_dtypes, grid, tg, init_value, order_name, seed)

    def _launch(self, lib, gen, inputs, output_shapes, output_dtypes, grid, tg, init_value, order_name, seed):
        datas: list[bytes | None] = []
        fills: list[int] = []
        for p in gen.params:
            if p.kind == "input":
                datas.append(_bytes_of(inputs[p.input_index]))
            elif p.kind == "shape":
                datas.append(np.array(inputs[p.input_index].shape, np.int32).tobytes())
            elif p.kind == "strides":
                shape = inputs[p.input_index].shape
                strides = [int(np.prod(shape[i + 1 :], dtype=np.int64)) for i in range(len(shape))]
                datas.append(np.array(strides, np.int64).tobytes())
            elif p.kind == "ndim":
                datas.append(np.array(inputs[p.input_index].ndim, np.int32).tobytes())
            else:  # output
                shape, dt = tuple(output_shapes[p.input_index]), output_dtypes[p.input_index]
                if init_value is not None:
                    datas.append(_bytes_of(mx.full(shape, init_value, dtype=dt)))
                else:
                    datas.append(None)
                    fills.append(int(np.prod(shape, dtype=np.int64)) * dt.size)
        bufs = (_Buffer * len(gen.params))()
        names = [p.name.encode() for p in gen.params]
        args = (ctypes.c_void_p * max(1, len(gen.params)))()
        fill_it = iter(fills)
        maps = []  # keeps the outputs' written-byte bitmaps alive during the launch
        try:
            for i, (p, data) in enumerate(zip(gen.params, datas)):
                n = len(data) if data is not None else next(fill_it)
                lo, hi = ctypes.c_void_p(), ctypes.c_void_p()
                ptr = lib.mlxemu_alloc(n, 0xFF, ctypes.byref(lo), ctypes.byref(hi))
                if not ptr:
                    raise MemoryError(f"cannot map {n} bytes for buffer {p.name!r}")
                if data:
                    ctypes.memmove(ptr, data, n)
                wmap = None
                if p.kind == "output":
                    wmap = np.zeros(n // 8 + 1, np.uint8)
                    maps.append(wmap)
                bufs[i] = _Buffer(
                    names[i],
                    ptr,
                    ptr + n,
                    lo.value,
                    hi.value,
                    0,
                    0,
                    p.kind == "output",
                    wmap.ctypes.data if wmap is not None else None,
                    0,
                )
                args[i] = ptr
            desc = _LaunchDesc()
            desc.grid[:] = grid
            desc.tg[:] = tg
            desc.order = ORDERS[order_name]
            # A barrier after some threads returned is an error unless MLXPAGED_EMU_STRICT=0.
            desc.strict_barriers = os.environ.get("MLXPAGED_EMU_STRICT", "1") != "0"
            desc.race_check = os.environ.get("MLXPAGED_EMU_RACES", "1") != "0"
            desc.seed = seed
            desc.timeout_s = int(os.environ.get("MLXPAGED_EMU_TIMEOUT", DEFAULT_TIMEOUT))
            desc.stack_size = int(os.environ.get("MLXPAGED_EMU_STACK", DEFAULT_STACK))
            desc.entry = ctypes.cast(lib.mlxemu_entry, ctypes.c_void_p).value
            desc.args = args
            desc.buffers = bufs
            desc.n_buffers = len(gen.params)
            desc.pool = ctypes.addressof(_POOL)
            err = ctypes.create_string_buffer(2048)
            rc = lib.mlxemu_launch(ctypes.byref(desc), err, len(err))
            st = list(desc.stats)
            self.last_launch = LaunchStats(
                order=order_name if order_name != "random" else f"random:{seed}",
                threads=st[0],
                threadgroups=st[1],
                barriers=st[2],
                simd_ops=st[3],
                barriers_with_exited_threads=st[4],
                threadgroup_memory_bytes=st[5],
                bytes_read={p.name: bufs[i].bytes_read for i, p in enumerate(gen.params)},
                bytes_written={p.name: bufs[i].bytes_written for i, p in enumerate(gen.params)},
                bytes_unwritten={
                    p.name: bufs[i].bytes_unwritten for i, p in enumerate(gen.params) if p.kind == "output"
                },
                registers=st[6] // 4,
                scalar_registers=st[20] // 4,
                register_budget=int(os.environ.get("MLXPAGED_EMU_REG_BUDGET", DEFAULT_REGISTER_BUDGET)),
                threads_per_threadgroup=tg[0] * tg[1] * tg[2],
                register_file_bytes=int(os.environ.get("MLXPAGED_EMU_REGFILE_BYTES", DEFAULT_REGISTER_FILE_BYTES)),
                exp_calls=st[7],
                exp2_calls=st[8],
                simd_shuffles=st[9],
                simd_reductions=st[10],
                barriers_without_threadgroup_fence=st[11],
                device_loads={w: st[12 + i] for i, w in enumerate((1, 2, 4, 8, 16))},
                simdgroup_mma=st[17],
                simdgroup_matrix_loads=st[18],
                simdgroup_matrix_stores=st[19],
            )
            self.last_stats = {p.name: bufs[i].bytes_read for i, p in enumerate(gen.params) if p.kind == "input"}
            if rc != 0:
                raise MetalEmuError(f"[{self.name}] {err.value.decode(errors='replace')}")
            st_ = self.last_launch
            if st_.over_register_file:
                raise MetalEmuError(
                    f"[{self.name}] launch refused: {st_.threads_per_threadgroup} threads per "
                    f"threadgroup x about {st_.registers} registers each = "
                    f"{st_.threadgroup_register_bytes / 1024:.0f} KB of registers, over one GPU "
                    f"core's register file ({st_.register_file_bytes / 1024:.0f} KB on Apple7/8): "
                    "use fewer threads per threadgroup"
                )
            if self.last_launch.over_register_budget:
                warnings.warn(
                    f"[{self.name}] about {self.last_launch.array_registers} live 32-bit values "
                    f"per thread exceed the register budget of "
                    f"{self.last_launch.register_budget} (Apple GPUs spill beyond it)",
                    RegisterBudgetWarning,
                    stacklevel=3,
                )
            outs = []
            for i, p in enumerate(gen.params):
                if p.kind == "output":
                    shape, dt = tuple(output_shapes[p.input_index]), output_dtypes[p.input_index]
                    n = bufs[i].hi - bufs[i].lo
                    outs.append(_array_from(ctypes.string_at(bufs[i].lo, n), shape, dt))
            return outs
        finally:
            for b in bufs:
                if b.map_lo:
                    lib.mlxemu_free(b.map_lo, b.map_hi)


def metal_kernel(
    name, input_names, output_names, source, header="", ensure_row_contiguous=True, atomic_outputs=False
) -> EmulatedKernel:
    """Same signature as `mx.fast.metal_kernel`; the kernel runs on the CPU emulator."""
    return EmulatedKernel(name, input_names, output_names, source, header, ensure_row_contiguous, atomic_outputs)
