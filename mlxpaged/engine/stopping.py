"""After a token is appended: stop checks, detokenizing, and the outputs a caller sees.

`check_stop` is what the scheduler calls on every appended token (`Scheduler.update_from_output`);
`make_output` turns a request into the `RequestOutput` that `LLMEngine.step` returns: cumulative,
or (`output_kind="delta"`) what is new since the last one. A delta holds back the tail of the text
that could still grow into a stop string (`StopMatcher`), so a streamed stop string is never sent
and taken back: the deltas of a sample sum to its cumulative output. This is the one place stop
strings are held back; the server only renders deltas.
"""

from __future__ import annotations

import copy
import logging
import weakref
from dataclasses import dataclass

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, _byte_decoder

from ..core.sequence import FinishReason, Request, Sequence
from .outputs import CompletionOutput, IdsSnapshot, RequestOutput


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
        stops = p.stop
        if stops:
            before = len(seq.detokenizer.text)
        if tok not in self.hidden_ids:
            seq.detokenizer.add_token(tok)
        if stops:
            text = seq.detokenizer.text
            # A stop string completed by this token starts after `before - len(stop) + 1`.
            hits = [i for i in (text.find(s, max(0, before - len(s) + 1)) for s in p.stop) if i >= 0]
            if hits:
                seq.stop_text_len = min(hits)
                return FinishReason.STOP
        if grammar_done:
            return FinishReason.STOP
        if len(seq.token_ids) - seq.num_prompt_tokens >= p.max_tokens:  # num_output_tokens, inlined
            return FinishReason.LENGTH
        return None


def _borders(s: str) -> list[int]:
    """KMP's failure function: `b[i]` is the longest proper prefix of `s[:i + 1]` that is also its suffix."""
    b, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = b[k - 1]
        if s[i] == s[k]:
            k += 1
        b[i] = k
    return b


class StopMatcher:
    """For each stop string, the longest prefix of it that the text fed so far ends with.

    Fed incrementally (a KMP automaton per stop), so a stream of T characters costs O(T) per
    stop in all, not O(len(stop)^2) slicing per step."""

    def __init__(self, stops: list[str], borders: list[list[int]] | None = None):
        self.stops = stops
        self.borders = borders if borders is not None else [_borders(s) for s in stops]  # shareable: read-only
        self.state = [0] * len(stops)

    def feed(self, text: str) -> None:
        for j, (s, b) in enumerate(zip(self.stops, self.borders)):
            q, m = self.state[j], len(s)
            for ch in text:
                if q == m:
                    q = b[m - 1]
                while q and s[q] != ch:
                    q = b[q - 1]
                if s[q] == ch:
                    q += 1
            self.state[j] = q

    def hold_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        return max((q if q < len(s) else b[q - 1] for s, b, q in zip(self.stops, self.borders, self.state)), default=0)


def hold_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    m = StopMatcher(stops)
    m.feed(text[-max((len(s) for s in stops), default=0) :] if stops else "")
    return m.hold_back()


@dataclass
class _Sent:
    """What the deltas of one sample have handed out so far."""

    matcher: StopMatcher | None
    fed: int = 0  # characters of the text the matcher has seen
    chars: int = 0  # characters handed out
    tokens: int = 0  # token ids (and logprobs) handed out
    finished: bool = False  # the finish reason was handed out: nothing more comes


# Per-sample delta state, dropped with its Sequence (core/ owns Sequence; this is the output side's
# own record). The stops' KMP tables are built once per request, for all its samples.
_SENT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BORDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _delta(req: Request, s: Sequence, text: str, stop_reason) -> CompletionOutput | None:
    """What is new in sample `s` since its last delta (None: nothing, not even its end)."""
    st = _SENT.get(s)
    if st is None:
        stops = req.params.stop
        if stops and req not in _BORDERS:
            _BORDERS[req] = [_borders(x) for x in stops]
        st = _SENT[s] = _Sent(StopMatcher(stops, _BORDERS[req]) if stops else None)
    if st.finished:
        return None
    if s.finished:
        end = len(text)  # the final text: the stop string, if one ended it, is already cut off
    else:
        if st.matcher is not None:
            st.matcher.feed(text[st.fed :])
            st.fed = len(text)
        end = len(text) - (st.matcher.hold_back() if st.matcher is not None else 0)
    end = max(end, st.chars)
    ids = s.token_ids[s.num_prompt_tokens + st.tokens :]  # the new ones only (not a copy of every output token)
    if end == st.chars and not ids and not s.finished:
        return None
    lps = s.logprobs[st.tokens :] if req.params.logprobs is not None else None
    out = CompletionOutput(
        s.sample_index,
        text[st.chars : end],
        ids,  # a fresh slice: the output's own list
        s.finish_reason.value if s.finish_reason else None,
        logprobs=lps,
        stop_reason=stop_reason,
    )
    st.chars, st.tokens, st.finished = end, st.tokens + len(ids), s.finished
    return out


