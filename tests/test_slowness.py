"""The tests' own time limits: stretched for a busy machine (mlxpaged/testing/slowness.py, tests/conftest.py)."""

from __future__ import annotations

import os

import pytest

from mlxpaged.testing import slowness


def test_slowdown_follows_the_load_per_core(monkeypatch):
    monkeypatch.delenv("MLXPAGED_TEST_SLOWDOWN", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (8.0, 6.0, 3.0))
    assert slowness.slowdown() == 4.0 and slowness.wall(1.5) == 6.0
    assert slowness.timeout_scale() == 8.0  # a process on both cores gets a quarter of one
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    assert slowness.slowdown() == 1.0 and slowness.wall(2.0) == 2.0  # a quiet machine: the limit as written
    assert slowness.timeout_scale() == slowness.LIVELOCK_SCALE
    monkeypatch.setenv("MLXPAGED_TEST_SLOWDOWN", "3")
    assert slowness.slowdown() == 3.0


@pytest.mark.timeout(7)
def test_a_tests_own_timeout_is_stretched(request):
    """The mark above is this test's quiet-machine limit; what pytest-timeout reads is it times the
    run's scale (taken at collection, from the load then)."""
    assert request.node.get_closest_marker("timeout").args[0] >= 7 * slowness.LIVELOCK_SCALE


def test_the_default_timeout_is_stretched(request, pytestconfig):
    limit = request.node.get_closest_marker("timeout").args[0]
    assert limit >= float(pytestconfig.getini("timeout")) * slowness.LIVELOCK_SCALE
