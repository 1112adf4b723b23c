"""Encoder checkpoints (BERT, XLM-RoBERTa and BGE-M3, ModernBERT; ModernBERT cross-encoders) loaded
by mlx-embeddings, with what their files say they compute: `EncoderModel` (the engine that runs one
is engine/encoder.py), and a checkpoint's sentence-transformers pooling (`sentence_pooling`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import MlxPagedError

ENCODER_TYPES = ("bert", "xlm_roberta", "modernbert")  # mlx-embeddings' encoder families
CROSS_ENCODERS = ("ModernBertForSequenceClassification",)  # the classification heads mlx-embeddings has


def is_encoder(config: dict) -> bool:
    return str(config.get("model_type", "")).replace("-", "_") in ENCODER_TYPES


def read_json(path: Path):
    """A JSON file's value, or None when it is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def sentence_pooling(path: Path) -> tuple[str | None, bool] | None:
    """What a checkpoint's sentence-transformers files say: None without `modules.json`; else (the
    Pooling module's mode, e.g. "lasttoken", "mean_tokens", "cls_token": None without a Pooling
    module, "?" when its config names none; whether a Normalize module follows)."""
    modules = read_json(path / "modules.json")
    if not isinstance(modules, list):
        return None
    modules = [m for m in modules if isinstance(m, dict)]
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    pool_dir = next((m.get("path") for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
    pool = read_json(path / pool_dir / "config.json") if pool_dir else None
    if not isinstance(pool, dict):
        return None, normalize
    mode = next((k[len("pooling_mode_") :] for k, v in pool.items() if k.startswith("pooling_mode_") and v), "?")
    return mode, normalize


@dataclass
class EncoderModel:
    """A loaded encoder checkpoint. Invariant: `task` is "score" exactly for a cross-encoder (its
    classification head's output is the score), else "embed" with `pooling` in ("mean", "cls")."""

    model: object  # mlx-embeddings' Model
    tokenizer: object  # mlx-embeddings' TokenizerWrapper (a transformers tokenizer)
    config: dict
    path: Path
    dtype: mx.Dtype
    task: str  # "embed" or "score"
    pooling: str = "mean"  # "mean" or "cls" (embed)
    normalize: bool = True
    weights: str = "float"
    pad_id: int = 0
    processor: None = None  # no image processor: an encoder takes no images (the routes' check reads it)

    @property
    def identity(self) -> bytes:
        return hashlib.sha256(f"{self.path.resolve()}|{self.dtype}|encoder".encode()).digest()

    @property
    def context(self) -> int | None:
        """Input tokens the position table holds (XLM-R's positions start after its pad id)."""
        n = self.config.get("max_position_embeddings")
        if not isinstance(n, int):
            return None
        if self.config.get("model_type", "").replace("-", "_") == "xlm_roberta":
            n -= int(self.config.get("pad_token_id", 1)) + 1
        return n

    @property
    def dims(self) -> int:
        return int(self.config.get("hidden_size") or 0)


def load_encoder(path: Path, dtype: mx.Dtype | None = None) -> EncoderModel:
    """mlx-embeddings' `load` of an encoder checkpoint directory, and what it computes; one-line
    `MlxPagedError` for a checkpoint it cannot serve."""
    try:
        import mlx_embeddings
    except ImportError:
        raise MlxPagedError(
            f"{path} is an encoder checkpoint: serving it needs mlx-embeddings (pip install mlx-embeddings)"
        ) from None
    config = read_json(path / "config.json") or {}
    arch = config.get("architectures") or []
    mtype = config.get("model_type")
    heads = [a for a in arch if a.endswith(("ForSequenceClassification", "ForTokenClassification"))]
    if heads and heads[0] not in CROSS_ENCODERS:
        raise MlxPagedError(
            f"{path}: mlx-embeddings has no {heads[0]} head (its cross-encoders: {', '.join(CROSS_ENCODERS)})"
        )
    if mtype == "modernbert" and arch in ([], ["ModernBertForMaskedLM"]):  # mlx-embeddings' default: the MLM head
        raise MlxPagedError(
            f"{path}: a ModernBERT masked-LM checkpoint is no embedding model (config.json's architectures)"
        )
    try:
        model, tokenizer = mlx_embeddings.load(str(path))
    except Exception as e:  # mlx-embeddings' own errors: a missing file, a weight that does not fit
        raise MlxPagedError(f"cannot load encoder checkpoint {path}: {str(e).strip().splitlines()[0][:200]}") from None
    if dtype is not None:
        model.set_dtype(dtype)
        mx.eval(model.parameters())
    dt = dtype or tree_flatten(model.parameters())[0][1].dtype
    pad = config.get("pad_token_id")
    if not isinstance(pad, int):
        pad = getattr(tokenizer, "pad_token_id", None) or 0
    if heads and heads[0] in CROSS_ENCODERS:
        if model.num_labels != 1:
            raise MlxPagedError(f"{path}: a cross-encoder scores with one label; this one has {model.num_labels}")
        return EncoderModel(model, tokenizer, config, path, dt, "score", pad_id=pad)
    mode, normalize = sentence_pooling(path) or (None, None)
    mode = {"mean_tokens": "mean", "cls_token": "cls"}.get(mode, mode)
    if mtype == "modernbert":  # it pools inside, by its config's classifier_pooling
        inside = config.get("classifier_pooling", "mean")
        if mode is not None and mode != inside:
            raise MlxPagedError(
                f"{path}: its sentence-transformers files pool by '{mode}', its config.json by '{inside}'"
            )
        mode = inside
    mode = mode or "mean"  # mlx-embeddings' text_embeds: mean pooled, normalised
    if mode not in ("mean", "cls"):
        raise MlxPagedError(f"{path}: it pools by '{mode}'; encoder embeddings here pool by mean or cls")
    return EncoderModel(
        model, tokenizer, config, path, dt, "embed", mode, True if normalize is None else normalize, pad_id=pad
    )
