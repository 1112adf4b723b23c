"""Driving an engine in tests: step until every request is done."""

from __future__ import annotations

from click.testing import CliRunner

from mlxpaged.cli.main import main


def run_all(engine, check: bool = True) -> dict:
    """Step `engine` until no request is left; the finished `RequestOutput`s by request id.

    With `check`, the allocator's invariants are asserted after every step.
    """
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check:
            engine.check_invariants()
    return done


def run_work(engine, work, arrivals: dict[int, list] | None = None, after_step=None) -> dict:
    """Queue `work` [(prompt, params)] as requests "0", "1", ...; before step i queue
    `arrivals[i]` (more (prompt, params)); call `after_step(engine)` after every step; at the end
    assert every block's ref_cnt is zero. Returns each finished request's samples' token ids."""
    for i, (p, sp) in enumerate(work):
        engine.add_request(p, sp, request_id=str(i))
    arrivals = dict(arrivals or {})
    done, step, n = {}, 0, len(work)
    while engine.has_unfinished_requests() or arrivals:
        for p, sp in arrivals.pop(step, []):
            engine.add_request(p, sp, request_id=str(n))
            n += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if after_step is not None:
            after_step(engine)
        step += 1
    assert all(b.ref_cnt == 0 for b in engine.block_manager.pool.blocks)
    return {k: [c.token_ids for c in v.outputs] for k, v in done.items()}


def run(*args, input=None):
    return CliRunner().invoke(main, ["generate", *args], input=input)
