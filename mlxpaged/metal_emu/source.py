"""The exact MSL text MLX compiles for `mx.fast.metal_kernel`, rebuilt in Python.

Mirrors mlx/backend/common/metal_kernel.cpp (signature, kernel name, explicit instantiation)
and mlx/backend/metal/make_compiled_preamble.sh (the `metal::utils()` preamble MLX prepends).
Invariant: `full_source(...) == metal_utils_preamble() + generated_source(...)`, and
`generated_source` equals what MLX prints with `verbose=True` (checked by the tests through
`mlx_compiled_source`, which asks the installed MLX itself).
"""

from __future__ import annotations

import functools
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

# Inputs with fewer elements are passed in the constant address space (MLX's constant).
MAX_CONSTANT_ARRAY_SIZE = 8

# MLX's table, in its order: attribute name -> MSL type. A parameter is added when the
# name occurs anywhere in the source (plain substring search, as MLX does).
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

_TYPE_STRINGS = {
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float64: "double",
    mx.complex64: "complex64_t",
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
}


def type_string(dtype: mx.Dtype) -> str:
    """MLX's `get_type_string`: the MSL spelling of an MLX dtype."""
    try:
        return _TYPE_STRINGS[dtype]
    except KeyError:
        raise TypeError(f"[metal_kernel] Unsupported compilation type {dtype}") from None


@dataclass(frozen=True)
class ParamInfo:
    """How one kernel parameter is passed (what the signature says about it)."""

    name: str
    kind: str  # "input", "shape", "strides", "ndim", "output"
    msl_type: str  # e.g. "const device float*"
    input_index: int  # index into inputs/outputs this parameter belongs to


@dataclass(frozen=True)
class Generated:
    """The generated part of a kernel's source and how to call it."""

    kernel_name: str
    source: str  # header + signature + body + instantiation
    params: tuple[ParamInfo, ...]  # buffer parameters in [[buffer(i)]] order
    attributes: tuple[tuple[str, str], ...]  # (name, MSL type) in signature order
    template_def: str  # "<float, 3, 1>" or ""


def _template_value(arg) -> tuple[str, str]:
    """(parameter kind, value text) of one template argument, as MLX writes them."""
    if isinstance(arg, bool):  # before int: bool is an int in Python
        return "bool", "1" if arg else "0"
    if isinstance(arg, int):
        return "int", str(arg)
    if isinstance(arg, mx.Dtype):
        return "typename", type_string(arg)
    raise TypeError(f"[metal_kernel] bad template argument {arg!r}")


def shape_infos(source: str, input_names) -> list[tuple[bool, bool, bool]]:
    return [(f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source) for n in input_names]


def attributes_in(source: str) -> tuple[tuple[str, str], ...]:
    return tuple((a, t) for a, t in METAL_ATTRIBUTES if a in source)


def generated_source(
    *, name, input_names, output_names, source, header, atomic_outputs, inputs, output_dtypes, template
) -> Generated:
    """The text MLX prints with verbose=True: header, signature, body and instantiation."""
    template = list(template or [])
    infos = shape_infos(source, input_names)
    attrs = attributes_in(source)
    kernel_name = "custom_kernel_" + name
    template_def = ""
    if template:
        template_def = "<" + ", ".join(_template_value(v)[1] for _, v in template) + ">"
        h = template_def.replace("<", "_").replace(">", "_").replace(", ", "_")
        kernel_name += "_" + h[:-1]
    for arr in inputs:
        kernel_name += "_" + type_string(arr.dtype)
        if arr.ndim == 0:
            kernel_name += "s"
        elif arr.size < MAX_CONSTANT_ARRAY_SIZE:
            kernel_name += "c"
    for dt in output_dtypes:
        kernel_name += "_" + type_string(dt)

    out = [header]
    if template:
        out.append("template <" + ", ".join(f"{_template_value(v)[0]} {n}" for n, v in template) + ">\n")
    out.append(f"[[kernel]] void {kernel_name}(\n")
    params = []
    index = 0
    for i, (n, arr) in enumerate(zip(input_names, inputs)):
        loc = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if arr.ndim == 0 else "*"
        ty = f"const {loc} {type_string(arr.dtype)}{ref}"
        out.append(f"  {ty} {n} [[buffer({index})]],\n")
        params.append(ParamInfo(n, "input", ty, i))
        index += 1
        if arr.ndim > 0:
            for flag, suffix, pty in zip(
                infos[i],
                ("shape", "strides", "ndim"),
                ("const constant int*", "const constant int64_t*", "const constant int&"),
            ):
                if flag:
                    out.append(f"  {pty} {n}_{suffix} [[buffer({index})]],\n")
                    params.append(ParamInfo(f"{n}_{suffix}", suffix, pty, i))
                    index += 1
    n_out = len(output_names)
    for i, (n, dt) in enumerate(zip(output_names, output_dtypes)):
        ts = type_string(dt)
        ty = f"device atomic<{ts}>*" if atomic_outputs else f"device {ts}*"
        out.append(f"  {ty} {n} [[buffer({index})]]")
        params.append(ParamInfo(n, "output", ty, i))
        # MLX's own (quirky) test for "last parameter": compares against inputs + outputs count.
        if index < len(inputs) + n_out - 1 or attrs:
            out.append(",\n")
        else:
            out.append(") {\n")
        index += 1
    for j, (a, t) in enumerate(attrs):
        out.append(f"  {t} {a} [[{a}]]")
        out.append(",\n" if j < len(attrs) - 1 else ") {\n")
    out.append(source)
    out.append("\n}\n")
    if template:
        tdef = kernel_name + template_def
        out.append(f'\ntemplate [[host_name("{kernel_name}")]] [[kernel]] decltype({tdef}) {tdef};\n')
    return Generated(kernel_name, "".join(out), tuple(params), attrs, template_def)


