"""Speculative decoding (n-gram prompt lookup) inside the paged batch.

References: the same engine without speculation (whose tokens the other tests tie to mlx-lm's
contiguous cache), mlx-lm's contiguous cache itself, exact distributions (numpy) for the
acceptance rule, and brute-force n-gram search for the proposer. Block accounting is checked
after every step: the allocator's invariants, and that every block table holds exactly the
blocks its stored tokens need (a rolled-back slot's block is returned at once).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.engine.beam_search import BeamSearchParams
from mlxpaged.engine.sampler import sample_arrays, sample_key
from mlxpaged.engine.spec_decode import NgramProposer, key_chain, verified_tokens

from chi_square import ALPHA, gof_pvalue
from drive import run_work
from reference import contiguous_generate, vllm_probs


# -- driving ------------------------------------------------------------------------------------
def engine_for(tiny_loaded, spec: bool, **kw) -> LLMEngine:
    cfg = dict(
        block_size=4,
        num_blocks=512,
        max_num_batched_tokens=64,
        attention_impl="reference",
        speculative="ngram" if spec else None,
        num_speculative_tokens=4,
    )
    return LLMEngine(tiny_loaded, EngineConfig.of(**{**cfg, **kw}))


def check_blocks(engine: LLMEngine) -> None:
    """The allocator's invariants, and no block held past a sequence's stored tokens."""
    engine.check_invariants()
    bm = engine.block_manager
    for seq in engine.live_sequences():
        assert len(seq.block_table) == bm.blocks_for(seq.num_computed_tokens), (
            f"{len(seq.block_table)} blocks for {seq.num_computed_tokens} stored tokens"
        )


def run(engine: LLMEngine, work, arrivals: dict[int, list] | None = None) -> dict:
    """Queue `work` [(prompt, params)], step to the end checking the blocks after every step;
    `arrivals[step]` are more (prompt, params) queued before that step. Outputs by request id."""
    got = run_work(engine, work, arrivals, after_step=check_blocks)
    engine.block_manager.pool.check()
    return got


# Phrases whose greedy continuation on the tiny model falls into loops (found by simulating the
# proposer on 96 candidates): high acceptance.
LOOPING = [9, 32, 19, 14, 5, 34, 7, 2, 45]


def repeating(i: int) -> list[int]:
    """A prompt with a repeated phrase, whose greedy answer on the tiny model repeats itself."""
    c = LOOPING[i % len(LOOPING)]
    phrase = [(11 * c + 7 * j) % 200 + 3 for j in range(5 + c % 3)]
    return phrase * 4 + phrase[:2]


def mixed(i: int) -> list[int]:
    return [(13 * i + 5 * j * j) % 300 + 3 for j in range(3 + (7 * i) % 13)]


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def spec_stats(engine: LLMEngine) -> tuple[int, int]:
    return engine.stats.spec_proposed_tokens, engine.stats.spec_accepted_tokens


# -- the proposer -------------------------------------------------------------------------------
def brute_ngram(toks: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(hi, lo - 1, -1):
        if n >= len(toks):
            continue
        suffix = toks[-n:]
        starts = [s for s in range(len(toks) - n) if toks[s : s + n] == suffix]
        if starts:
            return toks[starts[-1] + n : starts[-1] + n + k]
    return []


def test_ngram_proposer_matches_brute_force():
    rng = np.random.default_rng(0)
    prop = NgramProposer(2, 4)
    for _ in range(300):
        toks = rng.integers(0, 6, size=int(rng.integers(1, 40))).tolist()
        k = int(rng.integers(1, 6))
        assert prop(toks, k) == brute_ngram(toks, k, 2, 4), toks
    assert prop([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]  # the longest match wins
    assert prop([5, 6, 7, 8], 4) == []
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


# -- greedy identity ----------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_identity_high_acceptance(tiny_loaded, mlx_lm_tiny, overlap):
    """A prompt whose answer loops: most proposals are accepted, 40 tokens take far fewer steps,
    and the tokens are mlx-lm's."""
    work = [(repeating(0), GREEDY)]
    engine = engine_for(tiny_loaded, True, async_scheduling=overlap, prompt_lookup_min=1)
    got = run(engine, work)
    model, _ = mlx_lm_tiny
    assert got["0"][0] == contiguous_generate(model, repeating(0), 40)
    proposed, accepted = spec_stats(engine)
    assert accepted >= 0.8 * proposed and accepted >= 15, (proposed, accepted)
    assert engine.stats.steps < 0.6 * 40  # fewer steps than tokens


