"""Tensor parallelism over mx.distributed: two local ranks (ring backend) against one process.

Each launch runs tests/tp_worker.py on two ranks; the single-process engine runs the same
workload here and is the reference: sharding splits the arithmetic, not what is computed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tp_worker

from mlxpaged.distributed.sharding import check_shardable, shard_axis
from mlxpaged.errors import MlxPagedError
from mlxpaged.testing.slowness import wall

from launch import _free_port_pair, _ring_can_start, ring_command, wait_healthy  # noqa: E402

WORKER = str(Path(__file__).with_name("tp_worker.py"))


pytestmark = pytest.mark.skipif(_ring_can_start() is not None, reason=str(_ring_can_start()))


def launch(out: Path, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`mlx.launch -n 2 --backend ring` the worker; its output files land in `out`."""
    cmd = [
        *ring_command(),
        WORKER,
        "--out",
        str(out),
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=wall(timeout), env={**os.environ, **(env or {})})


def spawn_ranks(out: Path, *args: str, env: dict | None = None) -> list[subprocess.Popen]:
    """Start the two ranks the way mlx.launch does (MLX_RANK + MLX_HOSTFILE), so each rank's own
    exit code and stderr can be watched (mlx.launch exits 0 whatever its ranks do)."""
    port = _free_port_pair()
    hostfile = out / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    return [
        subprocess.Popen(
            [sys.executable, WORKER, "--out", str(out), *args],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {}), "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)},
        )
        for r in range(2)
    ]


