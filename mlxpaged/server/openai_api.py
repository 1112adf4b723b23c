"""OpenAI's `POST /v1/completions` and `POST /v1/chat/completions`, over the one admission path.

Each handler converts its body to an `Ask` (admission.py), which checks, tokenizes and starts the
job; then it renders the job's events (`turns.job_events`) as OpenAI's JSON: as
`chat.completion.chunk` / `text_completion` events, one chunk per choice per delta, or whole: the
same events collected, each choice's added up as a client adds up its chunks. A whole answer is
built and encoded on the tokenizer thread, a choice at a time (`_answer`), so however large it is
the event loop goes on serving. Errors are OpenAI's error object.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .admission import Ask, admit
from .errors import APIError
from .guided_request import chat_plan
from .jobs import JobStream
from .keepalive import keepalive
from .limits import CHAT_LOGPROB_BYTES
from .openai_format import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    encode_answer,
    envelope,
    sse_data,
    usage,
)
from .protocol import ChatCompletionRequest, CompletionRequest
from .tools import ToolCall
from .turns import Logprobs, Thinking, TurnEnd, drain, job_events, turn_parse

DEFAULT_CHAT_MAX_TOKENS = 1024  # when a chat body gives neither max_tokens nor max_completion_tokens
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def register_openai(router: APIRouter, state, text_of) -> None:
    vocab = state.capacity.vocab_size

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        if body.echo and body.stream:
            raise APIError(400, "echo with stream is not supported; send stream: false", param="echo")
        if body.max_tokens == 0 and not body.echo:
            raise APIError(
                400, "max_tokens: 0 asks for nothing; it is for echo: true (the prompt alone)", param="max_tokens"
            )
        prompt_only = body.max_tokens == 0  # the engine samples one token, which the answer leaves out
        plp = body.logprobs if body.echo else None
        ask = Ask(
            "cmpl",
            body.model,
            lambda max_tokens: body.to_sampling_params(max_tokens, body.logprobs, vocab, prompt_logprobs=plp),
            DEFAULT_COMPLETION_MAX_TOKENS,
            prompts=body.prompts(),
            stops=body.stops(),
            stop_token_ids=body.stop_token_ids,
            n=body.n,
            max_tokens=1 if prompt_only else body.max_tokens,
            logprobs=body.logprobs,
            echo=body.echo,
            adapters=body.adapters,
        )
        job, _ = await admit(state, ask)
        asked_lps = job.params.logprobs is not None

        def choice(index, text, lps, finish, prompt=None):
            lp = completion_logprobs(lps, text_of) if asked_lps else None
            if prompt is not None:  # echo: the prompt's text and (with logprobs) its tokens first
                text_p, ids, plps = prompt
                if lp is not None:
                    lp = echo_logprobs(ids, plps, text_of, lp)
                text = text_p + text
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

        def chunk(index, events, sent):
            text, _, _, lps, end = _gather(events)
            return choice(index, text, lps, end.finish_reason if end else None)

        def whole(index, events):
            text, _, _, lps, end = _gather(events)
            finish = end.finish_reason
            if prompt_only:
                text, lps, finish = "", [], "length"
            prompt = None
            if body.echo:
                o = job.final[job.rids[index // job.params.n]]
                ids = list(o.prompt_token_ids)
                prompt = (o.prompt if o.prompt is not None else state.engine_loop.engine.tokenizer.decode(ids), ids)
                prompt += (o.prompt_logprobs,)
            return choice(index, text, lps, finish, prompt)

        if body.stream:
            events = _chunks(state, job, "text_completion", chunk, body.include_usage, None, False)
            return JobStream(job, keepalive(events))  # keep-alive comments while it waits or prefills
        per, _ = await _collect(request, job_events(state, job, None, False))
        used = usage([job.final[r] for r in job.rids], generated=not prompt_only)
        head = envelope(job.resp_id, "text_completion", state.model_id)
        return await _answer(state, head, lambda: (whole(i, per.pop(i)) for i in sorted(per)), used)

    @router.post("/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        messages, plan = chat_plan(body, state.markers)  # tools, tool_choice and response_format (guided_request.py)
        parse = turn_parse(state, plan)  # refuses a forced call the checkpoint's format cannot be forced in
        ask = Ask(
            "chatcmpl",
            body.model,
            lambda max_tokens: body.to_sampling_params(max_tokens, body.logprobs_k(), vocab, guided=plan.guided),
            DEFAULT_CHAT_MAX_TOKENS,
            messages=messages,
            tools=plan.tools,
            stops=body.stops(),
            stop_token_ids=body.stop_token_ids,
            n=body.n,
            max_tokens=body.requested_max_tokens(),
            guided_param=plan.param,
            logprobs=body.logprobs_k(),
            logprob_bytes=CHAT_LOGPROB_BYTES,
            adapters=body.adapters,
        )
        job, _ = await admit(state, ask)
        asked_lps = job.params.logprobs is not None

        def chunk(index, events, sent):
            """One choice of a chunk, from one delta's events (None: nothing to send yet);
            `sent`: the tool calls this choice sent before."""
            text, reasoning, calls, lps, end = _gather(events)
            delta = {"content": text} if text or not (reasoning or parse) else {}
            if calls:
                delta["tool_calls"] = [
                    {
                        "index": sent + k,
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for k, c in enumerate(calls)
                ]
            if reasoning:
                delta["reasoning_content"] = reasoning
            if not delta and end is None and not lps:
                return None
            lp = chat_logprobs(lps, text_of) if asked_lps else None
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": end.finish_reason if end else None}

        def whole(index, events):
            """One choice of the whole answer: all its events' pieces, as a client adds up its chunks."""
            text, reasoning, calls, lps, end = _gather(events)
            msg: dict = {"role": "assistant", "content": (text or None) if calls else text}
            if calls:
                msg["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls
                ]
            if reasoning:
                msg["reasoning_content"] = reasoning
            lp = chat_logprobs(lps, text_of) if asked_lps else None
            return {"index": index, "message": msg, "logprobs": lp, "finish_reason": end.finish_reason}

        if body.stream:
            return JobStream(  # keep-alive comments while the request waits or prefills
                job, keepalive(_chunks(state, job, "chat.completion.chunk", chunk, body.include_usage, parse, True))
            )
        per, thought = await _collect(request, job_events(state, job, parse, True))
        head = envelope(job.resp_id, "chat.completion", state.model_id)
        used = usage([job.final[r] for r in job.rids], thought)
        return await _answer(state, head, lambda: (whole(i, per.pop(i)) for i in sorted(per)), used)


