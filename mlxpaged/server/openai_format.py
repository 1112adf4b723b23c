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


def echo_logprobs(ids: list[int], plps: list | None, text_of: TokenText, completion: dict) -> dict:
    """The prompt's tokens before the completion's in the legacy shape (`echo`), as OpenAI's legacy
    API and vLLM give them: the first token's logprob and top are None."""
    plps = plps or [None] * len(ids)
    tokens = [text_of(t) for t in ids]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": tokens + completion["tokens"],
        "token_logprobs": [None if e is None else float(e.logprob) for e in plps] + completion["token_logprobs"],
        "top_logprobs": [None if e is None else {text_of(i): float(lp) for i, lp in e.top_logprobs} for e in plps]
        + completion["top_logprobs"],
        "text_offset": offsets + [pos + o for o in completion["text_offset"]],
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


def usage(outputs: list, reasoning_tokens: int = 0, generated: bool = True) -> dict:
    """Prompt tokens count once per prompt (its n samples share one prefill); `generated=False`:
    the answer leaves the sampled tokens out (`max_tokens: 0`), so they count none."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs) if generated else 0
    cached = sum(o.num_cached_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


def encode_answer(head: dict, choices, tail: dict) -> bytes:
    """`{**head, "choices": [*choices], **tail}` as JSON (compact, as Starlette's JSONResponse writes
    it), each choice encoded as soon as it is built and then dropped: a large answer (echo and
    logprobs of many prompts) never exists whole as Python objects, several times its size, and
    the GIL is let go between two choices."""
    dumps = lambda v: json.dumps(v, ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # noqa: E731
    parts = [dumps(head)[:-1] + ',"choices":[']
    for i, c in enumerate(choices):
        parts.append(("," if i else "") + dumps(c))
    parts.append("]" + "".join(f",{dumps(k)}:{dumps(v)}" for k, v in tail.items()) + "}")
    return "".join(parts).encode("utf-8")


def sse_data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def envelope(resp_id: str, kind: str, model: str, created: int | None = None, **rest) -> dict:
    return {"id": resp_id, "object": kind, "created": created or int(time.time()), "model": model, **rest}
