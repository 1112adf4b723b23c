"""Chat messages to prompt token ids: one rule for `generate`, the server and the benchmarks."""

from __future__ import annotations


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The ids of `messages` through the checkpoint's chat template, ready for the assistant's turn.

    The template writes the special tokens itself, so none are added when encoding its text.
    """
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
