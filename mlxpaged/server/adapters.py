"""Which LoRA adapter a request runs with: `model: "BASE:NAME"`, or mlx_lm.server's `adapters`
field (the name given with `serve --adapter NAME=PATH`, or that PATH; or the name of a folder in
`--adapter-dir`). The engine checked every `--adapter` at start (models/lora.py); a folder of
`--adapter-dir` is loaded and checked by the engine when a request first names it, and one that
does not fit the model is a 400 naming why (jobs.py)."""

from __future__ import annotations

from .errors import APIError


def split_model(state, model: str | None) -> tuple[str | None, str | None]:
    """(the served model a `model` value names, the adapter after its last ':' or None). A name
    that is itself an alias (an Ollama-style 'qwen:7b') is the model, whole."""
    if model is None or model in state.model_aliases:
        return model, None
    base, sep, adapter = model.rpartition(":")
    if sep and adapter and base in state.model_aliases:
        return base, adapter
    return model, None


def request_adapter(state, model: str | None, adapters: str | None) -> str | None:
    """The adapter's name (None: the base model); a 404 naming an unknown adapter, a 400 when
    `model` and `adapters` name two."""
    _, by_model = split_model(state, model)
    if by_model is not None and adapters is not None and by_model != adapters:
        raise APIError(400, f"model names adapter '{by_model}' and adapters '{adapters}': send one", param="adapters")
    name = by_model if by_model is not None else adapters
    if name is None:
        return None
    loaded = state.engine_loop.engine.adapters
    param = "model" if by_model is not None else "adapters"
    if loaded is None:
        raise APIError(
            404,
            f"unknown adapter '{name}': model '{state.model_id}' serves no adapters (serve --adapter NAME=PATH)",
            param=param,
            code="adapter_not_found",
        )
    try:
        found = loaded.find(name)  # a folder of --adapter-dir is loaded by the engine, on its thread
        return found[0] if isinstance(found, tuple) else found.name  # (name, folder): not loaded yet
    except KeyError as e:
        raise APIError(
            404, f"{e.args[0]} (as model '{state.model_id}:NAME' or adapters)", param=param, code="adapter_not_found"
        ) from None
