"""The few textual rewrites that let clang compile MSL as C++ (everything else is macros).

The emulator compiles `lower(full_source)`; `full_source` itself is what MLX compiles and is
what `kernel.last_source` reports. Each rewrite only inserts or drops tokens within a line, and a
`#line` directive after MLX's preamble renumbers the rest, so line numbers in compiler
messages and error reports are lines of `last_source`:

1. `threadgroup` declarations at statement level (not pointers, references or parameters)
   become references to storage in the runtime's threadgroup arena
   (`threadgroup float (&buf)[64] = *(...)mlxemu_tg_slot(id, size, align, "buf")`): fixed per
   declaration, 0xFF-filled (NaN) before each threadgroup, with red zones and a race shadow.
   Threadgroups run one at a time, so one arena is one threadgroup's memory. Declarations
   with several declarators or an initializer get `MLXEMU_TG_STATIC` instead (a static in a
   section the runtime also refills) and `= {}`.
2. Address-space qualifiers after a method's parameter list (`f() const constant {`) become
   `MLXEMU_AS_METHOD_<space>`, a never-viable overload (C++ has no address-space-qualified
   methods); `thread` there is already an empty macro.
3. Attribute lists after `template` in explicit instantiations are dropped (C++ forbids them).
4. Half and bfloat literal suffixes (`1.0h`, `2bf`) become casts, and unsuffixed floating
   literals get an `f`: MSL has no double, its `0.5` is a float (C++ would compute in double).
5. `constant` variable declarations at statement level get `static`: a function-scope
   `constant` variable needs static storage in C++ (clang rejects address-space-qualified
   automatic variables); at namespace scope `static` changes nothing that matters here.
6. Casts to an address-space pointer type, `(device T*)x`, become `mlxemu_ascast<device T*>{} % x`
   (metal_shim.h): a cast between address spaces fails to compile, as in Metal (clang's C-style
   cast would convert silently). Only after `body_offset` (MLX's own preamble is trusted).
7. Register model: after each statement-level declaration of a thread-private array, of a
   struct type that holds arrays, or of a scalar or vector of a built-in type (not `constexpr`
   or `constant`: compile-time values), `mlxemu_regs(site, bytes);` is appended on the same
   line (bytes in whole 32-bit registers); the runtime sums the sites a launch reached
   (`LaunchStats.registers`).

Rejected with `CompileError` (Metal rejects them; C++ would not): a `threadgroup` declaration
with an initializer, and, when `kernel_span` is given, one outside the kernel function's body;
after `body_offset`, a program-scope variable, a static data member or a static local variable
that is not in the `constant` address space (`static constexpr int value = 1;` in a struct:
Metal wants `static constexpr constant int`).
"""

from __future__ import annotations

import re

_METHOD_AS = re.compile(r"\)(\s*(?:const\s+)?)(constant|device|threadgroup)\b(?=\s*(?:\{|:[^:]|;|=|->|noexcept))")
_INST_ATTRS = re.compile(r"\btemplate(\s*)((?:\[\[.*?\]\]\s*)+)(?=decltype|void|\w)", re.S)
# An array parameter in an address space (`constant const int64_t strides[2]`): clang rejects
# the array form, so it becomes the pointer it decays to anyway.
_AS_ARRAY_PARAM = re.compile(
    r"(?<=[(,])(\s*(?:const\s+)?(?:constant|device|threadgroup)\b[^,;(){}\[\]]*?)\b(\w+)\s*\[[^\]]*\]\s*(?=[,)])"
)
_FLOAT_LIT = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)(?![\w.])")
_HALF_LIT = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)(h|H|bf)\b")


