"""Requests sized against the KV pool, in one place: the blocks a request may take at most
(`request_blocks`), the engine's refusal of one that could never finish (`check_fits`) and the
largest `max_tokens` that fits (`fitting_max_tokens`, the server's default). Imports nothing
heavy: `serve --help` reaches it through server/limits.py."""

from __future__ import annotations

from ..core.block_manager import blocks_for_request
from ..errors import MlxPagedError
from ..utils import cdiv


def request_blocks(num_prompt: int, n: int, max_tokens: int, block_size: int) -> int:
    """Blocks a request of `n` samples of up to `max_tokens` tokens after a `num_prompt`-token
    prompt may hold at once (its prompt's blocks shared)."""
    return blocks_for_request(num_prompt, n, max_tokens, block_size)


def check_fits(num_prompt: int, n: int, max_tokens: int, block_size: int, max_blocks: int, pool_flag: str) -> None:
    """Refuse a request that could not finish even with the whole pool (`max_blocks`) to itself;
    the error names what to change (`pool_flag`: which flag makes the pool larger)."""
    need = request_blocks(num_prompt, n, max_tokens, block_size)
    if need > max_blocks:
        what = "prompt" if cdiv(num_prompt, block_size) > max_blocks else "request"
        raise MlxPagedError(
            f"{what} cannot fit in the KV pool: {num_prompt} prompt tokens, n={n}, "
            f"max_tokens={max_tokens} need up to {need} blocks of {block_size} "
            f"but the pool has {max_blocks}; {pool_flag} or lower -n/--max-tokens"
        )


def fitting_max_tokens(num_prompt: int, n: int, limit: int, block_size: int, max_blocks: int) -> int:
    """The largest max_tokens up to `limit` whose request fits the pool (at least 1: a prompt
    that cannot fit at all is refused by `check_fits`, naming the pool)."""
    hi = max(1, limit)
    if request_blocks(num_prompt, n, hi, block_size) <= max_blocks:
        return hi
    lo = 1  # by bisection (blocks grow with max_tokens)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if request_blocks(num_prompt, n, mid, block_size) <= max_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
