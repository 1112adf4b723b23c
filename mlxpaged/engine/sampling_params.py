"""`SamplingParams`, with the names and meanings of vLLM's."""

from __future__ import annotations

import dataclasses
import hashlib
import numbers
from dataclasses import dataclass, field

from .guided import GuidedDecoding

GREEDY_TEMPERATURE = 1e-5  # temperatures below it sample greedily
OUTPUT_KINDS = ("cumulative", "delta")  # vLLM's RequestOutputKind.CUMULATIVE and DELTA


@dataclass(slots=True)
class SamplingParams:
    """How to sample the completions of one prompt.

    n: samples of the prompt, decoded in parallel on shared prompt blocks.
    temperature: 0 (or below 1e-5) is greedy. top_p: nucleus mass in (0, 1]. top_k: 0 or -1 disables.
      Applied in vLLM's order: the logits are divided by the temperature first, then top-k
      and then top-p act on the tempered distribution (mlx-lm applies top-p before the
      temperature; see `sampler.py`).
    seed: in [0, 2**64). Sample `i` draws from its own stream, derived from the pair
      (seed, i) (`sampler.sample_key`): the same seed gives the same tokens whatever else
      runs in the batch, and no two (seed, i) pairs share a stream. `None` picks a fresh seed.
    logprobs: None returns none; k in [0, 20] returns, for every generated token, its
      logprob and the k most likely tokens' (the log-softmax of the raw logits, before
      temperature, top-k and top-p), as `CompletionOutput.logprobs`.
    max_tokens: generated tokens at most. stop: strings that end a sample (not included in
      its text). stop_token_ids: extra token ids that end a sample. ignore_eos: keep going
      past EOS (benchmarks).
    min_p: drop tokens whose probability (after temperature) is below min_p times the most
      likely token's; 0 disables. logit_bias: token id -> bias in [-100, 100] added to the raw
      logits (OpenAI's; +-100 forces or bans). presence_penalty, frequency_penalty in [-2, 2]:
      OpenAI's, on the generated tokens (subtract presence_penalty once per token that
      occurred, frequency_penalty times its count). repetition_penalty > 0 (1 disables): HF's
      and vLLM's, on prompt and generated tokens (a positive logit divided by it, a negative
      one multiplied). The order in which all of these act is in `sampler.py`'s docstring.
    guided: a `GuidedDecoding` (JSON schema, any JSON object, or a grammar) every sampled
      token must follow; the sample stops ("stop") when the grammar is complete.
    speculative: False opts this request out of the engine's speculative decoding.
    cache_salt: a non-empty string folded into the first block's hash: the request shares cached
      blocks (memory and disk) only with requests of the same salt (docs/prefix-cache.md).
    adapter: the name of a LoRA adapter the engine was given (`LLM(adapters=...)`, `serve --adapter`)
      to run this request with; None runs the base model. Its cached blocks are its own.
    prompt_logprobs: None returns none; k in [0, 20] returns, for every prompt token but the first,
      its logprob given the tokens before it and the k most likely tokens' there, as
      `RequestOutput.prompt_logprobs` (the first entry None, as vLLM's). Such a request computes
      its whole prompt: it takes no prefix-cache hits.
    output_kind: "cumulative" (each output holds everything so far, as `LLM.generate` returns) or
      "delta" (each holds what is new since the last: text, token ids, logprobs; text that may
      still grow into a stop string is held back until it cannot). See `stopping.make_output`.
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
    logprobs: int | None = None
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    guided: GuidedDecoding | None = None
    speculative: bool = True
    cache_salt: str | None = None
    adapter: str | None = None
    output_kind: str = "cumulative"
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20
        ):
            raise ValueError(f"prompt_logprobs must be None or an integer from 0 to 20, got {self.prompt_logprobs!r}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise ValueError(f"adapter must be a non-empty string, got {self.adapter!r}")
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
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be None or an integer in [0, 20], got {self.logprobs!r}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be true or false, got {self.speculative!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not _is_real(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            bias = {}
            for k, v in self.logit_bias.items():
                tok = int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k
                if not _is_int(tok) or tok < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}")
                if not _is_real(v) or not -100 <= v <= 100:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {v!r} for token {k!r}")
                bias[int(tok)] = float(v)
            self.logit_bias = bias or None
        if self.guided is not None and not isinstance(self.guided, GuidedDecoding):
            raise ValueError(f"guided must be a GuidedDecoding, got {type(self.guided).__name__}")

    def to_wire(self) -> dict:
        """JSON data that `from_wire` turns back into equal params, guided spec included (what
        rank 0 of a tensor-parallel server sends the other ranks)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None
        d["guided"] = dataclasses.asdict(self.guided) if self.guided is not None else None
        return d

    @classmethod
    def from_wire(cls, data: dict) -> SamplingParams:
        d = dict(data)
        guided = d.pop("guided", None)
        return cls(**d, guided=GuidedDecoding(**guided) if guided is not None else None)

    def needs_filter(self, vocab_size: int) -> bool:
        """Whether top-k or top-p can drop any token of a `vocab_size` vocabulary."""
        return 0 < self.top_k < vocab_size or self.top_p < 1.0

    @property
    def greedy(self) -> bool:
        # As vLLM: a temperature this small is greedy (logits / 1e-38 overflows float32 to inf).
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty changes the logits (they need the sample's token counts)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and v == v


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def salt_key(salt: str | None) -> bytes:
    """The bytes a `cache_salt` adds to a first block's hash key (none without a salt)."""
    return b"" if salt is None else b"salt:" + hashlib.sha256(salt.encode("utf-8", "surrogatepass")).digest()
