"""Grammar-constrained decoding in the step (`GrammarLayer`); the grammars themselves are guided.py's.

A sample with a matcher draws under its grammar's mask. A row's mask needs the value of its
previous token, so a step with such rows launches its forward pass first; the CPU advances the
matchers and fills the masks after the step before is read back, while the device runs the
forward pass, and the draws of all rows (one graph) follow (`StepLayer.masks_rows`, `masks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .guided import GrammarCompiler, GrammarTooSlow, Matcher, fill_masks, mask_budget_spent, mask_words
from .sampler import GuideMasks
from .step import StepLayer

if TYPE_CHECKING:
    from ..core.sequence import Request, Sequence
    from .sampling_params import SamplingParams


class GrammarLayer(StepLayer):
    """The engine's grammars (compiled by the first guided request) and the masks of its
    constrained rows. Invariant: `too_slow` holds the requests whose masks spent their time
    budget (guided.py) since the last step, failed before the next (`failed`); it is None under
    tensor parallelism, where each rank's own timing would make the ranks' decisions differ."""

    def __init__(self, make_compiler: Callable[[], GrammarCompiler], judge_time: bool = True):
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self.too_slow: dict[Request, str] | None = {} if judge_time else None

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = self._make_compiler()
        return self._compiler

    def matcher(self, params: SamplingParams) -> Callable[[], Matcher] | None:
        """A maker of one matcher per sample of a request with `params.guided`, None without;
        `ValueError` naming what the grammar backend cannot enforce."""
        if params.guided is None:
            return None
        return self.compiler.compile(params.guided).matcher

    def failed(self) -> dict[Request, Exception]:
        if not self.too_slow:
            return {}
        slow, self.too_slow = self.too_slow, {}
        return {r: GrammarTooSlow(why) for r, why in slow.items()}

    def masks_rows(self, pairs: list[tuple[Request, Sequence]]) -> bool:
        return any(s.matcher is not None for _, s in pairs)

    def masks(self, pairs: list[tuple[Request, Sequence]], vocab_size: int) -> GuideMasks | None:
        """Fill the grammar masks of the guided rows on the CPU; None when there are none.

        A matcher is brought to its sample's known output tokens first (`sync`: after a
        preemption or anything else that changed them it rolls back or replays); a sample
        that finished since the step was scheduled draws unmasked (its row is dropped).
        """
        rows = [j for j, (_, s) in enumerate(pairs) if s.matcher is not None]
        if not rows:
            return None
        bits = np.full((len(rows), mask_words(vocab_size)), -1, dtype=np.int32)
        matchers = []
        for j in rows:
            seq = pairs[j][1]
            assert seq.pending is None, "a guided row's previous token is read back before its mask"
            m = seq.matcher
            # the usual case, checked without copying the tokens: the matcher took every output token
            n = seq.num_output_tokens
            synced = (
                len(m.consumed) == n and (n == 0 or m.consumed[-1] == seq.token_ids[-1]) or m.sync(seq.output_token_ids)
            )
            matchers.append(None if seq.finished or not synced else m)
        fill_masks(matchers, bits)
        if self.too_slow is not None:
            for req in dict.fromkeys(pairs[j][0] for j in rows):
                why = mask_budget_spent(s.matcher for s in req.seqs)
                if why:
                    self.too_slow[req] = why
        return GuideMasks(rows, bits)