def test_greedy_identity_batch(tiny_loaded):
    work = [(repeating(i), GREEDY) for i in range(5)]
    ref = run(engine_for(tiny_loaded, False), work)
    engine = engine_for(tiny_loaded, True)
    assert run(engine, work) == ref
    assert engine.stats.spec_accepted_tokens > 20


def test_ragged_batch_mixed_with_non_speculative(tiny_loaded):
    """Greedy and seeded samples, some opted out, arriving mid-batch: identical tokens (the
    acceptance rule draws each position with the key plain decoding would use)."""
    plans = [
        dict(temperature=0),
        dict(temperature=0, speculative=False),
        dict(temperature=0.8, top_k=30, top_p=0.9, seed=3),
        dict(temperature=1.0, seed=4, speculative=False),
        dict(temperature=0, max_tokens=7),
        dict(temperature=0.7, seed=5, logprobs=2),
    ]
    work = [
        ((repeating if i % 2 == 0 else mixed)(i), SamplingParams(**{"max_tokens": 30, "ignore_eos": True, **p}))
        for i, p in enumerate(plans)
    ]
    later = {
        3: [(repeating(7), GREEDY)],
        6: [(mixed(8), SamplingParams(temperature=0.9, seed=9, max_tokens=25, ignore_eos=True))],
    }
    ref = run(engine_for(tiny_loaded, False), work, later)
    engine = engine_for(tiny_loaded, True)
    assert run(engine, work, later) == ref
    assert engine.stats.spec_accepted_tokens > 0


def test_opt_out_never_speculates(tiny_loaded):
    engine = engine_for(tiny_loaded, True)
    run(engine, [(repeating(0), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, speculative=False))])
    assert spec_stats(engine) == (0, 0)
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="no")


def test_n4_copy_on_write(tiny_loaded):
    work = [
        (repeating(1), SamplingParams(n=4, temperature=0, max_tokens=30, ignore_eos=True)),
        (repeating(2), SamplingParams(n=4, temperature=0.8, top_p=0.95, seed=7, max_tokens=30, ignore_eos=True)),
    ]
    ref = run(engine_for(tiny_loaded, False, speculative_max_batch_size=16), work)
    engine = engine_for(tiny_loaded, True, speculative_max_batch_size=16)
    assert run(engine, work) == ref
    assert engine.stats.spec_accepted_tokens > 0 and engine.block_manager.num_cow_copies > 0


def test_tight_pool_preempts(tiny_loaded):
    work = [(repeating(i), SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)) for i in range(4)]
    ref = run(engine_for(tiny_loaded, False, num_blocks=40), work)
    engine = engine_for(tiny_loaded, True, num_blocks=40)
    assert run(engine, work) == ref
    assert engine.scheduler.num_preemptions > 0 and engine.stats.spec_accepted_tokens > 0


def test_quantized_kv_cache(tiny_loaded):
    work = [(repeating(i), GREEDY) for i in range(2)] + [(mixed(3), GREEDY)]
    ref = run(engine_for(tiny_loaded, False, kv_bits=8, kv_group_size=32), work)
    engine = engine_for(tiny_loaded, True, kv_bits=8, kv_group_size=32)
    assert run(engine, work) == ref
    assert engine.stats.spec_accepted_tokens > 0


def test_beam_search_does_not_speculate(tiny_loaded):
    outs = []
    for spec in (False, True):
        engine = engine_for(tiny_loaded, spec)
        engine.add_beam_request(repeating(0), BeamSearchParams(3, 12, ignore_eos=True))
        engine.add_request(repeating(1), GREEDY)
        done = run(engine, [])
        outs.append(done)
    assert outs[0] == outs[1]


def test_off_above_the_batch_size(tiny_loaded):
    engine = engine_for(tiny_loaded, True, speculative_max_batch_size=2)
    run(engine, [(repeating(i), GREEDY) for i in range(3)])
    assert spec_stats(engine) == (0, 0)


