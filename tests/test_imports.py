"""The package's import graph: no cycle among mlxpaged's modules (imports inside functions
included, annotation-only imports under TYPE_CHECKING excluded), and core/ imports no MLX."""

import ast
from pathlib import Path

import mlxpaged

ROOT = Path(mlxpaged.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every module of mlxpaged (or outside name) that `path` imports, at any depth."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node, in_type_checking: bool):
        for ch in ast.iter_child_nodes(node):
            tc = in_type_checking or (isinstance(ch, ast.If) and "TYPE_CHECKING" in ast.unparse(ch.test))
            if isinstance(ch, ast.ImportFrom) and not tc:
                if ch.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (ch.level - 1)]
                    mod = ".".join(base + ([ch.module] if ch.module else []))
                else:
                    mod = ch.module or ""
                for a in ch.names:
                    found.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod)
            elif isinstance(ch, ast.Import) and not tc:
                found.update(a.name for a in ch.names)
            visit(ch, tc)

    visit(ast.parse(path.read_text()), False)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for d in _imports(name, path, mods):
            while d and d not in mods:
                d = d.rpartition(".")[0]
            if d and d != name:
                deps.add(d)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in graph:
        if v not in index:
            connect(v)
    return comps


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_core_imports_no_mlx():
    mods = _modules()
    for name, path in mods.items():
        if name.startswith("mlxpaged.core"):
            bad = {d for d in _imports(name, path, mods) if d == "mlx" or d.startswith("mlx.")}
            assert not bad, f"{name} imports {bad}"


def test_every_package_says_what_it_owns():
    for init in ROOT.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.parent.name}/__init__.py has no docstring saying what it owns"


def _mlx_before_mlxpaged(source: str) -> int | None:
    """The line of a module-level MLX (or mlx-lm) import that runs before any mlxpaged import, if any."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        else:
            continue
        tops = {n.split(".")[0] for n in names}
        if "mlxpaged" in tops:
            return None
        if tops & {"mlx", "mlx_lm"}:
            return node.lineno
    return None


def test_scripts_load_openblas_before_mlx():
    """A script run on its own must import mlxpaged (which loads the system OpenBLAS, _blas.py)
    before MLX: once MLX is loaded it keeps the wheel's reference BLAS, about 15x slower on the
    CPU, and every figure the script prints is off. (An import sorter moves `import mlx.core`
    above `import mlxpaged`; the scripts keep an `# isort: split` after it.)"""
    scripts = sorted((ROOT.parent / "scripts").glob("*.py"))
    assert scripts
    bad = {p.name: line for p in scripts if (line := _mlx_before_mlxpaged(p.read_text())) is not None}
    assert bad == {}, f"MLX imported before mlxpaged at: {bad}"
    assert _mlx_before_mlxpaged("import sys\nimport mlx.core as mx\nimport mlxpaged\n") == 2
    assert _mlx_before_mlxpaged("import mlxpaged\nimport mlx.core as mx\n") is None
