"""Front-end check: every kernel variant the engine can build, through clang's C++-for-OpenCL
front end, which shares Metal's keyword and address-space rules.

    python -m mlxpaged.metal_emu.frontend [--source DIR] [--quiet] [--jobs N]

Each variant is assembled as `mx.fast.metal_kernel` assembles it: MLX's generated signature
(`source.generated_source`: buffers, shapes, attributes), then the header, then the body. OpenCL
kernels cannot be templates, so the template values become typedefs and constants at the top of
the kernel body, and the signature is a `__kernel` function; `msl_opencl_prelude.h` maps the
address spaces (`device` -> `__global`, `threadgroup` -> `__local`, `constant` -> `__constant`,
`thread` -> `__private`) and declares the metal_stdlib names the sources use. Clang
(`python -m ziglang clang -cc1 -fsyntax-only -x cl -cl-std=clc++2021 -cl-ext=-all,+__opencl_c_generic_address_space`)
then rejects what Apple's compiler rejects and the emulator's C++ accepts: `half` (or `bfloat`)
as a name, casts between address spaces, program-scope variables outside `constant`,
`threadgroup` storage outside a kernel's outermost scope, exceptions, `new`. The generic address
space is on because clang's implicit copy constructors need it in C++ for OpenCL (with
`-cl-ext=-all` alone, passing a struct by value fails); a pointer without an address space then
takes it, so a second pass over clang's AST (one variant per kernel) reports every declaration
of a `__generic` pointer or reference. That pass also reports recursion (a cycle in the call
graph), which clang accepts.

`#line` directives make every message name the `.metal`/`.h` file and line; output is
`file:line: message` per error (one line per distinct error, with how many variants hit it), and
the exit status is 1 when there is any. Variants: `variants()` (dtypes x head dims x block sizes
x query groups x quantization, for single, split and merge decode, varlen lanes, quantized and MMA).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from .source import generated_source

HERE = Path(__file__).resolve().parent
PRELUDE = HERE / "msl_opencl_prelude.h"
CLANG = [sys.executable, "-m", "ziglang", "clang", "-cc1", "-fsyntax-only", "-x", "cl", "-cl-std=clc++2021"]
# cl_khr_fp16: MSL's half (variables, arithmetic, `1.0h`).
EXT = "-cl-ext=-all,+cl_khr_fp16,+__opencl_c_generic_address_space"
# The AST pass: the generic space on, so a pointer without an address space is `__generic`.
AST_EXT = EXT
# The MSL versions MLX 0.32 compiles for: 3.2 on macOS 15, 4.0 on macOS 26 (`__METAL_VERSION__`).
METAL_VERSIONS = (320, 400)
FLAGS = ["-ferror-limit", "0", "-Wno-unknown-attributes", "-w"]

DECODE_HEADER = "paged_attention.h"
DECODE_FILE = "paged_attention.metal"
VARLEN_FILE = "paged_attention_varlen.metal"

# The variant grid. Every head dim and block size the engine accepts, every dtype and
# quantization, and query groups covering each register split (1, 2, 4, 8 head groups) and the
# MMA kernel's limits.
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GROUPS = (1, 2, 4, 7, 8, 16)


class FrontendUnavailable(RuntimeError):
    """clang (the ziglang wheel of the test extra) cannot be run."""


@dataclass(frozen=True)
class Spec:
    """An input as `generated_source` sees it: dtype, rank and size (>= 8: device space)."""

    dtype: mx.Dtype
    ndim: int = 1
    size: int = 8


@dataclass
class Variant:
    """One kernel variant: what `mx.fast.metal_kernel(...)` and its call are given."""

    group: str  # "decode" or "varlen": the translation unit (header) it belongs to
    name: str  # metal_kernel's `name`: kind and template values
    section: str  # the `// @kernel` section holding its body
    input_names: list[str]
    output_names: list[str]
    template: list[tuple]
    inputs: list[Spec]
    output_dtypes: list[mx.Dtype]
    prefix: str = ""  # a line before the body (the quantized views macro)
    body: str = field(default="", repr=False)


def _cache_kinds(hd: int) -> list[tuple[int, int] | None]:
    """The caches a kernel of head_dim `hd` reads: plain (None), and each (bits, group size) it supports."""
    from ..attention import metal

    return [None] + [(b, gs) for b in metal.KV_BITS for gs in metal.KV_GROUP_SIZES if metal.quant_supported(hd, b, gs)]


def _decode_variants() -> list[Variant]:
    from ..attention import metal

    out = []
    T4 = Spec(mx.float32)
    for dt in DTYPES:
        for hd in HEAD_DIMS:
            if not metal.shape_supported(hd, 1, 1):
                continue
            for sk in (0, 1):  # HAS_SINKS: the sink's fold compiles in or out
                out.append(
                    Variant(
                        "decode",
                        f"paged_attention_merge_hd{hd}_nsg{metal.MERGE_SIMDGROUPS}" + ("_sk" if sk else ""),
                        "paged_attention_merge",
                        *metal.KERNEL_IO["paged_attention_merge"],
                        [("T", dt), ("HD", hd), ("NSG", metal.MERGE_SIMDGROUPS), ("HAS_SINKS", sk)],
                        [T4, T4, T4, T4],
                        [dt],
                    )
                )
            for bs in BLOCK_SIZES:
                for g in GROUPS:
                    if not metal.shape_supported(hd, bs, g):
                        continue
                    quants = _cache_kinds(hd)
                    for quant in quants:
                        tmpl = [("T", dt), ("HD", hd), ("BS", bs), ("G", g), ("NSG", metal.NUM_SIMDGROUPS)] + (
                            [("BITS", quant[0]), ("GS", quant[1])] if quant else []
                        )
                        cache = [Spec(mx.uint32), Spec(dt), Spec(dt)] * 2 if quant else [Spec(dt), Spec(dt)]
                        # q, the cache, tables, lengths, scale and the window scalar
                        ins = [Spec(dt), *cache, Spec(mx.int32), Spec(mx.int32), Spec(mx.float32, 0, 1)]
                        ins.append(Spec(mx.int32, 0, 1))
                        # HAS_SINKS = 1 and HAS_WINDOW = 1 are one branch more each: checked on the
                        # first (bs, G) of each head_dim and cache kind, so the count grows little
                        flags = (0, 1) if (bs, g) == (BLOCK_SIZES[0], GROUPS[0]) else (0,)
                        for kind, sk, w in [("paged_attention", sk, w) for sk in flags for w in flags] + [
                            ("paged_attention_partitioned", 0, w) for w in flags
                        ]:
                            full = f"{kind}_quant" if quant else kind
                            io = metal.QUANT_KERNEL_IO[full] if quant else metal.KERNEL_IO[kind]
                            single = kind == "paged_attention"
                            outs = [dt] if single else [mx.float32] * 3
                            out.append(
                                Variant(
                                    "decode",
                                    f"{full}_{metal._variant(hd, bs, g, quant, bool(sk), bool(w))}",
                                    kind,
                                    *io,
                                    tmpl + [("HAS_WINDOW", w)] + ([("HAS_SINKS", sk)] if single else []),
                                    ins + ([Spec(mx.float32)] if single else []),
                                    outs,
                                    "PA_QUANT_VIEWS" if quant else "",
                                )
                            )
    return out


def _varlen_variants() -> list[Variant]:
    from ..attention import metal
    from ..attention import metal_varlen as mv

    out = []
    for dt in DTYPES:
        for hd in HEAD_DIMS:
            for bs in BLOCK_SIZES:
                for g in GROUPS:
                    if not metal.shape_supported(hd, bs, g):
                        continue
                    quants = _cache_kinds(hd)
                    # HAS_WINDOW and HAS_SINKS: each combination on the first (bs, G) of each
                    # head_dim and cache kind (as the decode variants), so the count grows little
                    flags = (0, 1) if (bs, g) == (BLOCK_SIZES[0], GROUPS[0]) else (0,)
                    for quant, w, sk in [(qt, w, sk) for qt in quants for w in flags for sk in flags]:
                        p = mv.launch_plan(hd, bs, g, dt.size, quant, bool(w), bool(sk))
                        tmpl = mv.template(p, dt)
                        cache = [Spec(mx.uint32), Spec(dt), Spec(dt)] * 2 if quant else [Spec(dt), Spec(dt)]
                        # q, the cache, tables, cu_seqlens_q, lengths, tiles, scale, window, sinks
                        ins = [Spec(dt), *cache, *[Spec(mx.int32)] * 4, Spec(mx.float32, 0, 1)]
                        ins += [Spec(mx.int32, 0, 1), Spec(mx.float32)]
                        section = mv.MMA_KERNEL if p.mma else mv.KERNEL
                        names = mv.QUANT_INPUTS if quant else mv.INPUTS
                        out.append(
                            Variant(
                                "varlen",
                                f"{p.kind}_{p.variant}",
                                section,
                                list(names),
                                list(mv.OUTPUTS),
                                tmpl,
                                ins,
                                [dt],
                                "PAV_QUANT_VIEWS" if quant else "",
                            )
                        )
    return out


def variants() -> list[Variant]:
    """Every variant of the grid (DTYPES x HEAD_DIMS x BLOCK_SIZES x GROUPS x quantization) the
    engine's planning accepts, for every kernel kind."""
    return _decode_variants() + _varlen_variants()


