"""Grammar-constrained decoding: what a request asks for (`GuidedDecoding`) and the grammar
backend behind a small interface, so another backend (xgrammar) could replace llguidance in
this file alone:

- `GrammarCompiler(tokenizer, vocab_size, eos_token_ids)`: one per engine (its vocabulary);
  `compile(spec)` -> `Grammar`, cached by spec (LRU), raising `ValueError` naming what the
  backend cannot enforce;
- `Grammar.matcher()` -> `Matcher`: one per sample, with `consume(token)`, `fill_mask(row)`
  (the allowed next tokens as a bitmask: int32 words, bit `t % 32` of word `t // 32`),
  `rollback(k)`, `reset()`, `sync(output_token_ids)` and `is_stopped`;
- `fill_masks(matchers, bits)`: the masks of a step's matchers at once (for big vocabularies
  in llguidance's thread pool, outside the GIL).

The engine (llm_engine.py) advances a sample's matcher where its tokens are appended
(`output.StopChecker`), fills the masks of a step's constrained rows on the CPU, and the
sampler applies them in the step's one sampling graph (sampler.py). See docs/structured-output.md.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GuidedDecoding:
    """Exactly one of: a JSON schema, any JSON object, or a Lark grammar (llguidance's syntax,
    which may embed `%json{...}`). A spec the engine cannot enforce raises `ValueError` naming
    the unsupported part when it is compiled (at request time)."""

    json_schema: dict | None = None
    json_object: bool = False
    grammar: str | None = None

    def __post_init__(self):
        given = [self.json_schema is not None, bool(self.json_object), self.grammar is not None]
        if sum(given) != 1:
            raise ValueError("guided decoding takes exactly one of json_schema, json_object, grammar")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError(f"json_schema must be a dict, got {type(self.json_schema).__name__}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("grammar must be a non-empty string")
        try:
            self.key()
        except (TypeError, ValueError) as e:
            raise ValueError(f"json_schema must be JSON data: {e}") from None

    def __hash__(self):  # a dict field: hash the canonical JSON (compiled grammars are cached by spec)
        return hash(self.key())

    def key(self) -> str:
        """Canonical text of the spec: equal specs (dict key order aside) share a compiled grammar."""
        return json.dumps([self.json_schema, self.json_object, self.grammar], sort_keys=True)


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's token bitmask."""
    return (vocab_size + 31) // 32


class Matcher:
    """One sample's position in a compiled grammar (llguidance's `LLMatcher`).

    `num_consumed` counts the tokens it has taken, so `sync` can bring it to any sample's
    generated tokens after they were cut or replaced (rollback) or extended (consume).
    """

    def __init__(self, ll_matcher):
        self._m = ll_matcher
        self.consumed: list[int] = []

    def consume(self, token: int) -> bool:
        """Advance by `token`; False (and the matcher is in error) if the grammar forbids it."""
        ok = self._m.consume_token(int(token))
        if ok:
            self.consumed.append(int(token))
        return ok

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (int32 `[mask_words(V)]`, C-contiguous)."""
        assert row.dtype == np.int32 and row.flags["C_CONTIGUOUS"]
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            if not self._m.rollback(num_tokens):
                raise RuntimeError(f"grammar matcher could not roll back {num_tokens} tokens: {self._m.get_error()}")
            del self.consumed[len(self.consumed) - num_tokens :]

    def reset(self) -> None:
        self._m.reset()
        self.consumed.clear()

    def sync(self, output_token_ids: list[int]) -> bool:
        """Bring the matcher to exactly `output_token_ids` (rolling back what differs); False if
        the grammar rejects one of them."""
        same = 0
        for a, b in zip(self.consumed, output_token_ids):
            if a != b:
                break
            same += 1
        self.rollback(len(self.consumed) - same)
        return all(self.consume(t) for t in output_token_ids[same:])

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and admits no further token (but EOS)."""
        return self._m.is_stopped()

    @property
    def is_error(self) -> bool:
        return self._m.is_error()

    def error(self) -> str:
        return self._m.get_error()


