"""When a sequence speculates, and how far: K adapted from its own recent acceptance.

A speculating step costs more than a plain one in two ways: its row has K extra tokens, and it
must be read back before the next step is scheduled (the next proposals depend on its tokens),
which gives up the overlap of steps. So a sequence whose proposals gain nothing backs off:
- after a verification, K becomes (accepted + 1), or grows by one when all K were accepted,
  within [1, num_speculative_tokens];
- a miss (no n-gram match, or nothing accepted) halves K; from the third consecutive miss on,
  it also skips speculation for the next 1, 2, 4, 8, 8, ... steps. A skipping sequence whose
  last miss found no n-gram keeps looking one up in its known tokens (cheap, and the step stays
  overlapped): a match ends the skip, since a quote or a loop has likely begun; during skipped steps the sequence
  decodes as usual and its steps overlap. Any accepted token resets the back-off.
Everything here is a function of the sequence's own tokens: the same on every rank.

`SpecPolicy` is the scheduler's side: a speculating decode is scheduled as 1 + K tokens of its
sequence (`SpecDecode`), and a step that speculates, or after which a sequence may, is read back
before the next is scheduled (`needs_read_back`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .scheduler import SchedulerOutput
    from .sequence import Request, Sequence

MAX_SKIP = 8
FREE_MISSES = 2  # misses before any step is skipped: a loop or a quote may start any time


@dataclass
class SpecState:
    """One sequence's speculation state (`Sequence.spec`)."""

    k: int  # proposals to ask for next time
    skip: int = 0  # steps left without speculating
    misses: int = 0  # consecutive proposals that gained nothing
    unmatched: bool = False  # the last miss found no n-gram (rather than a rejected proposal)

    def miss(self, unmatched: bool = False) -> None:
        self.misses += 1
        self.unmatched = unmatched
        self.skip = 0 if self.misses <= FREE_MISSES else min(MAX_SKIP, 1 << (self.misses - FREE_MISSES - 1))
        self.k = max(1, self.k // 2)

    def verified(self, num_proposed: int, num_accepted: int, k_max: int) -> None:
        if num_accepted == 0:
            self.miss()
            return
        self.misses = 0
        if num_accepted == num_proposed:
            self.k = min(k_max, max(self.k, num_proposed) + 1)
        else:
            self.k = min(k_max, num_accepted + 1)


@dataclass
class SpecDecode:
    """A speculating decode: `seq`'s last token plus `proposal`, verified in one varlen row."""

    request: Request
    seq: Sequence
    proposal: list[int]


class SpecPolicy:
    """The scheduler's side of speculative decoding: which decodes speculate this step and how
    far, and whether the step must be read back before the next is scheduled. A speculating
    decode is scheduled as 1 + K tokens of its sequence (`SpecDecode`, counted by
    `SchedulerOutput.num_decode_tokens`); the scheduler stays the one owner of its slots.
    """

    def __init__(self, config, block_manager, proposer: Callable[[list[int], int], list[int]] | None):
        self.config, self.bm = config, block_manager
        self.proposer = proposer  # (token_ids, k) -> up to k proposed tokens; None: no speculation

    def active(self, num_running_seqs: int) -> bool:
        """Speculation runs while the batch is small enough for the step to be bandwidth-bound."""
        return self.proposer is not None and num_running_seqs <= self.config.speculative.max_batch_size

    @staticmethod
    def speculates(req: Request, seq: Sequence) -> bool:
        """Beam searches and requests that opt out do not speculate; nor do rows whose logits are
        processed with their own history or grammar (penalties, logit_bias, min_p, guided): their
        K+1 positions would each need the proposals before them as generated tokens."""
        p = req.params
        return (
            req.beam is None
            and p.speculative
            and not p.has_penalties
            and not p.logit_bias
            and p.min_p == 0
            and p.guided is None
        )

    def schedule(self, req: Request, seq: Sequence, out: SchedulerOutput) -> bool:
        """Schedule `seq`'s decode as a speculating row if it has proposals and the pool has room
        for them (speculation never preempts); False leaves it to the plain decode."""
        if not self.speculates(req, seq):
            return False
        if seq.spec is None:
            seq.spec = SpecState(self.config.speculative.num_speculative_tokens)
        st = seq.spec
        if st.skip:
            st.skip -= 1
            if st.unmatched and self.proposer(seq.token_ids, 1):
                st.skip = 0  # a match among the known tokens: read this step back and speculate next
            return False
        if seq.pending is not None:
            return False  # its value is on the device: nothing to look up yet (the next step will be read back)
        # One slot past `blocks_for_request` at most: the step yields up to k + 1 tokens.
        budget = self.config.scheduler.max_num_batched_tokens - out.num_decode_tokens - 1
        k = min(st.k, req.params.max_tokens - seq.num_output_tokens - 1, budget)
        proposal = self.proposer(seq.token_ids, k) if k > 0 else []
        if not proposal:
            if k > 0:
                st.miss(unmatched=True)
            return False
        copies = self.bm.allocate_slots(seq, 1 + len(proposal))
        if copies is None:
            return False
        out.add_copies(seq, copies)
        out.spec.append(SpecDecode(req, seq, proposal))
        return True

    def needs_read_back(self, out: SchedulerOutput) -> bool:
        """Whether the step must be read back before the next is scheduled: it has speculating
        rows, or a sequence it computes may speculate next step (its proposals need this step's tokens)."""
        if out.spec:
            return True
        reqs = [r for r, _ in out.decodes] + [c.request for c in out.prefills if c.sample]
        return any(
            self.speculates(r, s) and (s.spec is None or s.spec.skip == 0)
            for r in dict.fromkeys(reqs)
            for s in r.live_seqs()
        )
