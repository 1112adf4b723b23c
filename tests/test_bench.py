"""The benchmark harnesses (mlxpaged/bench/) on the tiny model: their JSON fields, that every
ratio is formed within a repeat, and that the order alternates. Timings are not asserted."""

import json
import statistics

import pytest

from mlxpaged.bench import concurrency, serving, throughput
from mlxpaged.bench.repeat import alternate, spread


def test_alternate_runs_each_side_first_in_turn():
    log = []
    out = alternate(lambda: log.append("a") or len(log), lambda: log.append("b") or len(log), 4)
    assert log == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert [f for _, _, f in out] == ["a", "b", "a", "b"]
    assert [(ra, rb) for ra, rb, _ in out] == [(1, 2), (4, 3), (5, 6), (8, 7)]  # each pair from its own repeat
    with pytest.raises(ValueError):
        alternate(lambda: 0, lambda: 0, 0)


def test_spread_is_median_and_range():
    s = spread([3.0, 1.0, 2.0, 10.0])
    assert s == {
        "median": statistics.median([3.0, 1.0, 2.0, 10.0]),
        "min": 1.0,
        "max": 10.0,
        "values": [3.0, 1.0, 2.0, 10.0],
    }


@pytest.fixture(scope="module")
def ref_model(mlx_lm_tiny, tiny_loaded):
    model, _ = mlx_lm_tiny
    model.set_dtype(tiny_loaded.dtype)
    return model


def test_throughput_rows_ratio_within_repeat(tiny_loaded, ref_model):
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + i)] for i in range(3)]
    cases = throughput.make_cases(prompts, [1, 3], samples=2, temperature=0.0)
    rows = throughput.compare(tiny_loaded, ref_model, cases, max_tokens=4, repeats=2)
    assert [r["case"] for r in rows] == [c.name for c in cases]
    for r in rows:
        assert set(r) >= {
            "case",
            "requests",
            "n",
            "ratio_output_tps",
            "mlxpaged_output_tps",
            "mlx_lm_output_tps",
            "ttft_ms_median",
            "itl_ms_median",
            "peak_memory_gb",
            "first",
            "runs",
        }
        assert r["first"] == ["mlxpaged", "mlx_lm"]
        want = [run["mlxpaged"]["output_tps"] / run["mlx_lm"]["output_tps"] for run in r["runs"]]
        assert r["ratio_output_tps"]["values"] == pytest.approx(want)
        assert r["ratio_output_tps"]["median"] == pytest.approx(statistics.median(want))
        for run in r["runs"]:  # both systems produced every requested token
            assert run["mlxpaged"]["output_tokens"] == run["mlx_lm"]["output_tokens"] == r["requests"] * r["n"] * 4
    json.dumps(rows)  # JSON-ready


def test_serving_rows_ratio_within_repeat(tiny_loaded, ref_model):
    pairs = [(12, 5), (30, 3), (7, 6), (20, 4)]
    rows = serving.compare(
        tiny_loaded,
        ref_model,
        pairs,
        num_requests=4,
        rate=0.0,
        max_prompt=32,
        max_output=6,
        kv_tokens=512,
        block_size=16,
        max_num_seqs=8,
        system_prompt=16,
        repeats=2,
    )
    assert [r["system_prompt_len"] for r in rows] == [0, 16]
    for r in rows:
        assert r["first"] == ["mlxpaged", "mlx_lm"]
        for k, ratio in r["ratio"].items():
            assert ratio["values"] == pytest.approx(
                [a / b for a, b in zip(r["mlxpaged"][k]["values"], r["mlx_lm"][k]["values"])]
            )
        assert r["mlxpaged"]["requests"]["values"] == r["mlx_lm"]["requests"]["values"] == [4, 4]
    assert "requests_per_s" in rows[0]["ratio"]
    json.dumps(rows)


def test_concurrency_rows(tiny_loaded):
    pairs = [(100 + 5 * i, 4 + i % 4) for i in range(40)]  # more than 2,100 slots hold at once, even exactly
    rows = concurrency.compare(tiny_loaded, pairs, capacity=2100, block_size=16)
    assert [r.scheme for r in rows][1:] == ["max", "pow2", "oracle"] and rows[0].scheme.startswith("mlxpaged")
    for r in rows:
        assert 0 < r.real_share <= 1 and r.peak_running >= 1 and r.steps > 0
        json.dumps(r.as_dict())
    head = concurrency.headline(rows)
    assert head["saturated_running"][2] == pytest.approx(rows[0].saturated_running / rows[3].saturated_running)
