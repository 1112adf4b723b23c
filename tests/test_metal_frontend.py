"""The MSL front-end check (`python -m mlxpaged.metal_emu.frontend`): every kernel
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
from mlxpaged.testing.slowness import wall

METAL = Path(__file__).resolve().parents[1] / "metal"


@pytest.fixture(scope="module", autouse=True)
def clang():
    problem = frontend.clang_available()
    assert not problem, f"the front-end check needs clang from the test extra's ziglang: {problem}"


def test_every_shipped_variant_passes():
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "mlxpaged.metal_emu.frontend"], capture_output=True, text=True, timeout=wall(1800)
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


def one_per_section() -> list:
    """One variant per kernel section and quantization (float16): what these injections need."""
    reps: dict[tuple, frontend.Variant] = {}
    for v in frontend.variants():
        reps.setdefault((v.group, v.section, bool(v.prefix)), v)
    return list(reps.values())


def _errors_at(root: Path, fname: str) -> dict[int, list[str]]:
    errors, n = frontend.check(root, only=one_per_section())
    assert n == len(one_per_section())
    out: dict[int, list[str]] = {}
    for e in errors:
        assert e.file.endswith(fname) or e.file.endswith(".h") or e.file.endswith(".metal"), str(e)
        if Path(e.file).name == fname:
            out.setdefault(e.line, []).append(e.message)
    return out


INJECTIONS = {
    # The two errors Apple's compiler once reported, as they were.
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
        timeout=wall(600),
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
        timeout=wall(600),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout == ""


# --- the rules MSL adds to C++, each with an injected error and its legal twin ----
#
# Each rule: (file, anchor, error snippet, legal twin, message regex). The snippet goes before
# the anchor; its line marked `// <-` is where the error must be reported. All errors go into
# one copy of metal/ and all twins into another (two front-end runs, every dtype's and
# quantization's variant through the AST pass), so each rule costs no run of its own.
H = "paged_attention.h"
V = "paged_attention_varlen.metal"
TOP = "// Smallest power of two >= n, for 1 <= n <= 32."
# Edits both copies get: the fp32-only template's caller (every dtype's varlen body calls it).
COMMON = [("fe_f32 call", V, "const float qscale = scale * PAV_LOG2E;", "const float fe_probe = fe_f32(q);\n", False)]
RULES = {
    # MSL's concrete overloads: no template over any type.
    "ambiguous max(half, float)": (
        H,
        TOP,
        "inline float fe_mix(half h, float f) { return max(h, f); }  // <-\n",
        "inline float fe_mix(half h, float f) { return max(static_cast<float>(h), f); }\n",
        r"call to 'max' is ambiguous",
    ),
    "simd function on a struct": (
        H,
        TOP,
        "struct FeS { float v; };\ninline float fe_shuf(FeS s) { return simd_shuffle(s, 0).v; }  // <-\n",
        "struct FeS { float v; };\ninline float fe_shuf(FeS s) { return simd_shuffle(s.v, 0); }\n",
        r"no matching function for call to 'simd_shuffle'",
    ),
    "atomic on a plain int": (
        H,
        TOP,
        "inline void fe_at(device int* a) { atomic_fetch_add_explicit(a, 1, memory_order_relaxed); }  // <-\n",
        "inline void fe_at(device atomic_int* a) { atomic_fetch_add_explicit(a, 1, memory_order_relaxed); }\n",
        r"no matching function for call to 'atomic_fetch_add_explicit'",
    ),
    # The specification's "C++ features not supported" list, item by item (recursion: above).
    "lambda": (
        H,
        TOP,
        "inline int fe_lam(int x) {\n  auto f = [](int y) { return y + 1; };  // <-\n  return f(x);\n}\n",
        "inline int fe_one(int y) { return y + 1; }\ninline int fe_lam(int x) { return fe_one(x); }\n",
        r"lambda expression: not supported in Metal",
    ),
    "dynamic_cast": (
        H,
        TOP,
        "struct FeD { int v; };\ninline int fe_dc(thread FeD* p) { return dynamic_cast<thread FeD*>(p)->v; }  // <-\n",
        "struct FeD { int v; };\ninline int fe_dc(thread FeD* p) { return static_cast<thread FeD*>(p)->v; }\n",
        r"dynamic_cast",
    ),
    "typeid": (
        H,
        TOP,
        "inline bool fe_ti(int x) { return typeid(x) == typeid(int); }  // <-\n",
        "inline bool fe_ti(int x) { return sizeof(x) == sizeof(int); }\n",
        r"typeid",
    ),
    "new and delete": (
        H,
        TOP,
        "inline int fe_new() { thread int* p = new int(1); return *p; }  // <-\n",
        "inline int fe_new() { int one = 1; thread int* p = &one; return *p; }\n",
        r"new",
    ),
    "noexcept operator": (
        H,
        TOP,
        "inline bool fe_ne(int x) { return noexcept(x + 1); }  // <-\n",
        "inline bool fe_ne(int x) { return x + 1 > x; }\n",
        r"noexcept operator: not supported in Metal",
    ),
    "goto": (
        H,
        TOP,
        "inline int fe_go(int x) {\n  if (x > 0) goto done;  // <-\n  x = 1;\ndone:\n  return x;\n}\n",
        "inline int fe_go(int x) {\n  if (x <= 0) x = 1;\n  return x;\n}\n",
        r"goto statement: not supported in Metal",
    ),
    "register": (
        H,
        TOP,
        "inline int fe_reg(int x) {\n  register int r = x;  // <-\n  return r;\n}\n",
        "inline int fe_reg(int x) {\n  int r = x;\n  return r;\n}\n",
        r"register",
    ),
    "thread_local": (
        H,
        TOP,
        "thread_local int fe_tl = 1;  // <-\n",
        "constant int fe_tl = 1;\n",
        r"thread|tls",
    ),
    "virtual function": (
        H,
        TOP,
        "struct FeVirt {\n  virtual int f() const { return 1; }  // <-\n};\n",
        "struct FeVirt {\n  int f() const { return 1; }\n};\n",
        r"virtual functions? (are )?not supported",
    ),
    "derived class": (
        H,
        TOP,
        "struct FeBase { int a; };\nstruct FeDerived : FeBase {  // <-\n  int b;\n};\n",
        "struct FeBase { int a; };\nstruct FeDerived {\n  FeBase base;\n  int b;\n};\n",
        r"derived class",
    ),
    "exceptions": (
        H,
        TOP,
        "inline int fe_throw(int x) {\n  if (x < 0) throw x;  // <-\n  return x;\n}\n",
        "inline int fe_throw(int x) {\n  return x < 0 ? 0 : x;\n}\n",
        r"throw|exception",
    ),
    "standard library": (
        H,
        TOP,
        "inline int fe_std(int a, int b) { return std::max(a, b); }  // <-\n",
        "inline int fe_std(int a, int b) { return max(a, b); }\n",
        r"std::max: the C\+\+ standard library is not available in Metal",
    ),
    # MLX's preamble precedes every source: a name it declares clashes.
    "a name of MLX's preamble": (
        H,
        TOP,
        "inline int ceildiv(int a, int b) { return (a + b - 1) / b; }  // <-\n",
        "inline int pa_ceildiv(int a, int b) { return (a + b - 1) / b; }\n",
        r"'ceildiv' is also declared by MLX's preamble",
    ),
    # Threadgroup memory per variant within 32 KB (the largest variants are 16-24 KB).
    "threadgroup memory over 32 KB": (
        V,
        "threadgroup T tg_k[KC * HD];",
        "threadgroup T tg_k[KC * HD * 4];  // <-\n",
        "threadgroup T tg_k[KC * HD];\n",
        r"threadgroup memory of this variant over 32 KB",
    ),
    # An unqualified pointer in code only the float32 variants instantiate: the AST pass takes
    # a variant of every dtype.
    "pointer without address space in fp32-only code": (
        V,
        "// @kernel paged_attention_varlen\n",
        "template <typename T>\ninline float fe_f32(const device T* p) {\n  if constexpr (sizeof(T) == 4) {\n"
        "    const T* r = p;  // <-\n    return r[0];\n  }\n  return static_cast<float>(p[0]);\n}\n",
        "template <typename T>\ninline float fe_f32(const device T* p) {\n  if constexpr (sizeof(T) == 4) {\n"
        "    const device T* r = p;\n    return r[0];\n  }\n  return static_cast<float>(p[0]);\n}\n",
        r"'r' is a pointer or reference without an address space",
    ),
    # Only MSL 4.0 sees this block: each check runs as MSL 3.2 and 4.0.
    "an error under MSL 4.0 only": (
        H,
        TOP,
        "#if __METAL_VERSION__ >= 400\ninline int fe_v4() { return fe_undeclared; }  // <-\n#endif\n",
        "#if __METAL_VERSION__ >= 400\ninline int fe_v4() { return 4; }\n#endif\n",
        r"use of undeclared identifier 'fe_undeclared'",
    ),
}
# Legal MSL the check used to reject (its former false positives): twins only, no error.
LEGAL = {
    "atomic_int": (
        H,
        TOP,
        "inline int fe_atomic(device atomic_int* a) {\n"
        "  return atomic_fetch_add_explicit(a, 1, memory_order_relaxed);\n}\n",
    ),
    "a half variable": (
        H,
        TOP,
        "inline float fe_half(float x) {\n  half h = static_cast<half>(x);\n"
        "  h = h * h;\n  return static_cast<float>(h);\n}\n",
    ),
    "a 1.0h literal": (H, TOP, "inline half fe_lit(half x) { return x + 1.0h; }\n"),
    "a chain of template specialisations": (
        H,
        TOP,
        "template <int N> inline int fe_depth() { return 1 + fe_depth<N / 2>(); }\n"
        "template <> inline int fe_depth<1>() { return 0; }\n"
        "template <int N> struct FeLog { static constexpr constant int value = 1 + FeLog<N / 2>::value; };\n"
        "template <> struct FeLog<1> { static constexpr constant int value = 0; };\n"
        "inline int fe_depths() { return fe_depth<8>() + FeLog<16>::value; }\n",
    ),
}


def _apply(root: Path, edits: list[tuple[str, str, str, str, bool]]) -> dict[str, tuple[str, int]]:
    """Each (name, file, anchor, text, replace): `text` before `anchor` in root/file (or in its
    place). Returns {name: (file, line of its `// <-` mark)}."""
    for name, fname, anchor, text, replace in edits:
        path = root / fname
        t = path.read_text()
        assert anchor in t, (fname, anchor)
        marked = text.replace("  // <-", f"  // <- {name}")
        path.write_text(t.replace(anchor, marked if replace else marked + anchor, 1))
    where = {}
    for name, fname, _, text, _ in edits:
        if "// <-" in text:
            lines = (root / fname).read_text().splitlines()
            where[name] = (fname, next(i + 1 for i, ln in enumerate(lines) if ln.endswith(f"// <- {name}")))
    return where


@pytest.fixture(scope="module")
def rule_runs(tmp_path_factory):
    """(errors of the copy with every injected error, where each was injected, errors of the
    copy with every legal twin and the false positives)."""
    only = frontend.representatives()
    bad = _copy(tmp_path_factory.mktemp("bad"))
    where = _apply(bad, COMMON + [(n, f, a, e, a.startswith("threadgroup")) for n, (f, a, e, _, _) in RULES.items()])
    bad_errors, _ = frontend.check(bad, only=only)
    good = _copy(tmp_path_factory.mktemp("good"))
    twins = COMMON + [(n, f, a, t, a.startswith("threadgroup")) for n, (f, a, _, t, _) in RULES.items()]
    twins += [(n, f, a, t, False) for n, (f, a, t) in LEGAL.items()]
    _apply(good, twins)
    good_errors, _ = frontend.check(good, only=only)
    return bad, bad_errors, where, good_errors


@pytest.mark.parametrize("rule", list(RULES))
def test_rule_rejects_its_error_at_its_line(rule_runs, rule):
    root, errors, where, _ = rule_runs
    fname, line = where[rule]
    at = [e for e in errors if e.file == str(root / fname) and e.line == line]
    assert at, f"no error at {fname}:{line}; got {[str(e) for e in errors]}"
    assert any(re.search(RULES[rule][4], e.message) for e in at), [e.message for e in at]


def test_every_legal_twin_and_former_false_positive_passes(rule_runs):
    *_, good_errors = rule_runs
    assert good_errors == [], [str(e) for e in good_errors]


def test_msl_4_only_error_names_the_version(rule_runs):
    _, errors, where, _ = rule_runs
    fname, line = where["an error under MSL 4.0 only"]
    (e,) = [e for e in errors if e.line == line and e.file.endswith(fname)]
    assert e.variants and all(v.endswith("(MSL 4.0)") for v in e.variants), e.variants


def test_include_outside_metal_stdlib_is_rejected(tmp_path):
    root = _copy(tmp_path)
    line = _inject(root, H, "#include <metal_stdlib>", "#include <metal_stdlib>\n#include <cstdint>")
    errs = frontend._restriction_errors(frontend.Sources.load(root))
    assert [(Path(f).name, ln) for f, ln, m, _ in errs if "standard library" in m] == [(H, line + 1)]
