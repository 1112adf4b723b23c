"""After a token is appended: stop checks, detokenizing, and the outputs a caller sees.

`check_stop` is what the scheduler calls on every appended token (`Scheduler.update_from_output`);
`make_output` turns a request into the `RequestOutput` that `LLMEngine.step` returns.
"""

from __future__ import annotations

import logging

from ..core.sequence import FinishReason, Request, Sequence
from .outputs import CompletionOutput, RequestOutput


class StopChecker:
    """Decides whether a just-appended token ends its sample, and feeds the detokenizer.

    A token that ends the sample by id (EOS, `stop_token_ids`) stays in `token_ids` but never
    reaches the text, as in vLLM and mlx-lm. A stop string ends it at the string's first
    occurrence (`stop_text_len`); only text the new token could have completed is searched.
    A constrained sample's grammar matcher takes every appended token; the sample ends ("stop")
    when the grammar is complete.
    """

    def __init__(self, eos_token_ids: set[int], hidden_ids: frozenset[int] = frozenset()):
        self.eos_token_ids = eos_token_ids
        self.hidden_ids = hidden_ids  # control tokens: kept in token_ids, never in the text

    def __call__(self, req: Request, seq: Sequence, tok: int) -> FinishReason | None:
        p = req.params
        if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
            return FinishReason.STOP
        grammar_done = False
        if seq.matcher is not None:
            if not seq.matcher.consume(tok):  # the mask forbids this: a bug, not the request's fault
                logging.getLogger(__name__).warning(
                    "request %s: the grammar rejected token %d (%s); sample stopped",
                    req.request_id,
                    tok,
                    seq.matcher.error(),
                )
                return FinishReason.STOP
            grammar_done = seq.matcher.is_stopped
        before = len(seq.detokenizer.text)
        if tok not in self.hidden_ids:
            seq.detokenizer.add_token(tok)
        if p.stop:
            text = seq.detokenizer.text
            # A stop string completed by this token starts after `before - len(stop) + 1`.
            hits = [i for i in (text.find(s, max(0, before - len(s) + 1)) for s in p.stop) if i >= 0]
            if hits:
                seq.stop_text_len = min(hits)
                return FinishReason.STOP
        if grammar_done:
            return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens:
            return FinishReason.LENGTH
        return None


def hidden_token_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special added tokens (`<|im_start|>`, `<|endoftext|>`), which a
    random or confused model may sample: they are control tokens, not text (HF's
    `skip_special_tokens`). The thinking and tool-call markers stay: the server parses them."""
    added = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "added_tokens_decoder", None) or {}
    keep = {getattr(tokenizer, k, None) for k in ("think_start", "think_end", "tool_call_start", "tool_call_end")}
    return frozenset(i for i, t in added.items() if getattr(t, "special", False) and t.content not in keep)


def make_output(req: Request, tokenizer) -> RequestOutput:
    """The request's samples so far (or, for a beam search, its finished hypotheses, best first)."""
    outs = []
    if req.beam is not None:
        if req.finished:
            for i, h in enumerate(req.beam.finished):
                text_ids = h.token_ids[:-1] if h.finish_reason == "stop" else h.token_ids
                outs.append(
                    CompletionOutput(
                        i,
                        tokenizer.decode(text_ids),
                        list(h.token_ids),
                        h.finish_reason,
                        cumulative_logprob=h.cumulative_logprob,
                        score=h.score,
                    )
                )
    else:
        for s in req.seqs:
            if s.finished:
                s.detokenizer.finalize()
            text = s.detokenizer.text
            stop_reason = None  # vLLM's: the stop string that ended the sample, or the stop token id
            if s.stop_text_len is not None:
                # the first occurrence that ended it: of the stops found there, the one StopChecker saw first
                stop_reason = next((x for x in req.params.stop if text.startswith(x, s.stop_text_len)), None)
                text = text[: s.stop_text_len]
            elif s.finish_reason is FinishReason.STOP and s.output_token_ids:
                last = s.output_token_ids[-1]
                stop_reason = last if last in req.params.stop_token_ids else None
            outs.append(
                CompletionOutput(
                    s.sample_index,
                    text,
                    list(s.output_token_ids),
                    s.finish_reason.value if s.finish_reason else None,
                    logprobs=list(s.logprobs) if req.params.logprobs is not None else None,
                    stop_reason=stop_reason,
                )
            )
    return RequestOutput(
        req.request_id, req.prompt_text, req.prompt_token_ids, outs, req.finished, req.num_cached_tokens
    )
