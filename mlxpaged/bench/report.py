"""Where benchmark results go: JSON files named by machine, model and MLX version."""

from __future__ import annotations

import json
import platform
import re
import subprocess
from pathlib import Path

import mlx.core as mx


def machine_name() -> str:
    """The chip ("Apple M3 Pro") on a Mac, the CPU model elsewhere."""
    try:
        if platform.system() == "Darwin":
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip() or platform.machine()
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except Exception:
        pass
    return platform.machine()


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()[:60]


def result_path(out_dir: str | Path, kind: str, model: str) -> Path:
    name = f"{kind}_{slug(machine_name())}_{slug(model)}_mlx{mx.__version__}.json"
    return Path(out_dir) / name


def write_result(out_dir: str | Path, kind: str, model: str, payload: dict) -> Path:
    """Write `payload` with the machine, device, model and MLX version it was measured on."""
    path = result_path(out_dir, kind, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"kind": kind, "machine": machine_name(), "device": str(mx.default_device()), "model": model,
           "mlx": mx.__version__, **payload}
    path.write_text(json.dumps(doc, indent=1))
    return path
