"""Speculative decoding inside the paged batch: n-gram proposals and the acceptance rule.

A speculating sequence contributes one varlen row to the step's forward pass: its last token
(whose KV is not stored yet) followed by K proposed tokens d_1..d_K. The pass returns the logits
L_0..L_K of all K+1 positions (`ModelRunner.forward(..., spec_tokens=...)`), and the sampler draws
a target token t_i from each L_i with the key that a non-speculative decode of that output
position would use: key_0 is the sequence's key, key_{i+1} = split(key_i)[0] (`key_chain`), and
`sample_arrays` draws t_i with split(key_i)[1], exactly as it draws one token per step.

The acceptance rule (`accepted_length`, `verified_tokens`): accept d_1..d_a while d_{i+1} == t_i;
the step appends d_1..d_a and t_a, the target's own token at the first rejected position. Why this is exact:
- greedy: t_i is the argmax at position i given the accepted prefix, so the tokens are those of
  plain decoding, token for token;
- sampled: t_i = argmax(filtered tempered logits + Gumbel noise) is a draw from p_i (top-k and
  top-p applied). Against the point-mass proposal d, "accept iff t_i == d" accepts with
  probability p_i(d), and given a rejection t_i is distributed as p_i with d removed and
  renormalized (the Gumbel-max argmax conditioned on not being d): this is Leviathan et al.'s
  speculative sampling for q = delta_d, realized with the noise plain decoding would draw.
  Hence seeded requests are reproducible, and with the same logits they give the same tokens
  as without speculation, whatever else shares the batch.

Proposals are a deterministic function of the sequence's tokens, so every tensor-parallel
rank makes the same ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from .step import StepLayer

if TYPE_CHECKING:
    from ..core.scheduler import Scheduler, SchedulerOutput, SpecDecode
    from ..core.sequence import Request
    from .step import LaunchedStep


class NgramProposer:
    """Prompt lookup (vLLM's `ngram` method): find the last `n` tokens earlier in the sequence
    (prompt and output), for n from `prompt_lookup_max` down to `prompt_lookup_min`, and propose
    the tokens that followed that occurrence (the most recent one)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def __call__(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` proposed tokens to follow `token_ids` (empty when no n-gram recurs)."""
        num = len(token_ids)
        if k < 1 or num <= self.min_n:
            return []
        toks = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            suffix = toks[num - n :]
            # Windows starting at 0..num-n-1: every earlier occurrence, never the suffix itself.
            windows = np.lib.stride_tricks.sliding_window_view(toks[: num - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return toks[start : start + k].tolist()
        return []


def accepted_length(proposal: list[int], targets: list[int]) -> int:
    """How many proposals the target accepts: the longest prefix with proposal[i] == targets[i].

    `targets[i]` is the token drawn from the logits of the position before proposal[i]
    (len(targets) == len(proposal) + 1); the step appends targets[: a + 1].
    """
    a = 0
    while a < len(proposal) and proposal[a] == targets[a]:
        a += 1
    return a


def verified_tokens(proposal: list[int], targets: list[int]) -> list[int]:
    """The tokens a verified row appends: the accepted proposals, then the target's token at the
    first rejected position (or after the last proposal)."""
    a = accepted_length(proposal, targets)
    return proposal[:a] + [targets[a]]


_split_rows = mx.vmap(lambda k: mx.random.split(k))


def key_chain(keys: mx.array, length: int) -> list[mx.array]:
    """`[key_0, ..., key_{length-1}]` for rows of `keys [S, 2]`: key_{i+1} = split(key_i)[0], the
    key that the draw of position i leaves behind (sampler.py's stream, advanced once per token)."""
    chain = [keys]
    for _ in range(length - 1):
        chain.append(_split_rows(chain[-1])[:, 0])
    return chain


# -- the layer: speculating rows in the step's draws, and their verification -----------------------
def spec_rows(out: SchedulerOutput, first: int) -> tuple[list[int], list[tuple[SpecDecode, int]]]:
    """The logits rows of each speculating row's K+1 positions (they follow the other rows: the
    runner's `logits_indices` gives every position of such a row), and each speculating row with
    the index of its first draw (the step's draws before them: `first`)."""
    row = len(out.decodes) + len(out.prefills)
    index, rows = [], []
    for d in out.spec:
        rows.append((d, first + len(index)))
        index.extend(range(row, row + 1 + len(d.proposal)))
        row += 1 + len(d.proposal)
    return index, rows


def spec_draws(spec: list[tuple[SpecDecode, int]], params: list, keys: list) -> None:
    """Append the params and keys of the speculating rows' draws: position i of a row draws with
    key_i of its sequence's chain (`key_chain`), as plain decoding would."""
    sampled = [d for d, _ in spec if not d.request.params.greedy]
    chain_of = {}
    if sampled:
        chain = key_chain(mx.stack([d.seq.rng_key for d in sampled]), 1 + max(len(d.proposal) for d in sampled))
        chain_of = {id(d): j for j, d in enumerate(sampled)}
    for d, _ in spec:
        for i in range(1 + len(d.proposal)):
            params.append(d.request.params)
            keys.append((chain[i], chain_of[id(d)]) if id(d) in chain_of else None)


class Verifier(StepLayer):
    """Speculating rows in the step: the proposals their forward pass feeds (`forward_tokens`),
    their K+1 draws after the step's other draws (`added_rows`, `added_draws`), and after the
    read-back the proposals accepted against those draws; the scheduler appends the accepted
    tokens and rolls back the rest (`update_from_spec`)."""

    def __init__(self, scheduler: Scheduler, stats, check_stop):
        self.scheduler, self.stats, self.check_stop = scheduler, stats, check_stop

    def forward_tokens(self, out: SchedulerOutput) -> dict[int, list[int]]:
        return out.spec_tokens() if out.spec else {}

    def added_rows(self, out: SchedulerOutput, first: int):
        return spec_rows(out, first) if out.spec else None

    def added_draws(self, kept, params: list, keys: list) -> None:
        spec_draws(kept, params, keys)

    def read_back(self, step: LaunchedStep) -> list[Request]:
        spec = step.held.pop(self, None)
        if not spec:
            return []
        s, toks, logprobs = step.sampled, step.tokens, step.logprobs
        key_row = {i: j for j, i in enumerate(s.sampled)}
        progressed = []
        for d, r0 in spec:
            k = len(d.proposal)
            tokens = verified_tokens(d.proposal, toks[r0 : r0 + k + 1])
            a = len(tokens) - 1
            last = r0 + a  # the draw of the last appended token left the sequence's next key
            key = s.keys[key_row[last]] if last in key_row else None
            n = self.scheduler.update_from_spec(
                d.request, d.seq, d, tokens, logprobs[r0 : last + 1], key, self.check_stop
            )
            st = self.stats
            st.spec_proposed_tokens += k
            st.spec_accepted_tokens += a
            st.spec_verifications += 1
            st.generation_tokens += n
            st.decode_tokens += n
            if n:
                progressed.append(d.request)
        return progressed
