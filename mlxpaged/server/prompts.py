"""Request bodies to prompt token ids, the way `mlxpaged generate` encodes them.

A completion prompt is encoded as `generate --no-chat` does (`tokenizer.encode(text)`); chat
messages go through the checkpoint's chat template and are then encoded without special tokens,
as `generate --chat` does for a single user message.
"""

from __future__ import annotations

from ..engine.chat import chat_ids
from ..errors import MlxPagedError
from .errors import APIError
from .tools import render_chat


def encode_prompt(tokenizer, prompt: str | list[int], vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        return tokenizer.encode(prompt)
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", param="prompt")
    return list(prompt)


def encode_messages(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """`tools` (OpenAI function definitions) go to the template too, which renders them its own way."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
    try:
        ids = render_chat(tokenizer, messages, tools) if tools else chat_ids(tokenizer, messages)
    except Exception as e:  # a template's own raise_exception(), e.g. roles out of order
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    if not ids:
        raise MlxPagedError("empty prompt")
    return ids


def check_context(num_prompt: int, max_tokens: int, context: int | None) -> None:
    """A prompt plus its completion must fit the model's positions (e.g. 32,768 for Qwen2.5)."""
    if context and num_prompt >= context:
        raise APIError(
            400,
            f"prompt has {num_prompt} tokens but the model's context is {context} tokens",
            param="prompt",
            code="context_length_exceeded",
        )
    if context and num_prompt + max_tokens > context:
        raise APIError(
            400,
            f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
            f"context of {context} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
