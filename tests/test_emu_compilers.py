"""The MSL emulator gives working, correctly rounded bfloat16 with every compiler it accepts.

The bf16 tests run once per compiler: `ziglang` (`python -m ziglang c++` from the test extra,
always) and `system-clang` ($MLXPAGED_EMU_CXX if set, else the newest `clang++-NN`/`clang++`
>= 17 on PATH; skipped, saying so, on a machine that has none). Each compiler builds into its
own fresh library cache, and every kernel library there must carry that compiler's version in
its ELF `.comment`, so nothing one compiler built can stand in for the other. Neither Debian
12's libgcc 12 nor zig's compiler-rt has `__truncsfbf2`: bf16 kernels failed to load
("undefined symbol") with Debian's clang-19, and with zig on CPUs without AVX512-BF16, until
runtime.cpp defined the conversion builtins itself.

References: the paged-attention kernel against the pure-MLX reference (test_metal_kernel's
helpers); float -> bf16 conversions against MLX's `astype(bfloat16)`; double -> bf16 against
the exact nearest bf16 computed with fractions.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import shutil
import struct
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxpaged.metal_emu as emu  # noqa: E402  (the project's own emulator: never skipped)
from mlxpaged.attention import metal
from mlxpaged.metal_emu import compiler  # noqa: E402

from kernel_cases import ORDERS, run_case, sweep_cases  # noqa: E402

COMPILERS = ("ziglang", "system-clang")


def system_clang() -> str | None:
    """$MLXPAGED_EMU_CXX, else the newest clang++-NN / clang++ on PATH that the emulator accepts."""
    named = os.environ.get("MLXPAGED_EMU_CXX", "").strip()
    if named:
        return named
    for name in [f"clang++-{v}" for v in range(40, compiler.MIN_CLANG - 1, -1)] + ["clang++"]:
        exe = shutil.which(name)
        if exe and compiler.clang_major((exe,)) >= compiler.MIN_CLANG:
            return exe
    return None


def _clear_caches() -> None:
    # compiler() and runtime_object() are memoised per process, and each kernel object keeps the
    # libraries it loaded: all three must forget the previous compiler.
    compiler.compiler.cache_clear()
    compiler.runtime_object.cache_clear()
    metal._kernel.cache_clear()


@pytest.fixture(scope="module")
def cache_dirs(tmp_path_factory) -> dict[str, Path]:
    return {name: tmp_path_factory.mktemp(f"emu-cache-{name}") for name in COMPILERS}


@pytest.fixture(params=COMPILERS)
def emu_compiler(request, monkeypatch, cache_dirs):
    """Point the emulator at one compiler and its own library cache; yields its version line."""
    if request.param == "system-clang":
        exe = system_clang()
        if exe is None:
            pytest.skip(
                f"[expected] no system clang++ >= {compiler.MIN_CLANG} on PATH (e.g. apt-get install "
                "clang-19); the ziglang case ran, this one did not"
            )
        monkeypatch.setenv("MLXPAGED_EMU_CXX", exe)
    else:
        monkeypatch.delenv("MLXPAGED_EMU_CXX", raising=False)
    monkeypatch.setenv("MLXPAGED_EMU_CACHE", str(cache_dirs[request.param]))
    _clear_caches()
    cmd, _ = compiler.compiler()
    if request.param == "ziglang":
        assert "ziglang" in cmd, cmd
    version = compiler.compiler_version(cmd).splitlines()[0]
    yield version
    _clear_caches()


def assert_built_by(version: str) -> None:
    """Every kernel library in the current cache was compiled by the compiler `version` names."""
    libs = sorted(compiler.cache_dir().glob("k-*.so"))
    assert libs, "no kernel library was built"
    for lib in libs:
        assert version.encode() in lib.read_bytes(), f"{lib.name} was not built by {version!r}"


# ---------------------------------------------------------------------------------------------
# Which compiler


def test_default_ignores_system_clang(monkeypatch, tmp_path):
    """A clang on PATH does not replace ziglang: only MLXPAGED_EMU_CXX chooses another."""
    fake = tmp_path / "clang++-30"
    fake.write_text("#!/bin/sh\necho 'clang version 30.0.0'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("MLXPAGED_EMU_CXX", raising=False)
    compiler.compiler.cache_clear()
    try:
        assert "ziglang" in compiler.compiler()[0]
        monkeypatch.setenv("MLXPAGED_EMU_CXX", "clang++-30")
        compiler.compiler.cache_clear()
        assert compiler.compiler()[0] == ("clang++-30",)
    finally:
        compiler.compiler.cache_clear()


def test_rejects_a_compiler_that_is_not_clang(monkeypatch):
    monkeypatch.setenv("MLXPAGED_EMU_CXX", sys.executable)  # prints "Python 3.x", not a clang
    compiler.compiler.cache_clear()
    try:
        want = rf"needs clang >= {compiler.MIN_CLANG} \(not a clang that runs\)"
        with pytest.raises(emu.CompileError, match=want):
            compiler.compiler()
    finally:
        compiler.compiler.cache_clear()


# ---------------------------------------------------------------------------------------------
# The paged-attention kernel in bfloat16

# One single-pass and one split (partitioned + merge) case of the sweep: every bf16 kernel kind.
BF16_CASES = [
    next(c for c in sweep_cases() if c["dtype"] == "bfloat16" and c["split"] == split) for split in (False, True)
]


def test_bf16_paged_attention_matches_reference(emu_compiler, emulated):
    for case in BF16_CASES:
        for order in ORDERS:
            emulated(order)
            err = run_case(case)
            assert err <= 1.0, f"{case} mismatch {err} with lane order {order}"
    assert_built_by(emu_compiler)


# ---------------------------------------------------------------------------------------------
# float -> bfloat16 inside a kernel (the compiler's codegen plus __truncsfbf2)


def special_floats() -> np.ndarray:
    """Ties (even and odd kept LSB), one off a tie, subnormals, the overflow edge, inf, NaNs
    (quiet, signalling, negative, payloads), zeros, plus random bit patterns."""
    bits = [
        0x3F808000,
        0x3F818000,
        0x3F807FFF,
        0x3F808001,
        0xBF808000,
        0xBF818000,  # ties near 1
        0x00008000,
        0x00018000,
        0x00000001,
        0x00007FFF,
        0x007FFFFF,
        0x807F8000,  # subnormals
        0x00800000,
        0x0080C000,
        0x7F7F7FFF,
        0x7F7F8000,
        0x7F7FFFFF,
        0xFF7FFFFF,  # normal edges
        0x7F800000,
        0xFF800000,
        0x00000000,
        0x80000000,
        0x7FC00000,
        0xFFC00000,
        0x7F800001,
        0xFF800001,
        0x7FA00000,
        0x7FFFFFFF,
        0x7F80FFFF,
    ]
    rng = np.random.default_rng(0)
    rand = rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    small = rng.integers(0, 0x01000000, size=512, dtype=np.uint32)  # subnormal / tiny exponents
    return np.concatenate([np.array(bits, np.uint32), rand, small, small | 0x80000000])


def check_bf16(src_bits: np.ndarray, got: np.ndarray, want: np.ndarray) -> None:
    """`got` equals `want` bit for bit, except NaNs: any quiet NaN of the source's sign."""
    nan_in = (src_bits & 0x7FFFFFFF) > 0x7F800000
    np.testing.assert_array_equal(got[~nan_in], want[~nan_in])
    g = got[nan_in].astype(np.uint32)
    assert np.all((g & 0x7F80) == 0x7F80) and np.all(g & 0x0040), "a NaN did not stay a quiet NaN"
    np.testing.assert_array_equal(g >> 15, src_bits[nan_in] >> 31)  # sign kept


