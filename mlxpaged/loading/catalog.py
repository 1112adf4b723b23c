"""What a checkpoint on disk is, from its files alone: kind, family, quantization, size, context.

`describe(path)` reads a checkpoint directory's `config.json` (and, for one converted from a GGUF,
`mlxpaged_conversion.json`) without loading any weights, so `mlxpaged ls` stays fast and the
server's model listings (`/api/tags`, `/api/show`) say the same things `ls` does.

Kind: "vision" when the config has a vision tower (`vision_config`, as every Hugging Face
vision-language config does), "embeddings" when its architecture or model type names an
embedding or sentence model (`BertModel`, `*EmbeddingModel`, `XLMRobertaModel`...), else "text".
Quantization: MLX's `quantization` block (`Q4` with its group size), the block types of a GGUF
conversion that kept them (`Q5_0+Q8_0...`, the source's), or the stored float dtype (`F16`,
`BF16`, `F32`; a dequantized GGUF conversion's too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Architectures (or model types) that encode text into vectors rather than generate it.
EMBEDDING_HINTS = ("embedding", "bertmodel", "robertamodel", "nomic_bert")
DTYPE_LEVELS = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


@dataclass(frozen=True)
class CheckpointInfo:
    """What `describe` found; every field is read from the files (None: they do not say)."""

    kind: str  # "text", "vision" or "embeddings"
    family: str | None  # config.json's model_type (qwen2, llama...)
    quantization: str | None  # Q4 (group 64), Q5_0+Q8_0 (GGUF), F16...
    context: int | None  # max_position_embeddings
    size_bytes: int  # every file under the directory, links followed
    source: str  # "safetensors" or "gguf" (converted here from a GGUF file)


def read_config(path: Path) -> dict:
    """config.json of a checkpoint directory ({} when missing or unreadable)."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def kind_of(config: dict) -> str:
    if "vision_config" in config or "vision_tower" in config:
        return "vision"
    names = [str(a).lower() for a in config.get("architectures") or []] + [str(config.get("model_type", "")).lower()]
    if any(h in n for n in names for h in EMBEDDING_HINTS) and not any(n.endswith("forcausallm") for n in names):
        return "embeddings"
    return "text"


def quantization_of(config: dict, conversion: dict | None = None) -> str | None:
    q = config.get("quantization") or config.get("quantization_config")
    if isinstance(q, dict) and q.get("bits"):
        group = q.get("group_size")
        return f"Q{q['bits']}" + (f" (group {group})" if group else "")
    if conversion and conversion.get("weights") == "quantized":  # GGUF blocks kept: their types, most used first
        types = conversion.get("tensor_types") or {}
        quant = sorted((t for t in types if not t.startswith(("F", "BF"))), key=lambda t: -types[t])
        if quant:
            return "+".join(quant)
    # a float checkpoint, a GGUF's dequantized conversion among them
    dtype = (conversion or {}).get("dtype") or config.get("torch_dtype") or config.get("dtype")
    return DTYPE_LEVELS.get(str(dtype)) if dtype else None


def dir_size(path: Path) -> int:
    """Bytes of the files under `path`; a Hugging Face snapshot's files are links into its blobs."""
    total = 0
    for f in Path(path).rglob("*"):
        try:
            if f.is_file():
                total += f.stat().st_size
        except OSError:  # a dangling link (a blob removed by hand): counts nothing
            pass
    return total


def describe(path: Path) -> CheckpointInfo:
    path = Path(path)
    config = read_config(path)
    try:
        conversion = json.loads((path / "mlxpaged_conversion.json").read_text())
    except (OSError, ValueError):
        conversion = None
    context = config.get("max_position_embeddings")
    return CheckpointInfo(
        kind=kind_of(config),
        family=config.get("model_type"),
        quantization=quantization_of(config, conversion if isinstance(conversion, dict) else None),
        context=context if isinstance(context, int) else None,
        size_bytes=dir_size(path),
        source="gguf" if conversion else "safetensors",
    )
