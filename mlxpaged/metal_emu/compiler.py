"""Compiling lowered MSL into a shared library, cached on disk by content hash.

The compiler is the same everywhere: `python -m ziglang c++` (clang, from the `ziglang` wheel
the test extra installs; its first run spends about a minute building its C++ library cache),
unless `$MLXPAGED_EMU_CXX` names another clang >= 17 (`__bf16` arithmetic and
`-fbfloat16-excess-precision` arrived in clang 17; clang 16 rejects every kernel's flags).
A system clang is never picked up by itself: its runtime library (Debian 12's clang links
libgcc 12) may lack builtins the kernels call, and a machine's results should not depend on what
else it has installed. Any accepted compiler gives working bf16: runtime.cpp defines the bf16
conversion builtins itself (weakly). Libraries live in `$MLXPAGED_EMU_CACHE` (default
`~/.cache/mlxpaged/metal_emu`), named by the SHA-256 of everything that affects them (source,
shim, runtime, flags, compiler command and `--version`, host CPU), so a stale library is never
reused and concurrent builders never see a half-written file (atomic rename).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Per-operation rounding for half/bfloat (no excess precision), no FMA contraction (results
# comparable with numpy), and load/store tracing for the byte counts and bounds checks.
KERNEL_FLAGS = [
    "-std=c++17",
    "-O1",
    "-fPIC",
    "-g0",
    "-fno-sanitize=all",
    "-Xclang",
    "-ffloat16-excess-precision=none",
    "-Xclang",
    "-fbfloat16-excess-precision=none",
    "-ffp-contract=off",
    "-fno-exceptions",
    "-fno-threadsafe-statics",
    "-fno-strict-aliasing",
    # Vectorizers could merge loads into widths the tracing does not report (> 16 bytes).
    "-fno-vectorize",
    "-fno-slp-vectorize",
    # Nor may loop idioms: clang 19 turns a two-float copy loop into an 8-byte memcpy, then one
    # i64 store, which the alignment check would blame on the kernel (a GPU stores two floats).
    "-fno-builtin-memcpy",
    "-fno-builtin-memset",
    "-fstack-clash-protection",  # large frames probe each page, so they hit the guard page
    # zig targets the host CPU; AVX512-BF16 / AVX-NE-CONVERT float->bf16 instructions flush
    # subnormals to zero, so bf16 always goes through __truncsfbf2 (exact, same on every CPU).
    "-Xclang",
    "-target-feature",
    "-Xclang",
    "-avx512bf16",
    "-Xclang",
    "-target-feature",
    "-Xclang",
    "-avxneconvert",
    "-fsanitize-coverage=inline-8bit-counters,trace-loads,trace-stores",
    "-Wno-unknown-attributes",
    "-Wno-ignored-attributes",
    "-Wno-gcc-compat",
    "-Wno-c++20-extensions",
    "-Wno-c++2b-extensions",
    "-Wno-unused-value",
    "-Wno-deprecated-declarations",
    "-Wno-unknown-pragmas",
    "-Wno-c++17-extensions",
    "-Wno-macro-redefined",
]
# The oldest clang that compiles the kernels (__bf16 arithmetic, -fbfloat16-excess-precision).
MIN_CLANG = 17
# metal_shim.h and the headers it includes from this directory.
SHIM_HEADERS = ("metal_shim.h", "metal_simdgroup_matrix.h")
RUNTIME_FLAGS = ["-std=c++17", "-O2", "-fPIC", "-g0", "-fno-sanitize=all", "-fno-exceptions"]


class CompileError(RuntimeError):
    """The kernel source did not compile; the message holds the compiler's diagnostics."""


def cache_dir() -> Path:
    d = Path(os.environ.get("MLXPAGED_EMU_CACHE") or Path.home() / ".cache" / "mlxpaged" / "metal_emu")
    d.mkdir(parents=True, exist_ok=True)
    return d


def clang_major(cmd: tuple[str, ...]) -> int:
    """Major version of the clang that `cmd` runs (0: not a clang, or it does not run)."""
    m = re.search(r"clang version (\d+)", compiler_version(cmd))
    return int(m.group(1)) if m else 0


