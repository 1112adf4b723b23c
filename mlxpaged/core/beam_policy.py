"""The scheduler's side of beam search: carrying out what a beam step decided on the block tables.

The engine ranks the beams' continuations (`engine/beam_search.py`, policy only); this owns what
that changes in core: a beam continued k times forks k - 1 times (sharing every block, copy-on-write
later), a beam no candidate continues is freed at once, and beams that recompute after a preemption
stop one token short so they decode in the same step as the others. The scheduler holds one
`BeamPolicy` (`Scheduler.beams`), as it holds one `SpecPolicy`; nothing else in core names beams.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from .sequence import FinishReason, Request, Sequence

if TYPE_CHECKING:
    from .scheduler import Scheduler


class NextBeam(Protocol):
    beam: int  # the old live beam it continues
    token: int
    cumulative_logprob: float


class BeamStep(Protocol):
    """What one beam-search step decided (the engine's `beam_search.BeamStep`): the live beams
    after it, best first, and whether the search ends with it."""

    next_beams: list[NextBeam]
    done: bool


class BeamPolicy:
    """Forks, drops and reorders a beam search's sequences; counts both (`num_forks`, `num_frees`).

    Invariant: a beam search's live `seqs` are its beams, best first; each holds its own block
    table (shared blocks counted by their ref_cnt), and the scheduler's count of running samples
    follows every fork and drop."""

    def __init__(self, scheduler: Scheduler):
        self.sched = scheduler
        self.num_forks = 0
        self.num_frees = 0

    @staticmethod
    def recompute_short(req: Request, live: list[Sequence]) -> int:
        """Tokens a recomputing sample's prefill stops short of its end: beams rank their
        continuations together, so recomputing ones stop one token short and then decode in the
        same step as the others."""
        return 1 if req.beam is not None and len(live) > 1 else 0

    def apply(self, req: Request, live: list[Sequence], step: BeamStep) -> None:
        """Carry out a beam step: a beam continued k times forks k - 1 times (before any parent
        takes its new token), a beam continued 0 times is freed, the rest take their token; the
        request's `seqs` become the new beams, best first."""
        sched = self.sched
        kept: list[Sequence] = []
        for c in step.next_beams:
            parent = live[c.beam]
            if parent in kept:
                child = Sequence(list(parent.token_ids), parent.num_prompt_tokens)
                sched.bm.fork(parent, child)
                req.seqs.append(child)
                sched.seqs_started(1)
                self.num_forks += 1
                kept.append(child)
            else:
                kept.append(parent)
        for s in live:
            if s not in kept:
                sched.bm.free(s)
                req.seqs.remove(s)
                sched.seqs_started(-1)
                self.num_frees += 1
        for s, c in zip(kept, step.next_beams):
            s.token_ids.append(c.token)
            s.cumulative_logprob = c.cumulative_logprob
        req.seqs = kept
        if step.done:
            for s in kept:
                s.finish_reason = FinishReason.LENGTH
                sched.finish_sequence(req, s)
            if not kept:
                sched.end_request(req)
