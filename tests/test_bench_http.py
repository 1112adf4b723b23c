"""The HTTP benchmark harness (mlxpaged/bench/http.py, http_stats.py): its statistics by hand-worked
examples, and one end-to-end run of both real servers on the tiny model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlxpaged.bench import http, http_stats
from mlxpaged.bench.cli import bench
from mlxpaged.testing.slowness import wall

ROOT = Path(__file__).resolve().parents[1]


# -- the sustainable rate ---------------------------------------------------------------------------
def test_sustainable_rate_interpolates_between_the_last_pass_and_the_first_fail():
    # 0.6 s/tok at rate 2, 1.4 at rate 4: the 1.0 bound is crossed half-way, at rate 3.
    pts = [(1.0, 0.2, 0), (2.0, 0.6, 0), (4.0, 1.4, 0), (8.0, 3.0, 0)]
    assert http_stats.sustainable_rate(pts, 1.0) == (pytest.approx(3.0), None)
    assert http_stats.sustainable_rate(list(reversed(pts)), 1.0) == (pytest.approx(3.0), None)  # order-free


def test_sustainable_rate_needs_every_lower_rate_to_pass_and_failed_requests_fail():
    # Rate 2 fails by a failed request: neither its low latency nor rate 4's rescues it.
    pts = [(1.0, 0.2, 0), (2.0, 0.3, 1), (4.0, 0.4, 0)]
    assert http_stats.sustainable_rate(pts, 1.0) == (1.0, None)
    pts = [(1.0, 0.2, 0), (2.0, 1.5, 0), (4.0, 0.4, 0)]  # a dip at 4 after a fail at 2
    assert http_stats.sustainable_rate(pts, 1.0)[0] == pytest.approx(1.0 + 0.8 / 1.3)


def test_sustainable_rate_says_when_it_is_censored():
    assert http_stats.sustainable_rate([(1.0, 0.1, 0), (2.0, 0.2, 0)], 1.0) == (2.0, "above")
    assert http_stats.sustainable_rate([(1.0, 1.1, 0), (2.0, 0.2, 0)], 1.0) == (0.0, "below")
    assert http_stats.sustainable_rate([(1.0, None, 0)], 1.0) == (0.0, "below")


# -- ratios within repeats ----------------------------------------------------------------------------
def _row(server, load, rate, repeat, lat, failed=0, tokens=(8, 8), rss=100.0):
    return {
        "server": server,
        "load": load,
        "rate": rate,
        "repeat": repeat,
        "norm_latency_mean": lat,
        "norm_latency_median": lat,
        "failed": failed,
        "output_tokens": list(tokens),
        "ttft_ms_median": 1.0,
        "itl_ms_median": 1.0,
        "req_per_s": 1.0,
        "idle_rss_mb": rss,
        "peak_rss_mb": rss,
        "after_rss_mb": rss,
    }


def test_latency_ratios_are_formed_within_each_repeat():
    # Repeat 0 ran on a loaded machine (both slow), repeat 1 on a quiet one. Within repeats the
    # ratios are 4/2 = 2.0 and 0.6/0.5 = 1.2, median 1.6; the ratio of the medians would be
    # ((4 + 0.6) / 2) / ((2 + 0.5) / 2) = 1.84, mixing the two conditions.
    rows = [
        _row("mlxpaged", "sharegpt", 1.0, 0, 2.0),
        _row("mlx_lm", "sharegpt", 1.0, 0, 4.0),
        _row("mlxpaged", "sharegpt", 1.0, 1, 0.5),
        _row("mlx_lm", "sharegpt", 1.0, 1, 0.6),
    ]
    (e,) = http_stats.per_rate(rows)
    r = e["ratio_norm_latency_mean"]
    assert r["median"] == pytest.approx(1.6) and r["min"] == pytest.approx(1.2) and r["max"] == pytest.approx(2.0)
    assert e["lengths_equal"] == [True, True]


def test_a_second_peer_gets_its_own_ratios_within_each_repeat():
    """vllm-mlx beside mlx_lm: each peer's ratios against mlxpaged's run of the same repeat, under
    its own name; mlx_lm's keep theirs. Repeat 0: mlx_lm 4/2 = 2.0, vllm-mlx 3/2 = 1.5; repeat 1:
    0.6/0.5 = 1.2 and 1.0/0.5 = 2.0 (vllm-mlx's medians over its repeats would give 2.0 / 1.25 = 1.6)."""
    rows = [
        _row("mlxpaged", "sharegpt", 1.0, 0, 2.0),
        _row("mlx_lm", "sharegpt", 1.0, 0, 4.0),
        _row("vllm_mlx", "sharegpt", 1.0, 0, 3.0, tokens=(8, 7)),
        _row("mlxpaged", "sharegpt", 1.0, 1, 0.5),
        _row("mlx_lm", "sharegpt", 1.0, 1, 0.6),
        _row("vllm_mlx", "sharegpt", 1.0, 1, 1.0),
    ]
    (e,) = http_stats.per_rate(rows)
    assert e["ratio_norm_latency_mean"]["values"] == [pytest.approx(2.0), pytest.approx(1.2)]
    assert e["ratio_norm_latency_mean_vllm_mlx"]["values"] == [pytest.approx(1.5), pytest.approx(2.0)]
    assert e["lengths_equal"] == [True, True] and e["lengths_equal_vllm_mlx"] == [False, True]
    assert e["vllm_mlx_norm_latency_mean"]["median"] == pytest.approx(2.0)
    s = http_stats.sustainable(rows, "sharegpt", 2.5)  # mlxpaged and mlx_lm pass both runs; vllm-mlx one
    assert [r["ratio_vllm_mlx"] for r in s["per_repeat"]] == [None, pytest.approx(1.0)]
    assert "mlxpaged/vllm_mlx" in http_stats.sustainable_line("sharegpt", s)


def _n4_rows() -> list[dict]:
    """Two repeats of three rates. At the 1 s/token bound:
    repeat 0: mlxpaged passes 1 and 2, fails 4 at 1.4 -> 3.0; mlx_lm fails 2 at 1.4 -> 1.5; ratio 2.0.
    repeat 1: mlxpaged passes everything -> 4.0 (censored above); mlx_lm fails 2 by a failed request,
    not interpolated -> 1.0; ratio 4.0."""
    rows = []
    for rate, a, b in ((1.0, 0.2, 0.6), (2.0, 0.6, 1.4), (4.0, 1.4, 3.0)):
        rows += [_row("mlxpaged", "n4", rate, 0, a), _row("mlx_lm", "n4", rate, 0, b)]
    for rate, a, b in ((1.0, 0.1, 0.5), (2.0, 0.2, 0.9), (4.0, 0.3, 3.0)):
        rows += [_row("mlxpaged", "n4", rate, 1, a), _row("mlx_lm", "n4", rate, 1, b, failed=int(rate == 2.0))]
    return rows


def test_sustainable_ratio_is_formed_within_each_repeat():
    s = http_stats.sustainable(_n4_rows(), "n4", 1.0)
    assert [r["ratio"] for r in s["per_repeat"]] == [pytest.approx(2.0), pytest.approx(4.0)]
    assert s["ratio"]["median"] == pytest.approx(3.0)
    assert s["per_repeat"][1]["mlxpaged_censored"] == "above"
    assert s["mlxpaged"]["values"] == [pytest.approx(3.0), 4.0] and s["mlx_lm"]["values"] == [pytest.approx(1.5), 1.0]


def _doc(rows, bound=1.0, commit="c0", dirty=False, **over):
    return {
        "kind": "serve",
        "model": "m",
        "provenance": {"command": "python scripts/bench_http.py ..."},
        "rates": sorted({r["rate"] for r in rows}),
        "extend": 0,
        "num_requests": 16,
        "max_prompt": 256,
        "max_output": 32,
        "trace": "sharegpt",
        "repeats": 2,
        "bound_s_per_token": bound,
        "mlxpaged_args": ["--dtype", "float32"],
        "git_at_start": {"commit": commit, "dirty": dirty},
        "rows": rows,
        **over,
    }


def test_merged_runs_keep_each_loads_ratios():
    # _n4_rows (ratios 2.0 and 4.0) and the sharegpt rows of
    # test_latency_ratios_are_formed_within_each_repeat (1.2 and 2.0), run apart.
    n4 = _n4_rows()
    share = [
        _row("mlxpaged", "sharegpt", 0.5, 0, 2.0),
        _row("mlx_lm", "sharegpt", 0.5, 0, 4.0),
        _row("mlxpaged", "sharegpt", 0.5, 1, 0.5),
        _row("mlx_lm", "sharegpt", 0.5, 1, 0.6),
    ]
    m = http_stats.merge([_doc(share), _doc(n4, system_prompt_tokens=None)], bounds=(2.0,))
    assert m["loads"] == ["sharegpt", "n4"] and len(m["rows"]) == len(share) + len(n4)
    assert m["rates"] == [0.5, 1.0, 2.0, 4.0] and [s["loads"] for s in m["sources"]] == [["sharegpt"], ["n4"]]
    assert [r["ratio"] for r in m["sustainable"]["n4"]["per_repeat"]] == [pytest.approx(2.0), pytest.approx(4.0)]
    (e,) = [e for e in m["per_rate"] if e["load"] == "sharegpt"]
    assert e["ratio_norm_latency_mean"]["values"] == [pytest.approx(2.0), pytest.approx(1.2)]
    # At 2 s/token: repeat 0, mlxpaged passes all (4.0, censored above) and mlx_lm fails 4 at 3.0,
    # so 2 + (2 - 1.4) / (3.0 - 1.4) * 2 = 2.75; repeat 1, mlx_lm failed a request at 2 -> 1.0.
    at2 = m["sustainable_by_bound"]["2"]["n4"]["per_repeat"]
    assert [r["ratio"] for r in at2] == [pytest.approx(4.0 / 2.75), pytest.approx(4.0)]


def test_runs_with_other_settings_or_code_are_not_merged():
    a = [_row("mlxpaged", "sharegpt", 1.0, 0, 0.5), _row("mlx_lm", "sharegpt", 1.0, 0, 0.6)]
    b = [_row("mlxpaged", "n4", 1.0, 0, 0.5), _row("mlx_lm", "n4", 1.0, 0, 0.6)]
    with pytest.raises(ValueError, match="bound_s_per_token"):
        http_stats.merge([_doc(a), _doc(b, bound=0.5)])
    with pytest.raises(ValueError, match="clean commit"):
        http_stats.merge([_doc(a), _doc(b, dirty=True)])
    with pytest.raises(ValueError, match="clean commit"):
        http_stats.merge([_doc(a), _doc(b, commit="c1")])
    with pytest.raises(ValueError, match="more than one run"):
        http_stats.merge([_doc(a), _doc(a)])
    other_rate = [dict(r, rate=2.0) for r in a]
    with pytest.raises(ValueError, match="sharegpt ran with 16 and 8 requests"):
        http_stats.merge([_doc(a), _doc(other_rate, num_requests=8)])


def test_a_merge_takes_more_rates_of_a_load_and_an_earlier_merge():
    # The merge of test_merged_runs_keep_each_loads_ratios, then n4 at rate 8 from a later run.
    # Repeat 1's mlxpaged passed every rate up to 4 (0.3 s/token, censored above at 4.0); at 8 it
    # reads 1.3, so the bound is crossed at 4 + (1 - 0.3) / (1.3 - 0.3) * 4 = 6.8 and the ratio
    # against mlx_lm's 1.0 becomes 6.8. Repeat 0 had failed already at 4: unchanged at 2.0.
    share = [_row("mlxpaged", "sharegpt", 0.5, 0, 2.0), _row("mlx_lm", "sharegpt", 0.5, 0, 4.0)]
    first = http_stats.merge([_doc(share), _doc(_n4_rows())])
    more = [
        _row(s, "n4", 8.0, k, lat)
        for k, (a, b) in enumerate(((3.0, 5.0), (1.3, 5.0)))
        for s, lat in (("mlxpaged", a), ("mlx_lm", b))
    ]
    m = http_stats.merge([first, _doc(more, provenance={"command": "later"})])
    assert m["loads"] == ["sharegpt", "n4"] and m["rates"] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert m["sources"][-1]["command"] == "later"
    assert len(m["sources"]) == 3 and len(m["rows"]) == len(first["rows"]) + 4
    n4 = m["sustainable"]["n4"]["per_repeat"]
    assert [r["ratio"] for r in n4] == [pytest.approx(2.0), pytest.approx(6.8)] and n4[1]["mlxpaged_censored"] is None


def test_first_server_alternates_per_case_and_per_repeat():
    two = ("mlxpaged", "mlx_lm")
    assert [http.server_order(two, c, 0)[0] for c in range(4)] == ["mlxpaged", "mlx_lm", "mlxpaged", "mlx_lm"]
    assert [http.server_order(two, 0, r)[0] for r in range(3)] == ["mlxpaged", "mlx_lm", "mlxpaged"]
    three = two + ("vllm_mlx",)
    for case in range(3):  # with a second peer: each server first once in three repeats, each runs once
        orders = [http.server_order(three, case, r) for r in range(3)]
        assert sorted(o[0] for o in orders) == sorted(three) and all(sorted(o) == sorted(three) for o in orders)


# -- what each server is asked -------------------------------------------------------------------------
def test_request_bodies_match_stopping_and_send_no_seed():
    req = http.Req("hi", 7, system="be brief")
    ours = http.request_body("mlxpaged", "m", req, 4, [2, 5])
    peer = http.request_body("mlx_lm", "m", req, 4, [2, 5])
    assert ours["ignore_eos"] is True and ours["n"] == 4 and "logit_bias" not in ours
    assert peer["logit_bias"] == {"2": -100.0, "5": -100.0} and "n" not in peer and "ignore_eos" not in peer
    for body in (ours, peer):
        assert "seed" not in body and body["max_tokens"] == 7 and body["messages"][0]["role"] == "system"
    assert ours["temperature"] == peer["temperature"] == 0.8  # the n=4 load samples on both


def test_a_request_with_another_length_fails():
    res = http.RunResult("mlx_lm", "n4", 1.0, n=4, output_tokens=[None, None])
    ok = http.Part(ok=True, t0=0.0, first=0.1, last=0.5, end=0.6, completion_tokens=5)
    short = http.Part(ok=True, t0=0.0, first=0.1, last=0.4, end=0.5, completion_tokens=4)  # stopped at its EOS
    http.record(res, 0, http.Req("a", 5), [ok] * 4, 4)
    http.record(res, 1, http.Req("b", 5), [ok, ok, short, ok], 4)
    assert (res.completed, res.failed, res.length_mismatches) == (1, 1, 1)
    assert res.output_tokens == [20, 19]
    assert res.norm_latency == [pytest.approx(0.6 / 5)]  # done when the last of the four is


def test_a_dirty_tree_is_refused(monkeypatch):
    import mlxpaged.bench.report as report

    monkeypatch.setattr(report, "git_state", lambda: {"commit": "abc", "dirty": True})
    r = CliRunner().invoke(bench, ["serve", "--tiny", "--rates", "1"])
    assert r.exit_code == 1 and "uncommitted changes" in r.output


def test_unknown_or_missing_servers_are_refused_in_one_line(monkeypatch):
    import mlxpaged.bench.report as report

    monkeypatch.setattr(report, "git_state", lambda: {"commit": "abc", "dirty": False})
    monkeypatch.delenv("MLXPAGED_VLLM_MLX", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # no vllm-mlx script to be found either
    for servers, why in (
        ("mlxpaged,tgi", "--servers takes"),
        ("mlx_lm", "--servers takes"),
        ("mlxpaged,vllm_mlx", "vllm-mlx is not installed"),
    ):
        r = CliRunner().invoke(bench, ["serve", "--tiny", "--rates", "1", "--servers", servers])
        assert r.exit_code == 1 and why in r.output and len(r.output.strip().splitlines()) == 1, r.output


# -- both real servers, end to end ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [
        sys.executable,
        "scripts/bench_http.py",
        "--tiny",
        "--trace",
        "builtin",
        "--loads",
        "sharegpt,n4",
        "--rates",
        "4",
        "--repeats",
        "1",
        "--extend",
        "0",
        "--num-requests",
        "3",
        "--max-output",
        "6",
        "--settle",
        "0.3",
        "--allow-dirty",
        "--out",
        str(out),
    ]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=wall(900))
    assert p.returncode == 0, p.stderr[-3000:]
    (path,) = out.glob("serve_*.json")
    return json.loads(path.read_text())


