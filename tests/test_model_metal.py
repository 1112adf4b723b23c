"""The whole model decoding through the Metal kernel, executed by the MSL emulator."""

import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.metal_emu import emulate


def run(loaded, impl, prompts, n=1, block_size=16):
    engine = LLMEngine(loaded, EngineConfig(block_size=block_size, num_blocks=64, attention_impl=impl))
    params = SamplingParams(n=n, temperature=0.0 if n == 1 else 0.8, seed=1, max_tokens=12, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return {k: [c.token_ids for c in o.outputs] for k, o in done.items()}


@pytest.mark.parametrize("block_size,n", [(16, 1), (4, 3)])
def test_metal_kernel_decodes_like_reference(tiny_loaded, block_size, n):
    prompts = ["The KV cache stores", "Paged attention borrows an idea from operating systems:"]
    want = run(tiny_loaded, "reference", prompts, n, block_size)
    with emulate():
        got = run(tiny_loaded, "metal", prompts, n, block_size)
    assert got == want
