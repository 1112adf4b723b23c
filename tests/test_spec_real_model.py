"""The real-model tier for speculative decoding: Qwen2.5-Coder-0.5B-Instruct (the offline GGUF),
float32 on the CPU. An edit whose answer quotes its prompt: most proposals are accepted, and the
tokens are exactly those of mlx-lm's contiguous cache. For the draft proposer, the only draft
with this tokenizer here is the model itself (every greedy proposal accepted) or its first
layers (an early exit: proposals mostly rejected, so rollbacks happen)."""

import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams

from drive import run_all
from reference import contiguous_generate

SNIPPET = """def total_price(items, tax_rate):
    subtotal = sum(item.price * item.quantity for item in items)
    return subtotal * (1 + tax_rate)
"""


def edit_prompt(tokenizer) -> list[int]:
    from mlxpaged.engine.chat import chat_ids

    text = (
        f"Rewrite this function with `subtotal` renamed to `net`. Reply with the code only.\n\n```python\n{SNIPPET}```"
    )
    return chat_ids(tokenizer, [{"role": "user", "content": text}])


@pytest.mark.timeout(1800)
def test_edit_greedy_identity_with_ngram(real):
    loaded, ref = real
    prompt = edit_prompt(loaded.tokenizer)
    engine = LLMEngine(loaded, EngineConfig.of(num_blocks=64, speculative="ngram"))
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


@pytest.mark.timeout(1800)
def test_edit_greedy_identity_with_a_draft_model(real, tmp_path):
    """The model as its own draft: all 24 proposals of the 24 tokens after the first accepted;
    its 2-layer early exit as draft: rejections and rollbacks. Tokens: mlx-lm's either way."""
    from mlxpaged.bench.spec import truncated_checkpoint

    loaded, ref = real
    prompt = edit_prompt(loaded.tokenizer)
    want = contiguous_generate(ref, prompt, 24)
    early = truncated_checkpoint(loaded.path, 2, tmp_path / "early")
    for draft in (str(loaded.path), early):
        cfg = EngineConfig.of(num_blocks=64, speculative="draft", draft_model=draft, num_speculative_tokens=4)
        engine = LLMEngine(loaded, cfg)
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        (out,) = run_all(engine).values()
        st = engine.stats_dict()
        assert out.outputs[0].token_ids == want, draft
        if draft == early:
            assert st["spec_accepted_tokens"] < st["spec_proposed_tokens"]
        else:
            assert st["spec_accepted_tokens"] == st["spec_proposed_tokens"] > 0 and engine.stats.steps < 12
        assert all(b.ref_cnt == 0 for b in engine.block_manager.pool.blocks)