CONVERT = "uint i = thread_position_in_grid.x; out[i] = static_cast<bfloat16_t>(x[i]);"


def test_bf16_conversion_in_kernel_matches_mlx(emu_compiler):
    bits = special_floats()
    x = mx.array(bits.view(np.float32))
    k = emu.metal_kernel(name="to_bf16", input_names=["x"], output_names=["out"], source=CONVERT)
    out = k(
        inputs=[x], grid=(x.size, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape], output_dtypes=[mx.bfloat16]
    )[0]
    got = np.array(out.view(mx.uint16))
    want = np.array(x.astype(mx.bfloat16).view(mx.uint16))
    check_bf16(bits, got, want)
    assert_built_by(emu_compiler)


# ---------------------------------------------------------------------------------------------
# The runtime's own conversions (the ones the kernel libraries link, with both compilers)


@pytest.fixture
def runtime_lib(emu_compiler, tmp_path):
    """runtime.cpp as built for kernels, linked alone into a library ctypes can call."""
    cmd, _ = compiler.compiler()
    so = tmp_path / "rt.so"
    subprocess.run(
        [*cmd, "-shared", "-fPIC", str(compiler.runtime_object()), "-o", str(so)], check=True, capture_output=True
    )
    lib = ctypes.CDLL(str(so))
    lib.mlxemu_bf16_from_float.argtypes = [ctypes.c_float]
    lib.mlxemu_bf16_from_float.restype = ctypes.c_uint16
    lib.mlxemu_bf16_from_double.argtypes = [ctypes.c_double]
    lib.mlxemu_bf16_from_double.restype = ctypes.c_uint16
    return lib