MEMO_LIMIT = 1 << 18  # distinct token strings remembered per engine (about a vocabulary)


class MemoBPEDetokenizer(BPEStreamingDetokenizer):
    """mlx-lm's byte-level BPE streaming detokenizer, with each token string's bytes remembered.

    mlx-lm's maps the unflushed characters back to bytes in a Python loop on every `add_token`:
    about a quarter of a decode step's host time at 64 samples. The map is a pure function of a
    token's string, and the bytes of a concatenation are the concatenation of the bytes, so this
    one keeps the unflushed bytes beside the unflushed string, remembering each token's bytes in
    one table that the copies (one per sample) share. A token that, with nothing unflushed,
    flushes on its own (most of them) has its text remembered by id too (`_flushes`), so it is
    decoded once per engine, not once per appearance. The text is mlx-lm's, character for
    character (tests/test_detokenizer.py)."""

    _memo: dict
    _flushes: dict
    _SPACE = "\u0120"  # the one-character token string of byte 32 in the byte-level alphabet

    def reset(self):
        super().reset()
        self._unflushed_bytes = b""

    def _bytes_of(self, v: str) -> bytes:
        b = self._memo.get(v)
        if b is None:
            byte_decoder = _byte_decoder()
            barr = bytearray()
            for c in v:  # mlx-lm's `_decode_bytes` loop, byte for byte (its falsy 0 included)
                res = byte_decoder.get(c, False)
                if res:
                    barr.append(res)
                else:
                    barr.extend(bytes(c, "utf-8"))
            b = bytes(barr)
            if len(self._memo) < MEMO_LIMIT:
                self._memo[v] = b
        return b

    def add_token(self, token):
        # mlx-lm's `add_token`, on the kept bytes; its space test (a one-character token that is
        # byte 32) as one comparison
        self.tokens.append(token)
        if not self._unflushed:
            # The usual token: nothing unflushed and its bytes a whole text, remembered by id
            # (`_flushes`): what the general path below appends, without decoding it again.
            d = self._flushes.get(token)
            if d is not None:
                self.text += self._maybe_trim_space(d) if d[:1] == " " else d
                return
        v = self.tokenmap[token] if token < len(self.tokenmap) else "!"
        if not self._unflushed and len(self._flushes) < MEMO_LIMIT:
            d = self._bytes_of(v).decode("utf-8", "replace")
            if not d.endswith("\ufffd") and v != self._SPACE:  # it flushes on its own, every time
                self._flushes[token] = d
        self._unflushed += v
        self._unflushed_bytes += self._bytes_of(v)
        text = self._unflushed_bytes.decode("utf-8", "replace")
        if not text.endswith("\ufffd") and v != self._SPACE:
            self.text += self._maybe_trim_space(text)
            self._unflushed = ""
            self._unflushed_bytes = b""

    def finalize(self):
        super().finalize()
        self._unflushed_bytes = b""


def detokenizers(tokenizer):
    """A factory of fresh streaming detokenizers for `tokenizer` (mlx-lm's wrapper), one per sample;
    a BPE one gets the remembered byte map (`MemoBPEDetokenizer`), any other is mlx-lm's as it is."""
    proto = tokenizer.detokenizer  # a fresh copy (TokenizerWrapper.detokenizer)
    if type(proto) is BPEStreamingDetokenizer:
        proto.__class__ = MemoBPEDetokenizer
        proto._memo = {}
        proto._flushes = {}  # token id -> its text, for a token that flushes on its own
        proto.reset()

    def make():
        d = copy.copy(proto)  # shallow: the copies share the token map and the memo
        d.reset()
        return d

    return make