async def _collect(request: Request, events) -> tuple[dict[int, list], int]:
    """The job's events (`job_events`) collected: choice index -> its events in order, and the
    reasoning tokens of all choices (the stream's usage chunk counts the same)."""
    per: dict[int, list] = {}
    for index, evs in await drain(request, events):
        per.setdefault(index, []).extend(evs)
    thought = sum(e.reasoning_tokens for evs in per.values() for e in evs if isinstance(e, TurnEnd))
    return per, thought


async def _answer(state, head: dict, choices, used: dict) -> Response:
    """The whole answer `head` + `choices()` + `usage`, built and encoded on the tokenizer thread
    (naming logprobs' tokens decodes; the echoed prompts' text too): the event loop never holds
    tens of MB of it, and /health answers while it is written."""
    body = await state.off_loop(lambda: encode_answer(head, choices(), {"usage": used}))
    return Response(body, media_type="application/json")


async def _render(state, job, fn, *args):
    """`fn(*args)`; on the tokenizer thread when logprobs are asked for (naming their tokens decodes),
    so the event loop does no tokenizer work."""
    if job.params.logprobs is None:
        return fn(*args)
    return await state.off_loop(fn, *args)


def _gather(events: list) -> tuple[str, str, list[ToolCall], list, TurnEnd | None]:
    """(answer text, reasoning text, tool calls, logprobs, end) of one delta's events."""
    text = "".join(e for e in events if isinstance(e, str))
    reasoning = "".join(e.text for e in events if isinstance(e, Thinking))
    lps = [t for e in events if isinstance(e, Logprobs) for t in e.items]
    end = next((e for e in events if isinstance(e, TurnEnd)), None)
    return text, reasoning, [e for e in events if isinstance(e, ToolCall)], lps, end


async def _chunks(state, job, kind: str, chunk, include_usage: bool, parse, think: bool):
    """The job's events as OpenAI chunks of `kind`, then the usage chunk (if asked for) and
    `[DONE]`. A failed step sends the error object in place of the rest."""
    extra = {"usage": None} if include_usage else {}
    calls: dict[int, int] = {}  # choice index -> tool calls sent
    started: set[int] = set()
    thought = 0
    try:
        async for index, events in job_events(state, job, parse, think):
            choice = await _render(state, job, chunk, index, events, calls.get(index, 0))
            calls[index] = calls.get(index, 0) + sum(isinstance(e, ToolCall) for e in events)
            thought += sum(e.reasoning_tokens for e in events if isinstance(e, TurnEnd))
            if choice is None:
                continue
            if kind == "chat.completion.chunk" and index not in started:
                choice["delta"] = {"role": "assistant", **choice["delta"]}
                started.add(index)
            yield sse_data(envelope(job.resp_id, kind, state.model_id, choices=[choice], **extra))
        if include_usage:
            outs = [job.final[r] for r in job.rids]
            yield sse_data(envelope(job.resp_id, kind, state.model_id, choices=[], usage=usage(outs, thought)))
    except APIError as e:
        yield sse_data(e.body())
    yield "data: [DONE]\n\n"
