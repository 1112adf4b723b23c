"""The pieces of OpenAI's JSON: logprobs, usage, the envelope and the stream's `data:` lines.

The events these render come from `turns.job_events`; stop strings are held back in the engine
(`engine/stopping.py`), so nothing here has to take streamed text back.
"""

from __future__ import annotations

import json
import time
from functools import lru_cache


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


def usage(outputs: list, reasoning_tokens: int = 0) -> dict:
    """Prompt tokens count once per prompt (its n samples share one prefill)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


def sse_data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def envelope(resp_id: str, kind: str, model: str, created: int | None = None, **rest) -> dict:
    return {"id": resp_id, "object": kind, "created": created or int(time.time()), "model": model, **rest}
