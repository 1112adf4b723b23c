"""The pieces of OpenAI's JSON: logprobs, usage, the envelope and the stream's `data:` lines.

The events these render come from `turns.job_events`; stop strings are held back in the engine
(`engine/stopping.py`), so nothing here has to take streamed text back.
"""

from __future__ import annotations

import json
import time
from functools import lru_cache


class TokenText:
    """Token id -> its text, and its own bytes, cached (logprobs name each token)."""

    def __init__(self, tokenizer):
        self._decode = lru_cache(maxsize=65536)(lambda t: tokenizer.decode([t]))
        self._bytes = lru_cache(maxsize=65536)(token_bytes(tokenizer, self._decode))

    def __call__(self, token_id: int) -> str:
        return self._decode(int(token_id))

    def bytes_of(self, token_id: int) -> list[int]:
        return list(self._bytes(int(token_id)))


def token_bytes(tokenizer, decode):
    """Token id -> the bytes the token stands for, as OpenAI's logprobs give them: a token that is
    part of a multi-byte character has those bytes, not the UTF-8 of U+FFFD that its decoded text
    is, so a client joins consecutive tokens' bytes into the character. The vocabulary says how:
    a byte-level BPE token (GPT-2, Qwen, Llama 3) spells its bytes in GPT-2's byte alphabet; a
    SentencePiece byte token is `<0xE4>` and `▁` is a space; added (special) tokens are their own
    text. `decode` (id -> text) covers tokenizers without such a vocabulary, and ids past it."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

    detokenizer = getattr(tokenizer, "detokenizer", None)  # mlx-lm's reading of tokenizer.json's decoder
    spm = isinstance(detokenizer, SPMStreamingDetokenizer)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    if isinstance(detokenizer, BPEStreamingDetokenizer):
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        alphabet = {c: b for b, c in bytes_to_unicode().items()}
    elif not spm:
        return lambda t: decode(t).encode("utf-8")

    def of(token_id: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token_id) if token_id < len(tokenizer) else None
        if piece is None or token_id in added:
            return decode(token_id).encode("utf-8")
        if spm:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        if all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return decode(token_id).encode("utf-8")

    return of


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
        return {"token": text_of(tid), "logprob": float(lp), "bytes": text_of.bytes_of(tid)}

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
