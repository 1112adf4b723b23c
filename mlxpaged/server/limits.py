"""What one request may ask of the server, checked before any expensive work (all flags of `serve`).

A request that could never be served gets a 400 naming the limit, never a retryable 503: a client
that honours `Retry-After` would otherwise retry it forever.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import APIError

OPENAI_MAX_STOPS = 4
MAX_STOPS_CAP = 64  # --max-stop-strings may not go above this


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 << 20  # --max-body-bytes
    max_stop_strings: int = OPENAI_MAX_STOPS  # --max-stop-strings
    max_request_tokens: int = 1 << 20  # --max-request-tokens: prompts x n x max_tokens
    # --max-answer-bytes: an answer's estimated size (`answer_bytes`). 16 MiB holds an lm-eval
    # scoring batch of 32 prompts of 2,048 tokens with their logprobs (~4 MB) and 1,024 tokens with
    # 20 top logprobs each (~0.5 MB) many times over; a whole answer is built in memory, several
    # times its size in Python objects, so one request may not ask for hundreds of MB of them.
    max_answer_bytes: int = 16 << 20
    # --responses-store-bytes: the memory of the stored Responses conversations' text, all together
    responses_store_bytes: int = 256 << 20
    stream_stall_timeout: float | None = 60.0  # --stream-stall-timeout
    enable_docs: bool = False  # --enable-docs
    # --content-special-tokens: a special token's text in client content is that token (a trusted
    # client writing raw control tokens); off, it is text and no client can forge a turn
    content_special_tokens: bool = False
    # a vision model's images (admission.py): per request (--max-images), each image's bytes
    # (--max-image-bytes: a data URL's decoded bytes, a fetched image's body) and pixels
    # (--max-image-pixels, read from the image's header before it is decoded)
    max_images: int = 16
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 50_000_000
    # --fetch-image-urls: an http(s) image URL is fetched (image_fetch.py), each within
    # max_image_bytes and this many seconds; off, such a URL is a 400 (a server fetches no address
    # a client names unless told to)
    fetch_image_urls: bool = False
    image_fetch_timeout: float = 10.0  # --image-fetch-timeout


@dataclass(frozen=True)
class Capacity:
    """The model's and the pool's sizes, fixed at start."""

    context: int | None  # the model's positions
    vocab_size: int
    max_blocks: int  # the pool's maximum (a growable pool's cap): what the engine admits against
    block_size: int
    max_token_chars: int | None  # the longest token's text: a prompt of more than context x this cannot fit

    @property
    def max_prompt_tokens(self) -> int:
        pool = self.max_blocks * self.block_size
        return min(self.context, pool) if self.context else pool


def max_token_chars(tokenizer) -> int | None:
    """Characters in the vocabulary's longest entry (byte-level BPE keys have one character per byte)."""
    try:
        return max(map(len, tokenizer.get_vocab()), default=None)
    except (AttributeError, TypeError):
        return None


def check_chars(cap: Capacity, num_chars: int, param: str) -> None:
    """Refuse a text that cannot tokenize to few enough tokens, before spending time tokenizing it."""
    if cap.max_token_chars and num_chars > cap.max_prompt_tokens * cap.max_token_chars:
        raise APIError(
            400,
            f"{param} has {num_chars} characters, more than the {cap.max_prompt_tokens} tokens this "
            f"server takes could hold ({cap.max_token_chars} characters a token at most)",
            param=param,
            code="context_length_exceeded",
        )


