"""Grammar-constrained decoding on the tiny random model: whatever the weights, the output
follows the grammar, checked by an independent validator (`jsonschema`, `json`).

Requests run through `LLMEngine` step by step (with overlapped steps, the default), alone and
mixed with unconstrained ones, with n > 1 and under preemption.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from mlxpaged.config import EngineConfig
from mlxpaged.engine.guided import GrammarCompiler, GuidedDecoding
from mlxpaged.engine.llm_engine import LLMEngine
from mlxpaged.engine.sampling_params import SamplingParams
from mlxpaged.errors import MlxPagedError

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": -99, "maximum": 9999},
                    "name": {"type": "string", "maxLength": 6},
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "meta": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            },
        },
        "required": ["user", "meta"],
        "additionalProperties": False,
    },
    "array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    "enum": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "bounds": {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 3, "maximum": 17},
            "x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "k": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        },
        "required": ["n", "x", "k"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "name": {"type": "string", "maxLength": 8},
            "note": {"type": "string", "maxLength": 5},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name"],
        "additionalProperties": False,
    },
}

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
# Compact JSON inside the grammar (llguidance's %json allows free whitespace by default).
TOOL_GRAMMAR = 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json' + json.dumps(
    {**TOOL_SCHEMA, "x-guidance": {"whitespace_flexible": False}}
)

PROMPTS = ["Reply in JSON.", "The KV cache stores", "Give me an object:", "0123456789"]


def make_engine(loaded, **kw) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig.of(**{"num_blocks": 1024, "max_num_seqs": 128, **kw}))


def run(engine: LLMEngine, requests: list[tuple[str, SamplingParams]], stream: bool = False):
    """Outputs by request id; with `stream`, also the text each step added, per (request, sample)."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    done, pieces = {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if stream:
                for c in o.outputs:
                    seen = pieces.setdefault((o.request_id, c.index), [""])
                    assert c.text.startswith(seen[-1])  # text only grows
                    seen.append(c.text)
            if o.finished:
                done[o.request_id] = o
    engine.check_invariants()
    return [done[i] for i in ids], pieces


def guided(seed: int, n: int = 1, max_tokens: int = 200, logit_bias=None, **spec) -> SamplingParams:
    # Temperature 1.5: at 1 the random model repeats a digit of a fraction until max_tokens.
    return SamplingParams(
        n=n, temperature=1.5, seed=seed, max_tokens=max_tokens, logit_bias=logit_bias, guided=GuidedDecoding(**spec)
    )


def test_json_schemas_always_validate(tiny_loaded):
    """5 schemas x 20 seeds, one batch: every completion validates and ends because the JSON is complete."""
    engine = make_engine(tiny_loaded)
    reqs = [(PROMPTS[s % 4], guided(s, json_schema=schema)) for schema in SCHEMAS.values() for s in range(20)]
    outs, _ = run(engine, reqs)
    texts = set()
    for (_, sp), o in zip(reqs, outs):
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), sp.guided.json_schema)
        assert 2 not in c.token_ids  # ended by the grammar, not by EOS
        texts.add(c.text)
    assert len(texts) > 50  # the seeds really sample different documents
    assert engine.grammar_compiler.num_compiled == len(SCHEMAS)  # compiled once per schema


def test_unconstrained_model_does_not_write_json(tiny_loaded):
    """The same requests without the grammar: the random model's text is not JSON (so the test above is not vacuous)."""
    outs, _ = run(
        make_engine(tiny_loaded),
        [(PROMPTS[s % 4], SamplingParams(temperature=1.0, seed=s, max_tokens=40)) for s in range(10)],
    )
    for o in outs:
        with pytest.raises(ValueError):
            json.loads(o.outputs[0].text)


def test_json_object_mode_parses_as_object(tiny_loaded):
    """Any JSON object. Left alone, the random model never closes a free string; a bias toward the
    quote token (which the grammar still overrides wherever a quote is not allowed) ends them."""
    quote = tiny_loaded.tokenizer.encode('"')
    assert len(quote) == 1
    outs, _ = run(
        make_engine(tiny_loaded),
        [(PROMPTS[s % 4], guided(s, max_tokens=300, logit_bias={quote[0]: 6.0}, json_object=True)) for s in range(20)],
    )
    assert sum(o.outputs[0].text != "{}" for o in outs) > 10
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        assert isinstance(json.loads(c.text), dict)


