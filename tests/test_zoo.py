"""Every model type mlx-lm 0.32 has, on the paged cache: one tiny random checkpoint per type,
written by mlx-lm's own `ModelArgs`/`Model` (mlxpaged.testing.zoo), mlxpaged's greedy tokens
against mlx-lm's `generate_step` on its own `make_prompt_cache` caches, at block size 16 (the
prompt in one step) and at block size 4 with 7-token chunks; then the same prompt again as
`n=2` on that engine (a prefix hit, and two samples forked from one prefill).

A type not run is refused at load in one line naming what the paged cache lacks. Every type
mlx-lm has is in exactly one of RUNS, REFUSED and NOT_WRITTEN, so a new mlx-lm module fails
`test_every_type_is_listed` until it is tried.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.errors import MlxPagedError
from mlxpaged.loading.loader import load
from mlxpaged.models.paged_adapter import check_family
from mlxpaged.testing.zoo import PROMPT, model_types, write_zoo

from drive import run_all

N = 6  # greedy tokens compared per setting

# Types whose tiny checkpoint gives mlx-lm's exact greedy tokens (plain, MoE, partial rotary,
# parallel blocks, learned positions, sliding windows, hybrid recurrent, latent attention, wrappers,
# and the types mlx-lm remaps onto those modules).
RUNS = (
    "afmoe apertus bailing_moe bailing_moe_v3 cohere cohere2 dbrx deepseek deepseek_v3 dots1 ernie4_5 "
    "ernie4_5_moe exaone exaone4 exaone_moe gear gemma gemma3 gemma3_text gemma3n gemma4 gemma4_text "
    "gemma4_unified glm glm4 glm4_moe glm4_moe_lite gpt2 gpt_neox gpt_oss gptj granite granitemoe "
    "granitemoehybrid helium hunyuan hunyuan_v1_dense internlm2 internlm3 iquestcoder jamba "
    "joyai_llm_flash kimi_k2 kimi_k25 kimi_vl Klear laguna lfm2 lfm2-vl lfm2_moe lille-130m llama llama4 "
    "llama4_text llava mellum mimo mimo_v2_flash minicpm minimax minimax_m2 ministral3 mistral mistral3 "
    "mistral4 mixtral muse_glimmer nanbeige nemotron nemotron_h olmo2 olmo3 olmoe openelm phi phi3 phimoe "
    "pixtral qwen qwen2 qwen2_5_vl qwen2_moe qwen2_vl qwen3 qwen3_5 qwen3_5_moe qwen3_moe qwen3_next "
    "qwen3_vl qwen3_vl_moe seed_oss smollm3 solar_open spark2_5 stablelm starcoder2 step3p5 telechat3 "
    "xverse"
).split()
# Attention-side types run since the zoo was first written (per-head key and value widths, a
# final norm outside the body, settings kept as `config`, ...).
RUNS += """
afm7 gemma2 gpt_bigcode iquestloopcoder nemotron-nas plamo
deepseek_v2 minicpm3 nanochat phi-msft phixtral plamo3 talkie youtu_llm
""".split()

# Recurrent and state-space types, and those with two caches in one layer (recurrent.py; a layer's
# two caches as two group entries).
RUNS += (
    "bailing_hybrid bailing_moe_linear deepseek_v32 falcon_h1 falcon_mamba glm_moe_dsa kimi_k3 kimi_linear "
    "longcat_flash longcat_flash_ngram mamba mamba2 minimax_m3_vl olmo_hybrid recurrent_gemma rwkv7"
).split()

# Types refused, each with words its one line must hold: what the paged cache lacks for it.
REFUSED = {
    "baichuan_m1": "mlx_lm.models.baichuan_m1.Attention reads the state itself beside its KV cache",
    "deepseek_v41": "(mlx_lm.models.deepseek_v41.LayerCache: window, compress_kv, index_k",
    "deepseek_v41_text": "(mlx_lm.models.deepseek_v41.LayerCache: window, compress_kv, index_k",
    "phi3small": "attends block-sparsely",
    "plamo2": "mlx_lm.models.plamo2.Attention calls a scaled_dot_product_attention that is not mlx-lm's",
}

# Types the zoo writes no checkpoint for (their configs need more than its sizes, or mlx-lm's own
# module cannot run a tiny one on the CPU): each is refused from a bare config, in one line
# naming the type.
NOT_WRITTEN = ("bitnet muse_spark olmo prism_hadamard_qwen35").split()


def greedy(n: int, samples: int = 1) -> SamplingParams:
    return SamplingParams(n=samples, temperature=0.0, max_tokens=n, ignore_eos=True)


def mlx_lm_tokens(model, ids: list[int], n: int) -> list[int]:
    """mlx-lm's greedy tokens: its `generate_step` on its own `make_prompt_cache`."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    steps = generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=make_prompt_cache(model))
    return [int(t) for t, _ in steps]


def engine(loaded, block_size: int, chunk: int) -> LLMEngine:
    config = EngineConfig.of(
        block_size=block_size, num_blocks=64, max_num_batched_tokens=chunk, attention_impl="reference"
    )
    return LLMEngine(loaded, config)


