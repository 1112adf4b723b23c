"""The whole model decoding through the Metal kernel, executed by the MSL emulator."""

import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.metal_emu import emulate


def run(loaded, impl, prompts, n=1, block_size=16):
    engine = LLMEngine(loaded, EngineConfig.of(block_size=block_size, num_blocks=64, attention_impl=impl))
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


def test_kernel_failing_mid_serving_never_fails_a_request(tiny_loaded, monkeypatch):
    """As on a new user's Mac: the varlen kernel passes its start-up check, then its
    build fails mid-serving (an emulated factory that refuses it). The requests finish with the
    reference's tokens and one warning, instead of `StepError`."""
    import warnings

    from mlxpaged.attention import metal

    from kernel_cases import Recording

    prompts = ["The KV cache stores", "Paged attention borrows an idea from operating systems:"]
    want = run(tiny_loaded, "reference", prompts)
    factory = Recording(refuse="paged_attention_varlen", after=1)
    monkeypatch.setattr(metal, "_metal_kernel_factory", lambda: factory)
    monkeypatch.delenv("MLXPAGED_METAL", raising=False)
    metal.reset_kernels()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = run(tiny_loaded, "metal", prompts)
    finally:
        metal.reset_kernels()
    assert got == want
    failed = [w for w in caught if "Unable to build metal library" in str(w.message)]
    assert len(failed) == 1 and factory.calls == 2
