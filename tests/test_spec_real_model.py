"""The real-model tier for speculative decoding: Qwen2.5-Coder-0.5B-Instruct (the offline GGUF),
float32 on the CPU. An edit whose answer quotes its prompt: most proposals are accepted, and the
tokens are exactly those of mlx-lm's contiguous cache."""

import mlx.core as mx
import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams

from reference import contiguous_generate

SNIPPET = """def total_price(items, tax_rate):
    subtotal = sum(item.price * item.quantity for item in items)
    return subtotal * (1 + tax_rate)
"""


@pytest.fixture(scope="module")
def real():
    import mlx_lm

    from mlxpaged.loading.gguf import convert_gguf
    from mlxpaged.loading.loader import load
    from mlxpaged.loading.offline_model import ensure_offline_model

    path = convert_gguf(ensure_offline_model())
    loaded = load(str(path), "float32")
    ref, _ = mlx_lm.load(str(path))
    ref.set_dtype(mx.float32)
    return loaded, ref


@pytest.mark.timeout(1800)
def test_edit_greedy_identity_with_ngram(real):
    loaded, ref = real
    from mlxpaged.engine.chat import chat_ids

    text = (
        f"Rewrite this function with `subtotal` renamed to `net`. Reply with the code only.\n\n```python\n{SNIPPET}```"
    )
    prompt = chat_ids(loaded.tokenizer, [{"role": "user", "content": text}])
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, speculative="ngram"))
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
        engine.check_invariants()
    st = engine.stats_dict()
    print(
        f"\n{st['spec_accepted_tokens']} of {st['spec_proposed_tokens']} accepted, "
        f"{engine.stats.steps} steps for 40 tokens"
    )
    assert done[0].outputs[0].token_ids == contiguous_generate(ref, prompt, 40)
    assert st["spec_acceptance_rate"] > 0.5 and engine.stats.steps < 30
    assert all(b.ref_cnt == 0 for b in engine.block_manager.pool.blocks)