def _strip_comments_keep_layout(src: str) -> str:
    """Blank out comments and string literals (same length), so the regexes see only code."""
    out = list(src)
    for m in re.finditer(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', src, re.S):
        for i in range(m.start(), m.end()):
            if out[i] != "\n":
                out[i] = " "
    return "".join(out)


def _storage_declarations(code: str, pattern: str) -> list[tuple[int, int, bool]]:
    """(start, end at its `;`, has an initializer) of each statement `pattern` begins that
    declares storage: preceded by `;`, `{` or `}`, and no `*`, `&` or `(` before the
    declarator ends (pointers, references and functions are not storage)."""
    hits = []
    for m in re.finditer(pattern, code):
        i = m.start() - 1
        while i >= 0 and code[i].isspace():
            i -= 1
        if i >= 0 and code[i] not in ";{}":
            continue
        end = code.find(";", m.end())
        decl = code[m.end() : end if end >= 0 else len(code)]
        head = decl.split("=", 1)[0].split("[", 1)[0].split("{", 1)[0]
        if "*" in head or "&" in head or "(" in head:
            continue
        hits.append((m.start(), end, "=" in decl or "{" in decl))
    return hits


_DECLARATOR = re.compile(r"\s*(?P<type>.*?)\b(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\]]*\]\s*)*)", re.S)


def _tg_slot(decl: str, slot_id: int) -> str | None:
    """`threadgroup T name[dims]` as a reference to runtime storage (None: keep it static).

    The arena gives each array red zones and a race shadow, which a static cannot have.
    Newlines are kept so later lines keep their numbers.
    """
    rest = decl[len("threadgroup") :]
    depth = 0
    for ch in rest:  # several declarators (a top-level comma): leave it to the static form
        depth += ch in "<([" and 1 or (ch in ">)]" and -1 or 0)
        if ch == "," and depth == 0:
            return None
    m = _DECLARATOR.fullmatch(rest)
    if not m or not m.group("type").strip():
        return None
    ty, name = " ".join(m.group("type").split()), m.group("name")
    dims = " ".join(m.group("dims").split())
    ref = f"(&{name}){dims}" if dims else f"&{name}"
    ptr = f"(*){dims}" if dims else "*"
    # The type through an identity alias: `float4 (&x)` would call the shim's float4(...) macro.
    ty = f"mlxemu_type<{ty}>"
    text = (
        f"threadgroup {ty} {ref} = *(threadgroup {ty} {ptr})mlxemu_tg_slot("
        f'{slot_id}, sizeof({ty}{dims}), alignof({ty}), "{name}")'
    )
    return text + "\n" * decl.count("\n")


def _where(src: str, pos: int, body_offset: int | None, body_file: str) -> str:
    """`file:line` of offset `pos`, numbered as compiler diagnostics are (see `lower`)."""
    if body_offset is not None and pos >= body_offset:
        return f"{body_file}:{src.count(chr(10), body_offset, pos) + src.count(chr(10), 0, body_offset) + 1}"
    return f"line {src.count(chr(10), 0, pos) + 1}"


_AS_CAST = re.compile(
    r"\(\s*((?:(?:const|volatile)\s+)*(?:device|constant|threadgroup|thread)\s+(?:const\s+)?"
    r"[A-Za-z_][\w:]*(?:\s*<[^()<>;]*>)?\s*(?:const\s*)?\*+\s*(?:const\s*)?)\)(?=\s*[\w(*&!~])"
)
_SCOPE_OPEN = re.compile(r"[;{}]")
_ARRAY_DECL = re.compile(
    r"\s*(?P<type>(?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?)\s+(?P<name>[A-Za-z_]\w*)\s*"
    r"(?P<dims>(?:\[[^\]]+\]\s*)+)(?:=[^;]*)?;"
)
_STRUCT_VAR = r"\s*(?:const\s+)?(?:{names})\b(?:\s*<[^;{{}}]*?>)?\s+(?P<name>[A-Za-z_]\w*)\s*;"
# Thread-private scalars and vectors (`const int seq = ...;`, `float2 sb;`): MSL's built-in
# arithmetic types. `constexpr` and `constant` ones are compile-time values, never registers;
# loop counters (declared after `(`) are not counted.
_SCALAR_TYPES = (
    r"(?:(?:bool|char|uchar|short|ushort|int|uint|long|ulong|half|bfloat|float)(?:[234])?"
    r"|size_t|u?int(?:8|16|32|64)_t)"
)
SCALAR_SITES = 512  # runtime.cpp: N_REG_SITES / 2
_SCALAR_DECL = re.compile(
    r"\s*(?:const\s+)?(?:thread\s+)?(?P<type>" + _SCALAR_TYPES + r")\s+(?P<name>[A-Za-z_]\w*)\s*(?:=[^;{}]*)?;"
)
# Where a declaration may start: after `;`, `{` or `}` (or at the text's start). Sites are looked
# for with this lookbehind in front, so the regex engine passes over every other position at
# once: with only the leading `\s*`, each blank run (comments are blanked to spaces) was scanned
# again from each of its positions, quadratic in its length (0.7 s per kernel source, most of
# the time a test spent launching a cached kernel).
_AT_STATEMENT = r"(?:(?<=[;{}])|\A)"
_ARRAY_SITE = re.compile(_AT_STATEMENT + _ARRAY_DECL.pattern)
_SCALAR_SITE = re.compile(_AT_STATEMENT + _SCALAR_DECL.pattern)
_NOT_TYPES = {
    "threadgroup",
    "constant",
    "device",
    "static",
    "return",
    "typedef",
    "using",
    "else",
    "case",
    "goto",
    "delete",
    "throw",
    "constexpr",
}


def _scopes(code: str) -> list[tuple[int, int, str, str]]:
    """(open, close, kind, struct name) of every brace pair: kind is "struct" (struct/class/union
    body), "init" (a braced initializer) or "code" (namespace, function or block)."""
    out, stack, prev = [], [], 0
    for m in _SCOPE_OPEN.finditer(code):
        ch = m.group()
        if ch == "{":
            head = code[prev : m.start()]
            sm = re.search(r"\b(?:struct|class|union)\s+(\w+)?[^()]*$", head)
            if sm:
                kind = "struct"
            elif re.search(r"\bnamespace\b|\bextern\s*$|\benum\b", head):
                kind = "other"  # namespace scope, extern "C", enumerators: no statements
            elif re.search(r"[=,(]\s*$|return\s*$", head):
                kind = "init"
            else:
                kind = "code"
            stack.append((m.start(), kind, sm.group(1) or "" if sm else ""))
        elif ch == "}" and stack:
            o, kind, name = stack.pop()
            out.append((o, m.start(), kind, name))
        prev = m.end()
    return out


def _register_notes(code: str, start: int = 0) -> list[tuple[int, int, str]]:
    """Edits appending `mlxemu_regs(site, sizeof(x));` after thread-private arrays and after
    variables of struct types that hold arrays (item 7 of the module docstring)."""
    scopes = _scopes(code)

    def innermost(p: int) -> str:
        best = (-1, "other")
        for o, c, k, _ in scopes:
            if o < p < c and o > best[0]:
                best = (o, k)
        return best[1]

    holders = set()
    for o, c, k, name in scopes:
        if (
            k == "struct"
            and name
            and any(m.group("type").split()[-1] not in _NOT_TYPES for m in _ARRAY_DECL.finditer(code, o + 1, c))
        ):
            holders.add(name)
    pats = [_ARRAY_SITE, _SCALAR_SITE]
    if holders:
        pats.append(re.compile(_AT_STATEMENT + _STRUCT_VAR.format(names="|".join(sorted(holders)))))
    edits, site = [], 0
    for pat in pats:
        for m in pat.finditer(code, start):
            s = m.start()
            if pat is _ARRAY_SITE and set(m.group("type").split()) & _NOT_TYPES:
                continue
            if innermost(s) != "code":  # a function or block body: a statement can follow
                continue
            # Whole 32-bit registers: a bool or half takes one.
            size = f"(sizeof({m.group('name')}) + 3) / 4 * 4"
            # Scalar sites are numbered from SCALAR_SITES, so the runtime can tell them apart.
            n = site + SCALAR_SITES if pat is _SCALAR_SITE else site
            edits.append((m.end(), m.end(), f" mlxemu_regs({n}, {size});"))
            site += 1
    return edits


_VAR_DECL = re.compile(
    r"(?P<quals>(?:(?:static|constexpr|const|inline|volatile|extern)\s+)*)"
    r"(?P<type>[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?(?:\s*[*&]+)?)\s*(?<=[\s*&>])(?P<name>[A-Za-z_]\w*)"
    r"\s*(?:\[[^\]]*\]\s*)*(?==|;|\{)"
)
_DECL_HEADS = {
    "typedef",
    "using",
    "template",
    "struct",
    "class",
    "union",
    "enum",
    "namespace",
    "return",
    "operator",
    "friend",
    "case",
    "default",
    "goto",
    "throw",
    "delete",
    "else",
    "do",
    "static_assert",
    "public",
    "private",
    "protected",
}


def _blank_directives(code: str) -> str:
    """Preprocessor lines (with their continuations) blanked out, layout kept."""
    out = list(code)
    for m in re.finditer(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", code, re.M):
        for i in range(m.start(), m.end()):
            if out[i] != "\n":
                out[i] = " "
    return "".join(out)


def unqualified_program_variables(code: str, start: int = 0) -> list[tuple[int, str]]:
    """(offset, declaration) of each variable after `start` that Metal wants in `constant`:
    at namespace scope, a static data member, or a static local. `code` has its comments
    blanked (`_strip_comments_keep_layout`)."""
    code = _blank_directives(code)
    scopes = _scopes(code)

    def innermost(p: int) -> str:
        best = (-1, "top")
        for o, c, k, _ in scopes:
            if o < p < c and o > best[0]:
                best = (o, k)
        return best[1]

    hits = []
    for m in re.finditer(r"(?:^|[;{}])\s*", code[start:]):
        pos = start + m.end()
        d = _VAR_DECL.match(code, pos)
        if not d or pos >= len(code):
            continue
        words = set(re.findall(r"\w+", code[pos : d.end()]))
        if d.group("type").split("<")[0].strip() in _DECL_HEADS or words & {"constant", "threadgroup"}:
            continue
        scope = innermost(pos)
        static = "static" in d.group("quals").split()
        if scope in ("top", "other") or (scope in ("struct", "code") and static):
            end = code.find(";", pos)
            hits.append((pos, " ".join(code[pos : end if end > 0 else d.end()].split())))
    return hits


def lower(
    src: str,
    body_offset: int | None = None,
    body_file: str = "kernel.metal",
    kernel_span: tuple[int, int] | None = None,
) -> str:
    """The C++ text the emulator compiles for the MSL text `src` (see the module docstring).

    `body_offset` (the start of a line: where MLX's preamble ends) gets a `#line` directive so
    diagnostics and call sites after it name `body_file` and their line in `src`.
    `kernel_span` (start, end) of the kernel function's body: `threadgroup` storage must lie in it.
    """
    from .compiler import CompileError

    code = _strip_comments_keep_layout(src)
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement) in `src` coordinates
    if body_offset is not None:
        line = src.count("\n", 0, body_offset) + 1
        edits.append((body_offset, body_offset, f'#line {line} "{body_file}"\n'))
    for slot_id, (pos, end, has_init) in enumerate(_storage_declarations(code, r"\bthreadgroup\b")):
        where = _where(src, pos, body_offset, body_file)
        if has_init:
            raise CompileError(
                f"{where}: a threadgroup variable cannot have an initializer "
                f"(Metal rejects it): {' '.join(code[pos:end].split())}"
            )
        if kernel_span is not None and not kernel_span[0] <= pos < kernel_span[1]:
            raise CompileError(
                f"{where}: threadgroup memory can only be declared in the kernel "
                f"function's scope: {' '.join(code[pos:end].split())}"
            )
        slot = _tg_slot(code[pos:end], slot_id) if end > 0 and not has_init else None
        if slot is not None:
            edits.append((pos, end, slot))
            continue
        edits.append((pos, pos, "MLXEMU_TG_STATIC "))
        if not has_init and end > 0:
            # Zero-initialised aggregate: no constructor call, which clang refuses for objects
            # in an address space (atomic<int>, structs). The runtime refills it anyway.
            edits.append((end, end, " = {}"))
    if body_offset is not None:
        for pos, decl in unqualified_program_variables(code, body_offset):
            raise CompileError(
                f"{_where(src, pos, body_offset, body_file)}: a program-scope or "
                f"static variable must be in the constant address space (Metal "
                f"rejects it): {decl}"
            )
    for pos, _, _ in _storage_declarations(code, r"\b(?:(?:constexpr|const)\s+)*constant\b"):
        edits.append((pos, pos, "static "))
    for m in _METHOD_AS.finditer(code):
        edits.append((m.start(2), m.end(2), "MLXEMU_AS_METHOD_" + m.group(2)))
    for m in _INST_ATTRS.finditer(code):
        edits.append((m.start(2), m.end(2), ""))
    for m in _AS_ARRAY_PARAM.finditer(code):
        edits.append((m.start(2), m.end(), "* " + m.group(2)))
    for m in _HALF_LIT.finditer(code):
        ty = "half" if m.group(2) in ("h", "H") else "bfloat"
        num = m.group(1)
        if "." not in num and "e" not in num.lower():
            num += ".0"
        edits.append((m.start(), m.end(), f"(({ty}){num}f)"))
    for m in _FLOAT_LIT.finditer(code):
        edits.append((m.end(), m.end(), "f"))
    start = body_offset or 0
    for m in _AS_CAST.finditer(code, start):
        ty = " ".join(m.group(1).split())
        edits.append((m.start(), m.end(), f"mlxemu_ascast<{ty}>{{}} % "))
    if body_offset is not None:
        edits += _register_notes(code, body_offset)
    edits.sort(key=lambda e: (e[0], e[1]))
    out, last = [], 0
    for s, e, r in edits:
        if s < last:
            continue
        out.append(src[last:s])
        out.append(r)
        last = e
    out.append(src[last:])
    return "".join(out)
