"""Every refusal at start-up, run as a user runs it (`python -m mlxpaged.cli ...` in a subprocess):
exit status 1, one line on stderr, no traceback and no abort.

In-process runners (click's CliRunner) cannot see an abort at interpreter exit, which is where
MLX, used by `serve`'s engine thread, ended a failed load with SIGABRT.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from mlxpaged.testing.slowness import wall

# Seconds one refused start-up may take on a 2-core machine at load 8 (a few seconds quiet).
STARTUP_S = 120
# `mlxpaged` as its console script runs it, but the engine thread, once its load has failed and
# it has said so, yields the CPU before it ends, as a busy machine's scheduler makes it do. That
# is the moment interpreter teardown used to abort at: it does in nearly every run on the code
# before the fix (and in about half of the plain runs beside two CPU-bound processes).
DESCHEDULED = (
    "import sys, time; from mlxpaged.server import engine_loop as el; run = el.EngineLoop._run; "
    "el.EngineLoop._run = lambda self: (run(self), time.sleep(0)); "
    "sys.argv[0] = 'mlxpaged'; from mlxpaged.cli.main import main; main()"
)


def cli(*args: str, program=("-m", "mlxpaged.cli")) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *program, *args], capture_output=True, text=True, timeout=wall(STARTUP_S))


def run_all(commands: list[list[str]], program=("-m", "mlxpaged.cli")) -> list[subprocess.CompletedProcess]:
    """Each command in its own process, a few at once (start-up is mostly imports)."""
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda args: cli(*args, program=program), commands))


def assert_refused(r: subprocess.CompletedProcess, message: str) -> None:
    """Exit 1 with one line naming the problem: no traceback, no abort (134), no second line."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], r.stderr[-2000:]


def _edited(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def mismatched(tiny_model_path, tmp_path_factory):
    """A half-edited download: config.json's MLP width is not its weights' (512)."""
    return _edited(tiny_model_path, tmp_path_factory.mktemp("mismatch") / "ckpt", intermediate_size=256)


@pytest.fixture(scope="module")
def refused(tiny_model_path, tmp_path_factory):
    """A checkpoint whose structure the paged cache refuses once mlx-lm has built the model (each of
    deepseek_v41's layers keeps a cache class of its own), so the refusal comes after MLX was used."""
    return _edited(tiny_model_path, tmp_path_factory.mktemp("refused") / "ckpt", model_type="deepseek_v41")


@pytest.fixture(scope="module")
def truncated(tiny_model_path, tmp_path_factory):
    dst = tmp_path_factory.mktemp("truncated") / "ckpt"
    shutil.copytree(tiny_model_path, dst)
    weights = dst / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return dst


def test_serve_on_mismatched_config_exits_1_every_time(mismatched):
    """`serve` loads on its engine thread; a load that failed there could end in "terminate called
    without an active exception" (exit 134) once the error was printed. Ten runs of ten exit 1."""
    runs = run_all([["serve", "--model", str(mismatched), "--port", "0"]] * 10, program=("-c", DESCHEDULED))
    assert [r.returncode for r in runs] == [1] * 10, [r.stderr[-300:] for r in runs if r.returncode != 1]
    for r in runs:
        assert_refused(r, "Expected shape")


@pytest.mark.parametrize(
    "checkpoint,message",
    [("refused", "LayerCache"), ("truncated", "cannot load checkpoint"), ("mismatched", "Expected shape")],
)
def test_refused_checkpoint_exits_1_on_every_command(checkpoint, message, request, tmp_path):
    path = str(request.getfixturevalue(checkpoint))
    runs = run_all(
        [
            ["serve", "--model", path, "--port", "0"],
            ["generate", "--model", path, "--prompt", "hi"],
            ["bench", "throughput", "--model", path, "--out", str(tmp_path)],
        ]
    )
    for r in runs:
        assert_refused(r, message)


BAD_FLAGS_AND_FILES = [
    (["serve", "--block-size", "48"], "power of two"),
    (["generate", "--prompt", "hi", "--block-size", "48"], "power of two"),
    (["generate", "--prompts-file", "/nonexistent/prompts.txt"], "cannot read prompts file"),
    (["generate", "--prompt", "hi", "--json-schema", "/nonexistent/schema.json"], "cannot read JSON schema"),
    (["bench", "throughput", "--tiny", "--concurrency", "eight"], "--concurrency"),
    (["bench", "throughput", "--tiny", "--out", "/proc/results"], "cannot write results to /proc/results"),
    (["doctor", "--seqs", "0"], "--seqs and --tokens must be positive"),
    (["doctor", "--family", "7by64"], "--family takes GROUPxHEAD_DIM"),
    (["doctor", "--out", "/nonexistent/dir/report.json"], "cannot write the report"),
    # click's own checks of a flag's value: one line and exit 1 too, not a usage block and exit 2
    (["serve", "--kv-memory-gb", "0"], "Invalid value for '--kv-memory-gb'"),
    (["generate", "--prompt", "hi", "--max-tokens", "many"], "Invalid value for '--max-tokens'"),
    (["bench", "throughput", "--tiny", "--no-such-flag"], "--no-such-flag"),
]


def test_bad_flag_or_unreadable_file_exits_1(tiny_model_path, tmp_path):
    commands = [
        [args[0], "--model", str(tiny_model_path), *args[1:]]
        if args[0] in ("serve", "generate")
        else [*args, "--out", str(tmp_path)]
        if args[0] == "bench" and "--out" not in args
        else args
        for args, _ in BAD_FLAGS_AND_FILES
    ]
    for (_, message), r in zip(BAD_FLAGS_AND_FILES, run_all(commands)):
        assert_refused(r, message)


def test_serve_on_a_port_in_use_exits_1(tiny_model_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = cli("serve", "--model", str(tiny_model_path), "--port", str(port))
    assert_refused(r, f"cannot listen on 127.0.0.1:{port}")
