"""KV-cache memory waste of reservation schemes on a (prompt, answer) length trace.

Pure integer arithmetic on token counts (no MLX, no numpy), so the engine's bench command
and the scripts in ``scripts/`` can share it. It reproduces the PagedAttention paper's
argument (Kwon et al., SOSP 2023, sections 2.3 and 3): a server that gives each request
one contiguous KV region must reserve it up front for the request's final length, which it
does not know, while a paged cache takes one fixed-size block at a time.

The measure: time-averaged over a request's life
--------------------------------------------------
A request with a prompt of ``p`` tokens and an answer of ``a`` tokens is in flight for
``a`` steps: the prefill step samples answer token 1 and decode step ``t`` samples token
``t``. At the end of step ``t`` (t = 1 .. a) the sequence is ``p + t`` tokens long and
each of those tokens has a KV slot (the one just sampled has its slot taken so that the
next step can write it) -- these are the *real* tokens. The *reserved* slots at that
moment depend on the scheme (below). Both are summed over every step of every request
and then divided:

    real share     = sum over requests and steps of real / same sum of reserved
    slots/request  = sum of reserved / number of request-steps
    real/request   = sum of real / number of request-steps

Summing over steps weights each request by how long it runs, which is what a snapshot
of a busy server sees: by Little's law a request with twice the steps is twice as likely
to be among those in flight. So ``slots/request`` is the mean reservation of a running
request, and ``capacity / slots/request`` is how many run at once when KV memory of
``capacity`` slots is the only limit (a fluid average; for the contiguous schemes it
ignores the external fragmentation between regions, so it is an upper bound there: the
``max`` scheme fits 7 whole requests in 15,700 slots, not 7.7). A request with
``a == 0`` is never in flight and counts for nothing.

This is why the oracle scheme is not 100 %: it reserves ``p + a`` from the first step
while only ``p + t`` slots hold something, so on average about half the answer's slots
are empty. With this definition the seed design doc's figures are reproduced on our
traces to within 0.4 points, except Alpaca pow2 (ours 41.0 %, the seed's 41.9 %).
Definitions that fit worse, tried on the same traces (ShareGPT / Alpaca oracle):
counting ``p + t`` for t = 0 .. a-1 (the new token not yet holding a slot) gives
62.9 / 56.0 %; the plain mean of each request's own ratio, not weighted by its length,
gives 74.1 / 68.8 %; and ``next_pow2(p + a)`` for pow2 gives 43.7 / 39.3 % where the
seed has 47.7 / 41.9 %.

The schemes (reserved slots at every step of a request)
-------------------------------------------------------
``max``      ``window`` -- the model's whole context window (2,048), whatever the
             request (the paper's "Orca (Max)").
``pow2``     ``p + next_pow2(a)`` -- the prompt is known on arrival, the answer's slots
             are reserved in power-of-two buckets, so at most twice the answer (the
             paper's "Orca (Pow2)", which over-reserves by up to 2x). Not capped at the
             window: capping moves ShareGPT from 47.7 % to 48.0 % and the seed's 47.7 %
             is the uncapped figure.
``pow2_total`` ``next_pow2(p + a)`` -- the power-of-two bucket of the whole sequence.
             Not in the seed's table; printed for comparison.
``oracle``   ``p + a`` -- the exact final length, known in advance (the paper's
             "Orca (Oracle)").
``paged``    ``ceil((p + t) / block_size) * block_size`` -- whole blocks for the tokens
             present now (vLLM); only the last block is partly empty.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

WINDOW = 2048
"""The model's context window, as in the seed design doc (vLLM's benchmark filter caps
prompt + answer at 2,048 too)."""

CAPACITY_SLOTS = 15_700
"""The seed's "15.7K slots" of KV cache. Read as 15,700 because it is the only whole
number of slots it can mean (15.7 x 1,024 = 16,076.8)."""

BLOCK_SIZE = 16

SHARED_PREFIX = 85
"""Tokens of a prompt prefix shared between requests (a system prompt) in the seed."""

SEED_REAL_SHARE = {
    # Real tokens as a share of reserved slots, in %, from the seed design doc.
    "sharegpt": {"max": 17.6, "pow2": 47.7, "oracle": 63.0, "paged": 98.0},
    "alpaca": {"max": 3.4, "pow2": 41.9, "oracle": 57.0, "paged": 90.4},
}

Pair = Sequence[int]  # (prompt tokens, answer tokens)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def reserve_max(p: int, a: int, window: int = WINDOW) -> int:
    """Slots a ``max`` scheme reserves: the whole window."""
    if p + a > window:
        raise ValueError(f"request of {p}+{a} tokens does not fit a {window}-token window")
    return window


def reserve_pow2(p: int, a: int, window: int = WINDOW) -> int:
    """Slots a ``pow2`` scheme reserves: the prompt plus the answer's power-of-two bucket."""
    return p + next_pow2(a)


