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
"""

from __future__ import annotations

import re

_METHOD_AS = re.compile(r"\)(\s*(?:const\s+)?)(constant|device|threadgroup)\b(?=\s*(?:\{|:[^:]|;|=|->|noexcept))")
_INST_ATTRS = re.compile(r"\btemplate(\s*)((?:\[\[.*?\]\]\s*)+)(?=decltype|void|\w)", re.S)
# An array parameter in an address space (`constant const int64_t strides[2]`): clang rejects
# the array form, so it becomes the pointer it decays to anyway.
_AS_ARRAY_PARAM = re.compile(r"(?<=[(,])(\s*(?:const\s+)?(?:constant|device|threadgroup)\b[^,;(){}\[\]]*?)\b(\w+)\s*\[[^\]]*\]\s*(?=[,)])")
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
        decl = code[m.end(): end if end >= 0 else len(code)]
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
    rest = decl[len("threadgroup"):]
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
    text = (f"threadgroup {ty} {ref} = *(threadgroup {ty} {ptr})mlxemu_tg_slot("
            f'{slot_id}, sizeof({ty}{dims}), alignof({ty}), "{name}")')
    return text + "\n" * decl.count("\n")


def lower(src: str, body_offset: int | None = None, body_file: str = "kernel.metal") -> str:
    """The C++ text the emulator compiles for the MSL text `src` (see the module docstring).

    `body_offset` (the start of a line: where MLX's preamble ends) gets a `#line` directive so
    diagnostics and call sites after it name `body_file` and their line in `src`.
    """
    code = _strip_comments_keep_layout(src)
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement) in `src` coordinates
    if body_offset is not None:
        line = src.count("\n", 0, body_offset) + 1
        edits.append((body_offset, body_offset, f'#line {line} "{body_file}"\n'))
    for slot_id, (pos, end, has_init) in enumerate(_storage_declarations(code, r"\bthreadgroup\b")):
        slot = _tg_slot(code[pos:end], slot_id) if end > 0 and not has_init else None
        if slot is not None:
            edits.append((pos, end, slot))
            continue
        edits.append((pos, pos, "MLXEMU_TG_STATIC "))
        if not has_init and end > 0:
            # Zero-initialised aggregate: no constructor call, which clang refuses for objects
            # in an address space (atomic<int>, structs). The runtime refills it anyway.
            edits.append((end, end, " = {}"))
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