def representatives() -> list[Variant]:
    """One variant per `ast_key`: kernel section, dtype, quantization and any flag (the first
    of the grid)."""
    reps: dict[tuple, Variant] = {}
    for v in variants():
        reps.setdefault(ast_key(v), v)
    return list(reps.values())


@dataclass
class Sources:
    """A copy of `metal/`: the decode header, and each group's sections with their first line."""

    root: Path
    headers: dict[str, tuple[str, str, int]]  # group -> (file, text, first line)
    sections: dict[str, tuple[str, str, int]]  # section -> (file, body, first line)
    group_of: dict[str, str]

    @classmethod
    def load(cls, root: Path) -> Sources:
        root = Path(root)
        headers, sections, group_of = {}, {}, {}
        headers["decode"] = (DECODE_HEADER, (root / DECODE_HEADER).read_text(), 1)
        for group, fname in (("decode", DECODE_FILE), ("varlen", VARLEN_FILE)):
            text = (root / fname).read_text()
            marks = list(re.finditer(r"^// @kernel (\w+)\n", text, flags=re.M))
            if group == "varlen":
                headers["varlen"] = (fname, text[: marks[0].start()] if marks else text, 1)
            for i, m in enumerate(marks):
                end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
                body = text[m.end() : end]
                line = text.count("\n", 0, m.end()) + 1
                stripped = body.lstrip("\n")
                line += len(body) - len(stripped)
                sections[m.group(1)] = (fname, stripped.rstrip("\n") + "\n", line)
                group_of[m.group(1)] = group
        return cls(root, headers, sections, group_of)


