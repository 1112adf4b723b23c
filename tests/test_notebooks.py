"""Every notebook in notebooks/ runs top to bottom, and the walkthrough prints the engine's real figures.

The notebooks are executed by nbclient in a `python3` kernel, which jupyter_client starts with
this interpreter (it swaps a kernelspec's bare `python` for `sys.executable`), so the kernel sees
the same environment as the tests; `test_kernel_runs_this_python` checks that.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
WALKTHROUGH = NOTEBOOK_DIR / "paged_attention.ipynb"
CELL_TIMEOUT_S = 120


def execute(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Run every cell in place, cwd = notebooks/; raises CellExecutionError on the first error."""
    # The notebooks' own tiny model, whatever the caller's shell points MLXPAGED_NOTEBOOK_MODEL at.
    env = {k: v for k, v in os.environ.items() if k != "MLXPAGED_NOTEBOOK_MODEL"}
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute(env=env)
    return nb


def printed(nb: nbformat.NotebookNode) -> str:
    """Everything the cells wrote to stdout, in order."""
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []) if o.output_type == "stream" and o.name == "stdout")


@pytest.fixture(scope="module")
def executed():
    """Executes each notebook at most once per module, so the fact checks reuse the run."""
    cache: dict[Path, nbformat.NotebookNode] = {}

    def get(path: Path) -> nbformat.NotebookNode:
        if path not in cache:
            cache[path] = execute(nbformat.read(path, as_version=4))
        return cache[path]

    return get


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, executed):
    nb = executed(path)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


def test_walkthrough_prints_engine_figures(executed):
    text = printed(executed(WALKTHROUGH))
    # Section 4: 44-token prompt, 4 samples of 64 tokens, blocks of 16 (engine.stats_dict()).
    assert ("44-token prompt, 4 samples of 64 tokens: 22 blocks in use at peak, "
            "28 without sharing, 3 copy-on-write copies") in text
    assert "distinct samples: 4 of 4" in text
    # Section 5: RequestOutput.num_cached_tokens of A, B (shares A's first 85 tokens), C.
    for rid, reused in (("A", 0), ("B", 80), ("C", 0)):
        assert re.search(rf"^{rid}: 96 prompt tokens, {reused} reused from the prefix cache$", text, re.M), rid
    # Section 1: paged blocks of 16 on ShareGPT then Alpaca, against the seed's 98.0 and 90.4 %.
    shares = [float(s) for s in re.findall(r"paged-16\s+real/reserved\s+([\d.]+)%", text)]
    assert len(shares) == 2 and abs(shares[0] - 98.0) < 0.5 and abs(shares[1] - 90.4) < 0.5, shares


def test_walkthrough_has_a_figure_per_section(executed):
    nb = executed(WALKTHROUGH)
    figures = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    # Sections 1-5 always draw; section 6 draws when notebooks/data holds a kernel table.
    data = NOTEBOOK_DIR / "data"
    has_kernel_table = (data / "kernel_mac.json").exists() or (data / "kernel_emulator.json").exists()
    assert figures == 5 + has_kernel_table


def test_kernel_runs_this_python():
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.prefix)"))
    assert Path(printed(execute(nb)).strip()).resolve() == Path(sys.prefix).resolve()


def test_committed_notebook_matches_its_source():
    """The .ipynb is `notebooks/build_notebook.py`'s output, saved without outputs."""
    spec = importlib.util.spec_from_file_location("build_notebook", NOTEBOOK_DIR / "build_notebook.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    built = build.build()
    committed = nbformat.read(WALKTHROUGH, as_version=4)
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in built.cells], (
        "paged_attention.ipynb is stale: run python notebooks/build_notebook.py")
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in committed.cells if c.cell_type == "code"), "save the notebook without outputs"
