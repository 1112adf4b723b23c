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

The engine advances a sample's matcher where its tokens are appended (`stopping.StopChecker`),
its `GrammarLayer` (grammar_layer.py) fills the masks of a step's constrained rows on the CPU,
and the sampler applies them in the step's one sampling graph (sampler.py). See
docs/structured-output.md.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..errors import MlxPagedError

# A spec's canonical JSON may have this many characters: compiling costs time and memory in
# proportion (a 100,000-string enum, ~1 MB, takes llguidance about a second and then fails
# its lexer limit), and a compile holds a grammar thread while it runs.
MAX_SPEC_CHARS = 256 * 1024
# The grammar cache holds at most this many bytes, estimated: the compiled lexer and parser
# grow with the spec (64 distinct 0.6 MB enums once kept ~890 MB resident).
CACHE_BYTES = 256 * 1024 * 1024
BYTES_PER_SPEC_CHAR = 40  # measured: 10 distinct 20,000-string enums (229 KB each) grew RSS ~40 B a character
GRAMMAR_OVERHEAD_BYTES = 64 * 1024  # a compiled grammar's fixed cost, whatever its size


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
            size = len(self.key())
        except (TypeError, ValueError) as e:
            raise ValueError(f"json_schema must be JSON data: {e}") from None
        except RecursionError:
            raise ValueError("json_schema is nested too deeply") from None
        if size > MAX_SPEC_CHARS:  # refused before compiling: compile time grows with the spec
            what = "json_schema" if self.json_schema is not None else "grammar"
            raise ValueError(f"{what} is {size} characters as JSON, more than the {MAX_SPEC_CHARS} a grammar may have")
        if self.json_schema is not None:
            why = unsatisfiable(self.json_schema)
            if why:
                raise ValueError(f"unsupported JSON schema: {why}")

    def __hash__(self):  # a dict field: hash the canonical JSON (compiled grammars are cached by spec)
        return hash(self.key())

    def key(self) -> str:
        """Canonical text of the spec: equal specs (dict key order aside) share a compiled grammar."""
        return json.dumps([self.json_schema, self.json_object, self.grammar], sort_keys=True)


def unsatisfiable(schema) -> str | None:
    """Why no finite JSON value can satisfy `schema`, or None when one may: a `$ref` cycle with no
    way out (`{"$ref": "#"}`, a loop of definitions, a required property that is the schema
    itself). Such a grammar compiles, but its matcher can only run to `max_tokens` or die.

    A least fixed point over the local `$ref` targets: a target is satisfiable once its schema is,
    given the targets already known satisfiable. Conservative: a keyword it does not know, a
    remote `$ref` or a non-object/array type counts as satisfiable (llguidance judges the rest).
    """
    targets: dict[str, object] = {}
    known: set[str] = set()

    def resolve(ref: str):
        if ref == "#" or ref.startswith("#/"):
            node = schema
            for part in ref[2:].split("/") if ref != "#" else []:
                part = part.replace("~1", "/").replace("~0", "~")
                if isinstance(node, dict) and part in node:
                    node = node[part]
                elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                    node = node[int(part)]
                else:
                    return None
            return node
        return None

    def ok(node) -> bool:
        if not isinstance(node, dict):
            return node is not False
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref not in targets:
                targets[ref] = resolve(ref)
            if targets[ref] is not None and ref not in known:
                return False
        if not all(ok(s) for s in node.get("allOf") or []):
            return False
        for key in ("anyOf", "oneOf"):
            if node.get(key) and not any(ok(s) for s in node[key]):
                return False
        if "enum" in node or "const" in node:
            return True
        types = node.get("type")
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
        if types is None or any(t not in ("object", "array") for t in types):
            return True  # a scalar (or any type) is always finite
        if "object" in types:
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            required = node.get("required") if isinstance(node.get("required"), list) else []
            if all(ok(props[r]) for r in required if isinstance(r, str) and r in props):
                return True
        if "array" in types:
            n = node.get("minItems", 0)
            n = n if isinstance(n, int) else 0
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            if all(ok(s) for s in prefix[:n]) and (n <= len(prefix) or ok(node.get("items", True))):
                return True
        return False

    try:
        root_ok = ok(schema)
        while not root_ok:  # grow the satisfiable targets until nothing changes
            grown = {r for r, t in list(targets.items()) if t is not None and r not in known and ok(t)}
            if not grown:
                break
            known.update(grown)
            root_ok = ok(schema)
    except RecursionError:
        return None  # too deep to judge here; llguidance's own limits apply
    if root_ok:
        return None
    loops = sorted(r for r, t in targets.items() if t is not None and r not in known)
    if not loops:
        return "it accepts no value"
    return f"it accepts no value: the $ref cycle through {', '.join(loops)} never ends"


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
        self.mask_seconds = 0.0  # time spent filling this sample's masks (`fill_masks`)
        self.masks = 0

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
# A request's masks may take MASK_BUDGET_S plus MASK_BUDGET_PER_MASK_S per mask filled, summed over
# its samples: ordinary grammars take well under a millisecond a mask (even on a 150k vocabulary);
# a pathological lexer (`"pattern": "^x{100000}$"`) takes ~80 ms a mask and stalls every other
# request's decoding, so such a request ends with `GrammarTooSlow` instead.
MASK_BUDGET_S = 1.0
MASK_BUDGET_PER_MASK_S = 0.010