def hidden_token_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special added tokens (`<|im_start|>`, `<|endoftext|>`), which a
    random or confused model may sample: they are control tokens, not text (HF's
    `skip_special_tokens`). The thinking and tool-call markers stay: the server parses them."""
    added = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "added_tokens_decoder", None) or {}
    keep = {getattr(tokenizer, k, None) for k in ("think_start", "think_end", "tool_call_start", "tool_call_end")}
    return frozenset(i for i, t in added.items() if getattr(t, "special", False) and t.content not in keep)


def make_output(req: Request, tokenizer) -> RequestOutput:
    """The request's samples so far (or, for a beam search, its finished hypotheses, best first);
    for `output_kind="delta"`, only what is new since the previous output."""
    if req.beam is not None:
        return _beam_output(req, tokenizer)
    if req.pooling is not None:  # values, no tokens (engine/pooling.py)
        delta = req.params.output_kind == "delta"
        return RequestOutput(
            req.request_id,
            req.prompt_text,
            req.prompt_token_ids,
            [],
            req.finished,
            req.num_cached_tokens,
            delta,
            None,
            req.pooled,
        )
    # Once per request per step: attribute reads out of the loop, no property calls (host time).
    params = req.params
    delta = getattr(params, "output_kind", "cumulative") == "delta"
    want_logprobs = params.logprobs is not None
    finished = True  # `req.finished`, from the reasons the loop reads anyway
    outs = []
    for s in req.seqs:
        reason = s.finish_reason
        if reason is None:
            finished = False
        else:
            s.detokenizer.finalize()
        text = s.detokenizer.text
        stop_reason = None  # vLLM's: the stop string that ended the sample, or the stop token id
        if s.stop_text_len is not None:
            # the first occurrence that ended it: of the stops found there, the one StopChecker saw first
            stop_reason = next((x for x in params.stop if text.startswith(x, s.stop_text_len)), None)
            text = text[: s.stop_text_len]
        elif reason is FinishReason.STOP and len(s.token_ids) > s.num_prompt_tokens:
            last = s.token_ids[-1]
            stop_reason = last if last in params.stop_token_ids else None
        if delta:
            d = _delta(req, s, text, stop_reason)
            if d is not None:
                outs.append(d)
            continue
        outs.append(
            CompletionOutput(  # positional: keywords cost a dict per call
                s.sample_index,
                text,
                IdsSnapshot(s.token_ids, s.num_prompt_tokens, len(s.token_ids)),  # copied when read
                reason.value if reason is not None else None,
                list(s.logprobs) if want_logprobs else None,
                None,
                None,
                stop_reason,
            )
        )
    asked = req.prompt_logprobs is not None or getattr(params, "prompt_logprobs", None) is not None
    return RequestOutput(
        req.request_id,
        req.prompt_text,
        req.prompt_token_ids,
        outs,
        finished,
        req.num_cached_tokens,
        delta,
        _prompt_logprobs(req, delta) if asked else None,
    )


def _beam_output(req: Request, tokenizer) -> RequestOutput:
    """A beam search's output: nothing until it ends, then its finished hypotheses, best first."""
    outs = []
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
    asked = req.prompt_logprobs is not None or getattr(req.params, "prompt_logprobs", None) is not None
    return RequestOutput(
        req.request_id,
        req.prompt_text,
        req.prompt_token_ids,
        outs,
        req.finished,
        req.num_cached_tokens,
        False,
        _prompt_logprobs(req, False) if asked else None,
    )


_PLP_SENT: weakref.WeakSet = weakref.WeakSet()  # delta requests whose prompt logprobs went out


def _prompt_logprobs(req: Request, delta: bool) -> list | None:
    """The prompt's logprobs once scored (engine/prompt_logprobs.py): in every cumulative output,
    in one delta. A one-token prompt has nothing to score: [None]."""
    plp = req.prompt_logprobs
    if plp is None:
        if getattr(req.params, "prompt_logprobs", None) is None or req.num_prompt_tokens > 1:
            return None
        plp = req.prompt_logprobs = [None]
    if delta:
        if req in _PLP_SENT:
            return None
        _PLP_SENT.add(req)
    return plp
