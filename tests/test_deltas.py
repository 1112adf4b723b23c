"""The engine's delta outputs (`SamplingParams(output_kind="delta")`) against its cumulative ones:
the same requests, run side by side in one engine, must sum to the same outputs, and a delta
must never hand out text a stop string later takes back."""

import random

from mlxpaged import LLM, EngineConfig, LLMEngine, SamplingParams
from mlxpaged.engine.outputs import RequestOutput
from mlxpaged.engine.stopping import StopMatcher, hold_back

PROMPT = "Blocks of sixteen tokens are found through a block table, one per sequence."


def _run(engine, params_by_rid):
    """Every output of every request, in step order."""
    seen = {rid: [] for rid in params_by_rid}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen


def test_deltas_sum_to_cumulative_outputs(tiny_loaded):
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=128, attention_impl="reference"))
    base = dict(n=2, temperature=0.8, seed=7, max_tokens=40, logprobs=2)
    plain = _run(engine, {engine.add_request(PROMPT, SamplingParams(**base), request_id="p"): 0})["p"][-1]
    # a stop string from the middle of sample 0's text: several tokens long, it is split across deltas
    text = plain.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 6]
    assert len(stop) == 6 and stop not in text[: len(text) // 2]
    stops = [stop, "\x00never"]
    rids = {"c": "cumulative", "d": "delta"}
    for rid, kind in rids.items():
        engine.add_request(PROMPT, SamplingParams(**base, stop=stops, output_kind=kind), request_id=rid)
    seen = _run(engine, rids)
    cum, deltas = seen["c"][-1], seen["d"]
    assert cum.finished and not cum.delta and all(d.delta for d in deltas)
    assert cum.outputs[0].finish_reason == "stop" and cum.outputs[0].stop_reason == stop
    assert cum.outputs[0].text == text[: len(text) // 2]

    # along the way: what the deltas handed out so far is a prefix of the final text, and never
    # ends inside a possible stop string while the sample runs
    so_far = {}
    for d in deltas:
        for c in d.outputs:
            so_far[c.index] = so_far.get(c.index, "") + c.text
            final = cum.outputs[c.index].text
            assert final.startswith(so_far[c.index]), (so_far[c.index], final)
            if c.finish_reason is None:
                assert hold_back(so_far[c.index], [stop]) == 0
    # every sample reports its end exactly once
    ends = [c.index for d in deltas for c in d.outputs if c.finish_reason is not None]
    assert sorted(ends) == [0, 1]

    total = RequestOutput(deltas[0].request_id, None, [], [], False, delta=True)
    for d in deltas:
        total.add(d)
    assert total.finished
    for a, b in zip(total.outputs, cum.outputs, strict=True):
        assert (a.index, a.text, a.token_ids, a.finish_reason, a.stop_reason) == (
            b.index,
            b.text,
            b.token_ids,
            b.finish_reason,
            b.stop_reason,
        )
        assert [(t.token_id, t.logprob) for t in a.logprobs] == [(t.token_id, t.logprob) for t in b.logprobs]


def test_stop_hold_back_equals_brute_force():
    """The KMP hold-back, fed in pieces as a stream grows, against the definition by slicing."""

    def brute(text, stops):
        return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)

    rng = random.Random(0)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 14)))
        assert hold_back(text, stops) == brute(text, stops), (text, stops)
        m, cut = StopMatcher(stops), 0
        while cut < len(text):
            nxt = min(len(text), cut + rng.randint(1, 3))
            m.feed(text[cut:nxt])
            cut = nxt
            assert m.hold_back() == brute(text[:cut], stops), (text[:cut], stops)


def test_generate_returns_whole_outputs_for_delta_params(tiny_loaded):
    """`LLM.generate` streams deltas to `on_output` and still returns what cumulative params return."""
    llm = LLM(tiny_loaded, num_blocks=64)
    base = dict(temperature=0, max_tokens=20, logprobs=1)
    want = llm.generate(PROMPT, SamplingParams(**base))[0].outputs[0]
    seen = []
    got = llm.generate(PROMPT, SamplingParams(**base, output_kind="delta"), on_output=seen.append)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert len(seen) > 1 and all(o.delta for o in seen)
    assert "".join(c.text for o in seen for c in o.outputs) == want.text


def test_cumulative_outputs_are_snapshots(tiny_loaded):
    """Every cumulative output keeps the tokens it had when it was handed out (read after the run:
    its ids are copied on the first read), and its list is its own: changing it changes neither a
    later read nor the request's later outputs."""
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=128, attention_impl="reference"))
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    engine.add_request(PROMPT, params, request_id="r")
    outs = _run(engine, {"r": 0})["r"]
    final = [c.token_ids for c in outs[-1].outputs]
    assert len(outs) > 10 and all(len(f) == 24 for f in final)
    lengths = []
    for out in outs:
        for c in out.outputs:
            assert c.token_ids == final[c.index][: len(c.token_ids)]
        lengths.append({len(c.token_ids) for c in out.outputs})
    assert lengths == [{k} for k in range(25 - len(outs), 25)]  # one token more each step, read long after
    first = outs[0].outputs[0]
    first.token_ids.append(-1)
    assert first.token_ids[-1] == -1 and outs[1].outputs[0].token_ids[-1] != -1
    assert engine.stats.generation_tokens == 48