# -- rollback: rejected tokens never reach the prefix cache -------------------------------------
def test_rejected_tokens_are_never_hashed(tiny_loaded, mlx_lm_tiny, monkeypatch):
    """Proposals chosen to be wrong: every verification rejects some. The sample's blocks are
    then reused as a prefix by a second request, whose tokens must equal mlx-lm's on the same
    prompt: a hashed block holding a rejected token's KV would change them."""
    from mlxpaged.core import spec_policy

    monkeypatch.setattr(spec_policy, "MAX_SKIP", 0)  # keep proposing however often it fails
    engine = engine_for(tiny_loaded, True, num_speculative_tokens=3)
    vocab = tiny_loaded.model.args.vocab_size
    engine.scheduler.proposer = lambda toks, k: [(toks[-1] * 7 + j + 1) % vocab for j in range(k)]
    first = run(engine, [(mixed(5), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))])["0"][0]
    proposed, accepted = spec_stats(engine)
    assert proposed > accepted and proposed > 20
    assert len(engine.block_manager.pool.cached) > 0
    prompt = mixed(5) + first
    engine.scheduler.proposer = None
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), request_id="again")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    out = done["again"]
    assert out.num_cached_tokens >= len(prompt) - 8  # all but the last blocks came from the cache
    model, _ = mlx_lm_tiny
    assert out.outputs[0].token_ids == contiguous_generate(model, prompt, 10)


# -- the acceptance rule against exact distributions -----------------------------------------------
L0 = np.array([2.0, 1.6, 1.3, 1.0, 0.8, 0.5, 0.2, -0.3, -1.0, -2.0], dtype=np.float32)
L1 = np.array([-1.0, 0.3, 1.9, 0.1, 1.2, -0.4, 0.9, 1.5, 0.0, -2.0], dtype=np.float32)


def spec_draws(proposal: list[int], params: SamplingParams, num: int) -> list[list[int]]:
    """The tokens a verified row appends, for `num` independent streams: the engine's path
    (key chain, one `sample_arrays` over the row's positions, `verified_tokens`)."""
    width = len(proposal) + 1
    rows = mx.array(np.tile(np.stack([L0, L1][:width]), (num, 1)))  # [num * (K+1), V]: stream by stream
    chain = key_chain(mx.stack([sample_key(s, 0) for s in range(num)]), width)
    keys = mx.stack(chain, axis=1).reshape(-1, 2)  # position i of stream s draws with key_i of s
    s = sample_arrays(rows, [params] * (num * width), [(keys, r) for r in range(num * width)])
    toks = np.array(s.tokens).reshape(num, width)
    return [verified_tokens(proposal, t.tolist()) for t in toks]


@pytest.mark.parametrize("proposed", [1, 4, 0, 9])  # 9 is outside top-k: never accepted
def test_acceptance_is_exact_speculative_sampling(proposed):
    """20,000 draws at temperature 0.8 with top-k and top-p: the first token follows p0 (so the
    proposal is accepted with probability p0(d)); rejected draws follow p0 without d,
    renormalized; after an acceptance the next token follows p1."""
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.95)
    p0, p1 = vllm_probs(L0, 0.8, 8, 0.95), vllm_probs(L1, 0.8, 8, 0.95)
    out = spec_draws([proposed], params, 20_000)
    first = np.array([o[0] for o in out])
    assert gof_pvalue(np.bincount(first, minlength=10), p0) > ALPHA
    accepted = first == proposed
    if p0[proposed] > 0:
        assert 0.05 < accepted.mean() < 0.95  # forced both ways
        second = np.array([o[1] for o in out if len(o) == 2])
        assert len(second) == accepted.sum()
        assert gof_pvalue(np.bincount(second, minlength=10), p1) > ALPHA
    else:
        assert not accepted.any()
    rest = p0.copy()
    rest[proposed] = 0
    assert gof_pvalue(np.bincount(first[~accepted], minlength=10), rest / rest.sum()) > ALPHA
    # and the test rejects a rule that always accepts: its first token is always the proposal
    assert gof_pvalue(np.bincount(np.full(20_000, proposed), minlength=10), p0) < 1e-9


def test_seeded_spec_is_reproducible(tiny_loaded):
    work = [
        (repeating(i), SamplingParams(temperature=0.9, seed=11, n=2, max_tokens=30, ignore_eos=True)) for i in range(2)
    ]
    assert run(engine_for(tiny_loaded, True), work) == run(engine_for(tiny_loaded, True), work)