def _template_decl(name: str, value) -> str:
    if isinstance(value, mx.Dtype):
        from .source import type_string

        return f"typedef {type_string(value)} {name};"
    if isinstance(value, bool):
        return f"constexpr bool {name} = {'true' if value else 'false'};"
    return f"constexpr int {name} = {int(value)};"


def kernel_text(v: Variant, src: Sources) -> str:
    """The variant as one `__kernel` function: MLX's signature, the template values, the body
    (its lines numbered as in its file)."""
    fname, body, line = src.sections[v.section]
    gen = generated_source(
        name=v.name,
        input_names=v.input_names,
        output_names=v.output_names,
        source=body,
        header="",
        atomic_outputs=False,
        inputs=v.inputs,
        output_dtypes=v.output_dtypes,
        template=v.template,
    )
    lines = [f'#line 1 "<signature of {v.name}>"', f"__kernel void {gen.kernel_name}("]
    params = [f"  {p.msl_type} {p.name} [[buffer({i})]]" for i, p in enumerate(gen.params)]
    params += [f"  {t} {a} [[{a}]]" for a, t in gen.attributes]
    lines.append(",\n".join(params) + ") {")
    lines += [_template_decl(n, val) for n, val in v.template]
    if v.prefix:
        lines.append(v.prefix)
    path = src.root / fname
    return "\n".join(lines) + f'\n#line {line} "{path}"\n' + body + _threadgroup_limit(body, line, path) + "}\n"


