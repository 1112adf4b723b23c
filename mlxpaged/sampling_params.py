"""`SamplingParams`, with the names and meanings of vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to sample the completions of one prompt.

    n: samples of the prompt, decoded in parallel on shared prompt blocks.
    temperature: 0 is greedy. top_p: nucleus mass in (0, 1]. top_k: 0 or -1 disables.
    seed: sample `i` draws from its own stream seeded `seed + i`, so it gives the same tokens
      whatever else runs in the batch (and equals sample 0 of a request seeded `seed + i`).
      `None` picks a fresh seed.
    max_tokens: generated tokens at most. stop: strings that end a sample (not included in
      its text). stop_token_ids: extra token ids that end a sample. ignore_eos: keep going
      past EOS (benchmarks).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