def check_request(
    limits: Limits,
    cap: Capacity,
    *,
    stops: list[str],
    stop_token_ids: list[int],
    num_prompts: int,
    n: int,
    max_tokens: int,
    max_queue: int,
) -> None:
    """The checks that need no tokenizing: counts, ids and the total work asked for."""
    if len(stops) > limits.max_stop_strings:
        raise APIError(
            400,
            f"stop has {len(stops)} strings; this server takes at most {limits.max_stop_strings} (--max-stop-strings)",
            param="stop",
        )
    bad = [t for t in stop_token_ids if not 0 <= t < cap.vocab_size]
    if bad:
        raise APIError(
            400, f"stop_token_ids: {bad[0]} is outside the vocabulary (0..{cap.vocab_size - 1})", param="stop_token_ids"
        )
    if num_prompts > max_queue:
        raise APIError(
            400,
            f"{num_prompts} prompts in one request can never be admitted: at most {max_queue} "
            f"requests may wait (--max-queue)",
            param="prompt",
        )
    work = num_prompts * n * max_tokens
    if work > limits.max_request_tokens:
        raise APIError(
            400,
            f"the request asks for up to {work} generated tokens (prompts x n x max_tokens = "
            f"{num_prompts} x {n} x {max_tokens}); this server takes at most "
            f"{limits.max_request_tokens} (--max-request-tokens)",
            param="max_tokens",
        )


# The estimate of an answer's JSON, per token: its text (a typical token is 4 characters, quoted
# and separated) and, with logprobs, one entry for the token and one per alternative: ~20-30
# bytes in completions' legacy shape, ~60-80 in chat's (each entry with its `bytes`; measured on
# one-character tokens: 18 and 64). An estimate, not a bound: it must not refuse an answer that
# fits, and it catches the ones many times past the cap.
TOKEN_BYTES = 6
LOGPROB_BYTES = 30
CHAT_LOGPROB_BYTES = 64


def answer_bytes(
    prompt_tokens: list[int],
    n: int,
    max_tokens: int,
    logprobs: int | None,
    echo_chars: list[int] | None = None,
    entry_bytes: int = LOGPROB_BYTES,
) -> int:
    """The estimated size of an answer: each prompt's `n` choices of `max_tokens` tokens, with
    `logprobs` alternatives a token (None: no logprobs). `echo_chars`: each prompt's characters
    when every choice repeats its prompt first (completions' `echo`, with the prompt tokens'
    logprobs when asked: their texts once more, in the answer's list of tokens). `entry_bytes`: one
    logprob entry's, in the route's shape."""
    per_logprob = 0 if logprobs is None else entry_bytes * (logprobs + 1)
    total = 0
    for i, num in enumerate(prompt_tokens):
        choice = max_tokens * (TOKEN_BYTES + per_logprob)
        if echo_chars is not None:
            chars = echo_chars[i]
            choice += chars + (chars + num * per_logprob if logprobs is not None else 0)
        total += n * choice
    return total


def check_answer(
    limits: Limits,
    prompt_tokens: list[int],
    n: int,
    max_tokens: int,
    logprobs: int | None,
    echo_chars=None,
    entry_bytes: int = LOGPROB_BYTES,
) -> None:
    """Refuse, before any generating, a request whose answer is estimated past `--max-answer-bytes`
    (a whole answer is built in memory, and even a stream's logprobs are kept for its usage)."""
    est = answer_bytes(prompt_tokens, n, max_tokens, logprobs, echo_chars, entry_bytes)
    if est > limits.max_answer_bytes:
        what = f"{len(prompt_tokens)} prompt{'s' if len(prompt_tokens) > 1 else ''} x n={n} x max_tokens={max_tokens}"
        what += " plus the echoed prompt" if echo_chars is not None else ""
        what += f", with logprobs={logprobs}" if logprobs is not None else ""
        raise APIError(
            400,
            f"the answer would be about {est} bytes ({what}); this server answers at most "
            f"{limits.max_answer_bytes} (--max-answer-bytes): ask for fewer prompts, a smaller n, "
            f"max_tokens or logprobs",
            param="max_tokens",
        )


def default_max_tokens(cap: Capacity, default: int, num_prompt: int, n: int) -> int:
    """`default`, lowered to what the model's context and the KV pool can hold for this prompt and n
    (at least 1: a prompt that cannot fit at all is refused by the engine, naming the pool)."""
    from ..engine.sizing import fitting_max_tokens  # here: `serve --help` imports this module

    limit = min(default, cap.context - num_prompt if cap.context else default)
    return fitting_max_tokens(num_prompt, n, limit, cap.block_size, cap.max_blocks)
