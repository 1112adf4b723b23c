"""GGUF support: convert llama.cpp's qwen2 GGUF files into checkpoints mlx-lm loads.

Public API:

- :func:`convert_gguf` (path, cache_dir=None, *, dtype="float16", force=False, weights="float")
  -> Path of a cached Hugging Face-style checkpoint directory; ``weights="quantized"`` keeps
  block weights as MLX affine layers (:mod:`.mlx_quant`).
- :func:`load_gguf_tokenizer` (path) -> ``tokenizers.Tokenizer``, metadata only.
- :class:`GGUFError`, raised with a one-line message for unreadable or unsupported files.
- :class:`GGUFFile`, :func:`dequantize`, :data:`SUPPORTED_TYPES` for lower-level use.
"""

from .convert import CONVERTER_VERSION, DEFAULT_DTYPE, WEIGHTS, cache_root, convert_gguf, file_sha256
from .reader import SUPPORTED_TYPES, GGUFError, GGUFFile, TensorInfo, dequantize
from .tokenizer import load_gguf_tokenizer, tokenizer_from_metadata

__all__ = [
    "convert_gguf",
    "load_gguf_tokenizer",
    "GGUFError",
    "GGUFFile",
    "TensorInfo",
    "dequantize",
    "SUPPORTED_TYPES",
    "cache_root",
    "file_sha256",
    "tokenizer_from_metadata",
    "CONVERTER_VERSION",
    "DEFAULT_DTYPE",
    "WEIGHTS",
]
