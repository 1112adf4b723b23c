"""A hybrid model's prefix-state checkpoints as a step layer (worker/state_cache.py keeps them)."""

from __future__ import annotations

from ..worker.state_cache import Checkpoints
from .step import LaunchedStep, StepLayer


class CheckpointNamer(StepLayer):
    """Files the pass's pending state checkpoints under their blocks' hashes once the blocks are
    named: prompt blocks at commit, generated ones after the read-back (hashing needs values)."""

    def __init__(self, checkpoints: Checkpoints):
        self.checkpoints = checkpoints

    def committed(self, step: LaunchedStep) -> None:
        self.checkpoints.resolve()

    def read_back(self, step: LaunchedStep) -> list:
        self.checkpoints.resolve()
        return []
