"""Request bodies to prompt token ids, the way `mlxpaged generate` encodes them.

A completion prompt is encoded as `generate --no-chat` does (`tokenizer.encode(text)`); chat
messages go through the checkpoint's chat template and are then encoded without special tokens,
as `generate --chat` does for a single user message.

Client text is text: a special token's text inside a message, a tool call or a tool definition
(`"<|im_start|>system"` in a tool result) is tokenized as the characters it is, never as the
control token, so no client can forge a turn. Only the template's own markers are special.
"""

from __future__ import annotations

import re
import uuid

from ..engine.chat import chat_ids
from ..errors import MlxPagedError
from .errors import APIError
from .tools import render_chat

TEMPLATE_KEYS = frozenset({"role", "type"})  # strings the template reads as structure, not client text


def encode_prompt(
    tokenizer, prompt: str | list[int] | tuple[str, str], vocab_size: int, special_tokens: bool = True
) -> list[int]:
    """A prompt's ids; a (text, text) pair is a cross-encoder's input, tokenized as the pair it is."""
    if isinstance(prompt, tuple):
        if not all(prompt):
            raise APIError(400, "prompt is empty", param="prompt")
        return tokenizer.encode(*prompt)
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        return tokenizer.encode(prompt) if special_tokens else tokenizer.encode(prompt, add_special_tokens=False)
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", param="prompt")
    return list(prompt)


def encode_messages(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
    specials_as_text: bool = True,
) -> list[int]:
    """`tools` (OpenAI function definitions) go to the template too, which renders them its own way.
    `template_kwargs` (`enable_thinking`) go to the template; one that does not read them ignores them.
    `specials_as_text=False` (`--content-special-tokens`) encodes a special token's text in client
    content as that token, as the template's own text is."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
    try:
        return _encode(tokenizer, messages, tools, template_kwargs, specials_as_text)
    except APIError:
        folded = fold_systems(messages)
        if folded is None:
            raise
        # a template that takes one system turn, first
        return _encode(tokenizer, folded, tools, template_kwargs, specials_as_text)


def fold_systems(messages: list[dict]) -> list[dict] | None:
    """The system messages after the first message folded into one leading system turn, in order;
    None when there are none (Claude Code sends system messages mid-conversation)."""
    late = [m for m in messages[1:] if m.get("role") == "system"]
    if not late:
        return None
    first = [messages[0]] if messages[0].get("role") == "system" else []
    text = "\n\n".join(m.get("content") or "" for m in first + late)
    rest = [m for m in messages[len(first) :] if m.get("role") != "system"]
    return [{"role": "system", "content": text}, *rest]


def _encode(
    tokenizer, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None, specials_as_text: bool
) -> list[int]:
    specials = _special_texts(tokenizer) if specials_as_text else ()
    held: list[str] = []
    tag = f"\ue000{uuid.uuid4().hex}"  # private-use characters: the template copies them through
    if specials:
        messages, tools = _hold(messages, specials, held, tag), _hold(tools, specials, held, tag)
    extra = template_kwargs or {}  # mlx-lm renames enable_thinking to the template's own switch
    try:
        if not held and not extra:  # the usual case: as `generate --chat` encodes it
            ids = render_chat(tokenizer, messages, tools) if tools else chat_ids(tokenizer, messages)
        else:
            kw = {"tools": tools, **extra} if tools else extra
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
            ids = _encode_held(tokenizer, text, held, tag)  # nothing held: the template's text as it is
    except Exception as e:  # a template's own raise_exception(), e.g. roles out of order
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    if not ids:
        raise MlxPagedError("empty prompt")
    return ids


def thinking_kwargs(state, on: bool | None) -> dict:
    """The template keyword that switches a reasoning model's thinking (Qwen3's `enable_thinking`);
    nothing for a model that does not reason (it answers without thinking) or for the default."""
    return {"enable_thinking": on} if state.think is not None and on is not None else {}


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


def _special_texts(tokenizer) -> tuple[str, ...]:
    """The text of every added token (special or not: Qwen's `<tool_call>` is an added token)."""
    added = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "added_tokens_decoder", None) or {}
    return tuple(t.content if hasattr(t, "content") else str(t) for t in added.values())


def _hold(value, specials: tuple[str, ...], held: list[str], tag: str):
    """`value` with each special token's text in a client string replaced by a placeholder (`held`
    keeps the texts). A placeholder has no character JSON escapes, so it survives a template's
    `tojson` too. A new value; the original is untouched."""
    if isinstance(value, str):
        if not any(sp in value for sp in specials):
            return value
        pattern = "|".join(re.escape(sp) for sp in sorted(specials, key=len, reverse=True))

        def placeholder(m: re.Match) -> str:
            held.append(m.group(0))
            return f"{tag}:{len(held) - 1}\ue001"

        return re.sub(pattern, placeholder, value)
    if isinstance(value, dict):
        return {k: v if k in TEMPLATE_KEYS else _hold(v, specials, held, tag) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_hold(v, specials, held, tag) for v in value]
    return value


def _encode_held(tokenizer, text: str, held: list[str], tag: str) -> list[int]:
    """The template's text with its special tokens, each held client text as plain characters."""
    ids: list[int] = []
    for i, part in enumerate(re.split(f"{re.escape(tag)}:(\\d+)\ue001", text)):
        if i % 2 == 0:
            ids += tokenizer.encode(part, add_special_tokens=False) if part else []
        else:
            ids += tokenizer.encode(held[int(part)], add_special_tokens=False, split_special_tokens=True)
    return ids
