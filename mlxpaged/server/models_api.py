"""The models a server serves, described once, and OpenAI's `GET /v1/models` and `GET /v1/models/{id}`.

`ModelCard` is what every listing says about one served model (OpenAI's model object, Ollama's
`/api/tags`, `/api/show` and `/api/ps`): its name and aliases, context length, parameter count,
weights' bytes in memory, and what `loading.catalog.describe` reads from its checkpoint's files.
`Catalog.cards` is the one place the routes ask which models there are; today it holds the one
loaded model, and a registry of several models would take its place behind the same methods.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from fastapi import APIRouter

from ..loading.catalog import CheckpointInfo, describe
from .errors import APIError


@dataclass(frozen=True)
class ModelCard:
    """One served model. Invariant: `id` is in `names` (the names a request may use for it)."""

    id: str
    names: frozenset[str]
    created: int  # when the server started serving it (Unix seconds)
    context: int | None
    parameters: int  # weights' values (a quantized weight counts its unpacked values)
    memory_bytes: int  # the weights' bytes in memory
    digest: str  # sha256 hex naming the weights and dtype (the prefix cache's identity)
    modified: datetime  # the checkpoint's config.json's mtime
    dtype: str  # float32, float16, bfloat16
    quantization: str  # Q4 (group 64) or the float dtype, as loaded
    info: CheckpointInfo
    chat_template: str | None
    task: str = "generate"  # what it serves: "generate", "embed" (an embedding model), "score" (a cross-encoder)

    def openai(self) -> dict:
        # created: the server's start; max_model_len: vLLM's name for the context length (Codex reads it)
        return {"id": self.id, "object": "model", "created": self.created, "owned_by": "mlxpaged"} | {
            "max_model_len": self.context,
            "task": self.task,
        }


def parameter_count(model) -> int:
    """Values in the model's weights: a quantized layer's packed `weight` counts 32/bits values per
    uint32, and its scales and biases count none (they are not the model's parameters)."""
    import mlx.core as mx

    n = 0
    for _, m in model.named_modules():
        bits = getattr(m, "bits", None)
        for k, v in m.items():
            if not isinstance(v, mx.array):
                continue
            if bits and k == "weight":
                n += v.size * 32 // bits
            elif not (bits and k in ("scales", "biases")):
                n += v.size
    return n


def memory_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def card_of(
    loaded, model_id: str, names: frozenset[str], context: int | None, created: int, task: str = "generate"
) -> ModelCard:
    """The card of a `LoadedModel` (or an encoder's `EncoderModel`) served as `model_id`."""
    path = Path(loaded.path)
    try:
        modified = datetime.fromtimestamp((path / "config.json").stat().st_mtime, tz=timezone.utc)
    except OSError:
        modified = datetime.fromtimestamp(created, tz=timezone.utc)
    info = describe(path)
    dtype = str(loaded.dtype).rsplit(".", 1)[-1]
    quant = (
        info.quantization if loaded.weights == "quantized" else {"float16": "F16", "bfloat16": "BF16"}.get(dtype, "F32")
    )
    return ModelCard(
        id=model_id,
        names=frozenset({model_id, *names}),
        created=created,
        context=context,
        parameters=parameter_count(loaded.model),
        memory_bytes=memory_bytes(loaded.model),
        digest=loaded.identity.hex(),
        modified=modified,
        dtype=dtype,
        quantization=quant or dtype,
        info=info,
        chat_template=getattr(loaded.tokenizer, "chat_template", None),
        task=task,
    )


class Catalog:
    """The served models. Invariant: every name resolves to at most one card."""

    def __init__(self, cards: list[ModelCard]):
        self._cards = list(cards)

    def cards(self) -> list[ModelCard]:
        return list(self._cards)

    def find(self, name: str) -> ModelCard | None:
        return next((c for c in self._cards if name in c.names), None)


def served_catalog(state, created: int | None = None) -> Catalog:
    """The catalog of the one model a server loaded."""
    engine, spec = state.engine_loop.engine, state.pooling
    task = "generate" if spec is None or not spec.embedding_only else "score" if spec.scores == "head" else "embed"
    card = card_of(engine.loaded, state.model_id, state.model_aliases, state.context, created or int(time.time()), task)
    return Catalog([card])


def register_models(router: APIRouter, catalog: Catalog) -> None:
    @router.get("/models")
    async def models():
        return {"object": "list", "data": [c.openai() for c in catalog.cards()]}

    @router.get("/models/{model_id:path}")
    async def model(model_id: str):
        card = catalog.find(model_id)
        if card is None:
            names = ", ".join(f"'{c.id}'" for c in catalog.cards())
            raise APIError(
                404, f"unknown model '{model_id}': this server serves {names}", param="model", code="model_not_found"
            )
        return card.openai()