_executor = None
PARALLEL_MASK_TOKENS = 1 << 20  # rows x vocabulary from which a step's masks are filled in parallel


def fill_masks(matchers: list, bits: np.ndarray) -> None:
    """Row k of `bits` (int32 `[K, mask_words(V)]`, C-contiguous) gets `matchers[k]`'s mask; a
    row whose matcher is None is left as it is."""
    global _executor
    assert bits.dtype == np.int32 and bits.flags["C_CONTIGUOUS"]
    todo = [(m._m, k) for k, m in enumerate(matchers) if m is not None]
    # Small work (a small vocabulary or few rows): a thread pool's hand-offs cost more than they save.
    if len(todo) * bits.shape[1] * 32 < PARALLEL_MASK_TOKENS:
        ptr, stride = bits.ctypes.data, bits.strides[0]  # one ctypes lookup, not one per row
        for m, k in todo:
            m.unsafe_compute_mask_ptr(ptr + k * stride, stride)
    else:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor()
        _executor.unsafe_compute_mask_ptr(todo, bits.ctypes.data, bits.shape[1] * 4, bits.shape[0])


class Grammar:
    """A compiled grammar: a validated llguidance grammar and a fresh matcher to copy from."""

    def __init__(self, template):
        self._template = template

    def matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy())


class GrammarCompiler:
    """Compiles `GuidedDecoding` specs for one vocabulary, caching the results by spec.

    `tokenizer` is the engine's (mlx-lm's wrapper of a Hugging Face fast tokenizer, or a
    `tokenizers.Tokenizer`); `vocab_size` is the width of the model's logits (it may exceed
    the tokenizer's: the extra ids are never allowed).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 64):
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = tokenizer
        self._ll_tokenizer = None  # built on the first compile (about a second for a 150k vocabulary)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self.cache_size = cache_size
        self.num_compiled = 0

    def ll_tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance

            backend = _backend_tokenizer(self._tokenizer)
            if not self.eos_token_ids:
                raise ValueError("guided decoding needs the tokenizer's EOS token id")
            self._ll_tokenizer = llguidance.LLTokenizer(backend, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return self._ll_tokenizer

    def compile(self, spec: GuidedDecoding) -> Grammar:
        """The compiled grammar of `spec`; raises ValueError naming what cannot be enforced."""
        key = spec.key()
        g = self._cache.get(key)
        if g is not None:
            self._cache.move_to_end(key)
            return g
        g = Grammar(self._matcher_template(spec))
        self.num_compiled += 1
        self._cache[key] = g
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return g

    def _matcher_template(self, spec: GuidedDecoding):
        from llguidance import LLMatcher

        if spec.json_schema is not None:
            what, grammar = "JSON schema", _from_schema(spec.json_schema)
        elif spec.json_object:
            what, grammar = "JSON object", _from_schema({"type": "object"})
        else:
            what, grammar = "grammar", LLMatcher.grammar_from_lark(spec.grammar)
        is_error, msgs = LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer())
        if is_error:
            raise ValueError(f"unsupported {what}: {_one_line(msgs[0])}")
        m = LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"unsupported {what}: {_one_line(m.get_error())}")
        return m


def _from_schema(schema: dict) -> str:
    from llguidance import LLMatcher

    # Compact JSON (no free whitespace): a weak model cannot pad the output with blank lines.
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as e:
        raise ValueError(f"unsupported JSON schema: {_one_line(str(e))}") from None


def _one_line(msg: str) -> str:
    return " ".join(msg.split())


def _backend_tokenizer(tokenizer) -> str:
    """The tokenizer.json text of a Hugging Face fast tokenizer (through mlx-lm's wrapper) or of a
    `tokenizers.Tokenizer`, without padding or truncation."""
    from copy import copy

    tok = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(tok, "backend_tokenizer", tok)
    if not hasattr(backend, "to_str"):
        raise ValueError(f"guided decoding needs a Hugging Face fast tokenizer, got {type(tok).__name__}")
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()
