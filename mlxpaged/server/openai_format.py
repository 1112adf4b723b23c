"""Engine outputs to OpenAI JSON: whole responses, stream deltas, logprobs and usage.

The engine reports each sample's full text so far; `ChoiceStream` turns that into deltas.
While a sample runs, it holds back a tail of the text that could still grow into a stop string
(the engine cuts the stop string off once it is complete), so streamed text never has to be
taken back: the concatenated deltas equal the final text.
"""

from __future__ import annotations

import time
from functools import lru_cache


def _borders(s: str) -> list[int]:
    """KMP's failure function: `b[i]` is the longest proper prefix of `s[:i + 1]` that is also its suffix."""
    b, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = b[k - 1]
        if s[i] == s[k]:
            k += 1
        b[i] = k
    return b


class StopMatcher:
    """For each stop string, the longest prefix of it that the text fed so far ends with.

    Fed incrementally (a KMP automaton per stop), so a stream of T characters costs O(T) per
    stop in all, not O(len(stop)^2) slicing per step."""

    def __init__(self, stops: list[str], borders: list[list[int]] | None = None):
        self.stops = stops
        self.borders = borders if borders is not None else [_borders(s) for s in stops]  # shareable: read-only
        self.state = [0] * len(stops)

    def feed(self, text: str) -> None:
        for j, (s, b) in enumerate(zip(self.stops, self.borders)):
            q, m = self.state[j], len(s)
            for ch in text:
                if q == m:
                    q = b[m - 1]
                while q and s[q] != ch:
                    q = b[q - 1]
                if s[q] == ch:
                    q += 1
            self.state[j] = q

    def hold_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        return max((q if q < len(s) else b[q - 1] for s, b, q in zip(self.stops, self.borders, self.state)), default=0)


def stop_borders(stops: list[str]) -> list[list[int]]:
    return [_borders(s) for s in stops]


def hold_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    m = StopMatcher(stops)
    m.feed(text[-max((len(s) for s in stops), default=0) :] if stops else "")
    return m.hold_back()


class ChoiceStream:
    """The part of one sample already sent to the client."""

    def __init__(self, stops: list[str], borders: list[list[int]] | None = None):
        """`borders`: the stops' KMP tables, computed once for all the samples of a request."""
        self.matcher = StopMatcher(stops, borders) if stops else None
        self.seen = ""  # the text the matcher has been fed
        self.sent_text = 0
        self.sent_tokens = 0
        self.started = False

    def _hold_back(self, text: str) -> int:
        if self.matcher is None:
            return 0
        if not text.startswith(self.seen):  # the text changed behind us (not seen so far): start over
            self.matcher = StopMatcher(self.matcher.stops, self.matcher.borders)
            self.seen = ""
        self.matcher.feed(text[len(self.seen) :])
        self.seen = text
        return self.matcher.hold_back()

    def advance(self, c) -> tuple[str, list | None, str | None] | None:
        """(text delta, new TokenLogprobs or None, finish_reason) to send, or None if nothing new."""
        end = len(c.text) if c.finish_reason else len(c.text) - self._hold_back(c.text)
        delta = c.text[self.sent_text : end] if end > self.sent_text else ""
        lps = getattr(c, "logprobs", None)
        new_lps = lps[self.sent_tokens :] if lps is not None else None
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

    return {
        "content": [
            {**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top_logprobs]} for t in lps
        ]
    }


def usage(outputs: list) -> dict:
    """Prompt tokens count once per prompt (its n samples share one prefill)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def envelope(resp_id: str, kind: str, model: str, created: int | None = None, **rest) -> dict:
    return {"id": resp_id, "object": kind, "created": created or int(time.time()), "model": model, **rest}