def _mlx_include_dir() -> Path:
    import mlx

    for base in mlx.__path__:
        if (Path(base) / "include").is_dir():
            return Path(base) / "include"
    raise FileNotFoundError("the installed MLX ships no include/ directory")


@functools.cache
def metal_utils_preamble() -> str:
    """`metal::utils()`: MLX's utils.h with its local includes expanded, as MLX's build does.

    make_compiled_preamble.sh lists headers in post-order of inclusion (dependencies first,
    each once), drops `#include "*.h"` and `#pragma once` lines, and wraps each in a banner.
    Rebuilt here from the headers the installed MLX ships (the same version that runs).
    """
    root = _mlx_include_dir()
    top = "mlx/backend/metal/kernels/utils.h"
    order: list[str] = []
    seen: set[str] = set()
    inc = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)

    def visit(rel: str):
        seen.add(rel)
        for dep in inc.findall((root / rel).read_text()):
            if dep not in seen:
                visit(dep)
        order.append(rel)

    visit(top)
    # The script appends the input file once more after the sorted dependency list.
    order = [h for h in order if h != top] + [top]
    drop = re.compile(r'#include ".*.h"|#pragma once')
    lines = ["// Copyright © 2025 Apple Inc.", "", f"// Auto generated source for {top}", ""]
    bar = "/" * 79
    for h in order:
        lines += [bar, f'// Contents from "{h}"', bar, "", f'#line 1 "{h}"']
        text = (root / h).read_text()
        lines += [ln for ln in text.split("\n")[: -1 if text.endswith("\n") else None] if not drop.search(ln)]
        lines.append("")
    lines.append(bar)
    return "\n" + "\n".join(lines) + "\n"


def mlx_generated_source(kernel_kwargs: dict, call_kwargs: dict) -> str:
    """What the installed MLX prints for this kernel and call (verbose=True under export).

    Works without Metal: `mx.export_function` traces the call on a placeholder GPU stream and
    the C++ side prints the source to the process's stdout, captured here at fd level.
    """
    kernel = mx.fast.metal_kernel(**kernel_kwargs)
    call = dict(call_kwargs)
    call["verbose"] = True
    call.pop("stream", None)
    inputs = list(call.pop("inputs"))

    def fn(*xs):
        return kernel(inputs=list(xs), **call)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.mlxfn")
        sys.stdout.flush()
        saved = os.dup(1)
        cap = os.path.join(tmp, "out.txt")
        fd = os.open(cap, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.dup2(fd, 1)
            mx.export_function(path, fn, *inputs)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            os.close(fd)
        text = Path(cap).read_text()
    start = text.index("```\n") + 4
    end = text.rindex("\n```")
    # MLX prints "```", endl, the source, endl, "```": the slice is exactly the source.
    return text[start:end]


def mlx_compiled_source(kernel_kwargs: dict, call_kwargs: dict) -> str:
    """The full text MLX hands the Metal compiler: `metal::utils()` + the generated source."""
    return metal_utils_preamble() + mlx_generated_source(kernel_kwargs, call_kwargs)
