"""The package's import graph: no cycle among mlxpaged's modules (imports inside functions
included, annotation-only imports under TYPE_CHECKING excluded), core/ imports no MLX, and every
import keeps the layering rule its package's docstring states ("May import: ..."; imports
inside functions and under TYPE_CHECKING included)."""

import ast
import re
from pathlib import Path

import pytest

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


def _imports(name: str, path: Path, mods: dict[str, Path], type_checking: bool = False) -> set[str]:
    """Every module of mlxpaged (or outside name) that `path` imports, at any depth; annotation-only
    imports (under TYPE_CHECKING) too when `type_checking`."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node, in_type_checking: bool):
        for ch in ast.iter_child_nodes(node):
            tc = not type_checking and (
                in_type_checking or (isinstance(ch, ast.If) and "TYPE_CHECKING" in ast.unparse(ch.test))
            )
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


def _graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the mlxpaged modules it imports."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for d in _imports(name, path, mods, type_checking):
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


# -- the layering rules ---------------------------------------------------------------------------
ITEM = re.compile(r"`([\w.]+)`(?:\s*\(from\s+`([\w.]+)`\s+only\))?")


def _rule_text(doc: str) -> str | None:
    """What follows "May import:" up to the end of its sentence (a period outside backticks)."""
    at = doc.find("May import:")
    if at < 0:
        return None
    text, quoted = doc[at + len("May import:") :], False
    for i, ch in enumerate(text):
        quoted ^= ch == "`"
        if ch == "." and not quoted:
            return text[:i]
    return text


def _rules() -> dict[str, list[tuple[str, str | None]]]:
    """Package -> what its modules may import besides itself and the shared modules: (module
    prefix, the only importer prefix or None), as its `__init__` docstring says."""
    rules = {}
    for init in sorted(ROOT.glob("*/__init__.py")):
        text = _rule_text(ast.get_docstring(ast.parse(init.read_text())) or "")
        assert text is not None, f"{init.parent.name}/__init__.py does not say what it may import (May import: ...)"
        rules[init.parent.name] = [
            (f"mlxpaged.{m}", f"mlxpaged.{only}" if only else None) for m, only in ITEM.findall(text)
        ]
    return rules


def _shared() -> set[str]:
    """The top-level modules (config, errors, settings, ...): every package may import them."""
    return {f"mlxpaged.{p.stem}" for p in ROOT.glob("*.py") if p.stem != "__init__"}


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def _violations(graph: dict[str, set[str]], rules: dict, shared: set[str]) -> list[str]:
    bad = []
    for mod, deps in graph.items():
        parts = mod.split(".")
        if mod == "mlxpaged":  # the public API re-exports from every layer
            continue
        if mod in shared:
            bad += [f"{mod} -> {d} (a shared module imports no package)" for d in deps if d not in shared]
            continue
        pkg = f"mlxpaged.{parts[1]}"
        for d in deps:
            if _under(d, pkg) or d in shared:
                continue
            if not any(_under(d, m) and (only is None or _under(mod, only)) for m, only in rules[parts[1]]):
                bad.append(f"{mod} -> {d}")
    return sorted(bad)


def test_every_package_keeps_its_import_rule():
    rules = _rules()
    mods = _modules()
    for pkg, items in rules.items():
        for m, only in items:
            assert any(_under(x, m) for x in mods), f"{pkg}'s rule names {m}, which does not exist"
            assert only is None or any(_under(x, only) for x in mods), f"{pkg}'s rule names {only}"
    assert _violations(_graph(type_checking=True), rules, _shared()) == []


def _allowed(pkg: str, rules: dict) -> set[str]:
    return {m.split(".")[1] for m, only in rules[pkg] if only is None and m.count(".") == 1}


@pytest.mark.parametrize("pkg", sorted(p.parent.name for p in ROOT.glob("*/__init__.py")))
def test_a_planted_break_of_each_rule_fails(pkg):
    """One import outside what `pkg` may import, planted in one of its modules, is reported; so
    is an import of a shared module that reaches into a package."""
    rules, shared, graph = _rules(), _shared(), _graph(type_checking=True)
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    target = next(q for q in packages if q != pkg and q not in _allowed(pkg, rules))
    mod = next(m for m in sorted(graph) if _under(m, f"mlxpaged.{pkg}"))
    planted = {**graph, mod: graph[mod] | {f"mlxpaged.{target}"}}
    assert _violations(planted, rules, shared) == [f"{mod} -> mlxpaged.{target}"]
    leaf = {**graph, "mlxpaged.config": graph["mlxpaged.config"] | {f"mlxpaged.{pkg}"}}
    assert _violations(leaf, rules, shared) == [
        f"mlxpaged.config -> mlxpaged.{pkg} (a shared module imports no package)"
    ]


def test_a_rule_for_one_module_only_binds_the_others():
    """engine/ reaches distributed/ from its builder only: the same import elsewhere in engine/ breaks it."""
    rules, shared, graph = _rules(), _shared(), _graph(type_checking=True)
    assert "mlxpaged.distributed.tp_engine" in graph["mlxpaged.engine.builder"]  # allowed there
    planted = {**graph, "mlxpaged.engine.llm": graph["mlxpaged.engine.llm"] | {"mlxpaged.distributed.collectives"}}
    assert _violations(planted, rules, shared) == ["mlxpaged.engine.llm -> mlxpaged.distributed.collectives"]


def test_type_checking_imports_count_for_the_rules(tmp_path):
    """An import for annotations only still ties the layers: core/ naming an engine type is a break."""
    p = tmp_path / "sequence.py"
    p.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..engine.sampling_params import X\n")
    mods = _modules()
    assert _imports("mlxpaged.core.sequence", p, mods) == {"typing"}  # the cycle check leaves it out
    assert "mlxpaged.engine.sampling_params" in _imports("mlxpaged.core.sequence", p, mods, type_checking=True)
    graph = {**_graph(type_checking=True), "mlxpaged.core.sequence": {"mlxpaged.engine.sampling_params"}}
    assert _violations(graph, _rules(), _shared()) == ["mlxpaged.core.sequence -> mlxpaged.engine.sampling_params"]
