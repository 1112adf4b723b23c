"""The models a benchmark compares: mlxpaged's load of a checkpoint and mlx-lm's load of the same files."""

from __future__ import annotations

import tempfile
from pathlib import Path


def tiny_checkpoint(**kwargs) -> str:
    """A tiny random-weight Qwen2 checkpoint in a temporary folder (`mlxpaged.testing.tiny_model`, as the tests use)."""
    from ..testing.tiny_model import write_tiny_qwen2

    return str(write_tiny_qwen2(Path(tempfile.mkdtemp(prefix="mlxpaged-tiny-")) / "tiny", **kwargs))


def load_models(model: str | None, tiny: bool = False, dtype: str | None = "auto", reference: bool = True):
    """(mlxpaged's LoadedModel, mlx-lm's model of the same files in the same dtype, or None)."""
    from ..loading.loader import load

    loaded = load(tiny_checkpoint() if tiny else model, dtype)
    if not reference:
        return loaded, None
    import mlx_lm

    ref, _ = mlx_lm.load(str(loaded.path))
    ref.set_dtype(loaded.dtype)
    return loaded, ref


def model_label(loaded, model: str | None, tiny: bool = False) -> str:
    """A readable name for result files: the converted copy's folder is only a hash."""
    if tiny:
        return "tiny-qwen2"
    if model is None:
        from ..loading.offline_model import DEFAULT_MODEL

        return f"{DEFAULT_MODEL}-instruct-offline"
    return Path(model).name or str(model)
