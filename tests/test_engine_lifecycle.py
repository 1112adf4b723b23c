"""Request life cycle in the engine: stop tokens out of the text, abort, a failing step, metrics."""

import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.core.sequence import RequestStatus
from mlxpaged.errors import StepError

from drive import run_all
from reference import contiguous_generate

PROMPT = "The KV cache stores"


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


@pytest.mark.parametrize("how", ["eos", "stop_token_ids"])
def test_stopping_token_is_kept_in_ids_but_not_in_text(tiny_loaded, mlx_lm_tiny, how):
    ref_model, tok = mlx_lm_tiny
    ids = tok.encode(PROMPT)
    ref = contiguous_generate(ref_model, ids, 12)
    stop_tok = ref[6]
    cut = ref.index(stop_tok)  # the first time the model emits it
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=32, attention_impl="reference"))
    if how == "eos":
        engine.eos_token_ids = {stop_tok}
        params = greedy(12)
    else:
        params = greedy(12, stop_token_ids=[stop_tok], ignore_eos=True)
    rid = engine.add_request(ids, params)
    out = run_all(engine)[rid].outputs[0]
    assert out.token_ids == ref[: cut + 1] and out.finish_reason == "stop"
    assert out.text == tok.decode(ref[:cut])  # the stopping token's text never reaches the output


def test_ignore_eos_keeps_going_and_keeps_the_text(tiny_loaded, mlx_lm_tiny):
    ref_model, tok = mlx_lm_tiny
    ids = tok.encode(PROMPT)
    ref = contiguous_generate(ref_model, ids, 10)
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=32, attention_impl="reference"))
    engine.eos_token_ids = {ref[3]}
    rid = engine.add_request(ids, greedy(10, ignore_eos=True))
    out = run_all(engine)[rid].outputs[0]
    assert out.token_ids == ref and out.text == tok.decode(ref)


def test_abort_frees_blocks_at_once_and_others_go_on(tiny_loaded, mlx_lm_tiny):
    ref_model, tok = mlx_lm_tiny
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=64, attention_impl="reference"))
    keep = engine.add_request(PROMPT, greedy(30, ignore_eos=True))
    drop = engine.add_request(
        "Paged attention borrows an idea", SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=30, ignore_eos=True)
    )
    queued = engine.add_request("Write a Python function", greedy(5))
    for _ in range(4):
        engine.step()
    req = engine._requests[drop]
    assert req.status is RequestStatus.RUNNING and all(s.block_table for s in req.seqs)
    used_before = engine.block_manager.pool.num_used
    assert engine.abort_request(drop) and not engine.abort_request(drop)
    assert req.status is RequestStatus.FINISHED and all(not s.block_table for s in req.seqs)
    assert all(s.finish_reason.value == "abort" for s in req.seqs)
    assert engine.block_manager.pool.num_used < used_before
    engine.check_invariants()
    done = run_all(engine)
    assert drop not in done
    assert done[keep].outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(PROMPT), 30)
    assert engine.metrics()["kv_blocks_used"] == 0 and queued in done


def test_abort_a_waiting_request(tiny_loaded):
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=64, attention_impl="reference"))
    rid = engine.add_request(PROMPT, greedy(5))
    req = engine._requests[rid]
    assert req.status is RequestStatus.WAITING
    assert engine.abort_request(rid)
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_a_failing_step_fails_only_its_requests(tiny_loaded, mlx_lm_tiny, monkeypatch):
    ref_model, tok = mlx_lm_tiny
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=64, attention_impl="reference"))
    a = engine.add_request(PROMPT, greedy(8, ignore_eos=True))
    engine.step()
    real_forward = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda batch: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(StepError) as e:
        engine.step()
    assert e.value.request_ids == [a] and "boom" in str(e.value)
    assert engine.metrics()["kv_blocks_used"] == 0 and not engine.has_unfinished_requests()
    monkeypatch.setattr(engine.runner, "forward", real_forward)
    b = engine.add_request(PROMPT, greedy(8, ignore_eos=True))
    assert run_all(engine)[b].outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(PROMPT), 8)


def test_metrics_count_running_waiting_and_blocks(tiny_loaded):
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=64, max_num_seqs=2, attention_impl="reference"))
    for i in range(3):
        engine.add_request(f"{PROMPT} {i}", greedy(4, ignore_eos=True))
    engine.step()
    m = engine.metrics()
    assert (m["requests_running"], m["requests_waiting"]) == (2, 1)
    held = {b.block_id for s in engine.live_sequences() for b in s.block_table}
    assert m["kv_blocks_used"] == len(held) and m["kv_blocks_total"] == 64
    run_all(engine)
    m = engine.metrics()
    assert m["kv_blocks_used"] == 0 and m["generation_tokens"] == 12 and m["requests_running"] == 0