def _finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str, float]]:
    """(exit code, stderr, exit time) of each rank; a rank still alive after `timeout` is killed."""
    res = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=wall(timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        res.append((p.returncode, err, time.time()))
    return res


def _error_lines(stderr: str) -> list[str]:
    # The ring backend prints its own "[ring] ..." diagnostics to stderr; ours start with "error:".
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# -- the main check: one launch, everything compared -----------------------------------------------------
@pytest.fixture(scope="module")
def tiny_quantized(tiny_model_path, tmp_path_factory) -> Path:
    """The tiny checkpoint quantized by mlx-lm (4 bits, group 64): the sharded quantized layers."""
    from mlx_lm import convert

    out = tmp_path_factory.mktemp("tp") / "tiny-q4"
    convert(str(tiny_model_path), mlx_path=str(out), quantize=True, q_group_size=64, q_bits=4)
    return out


@pytest.fixture(scope="module")
def tp_run(tiny_model_path, tiny_quantized, tmp_path_factory) -> Path:
    """One launch of two ranks running the workload on the float and the quantized checkpoint,
    then on the float one with an 8-bit KV cache (each rank measures its own heads' key scales)."""
    out = tmp_path_factory.mktemp("tp-run")
    r = launch(
        out,
        "--model",
        str(tiny_model_path),
        "--model",
        str(tiny_quantized),
        "--model",
        f"{tiny_model_path}#kv8",
        env={"MLXPAGED_TP_CHECK_EVERY": "1"},
    )
    assert (out / "rank1_2.json").exists(), r.stdout + r.stderr
    return out


@pytest.mark.parametrize("which", [0, 1, 2], ids=["float32", "quantized", "kv8"])
def test_two_ranks_equal_one_process(tiny_model_path, tiny_quantized, tp_run, which):
    from mlx.utils import tree_flatten

    from mlxpaged import LLM

    ranks = [json.loads((tp_run / f"rank{i}_{which}.json").read_text()) for i in range(2)]
    path = [tiny_model_path, tiny_quantized, tiny_model_path][which]
    kv_bits = 8 if which == 2 else None
    llm = LLM(str(path), dtype="float32", block_size=tp_worker.BLOCK_SIZE, num_blocks=64, kv_bits=kv_bits)
    ref_steps = tp_worker.record_logits(llm.engine)
    ref = tp_worker.workload(llm)
    assert ref["prefix_cached_tokens"] == 24  # the workload does hit the prefix cache
    full_params = dict(tree_flatten(llm.engine.loaded.model.parameters()))
    full_bytes = sum(v.nbytes for v in full_params.values())
    replicated = sum(v.nbytes for k, v in full_params.items() if shard_axis(k) is None)
    kv_heads = llm.engine.cache_shape.num_kv_heads
    assert kv_heads == 2

    for info in ranks:
        rank = info["rank"]
        for key in ("greedy", "sampled", "prefix_hit", "prefix_cached_tokens"):
            assert info[key] == ref[key], (rank, key)
        assert info["checks"] > 0  # the debug-mode agreement check ran (every step) and passed
        # Each rank's pool holds half the KV heads; its weights are the replicated ones plus half the rest.
        assert info["num_kv_heads"] == kv_heads // 2
        assert info["pool_shape"] == [64, kv_heads // 2, tp_worker.BLOCK_SIZE, llm.engine.cache_shape.head_dim]
        assert info["weight_bytes"] == replicated + (full_bytes - replicated) // 2
        z = np.load(tp_run / f"rank{rank}_{which}.npz")
        steps = [z[f"arr_{i}"] for i in range(len(z.files))]
        assert len(steps) == len(ref_steps)
        # 8-bit K/V: a key within float error of a rounding boundary may land one level apart.
        atol = 1e-2 if kv_bits else 1e-4
        for got, want in zip(steps, ref_steps):
            np.testing.assert_allclose(got, want, rtol=0, atol=atol)
        print(
            f"{['float32', 'quantized', 'kv8'][which]} rank {rank}: weights {info['weight_bytes']} "
            f"of {full_bytes} bytes "
            f"({info['weight_bytes'] / full_bytes:.3f}), KV heads {info['num_kv_heads']} of {kv_heads}, "
            f"max |logit diff| {max(np.abs(g - w).max() for g, w in zip(steps, ref_steps)):.2e}"
        )


def test_generate_cli_under_mlx_launch(tiny_model_path):
    """`mlx.launch -n 2 --backend ring -- -m mlxpaged.cli generate ...`: rank 0 alone prints, the tokens
    of one process."""
    from mlxpaged import LLM, SamplingParams

    prompts = ["The KV cache stores", "Blocks of sixteen tokens"]
    cmd = [
        *ring_command(),
        "-m",
        "mlxpaged.cli",
        "generate",
        "--model",
        str(tiny_model_path),
        "--no-chat",
        "--json",
        "--max-tokens",
        "10",
        "-n",
        "2",
        "--temp",
        "0.7",
        "--seed",
        "5",
        *[a for p in prompts for a in ("-p", p)],
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=wall(300))
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, r.stdout + r.stderr  # one JSON object: rank 1 printed nothing
    got = [(o["prompt_index"], o["sample_index"], o["token_ids"]) for o in json.loads(lines[0])["outputs"]]
    llm = LLM(str(tiny_model_path), dtype="float32")
    outs = llm.generate(prompts, SamplingParams(n=2, temperature=0.7, seed=5, max_tokens=10))
    assert got == [(i, c.index, c.token_ids) for i, o in enumerate(outs) for c in o.outputs]


def test_world_must_divide_kv_heads():
    cfg = {"num_key_value_heads": 2, "num_attention_heads": 14, "intermediate_size": 4864}
    check_shardable(cfg, 2)
    with pytest.raises(MlxPagedError, match="3 to divide num_key_value_heads=2"):
        check_shardable(cfg, 3)
    with pytest.raises(MlxPagedError, match="4 to divide num_key_value_heads=2"):
        check_shardable(cfg, 4)


# -- faults ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["die", "hang"])
def test_lost_rank_ends_rank0_within_10s(tiny_model_path, tmp_path, mode):
    """Rank 1 is SIGKILLed (its sockets close) or SIGSTOPped (they stay open, nothing answers)
    at step 3: rank 0 exits non-zero with one error line within 10 s."""
    procs = spawn_ranks(tmp_path, "--model", str(tiny_model_path), "--mode", mode, env={"MLXPAGED_TP_TIMEOUT": "3"})
    try:
        rc, err, t_exit = _finish(procs[:1])[0]
    finally:
        procs[1].kill()
        procs[1].communicate()
    t_sabotage = float((tmp_path / "sabotage_time").read_text())
    lines = _error_lines(err)
    assert rc != 0 and len(lines) == 1, err
    assert "rank 0:" in lines[0] and ("lost the connection" in lines[0] or "no answer" in lines[0])
    assert t_exit - t_sabotage < 10
    print(f"{mode}: rank 0 exited {t_exit - t_sabotage:.1f} s after rank 1 stopped: {lines[0]}")


def test_divergence_fails_loudly(tiny_model_path, tmp_path):
    procs = spawn_ranks(
        tmp_path, "--model", str(tiny_model_path), "--mode", "diverge", env={"MLXPAGED_TP_CHECK_EVERY": "2"}
    )
    for rc, err, _ in _finish(procs):
        assert rc != 0 and any("ranks diverged" in line for line in _error_lines(err)), err


@pytest.mark.parametrize("other", ["settings", "weights"])
def test_mismatch_detected_at_start(tiny_model_path, tmp_path, other):
    """Rank 1 runs another block size, or another checkpoint of the same shape."""
    from mlxpaged.testing.tiny_model import write_tiny_qwen2

    extra = []
    if other == "weights":
        extra = ["--model-1", str(write_tiny_qwen2(tmp_path / "other", seed=1))]
    procs = spawn_ranks(tmp_path, "--model", str(tiny_model_path), "--mode", "mismatch", *extra)
    want = "different engine settings" if other == "settings" else "different weights"
    for rc, err, _ in _finish(procs):
        assert rc != 0 and any(want in line for line in _error_lines(err)), err
    assert not (tmp_path / "rank0_0.json").exists()


# -- the real-model tier ------------------------------------------------------------------------------------
def test_real_model_two_ranks_greedy_16(tmp_path):
    """Qwen2.5-Coder-0.5B (2 KV heads), float32: W=2 gives the single-process greedy tokens."""
    from mlxpaged import LLM

    r = launch(tmp_path, "--model", "default", "--mode", "real", "--tokens", "16", timeout=900)
    assert (tmp_path / "rank1_0.json").exists(), r.stdout + r.stderr
    ranks = [json.loads((tmp_path / f"rank{i}_0.json").read_text()) for i in range(2)]
    llm = LLM(None, dtype="float32", block_size=tp_worker.BLOCK_SIZE, num_blocks=64)
    ref = tp_worker.real_workload(llm, 16)
    full = tp_worker.weight_bytes(llm.engine.loaded.model)
    for info in ranks:
        assert info["greedy"] == ref["greedy"]
        assert info["num_kv_heads"] == 1
        print(f"real rank {info['rank']}: weights {info['weight_bytes'] / 1e9:.3f} of {full / 1e9:.3f} GB")


# -- the server: rank 0 owns HTTP and broadcasts each step's requests ------------------------------------------
def _post(port: int, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _stream_then_hang_up(port: int, body: dict) -> None:
    """Start a streamed completion, read its first event, and disconnect (the server aborts it)."""
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    r.fp.readline()
    c.sock.close()
    c.close()


def test_serve_two_ranks_loopback(tiny_model_path, tmp_path):
    """`mlxpaged serve` on two ranks answers as one process does, survives a client that hangs up
    mid-stream (an abort every rank must replay), and stops both ranks cleanly on Ctrl-C."""

    from mlxpaged import LLM, SamplingParams

    port = _free_port_pair()
    http_port = _free_port_pair()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlxpaged.cli",
                "serve",
                "--model",
                str(tiny_model_path),
                "--port",
                str(http_port),
                "--num-blocks",
                "256",
            ],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile), "MLXPAGED_TP_CHECK_EVERY": "1"},
        )
        for r in range(2)
    ]
    try:
        wait_healthy(http_port, procs)
        greedy = {
            "prompt": "Words from outside the corpus: zebra, quartz, jive, vex, ochre.",
            "max_tokens": 12,
            "temperature": 0,
        }
        sampled = {"prompt": "Paged attention borrows", "max_tokens": 10, "temperature": 0.8, "seed": 3, "n": 2}
        got = [_post(http_port, greedy)]
        _stream_then_hang_up(http_port, {"prompt": "Copy-on-write", "max_tokens": 3000, "ignore_eos": True})
        got += [_post(http_port, sampled), _post(http_port, greedy)]
        assert all(p.poll() is None for p in procs)
    finally:
        procs[0].send_signal(signal.SIGINT)
        res = _finish(procs, timeout=30)
    assert [rc for rc, _, _ in res] == [0, 0], [err[-1500:] for _, err, _ in res]

    llm = LLM(str(tiny_model_path), dtype="float32", num_blocks=256)
    want_g = llm.generate(greedy["prompt"], SamplingParams(temperature=0, max_tokens=12))[0]
    want_s = llm.generate(sampled["prompt"], SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=10))[0]
    assert [c["text"] for c in got[0]["choices"]] == [want_g.outputs[0].text]
    assert [c["text"] for c in got[1]["choices"]] == [c.text for c in want_s.outputs]
    assert [c["text"] for c in got[2]["choices"]] == [want_g.outputs[0].text]
    assert got[2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # a prefix hit on every rank's cache
