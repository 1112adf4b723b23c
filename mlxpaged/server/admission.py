"""The one way in to the engine, for every route (OpenAI chat and completions, Messages, Responses,
embeddings and rerank).

A route turns its body into an `Ask` (its template messages and tools, or completion prompts; its
stops, n, the max_tokens it asked for, and how to build its `SamplingParams`) and calls `admit`,
which, here and nowhere else, in this order:
1. checks the model name;
2. bounds the stops, the stop token ids, the prompts, the work asked for and the answer's estimated
   size (limits.py);
3. counts every character the template will render (system, messages, tool definitions, tool
   calls and results, and one token's worth per message for the template's own markers) and
   refuses a prompt that cannot fit the pool, before any tokenizing;
4. tokenizes on the tokenizer thread, never on the event loop;
5. picks the default max_tokens against the pool's maximum and the model's context, and clamps an
   asked max_tokens to what the context leaves (Claude Code asks 32,000 whatever the model): the
   response says so in its `x-mlxpaged-max-tokens-clamped` header;
6. checks the context, the work and the answer's size again (with the prompts' token counts now),
   builds the parameters and starts the `Job`.

Errors are `APIError`s; `Ask.names` renames OpenAI's field names in them to the route's own
(`max_output_tokens`, `stop_sequences`), and the route renders them as its own error object.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import APIError
from .jobs import Job, check_model
from .limits import LOGPROB_BYTES, TOKEN_BYTES, check_answer, check_chars, check_request, default_max_tokens
from .middleware import note
from .prompts import check_context, encode_messages, encode_prompt


@dataclass
class Ask:
    """What one request asks of the engine. Exactly one of `messages` (chat-template messages, with
    `tools` in OpenAI's function form) and `prompts` (completion prompts: text or token ids) is set."""

    prefix: str  # the engine request ids' prefix (chatcmpl, cmpl, msg, resp)
    model: str | None
    make_params: Callable[[int], object]  # max_tokens -> SamplingParams; ValueError/TypeError: a 400
    default_max_tokens: int
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    prompts: list | None = None  # texts, token ids, or a cross-encoder's (query, document) pairs
    stops: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    max_tokens: int | None = None  # as asked; None: the default, lowered to what fits
    guided_param: str | None = None  # the field a grammar the engine refuses is blamed on
    names: dict[str, str] = field(default_factory=dict)  # OpenAI field name -> this route's
    template_kwargs: dict = field(default_factory=dict)  # e.g. enable_thinking, for templates that read it
    logprobs: int | None = None  # alternatives a token the answer carries logprobs of (None: no logprobs)
    logprob_bytes: int = LOGPROB_BYTES  # one logprob entry's size in the route's shape (limits.py)
    echo: bool = False  # every choice repeats its prompt first (completions' `echo`)
    # a pooled request (embeddings, rerank scores: engine/pooling.py) generates no tokens; this is its
    # answer's size per prompt, in bytes (0: not a pooled request)
    pooled_bytes: int = 0
    # text prompts get the tokenizer's own special tokens (a BOS, an embedding model's end token);
    # False: the prompt writes its own (the reranker's prompt format)
    special_tokens: bool = True


def template_chars(messages: list[dict], tools: list[dict] | None, per_message: int) -> int:
    """Characters the template renders from these messages and tools, at least (its own markers:
    `per_message` a message, a token's worth: every template writes at least one token per message)."""
    n = len(json.dumps(tools, ensure_ascii=False)) if tools else 0
    for m in messages:
        n += per_message + len(m.get("role") or "") + len(m.get("content") or "") + len(m.get("tool_call_id") or "")
        for c in m.get("tool_calls") or ():
            fn = c.get("function") or {}
            n += len(fn.get("name") or "") + len(json.dumps(fn.get("arguments"), ensure_ascii=False))
    return n


def _check_limits(state, ask: Ask, max_tokens: int, ids: list[list[int]] | None = None) -> None:
    """The limits; `ids`: the prompts' tokens once known (before, a text prompt counts none)."""
    check_request(
        state.limits,
        state.capacity,
        stops=ask.stops,
        stop_token_ids=ask.stop_token_ids,
        num_prompts=len(ask.prompts) if ask.prompts is not None else 1,
        n=ask.n,
        max_tokens=max_tokens,
        max_queue=state.max_queue,
    )
    if ids is not None:
        counts = [len(x) for x in ids]
    else:
        counts = [0 if isinstance(p, (str, tuple)) else len(p) for p in ask.prompts] if ask.prompts is not None else [0]
    if ask.pooled_bytes and len(counts) * ask.pooled_bytes > state.limits.max_answer_bytes:
        raise APIError(
            400,
            f"the answer would be about {len(counts) * ask.pooled_bytes} bytes ({len(counts)} inputs); this "
            f"server answers at most {state.limits.max_answer_bytes} (--max-answer-bytes): send fewer inputs",
            param="prompt",
        )
    echo = None
    if ask.echo and ask.prompts is not None:
        echo = [len(p) if isinstance(p, str) else TOKEN_BYTES * len(p) for p in ask.prompts]
    check_answer(state.limits, counts, ask.n, max_tokens, ask.logprobs, echo, ask.logprob_bytes)


async def tokenize(state, ask: Ask) -> list[list[int]]:
    """Steps 1-4: the prompts' ids, or a 400 before any tokenizing when they cannot fit."""
    check_model(state, ask.model)
    _check_limits(state, ask, ask.max_tokens or (0 if ask.pooled_bytes else 1))
    cap, tok = state.capacity, state.engine_loop.engine.tokenizer
    if ask.prompts is not None:
        if not ask.prompts:
            raise APIError(400, "prompt is empty", param="prompt")
        for p in ask.prompts:
            if isinstance(p, (str, tuple)):
                check_chars(cap, len(p) if isinstance(p, str) else sum(map(len, p)), "prompt")
        special = ask.special_tokens
        return await state.off_loop(lambda: [encode_prompt(tok, p, cap.vocab_size, special) for p in ask.prompts])
    check_chars(cap, template_chars(ask.messages, ask.tools, cap.max_token_chars or 1), "messages")
    as_text = not state.limits.content_special_tokens
    return [await state.off_loop(encode_messages, tok, ask.messages, ask.tools, ask.template_kwargs, as_text)]


async def admit(state, ask: Ask) -> tuple[Job, list[list[int]]]:
    """All six steps: the started job and its prompts' ids."""
    try:
        if state.pooling is not None and state.pooling.embedding_only and not ask.pooled_bytes:
            check_model(state, ask.model)
            spec = state.pooling
            raise APIError(
                400,
                f"'{state.model_id}' is {spec.what}; it does not generate: use "
                + ("/v1/rerank" if spec.scores == "head" else "/v1/embeddings"),
                param="model",
            )
        prompts = await tokenize(state, ask)
        cap = state.capacity
        longest = max(map(len, prompts))
        if ask.pooled_bytes:  # nothing is generated
            max_tokens = 0
        else:
            max_tokens = ask.max_tokens or default_max_tokens(cap, ask.default_max_tokens, longest, ask.n)
        if ask.max_tokens and cap.context and longest < cap.context and longest + max_tokens > cap.context:
            max_tokens = cap.context - longest  # clamped, not refused: the prompt itself fits
            note(max_tokens_clamped=max_tokens)
        _check_limits(state, ask, max_tokens, prompts)
        for ids in prompts:
            check_context(len(ids), max_tokens, cap.context)
        try:
            params = ask.make_params(max_tokens)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0] if " must " in str(e) else None) from None
        job = await Job.start(state, ask.prefix, prompts, params, ask.guided_param)
        note(job=job)  # the access log line reads its tokens when the response ends
        return job, prompts
    except APIError as e:
        raise renamed(e, ask.names) from None


async def count_tokens(state, ask: Ask) -> int:
    try:
        return len((await tokenize(state, ask))[0])
    except APIError as e:
        raise renamed(e, ask.names) from None


def renamed(e: APIError, names: dict[str, str]) -> APIError:
    """`e` in the route's field names (OpenAI's `max_tokens` is Responses' `max_output_tokens`)."""
    for old, new in names.items():
        e.message = re.sub(rf"(?<![\w-]){old}(?![\w-])", new, e.message)  # a field, not a flag's part
        if e.param == old:
            e.param = new
    return e
