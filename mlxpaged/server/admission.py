"""The one way in to the engine, for every route (OpenAI chat and completions, Messages, Responses,
embeddings and rerank).

A route turns its body into an `Ask` (its template messages and tools, or completion prompts; its
stops, n, the max_tokens it asked for, and how to build its `SamplingParams`) and calls `admit`,
which, here and nowhere else, in this order:
1. checks the model name, and the LoRA adapter it or `adapters` names (adapters.py);
2. bounds the stops, the stop token ids, the prompts, the work asked for and the answer's estimated
   size (limits.py);
3. counts every character the template will render (system, messages, tool definitions, tool
   calls and results, and one token's worth per message for the template's own markers) and
   refuses a prompt that cannot fit the pool, before any tokenizing;
4. with images: checks the model takes them, their count and (unless `--fetch-image-urls`) that
   none is an http(s) URL, fetches those that are (image_fetch.py); tokenizes on the tokenizer
   thread, never on the event loop, and there decodes the images within their byte and pixel
   limits;
5. picks the default max_tokens against the pool's maximum and the model's context, and clamps an
   asked max_tokens to what the context leaves (Claude Code asks 32,000 whatever the model): the
   response says so in its `x-mlxpaged-max-tokens-clamped` header;
6. checks the context, the work and the answer's size again (with the prompts' token counts now),
   builds the parameters and starts the `Job`.

Errors are `APIError`s; `Ask.names` renames OpenAI's field names in them to the route's own
(`max_output_tokens`, `stop_sequences`), and the route renders them as its own error object.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .adapters import request_adapter
from .errors import APIError
from .image_fetch import fetch_images, is_url
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
    adapters: str | None = None  # mlx_lm.server's field: a LoRA adapter's name or folder (adapters.py)
    adapter: str | None = None  # the adapter it runs with, found at step 1 (None: the base model)
    num_ctx: int | None = None  # the longest prompt the client takes, in tokens (Ollama's option; None: any)


def template_chars(messages: list[dict], tools: list[dict] | None, per_message: int) -> int:
    """Characters the template renders from these messages and tools, at least (its own markers:
    `per_message` a message, a token's worth: every template writes at least one token per message)."""
    n = len(json.dumps(tools, ensure_ascii=False)) if tools else 0
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):  # parts: their text (an image's tokens are counted once processed)
            content = "".join(p.get("text") or "" for p in content)
        n += per_message + len(m.get("role") or "") + len(content) + len(m.get("tool_call_id") or "")
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


def take_images(messages: list[dict]) -> tuple[list[dict], list[tuple[str, str]]]:
    """(the messages as the chat template reads them, each image part `{"type": "image"}`; each
    image's (where, url), in the order the template renders them: messages, then parts)."""
    images: list[tuple[str, str]] = []
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(p.get("type") == "image" for p in content):
            images += [(p["where"], p["url"]) for p in content if p.get("type") == "image"]
            m = {**m, "content": [{"type": "image"} if p.get("type") == "image" else p for p in content]}
        out.append(m)
    return out, images


def image_bytes(limits, where: str, source: str | bytes) -> bytes:
    """An image part's bytes: a base64 data URL's, or a fetched URL's (`source` already bytes,
    image_fetch.py), at most `--max-image-bytes`; a 400 naming the part otherwise."""
    import base64
    import binascii

    if isinstance(source, bytes):
        return source
    head, sep, data = source.partition(",")
    if not (source.startswith("data:") and sep and head.endswith(";base64")):
        raise APIError(400, f"{where}: an image must be a base64 data URL (data:image/...;base64,...)", param=where)
    too_big = APIError(
        400, f"{where}: the image is larger than {limits.max_image_bytes} bytes (--max-image-bytes)", param=where
    )
    if len(data) * 3 // 4 > limits.max_image_bytes + 2:  # before decoding it (4 characters, 3 bytes)
        raise too_big
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{where}: the image's data is not valid base64", param=where) from None
    if len(raw) > limits.max_image_bytes:
        raise too_big
    return raw


def decode_image(limits, where: str, source: str | bytes):
    """One image part's decoded image (`source`: a data URL, or a fetched image's bytes), within
    the limits, its pixels counted from its header before it is decoded; a 400 naming the part
    otherwise."""
    import io

    from PIL import Image

    from ..engine.multimodal import load_image

    raw = image_bytes(limits, where, source)
    too_many = f"more than {limits.max_image_pixels} pixels (--max-image-pixels)"
    try:
        w, h = Image.open(io.BytesIO(raw)).size  # the header only: no pixels decoded yet
    except Image.DecompressionBombError:  # past PIL's own bound (twice its MAX_IMAGE_PIXELS)
        raise APIError(400, f"{where}: the image has {too_many}", param=where) from None
    except Exception:  # noqa: BLE001 - an unreadable image is load_image's to name, below
        w = h = 0
    if w * h > limits.max_image_pixels:
        raise APIError(400, f"{where}: {w}x{h} is {too_many}", param=where)
    try:
        return load_image(raw, where)
    except ValueError as e:
        raise APIError(400, str(e), param=where) from None