# -- settings and visibility --------------------------------------------------------------------
def test_config_refuses_bad_settings():
    with pytest.raises(ValueError, match="needs a draft model"):
        EngineConfig.of(speculative="draft")
    with pytest.raises(ValueError, match="speculative must be"):
        EngineConfig.of(speculative="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig.of(speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig.of(speculative="ngram", prompt_lookup_min=4, prompt_lookup_max=2)


def test_generate_summary_shows_acceptance(tiny_model_path):
    from click.testing import CliRunner

    from mlxpaged.cli.main import main

    r = CliRunner().invoke(
        main,
        [
            "generate",
            "--model",
            str(tiny_model_path),
            "--no-chat",
            "--prompt",
            "The KV cache stores the KV cache stores the KV cache",
            "-t",
            "40",
            "--ignore-eos",
            "--speculative",
            "ngram",
            "--num-speculative-tokens",
            "3",
            "--prompt-lookup-min",
            "1",
            "--attention",
            "reference",
        ],
    )
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("Speculative decoding (ngram):"))
    accepted, proposed = (int(w) for w in line.split()[3:6:2])
    assert proposed > 0 and f"({100 * accepted / proposed:.1f}%)" in line and "mean accepted length" in line
    bad = CliRunner().invoke(
        main, ["generate", "--model", str(tiny_model_path), "--prompt", "hi", "--speculative", "draft"]
    )
    assert bad.exit_code != 0 and "Traceback" not in bad.output


def proposed(client) -> float:
    line = next(ln for ln in client.get("/metrics").text.splitlines() if ln.startswith("mlxpaged_spec_proposed"))
    return float(line.rsplit(" ", 1)[1])


def test_server_metrics_and_opt_out(tiny_loaded):
    from fastapi.testclient import TestClient

    from mlxpaged.server.app import build_app
    from mlxpaged.server.engine_loop import EngineLoop
    from mlxpaged.server.metrics import Metrics

    metrics = Metrics()
    loop = EngineLoop(lambda: engine_for(tiny_loaded, True), observer=metrics)
    loop.start()
    metrics.attach(loop)
    app = build_app(loop, metrics, model_id="tiny")
    prompt = repeating(0)
    with TestClient(app) as c:
        off = c.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True, "speculative": False},
        )
        assert off.status_code == 200
        on = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True})
        assert on.status_code == 200
        assert on.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]
        assert set(on.json()["usage"]) == set(off.json()["usage"])
        bad = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "speculative": "yes"})
        assert bad.status_code == 400
        text = c.get("/metrics").text
        # The Anthropic and Responses routes take the same opt-out: no proposal while it is off.
        words = tiny_loaded.tokenizer.decode(prompt)
        routes = [
            ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": words}], "max_tokens": 24}),
            ("/v1/responses", {"model": "tiny", "input": words, "max_output_tokens": 24}),
        ]
        for route, body in routes:
            body = {**body, "temperature": 0}
            before = proposed(c)
            r = c.post(route, json={**body, "speculative": False})
            assert r.status_code == 200, r.text
            assert proposed(c) == before, route
            assert c.post(route, json=body).status_code == 200
            assert proposed(c) > before, route
            assert c.post(route, json={**body, "speculative": "yes"}).status_code == 400
    vals = {
        ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and not ln.startswith("#")
    }
    assert vals["mlxpaged_spec_proposed_tokens_total"] >= vals["mlxpaged_spec_accepted_tokens_total"] > 0


# -- the block table's rollback and the speculation policy, in isolation ---------------------------
def test_truncate_returns_blocks_past_the_kept_tokens():
    from mlxpaged.core.block_manager import BlockManager
    from mlxpaged.core.sequence import Sequence

    bm = BlockManager(8, 4)
    seq = Sequence(list(range(3, 13)), 10)
    assert bm.allocate_slots(seq, 10) == []
    seq.num_computed_tokens = 10
    bm.cache_full_blocks(seq)  # blocks 0 and 1 are full and named
    assert len(seq.block_table) == 3 and bm.pool.num_free == 5
    bm.truncate(seq, 9)
    assert len(seq.block_table) == 3 and seq.num_computed_tokens == 9  # the last block still holds token 8
    bm.truncate(seq, 8)
    assert len(seq.block_table) == 2 and bm.pool.num_free == 6 and seq.num_computed_tokens == 8
    with pytest.raises(ValueError, match="named"):
        bm.truncate(seq, 7)  # would cut into a block already in the prefix cache
    with pytest.raises(ValueError, match="stored"):
        bm.truncate(seq, 9)
    bm.check([seq])


def test_k_adapts_and_backs_off():
    from mlxpaged.core.spec_policy import SpecState

    st = SpecState(4)
    st.verified(4, 4, 6)
    assert st.k == 5
    st.verified(5, 5, 6)
    st.verified(6, 6, 6)
    assert st.k == 6  # at most num_speculative_tokens
    st.verified(6, 2, 6)
    assert st.k == 3 and st.misses == 0
    skips = []
    for _ in range(7):
        st.miss()
        skips.append(st.skip)
    assert skips == [0, 0, 1, 2, 4, 8, 8] and st.k == 1
    st.verified(1, 1, 6)
    assert st.misses == 0 and st.k == 2


