"""Hybrid recurrent models beyond the family tests: state checkpoints for prefix hits with chunks
ending mid-block, beams over recurrent state, the refusals, and the CLI and server routes (the
server's for the latent-attention families too).

The reference is mlx-lm's own model on its own `make_prompt_cache` (an ArraysCache on each
recurrent layer); the checkpoints are tiny random ones written by mlx-lm's classes.
"""

from __future__ import annotations

import json

import mlx_lm
import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.errors import MlxPagedError
from mlxpaged.loading.loader import load
from mlxpaged.testing.tiny_model import write_tiny_family
from mlxpaged.testing.zoo import write_zoo

from drive import run, run_all
from reference import contiguous_generate, reference_beam_search

SYSTEM = "Paged attention borrows an idea from operating systems: virtual memory and paging. "
FOLLOW = [SYSTEM + "The KV cache stores", SYSTEM + "Copy-on-write lets many samples share one prompt."]


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


# The hybrid families, and one model of each recurrent kind without attention or with two caches
# in one layer (mlxpaged.testing.zoo's checkpoints): Mamba-1, RWKV-7, Falcon-H1 (Mamba-2 and attention
# in every layer), RecurrentGemma (RG-LRU and local attention), Kimi Linear (Kimi Delta Attention
# beside latent attention), Bailing linear attention (rotated by the attention cache's offset),
# LongCat-Flash n-gram (its embedding's state, the last tokens, kept before the layers').
RECURRENT = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "granitemoehybrid"]
RECURRENT += ["mamba", "rwkv7", "falcon_h1", "recurrent_gemma", "kimi_linear", "bailing_moe_linear"]
RECURRENT += ["longcat_flash_ngram"]


@pytest.fixture(scope="module", params=RECURRENT)
def hybrid(request, tmp_path_factory):
    path = write_zoo(tmp_path_factory.mktemp(request.param), request.param)
    ref_model, tok = mlx_lm.load(str(path))
    return path, load(str(path), "float32"), ref_model, tok


def _engine(loaded, **kw):
    return LLMEngine(loaded, EngineConfig.of(block_size=4, num_blocks=160, attention_impl="reference", **kw))


@pytest.mark.parametrize("chunk", [6, 7])
def test_prefix_hits_resume_from_state_checkpoints(hybrid, chunk):
    """Chunks of 6 or 7 tokens end mid-block, so each chunk's checkpoint is taken between two
    calls of the recurrent layer; later prompts sharing the warm prompt's blocks start from the
    checkpoint of their last shared block and give mlx-lm's tokens."""
    _, loaded, ref_model, tok = hybrid
    engine = _engine(loaded, max_num_batched_tokens=chunk)
    engine.add_request(SYSTEM, greedy(3), request_id="warm")
    run_all(engine)
    rids = [engine.add_request(p, greedy(16)) for p in FOLLOW]
    done = run_all(engine)
    for p, r in zip(FOLLOW, rids):
        assert done[r].outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(p), 16), p
    hit = min(done[r].num_cached_tokens for r in rids)
    assert hit >= 8 and hit % 4 == 0, hit
    assert engine.runner.checkpoints.hits >= len(FOLLOW)


def test_no_checkpoint_no_hit(hybrid):
    """With no room for checkpoints the KV blocks are still cached, but a hit would leave the
    recurrent layers without their state: no hit is taken, and the tokens are still mlx-lm's."""
    _, loaded, ref_model, tok = hybrid
    engine = _engine(loaded, max_num_batched_tokens=6)
    engine.runner.checkpoints.cap_bytes = 0
    engine.add_request(SYSTEM, greedy(3))
    run_all(engine)
    rid = engine.add_request(FOLLOW[0], greedy(16))
    done = run_all(engine)
    assert done[rid].num_cached_tokens == 0
    assert done[rid].outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(FOLLOW[0]), 16)


def test_prefix_caching_off_takes_no_checkpoints(hybrid):
    _, loaded, ref_model, tok = hybrid
    engine = _engine(loaded, enable_prefix_caching=False)
    assert engine.runner.checkpoints is None and engine.block_manager.state_groups == []
    rid = engine.add_request(FOLLOW[1], greedy(12))
    assert run_all(engine)[rid].outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(FOLLOW[1]), 12)


