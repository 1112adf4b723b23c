from pathlib import Path

import pytest

import mlxpaged  # noqa: F401  (first: it points MLX at the system OpenBLAS before MLX loads)
from mlxpaged.testing.tiny_model import write_tiny_qwen2


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    return write_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_path):
    from mlxpaged.loading.loader import load

    return load(str(tiny_model_path), "float32")


@pytest.fixture(scope="session")
def mlx_lm_tiny(tiny_model_path):
    """The same checkpoint loaded by mlx-lm's own Qwen2 implementation (the contiguous reference)."""
    import mlx_lm

    return mlx_lm.load(str(tiny_model_path))