def test_low_acceptance_backs_off(tiny_loaded):
    """Proposals that are always wrong: the tokens are unchanged, few proposals are made, and
    most steps stay overlapped (are not read back before the next is scheduled)."""
    engine = engine_for(tiny_loaded, True)
    vocab = tiny_loaded.model.args.vocab_size
    engine.scheduler.proposer = lambda toks, k: [(toks[-1] * 7 + j + 1) % vocab for j in range(k)]
    schedule, synced = engine.scheduler.schedule, []

    def counting():
        out = schedule()
        synced.append(out.read_back_now)
        return out

    engine.scheduler.schedule = counting
    work = [(mixed(2), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))]
    assert run(engine, work) == run(engine_for(tiny_loaded, False), work)
    proposed, accepted = spec_stats(engine)
    assert accepted <= 2 and proposed < 20
    assert sum(synced) < 0.4 * len(synced)


def test_bench_spec_rows(tiny_loaded, mlx_lm_tiny, tiny_model_path, tmp_path):
    """The benchmark's rows: the same tokens with and without speculation, ratios formed within
    each repeat, every system run in a rotating order; a truncated draft keeps the first layers."""
    import json

    from mlxpaged.bench.spec import benchmark, truncated_checkpoint

    draft = truncated_checkpoint(tiny_model_path, 1, tmp_path / "draft")
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    weights = mx.load(str(tmp_path / "draft" / "model.safetensors"))
    assert cfg["num_hidden_layers"] == 1 and not any(".layers.1." in k for k in weights)
    source = mx.load(str(tiny_model_path / "model.safetensors"))
    assert set(weights) == {k for k in source if ".layers.1." not in k}
    assert all(mx.array_equal(weights[k], source[k]) for k in weights)
    model, _ = mlx_lm_tiny
    payload = benchmark(
        tiny_loaded, model, workloads=["edit"], batches=[1], repeats=2, max_tokens={"edit": 6}, draft_model=draft
    )
    (row,) = payload["rows"]
    assert row["same_tokens"]
    assert [r["order"] for r in row["runs"]] == [
        ["ngram", "draft", "plain", "mlx_lm"],
        ["draft", "plain", "mlx_lm", "ngram"],
    ]
    for name in ("ngram", "draft"):
        ratios = [r[name]["tps"] / r["plain"]["tps"] for r in row["runs"]]
        assert row[name]["speedup_vs_plain"]["values"] == pytest.approx(ratios)
        assert {r[name]["system"] for r in row["runs"]} == {name}


# -- with main's features: processed logits, the disk tier, a growing pool, the adapter's rows ----
def test_processed_rows_decode_normally_beside_speculating_ones(tiny_loaded):
    """Penalties, logit_bias, min_p and a grammar need each position's history or mask: those
    requests never speculate, while a plain request in the same steps does; every token equals
    the engine's without speculation (a guided row's draws wait for the read-back, with the
    speculating row's draws in the same graph)."""
    from mlxpaged.engine.guided import GuidedDecoding

    base = dict(max_tokens=24, ignore_eos=True)
    plans = [
        dict(temperature=0),  # speculates
        dict(temperature=0, repetition_penalty=1.3),
        dict(temperature=0.8, seed=2, frequency_penalty=0.5, presence_penalty=0.3),
        dict(temperature=0, logit_bias={7: 5.0, 11: -100}),
        dict(temperature=0.9, seed=3, min_p=0.1),
        dict(temperature=0, guided=GuidedDecoding(json_object=True), max_tokens=16),
    ]
    work = [(repeating(i), SamplingParams(**{**base, **p})) for i, p in enumerate(plans)]
    ref = run(engine_for(tiny_loaded, False), work)
    engine = engine_for(tiny_loaded, True)
    ngram = engine.scheduler.proposer
    engine.scheduler.proposer = lambda toks, k: ngram(toks, k) or [toks[-1]] * k  # every row has proposals
    schedule, speculated = engine.scheduler.schedule, set()

    def recording():
        out = schedule()
        speculated.update(d.request.request_id for d in out.spec)
        return out

    engine.scheduler.schedule = recording
    assert run(engine, work) == ref
    assert speculated == {"0"} and engine.stats.spec_accepted_tokens > 0


