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
"""

from __future__ import annotations

from dataclasses import dataclass

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
