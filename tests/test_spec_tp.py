"""Speculative decoding on two tensor-parallel ranks (`mlx.launch -n 2 --backend ring`): the
proposals are a function of the tokens, so every rank makes the same ones and rank 0 prints the
tokens of one process without speculation."""

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlxpaged import LLM, SamplingParams

LAUNCH = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or shutil.which("mlx.launch")
pytestmark = pytest.mark.skipif(
    LAUNCH is None or not mx.distributed.is_available(), reason="mlx.launch or MLX's distributed support is missing"
)


def free_port_pair() -> int:
    """A port p with p and p + 1 free (the ring backend listens on one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port pair")


@pytest.mark.timeout(600)
def test_two_tensor_parallel_ranks(tiny_model_path):
    """`mlx.launch -n 2` generate with speculation: rank 0 prints the tokens of one process
    without speculation (every rank makes the same proposals, or the ranks would diverge)."""
    prompt = "The KV cache stores the KV cache stores the KV cache"
    cmd = [
        LAUNCH,
        "-n",
        "2",
        "--backend",
        "ring",
        "--starting-port",
        str(free_port_pair()),
        "--python",
        sys.executable,
        "--",
        "-m",
        "mlxpaged.cli",
        "generate",
        "--model",
        str(tiny_model_path),
        "--no-chat",
        "--json",
        "--max-tokens",
        "40",
        "--ignore-eos",
        "--speculative",
        "ngram",
        "--prompt-lookup-min",
        "1",
        "-p",
        prompt,
        "-p",
        "Blocks of sixteen tokens",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, r.stdout + r.stderr
    got = json.loads(lines[0])
    assert got["stats"]["spec_accepted_tokens"] > 0
    llm = LLM(str(tiny_model_path), dtype="float32")
    outs = llm.generate(
        [prompt, "Blocks of sixteen tokens"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )
    assert [o["token_ids"] for o in got["outputs"]] == [o.outputs[0].token_ids for o in outs]