def test_rolled_back_blocks_never_reach_the_disk_tier(tiny_loaded, mlx_lm_tiny, monkeypatch, tmp_path):
    """Every verification rejects proposals (their KV is written, then rolled back). The disk tier
    gets the prompt's full blocks and no output block (it keeps prompt blocks only),
    so no block that held a rejected token's KV; a fresh engine reading them from
    disk continues exactly as mlx-lm's contiguous cache."""
    from mlxpaged.core import spec_policy
    from mlxpaged.worker import prefix_store

    monkeypatch.setattr(spec_policy, "MAX_SKIP", 0)
    store = tmp_path / "store"
    engine = engine_for(tiny_loaded, True, num_speculative_tokens=3, prefix_cache_dir=str(store))
    vocab = tiny_loaded.model.args.vocab_size
    engine.scheduler.proposer = lambda toks, k: [(toks[-1] * 7 + j + 1) % vocab for j in range(k)]
    prompt = mixed(5)
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
        # named blocks go to the store in the step that named them: no later step can write into them first
        assert engine.block_manager.to_store == []
        check_blocks(engine)
    first = done[0].outputs[0].token_ids
    engine.prefix_store.flush()
    proposed, accepted = spec_stats(engine)
    assert proposed > accepted and proposed > 20
    stored = len(prompt)  # the prompt's full blocks; the output's (where proposals were rolled back) stay in memory
    assert len(prompt) + 30 - 1 >= stored + 8  # the output filled blocks of its own that were not stored
    assert len(list(store.rglob("*" + prefix_store.SUFFIX))) == stored // 4
    again = engine_for(tiny_loaded, False, prefix_cache_dir=str(store))  # an empty pool: hits come from disk
    asked = prompt + first
    again.add_request(asked, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), request_id="again")
    done = {}
    while again.has_unfinished_requests():
        done.update({o.request_id: o for o in again.step() if o.finished})
    assert again.stats_dict()["prefix_cache_disk_hit_tokens"] == stored // 4 * 4
    assert done["again"].outputs[0].token_ids == contiguous_generate(mlx_lm_tiny[0], asked, 10)


def test_growing_pool_and_idle_trim(tiny_loaded, mlx_lm_tiny):
    """A pool that grows a chunk at a time while proposals take slots and rollbacks return them;
    after the trim of the idle engine the prefix cache still gives mlx-lm's tokens."""
    work = [(repeating(i), GREEDY) for i in range(3)]
    engine = engine_for(tiny_loaded, True, num_blocks=None, kv_chunk_blocks=2)
    assert engine.num_blocks == 2
    got = run(engine, work)
    model, _ = mlx_lm_tiny
    assert [got[str(i)][0] for i in range(3)] == [contiguous_generate(model, p, 40) for p, _ in work]
    assert engine.num_blocks > 8 and engine.stats.spec_accepted_tokens > 20
    engine.trim_pool()
    prompt = repeating(0) + got["0"][0][:8]
    again = run(engine, [(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))])
    assert again["0"][0] == contiguous_generate(model, prompt, 12)


def test_runner_returns_every_position_of_a_speculating_row(tiny_loaded, mlx_lm_tiny):
    """The adapter's output rows (`logits_indices`): one for a decode, K+1 for a speculating row,
    each equal to mlx-lm's contiguous logits at that position."""
    from mlxpaged.core.sequence import Sequence

    e = engine_for(tiny_loaded, False)
    bm, runner = e.block_manager, e.runner
    a, b = mixed(3), repeating(4)
    seqs = [Sequence(list(a), len(a)), Sequence(list(b), len(b))]
    for s in seqs:
        bm.allocate_slots(s, s.num_tokens - 1)
    mx.eval(runner.forward([(s, s.num_tokens - 1) for s in seqs]), e.kv_cache.arrays)
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
    proposal = [17, 5, 99]
    bm.allocate_slots(seqs[0], 1)
    bm.allocate_slots(seqs[1], 1 + len(proposal))
    logits = runner.forward([(seqs[0], 1), (seqs[1], 1 + len(proposal))], {1: proposal})
    assert logits.shape[0] == 2 + len(proposal)
    model, _ = mlx_lm_tiny
    ref_a = model(mx.array([a]))[0, -1:]
    ref_b = model(mx.array([b + proposal]))[0, len(b) - 1 :]
    got = np.array(logits.astype(mx.float32))
    np.testing.assert_allclose(got[:1], np.array(ref_a.astype(mx.float32)), atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(got[1:], np.array(ref_b.astype(mx.float32)), atol=2e-4, rtol=1e-4)
