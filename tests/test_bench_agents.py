"""The coding-agent benchmark (mlxpaged/bench/agents.py): one K=2, T=3 replay with the restart
variant against both real servers on the tiny model, short prompts so that it stays cheap."""

from pathlib import Path

import pytest

from mlxpaged.bench import agents, http
from mlxpaged.bench.models import tiny_checkpoint

K, T, MAX_TOKENS = 2, 3, 4
SYSTEM = "You are a coding agent. Use the tools."


@pytest.fixture(scope="module")
def result():
    path = http.float32_copy(tiny_checkpoint())
    return agents.run(
        path,
        [K],
        T,
        1,
        MAX_TOKENS,
        restart=True,
        progress=lambda s: None,
        system=SYSTEM,
        tools=agents.TOOLS[:1],
        result_tokens=(20, 40),
    )


def test_replay_fields_lengths_and_growing_prompts(result):
    rows = result["rows"]
    assert {(r["server"], r["restart"]) for r in rows} == {
        (s, v) for s in agents.DEFAULT_SERVERS for v in (False, True)
    }
    for r in rows:
        assert r["failed"] == 0, r["errors"]
        for key in ("ttft_per_turn", "ttft_ms_later_median", "wall_s", "output_tok_per_s", "peak_rss_mb"):
            assert r[key] is not None, key
        assert r["final_rss_mb"] > 0 and r["peak_rss_mb"] >= r["final_rss_mb"] * 0.5
        assert len(r["ttft_per_turn"]) == T
        assert r["computed_prompt_tokens"] == r["prompt_tokens"] - r["cached_tokens"]
        for c in range(K):
            turns = [d for d in r["turns_detail"] if d["conv"] == c]
            assert [d["completion_tokens"] for d in turns] == [MAX_TOKENS] * T  # equal lengths, both servers
            sizes = [d["prompt_tokens"] for d in turns]
            assert all(b > a for a, b in zip(sizes, sizes[1:])), sizes  # prompts grow every turn
            for d in turns:  # sent, first text, end in that order, on the replay's clock
                assert 0 <= d["sent_s"] and d["sent_s"] + d["ttft_s"] <= d["end_s"]
    # Both servers saw the same prompts (same tokenizer, same bytes), since they gave the same answers.
    by = {(r["server"], r["restart"]): [d["prompt_tokens"] for d in r["turns_detail"]] for r in rows}
    assert by[("mlxpaged", False)] == by[("mlx_lm", False)]
    heads = {
        (r["server"], r["restart"]): sorted((d["conv"], d["turn"], d["answer_head"]) for d in r["turns_detail"])
        for r in rows
    }
    assert heads[("mlxpaged", False)] == heads[("mlx_lm", False)]
    assert all(0 < len(h) <= agents.ANSWER_HEAD for _, _, h in heads[("mlxpaged", False)])


def test_shared_system_prompt_is_served_from_cache(result):
    # Later turns extend the same conversation: some of every later turn's prompt is cached.
    for r in result["rows"]:
        if not r["restart"]:
            later = [d for d in r["turns_detail"] if d["turn"] > 0]
            assert all(d["cached_tokens"] > 0 for d in later), (r["server"], later)


def test_ratios_within_a_repeat(result):
    rows = {(r["server"], r["restart"]): r for r in result["rows"]}
    ratios = result["ratios"]
    assert len(ratios) == 2
    for q in ratios:
        me, peer = rows[("mlxpaged", q["restart"])], rows[(q["peer"], q["restart"])]
        assert q["repeat"] == me["repeat"] == peer["repeat"]
        assert q["wall_ratio"] == pytest.approx(me["wall_s"] / peer["wall_s"])
        if q["restart"]:
            after = me["ttft_ms_after_restart_median"] / peer["ttft_ms_after_restart_median"]
            assert q["ttft_after_restart_ratio"] == pytest.approx(after)
        else:
            assert q["ttft_after_restart_ratio"] is None