@functools.cache
def _cpu_identity() -> str:
    """Libraries are built for the host CPU: a cache shared between machines must not mix them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = re.search(r"^flags\s*:(.*)$", text, re.M)
        model = re.search(r"^model name\s*:(.*)$", text, re.M)
        return f"{model.group(1).strip() if model else ''}|{flags.group(1).strip() if flags else ''}"
    except OSError:
        import platform

        return platform.machine()


@functools.cache
def compiler() -> tuple[tuple[str, ...], str]:
    """(command prefix, identity string for the cache key) of the C++ compiler to use."""
    env = os.environ.get("MLXPAGED_EMU_CXX", "").strip()
    if env:
        cmd = tuple(env.split())
        major = clang_major(cmd)
        if major < MIN_CLANG:
            found = f"clang {major}" if major else "not a clang that runs"
            raise CompileError(f"MLXPAGED_EMU_CXX={env!r}: the MSL emulator needs clang >= {MIN_CLANG} ({found})")
        return cmd, f"{env} {compiler_version(cmd)} {_cpu_identity()}"
    try:
        import ziglang  # noqa: F401
    except ImportError:
        raise CompileError(
            "the MSL emulator compiles with the `ziglang` wheel (pip install -e '.[test]') "
            f"or the clang >= {MIN_CLANG} that MLXPAGED_EMU_CXX names"
        ) from None
    cmd = (sys.executable, "-m", "ziglang", "c++")
    return cmd, f"zig {compiler_version(cmd)} {_cpu_identity()}"


def compiler_version(cmd: tuple[str, ...]) -> str:
    """The compiler's full `--version` text: any upgrade changes the cache key."""
    try:
        return subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=300).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _run(cmd: list[str], what: str) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise CompileError(f"{what} failed:\n{p.stderr[-20000:]}")


def include_dir() -> Path:
    """A directory holding `metal_stdlib` & co. that include the shim (made once per shim and
    place: the headers name the shim's absolute path, so a checkout moved or removed must not
    leave its successor including a file that is gone)."""
    shim = HERE / "metal_shim.h"
    h = hashlib.sha256(shim_bytes() + str(shim).encode()).hexdigest()[:16]
    d = cache_dir() / f"include-{h}"
    if not (d / "metal_stdlib").exists():
        tmp = Path(tempfile.mkdtemp(dir=cache_dir()))
        for name in (
            "metal_stdlib",
            "metal_math",
            "metal_simdgroup",
            "metal_atomic",
            "metal_compute",
            "metal_integer",
            "metal_common",
            "metal_logging",
            "metal_simdgroup_matrix",
        ):
            (tmp / name).write_text(f'#include "{shim}"\n')
        try:
            tmp.rename(d)
        except OSError:  # another process won
            shutil.rmtree(tmp, ignore_errors=True)
    return d


def shim_bytes() -> bytes:
    """The shim and the headers it includes: all of them key the caches."""
    return b"\0".join((HERE / n).read_bytes() for n in SHIM_HEADERS)


@functools.cache
def runtime_object() -> Path:
    """runtime.cpp compiled once (without tracing: its own accesses must not count)."""
    cmd, ident = compiler()
    src = HERE / "runtime.cpp"
    key = hashlib.sha256(src.read_bytes() + repr((RUNTIME_FLAGS, ident)).encode()).hexdigest()[:24]
    out = cache_dir() / f"runtime-{key}.o"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp.o")
        _run([*cmd, *RUNTIME_FLAGS, "-c", str(src), "-o", str(tmp)], "compiling runtime.cpp")
        os.replace(tmp, out)
    return out


def build(lowered_source: str, driver: str) -> Path:
    """Shared library for one lowered kernel source plus its generated entry point."""
    cmd, ident = compiler()
    shim = shim_bytes()
    rt = runtime_object()
    key = hashlib.sha256(
        b"\0".join(
            [lowered_source.encode(), driver.encode(), shim, rt.read_bytes(), repr((KERNEL_FLAGS, ident)).encode()]
        )
    ).hexdigest()[:32]
    out = cache_dir() / f"k-{key}.so"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        src = Path(tmp) / "kernel.metal"
        src.write_text(lowered_source)
        drv = Path(tmp) / "driver.cpp"
        drv.write_text(f'#include "{src}"\n{driver}')
        obj = Path(tmp) / "kernel.o"
        _run([*cmd, *KERNEL_FLAGS, "-I", str(include_dir()), "-c", str(drv), "-o", str(obj)], "compiling the kernel")
        so = Path(tmp) / "k.so"
        _run([*cmd, "-shared", "-fPIC", "-fno-sanitize=all", str(obj), str(rt), "-o", str(so)], "linking the kernel")
        os.replace(so, out)
    return out