def test_lark_tool_call_grammar(tiny_loaded):
    """A Qwen-style `<tool_call>{"name", "arguments"}</tool_call>` grammar with an embedded schema."""
    outs, _ = run(make_engine(tiny_loaded), [(PROMPTS[s % 4], guided(s, grammar=TOOL_GRAMMAR)) for s in range(10)])
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        m = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", c.text, re.S)
        assert m, c.text
        call = json.loads(m.group(1))
        jsonschema.validate(call, TOOL_SCHEMA)
        assert call["name"] == "get_weather"


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_streamed_n3_and_mixed_with_unconstrained(tiny_loaded, async_scheduling):
    """n = 3 samples each keep their own matcher; streamed text grows to the final text; the
    unconstrained requests in the batch produce exactly the tokens they produce without it;
    overlapped and plain steps agree."""
    schema = SCHEMAS["optional"]
    free = [
        (PROMPTS[i], SamplingParams(temperature=t, seed=50 + i, max_tokens=30, ignore_eos=True, **kw))
        for i, (t, kw) in enumerate(
            [
                (0.0, {}),
                (1.0, {}),
                (0.8, dict(top_k=20, min_p=0.05)),
                (1.0, dict(presence_penalty=1.0, logit_bias={5: 3.0})),
            ]
        )
    ]
    alone, _ = run(make_engine(tiny_loaded, async_scheduling=async_scheduling), free)
    cons = [(PROMPTS[i], guided(i, n=3, json_schema=schema)) for i in range(4)]
    mixed, pieces = run(
        make_engine(tiny_loaded, async_scheduling=async_scheduling),
        [x for pair in zip(cons, free) for x in pair],
        stream=True,
    )
    for a, b in zip(alone, mixed[1::2]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for o in mixed[0::2]:
        assert len(o.outputs) == 3
        for c in o.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), schema)
            assert pieces[(o.request_id, c.index)][-1] == c.text
        assert len({c.text for c in o.outputs}) > 1  # the samples are not one shared state
    if async_scheduling:
        other, _ = run(make_engine(tiny_loaded, async_scheduling=False), [x for pair in zip(cons, free) for x in pair])
        assert [[c.token_ids for c in o.outputs] for o in other] == [[c.token_ids for c in o.outputs] for o in mixed]


def test_preemption_restores_matchers(tiny_loaded):
    """A pool too small for the batch preempts and recomputes; the outputs are those of a roomy pool."""
    reqs = [
        (PROMPTS[s % 4], guided(s, n=2 if s % 3 == 0 else 1, max_tokens=100, json_schema=SCHEMAS["nested"]))
        for s in range(8)
    ]
    roomy, _ = run(make_engine(tiny_loaded), reqs)
    tight = make_engine(tiny_loaded, num_blocks=32, block_size=8)
    cramped, _ = run(tight, reqs)
    assert tight.scheduler.num_preemptions > 0
    for a, b in zip(roomy, cramped):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for c in b.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), SCHEMAS["nested"])


def test_matcher_sync_rolls_back_and_replays(tiny_loaded):
    """`sync` to a shorter or different token list leaves the matcher where a fresh one would be."""
    gc = GrammarCompiler(tiny_loaded.tokenizer, 384, {2})
    g = gc.compile(GuidedDecoding(json_schema=SCHEMAS["enum"]))
    text_ids = tiny_loaded.tokenizer.encode('{"color":"green","size":"M"}')

    def mask_after(ids):
        m = g.matcher()
        assert m.sync(ids)
        row = np.zeros(12, dtype=np.int32)
        m.fill_mask(row)
        return row

    m = g.matcher()
    for t in text_ids:
        assert m.consume(t)
    assert m.is_stopped
    for cut in (len(text_ids) - 1, 5, 0):
        assert m.sync(text_ids[:cut])
        row = np.zeros(12, dtype=np.int32)
        m.fill_mask(row)
        assert (row == mask_after(text_ids[:cut])).all() and not m.is_stopped
    assert m.sync(text_ids) and m.is_stopped
    assert not g.matcher().consume(tiny_loaded.tokenizer.encode("[")[0])  # the schema wants an object


@pytest.mark.parametrize(
    "spec,part",
    [
        (dict(json_schema={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}), "not"),
        (dict(json_schema={"type": "string", "pattern": "(?=a)b"}), "look-around"),
        (dict(json_schema={"type": "object", "dependentSchemas": {"a": {}}}), "dependentSchemas"),
        (dict(grammar="start: foo"), "foo"),
    ],
)
def test_unenforceable_spec_is_refused_by_name(tiny_loaded, spec, part):
    engine = make_engine(tiny_loaded, num_blocks=64)
    with pytest.raises(MlxPagedError, match=re.escape(part)) as e:
        engine.add_request("x", SamplingParams(guided=GuidedDecoding(**spec)))
    assert "\n" not in str(e.value)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(json_object=True, grammar='start: "a"'),
        dict(json_schema=[1]),
        dict(grammar="  "),
        dict(json_schema={"enum": {1, 2}}),
    ],
)
def test_guided_decoding_takes_exactly_one_spec(kwargs):
    with pytest.raises(ValueError):
        GuidedDecoding(**kwargs)