def test_restart_variant_second_half_runs_on_a_restarted_server(result):
    for r in result["rows"]:
        gens = {(d["turn"], d["server_generation"]) for d in r["turns_detail"]}
        if r["restart"]:
            assert r["restart_at_turn"] == T // 2
            assert gens == {(t, 0 if t < T // 2 else 1) for t in range(T)}
            assert r["ttft_ms_after_restart_median"] is not None
        else:
            assert {g for _, g in gens} == {0}
    assert (
        "--prefix-cache-dir"
        in next(r for r in result["rows"] if r["restart"] and r["server"] == "mlxpaged")["server_args"]
    )


def test_corpus_is_fixed_by_the_seed():
    class Tok:
        encode = staticmethod(lambda s: s.split(" "))
        decode = staticmethod(lambda ids: " ".join(ids))

    a, b = agents.tool_results(Tok(), 4, seed=3), agents.tool_results(Tok(), 4, seed=3)
    assert a == b and all(text for _, text in a)
    assert agents.tool_results(Tok(), 4, seed=4) != a


def test_every_server_goes_first_in_turn():
    servers = ("mlxpaged", "mlx_lm", "vllm_mlx")
    orders = [http.server_order(servers, case, 0) for case in range(6)]
    assert all(sorted(o) == sorted(servers) for o in orders)
    firsts = [o[0] for o in orders]
    assert all(firsts.count(s) == 2 for s in servers)
    assert [http.server_order(servers[:2], c, 0)[0] for c in range(4)] == ["mlxpaged", "mlx_lm"] * 2


@pytest.fixture
def replays(monkeypatch):
    """`run` with its replays recorded, not run: (server, restart variant, server flags) each."""
    calls = []

    def fake_replay(name, path, extra, k, turns, max_tokens, eos, results, restart, *a):
        calls.append((name, restart, extra))
        return {
            "server": name,
            "wall_s": 1.0,
            "ttft_ms_later_median": 1.0,
            "cached_tokens": 0,
            "prompt_tokens": 1,
            "failed": 0,
        }

    monkeypatch.setattr(agents, "replay", fake_replay)
    monkeypatch.setattr(agents, "ratios", lambda rows: [])
    return calls


def test_the_replays_alternate_which_server_goes_first(replays):
    """Through `run`: with two servers, repeats and loads alternate who starts (a bug once put
    mlxpaged first in every repeat: the case and repeat counters moved together)."""
    path = http.float32_copy(tiny_checkpoint())
    agents.run(path, [1, 2], 2, 3, 4, progress=lambda s: None, result_tokens=(5, 10))
    firsts = [name for name, _, _ in replays[::2]]  # each (K, repeat) runs both servers
    assert firsts == ["mlxpaged", "mlx_lm", "mlxpaged", "mlx_lm", "mlxpaged", "mlx_lm"]


def test_restart_only_runs_the_restart_variant_alone(replays, monkeypatch):
    """`--restart-only` (a peer added to the restart figures): every replay restarts, each server
    with its disk tier; `--restart` runs the plain variant too."""
    calls = replays
    path = http.float32_copy(tiny_checkpoint())
    agents.run(path, [1], 2, 2, 4, restart_only=True, progress=lambda s: None, result_tokens=(5, 10))
    assert [(n, r) for n, r, _ in calls] == [("mlxpaged", True), ("mlx_lm", True), ("mlx_lm", True), ("mlxpaged", True)]
    assert all("--prefix-cache-dir" in extra for n, _, extra in calls if n == "mlxpaged")
    calls.clear()
    agents.run(path, [1], 2, 1, 4, restart=True, progress=lambda s: None, result_tokens=(5, 10))
    assert sorted(r for _, r, _ in calls) == [False, False, True, True]
    calls.clear()  # and from the command line (its call passes the flags in their order)
    monkeypatch.setattr(agents.http, "float32_copy", lambda p: path)
    import mlxpaged.bench.report as report

    monkeypatch.setattr(report, "git_state", lambda: {"commit": "abc", "dirty": False})
    monkeypatch.setattr(report, "write_result", lambda *a, **kw: Path("/nonexistent/r.json"))
    assert agents.main(["--tiny", "--ks", "1", "--turns", "2", "--repeats", "1", "--restart-only"]) == 0
    assert sorted(r for _, r, _ in calls) == [True, True]


def test_vllm_mlx_runs_from_its_own_venv(tmp_path, monkeypatch):
    """vllm-mlx is started with its venv's Python (read off its script's first line), the same
    OpenBLAS, its CLI's `serve` with continuous batching and the paged and prefix caches, no request
    timeout (its default 300 s aborts a first turn at K = 4 here); without
    a venv the harness says how to make one, in one line."""
    script = tmp_path / "vllm-mlx"
    script.write_text("#!/opt/v/bin/python3\nimport sys\n")
    monkeypatch.setenv("MLXPAGED_VLLM_MLX", str(script))
    cmd = http.server_command("vllm_mlx", "/m", 8123, ["--ssd-cache-dir", "/d"])
    assert cmd[0] == "/opt/v/bin/python3" and cmd[1] == "-c" and "from vllm_mlx.cli import main" in cmd[2]
    assert cmd[3:] == [
        "serve",
        "/m",
        "--port",
        "8123",
        "--continuous-batching",
        "--use-paged-cache",
        "--enable-prefix-cache",
        "--timeout",
        "86400",
        "--ssd-cache-dir",
        "/d",
    ]
    assert agents.server_extra("vllm_mlx", 4, True, "/d", []) == ["--ssd-cache-dir", "/d"]
    assert agents.server_extra("vllm_mlx", 4, False, None, []) == []
    monkeypatch.setenv("MLXPAGED_VLLM_MLX", str(tmp_path / "none"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match="vllm-mlx is not installed: make a venv of its own"):
        http.vllm_mlx_python()
