"""MSL rules the emulator enforces although C++ would accept the code: `half` and
`bfloat` are type keywords, not typedefs a variable may shadow; program-scope and static
variables live in the `constant` address space."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxpaged.metal_emu import CompileError, metal_kernel


def run(body: str, header: str = "") -> np.ndarray:
    k = metal_kernel(name="rules", input_names=["a"], output_names=["out"], source=body, header=header)
    a = mx.arange(8, dtype=mx.float32)
    out = k(inputs=[a], grid=(8, 1, 1), threadgroup=(8, 1, 1), output_shapes=[(8,)], output_dtypes=[mx.float32])[0]
    return np.array(out)


BODY = "uint i = thread_position_in_grid.x;\nout[i] = a[i] * {};\n"


@pytest.mark.parametrize("name", ["half", "bfloat"])
def test_type_keyword_cannot_name_a_variable(name):
    body = f"const int {name} = 2;\n" + BODY.format(name)
    with pytest.raises(CompileError):
        run(body)


def test_half_still_a_type():
    out = run(BODY.format("static_cast<float>(half(2.0f) + (half)1.0f)"))
    np.testing.assert_array_equal(out, np.arange(8) * 3.0)


@pytest.mark.parametrize(
    "header",
    [
        "struct Two { static constexpr int value = 2; };\n",  # a static data member
        "constexpr int TWO = 2;\n",  # a program-scope variable
        "namespace k { const float two = 2.0f; }\n",
    ],
)
def test_program_scope_variable_needs_constant(header):
    name = "Two::value" if "Two" in header else ("k::two" if "k::" in header or "namespace" in header else "TWO")
    with pytest.raises(CompileError, match=r"constant address space.*(value|TWO|two)"):
        run(BODY.format(name), header)


def test_static_local_needs_constant():
    body = "static int two = 2;\n" + BODY.format("two")
    with pytest.raises(CompileError, match="constant address space"):
        run(body)


@pytest.mark.parametrize(
    "header,name",
    [
        ("struct Two { static constexpr constant int value = 2; };\n", "Two::value"),
        ("constant constexpr int TWO = 2;\n", "TWO"),
        ("static constant constexpr const int TWO = 2;\n", "TWO"),
    ],
)
def test_constant_program_scope_variables_compile(header, name):
    np.testing.assert_array_equal(run(BODY.format(name), header), np.arange(8) * 2.0)
