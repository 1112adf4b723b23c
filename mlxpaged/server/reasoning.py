"""A thinking model's reasoning, kept apart from its answer.

The markers are the ones mlx-lm finds for the checkpoint (`TokenizerWrapper.has_thinking`,
`think_start`, `think_end`: `<think>`/`</think>` for Qwen3 and DeepSeek-R1 style models). Text
between them is reasoning, returned as `reasoning_content` in chat, `thinking` blocks in Messages
and a reasoning item in Responses, and never as the answer. A template whose generation prompt
opens the block itself (Qwen3 with thinking on) starts the answer inside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tools import partial_prefix


@dataclass(frozen=True)
class ThinkMarkers:
    start: str
    end: str

    @classmethod
    def of(cls, tokenizer) -> ThinkMarkers | None:
        if not getattr(tokenizer, "has_thinking", False):
            return None
        return cls(tokenizer.think_start, tokenizer.think_end)


def opens_thinking(tokenizer, prompt: list[int]) -> bool:
    """Whether the prompt ends inside a think block (by token ids: no decoding)."""
    start = tokenizer.rfind_think_start(prompt)
    return start >= 0 and start > tokenizer.rfind_think_end(prompt)


class ReasoningSplit:
    """Text deltas in, `(is_reasoning, text)` pieces out. Holds back a tail that may grow into the
    next marker; the markers themselves are dropped. Invariant: the pieces of any split of a text
    equal those of the whole text, joined by kind."""

    def __init__(self, markers: ThinkMarkers, thinking: bool = False):
        self.markers, self.thinking, self.buf = markers, thinking, ""

    def feed(self, delta: str) -> list[tuple[bool, str]]:
        self.buf += delta
        out: list[tuple[bool, str]] = []
        while True:
            marker = self.markers.end if self.thinking else self.markers.start
            i = self.buf.find(marker)
            if i >= 0:
                if i:
                    out.append((self.thinking, self.buf[:i]))
                self.buf, self.thinking = self.buf[i + len(marker) :], not self.thinking
                continue
            keep = partial_prefix(self.buf, marker)
            if len(self.buf) > keep:
                out.append((self.thinking, self.buf[: len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep :]
            return out

    def finish(self) -> list[tuple[bool, str]]:
        out, self.buf = ([(self.thinking, self.buf)] if self.buf else []), ""
        return out


def thinking_of(state, prompt: list[int]) -> ReasoningSplit | None:
    """The splitter of one sample of `prompt`, or None for a model that does not think."""
    if state.think is None:
        return None
    return ReasoningSplit(state.think, opens_thinking(state.engine_loop.engine.tokenizer, prompt))


def split_reasoning(split: ReasoningSplit | None, text: str, final: bool = True) -> tuple[str, str]:
    """(reasoning, answer) of a delta (`final`: the sample's last), or of a whole completion."""
    if split is None:
        return "", text
    pieces = split.feed(text) + (split.finish() if final else [])
    return "".join(t for r, t in pieces if r), "".join(t for r, t in pieces if not r)


def reasoning_tokens(state, prompt: list[int], output: list[int]) -> int:
    """Output tokens inside the think block, its markers excluded (`reasoning_tokens` in usage):
    found by token ids, so counting decodes nothing."""
    if state.think is None or not output:
        return 0
    tok = state.engine_loop.engine.tokenizer
    if opens_thinking(tok, prompt):
        start = 0
    else:
        if not getattr(tok, "think_start_tokens", None):  # mlx-lm found no start marker to look for
            return 0
        i = tok.find_think_start(output)
        if i < 0:
            return 0
        start = i + len(tok.think_start_tokens)
    if not getattr(tok, "think_end_tokens", None):
        return len(output) - start
    j = tok.find_think_end(output, start)
    return (j if j >= 0 else len(output)) - start