class GrammarTooSlow(MlxPagedError):
    """A request's grammar masks took longer than its budget; the request was ended."""


def mask_budget_spent(matchers) -> str | None:
    """Why the masks of one request's samples (`matchers`) exceeded the budget, or None."""
    ms = [m for m in matchers if m is not None]
    spent, masks = sum(m.mask_seconds for m in ms), sum(m.masks for m in ms)
    if spent <= MASK_BUDGET_S + MASK_BUDGET_PER_MASK_S * masks:
        return None
    return (
        f"the grammar is too slow to enforce: its token masks took {spent:.1f} s for {masks} tokens "
        f"(the budget is {MASK_BUDGET_S:g} s plus {MASK_BUDGET_PER_MASK_S * 1000:g} ms a token); simplify the "
        "schema or grammar (long repetitions such as x{100000} are costly)"
    )


def fill_masks(matchers: list, bits: np.ndarray) -> None:
    """Row k of `bits` (int32 `[K, mask_words(V)]`, C-contiguous) gets `matchers[k]`'s mask; a
    row whose matcher is None is left as it is."""
    global _executor
    assert bits.dtype == np.int32 and bits.flags["C_CONTIGUOUS"]
    todo = [(m._m, k) for k, m in enumerate(matchers) if m is not None]
    # Small work (a small vocabulary or few rows): a thread pool's hand-offs cost more than they save.
    timed = [m for m in matchers if m is not None]
    if len(todo) * bits.shape[1] * 32 < PARALLEL_MASK_TOKENS:
        ptr, stride = bits.ctypes.data, bits.strides[0]  # one ctypes lookup, not one per row
        for (m, k), mm in zip(todo, timed):
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(ptr + k * stride, stride)
            mm.mask_seconds += time.perf_counter() - t0
            mm.masks += 1
    elif todo:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor()
        t0 = time.perf_counter()
        _executor.unsafe_compute_mask_ptr(todo, bits.ctypes.data, bits.shape[1] * 4, bits.shape[0])
        share = (time.perf_counter() - t0) / len(todo)  # in parallel, no row's own time is known: an equal share
        for mm in timed:
            mm.mask_seconds += share
            mm.masks += 1


class Grammar:
    """A compiled grammar: a validated llguidance grammar and a fresh matcher to copy from.
    `nbytes` estimates its memory (the cache's bound counts it)."""

    def __init__(self, template, nbytes: int = 0):
        self._template = template
        self.nbytes = nbytes

    def matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy())


