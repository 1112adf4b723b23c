"""Engine outputs to OpenAI JSON: whole responses, stream deltas, logprobs and usage.

The engine reports each sample's full text so far; `ChoiceStream` turns that into deltas.
While a sample runs, it holds back a tail of the text that could still grow into a stop string
(the engine cuts the stop string off once it is complete), so streamed text never has to be
taken back: the concatenated deltas equal the final text.
"""

from __future__ import annotations

import time
from functools import lru_cache


def hold_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class ChoiceStream:
    """The part of one sample already sent to the client."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.sent_text = 0
        self.sent_tokens = 0
        self.started = False

    def advance(self, c) -> tuple[str, list | None, str | None] | None:
        """(text delta, new TokenLogprobs or None, finish_reason) to send, or None if nothing new."""
        end = len(c.text) if c.finish_reason else len(c.text) - hold_back(c.text, self.stops)
        delta = c.text[self.sent_text:end] if end > self.sent_text else ""
        lps = getattr(c, "logprobs", None)
        new_lps = lps[self.sent_tokens:] if lps is not None else None
        if not delta and not new_lps and not c.finish_reason:
            return None
        self.sent_text = max(self.sent_text, end)
        self.sent_tokens = len(c.token_ids)
        return delta, new_lps, c.finish_reason


class TokenText:
    """Token id -> its text, cached (logprobs name each token)."""

    def __init__(self, tokenizer):
        self._decode = lru_cache(maxsize=65536)(lambda t: tokenizer.decode([t]))

    def __call__(self, token_id: int) -> str:
        return self._decode(int(token_id))


def completion_logprobs(lps: list, text_of: TokenText, offset: int = 0) -> dict:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [text_of(t.token_id) for t in lps]
    offsets, pos = [], offset
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [float(t.logprob) for t in lps],
        "top_logprobs": [{text_of(i): float(lp) for i, lp in t.top_logprobs} for t in lps],
        "text_offset": offsets,
    }


def chat_logprobs(lps: list, text_of: TokenText) -> dict:
    def entry(tid, lp):
        s = text_of(tid)
        return {"token": s, "logprob": float(lp), "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top_logprobs]}
                        for t in lps]}


def usage(outputs: list) -> dict:
    """Prompt tokens count once per prompt (its n samples share one prefill)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def envelope(resp_id: str, kind: str, model: str, created: int | None = None, **rest) -> dict:
    return {"id": resp_id, "object": kind, "created": created or int(time.time()), "model": model, **rest}
