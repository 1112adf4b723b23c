"""`POST /tokenize` and `POST /detokenize`, in vLLM's shape (lm-eval's remote tokenizer and scripts
that count tokens before they send).

`/tokenize` takes `{"model", "prompt"}` (text, or token ids checked against the vocabulary) and
answers `{"count", "max_model_len", "tokens"}`; `/detokenize` takes `{"model", "tokens"}` and
answers `{"prompt"}`. Both go through admission's checks (the model name, the character cap before
any tokenizing, the tokenizer thread) and sit behind the same API key and body cap as every route.
Chat `messages` are not taken here: `/v1/messages/count_tokens` counts a templated conversation.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import Field

from .admission import Ask, tokenize
from .errors import APIError
from .jobs import check_model
from .protocol import Text, _Request


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: Text | list[int] | None = None
    messages: object = None  # vLLM's chat form: refused by name, never ignored


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int] = Field(min_length=1)


def register_tokenize(router: APIRouter, state) -> None:
    @router.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest):
        if body.messages is not None:
            raise APIError(
                400,
                "messages is not supported on /tokenize; /v1/messages/count_tokens counts a conversation",
                param="messages",
            )
        if body.prompt is None:
            raise APIError(400, "prompt: a text or a list of token ids is required", param="prompt")
        ask = Ask("tok", body.model, lambda n: None, 1, prompts=[body.prompt], max_tokens=1)
        ids = (await tokenize(state, ask))[0]
        return {"count": len(ids), "max_model_len": state.capacity.context, "tokens": ids}

    @router.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        check_model(state, body.model)
        vocab = state.capacity.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        most = state.limits.max_request_tokens
        if len(body.tokens) > most:
            raise APIError(400, f"tokens: more than {most} ids (--max-request-tokens)", param="tokens")
        tok = state.engine_loop.engine.tokenizer
        return {"prompt": await state.off_loop(tok.decode, body.tokens)}