def test_tiny_run_writes_every_field(tiny_run):
    doc = tiny_run
    assert doc["kind"] == "serve" and doc["provenance"]["git"]["commit"] != ""
    assert doc["git_at_start"]["commit"] == doc["provenance"]["git"]["commit"]  # nothing committed meanwhile
    for f in ("rates", "repeats", "bound_s_per_token", "peer_args", "mlxpaged_args", "rows", "per_rate", "sustainable"):
        assert f in doc, f
    assert {(r["server"], r["load"]) for r in doc["rows"]} == {
        (s, load) for s in ("mlxpaged", "mlx_lm") for load in ("sharegpt", "n4")
    }
    for r in doc["rows"]:
        for f in (
            "norm_latency_mean",
            "norm_latency_median",
            "ttft_ms_median",
            "idle_rss_mb",
            "peak_rss_mb",
            "after_rss_mb",
        ):
            assert r[f] is not None and r[f] > 0, (f, r)
        assert r["failed"] == 0 and r["completed"] == 3, r["errors"]


def test_tiny_run_both_servers_produce_the_asked_lengths(tiny_run):
    for r in tiny_run["rows"]:
        n = 4 if r["load"] == "n4" else 1
        assert r["output_tokens"] == [n * 6] * 3, r
    assert all(all(e["lengths_equal"]) for e in tiny_run["per_rate"])