def test_runtime_float_to_bf16_matches_mlx(runtime_lib):
    bits = special_floats()
    got = np.array([runtime_lib.mlxemu_bf16_from_float(float(v)) for v in bits.view(np.float32)], np.uint16)
    want = np.array(mx.array(bits.view(np.float32)).astype(mx.bfloat16).view(mx.uint16))
    check_bf16(bits, got, want)


# Every finite non-negative bf16 value, ascending, with +inf standing at 2**128 (the next value
# of the exponent range): rounding to it is exactly IEEE overflow.
_BF16_VALUES: list[Fraction] = []


def bf16_values() -> list[Fraction]:
    if not _BF16_VALUES:
        for b in range(0x7F80):
            e, m = b >> 7, b & 0x7F
            _BF16_VALUES.append(
                Fraction(m, 128) * Fraction(2) ** -126 if e == 0 else Fraction(128 + m, 128) * Fraction(2) ** (e - 127)
            )
        _BF16_VALUES.append(Fraction(2) ** 128)
    return _BF16_VALUES


def exact_bf16(d: float) -> int:
    """The bf16 nearest to `d` (ties to even), by exact rational arithmetic."""
    sign = 0x8000 if struct.pack(">d", d)[0] & 0x80 else 0
    if d in (float("inf"), float("-inf")):
        return sign | 0x7F80
    a, vals = abs(Fraction(d)), bf16_values()
    if a >= vals[-1]:
        return sign | 0x7F80
    hi = bisect.bisect_left(vals, a)
    if vals[hi] == a:
        return sign | hi
    lo = hi - 1
    below, above = a - vals[lo], vals[hi] - a
    pick = lo if below < above or (below == above and lo % 2 == 0) else hi
    return sign | pick


def special_doubles() -> list[float]:
    """Random doubles over the whole bf16 range and beyond, and double-rounding traps: just
    above and below each tie, where rounding to float first would make an exact tie."""
    rng = np.random.default_rng(1)
    vals = [
        0.0,
        -0.0,
        1.0,
        -2.5,
        float("inf"),
        float("-inf"),
        1e-300,
        -1e-300,
        1e300,
        3.4e38,
        3.39e38,
        2.0**-133,
        2.0**-134,
        3 * 2.0**-135,
        2.0**-150,
    ]
    for e in rng.integers(-140, 130, size=300):
        vals.append(float(rng.uniform(1, 2) * 2.0 ** int(e) * rng.choice([-1, 1])))
    bf = bf16_values()
    for i in rng.integers(1, len(bf) - 2, size=150):
        tie = (bf[i] + bf[i + 1]) / 2
        for nudge in (Fraction(1, 2**40), -Fraction(1, 2**40), 0):
            vals.append(float(tie * (1 + nudge)))
    return vals


def test_runtime_double_to_bf16_rounds_once(runtime_lib):
    vals = special_doubles()
    got = [runtime_lib.mlxemu_bf16_from_double(v) for v in vals]
    want = [exact_bf16(v) for v in vals]
    bad = [(v, hex(g), hex(w)) for v, g, w in zip(vals, got, want) if g != w]
    assert not bad, f"{len(bad)} wrong, e.g. {bad[:5]}"
    # The traps are real: converting through float first gets some of them wrong.
    with np.errstate(over="ignore"):
        as_f32 = np.array(vals).astype(np.float32)
    twice = np.array(mx.array(as_f32).astype(mx.bfloat16).view(mx.uint16)).tolist()
    assert sum(t != w for t, w in zip(twice, want)) > 0
    nan = runtime_lib.mlxemu_bf16_from_double(float("nan"))
    assert nan & 0x7F80 == 0x7F80 and nan & 0x40
