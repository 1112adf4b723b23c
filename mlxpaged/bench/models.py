"""The models a benchmark compares: mlxpaged's load of a checkpoint and mlx-lm's load of the same files."""

from __future__ import annotations

import tempfile
from pathlib import Path


def tiny_checkpoint(family: str | None = None, **kwargs) -> str:
    """A tiny random-weight checkpoint in a temporary folder (`mlxpaged.testing.tiny_model`, as the
    tests use): mlxpaged's own tiny Qwen2, or `family`'s through mlx-lm's `ModelArgs` and `Model`."""
    from ..testing.tiny_model import write_tiny_family, write_tiny_qwen2

    folder = Path(tempfile.mkdtemp(prefix="mlxpaged-tiny-")) / "tiny"
    if family is None:
        return str(write_tiny_qwen2(folder, **kwargs))
    return str(write_tiny_family(folder, family, **kwargs))


def load_models(model: str | None, tiny: bool | str = False, dtype: str | None = "auto", reference: bool = True):
    """(mlxpaged's LoadedModel, mlx-lm's model of the same files in the same dtype, or None).

    `tiny`: True for the tiny Qwen2, or a family name (`llama`, `phi3`, ...) for that family's."""
    from ..loading.loader import load

    if tiny:
        model = tiny_checkpoint(None if tiny is True else tiny)
    loaded = load(model, dtype)
    if not reference:
        return loaded, None
    import mlx_lm

    ref, _ = mlx_lm.load(str(loaded.path))
    ref.set_dtype(loaded.dtype)
    return loaded, ref


def model_label(loaded, model: str | None, tiny: bool | str = False) -> str:
    """A readable name for result files: the converted copy's folder is only a hash."""
    if tiny:
        return "tiny-qwen2" if tiny is True else f"tiny-{tiny}"
    if model is None:
        from ..loading.offline_model import DEFAULT_MODEL

        return f"{DEFAULT_MODEL}-instruct-offline"
    return Path(model).name or str(model)