def image_inputs(state, ids: list[int], images: list[tuple[str, str | bytes]]):
    """The prompt's images decoded and processed (engine/multimodal.py `ImageInputs`: its image
    markers widened): numpy work, on the tokenizer thread."""
    from ..engine.multimodal import process_images

    decoded = [decode_image(state.limits, where, source) for where, source in images]
    try:
        return process_images(state.engine_loop.engine.loaded, ids, decoded)
    except ValueError as e:
        raise APIError(400, f"messages: {e}", param="messages") from None


def check_images(state, images: list[tuple[str, str]]) -> None:
    """A request with images: the model must take them, not more than `--max-images` of them,
    and an http(s) URL only when the server fetches them (`--fetch-image-urls`)."""
    loaded = state.engine_loop.engine.loaded
    if loaded.processor is None:
        raise APIError(400, f"model {state.model_id} takes no images (it has no vision tower)", param="messages")
    if len(images) > state.limits.max_images:
        raise APIError(
            400,
            f"{len(images)} images, more than the {state.limits.max_images} a request may hold (--max-images)",
            param="messages",
        )
    for where, url in images:
        if is_url(url) and not state.limits.fetch_image_urls:
            raise APIError(
                400,
                f"{where}: image URLs are not fetched unless the server runs with --fetch-image-urls; "
                "send the image as a data URL",
                param=where,
            )


async def tokenize(state, ask: Ask) -> list[list[int]]:
    """Steps 1-4: the prompts' ids, or a 400 before any tokenizing when they cannot fit."""
    return (await tokenize_images(state, ask))[0]


async def tokenize_images(state, ask: Ask) -> tuple[list[list[int]], object]:
    """`tokenize`, and a prompt's images processed (`ImageInputs`, its ids the prompt's), or None."""
    check_model(state, ask.model)
    ask.adapter = request_adapter(state, ask.model, ask.adapters)
    _check_limits(state, ask, ask.max_tokens or (0 if ask.pooled_bytes else 1))
    cap, tok = state.capacity, state.engine_loop.engine.tokenizer
    if ask.prompts is not None:
        if not ask.prompts:
            raise APIError(400, "prompt is empty", param="prompt")
        for p in ask.prompts:
            if isinstance(p, (str, tuple)):
                check_chars(cap, len(p) if isinstance(p, str) else sum(map(len, p)), "prompt")
        special = ask.special_tokens
        return await state.off_loop(lambda: [encode_prompt(tok, p, cap.vocab_size, special) for p in ask.prompts]), None
    check_chars(cap, template_chars(ask.messages, ask.tools, cap.max_token_chars or 1), "messages")
    as_text = not state.limits.content_special_tokens
    messages, images = take_images(ask.messages)
    if images:
        check_images(state, images)
        images = await fetch_images(state.limits, images)  # http(s) URLs' bytes (--fetch-image-urls)
    ids = await state.off_loop(encode_messages, tok, messages, ask.tools, ask.template_kwargs, as_text)
    if not images:
        return [ids], None
    inputs = await state.off_loop(image_inputs, state, ids, images)
    return [inputs.ids], inputs


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
        prompts, images = await tokenize_images(state, ask)
        if ask.pooled_bytes and ask.adapter is not None:
            raise APIError(
                400, f"adapter '{ask.adapter}': embeddings and scores run on the base model only", param="model"
            )
        cap = state.capacity
        longest = max(map(len, prompts))
        if ask.pooled_bytes:  # nothing is generated
            max_tokens = 0
        else:
            max_tokens = ask.max_tokens or default_max_tokens(cap, ask.default_max_tokens, longest, ask.n)
        if ask.max_tokens and cap.context and longest < cap.context and longest + max_tokens > cap.context:
            max_tokens = cap.context - longest  # clamped, not refused: the prompt itself fits
            note(max_tokens_clamped=max_tokens)
        if ask.num_ctx is not None and longest > ask.num_ctx:
            raise APIError(
                400,
                f"num_ctx: the prompt has {longest} tokens, more than num_ctx ({ask.num_ctx}); "
                "this server does not truncate prompts",
                param="num_ctx",
            )
        _check_limits(state, ask, max_tokens, prompts)
        for ids in prompts:
            check_context(len(ids), max_tokens, cap.context)
        try:
            params = ask.make_params(max_tokens)
            if ask.adapter is not None:
                params = dataclasses.replace(params, adapter=ask.adapter)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0] if " must " in str(e) else None) from None
        job = await Job.start(state, ask.prefix, prompts, params, ask.guided_param, images)
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