@pytest.mark.parametrize("width", [2, 4])
def test_beams_carry_recurrent_state(hybrid, width):
    """Beams fork and drop every step; each beam's recurrent state follows its block table
    (a fork shares it), against a plain beam search on mlx-lm's caches copied per beam."""
    from mlxpaged import BeamSearchParams

    _, loaded, ref_model, tok = hybrid
    engine = _engine(loaded)
    prompt = tok.encode(FOLLOW[0])
    rid = engine.add_beam_request(prompt, BeamSearchParams(beam_width=width, max_tokens=10, ignore_eos=True))
    got = run_all(engine)[rid]
    want = reference_beam_search(ref_model, prompt, width, 10)
    assert [c.token_ids for c in got.outputs] == [toks for _, toks, _ in want]
    assert engine.stats_dict()["beam_forks"] > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_ngram_speculation_rolls_the_state_back(hybrid, overlap):
    """n-gram speculation on a hybrid model: a speculating row runs its recurrent layers one
    position at a time and keeps the state after each, so rejected proposals roll back to the
    last accepted token. A repeated phrase makes proposals; greedy tokens stay mlx-lm's."""
    _, loaded, ref_model, tok = hybrid
    phrase = tok.encode(" the cache stores blocks of keys")
    prompt = phrase * 4
    engine = _engine(
        loaded, speculative="ngram", num_speculative_tokens=3, prompt_lookup_min=1, async_scheduling=overlap
    )
    rids = [engine.add_request(prompt, greedy(40)), engine.add_request(FOLLOW[0], greedy(40))]
    done = run_all(engine)
    assert done[rids[0]].outputs[0].token_ids == contiguous_generate(ref_model, prompt, 40)
    assert done[rids[1]].outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(FOLLOW[0]), 40)
    st = engine.stats
    if not overlap:  # (overlapped steps propose only where the last token is known: fewer, maybe none)
        assert st.spec_proposed_tokens > st.spec_accepted_tokens  # some proposals were rejected


def test_a_recurrent_draft_model_is_refused(hybrid):
    path, loaded, _, _ = hybrid
    with pytest.raises(MlxPagedError) as e:
        _engine(loaded, speculative="draft", draft_model=str(path))
    msg = str(e.value)
    assert "draft model with recurrent layers" in msg and "\n" not in msg, msg


def test_disk_tier_keeps_state_checkpoints(hybrid, tmp_path):
    """The disk tier stores a prompt block's state checkpoint beside its KV, under the same hash:
    a fresh engine (a new process's empty pool) resumes from both. Unreadable state files are
    deleted and taken as misses: no hit, the same tokens."""
    _, loaded, ref_model, tok = hybrid
    d = str(tmp_path / "cache")
    first = _engine(loaded, max_num_batched_tokens=6, prefix_cache_dir=d)
    first.add_request(SYSTEM, greedy(3))
    run_all(first)
    first.prefix_store.flush()
    want = contiguous_generate(ref_model, tok.encode(FOLLOW[0]), 16)
    states = list(first.prefix_store.dir.glob("states/*.safetensors"))
    assert states

    second = _engine(loaded, prefix_cache_dir=d)
    rid = second.add_request(FOLLOW[0], greedy(16))
    done = run_all(second)[rid]
    assert done.outputs[0].token_ids == want
    assert done.num_cached_tokens >= 8 and second.runner.checkpoints.disk_reads >= 1

    states = list(first.prefix_store.dir.glob("states/*.safetensors"))  # the second engine's too
    for f in states:
        f.write_bytes(b"not a checkpoint")
    third = _engine(loaded, prefix_cache_dir=d)
    rid = third.add_request(FOLLOW[0], greedy(16))
    done = run_all(third)[rid]
    assert done.outputs[0].token_ids == want
    assert done.num_cached_tokens == 0 and third.runner.checkpoints.bad_files >= 1


def test_states_of_other_shapes_decode_beside_each_other(tmp_path):
    """LongCat-Flash n-gram's embedding state is a sequence's last tokens, shorter while the
    sequence is young: decodes whose states differ in shape are run apart, not stacked, and give
    mlx-lm's tokens (prompts of 1, 2 and 6 tokens decoding in the same steps)."""
    path = write_zoo(tmp_path / "ngram", "longcat_flash_ngram")
    ref_model, tok = mlx_lm.load(str(path))
    engine = _engine(load(str(path), "float32"))
    prompts = [[5], [7, 9], tok.encode("Paged attention borrows an idea")]
    rids = [engine.add_request(p, greedy(8)) for p in prompts]
    done = run_all(engine)
    for p, r in zip(prompts, rids):
        assert done[r].outputs[0].token_ids == contiguous_generate(ref_model, p, 8), p


def test_generate_cli_gives_mlx_lm_tokens(hybrid):
    path, _, ref_model, tok = hybrid
    r = run("--model", str(path), "--prompt", FOLLOW[0], "--no-chat", "-t", "12", "--ignore-eos", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)["outputs"][0]["token_ids"]
    assert out == contiguous_generate(ref_model, tok.encode(FOLLOW[0]), 12)


