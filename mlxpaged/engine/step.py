"""The step pipeline's record (`LaunchedStep`) and the interface of the features that join it
(`StepLayer`).

`LLMEngine.step` runs the same five stages for every step (docs/architecture.md): schedule,
launch, commit, read back, report. A feature that needs more than the plain pipeline (the disk
tier, the draft model, speculation, beam search) is a `StepLayer` the engine registers when it is
built, and the step calls every layer at each stage; the step itself names no feature. A new
feature (cache groups for windowed layers, state slots for recurrent ones) is one more layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mlx.core as mx

    from ..core.scheduler import SampleRow, SchedulerOutput, SpecDecode
    from ..core.sequence import Request, Sequence
    from .sampler import SampleArrays


@dataclass
class LaunchedStep:
    """A step whose forward pass and draws were handed to the device and not read back yet.

    Row j of `sampled` is drawn by `pairs[j]`; the speculating rows' draws follow (`spec`: each
    row and the index of its first draw). `tokens` and `logprobs` are the read-back values, set
    before the layers' `read_back` runs. A step that fails is dropped whole, with what it `held`.
    """

    step_id: int
    out: SchedulerOutput
    pairs: list[tuple[Request, Sequence]]
    sampled: SampleArrays | None
    beam_rows: list[SampleRow]  # read back at once: beams fork and drop on the values
    logits: mx.array | None  # kept only for beam rows
    num_prefill: int
    launched_at: float
    logits_rows: mx.array | None = None  # the sampled rows' logits while their draws wait (guided rows)
    spec: list[tuple[SpecDecode, int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    held: dict = field(default_factory=dict)  # what each layer keeps with the step until it is read back

    def requests(self) -> list[Request]:
        return requests_of(self.out)


def requests_of(out: SchedulerOutput) -> list[Request]:
    """The requests a scheduled step computes tokens for, each once."""
    return list(
        dict.fromkeys([r for r, _ in out.decodes] + [c.request for c in out.prefills] + [d.request for d in out.spec])
    )


class StepLayer:
    """A feature that joins the step pipeline at its stages; every hook defaults to nothing.

    Invariant: a layer changes block tables and request state only through the scheduler (the
    one owner), and only at its stage: the step calls `scheduled` after `Scheduler.schedule`,
    `before_forward` as the step is launched, `committed` after `update_from_forward` (then
    `reads_at_once` decides whether the step may stay in flight), and `read_back` once the
    step's values are known (layers in registration order).
    """

    def resize(self, num_blocks: int, copies: list[tuple[int, int]]) -> None:
        """The block pool grew or was trimmed: device pools with the same block ids follow."""

    def check_kernels(self) -> None:
        """Build and check the Metal kernels this layer's model needs, before any request."""

    def scheduled(self, out: SchedulerOutput) -> None:
        """Right after scheduling, even for an empty step (blocks named by it exist from now on)."""

    def before_forward(self, out: SchedulerOutput) -> None:
        """Device work the step's forward pass needs first (within the step: a failure fails it)."""

    def logits_wanted(self, out: SchedulerOutput) -> list[int]:
        """Entries of `out.batch()` whose every position's logits this layer wants (prompt logprobs)."""
        return []

    def launched(self, step: LaunchedStep, rows: mx.array) -> list[mx.array]:
        """The step is built: `rows` holds the logits `logits_wanted` asked for, every position of
        each entry in order; returns the arrays to launch with the step (kept in `step.held`)."""
        return []

    def committed(self, step: LaunchedStep) -> None:
        """The step's tokens are computed (block tables, hashes, forks recorded); it may be in flight."""

    def reads_at_once(self, step: LaunchedStep) -> bool:
        """Whether the step must be read back before the next is scheduled (its values decide it)."""
        return False

    def read_back(self, step: LaunchedStep) -> list[Request]:
        """The step's values are known; returns the requests that progressed through this layer."""
        return []
