"""Overlapped steps (`EngineConfig.async_scheduling`): step t+1 is launched before step t's tokens
are read back. The outputs must equal those of the engine with the overlap off, token for token,
whatever ends a sample, arrives, preempts or aborts; the block accounting must hold after every
step; a token computed after its sample ended is never emitted."""

import mlx.core as mx
import numpy as np
import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.attention import paged_attention
from mlxpaged.errors import StepError
from mlxpaged.testing.slowness import wall
from mlxpaged.worker.kv_cache import CacheShape, PagedKVCache

from drive import run_all
from reference import contiguous_generate

SYSTEM = [(31 * i) % 250 + 1 for i in range(20)]


def prompt(i: int) -> list[int]:
    return SYSTEM[: 4 + 3 * i] + [(17 * i + 5 * j) % 280 + 3 for j in range(2 + (7 * i) % 11)]


def engine_for(tiny_loaded, overlap: bool, **kw) -> LLMEngine:
    cfg = dict(block_size=4, num_blocks=256, max_num_batched_tokens=48, attention_impl="reference")
    return LLMEngine(tiny_loaded, EngineConfig.of(**{**cfg, **kw, "async_scheduling": overlap}))


def summary(out) -> list:
    """Everything a caller sees of a finished request; logprob values as `pytest.approx` (the
    batch around a row changes the last bits of its log-softmax, not the tokens)."""
    return [
        (
            c.token_ids,
            c.text,
            c.finish_reason,
            None
            if c.logprobs is None
            else [
                (
                    t.token_id,
                    pytest.approx(t.logprob, abs=1e-4),
                    [(i, pytest.approx(v, abs=1e-4)) for i, v in t.top_logprobs],
                )
                for t in c.logprobs
            ],
        )
        for c in out.outputs
    ]


def reference_tokens(tiny_loaded, n: int = 10, max_tokens: int = 24) -> dict[int, list[int]]:
    """Greedy tokens of the prompts, with the overlap off and nothing that stops them."""
    engine = engine_for(tiny_loaded, False)
    for i in range(n):
        engine.add_request(
            prompt(i), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), request_id=str(i)
        )
    return {int(k): o.outputs[0].token_ids for k, o in run_all(engine).items()}


def workload(tiny_loaded, ref: dict[int, list[int]]) -> list[tuple[int, list[int], SamplingParams]]:
    """(call index at which it arrives, prompt, params): greedy and seeded samples (n up to 3,
    top-k/top-p, logprobs) ending by EOS, stop token, stop string or max_tokens, mid-batch."""
    tok = tiny_loaded.tokenizer
    stop_text = tok.decode(ref[3][:8], skip_special_tokens=True)[-3:]  # special tokens are not text
    plans = [
        dict(temperature=0, max_tokens=24, ignore_eos=True),
        dict(temperature=0, max_tokens=24),  # ends at EOS (the engine's EOS is set from ref[1])
        dict(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[ref[2][4]]),
        dict(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop_text]),
        dict(n=3, temperature=0.9, top_p=0.9, seed=4, max_tokens=13, ignore_eos=True),
        dict(temperature=0.8, top_k=40, seed=5, max_tokens=1, ignore_eos=True),
        dict(temperature=0.7, seed=6, max_tokens=17, ignore_eos=True, logprobs=2),
        dict(temperature=0, max_tokens=9, ignore_eos=True, logprobs=0),
        dict(n=2, temperature=1.0, seed=8, max_tokens=20, stop_token_ids=[ref[8][6]]),
        dict(temperature=0, max_tokens=5, ignore_eos=True),
    ]
    arrivals = [0, 0, 0, 0, 2, 3, 3, 5, 8, 11]
    return [(a, prompt(i), SamplingParams(**p)) for i, (a, p) in enumerate(zip(arrivals, plans))]