def test_llm_api_n4_forks_share_the_prefill(hybrid):
    """`LLM.generate` with n=4 seeded samples: one prefill, four forks of its state."""
    from mlxpaged.engine.llm import LLM

    from reference import contiguous_samples

    path, _, ref_model, tok = hybrid
    llm = LLM(str(path), dtype="float32", block_size=4, num_blocks=96, attention_impl="reference")
    params = SamplingParams(n=4, temperature=0.9, seed=5, max_tokens=10, ignore_eos=True)
    prompt = tok.encode(FOLLOW[1])
    got = [c.token_ids for c in llm.generate([prompt], params)[0].outputs]
    assert got == contiguous_samples(ref_model, prompt, 10, params, seed=5, sample_indices=range(4))


def test_serve_completions_give_mlx_lm_tokens(hybrid):
    """The server's completions route (in process, the app `mlxpaged serve` runs) on a hybrid
    model: two concurrent greedy requests sharing a prefix, each mlx-lm's text."""
    _, loaded, ref_model, tok = hybrid
    _serve_matches(loaded, ref_model, tok)


@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_k2", "glm4_moe_lite"])
def test_serve_latent_attention_gives_mlx_lm_tokens(name, tmp_path):
    """The same for the MLA families (paged_adapter.LatentLayerCache), whose CLI run is in
    test_families.py."""
    path = write_tiny_family(tmp_path / name, name)
    ref_model, tok = mlx_lm.load(str(path))
    _serve_matches(load(str(path), "float32"), ref_model, tok)


def _serve_matches(loaded, ref_model, tok):
    import concurrent.futures

    import mlx.core as mx
    from fastapi.testclient import TestClient

    from mlxpaged.server.app import build_app
    from mlxpaged.server.engine_loop import EngineLoop
    from mlxpaged.server.metrics import Metrics

    mx.eval(loaded.model.parameters())
    loop = EngineLoop(lambda: _engine(loaded))
    loop.start()
    app = build_app(loop, Metrics(), model_id="tiny")
    with TestClient(app, raise_server_exceptions=False) as c:

        def ask(p):
            body = {"model": "tiny", "prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            texts = list(pool.map(ask, FOLLOW))
    for p, text in zip(FOLLOW, texts):
        detok = tok.detokenizer  # mlx-lm's streaming detokenizer, as mlx_lm.generate uses it
        detok.reset()
        special = set(tok.all_special_ids)  # the server skips special tokens (vLLM's skip_special_tokens)
        for t in contiguous_generate(ref_model, tok.encode(p), 10):
            if t not in special:
                detok.add_token(t)
        detok.finalize()
        assert text == detok.text, p


@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_k2", "glm4_moe_lite"])
def test_generate_cli_latent_attention(name, tmp_path):
    path = write_tiny_family(tmp_path / name, name)
    ref_model, tok = mlx_lm.load(str(path))
    r = run("--model", str(path), "--prompt", FOLLOW[0], "--no-chat", "-t", "12", "--ignore-eos", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["outputs"][0]["token_ids"] == contiguous_generate(ref_model, tok.encode(FOLLOW[0]), 12)


def test_latent_pool_keeps_one_row_per_token(tmp_path):
    """An MLA model's pool holds one `kv_lora_rank + qk_rope_head_dim` row per token and layer
    (read as key and value): the bytes a contiguous latent cache holds, not K and V."""
    path = write_tiny_family(tmp_path / "deepseek_v3", "deepseek_v3")
    cfg = json.loads((path / "config.json").read_text())
    engine = LLMEngine(load(str(path), "float32"), EngineConfig.of(block_size=4, num_blocks=32))
    row = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4  # float32
    assert engine.kv_cache.nbytes == 32 * 4 * cfg["num_hidden_layers"] * row
    assert engine.kv_cache.values == []


def test_latent_pool_on_the_disk_tier(tmp_path):
    """The disk tier stores and loads an MLA model's keys-only blocks: a fresh engine resumes
    from them and gives mlx-lm's tokens."""
    path = write_tiny_family(tmp_path / "glm4_moe_lite", "glm4_moe_lite")
    ref_model, tok = mlx_lm.load(str(path))
    loaded = load(str(path), "float32")
    d = str(tmp_path / "cache")
    first = _engine(loaded, prefix_cache_dir=d)
    first.add_request(SYSTEM, greedy(3))
    run_all(first)
    first.prefix_store.flush()
    second = _engine(loaded, prefix_cache_dir=d)
    rid = second.add_request(FOLLOW[1], greedy(12))
    done = run_all(second)[rid]
    assert done.num_cached_tokens >= 8
    assert done.outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(FOLLOW[1]), 12)
