"""OpenAI's `POST /v1/completions` and `POST /v1/chat/completions`, over the one admission path.

Each handler converts its body to an `Ask` (admission.py), which checks, tokenizes and starts the
job; then it renders the job's outputs as OpenAI's JSON, whole or as `chat.completion.chunk` /
`text_completion` events (jobs.py streams them). Errors are OpenAI's error object.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from .admission import Ask, admit
from .guided_request import chat_plan
from .keepalive import keepalive
from .openai_format import ChoiceStream, chat_logprobs, completion_logprobs, envelope, usage
from .protocol import ChatCompletionRequest, CompletionRequest
from .reasoning import split_reasoning, thinking_of
from .tools import ToolCallStream, chat_message, check_forcible, stream_tool_delta

DEFAULT_CHAT_MAX_TOKENS = 1024  # when a chat body gives neither max_tokens nor max_completion_tokens
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def register_openai(router: APIRouter, state, text_of) -> None:
    vocab = state.capacity.vocab_size

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        ask = Ask(
            "cmpl",
            body.model,
            lambda max_tokens: body.to_sampling_params(max_tokens, body.logprobs, vocab),
            DEFAULT_COMPLETION_MAX_TOKENS,
            prompts=body.prompts(),
            stops=body.stops(),
            stop_token_ids=body.stop_token_ids,
            n=body.n,
            max_tokens=body.max_tokens,
        )
        job, _ = await admit(state, ask)

        def choice(index, text, lps, finish, stream: ChoiceStream):
            lp = completion_logprobs(lps, text_of) if lps is not None else None
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

        def whole(o, c):
            return choice(job.index(o.request_id, c.index), c.text, getattr(c, "logprobs", None), c.finish_reason, None)

        return await answer(state, job, request, body, ("text_completion", "text_completion"), choice, whole)

    @router.post("/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        messages, plan = chat_plan(body, state.markers)  # tools, tool_choice and response_format (guided_request.py)
        check_forcible(state.tool_format, plan)
        parse, fmt = (plan.parse, state.tool_format) if state.tool_format else (None, None)
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
        )
        job, prompts = await admit(state, ask)

        def chunk_choice(index, text, lps, finish, stream: ChoiceStream):
            if not hasattr(stream, "think"):
                stream.think = thinking_of(state, prompts[0])
            reasoning, text = split_reasoning(stream.think, text, finish is not None)
            delta = {"content": text} if text or not reasoning else {}
            if parse:  # content the tool-call parser lets through, and the calls it completed
                if not hasattr(stream, "tools"):
                    stream.tools = ToolCallStream(parse, fmt)
                delta, finish = stream_tool_delta(stream.tools, text, finish)
            if reasoning:
                delta["reasoning_content"] = reasoning
            if (parse or state.think) and not delta and not finish and not lps:
                return None
            if not stream.started:
                delta = {"role": "assistant", **delta}
                stream.started = True
            lp = chat_logprobs(lps, text_of) if lps is not None else None
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

        def whole(o, c):
            reasoning, text = split_reasoning(thinking_of(state, prompts[0]), c.text)
            msg, finish = chat_message(text, c.finish_reason, parse, fmt)  # tools.py: parsed calls
            if reasoning:
                msg["reasoning_content"] = reasoning
            lps = getattr(c, "logprobs", None)
            lp = chat_logprobs(lps, text_of) if lps is not None else None
            return {"index": c.index, "message": msg, "logprobs": lp, "finish_reason": finish}

        kinds = ("chat.completion.chunk", "chat.completion")
        return await answer(state, job, request, body, kinds, chunk_choice, whole)


async def answer(state, job, request: Request, body, kinds: tuple[str, str], chunk, whole):
    """The job's outputs: streamed as `kinds[0]` events (each choice from `chunk`), or one
    `kinds[1]` object (each choice `whole(output, completion)`)."""
    if body.stream:
        resp = job.stream(request, kinds[0], state.model_id, chunk, body.include_usage)
        resp.body_iterator = keepalive(resp.body_iterator)  # comments while the request waits or prefills
        return resp
    outs = await job.collect(request)
    choices = [whole(o, c) for o in outs for c in o.outputs]
    return envelope(job.resp_id, kinds[1], state.model_id, choices=choices, usage=usage(outs))
