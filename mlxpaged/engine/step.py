"""The step pipeline's record (`LaunchedStep`), who draws from which logits row (`RowPlan`) and
the interface of the features that join the step (`StepLayer`, `Layers`).

`LLMEngine.step` runs the same five stages for every step (docs/architecture.md): schedule,
launch, commit, read back, report. Every feature that needs more than the plain pipeline is a
`StepLayer` the engine registers when it is built, and each stage calls the layers that define
its hook (`Layers`: a layer costs the stages it has nothing to do in nothing; a dormant one,
nothing at all until a request asks for its feature). The layers today: the draft model
(`DraftProposer`: proposals before the forward pass), speculation (`Verifier`: rows it adds to
the draws, the tokens its rows feed, how their draws are accepted), beam search (`BeamLayer`:
rows it takes from the draws and ranks itself), grammar-constrained decoding (`GrammarLayer`:
masks on the drawn rows, which make the draws wait for the step before), prompt logprobs, the
recurrent state's checkpoints and the disk tier. The plain step names none of them: it asks
the hooks. Cache groups are not a layer: the block manager loops over them (core/kv_groups.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mlx.core as mx

    from ..core.scheduler import SampleRow, SchedulerOutput
    from ..core.sequence import Request, Sequence
    from .sampler import GuideMasks, RowKinds, SampleArrays
    from .sampling_params import SamplingParams


@dataclass(eq=False)
class LaunchedStep:
    """A step whose forward pass and draws were handed to the device and not read back yet.

    Row j of `sampled` is drawn by `pairs[j]`; the rows layers added follow (`held[layer]` says
    what each such layer keeps of them). `logits_rows` holds the drawn rows' logits while their
    draws wait for their masks (`RowPlan.masking`); `logits` is the whole step's, kept only while
    a layer that took rows reads them. `tokens` and `logprobs` are the read-back values, set
    before the layers' `read_back` runs. A step that fails is dropped whole, with what it `held`.
    """

    step_id: int
    out: SchedulerOutput
    plan: RowPlan
    pairs: list[tuple[Request, Sequence]]
    sampled: SampleArrays | None
    logits: mx.array | None
    num_prefill: int
    launched_at: float
    logits_rows: mx.array | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    held: dict = field(default_factory=dict)  # what each layer keeps with the step until it is read back

    def requests(self) -> list[Request]:
        return requests_of(self.out)


@dataclass(slots=True)
class RowPlan:
    """Who draws from which logits row of a step: `pairs[j]` (request, sample) draws from row
    `index[j]` with `params[j]` (the rows' kinds: `kinds`); `taken`: (layer, sample rows) for
    each layer that takes rows from the draws (`StepLayer.take_rows`); `masking`: the layers
    that mask some drawn row (`StepLayer.masks_rows`); `batch`: the step's forward pass
    (`SchedulerOutput.batch()`).

    A decode-only step whose decodes are the last such step's samples in the same order (the
    usual step) reuses that step's plan, so the step builds none of it per sample: nothing a plan
    holds changes for a sample (a request's params and beam and a sample's matcher are set when
    they are made). Invariant: `decodes` is the `out.decodes` the plan was made from when that
    step was decode-only (no prefill chunk, no scheduled token beyond one per decode), else None;
    `in_order`: `index` is `0, 1, ..., len(index) - 1`.
    """

    pairs: list[tuple[Request, Sequence]]
    index: list[int]
    taken: list[tuple[StepLayer, list[SampleRow]]]
    masking: list[StepLayer]
    params: list[SamplingParams]
    kinds: RowKinds
    batch: list[tuple[Sequence, int]]
    in_order: bool
    decodes: list[tuple[Request, Sequence]] | None


def requests_of(out: SchedulerOutput) -> list[Request]:
    """The requests a scheduled step computes tokens for, each once."""
    return out.requests()


class StepLayer:
    """A feature that joins the step pipeline at its stages; every hook defaults to nothing.

    Invariant: a layer changes block tables and request state only through the scheduler (the
    one owner), and only at its stage: the step calls `failed` before scheduling, `scheduled`
    after `Scheduler.schedule`; as the step is launched `take_rows` and `masks_rows` (when its
    `RowPlan` is made), `before_forward`, `forward_tokens` and `logits_wanted` (the forward
    pass), `added_rows` and `added_draws` (the draws), `masks` (once the step before is read
    back, when some layer masks), `launched`; `committed` after `update_from_forward` (then
    `reads_at_once` decides whether the step may stay in flight), and `read_back` once the
    step's values are known (layers in registration order).
    """

    def resize(self, num_blocks: int, copies: list[tuple[int, int]]) -> None:
        """The block pool grew or was trimmed: device pools with the same block ids follow."""

    def check_kernels(self) -> None:
        """Build and check the Metal kernels this layer's model needs, before any request."""

    def failed(self) -> dict[Request, Exception]:
        """Requests this layer ends before the next step is scheduled, each with its error."""
        return {}

    def scheduled(self, out: SchedulerOutput) -> None:
        """Right after scheduling, even for an empty step (blocks named by it exist from now on)."""

    def take_rows(self, rows: list[SampleRow]) -> tuple[list[SampleRow], list[SampleRow]]:
        """(the sample rows this layer reads from the step's logits itself, not drawn; the rest)."""
        return [], rows

    def masks_rows(self, pairs: list[tuple[Request, Sequence]]) -> bool:
        """Whether this layer masks the logits of some drawn row (`pairs`): the masks need the
        step before's tokens, so the step's draws wait for its read-back."""
        return False

    def before_forward(self, out: SchedulerOutput) -> None:
        """Device work the step's forward pass needs first (within the step: a failure fails it)."""

    def forward_tokens(self, out: SchedulerOutput) -> dict[int, list[int]]:
        """Tokens the forward pass feeds after an entry's last one, by index in `out.batch()`;
        every position of such an entry gives logits, after the other entries' rows."""
        return {}

    def logits_wanted(self, out: SchedulerOutput) -> list[int]:
        """Entries of `out.batch()` whose every position's logits this layer wants (prompt logprobs)."""
        return []

    def added_rows(self, out: SchedulerOutput, first: int) -> tuple[list[int], object] | None:
        """Logits rows this layer adds to the step's draws (the first is draw `first`), and what
        it keeps with the step (`LaunchedStep.held`); None: none this step."""
        return None

    def added_draws(self, kept, params: list[SamplingParams], keys: list) -> None:
        """Append the params and keys of the draws `added_rows` added (`kept`: what it kept)."""

    def masks(self, pairs: list[tuple[Request, Sequence]], vocab_size: int) -> GuideMasks | None:
        """The masks of the rows of `pairs` this layer constrains (filled on the CPU), or None."""
        return None

    def launched(self, step: LaunchedStep, rows: mx.array) -> list[mx.array]:
        """The step is built: `rows` holds the logits `logits_wanted` asked for, every position of
        each entry in order; returns the arrays to launch with the step (kept in `step.held`)."""
        return []

    def hidden_wanted(self, out: SchedulerOutput) -> list[int]:
        """Entries of `out.batch()` whose last position's final hidden state and logits this layer
        takes (pooled requests: embeddings, scores)."""
        return []

    def pooled(self, step: LaunchedStep, hidden: mx.array, logits: mx.array) -> list[mx.array]:
        """The step is built: `hidden` [k, H] (after the final norm) and `logits` [k, V] of the last
        position of each entry `hidden_wanted` named, in order; returns the arrays to launch with
        the step."""
        return []

    def committed(self, step: LaunchedStep) -> None:
        """The step's tokens are computed (block tables, hashes, forks recorded); it may be in flight."""

    def reads_at_once(self, step: LaunchedStep) -> bool:
        """Whether the step must be read back before the next is scheduled (its values decide it)."""
        return False

    def read_back(self, step: LaunchedStep) -> list[Request]:
        """The step's values are known; returns the requests that progressed through this layer."""
        return []