class GrammarCompiler:
    """Compiles `GuidedDecoding` specs for one vocabulary, caching the results by spec.

    `tokenizer` is the engine's (mlx-lm's wrapper of a Hugging Face fast tokenizer, or a
    `tokenizers.Tokenizer`); `vocab_size` is the width of the model's logits (it may exceed
    the tokenizer's: the extra ids are never allowed).

    Invariants: the cache holds at most `cache_size` grammars and `cache_bytes` estimated bytes
    (least recently used out first; one grammar larger than the bound is compiled, not kept);
    a grammar some caller still holds is found by `compile` even after the cache dropped it
    (the server compiles on its grammar thread, then the engine thread's `compile` finds it).
    `compile` may be called from several threads at once.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 64, cache_bytes: int = CACHE_BYTES):
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = tokenizer
        self._ll_tokenizer = None  # built by `warm` or the first compile (about a second for a 150k vocabulary)
        self._lock = threading.Lock()  # guards the cache and the held grammars
        self._tokenizer_lock = threading.Lock()  # one build of llguidance's tokenizer
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._held: weakref.WeakValueDictionary[str, Grammar] = weakref.WeakValueDictionary()
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0
        self.num_compiled = 0

    def ll_tokenizer(self):
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance

                backend = _backend_tokenizer(self._tokenizer)
                if not self.eos_token_ids:
                    raise ValueError("guided decoding needs the tokenizer's EOS token id")
                self._ll_tokenizer = llguidance.LLTokenizer(
                    backend, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._ll_tokenizer

    def warm(self) -> None:
        """Build llguidance's tokenizer now (a server calls it at start, off the engine thread); a
        tokenizer it cannot take is reported at the first guided request instead."""
        try:
            self.ll_tokenizer()
        except (ValueError, ImportError):
            pass

    def lookup(self, spec: GuidedDecoding) -> Grammar | None:
        """The compiled grammar of `spec` if it is cached or held, without compiling."""
        key = spec.key()
        with self._lock:
            g = self._cache.get(key)
            if g is not None:
                self._cache.move_to_end(key)
                return g
            return self._held.get(key)

    def compile(self, spec: GuidedDecoding) -> Grammar:
        """The compiled grammar of `spec`; raises ValueError naming what cannot be enforced."""
        g = self.lookup(spec)
        if g is not None:
            return g
        key = spec.key()
        g = Grammar(self._matcher_template(spec), GRAMMAR_OVERHEAD_BYTES + BYTES_PER_SPEC_CHAR * len(key))
        with self._lock:
            self.num_compiled += 1
            self._held[key] = g
            if key not in self._cache and g.nbytes <= self.cache_bytes:
                self._cache[key] = g
                self.cached_bytes += g.nbytes
                while len(self._cache) > self.cache_size or self.cached_bytes > self.cache_bytes:
                    _, old = self._cache.popitem(last=False)
                    self.cached_bytes -= old.nbytes
        return g

    def _matcher_template(self, spec: GuidedDecoding):
        from llguidance import LLMatcher

        if spec.json_schema is not None:
            what, grammar = "JSON schema", _from_schema(spec.json_schema)
        elif spec.json_object:
            what, grammar = "JSON object", _from_schema({"type": "object"})
        else:
            what, grammar = "grammar", LLMatcher.grammar_from_lark(spec.grammar)
        m = LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"unsupported {what}: {_one_line(m.get_error())}")
        # The first mask, on a copy: a grammar with no sentence (an endless $ref the schema check
        # missed) compiles, then fails here, and would end every sample at once or run to max_tokens.
        probe, row = m.deep_copy(), np.zeros(mask_words(self.vocab_size), np.int32)
        probe.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if probe.is_error():
            raise ValueError(f"unsupported {what}: it accepts no output ({_one_line(probe.get_error())})")
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
