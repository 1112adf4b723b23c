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

import pytest

from server_proc import free_port

# Seconds one refused start-up may take on a 2-core machine at load 8 (a few seconds quiet).
STARTUP_S = 120


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxpaged.cli", *args], capture_output=True, text=True, timeout=STARTUP_S, cwd=cwd
    )


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
def vision(tiny_model_path, tmp_path_factory):
    """A checkpoint of a family mlxpaged refuses (a vision-language model)."""
    return _edited(tiny_model_path, tmp_path_factory.mktemp("vl") / "ckpt", model_type="qwen2_5_vl")


@pytest.fixture(scope="module")
def truncated(tiny_model_path, tmp_path_factory):
    dst = tmp_path_factory.mktemp("truncated") / "ckpt"
    shutil.copytree(tiny_model_path, dst)
    weights = dst / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return dst


def test_serve_on_mismatched_config_exits_1_every_time(mismatched):
    """`serve` loads on its engine thread; a load that fails there used to end in "terminate called
    without an active exception" (exit 134) about half the time on a busy machine. Ten runs with
    two CPU-bound processes beside them, the condition the abort was seen under."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        runs = [cli("serve", "--model", str(mismatched), "--port", str(free_port())) for _ in range(10)]
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert [r.returncode for r in runs] == [1] * 10, [r.stderr[-300:] for r in runs if r.returncode != 1]
    for r in runs:
        assert_refused(r, "Expected shape")


@pytest.mark.parametrize("command", ["serve", "generate", "bench"])
@pytest.mark.parametrize("checkpoint,message", [("vision", "qwen2_5_vl"), ("truncated", "cannot load checkpoint")])
def test_refused_checkpoint_exits_1(command, checkpoint, message, request):
    path = str(request.getfixturevalue(checkpoint))
    args = {
        "serve": ["serve", "--model", path, "--port", str(free_port())],
        "generate": ["generate", "--model", path, "--prompt", "hi"],
        "bench": ["bench", "throughput", "--model", path],
    }[command]
    assert_refused(cli(*args), message)


def test_generate_and_bench_on_mismatched_config_exit_1(mismatched):
    assert_refused(cli("generate", "--model", str(mismatched), "--prompt", "hi"), "Expected shape")
    assert_refused(cli("bench", "throughput", "--model", str(mismatched)), "Expected shape")


@pytest.mark.parametrize(
    "args,message",
    [
        (["serve", "--block-size", "48"], "power of two"),
        (["generate", "--prompt", "hi", "--block-size", "48"], "power of two"),
        (["generate", "--prompts-file", "/nonexistent/prompts.txt"], "cannot read prompts file"),
        (["generate", "--prompt", "hi", "--json-schema", "/nonexistent/schema.json"], "cannot read JSON schema"),
        (["bench", "throughput", "--tiny", "--concurrency", "eight"], "--concurrency"),
        (["doctor", "--seqs", "0"], "--seqs and --tokens must be positive"),
        (["doctor", "--out", "/nonexistent/dir/report.json"], "cannot write the report"),
    ],
)
def test_bad_flag_or_unreadable_file_exits_1(tiny_model_path, args, message):
    if args[0] in ("serve", "generate"):
        args = [args[0], "--model", str(tiny_model_path), *args[1:]]
    assert_refused(cli(*args), message)


def test_serve_on_a_port_in_use_exits_1(tiny_model_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = cli("serve", "--model", str(tiny_model_path), "--port", str(port))
    assert_refused(r, f"cannot listen on 127.0.0.1:{port}")