def reserve_pow2_total(p: int, a: int, window: int = WINDOW) -> int:
    """Slots a ``pow2_total`` scheme reserves: the whole sequence's power-of-two bucket."""
    return next_pow2(p + a)


def reserve_oracle(p: int, a: int, window: int = WINDOW) -> int:
    """Slots an ``oracle`` scheme reserves: the exact final length."""
    return p + a


CONTIGUOUS: dict[str, Callable[[int, int, int], int]] = {
    "max": reserve_max,
    "pow2": reserve_pow2,
    "pow2_total": reserve_pow2_total,
    "oracle": reserve_oracle,
}
"""Contiguous schemes by name: (prompt, answer, window) -> slots reserved for the request's
whole life."""


def real_token_steps(p: int, a: int) -> int:
    """Sum over steps t = 1..a of the real tokens p + t."""
    return a * p + a * (a + 1) // 2


def _ceil_sum(n: int, block_size: int) -> int:
    """Sum of ceil(k / block_size) for k = 1..n.

    Writing n = q * block_size + r: each of 1..q appears block_size times, then r more
    terms equal q + 1.
    """
    q, r = divmod(n, block_size)
    return block_size * q * (q + 1) // 2 + r * (q + 1)


def paged_block_steps(p: int, a: int, block_size: int) -> int:
    """Sum over steps t = 1..a of the blocks held, ceil((p + t) / block_size)."""
    return _ceil_sum(p + a, block_size) - _ceil_sum(p, block_size)


@dataclass(frozen=True)
class WasteRow:
    """One scheme on one trace (all averages are over request-steps; see module doc)."""

    scheme: str
    real_share: float  # real tokens / reserved slots, 0..1
    real_per_request: float  # real tokens held by a running request, on average
    slots_per_request: float  # slots reserved by a running request, on average
    requests_in_flight: float  # capacity / slots_per_request
    blocks_per_request: float | None = None  # paged only: blocks held, on average

    def as_dict(self) -> dict:
        return asdict(self)


def _steps_and_real(pairs: Iterable[Pair]) -> tuple[int, int]:
    steps = real = 0
    for p, a in pairs:
        steps += a
        real += real_token_steps(p, a)
    return steps, real


def contiguous_row(
    pairs: Sequence[Pair], scheme: str, window: int = WINDOW, capacity: int = CAPACITY_SLOTS
) -> WasteRow:
    """Waste of a contiguous scheme (a name in ``CONTIGUOUS``) on a trace."""
    reserve = CONTIGUOUS[scheme]
    steps, real = _steps_and_real(pairs)
    if steps == 0:
        raise ValueError("trace has no answer tokens: nothing is ever in flight")
    reserved = sum(a * reserve(p, a, window) for p, a in pairs)
    per_req = reserved / steps
    return WasteRow(scheme, real / reserved, real / steps, per_req, capacity / per_req)


def paged_row(pairs: Sequence[Pair], block_size: int = BLOCK_SIZE, capacity: int = CAPACITY_SLOTS) -> WasteRow:
    """Waste of a paged cache with blocks of ``block_size`` tokens on a trace."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    steps, real = _steps_and_real(pairs)
    if steps == 0:
        raise ValueError("trace has no answer tokens: nothing is ever in flight")
    blocks = sum(paged_block_steps(p, a, block_size) for p, a in pairs)
    reserved = blocks * block_size
    per_req = reserved / steps
    return WasteRow(
        f"paged-{block_size}",
        real / reserved,
        real / steps,
        per_req,
        capacity / per_req,
        blocks / steps,
    )


def waste_table(
    pairs: Sequence[Pair],
    schemes: Sequence[str] = ("max", "pow2", "oracle"),
    block_size: int = BLOCK_SIZE,
    window: int = WINDOW,
    capacity: int = CAPACITY_SLOTS,
) -> list[WasteRow]:
    """The contiguous ``schemes`` then paged blocks of ``block_size``, on one trace."""
    rows = [contiguous_row(pairs, s, window, capacity) for s in schemes]
    rows.append(paged_row(pairs, block_size, capacity))
    return rows


def prefix_reuse(shared: int, block_size: int, prompt_len: int | None = None) -> int:
    """Tokens of a ``shared``-token prefix that a block-level prefix cache can reuse.

    Only full blocks are cached, and the block holding the prompt's last token is never
    reused, because prefill must run that token to get the first answer token's logits.
    ``prompt_len=None`` means the prompt goes on past the shared prefix, so the whole
    prefix may be reused; a prompt that *is* the prefix (``prompt_len == shared``) can
    reuse at most ``shared - 1`` tokens.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    usable = shared if prompt_len is None or prompt_len > shared else prompt_len - 1
    return max(usable, 0) // block_size * block_size


def load_pairs(path: str | Path) -> list[tuple[int, int]]:
    """The (prompt, answer) pairs of a trace written by ``scripts/lengths.py``."""
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    return [(int(p), int(a)) for p, a in doc["pairs"]]