THREADGROUP_LIMIT = 32768  # bytes of threadgroup memory a kernel may use on every Apple GPU


def _threadgroup_limit(body: str, line: int, path: Path) -> str:
    """A static_assert, at the body's first `threadgroup` array, that this variant's arrays
    (each rounded up to 16 bytes, as Metal counts them) fit THREADGROUP_LIMIT: clang evaluates
    it with the variant's template values."""
    from .lower import _DECLARATOR, _storage_declarations, _strip_comments_keep_layout

    code = _strip_comments_keep_layout(body)
    names, first = [], None
    for start, end, _ in _storage_declarations(code, r"\bthreadgroup\b"):
        m = _DECLARATOR.fullmatch(code[start + len("threadgroup") : end])
        if m:
            names.append(m.group("name"))
            first = first if first is not None else line + code.count("\n", 0, start)
    if not names:
        return ""
    total = " + ".join(f"(sizeof({n}) + 15) / 16 * 16" for n in names)
    return (
        f'#line {first} "{path}"\n'
        f'static_assert({total} <= {THREADGROUP_LIMIT}, "threadgroup memory of this variant over 32 KB");\n'
    )


def translation_unit(group: str, batch: list[Variant], src: Sources) -> str:
    """Prelude, the group's header (numbered as in its file), then each variant's kernel."""
    fname, text, line = src.headers[group]
    parts = [f'#include "{PRELUDE}"\n', f'#line {line} "{src.root / fname}"\n', text, "\n"]
    parts += [kernel_text(v, src) for v in batch]
    return "".join(parts)


_DIAG = re.compile(r"^(?P<file>[^\n]*?):(?P<line>\d+):(?P<col>\d+): (?P<sev>fatal error|error): (?P<msg>.*)$")


def _clang(text: str, ext: str, extra: list[str] = (), version: int = METAL_VERSIONS[0]) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as tmp:
        inc = Path(tmp, "include")
        inc.mkdir()
        for name in ("metal_stdlib", "metal_simdgroup_matrix"):
            (inc / name).write_text("// the front-end check's prelude declares metal_stdlib\n")
        tu = Path(tmp, "kernels.cl")
        tu.write_text(text)
        cmd = [*CLANG, ext, *FLAGS, f"-D__METAL_VERSION__={version}", "-I", str(inc), *extra, str(tu)]
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except FileNotFoundError as e:
            raise FrontendUnavailable(f"cannot run {cmd[0]}: {e}") from None


