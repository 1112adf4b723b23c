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


def run(*args, input=None):
    return CliRunner().invoke(main, ["generate", *args], input=input)