def test_parallel_masks_equal_sequential(tiny_loaded, monkeypatch):
    """The thread-pool path of `fill_masks` (big vocabularies) writes the masks the per-row path writes."""
    import mlxpaged.engine.guided as guided_mod

    g = GrammarCompiler(tiny_loaded.tokenizer, 384, {2}).compile(GuidedDecoding(json_object=True))
    ms = [g.matcher() for _ in range(5)]
    for k, m in enumerate(ms):
        assert m.sync(tiny_loaded.tokenizer.encode('{"a":' + "1" * k))
    rows = ms[:2] + [None] + ms[3:]
    seq = np.full((5, 12), -1, dtype=np.int32)
    guided_mod.fill_masks(rows, seq)
    monkeypatch.setattr(guided_mod, "PARALLEL_MASK_TOKENS", 0)
    par = np.full((5, 12), -1, dtype=np.int32)
    guided_mod.fill_masks(rows, par)
    assert (seq == par).all() and (par[2] == -1).all() and (par[0] != par[1]).any()


def test_llm_generate_streamed_and_not(tiny_loaded):
    """The `LLM` API, with and without `on_output` (streaming): the same valid documents."""
    from mlxpaged import LLM

    llm = LLM(tiny_loaded, num_blocks=256)
    params = [guided(s, json_schema=SCHEMAS["enum"]) for s in range(4)]
    plain = llm.generate(PROMPTS, params)
    seen = []
    streamed = llm.generate(PROMPTS, params, on_output=lambda o: seen.append((o.request_id, o.outputs[0].text)))
    assert [o.outputs[0].text for o in plain] == [o.outputs[0].text for o in streamed]
    assert len(seen) > len(PROMPTS)  # intermediate outputs came before the final ones
    for o in plain:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS["enum"])


def test_grammars_join_the_step_at_the_first_guided_request(tiny_loaded):
    """Grammar-constrained decoding is a step layer that sleeps until the first guided request: a
    plain engine's step calls no hook that takes, adds or masks rows or ends requests; after the
    request the grammar layer alone masks rows, and the answer validates against the schema."""
    engine = make_engine(tiny_loaded)
    hooks = ("take_rows", "masks_rows", "masks", "added_rows", "added_draws", "forward_tokens", "failed")
    assert all(getattr(engine.layers, h) == [] for h in hooks)
    rid = engine.add_request("x", guided(0, json_schema=SCHEMAS["enum"]))
    assert [type(x).__name__ for x in engine.layers.masks_rows] == ["GrammarLayer"]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    jsonschema.validate(json.loads(done[rid].outputs[0].text), SCHEMAS["enum"])


def test_masks_follow_the_read_back_and_overlap_the_forward(tiny_loaded):
    """With overlapped steps, a guided step launches its forward pass, then the previous step is
    read back (its tokens advance the matchers), then the masks are filled: never a mask before
    the read-back it depends on, and the next forward pass is always launched before it."""
    engine = make_engine(tiny_loaded)
    events = []
    for name in ("_launch", "_read_back", "_masks"):
        real = getattr(engine, name)
        setattr(engine, name, lambda arg, real=real, name=name: events.append(name) or real(arg))
    engine.add_request("x", guided(0, json_schema=SCHEMAS["enum"]))
    while engine.has_unfinished_requests():
        engine.step()
    assert events[:2] == ["_launch", "_masks"]  # the first step: nothing in flight
    steady = events[2:]
    assert len(steady) >= 9 and steady[:3] == ["_launch", "_read_back", "_masks"]
    for i, e in enumerate(steady):
        if e == "_masks":
            assert steady[i - 2 : i] == ["_launch", "_read_back"], steady


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))


def test_grammar_cache_is_bounded_by_bytes(tiny_loaded):
    """Distinct large enums once grew the cache without bound (by count only). Resident
    memory is the independent measure: 12 enums of 10,000 strings keep ~48 MB when all are cached."""
    import ctypes

    tok = tiny_loaded.tokenizer
    gc = GrammarCompiler(tok, tiny_loaded.model.args.vocab_size, tok.eos_token_ids, cache_bytes=10_000_000)
    gc.warm()
    ctypes.CDLL(None).malloc_trim(0)
    before = _rss()
    specs = [GuidedDecoding(json_schema={"enum": [f"v{k}_{i}" for i in range(10_000)]}) for k in range(12)]
    held = gc.compile(specs[0])
    for s in specs[1:]:
        gc.compile(s)
    ctypes.CDLL(None).malloc_trim(0)
    assert _rss() - before < 30_000_000, (_rss() - before) / 1e6
    assert gc.cached_bytes <= 10_000_000 and len(gc._cache) < 12
    # a grammar the cache dropped but a caller holds is found, not compiled again; a dropped one is
    n = gc.num_compiled
    assert gc.compile(specs[0]) is held and gc.num_compiled == n
    del held
    gc.compile(specs[0])
    assert gc.num_compiled == n + 1