HOOKS = (
    "resize",
    "check_kernels",
    "failed",
    "scheduled",
    "take_rows",
    "masks_rows",
    "before_forward",
    "forward_tokens",
    "logits_wanted",
    "added_rows",
    "added_draws",
    "masks",
    "launched",
    "hidden_wanted",
    "pooled",
    "committed",
    "reads_at_once",
    "read_back",
)


class Layers:
    """The engine's step layers in registration order, and for each hook of `StepLayer` the list
    of those whose class defines it (`layers.scheduled`, `layers.read_back`, ...): a stage loops
    over that list only, so the plain decode step calls no layer that has nothing to do there.
    A layer registered `dormant` (a feature no request has asked for yet: beams, prompt logprobs)
    keeps its place in the order but joins no stage until `wake`.

    Invariant: for every name h in `HOOKS`, `getattr(self, h)` is the layers of `self.all` that
    are not dormant, in order, whose class overrides `StepLayer.h`.
    """

    def __init__(self, layers=()):
        self.all: list[StepLayer] = []
        self.dormant: list[StepLayer] = []
        self._index()
        for layer in layers:
            self.append(layer)

    def append(self, layer: StepLayer, *, dormant: bool = False) -> None:
        if not isinstance(layer, StepLayer):
            raise TypeError(f"a step layer must be a StepLayer, not {type(layer).__name__}")
        self.all.append(layer)
        if dormant:
            self.dormant.append(layer)
        self._index()

    def wake(self, layer: StepLayer) -> None:
        """A dormant layer joins the stages from the next one on (its feature's first request,
        queued: no step launched before it holds anything of that request)."""
        if any(x is layer for x in self.dormant):
            self.dormant = [x for x in self.dormant if x is not layer]
            self._index()

    def __iter__(self):
        return iter(self.all)

    def __len__(self) -> int:
        return len(self.all)

    def _index(self) -> None:
        for name in HOOKS:
            base = getattr(StepLayer, name)
            setattr(
                self,
                name,
                [x for x in self.all if getattr(type(x), name) is not base and not any(x is d for d in self.dormant)],
            )
