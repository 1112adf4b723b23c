"""The tiny random-weight Qwen2 writer now lives in the package (`mlxpaged.testing.tiny_model`); re-exported for old imports."""

from mlxpaged.testing.tiny_model import CHAT_TEMPLATE, CORPUS, write_tiny_qwen2, write_tokenizer  # noqa: F401