def drive(engine, work, eos: int) -> tuple[dict, list[int]]:
    """Run `work`, adding each request at its call index; invariants after every step.
    Returns the finished outputs and, per call, how many scheduled sequences read a pending token."""
    engine.eos_token_ids = {eos}
    pending_inputs = []
    forward = engine.runner.forward

    def counting(batch):
        pending_inputs.append(sum(s.pending is not None for s, _ in batch))
        return forward(batch)

    engine.runner.forward = counting
    done, call = {}, 0
    while call <= max(a for a, _, _ in work) or engine.has_unfinished_requests():
        for i, (a, p, sp) in enumerate(work):
            if a == call:
                engine.add_request(p, sp, request_id=str(i))
        for o in engine.step():
            assert o.request_id not in done, "a finished request is reported once"
            if o.finished:
                done[o.request_id] = o
        engine.check_invariants()
        call += 1
    pool = engine.block_manager.pool
    assert all(b.ref_cnt == 0 for b in pool.blocks) and pool.num_free == pool.num_blocks  # nothing leaked
    return done, pending_inputs


@pytest.mark.parametrize("case", ["ample", "tight", "no-prefix-caching"])
def test_overlap_on_equals_off(tiny_loaded, case):
    ref = reference_tokens(tiny_loaded)
    work = workload(tiny_loaded, ref)
    kw = {"tight": dict(num_blocks=20), "no-prefix-caching": dict(enable_prefix_caching=False)}.get(case, {})
    results = {}
    for overlap in (False, True):
        engine = engine_for(tiny_loaded, overlap, **kw)
        done, pending_inputs = drive(engine, work, eos=ref[1][5])
        results[overlap] = ({k: summary(o) for k, o in done.items()}, engine.stats_dict())
        assert (max(pending_inputs) > 0) == overlap  # inputs really came from a step still on the device
    (off, st_off), (on, st_on) = results[False], results[True]
    assert on == off
    assert len(on) == len(work)
    assert st_on["generation_tokens"] == st_off["generation_tokens"] == sum(len(c[0]) for o in on.values() for c in o)
    # The workload ends samples in every way, so the comparison covers each.
    reasons = {(k, c[2]) for k, o in on.items() for c in o}
    assert {("1", "stop"), ("2", "stop"), ("3", "stop"), ("0", "length")} <= reasons
    assert on["0"][0][0] == ref[0] and on["1"][0][0] == ref[1][: ref[1].index(ref[1][5]) + 1]
    if case == "tight":
        assert st_on["preemptions"] > 0 and st_off["preemptions"] > 0
    if case == "ample":
        assert st_on["prefix_cache_hit_tokens"] > 0


def test_greedy_overlapped_matches_contiguous(tiny_loaded, mlx_lm_tiny):
    ref_model, _ = mlx_lm_tiny
    engine = engine_for(tiny_loaded, True, block_size=16)
    prompts = [prompt(i) for i in range(6)]
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), request_id=str(i))
    done = run_all(engine)
    for i, p in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == contiguous_generate(ref_model, p, 20), i


def test_beam_search_beside_overlapped_samples(tiny_loaded):
    """A beam search (read back at once: its beams fork on the values) beside sampled requests:
    everything equals the engine with the overlap off."""
    from mlxpaged import BeamSearchParams

    results = {}
    for overlap in (False, True):
        engine = engine_for(tiny_loaded, overlap)
        engine.add_request(
            prompt(1), SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True), request_id="s"
        )
        engine.add_beam_request(prompt(2), BeamSearchParams(beam_width=3, max_tokens=10), request_id="b")
        engine.add_request(prompt(3), SamplingParams(temperature=0, max_tokens=15, ignore_eos=True), request_id="g")
        done = run_all(engine)
        results[overlap] = {
            k: [
                (c.token_ids, c.finish_reason, None if c.score is None else pytest.approx(c.score, abs=1e-5))
                for c in o.outputs
            ]
            for k, o in done.items()
        }
    assert results[True] == results[False] and len(results[True]["b"]) == 3


