"""Beam search inside the engine, on shared blocks (the paper's §4.4).

A beam-search request holds up to W live sequences (beams) that decode in the same batch as
everything else. After each step in which its beams computed their next logits, the request
ranks the top 2W continuations across its live beams by cumulative log-probability:
- walking them best first, a candidate that ends the sequence (EOS) joins the finished
  hypotheses if it ranks among the first W; any other candidate becomes a live beam, until
  there are W;
- a beam kept k times forks k - 1 times (its blocks are shared; copy-on-write copies the
  partly filled last block when they diverge) and a beam kept 0 times is freed at once.

Stopping and scoring, as Hugging Face transformers' `early_stopping=True`: the request ends
when W hypotheses are finished, or when the beams reach `max_tokens`, in which case the live
beams become hypotheses too. A hypothesis scores `cumulative_logprob / L ** length_penalty`,
L its generated tokens not counting a final EOS (at least 1); only the W best are kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx


@dataclass
class BeamSearchParams:
    """vLLM's names: beam_width beams, max_tokens generated at most, EOS optional, length penalty."""

    beam_width: int
    max_tokens: int = 16
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self):
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated ids, a final EOS included
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop" (EOS) or "length"


def beam_score(cumulative_logprob: float, num_tokens: int, ends_with_eos: bool, length_penalty: float) -> float:
    length = max(1, num_tokens - (1 if ends_with_eos else 0))
    return cumulative_logprob / length**length_penalty


@dataclass
class BeamState:
    """The finished hypotheses of one request, best first, at most `params.beam_width`."""

    params: BeamSearchParams
    finished: list[Hypothesis] = field(default_factory=list)

    def add(self, hyp: Hypothesis) -> None:
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
        del self.finished[self.params.beam_width :]

    @property
    def done(self) -> bool:
        return len(self.finished) >= self.params.beam_width


@dataclass
class Candidate:
    beam: int  # index of the parent among the live beams, in their order
    token: int
    cumulative_logprob: float


def top_candidates(logits: mx.array, cumulative: list[float], k: int) -> list[Candidate]:
    """The `k` best (beam, token) continuations of `logits [num_beams, V]` by cumulative
    log-probability, best first; ties go to the lower beam, then the lower token id."""
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True) + mx.array(cumulative, dtype=mx.float32)[:, None]
    flat = lp.reshape(-1)
    k = min(k, flat.size)
    idx = mx.argpartition(-flat, kth=k - 1)[:k]
    vals = flat[idx]
    mx.eval(idx, vals)
    vocab = logits.shape[-1]
    ranked = sorted(zip(vals.tolist(), idx.tolist()), key=lambda t: (-t[0], t[1]))
    return [Candidate(i // vocab, i % vocab, v) for v, i in ranked]


def select(candidates: list[Candidate], width: int, is_eos) -> tuple[list[Candidate], list[Candidate]]:
    """(the next live beams, the candidates that finish) from ranked candidates."""
    live, ended = [], []
    for rank, c in enumerate(candidates):
        if is_eos(c.token):
            if rank < width:
                ended.append(c)
        elif len(live) < width:
            live.append(c)
    return live, ended
