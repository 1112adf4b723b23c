"""How a benchmark result was made, and where it is written.

Every result JSON carries `provenance()`: the exact command line, the git commit of the code
that ran (only when mlxpaged is imported from a checkout; an installed copy says "unknown"),
the machine (platform, CPU, cores, RAM) and MLX's version and device. The scripts and
`mlxpaged bench` both write through `write_json`, so no result lacks it.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the checkout, when running from one


def machine_name() -> str:
    """The chip ("Apple M3 Pro") on a Mac, the CPU model elsewhere."""
    try:
        if platform.system() == "Darwin":
            return (
                subprocess.run(
                    ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
                ).stdout.strip()
                or platform.machine()
            )
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except Exception:
        pass
    return platform.machine()


def ram_gb() -> float | None:
    try:
        if platform.system() == "Darwin":
            out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True, timeout=5).stdout
            return round(int(out) / 2**30, 1)
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except Exception:
        pass
    return None


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(PACKAGE_ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_state() -> dict:
    """The commit of the checkout mlxpaged runs from, and whether files differ from it.

    Only when the git top level is the folder holding the `mlxpaged` package: an installed copy
    inside some other repository (a venv in a checkout) must not claim that repository's commit.
    """
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != PACKAGE_ROOT:
        return {"commit": "unknown", "dirty": None}
    return {"commit": _git("rev-parse", "HEAD") or "unknown", "dirty": bool(_git("status", "--porcelain"))}


def command_line() -> str:
    """This process's command as typed: `python scripts/x.py ...` for a script, `mlxpaged ...` for the CLI."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(".py"):
        return shlex.join(["python", *argv])
    if argv and Path(argv[0]).name == "mlxpaged":
        argv[0] = "mlxpaged"
    return shlex.join(argv)


def provenance() -> dict:
    """Command line, code version, machine and MLX of this process."""
    from .. import _blas

    return {
        "command": command_line(),
        "python": sys.executable,
        "cwd": os.getcwd(),
        "git": git_state(),
        "machine": {
            "platform": platform.platform(),
            "cpu": machine_name(),
            "cores": os.cpu_count(),
            "ram_gb": ram_gb(),
            "python": platform.python_version(),
        },
        "mlx": {"version": mx.__version__, "device": str(mx.default_device()), "blas": _blas.loaded or "bundled"},
    }


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()[:60]


def result_path(out_dir: str | Path, kind: str, model: str) -> Path:
    name = f"{kind}_{slug(machine_name())}_{slug(model)}_mlx{mx.__version__}.json"
    return Path(out_dir) / name


def write_json(path: str | Path, kind: str, model: str, payload: dict) -> Path:
    """Write `payload` under the run's provenance to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"kind": kind, "model": model, "provenance": provenance(), **payload}
    path.write_text(json.dumps(doc, indent=1))
    return path


def write_result(out_dir: str | Path, kind: str, model: str, payload: dict) -> Path:
    """`write_json` to a file in `out_dir` named by machine, model and MLX version."""
    return write_json(result_path(out_dir, kind, model), kind, model, payload)