def test_every_type_is_listed():
    """Each model type mlx-lm has (its modules and its remapped types) is in one list, once."""
    listed = RUNS + list(REFUSED) + NOT_WRITTEN
    assert len(listed) == len(set(listed))
    assert sorted(listed) == model_types()


@pytest.mark.parametrize("model_type", RUNS)
def test_type_gives_mlx_lm_greedy_tokens(model_type, tmp_path):
    import mlx_lm

    path = write_zoo(tmp_path / model_type, model_type)
    ref_model, tok = mlx_lm.load(str(path))
    ids = tok.encode(PROMPT)
    want = mlx_lm_tokens(ref_model, ids, N)
    loaded = load(str(path), "float32")

    whole = engine(loaded, 16, 2048)  # the prompt in one step
    rid = whole.add_request(ids, greedy(N))
    assert run_all(whole)[rid].outputs[0].token_ids == want, (model_type, "block 16")

    chunked = engine(loaded, 4, 7)  # 7-token chunks over blocks of 4
    rid = chunked.add_request(ids, greedy(N))
    assert run_all(chunked)[rid].outputs[0].token_ids == want, (model_type, "block 4, chunks of 7")
    rid = chunked.add_request(ids, greedy(N, samples=2))  # the prompt's blocks again; two samples fork
    done = run_all(chunked)[rid]
    assert [c.token_ids for c in done.outputs] == [want, want], (model_type, "n=2 after a prefix hit")
    assert done.num_cached_tokens >= 4, (model_type, done.num_cached_tokens)


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_type_is_refused_in_one_line_naming_what_is_missing(model_type, tmp_path):
    path = write_zoo(tmp_path / model_type, model_type)
    with pytest.raises(MlxPagedError) as e:
        load(str(path), "float32")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{model_type}") and REFUSED[model_type] in msg, msg


@pytest.mark.parametrize("model_type", NOT_WRITTEN)
def test_type_without_a_tiny_checkpoint_is_refused_in_one_line(model_type):
    with pytest.raises(MlxPagedError) as e:
        check_family(model_type, {"model_type": model_type}, "config.json")
    msg = str(e.value)
    assert "\n" not in msg and model_type in msg, msg


def test_a_write_of_other_kv_heads_than_the_pool_is_refused_in_one_line(tmp_path):
    """A layer whose keys have other KV heads (or widths) than its pool's rows is refused by
    name, not broadcast into the pool."""
    from types import SimpleNamespace

    from mlxpaged.models.paged_adapter import AdapterError, PagedLayerCache

    loaded = load(str(write_zoo(tmp_path / "llama", "llama")), "float32")
    kv_cache = engine(loaded, 4, 7).kv_cache
    heads, width = kv_cache.shape.layer_dims[0]
    meta = SimpleNamespace(positions=mx.arange(3), slot_mapping=mx.arange(3))
    for kvh, hd in ((2 * heads, width), (heads, 2 * width)):
        keys = mx.zeros((3, kvh, 1, hd))
        with pytest.raises(AdapterError) as e:
            PagedLayerCache(kv_cache, 0, meta).update_and_fetch(keys, keys)
        msg = str(e.value)
        assert "\n" not in msg and f"{kvh} KV heads x {hd}" in msg and f"holds {heads} x {width}" in msg, msg
    keys = mx.zeros((3, heads, 1, width))  # the pool's own shape is written
    assert PagedLayerCache(kv_cache, 0, meta).update_and_fetch(keys, keys)[0] is keys


# One type of each attention structure the adapter maps beyond plain attention: narrower values
# (padded), tiled KV heads, soft-capped scores, KV-reuse layers, attention-free layers, a cache
# per pass, learned positions per token, no final norm module.
STRUCTURES = "deepseek_v2 plamo gemma2 afm7 nemotron-nas iquestloopcoder gpt_bigcode nanochat".split()


@pytest.mark.parametrize("model_type", STRUCTURES)
def test_structure_forks_and_preempts_as_mlx_lm(model_type, tmp_path):
    """n=2 seeded samples forked from one prefill beside a greedy request, in a pool too small
    for all of them (preempted and recomputed): each equals mlx-lm's own run of that stream."""
    import mlx_lm

    from reference import contiguous_samples

    path = write_zoo(tmp_path / model_type, model_type)
    ref_model, tok = mlx_lm.load(str(path))
    prompt = tok.encode(PROMPT)
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)
    config = EngineConfig.of(block_size=4, num_blocks=20, max_num_batched_tokens=7, attention_impl="reference")
    eng = LLMEngine(load(str(path), "float32"), config)
    rid = eng.add_request(prompt, params)
    other = eng.add_request(prompt[:23], greedy(16))
    done = run_all(eng)
    assert eng.stats_dict()["preemptions"] > 0, eng.stats_dict()
    want = contiguous_samples(ref_model, prompt, 16, params, seed=3, sample_indices=range(2))
    assert [c.token_ids for c in done[rid].outputs] == want, model_type
    assert done[other].outputs[0].token_ids == mlx_lm_tokens(ref_model, prompt[:23], 16), model_type
