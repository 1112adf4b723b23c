"""The MSL front-end check (`python -m mlxpaged.metal_emu.frontend`, issue 22): every kernel
variant the engine can build passes clang's C++-for-OpenCL front end, whose keyword and
address-space rules Metal shares; each error Apple's compiler reports, injected into a copy of
metal/, fails the check at its line.

clang comes with the test extra (`ziglang`); without it these tests fail with a message, they
never skip.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlxpaged.metal_emu import frontend

METAL = Path(__file__).resolve().parents[1] / "metal"


@pytest.fixture(scope="module", autouse=True)
def clang():
    problem = frontend.clang_available()
    assert not problem, f"the front-end check needs clang from the test extra's ziglang: {problem}"


def test_every_shipped_variant_passes():
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "mlxpaged.metal_emu.frontend"], capture_output=True, text=True, timeout=1800
    )
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"(\d+) kernel variants checked in [\d.]+ s: 0 errors", r.stderr)
    assert m, r.stderr
    n = int(m.group(1))
    # Every kind of kernel, dtype and quantization is in the grid.
    vs = frontend.variants()
    names = {v.name for v in vs}  # names without the dtype: MLX's add the template values
    assert n == len(vs) == len({(v.name, str(v.template[0][1])) for v in vs}) > 5000
    for kind in (
        "paged_attention_hd",
        "paged_attention_partitioned_hd",
        "paged_attention_merge_",
        "paged_attention_quant_",
        "paged_attention_partitioned_quant_",
        "paged_attention_varlen_hd",
        "paged_attention_varlen_quant_",
        "paged_attention_varlen_mma_",
    ):
        assert any(x.startswith(kind) for x in names), kind
    print(f"front-end check: {n} variants in {took:.1f} s")


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "metal"
    shutil.copytree(METAL, dst)
    return dst


def _inject(root: Path, fname: str, old: str, new: str) -> int:
    """Replace the first `old` in root/fname by `new`; the 1-based line where `new` starts."""
    path = root / fname
    text = path.read_text()
    assert old in text, f"{old!r} not in {fname}"
    i = text.index(old)
    path.write_text(text[:i] + new + text[i + len(old) :])
    return text.count("\n", 0, i) + 1 + new[: len(new) - len(new.lstrip("\n"))].count("\n")


def _errors_at(root: Path, fname: str) -> dict[int, list[str]]:
    errors, n = frontend.check(root, only=frontend.representatives())
    assert n == len(frontend.representatives())
    out: dict[int, list[str]] = {}
    for e in errors:
        assert e.file.endswith(fname) or e.file.endswith(".h") or e.file.endswith(".metal"), str(e)
        if Path(e.file).name == fname:
            out.setdefault(e.line, []).append(e.message)
    return out


INJECTIONS = {
    # The two errors of issue 22, as they were.
    "half as a name": (
        "paged_attention.h",
        "const int mid = n / 2;",
        "const int half = n / 2;",
        "cannot combine with previous 'int' declaration specifier",
    ),
    "static member without constant": (
        "paged_attention_varlen.metal",
        "static constexpr constant int value = 1;",
        "static constexpr int value = 1;",
        "program scope variable must reside in constant address space",
    ),
    "pointer without address space": (
        "paged_attention.h",
        "inline float pa_dot(const threadgroup float* q, const thread float* k) {",
        "inline float pa_dot(const threadgroup float* q, const float* k) {",
        "without an address space",
    ),
    "threadgroup array in a helper": (
        "paged_attention.h",
        "  float s = 0.0f;\n  if (D % 4 == 0) {",
        "  threadgroup float scratch[D];\n  float s = scratch[0];\n  if (D % 4 == 0) {",
        "local address space",
    ),
    "device to thread cast": (
        "paged_attention.h",
        "    pa_load<T, D>(cache + off, out);",
        "    thread const T* p = (thread const T*)(cache + off);\n    pa_load<T, D>(cache + off, out);",
        "address space",
    ),
    "recursive helper": (
        "paged_attention.h",
        "// Smallest power of two >= n, for 1 <= n <= 32.",
        "inline int pa_depth(int n) { return n <= 1 ? 0 : 1 + pa_depth(n / 2); }\n"
        "// Smallest power of two >= n, for 1 <= n <= 32.",
        "recursive call",
    ),
}


@pytest.mark.parametrize("case", list(INJECTIONS))
def test_injected_error_fails_at_its_line(tmp_path, case):
    fname, old, new, message = INJECTIONS[case]
    root = _copy(tmp_path)
    line = _inject(root, fname, old, new)
    errors = _errors_at(root, fname)
    assert line in errors, f"no error at {fname}:{line}; got {errors}"
    assert any(message in m for m in errors[line]), errors[line]


def test_cli_names_the_line_and_exits_nonzero(tmp_path):
    root = _copy(tmp_path)
    line = _inject(
        root,
        "paged_attention_varlen.metal",
        "static constexpr constant int value = 32 / BITS;",
        "static constexpr int value = 32 / BITS;",
    )
    r = subprocess.run(
        [sys.executable, "-m", "mlxpaged.metal_emu.frontend", "--source", str(root), "--one-per-kernel", "--quiet"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    want = (
        f"{root / 'paged_attention_varlen.metal'}:{line}: program scope variable must reside in constant address space"
    )
    assert any(ln.startswith(want) for ln in r.stdout.splitlines()), r.stdout
    assert r.stderr == ""  # --quiet: no summary


def test_cli_passes_on_a_clean_copy(tmp_path):
    root = _copy(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "mlxpaged.metal_emu.frontend", "--source", str(root), "--one-per-kernel"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout == ""
