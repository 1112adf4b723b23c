"""A sequence (one sample of one request) and a request (the n samples of one prompt).

Sequence invariants:
- `token_ids` is the prompt followed by the generated tokens;
- `tables[g]` is the sequence's block table in KV cache group `g` (core/kv_groups.py); the KV of
  `token_ids[:num_computed_tokens]` is stored in the blocks of `tables[0]` (`block_table`, full
  attention), in order, so `len(block_table) >= ceil(num_computed_tokens / block_size)`; only the
  last block may be partly empty; every other group's table has one entry per entry of
  `block_table`: that group's block, or None for a block the group released (no token still to
  compute reads it); a sequence the block manager has not seen yet holds group 0's table only;
- `ids[g]` holds the block ids of `tables[g]` in order (0 for a released entry); the block manager
  changes each table and its ids together (`BlockManager.check` asserts they agree);
- `block_hashes[i]` names block `i` (full blocks only), so `len(block_hashes) <= num_computed_tokens // block_size`;
- `draft_computed <= num_computed_tokens` (only the draft proposer raises it, within the stored tokens);
- `state`, if set, is a recurrent state after at most `num_computed_tokens` tokens; the runner
  uses it only when it covers exactly those tokens;
- `pending` is set while one sampled token is still being computed on the device (overlapped
  steps, engine.py): it counts in `num_tokens` but is not in `token_ids`, so nothing can read
  its value before the engine appends it; hashing, stop checks and outputs see known tokens only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:  # core imports no MLX: pending tokens and keys are only held here, never computed on
    import mlx.core as mx

    from .block_pool import Block
    from .spec_policy import SpecState


class RequestParams(Protocol):
    """What core reads of a request's sampling parameters (the engine's `SamplingParams` has it):
    core names no engine type, so it states what it needs here."""

    max_tokens: int
    speculative: bool
    has_penalties: bool
    logit_bias: dict | None
    min_p: float
    guided: object
    prompt_logprobs: int | None  # scores every prompt position: such a request takes no prefix hits


class BeamWidth(Protocol):
    beam_width: int


class BeamSearch(Protocol):
    """What core reads of a beam search's state (the engine's `BeamState`): how many beams it keeps."""

    params: BeamWidth


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # the caller aborted the request (or its step failed)


class RequestStatus(enum.Enum):
    """Where a request is in its life. Only the scheduler changes it.

    WAITING: queued, never admitted. RUNNING: admitted, holds blocks. PREEMPTED: queued again
    after its blocks were taken; it recomputes its tokens when readmitted. FINISHED: every
    sample has a finish reason and the request holds no block.
    """

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class BlockIds:
    """A block table's ids in order, kept beside the table as a list and a growing int32 buffer.

    A decode step's block tables are copied from these (`list` while they are short, `buf` rows
    once they are long, whichever is cheaper: model_runner.py) where rebuilding them from the
    `Block` objects would cost Python work for every block of every context each step (at a
    32K-token context, 2,000 blocks a sequence).
    Invariant: `list == buf[:len(list)].tolist()`, `len(list) <= len(buf)`; only the block
    manager changes them (`BlockManager.check` compares them with the table), and every change
    raises `version`, so a reader that copied the ids at one version knows its copy is current
    while the version is the same (the runner's `DecodeTables`).
    """

    __slots__ = ("list", "buf", "version")

    def __init__(self, ids: list[int] | None = None):
        self.list: list[int] = list(ids or ())
        self.buf = np.zeros(max(4, len(self.list)), dtype=np.int32)
        self.buf[: len(self.list)] = self.list
        self.version = 0

    def __len__(self) -> int:
        return len(self.list)

    def append(self, block_id: int) -> None:
        n = len(self.list)
        if n == len(self.buf):  # doubling: appends cost O(1) amortized
            self.buf = np.concatenate([self.buf, np.zeros(n, dtype=np.int32)])
        self.buf[n] = block_id
        self.list.append(block_id)
        self.version += 1

    def extend(self, ids: list[int]) -> None:
        for i in ids:
            self.append(i)

    def __setitem__(self, i: int, block_id: int) -> None:
        self.list[i] = block_id  # (raises IndexError past the end)
        self.buf[i % len(self.list)] = block_id
        self.version += 1

    def truncate(self, n: int) -> None:
        del self.list[n:]
        self.version += 1

    def copy(self) -> BlockIds:
        return BlockIds(self.list)


@dataclass(eq=False, slots=True)
class PendingToken:
    """A token sampled in step `step` whose value is still on the device.

    It is row `row` of that step's token array `tokens`; when the sample drew with a key, the
    advanced key is row `key_row` of `keys`. A later step gathers its input id (and key) from
    these arrays without waiting for them.
    """

    step: int
    tokens: mx.array
    row: int
    keys: mx.array | None = None
    key_row: int = 0


@dataclass(eq=False, slots=True, weakref_slot=True)
class Sequence:
    """One sample: its tokens, its block table, and its own random stream."""

    token_ids: list[int]
    num_prompt_tokens: int
    sample_index: int = 0
    tables: list[list[Block | None]] = field(default_factory=lambda: [[]])  # one per KV cache group
    block_hashes: list[bytes] = field(default_factory=list)
    ids: list[BlockIds] = field(default_factory=lambda: [BlockIds()])  # tables' ids (the runner's copy source)
    num_computed_tokens: int = 0
    rng_key: mx.array | None = None
    finish_reason: FinishReason | None = None
    stop_text_len: int | None = None  # set when a stop string ended the sample
    detokenizer: object = None  # mlx-lm streaming detokenizer: the text so far
    logprobs: list = field(default_factory=list)  # TokenLogprob per output token, when asked for
    cumulative_logprob: float = 0.0  # beam search: log-probability of the output tokens
    pending: PendingToken | None = None  # a sampled token not yet read back (see the module invariants)
    # guided decoding (engine/guided.py): the grammar's state after the known output tokens; it
    # advances where a token is appended, so a dropped pending token never reaches it
    matcher: object = None
    spec: SpecState | None = None  # speculative decoding: K and back-off (core/spec_policy.py)
    # draft-model speculation: the draft's pool holds the KV of token_ids[:draft_computed] in this
    # sequence's blocks; the block manager keeps it <= num_computed_tokens (engine/draft.py)
    draft_computed: int = 0
    cache_salt: bytes = b""  # folded into the first block's hash: blocks are shared only within one salt
    # a LoRA adapter (models/lora.py `Adapter`) the sample runs with, or None (the base model); its
    # `key` is folded into the first block's hash beside the salt; opaque here otherwise
    adapter: object = None
    # a hybrid model's recurrent state after its first `state[0]` tokens, `(num_tokens, per-layer
    # arrays, a speculated run's state after each token or None)` (worker/state_cache.py): written
    # by the model runner, copied by a fork (a reference: the arrays are immutable), dropped with
    # the blocks; opaque here, like `rng_key`
    state: tuple | None = None
    # a sample with penalties: its token counts kept on the device between steps (engine/sampler.py
    # `PenaltyCounts`); opaque here, like `rng_key`
    penalties: object = None
    # a vision model's prompt images (engine/multimodal.py `PromptImages`): their features (held
    # only until the image rows are prefilled), the prompt rows they fill, their positions and
    # content hashes; shared by the request's samples and beams (a fork passes it on); opaque here
    # but for `block_key` (block_manager.py names blocks by it)
    images: object = None

    @property
    def num_tokens(self) -> int:
        """Known tokens plus the pending one, if any."""
        return len(self.token_ids) + (self.pending is not None)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens whose value is known (the pending one is not counted)."""
        return len(self.token_ids) - self.num_prompt_tokens

    def current_key(self) -> mx.array | tuple[mx.array, int] | None:
        """The key the next draw starts from: its own, or a row of the pending step's keys."""
        if self.pending is not None and self.pending.keys is not None:
            return (self.pending.keys, self.pending.key_row)
        return self.rng_key

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def block_table(self) -> list[Block]:
        """Group 0's table (full attention: every block of the sequence)."""
        return self.tables[0]

    @property
    def table_ids(self) -> BlockIds:
        """Group 0's block ids."""
        return self.ids[0]

    @property
    def block_ids(self) -> list[int]:
        return list(self.ids[0].list)

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose KV is not stored yet (1 for a sequence in the decode phase)."""
        return self.num_tokens - self.num_computed_tokens


@dataclass(eq=False, slots=True, weakref_slot=True)
class Request:
    """The n samples of one prompt, scheduled and preempted together.

    Before its prompt is prefilled, the first live sample alone carries it; the other samples
    fork from it (sharing its blocks) when the prompt's KV is stored, which sets
    `prompt_prefilled` (for n = 1 too). Preemption clears it: the request starts over.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: RequestParams
    seqs: list[Sequence]
    prompt_text: str | None = None
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache at the first admission
    status: RequestStatus = RequestStatus.WAITING
    prompt_prefilled: bool = False
    num_preemptions: int = 0
    passed_over: int = 0  # steps in a row its prefill waited behind shorter ones (prefill_order "shortest")
    beam: BeamSearch | None = None  # set for a beam-search request: its beams are `seqs`
    prompt_logprobs: list | None = None  # engine/prompt_logprobs.py: P entries once the prompt is scored
    # a pooled request (engine/pooling.py): its PoolingParams; it samples nothing and ends after its
    # prompt, with `pooled` its values (an embedding, or a score)
    pooling: object = None
    pooled: list[float] | None = None

    @property
    def max_live_seqs(self) -> int:
        """Samples this request may run at once (a beam search grows to its width)."""
        return self.beam.params.beam_width if self.beam is not None else len(self.live_seqs())

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # a loop, not all(): read several times per sample per step
            if s.finish_reason is None:
                return False
        return True

    @property
    def carrier(self) -> Sequence:
        """The sample that computes the shared prompt before the others fork from it."""
        return self.live_seqs()[0]

    def prefill_target(self) -> int:
        """How far the carrier prefills before the samples fork.

        With several live samples the carrier computes only the shared prompt; a lone sample
        computes all its tokens (after a preemption, its generated ones too).
        """
        live = self.live_seqs()
        return self.num_prompt_tokens if len(live) > 1 else live[0].num_tokens

    def live_seqs(self) -> list[Sequence]:
        """The unfinished samples, in order (a new list: callers may change `seqs` meanwhile)."""
        return [s for s in self.seqs if s.finish_reason is None]