def test_launch_precedes_read_back(tiny_loaded):
    """Step t+1 is handed to the device before step t's tokens are read (and never more than one ahead)."""
    engine = engine_for(tiny_loaded, True)
    events = []
    for name in ("_launch", "_read_back"):
        real = getattr(engine, name)
        setattr(engine, name, lambda step, real=real, name=name: events.append((name, id(step))) or real(step))
    for i in range(3):
        engine.add_request(prompt(i), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    run_all(engine)
    kinds = [k for k, _ in events]
    assert kinds[:5] == ["_launch", "_launch", "_read_back", "_launch", "_read_back"]
    ahead = 0
    for k in kinds:
        ahead += 1 if k == "_launch" else -1
        assert 0 <= ahead <= 2
    assert ahead == 0


@pytest.mark.parametrize("block_size", [1, 4])
def test_a_late_stop_wastes_one_token_and_never_emits_it(tiny_loaded, mlx_lm_tiny, block_size):
    """A stop token read back after the next step was launched: that step computed one more token
    for the sample, which is dropped; the output ends at the stop token, and counts add up."""
    ref_model, _ = mlx_lm_tiny
    p = prompt(2)
    ref = contiguous_generate(ref_model, p, 12)
    stop = ref[4]
    cut = ref.index(stop)
    rows = {}
    for overlap in (False, True):
        engine = engine_for(tiny_loaded, overlap, block_size=block_size, num_blocks=1024 // block_size)
        rid = engine.add_request(
            p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop])
        )
        other = engine.add_request(prompt(5), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        seq, seq2 = engine._requests[rid].seqs[0], engine._requests[other].seqs[0]
        forward, calls = engine.runner.forward, []
        engine.runner.forward = lambda batch: (
            calls.append([any(s is x for s, _ in batch) for x in (seq, seq2)]) or forward(batch)
        )
        done = run_all(engine)
        out = done[rid].outputs[0]
        assert out.token_ids == ref[: cut + 1] and out.finish_reason == "stop"
        assert engine.stats.generation_tokens == len(out.token_ids) + len(done[other].outputs[0].token_ids)
        rows[overlap] = np.sum(calls, axis=0).tolist()
    assert rows[True][0] == rows[False][0] + 1  # the one wasted row, computed and dropped
    assert rows[True][1] == rows[False][1]  # a sample whose pending token is its max_tokens-th is not decoded again


def test_abort_while_a_step_is_in_flight(tiny_loaded):
    """Aborting a request whose token is still on the device frees its blocks at once; its token
    is never reported; the others decode exactly as with the overlap off."""
    results = {}
    for overlap in (False, True):
        engine = engine_for(tiny_loaded, overlap)
        for i in range(3):
            engine.add_request(
                prompt(i),
                SamplingParams(n=1 + i % 2, temperature=0.8, seed=i, max_tokens=16, ignore_eos=True),
                request_id=str(i),
            )
        for _ in range(4):
            engine.step()
        victim = engine._requests["1"]
        assert any(s.pending is not None for s in victim.seqs) == overlap
        used = engine.block_manager.pool.num_used
        assert engine.abort_request("1")
        assert engine.block_manager.pool.num_used < used and all(s.pending is None for s in victim.seqs)
        engine.check_invariants()
        done = run_all(engine)
        assert "1" not in done
        results[overlap] = {k: summary(o) for k, o in done.items()}
    assert results[True] == results[False]


def test_failing_step_delivers_the_step_before(tiny_loaded):
    """The forward of step 3 fails while step 2 is in flight: only step 3's requests fail; a request
    that step 2 finished (its last token was on the device) is reported at the next call."""
    engine = engine_for(tiny_loaded, True)
    a = engine.add_request(prompt(0), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    b = engine.add_request(prompt(1), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    engine.step()
    real = engine.runner.forward
    engine.runner.forward = lambda batch: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(StepError) as e:
        engine.step()
    assert e.value.request_ids == [b]
    engine.runner.forward = real
    assert engine.has_unfinished_requests()
    (out,) = engine.step()
    assert out.request_id == a and out.finished and len(out.outputs[0].token_ids) == 2
    assert not engine.has_unfinished_requests() and engine.metrics()["kv_blocks_used"] == 0


def test_preempted_sequence_drops_its_pending_token(tiny_loaded):
    """Under a tight pool, requests are preempted while a token of theirs is still on the device;
    their recomputation gives the tokens of an ample pool."""
    work = [
        (0, prompt(i), SamplingParams(n=1 + i % 2, temperature=0.8 * (i % 2), seed=i, max_tokens=30, ignore_eos=True))
        for i in range(6)
    ]
    runs = {}
    for num_blocks in (512, 40):
        engine = engine_for(tiny_loaded, True, num_blocks=num_blocks)
        dropped = []
        release = engine.scheduler._release
        engine.scheduler._release = lambda req: (
            dropped.append(any(s.pending is not None for s in req.seqs)) or release(req)
        )
        done, _ = drive(engine, work, eos=-1)
        runs[num_blocks] = ({k: summary(o) for k, o in done.items()}, any(dropped))
    assert runs[40][1] and not runs[512][1]
    assert runs[40][0] == runs[512][0]


def test_a_reused_block_never_changes_an_in_flight_read():
    """The reasoning behind freeing a block while a step that reads it is in flight: the pools are
    MLX arrays, so a later write into the same block (a new owner) is a new version of the pool,
    built on the version the launched step reads. Its result is that of the old contents."""
    rng = np.random.default_rng(0)
    shape = CacheShape(1, 2, 32, mx.float32)
    cache = PagedKVCache(shape, 8, 4)
    k1, v1, k2, v2 = (mx.array(rng.normal(size=(4, 2, 32)).astype(np.float32)) for _ in range(4))
    q = mx.array(rng.normal(size=(1, 4, 32)).astype(np.float32))
    slots = mx.arange(12, 16, dtype=mx.int32)  # block 3
    tables, lens = mx.array([[3]], dtype=mx.int32), mx.array([4], dtype=mx.int32)
    cache.write(0, k1, v1, slots)
    first = paged_attention(q, cache.keys[0], cache.values[0], tables, lens, impl="reference")
    mx.async_eval(first)
    cache.write(0, k2, v2, slots)  # the block, freed, goes to another sequence at once
    second = paged_attention(q, cache.keys[0], cache.values[0], tables, lens, impl="reference")
    mx.eval(first, second)
    for got, (k, v) in ((first, (k1, v1)), (second, (k2, v2))):
        kk, vv = (x.transpose(1, 0, 2)[None] for x in (k, v))
        want = mx.fast.scaled_dot_product_attention(q.reshape(1, 4, 1, 32), kk, vv, scale=32**-0.5)
        np.testing.assert_allclose(np.array(got).reshape(-1), np.array(want).reshape(-1), atol=1e-5)
    assert mx.array_equal(cache.keys[0][3], k2.transpose(1, 0, 2)).item()


def test_bench_step_runs_and_rejects_bad_input():
    """scripts/bench_step.py measures all three modes on the tiny model; bad input is one line."""
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(__file__).resolve().parent.parent / "scripts" / "bench_step.py")
    ok = subprocess.run(
        [sys.executable, script, "--tiny", "--noop", "--vocab", "512", "--seqs", "2", "--steps", "4", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=wall(300),
    )
    assert ok.returncode == 0, ok.stderr
    rows = [line.split("|")[0].split() for line in ok.stdout.splitlines() if line.strip().startswith("2 ")]
    assert [r[1] for r in rows] == ["off", "on", "device", "ratio"]
    # bench_step_ab.py reads this table: its phase names and order are the header's, and it finds
    # the `off` row's cells
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_step_ab", Path(script).with_name("bench_step_ab.py"))
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    header = next(line for line in ok.stdout.splitlines() if line.split() and line.split()[0] == "seqs")
    assert tuple(c.strip() for c in header.split("|")[-len(ab.PHASES) :]) == ab.PHASES
    off = next(line for line in ok.stdout.splitlines() if line.split()[:2] == ["2", "off"])
    assert ab.parse(ok.stdout) == {2: {p: float(c) for p, c in zip(ab.PHASES, off.split("|")[-len(ab.PHASES) :])}}
    bad = subprocess.run(
        [sys.executable, script, "--tiny", "--seqs", "1,x"], capture_output=True, text=True, timeout=wall(300)
    )
    assert bad.returncode != 0 and "--seqs" in bad.stderr and "Traceback" not in bad.stderr


def test_bench_step_pair_runs_two_checkouts_in_one_process(tmp_path):
    """scripts/bench_step_pair.py imports checkout A beside B (`mlxpaged_a`, from A's own files)
    and reports each round's blocks and their ratio; bad input is one line."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script, out = str(root / "scripts" / "bench_step_pair.py"), tmp_path / "pair.json"
    args = ["--a", str(root), "--b", str(root), "--seqs", "2", "--rounds", "2", "--steps", "4", "--vocab", "512"]
    ok = subprocess.run(
        [sys.executable, script, *args, "--json", str(out)], capture_output=True, text=True, timeout=wall(300)
    )
    assert ok.returncode == 0, ok.stderr
    got = json.loads(out.read_text())
    assert got["packages"]["a"] == ["mlxpaged_a", str(root / "mlxpaged" / "__init__.py")]
    assert got["packages"]["b"] == ["mlxpaged", str(root / "mlxpaged" / "__init__.py")]
    for kind in ("host", "cpu"):
        row = got["by_seqs"]["2"][kind]
        assert len(row["a"]) == len(row["b"]) == 2 and all(x > 0 for x in row["a"] + row["b"])
        assert row["ratio"] == [a / b for a, b in zip(row["a"], row["b"])]
    bad = subprocess.run(
        [sys.executable, script, "--a", str(root), "--seqs", "1,x"], capture_output=True, text=True, timeout=wall(60)
    )
    assert bad.returncode != 0 and "--seqs" in bad.stderr and "Traceback" not in bad.stderr


def test_layers_list_each_hook_s_own_layers():
    """`Layers` gives each hook the layers whose class defines it, in registration order (a stage
    calls only those); a subclass inherits its parent's hooks; anything else is refused."""
    from mlxpaged.engine.step import HOOKS, Layers, StepLayer

    class Reads(StepLayer):
        def read_back(self, step):
            return []

    class Scheduled(Reads):
        def scheduled(self, out):
            pass

    a, b, c = Reads(), Scheduled(), StepLayer()
    layers = Layers([a, b])
    layers.append(c)
    assert layers.all == [a, b, c] and list(layers) == [a, b, c] and len(layers) == 3
    assert layers.read_back == [a, b] and layers.scheduled == [b]
    assert all(getattr(layers, h) == [] for h in HOOKS if h not in ("read_back", "scheduled"))
    with pytest.raises(TypeError, match="StepLayer"):
        layers.append(object())
    # a dormant layer keeps its place in the order and joins its stages when woken
    d = Scheduled()
    layers = Layers([a])
    layers.append(d, dormant=True)
    layers.append(b)
    assert layers.all == [a, d, b] and layers.read_back == [a, b] and layers.scheduled == [b]
    layers.wake(d)
    layers.wake(d)  # (again: nothing changes)
    assert layers.read_back == [a, d, b] and layers.scheduled == [d, b] and layers.dormant == []


def test_a_layer_joins_every_stage_of_the_step(tiny_loaded, mlx_lm_tiny):
    """A feature is a `StepLayer` the engine calls at each stage (engine/step.py), with no branch in
    `step()`: a recording layer sees every launched step go scheduled -> before_forward ->
    committed -> read_back, never more than one step in flight, and in `read_back` exactly the
    tokens the requests report, which are mlx-lm's."""
    from mlxpaged.engine.step import StepLayer

    ref_model, _ = mlx_lm_tiny
    events, seen = [], {}

    class Recorder(StepLayer):
        def scheduled(self, out):
            events.append(("scheduled", out))

        def before_forward(self, out):
            events.append(("before_forward", out))

        def committed(self, step):
            events.append(("committed", step.out))

        def read_back(self, step):
            events.append(("read_back", step.out))
            for (req, _seq), tok in zip(step.pairs, step.tokens):
                seen.setdefault(req.request_id, []).append(tok)
            return []

    engine = engine_for(tiny_loaded, True)
    engine.layers.append(Recorder())
    prompts = [prompt(i) for i in range(3)]
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), request_id=str(i))
    done = run_all(engine)
    for i, p in enumerate(prompts):
        assert seen[str(i)] == done[str(i)].outputs[0].token_ids == contiguous_generate(ref_model, p, 7)
    launched = [o for k, o in events if k == "before_forward"]
    assert len(launched) >= 7
    for o in launched:
        stages = [k for k, x in events if x is o]  # the objects stay alive in `events`: no id reuse
        assert stages == ["scheduled", "before_forward", "committed", "read_back"], stages
    in_flight = 0
    for k, _ in events:
        in_flight += {"before_forward": 1, "read_back": -1}.get(k, 0)
        assert 0 <= in_flight <= 2
    assert in_flight == 0
    # overlapped: some step is read back only after the next one was launched
    order = [k for k, _ in events if k in ("before_forward", "read_back")]
    assert "before_forward" in [order[i + 1] for i, k in enumerate(order[:-1]) if k == "before_forward"]
