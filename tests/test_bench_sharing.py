"""`mlxpaged bench sharing`: memory saved by sharing, measured from the allocator on real prompts."""

from __future__ import annotations

import json
import subprocess
import sys

from mlxpaged.testing.slowness import wall


def _run(tmp_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "mlxpaged.cli", "bench", "sharing", "--tiny", "--out", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=wall(600),
    )


def test_sharing_rows_follow_what_is_shared(tmp_path):
    r = _run(tmp_path, "--num-prompts", "3", "--max-tokens", "12", "--widths", "1,2,4", "--datasets", "alpaca")
    assert r.returncode == 0, r.stderr
    (path,) = tmp_path.glob("sharing_*.json")
    rows = {(x["mode"], x["width"]): x for x in json.loads(path.read_text())["rows"]}
    assert set(rows) == {(m, w) for m in ("parallel", "beam") for w in (1, 2, 4)}
    for mode in ("parallel", "beam"):
        # One sequence per request shares nothing; more samples share the same prompt blocks.
        assert rows[(mode, 1)]["memory_saved_pct"] == 0.0
        assert 0 < rows[(mode, 2)]["memory_saved_pct"] < rows[(mode, 4)]["memory_saved_pct"] < 100
        for w in (2, 4):
            x = rows[(mode, w)]
            assert x["blocks_in_use_peak"] < x["blocks_without_sharing_peak"]
    assert rows[("beam", 4)]["beam_forks"] > 0 and rows[("parallel", 4)]["beam_forks"] == 0
    assert "paper % (OPT-13B)" in r.stdout and "37.6-55.2" in r.stdout


def test_sharing_bad_widths_is_one_line(tmp_path):
    r = _run(tmp_path, "--widths", "0")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: bad --modes/--datasets/--widths")