def test_tiny_run_ratios_come_from_the_same_repeat(tiny_run):
    rows = tiny_run["rows"]
    for e in tiny_run["per_rate"]:
        (a,) = [r for r in rows if r["server"] == "mlxpaged" and r["load"] == e["load"]]
        (b,) = [r for r in rows if r["server"] == "mlx_lm" and r["load"] == e["load"]]
        assert e["ratio_norm_latency_mean"]["values"] == [
            pytest.approx(b["norm_latency_mean"] / a["norm_latency_mean"])
        ]
        assert a["first"] == b["first"]
    firsts = {e["load"]: [r["first"] for r in rows if r["load"] == e["load"]][0] for e in tiny_run["per_rate"]}
    assert set(firsts.values()) == {"mlxpaged", "mlx_lm"}  # two (load, rate) cases, alternating


def test_the_mlxpaged_server_runs_the_harness_own_package(tmp_path, monkeypatch):
    """`python -m mlxpaged.cli` imports the package of its working folder first: run from another
    checkout (here a decoy package), the server would time that code under this harness's
    provenance. The harness starts it in its own package's folder."""
    from mlxpaged.bench.report import PACKAGE_ROOT

    (tmp_path / "mlxpaged").mkdir()
    (tmp_path / "mlxpaged" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    probe = [sys.executable, "-c", "import mlxpaged; print(mlxpaged.__file__)"]  # `-c` puts the folder first, as `-m`

    def imported(cwd):
        return subprocess.run(probe, cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()

    assert imported(None).startswith(str(tmp_path))  # the decoy, without a folder of its own
    assert imported(http.server_cwd("mlxpaged")) == str(PACKAGE_ROOT / "mlxpaged" / "__init__.py")
    assert http.server_cwd("mlx_lm") is None and http.server_cwd("vllm_mlx") is None


# A server that writes `LOG` bytes to stderr, then answers /health (or, with `fail`, exits 3).
CHATTY = """
import http.server, sys
sys.stderr.write("x" * {log} + "\\nlast words\\n"); sys.stderr.flush()
if {fail}:
    sys.exit(3)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", {port}), H).serve_forever()
"""


def test_a_server_that_logs_a_lot_is_not_stalled_by_its_stderr():
    """Nobody reads a server's stderr while it runs: written to a pipe, 1 MB of logging (vllm-mlx
    logs a line per open request every 5 s) would block the server before it answered. Its last
    words still reach the error when it exits."""
    port = http.free_port()
    server = http.ServerProc(
        "chatty", [sys.executable, "-c", CHATTY.format(log=2**20, fail=False, port=port)], port, 30
    )
    try:
        assert server.log_tail(11) == "last words\n"
    finally:
        server.stop()
    with pytest.raises(RuntimeError, match="chatty exited: x*\nlast words"):
        http.ServerProc("chatty", [sys.executable, "-c", CHATTY.format(log=2**20, fail=True, port=port)], port, 30)