def clang_available() -> str:
    """ "" when `python -m ziglang clang` runs, else why not."""
    try:
        r = subprocess.run([*CLANG[:4], "--version"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run {' '.join(CLANG[:4])}: {e}"
    if r.returncode != 0:
        return (
            f"`{' '.join(CLANG[:4])} --version` failed ({r.returncode}): "
            f"{(r.stderr or r.stdout).strip()[:300]} (install the test extra: pip install -e '.[test]')"
        )
    return ""


@dataclass
class Error:
    file: str
    line: int
    message: str
    variants: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        which = f" (e.g. in {self.variants[0]})" if self.variants else ""
        return f"{self.file}:{self.line}: {self.message}{which}"


def _diagnostics(output: str, batch: list[Variant]) -> list[tuple[str, int, str, str]]:
    """(file, line, message, variant) of each error in clang's output for `batch`."""
    out, current = [], batch[0].name if batch else ""
    names = {v.name for v in batch}
    for ln in output.splitlines():
        m = _DIAG.match(ln)
        if not m:
            continue
        f = m.group("file")
        sig = re.match(r"<signature of (\w+)>", f)
        if sig and sig.group(1) in names:
            current = sig.group(1)
        out.append((f, int(m.group("line")), m.group("msg"), current))
    return out


def _as_version(variant: str, version: int) -> str:
    """A variant's name as an error's example, with the MSL version when it is not the first."""
    return variant if version == METAL_VERSIONS[0] or not variant else f"{variant} (MSL {version / 100:.1f})"


def check_batch(
    group: str, batch: list[Variant], src: Sources, version: int = METAL_VERSIONS[0]
) -> list[tuple[str, int, str, str]]:
    """Errors of one batch of a group's variants (one clang run), each with the variant whose
    signature clang read last before it as an example (an error in the header or a body hits
    every variant that uses that line)."""
    r = _clang(translation_unit(group, batch, src), EXT, version=version)
    errs = [(f, ln, msg, _as_version(v, version)) for f, ln, msg, v in _diagnostics(r.stderr, batch)]
    if r.returncode != 0 and not errs:
        errs.append(("<clang>", 0, f"clang failed ({r.returncode}): {r.stderr.strip()[-500:]}", ""))
    return errs


# --- the AST pass: unqualified pointers, recursion, MSL's restrictions, MLX's names ---------

_LOC = re.compile(
    r"<invalid sloc>|<built-in>|<scratch space>:\d+:\d+|line:(?P<l2>\d+):\d+|col:\d+"
    r"|(?P<f>[^\s<>,:']+):(?P<l>\d+):\d+"
)
_NAMED_DECL = re.compile(
    r">\s+(?:line:\d+:\d+|col:\d+|\S+:\d+:\d+)\s+(?:(?:used|referenced|invalid|implicit)\s+)*"
    r"(?!(?:used|referenced|invalid|implicit)\b)(\w+)\s+'([^']*)'"
)
_NODE = re.compile(r"^(?P<indent>[ |`-]*)(?P<kind>\w+) (?P<addr>0x[0-9a-f]+) ")

# The MSL specification's list of C++ features Metal does not support ("Metal and C++": lambda
# expressions, recursive function calls, dynamic_cast, type identification, new and delete,
# the noexcept operator, goto, register and thread_local, virtual functions, derived classes,
# exception handling, the C++ standard library), as clang AST nodes: each is reported at its
# line, whatever clang's OpenCL mode happens to accept. Recursion is the call-graph check below;
# the standard library is `std::` names and #includes other than <metal_*>.
RESTRICTED_NODES = {
    "LambdaExpr": "a lambda expression",
    "CXXDynamicCastExpr": "dynamic_cast",
    "CXXTypeidExpr": "typeid (type identification)",
    "CXXNewExpr": "the new operator",
    "CXXDeleteExpr": "the delete operator",
    "CXXNoexceptExpr": "the noexcept operator",
    "GotoStmt": "a goto statement",
    "IndirectGotoStmt": "a goto statement",
    "CXXThrowExpr": "exception handling (throw)",
    "CXXTryStmt": "exception handling (try)",
}


def _ast_nodes(dump: str):
    """(depth, kind, address, file, line, text) per node of clang's text AST dump. The dumper
    writes a location's file and line only when they change from the last location it printed;
    this tracks both, as the dumper does."""
    f, line = "", 0
    for ln in dump.splitlines():
        m = _NODE.match(ln)
        if not m:
            # A base specifier ("public 'Base'") has no address: a derived class's.
            b = re.match(r"^(?P<indent>[ |`-]*)(?:virtual )?(?:public|private|protected) '", ln)
            if b:
                yield len(b.group("indent")), "BaseSpecifier", "", f, line, ln
            continue
        first = None
        rest = ln[m.end() :]
        for lm in _LOC.finditer(rest):
            tok = lm.group(0)
            if tok.startswith("<"):
                continue
            if lm.group("f"):
                f, line = lm.group("f"), int(lm.group("l"))
            elif lm.group("l2"):
                line = int(lm.group("l2"))
            if first is None:
                first = (f, line)
        if first is None:
            first = (f, line)
        yield len(m.group("indent")), m.group("kind"), m.group("addr"), first[0], first[1], rest


@functools.cache
def mlx_preamble_names() -> frozenset[str]:
    """Names MLX's preamble (`utils.h` and what it includes, which every `metal_kernel` source
    follows) declares at namespace scope: macros, types, functions, constants."""
    from .lower import _strip_comments_keep_layout
    from .source import metal_utils_preamble

    text = _strip_comments_keep_layout(metal_utils_preamble())
    names = set(re.findall(r"^\s*#\s*define\s+(\w+)", text, re.M))
    names |= set(re.findall(r"\b(?:struct|class|union|enum(?:\s+class)?)\s+(\w+)\s*[:{<;]", text))
    names |= set(re.findall(r"\btypedef\b[^;{}]*?\b(\w+)\s*;", text))
    names |= set(re.findall(r"\busing\s+(\w+)\s*=", text))
    names |= set(re.findall(r"\b(?:METAL_FUNC|inline|constexpr|static)\b[^;{}()=]*?\b(\w+)\s*\(", text))
    names |= set(re.findall(r"\bconstant\b[^;{}()]*?\b(\w+)\s*=", text))
    return frozenset(n for n in names if len(n) > 2 and not n.startswith("_") and n not in _CPP_WORDS)


_CPP_WORDS = {"operator", "if", "for", "while", "return", "sizeof", "static_assert", "decltype", "switch"}
# Declarations at namespace scope whose names must not be MLX's.
_TOP_DECLS = {
    "FunctionDecl",
    "FunctionTemplateDecl",
    "CXXRecordDecl",
    "ClassTemplateDecl",
    "VarDecl",
    "TypedefDecl",
    "TypeAliasDecl",
    "EnumDecl",
}


def _restriction_errors(src: Sources) -> list[tuple[str, int, str, str]]:
    """Source-level rules: the standard library (`std::`, #include other than <metal_*>) and
    macros named as MLX's preamble names things."""
    errs = []
    mlx = mlx_preamble_names()
    from .lower import _strip_comments_keep_layout

    files = {name: text for name, text, _ in src.headers.values()}
    files |= {name: (src.root / name).read_text() for name, _, _ in src.sections.values()}
    for name, text in files.items():
        path = str(src.root / name)
        code = _strip_comments_keep_layout(text)
        for m in re.finditer(r"^\s*#\s*include\s*[<\"]([^>\"]+)[>\"]", text, re.M):
            if not m.group(1).startswith("metal_"):
                errs.append(
                    (
                        path,
                        text.count("\n", 0, m.start()) + 1,
                        f"#include <{m.group(1)}>: the C++ standard library is not available in Metal",
                        "",
                    )
                )
        for m in re.finditer(r"\bstd\s*::\s*(\w+)", code):
            errs.append(
                (
                    path,
                    code.count("\n", 0, m.start()) + 1,
                    f"std::{m.group(1)}: the C++ standard library is not available in Metal",
                    "",
                )
            )
        for m in re.finditer(r"^\s*#\s*define\s+(\w+)", code, re.M):
            if m.group(1) in mlx:
                errs.append((path, code.count("\n", 0, m.start()) + 1, _clash(m.group(1)), ""))
    return errs


def _clash(name: str) -> str:
    return (
        f"'{name}' is also declared by MLX's preamble (mlx/backend/metal/kernels/utils.h), "
        "which precedes every metal_kernel's source"
    )


def ast_errors(
    group: str, batch: list[Variant], src: Sources, version: int = METAL_VERSIONS[0]
) -> list[tuple[str, int, str, str]]:
    """Pointers and references without an address space, recursive calls, the C++ features
    MSL does not support (RESTRICTED_NODES, `register`, `thread_local`, virtual functions,
    derived classes) and names MLX's preamble declares, in the sources."""
    r = _clang(translation_unit(group, batch, src), AST_EXT, ["-ast-dump"], version=version)
    ours = {str(src.root / name) for name, _, _ in src.headers.values()}
    ours |= {str(src.root / name) for name, _, _ in src.sections.values()}
    mlx = mlx_preamble_names()
    example = _as_version(batch[0].name, version)
    errs, seen = [], set()

    def report(f, line, msg):
        if (f, line, msg) not in seen:
            seen.add((f, line, msg))
            errs.append((f, line, msg, example))

    record = None  # (file, line) of the last class definition in our files
    stack: list[tuple[int, str]] = []  # (depth, address) of enclosing function decls
    canon: dict[str, str] = {}  # a function declaration's address -> its first declaration's
    names: dict[str, str] = {}
    calls: dict[str, set[tuple[str, str, int]]] = {}
    for depth, kind, addr, f, line, text in _ast_nodes(r.stdout):
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if kind in ("FunctionDecl", "CXXMethodDecl"):
            prev = re.match(r"(?:parent 0x[0-9a-f]+ )?prev (0x[0-9a-f]+) ", text)
            canon[addr] = canon.get(prev.group(1), prev.group(1)) if prev else addr
            nm = re.search(r"\b(\w+) '", text)
            if nm:
                names[canon[addr]] = nm.group(1)
                if f in ours:
                    stack.append((depth, canon[addr]))
        if f not in ours:
            if kind == "CXXRecordDecl":
                record = None
            continue
        if kind in ("ParmVarDecl", "VarDecl", "FieldDecl") and "__generic" in text:
            # A named declaration (implicit copy constructors' parameters have no name).
            nm = _NAMED_DECL.search(text)
            if nm and "__generic" in nm.group(2):
                report(
                    f,
                    line,
                    f"'{nm.group(1)}' is a pointer or reference without an address space "
                    "(device, constant, threadgroup or thread)",
                )
        if kind in RESTRICTED_NODES:
            report(f, line, f"{RESTRICTED_NODES[kind]}: not supported in Metal")
        if kind == "VarDecl" and re.search(r"' (?:\w+ )*(?:tls|tls_dynamic)\b", text):
            report(f, line, "thread_local storage: not supported in Metal")
        if kind == "VarDecl" and re.search(r"' (?:\w+ )*register\b", text):
            report(f, line, "register storage: not supported in Metal")
        if kind == "CXXMethodDecl" and re.search(r"\bvirtual\b", text):
            report(f, line, "a virtual function: not supported in Metal")
        if kind == "CXXRecordDecl" and " definition" in text:
            record = (f, line)
        if kind == "BaseSpecifier" and record:
            report(*record, "a derived class (a class with a base class): not supported in Metal")
        if depth <= 2 and kind in _TOP_DECLS and "implicit" not in text.split("'")[0]:
            nm = _NAMED_DECL.search(text) or re.search(r"\b(?:struct|class|union|enum)\s+(\w+)", text)
            if nm and nm.group(1) in mlx:
                report(f, line, _clash(nm.group(1)))
        if kind == "DeclRefExpr" and stack:
            cm = re.search(r"Function (0x[0-9a-f]+) '(\w+)'", text)
            if cm:
                calls.setdefault(stack[-1][1], set()).add((cm.group(1), f, line))
    # A cycle in the call graph, over declarations (each template instantiation is its own
    # node: a chain of specialisations f<8> -> f<4> -> f<1> is not recursion).
    for start in calls:
        todo, seen_fn = [start], set()
        while todo:
            fn = todo.pop()
            for callee, f, line in calls.get(fn, ()):
                callee = canon.get(callee, callee)
                if callee == start:
                    report(
                        f,
                        line,
                        f"recursive call: '{names.get(fn, fn)}' calls '{names.get(callee, callee)}' "
                        "(Metal has no recursion)",
                    )
                elif callee not in seen_fn:
                    seen_fn.add(callee)
                    todo.append(callee)
    if r.returncode != 0 and not r.stdout:
        errs.append(("<clang>", 0, f"clang -ast-dump failed ({r.returncode}): {r.stderr.strip()[-300:]}", ""))
    return errs


def _batches(items: list[Variant], n: int) -> list[list[Variant]]:
    size = max(1, -(-len(items) // n))
    return [items[i : i + size] for i in range(0, len(items), size)]


# Template values that only size a variant (the AST pass checks declarations, whose types and
# address spaces these never change: the kernels have no `if constexpr`). Every other template
# value (dtype, quantization bits and group, any flag a later kernel adds) gets its own
# variants in the AST pass.
SHAPE_VALUES = {"HD", "BS", "G", "TQ", "KC", "NSG", "HS", "SP", "RPT"}


def ast_key(v: Variant) -> tuple:
    """What the AST pass needs one variant of: section, quantized views, non-shape template values."""
    return (v.group, v.section, v.prefix, tuple((n, str(x)) for n, x in v.template if n not in SHAPE_VALUES))


def check(
    source: Path | None = None, *, jobs: int | None = None, only: list[Variant] | None = None
) -> tuple[list[Error], int]:
    """(errors, variants checked) for the sources in `source` (default: the shipped metal/).

    Every variant through clang's front end as MSL 3.2 (and 4.0 too when a source tests
    `__METAL_VERSION__`: otherwise both preprocess alike); the AST pass over one variant per
    `ast_key` (every dtype, quantization and flag) as both MSL 3.2 and 4.0."""
    root = Path(source) if source is not None else default_source()
    src = Sources.load(root)
    vs = only if only is not None else variants()
    for v in vs:
        v.body = src.sections[v.section][1]
    jobs = jobs or max(1, min(8, os.cpu_count() or 1))
    texts = [t for _, t, _ in src.headers.values()] + [
        (root / name).read_text() for name, _, _ in src.sections.values()
    ]
    grid_versions = METAL_VERSIONS if any("__METAL_VERSION__" in t for t in texts) else METAL_VERSIONS[:1]
    work = []
    for group in ("decode", "varlen"):
        items = [v for v in vs if v.group == group]
        if not items:
            continue
        reps: dict[tuple, Variant] = {}
        for v in items:
            reps.setdefault(ast_key(v), v)
        for version in METAL_VERSIONS:
            work += [(ast_errors, group, b, version) for b in _batches(list(reps.values()), jobs)]
        for version in grid_versions:
            work += [(check_batch, group, b, version) for b in _batches(items, 2 * jobs)]
    merged: dict[tuple, Error] = {}
    for f, line, msg, _ in _restriction_errors(src):
        merged.setdefault((f, line, msg), Error(f, line, msg))
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for errs in pool.map(lambda w: w[0](w[1], w[2], src, w[3]), work):
            for f, line, msg, variant in errs:
                e = merged.setdefault((f, line, msg), Error(f, line, msg))
                if variant and variant not in e.variants:
                    e.variants.append(variant)
    return sorted(merged.values(), key=lambda e: (e.file, e.line, e.message)), len(vs)


def default_source() -> Path:
    """The shipped `metal/` folder: the checkout's beside this package (as `attention.metal`
    reads it), else the installed package data."""
    local = HERE.parents[1] / "metal"
    if (local / DECODE_FILE).is_file():
        return local
    from importlib import resources

    return Path(str(resources.files("mlxpaged.metal")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, help="a copy of metal/ to check (default: the shipped one)")
    ap.add_argument("--quiet", action="store_true", help="print errors only, no summary")
    ap.add_argument("--jobs", type=int, help="clang processes at once (default: CPUs, at most 8)")
    ap.add_argument(
        "--one-per-kernel", action="store_true", help="a quick check: one variant per kernel section and quantization"
    )
    args = ap.parse_args(argv)
    problem = clang_available()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    errors, n = check(args.source, jobs=args.jobs, only=representatives() if args.one_per_kernel else None)
    for e in errors:
        print(e)
    if not args.quiet:
        print(
            f"{n} kernel variants checked in {time.monotonic() - t0:.1f} s: "
            f"{len(errors)} error{'s' * (len(errors) != 1)}",
            file=sys.stderr,
        )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
