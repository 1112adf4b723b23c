"""Speculative decoding on two tensor-parallel ranks (`mlx.launch -n 2 --backend ring`): the
proposals are a function of the tokens, so every rank makes the same ones and rank 0 prints the
tokens of one process without speculation."""

import json
import subprocess

import pytest

from mlxpaged import LLM, SamplingParams
from mlxpaged.testing.slowness import wall

from launch import _ring_can_start, ring_command

pytestmark = pytest.mark.skipif(_ring_can_start() is not None, reason=str(_ring_can_start()))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_two_tensor_parallel_ranks(tiny_model_path, proposer):
    """`mlx.launch -n 2` generate with speculation: rank 0 prints the tokens of one process
    without speculation (every rank makes the same proposals, or the ranks would diverge). The
    draft (the target's own checkpoint, whole on each rank) has every greedy proposal accepted."""
    how = ["--prompt-lookup-min", "1"] if proposer == "ngram" else ["--draft-model", str(tiny_model_path)]
    prompt = "The KV cache stores the KV cache stores the KV cache"
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
        "40",
        "--ignore-eos",
        "--speculative",
        proposer,
        *how,
        "-p",
        prompt,
        "-p",
        "Blocks of sixteen tokens",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=wall(300))
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, r.stdout + r.stderr
    got = json.loads(lines[0])
    assert got["stats"]["spec_accepted_tokens"] > 0
    if proposer == "draft":
        assert got["stats"]["spec_accepted_tokens"] == got["stats"]["spec_proposed_tokens"]
    llm = LLM(str(tiny_model_path), dtype="float32")
    outs = llm.generate(
        [prompt, "Blocks of sixteen tokens"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )
    assert [o["token_ids"] for o in got["outputs"]] == [o.outputs[0].token_ids for o in outs]
