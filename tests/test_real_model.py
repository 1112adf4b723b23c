"""The real-model tier: Qwen2.5-Coder-0.5B-Instruct (the offline GGUF), float32 on the CPU.

Paging changes storage, not computation: on real weights mlxpaged must give exactly the tokens
of mlx-lm's contiguous cache.
"""

import mlx.core as mx
import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams

from reference import contiguous_generate, contiguous_samples, decode_in_turns, tables_interleave


def test_seed_prompts_in_turns_match_contiguous(real):
    loaded, ref = real
    tok = loaded.tokenizer
    prompts = ["The KV cache stores", "Paged attention borrows an idea from operating systems:"]
    ids = [tok.encode(p) for p in prompts]
    seqs = decode_in_turns(loaded, ids, 32, num_blocks=64)
    assert tables_interleave(seqs)
    for p, s in zip(ids, seqs):
        assert s.output_token_ids == contiguous_generate(ref, p, 32)


def test_four_samples_share_a_chat_prompt(real):
    loaded, ref = real
    tok = loaded.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me a short story about a robot that learns to paint at night."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = tok.encode(text, add_special_tokens=False)
    assert len(prompt) == 44
    params = SamplingParams(n=4, temperature=0.8, top_p=0.95, seed=3, max_tokens=32, ignore_eos=True)
    engine = LLMEngine(loaded, EngineConfig.of(num_blocks=64))
    engine.add_request(prompt, params)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    st = engine.stats_dict()
    print(
        f"\nblocks in use at peak {st['blocks_in_use_peak']}, without sharing {st['blocks_without_sharing']}, "
        f"copy-on-write copies {st['cow_copies']}"
    )
    # 44 + 32 tokens = 5 blocks a sample: 2 shared full blocks, 4 copies of the partly filled third, 2 more each.
    assert (st["blocks_in_use_peak"], st["blocks_without_sharing"], st["cow_copies"]) == (14, 20, 3)
    want = contiguous_samples(ref, prompt, 32, params, seed=3, sample_indices=range(4))
    assert [c.token_ids for c in done[0].outputs] == want


def test_prefix_caching_on_equals_off(real):
    loaded, _ = real
    tok = loaded.tokenizer
    system = "You are a careful Python tutor. Answer with one short code block and one sentence. " * 2
    prompts = [tok.encode(system + q) for q in ["Reverse a list.", "Sum a list.", "Sort a dict by value."]]
    g = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for caching in (True, False):
        engine = LLMEngine(loaded, EngineConfig.of(num_blocks=64, enable_prefix_caching=caching))
        outs = {}
        for i, p in enumerate(prompts):  # one after another, so later ones can hit the cache
            engine.add_request(p, g, request_id=str(i))
            while engine.has_unfinished_requests():
                outs.update({o.request_id: o for o in engine.step() if o.finished})
        runs.append(
            ({k: o.outputs[0].token_ids for k, o in outs.items()}, [outs[str(i)].num_cached_tokens for i in range(3)])
        )
    (on, hits_on), (off, hits_off) = runs
    assert on == off
    assert hits_off == [0, 0, 0] and hits_on[0] == 0 and min(hits_on[1:]) >= 16


def test_beam_search_width_4_matches_contiguous(real):
    from mlxpaged import BeamSearchParams

    from reference import reference_beam_search

    loaded, ref = real
    tok = loaded.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = tok.encode(text, add_special_tokens=False)
    engine = LLMEngine(loaded, EngineConfig.of(num_blocks=64))
    rid = engine.add_beam_request(prompt, BeamSearchParams(beam_width=4, max_tokens=16))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    want = reference_beam_search(ref, prompt, 4, 16, eos=set(engine.eos_token_ids))
    got = done[rid].outputs
    assert [c.token_ids for c in got] == [t for _, t, _ in want]
    assert [c.cumulative_logprob for c in got] == pytest.approx([c for _, _, c in want], abs=1e-3)
    st = engine.stats_dict()
    assert st["beam_forks"] > 0 and st["blocks_in_use_peak"] < st["blocks_without_sharing"]


def test_kv_quant_perplexity_within_bounds(real):
    """The paged cache at 8 bits stays within 1% of the float cache's perplexity, at
    4 bits within 5%, on the first 385 tokens of the weights test's Python snippet, scored in
    prefill chunks of 256 (each chunk is written to the pool first, so every token attends to
    K/V stored at those bits). The float cache's paged score must equal mlx-lm's contiguous
    forward pass over the same tokens (the scoring itself is right)."""
    import math
    from pathlib import Path

    import mlx.nn as nn

    from mlxpaged.bench.kv_quality import paged_perplexity

    loaded, ref = real
    ids = loaded.tokenizer.encode((Path(__file__).parent / "data" / "perplexity_snippet.py").read_text())[:385]
    x = mx.array(ids)[None]
    contiguous = math.exp(nn.losses.cross_entropy(ref(x[:, :-1]), x[:, 1:], reduction="mean").item())
    ppl = {bits: paged_perplexity(loaded, ids, kv_bits=bits, chunk=256) for bits in (None, 8, 4)}
    print(
        f"\nperplexity over {len(ids)} tokens: contiguous {contiguous:.4f}, paged float {ppl[None]:.4f}, "
        f"8-bit {ppl[8]:.4f} ({ppl[8] / ppl[None]:.5f}x), 4-bit {ppl[4]:.4f} ({ppl[4] / ppl[None]:.5f}x)"
    )
    assert ppl[None] == pytest.approx(contiguous, rel=1e-4)
    assert abs(ppl[8] / ppl[None] - 1) < 0.01
    assert abs(ppl[4] / ppl[None] - 1) < 0.05


def test_kv_8bit_greedy_matches_contiguous_quantized_cache(real):
    """The engine with kv_bits=8 against mlx-lm's contiguous cache holding K/V rounded the same
    way (keys less numpy's RoPE of the k_proj bias, over numpy's per-channel scales from the
    calibration text): the same greedy tokens up to the first near-tie (top-2 logit gap < 0.01)."""
    import numpy as np

    from attention_cases import rounded_caches

    loaded, ref = real
    tok = loaded.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = tok.encode(text, add_special_tokens=False)
    engine = LLMEngine(loaded, EngineConfig.of(num_blocks=16, kv_bits=8, attention_impl="reference"))
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    cache = rounded_caches(ref, tok, 8, 64)
    x, want, gaps = mx.array([prompt]), [], []
    for _ in range(24):
        logits = np.array(ref(x, cache=cache)[0, -1].astype(mx.float32))
        top2 = np.sort(logits)[-2:]
        want.append(int(logits.argmax()))
        gaps.append(top2[1] - top2[0])
        x = mx.array([[want[-1]]])
    n = next((i for i, g in enumerate(gaps) if g < 0.01), 23) + 1
    print(f"\n8-bit K/V: {n} greedy tokens compared (first near-tie at {n - 1})")
    assert n >= 10 and done[0].outputs[0].token_ids[:n] == want[:n]
