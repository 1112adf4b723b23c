"""LoRA adapters per request: rows of the base model and of several adapters in one packed pass,
each row's tokens against mlx-lm's own model with that adapter applied (`mlx_lm.load(...,
adapter_path=...)`, whose `LoRALinear` layers compute it) and its own contiguous cache."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from test_engine import drain_checked

from mlxpaged import EngineConfig, SamplingParams
from mlxpaged.engine.builder import build_engine
from mlxpaged.errors import MlxPagedError
from mlxpaged.testing.tiny_adapter import write_tiny_adapter
from mlxpaged.testing.tiny_model import write_tiny_qwen2

PROMPTS = [
    "The KV cache stores the keys and values of every token a sequence has seen, block by block.",
    "Paged attention borrows an idea from operating systems:",
]


@pytest.fixture(scope="module")
def adapters(tiny_model_path, tmp_path_factory):
    """name -> folder: A (every linear of every layer, rank 4), B (two linears of the last layer,
    rank 8, another scale), and A again in PEFT's format."""
    d = tmp_path_factory.mktemp("adapters")
    return {
        "A": write_tiny_adapter(tiny_model_path, d / "A", seed=1),
        "B": write_tiny_adapter(
            tiny_model_path,
            d / "B",
            seed=2,
            rank=8,
            scale=3.0,
            keys=["self_attn.q_proj", "mlp.down_proj"],
            num_layers=1,
        ),
        "A_peft": write_tiny_adapter(tiny_model_path, d / "A_peft", seed=1, peft=True),
    }


def reference(base, adapter, prompt_ids, max_tokens, quantize=False):
    """mlx-lm's greedy tokens with `adapter` (a folder, or None) applied to `base`."""
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.tuner.utils import load_adapters

    model, _ = mlx_lm.load(str(base))
    if quantize:
        nn.quantize(model, group_size=64, bits=4)
    if adapter is not None:
        load_adapters(model, str(adapter))
    steps = generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, -1))
    return [int(t) for t, _ in steps]


def greedy(max_tokens, adapter=None, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, adapter=adapter, **kw)


def spy_slots(engine) -> list[set]:
    """The adapter slots of each pass that had any (the runner's per-step input)."""
    seen, step = [], engine.adapters.step

    def recording(slots):
        seen.append({int(s) for s in slots})
        return step(slots)

    engine.adapters.step = recording
    return seen


def test_mixed_batch_matches_mlx_lm(tiny_loaded, tiny_model_path, adapters):
    """Base, A, B and A-as-PEFT rows in the same passes, with 7-token prefill chunks, n = 2 forks
    of an adapter's prompt and a pool small enough to preempt: each sample's tokens are mlx-lm's
    with its adapter."""
    n_out = 40
    config = EngineConfig.of(block_size=4, num_blocks=60, max_num_batched_tokens=7)
    engine = build_engine(tiny_loaded, config, adapters={k: str(v) for k, v in adapters.items()})
    seen = spy_slots(engine)
    tok = tiny_loaded.tokenizer
    asks = [(p, a) for p in PROMPTS for a in (None, "A", "B", "A_peft")]
    rids = [engine.add_request(p, greedy(n_out, a, n=2 if a == "B" else 1)) for p, a in asks]
    done = drain_checked(engine)
    assert engine.stats_dict()["preemptions"] > 0
    assert any(s >= {0, 1, 2, 3} for s in seen), "no pass mixed the base and every adapter"
    want = {}
    for (p, a), r in zip(asks, rids):
        ref_adapter = adapters["A" if a == "A_peft" else a] if a else None
        key = (p, ref_adapter)
        if key not in want:
            want[key] = reference(tiny_model_path, ref_adapter, tok.encode(p), n_out)
        got = [c.token_ids for c in done[r].outputs]
        assert got == [want[key]] * (2 if a == "B" else 1), (p, a)
    assert want[(PROMPTS[0], None)] != want[(PROMPTS[0], adapters["A"])] != want[(PROMPTS[0], adapters["B"])]


def test_prefix_hits_never_cross_adapters(tiny_loaded, tiny_model_path, adapters):
    """The same prompt under A, then B, then the base, then A again: only the last hits the cache
    (A's blocks), and every answer is mlx-lm's with its own adapter. With the adapter left out of
    the first block's hash, B and the base would reuse A's keys and values."""
    tok = tiny_loaded.tokenizer
    prompt = tok.encode(PROMPTS[0] * 2)
    engine = build_engine(
        tiny_loaded, EngineConfig.of(block_size=4, num_blocks=256), adapters={k: str(adapters[k]) for k in "AB"}
    )
    got = {}
    for a in ("A", "B", None, "A"):
        rid = engine.add_request(prompt, greedy(12, a))
        out = drain_checked(engine)[rid]
        got.setdefault(a, []).append((out.num_cached_tokens, out.outputs[0].token_ids))
    assert [c for c, _ in got["A"]] == [0, len(prompt) // 4 * 4 - (4 if len(prompt) % 4 == 0 else 0)]
    assert got["B"][0][0] == 0 and got[None][0][0] == 0
    for a, runs in got.items():
        want = reference(tiny_model_path, adapters[a] if a else None, prompt, 12)
        assert all(t == want for _, t in runs), a


def test_quantized_base_and_speculation(tiny_model_path, adapters):
    """QLoRA-style: the base quantized to 4 bits (`nn.QuantizedLinear`), the adapters in float;
    n-gram speculation verifies its proposals with each row's adapter."""
    from mlxpaged.loading.loader import load

    loaded = load(str(tiny_model_path), "float32")
    nn.quantize(loaded.model, group_size=64, bits=4)
    assert isinstance(loaded.model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    config = EngineConfig.of(block_size=4, num_blocks=256, speculative="ngram")
    engine = build_engine(loaded, config, adapters={k: str(adapters[k]) for k in "AB"})
    prompt = loaded.tokenizer.encode("a b c a b c a b c a b c")
    rids = {a: engine.add_request(prompt, greedy(24, a)) for a in (None, "A", "B")}
    done = drain_checked(engine)
    assert engine.stats_dict()["spec_proposed_tokens"] > 0
    for a, r in rids.items():
        want = reference(tiny_model_path, adapters[a] if a else None, prompt, 24, quantize=True)
        assert done[r].outputs[0].token_ids == want, a


def test_refusals(tiny_loaded, tiny_model_path, adapters, tmp_path):
    """An unknown adapter, one for another base model, and a DoRA adapter: one line naming it."""
    engine = build_engine(tiny_loaded, EngineConfig.of(num_blocks=64), adapters={"A": str(adapters["A"])})
    with pytest.raises(MlxPagedError, match="unknown adapter 'nope': this model serves 'A'"):
        engine.add_request("hi", greedy(2, "nope"))
    other = write_tiny_qwen2(tmp_path / "wide", hidden=128, heads=2, kv_heads=1, intermediate=256)
    wrong = write_tiny_adapter(other, tmp_path / "wrong", seed=3)
    shapes = r"is 256 -> \d+ in this model, the adapter's is 128 -> \d+: an adapter for another base model"
    with pytest.raises(MlxPagedError, match=r"adapter 'W' \(qwen2\): model\.layers\.\d\.\S+ " + shapes):
        build_engine(tiny_loaded, EngineConfig.of(num_blocks=64), adapters={"W": str(wrong)})
    dora = write_tiny_adapter(tiny_model_path, tmp_path / "dora", seed=4)
    cfg = (dora / "adapter_config.json").read_text().replace('"fine_tune_type": "lora"', '"fine_tune_type": "dora"')
    (dora / "adapter_config.json").write_text(cfg)
    with pytest.raises(MlxPagedError, match="fine_tune_type 'dora' is not served"):
        build_engine(tiny_loaded, EngineConfig.of(num_blocks=64), adapters={"D": str(dora)})


def test_beams_with_an_adapter(tiny_loaded, tiny_model_path, adapters):
    """A beam search with adapter B beside one on the base model: each is the plain beam search
    over mlx-lm's model with (or without) that adapter; B's forked beams keep B."""
    import mlx_lm
    from mlx_lm.tuner.utils import load_adapters

    from mlxpaged import BeamSearchParams

    from reference import reference_beam_search

    tok = tiny_loaded.tokenizer
    prompt = tok.encode(PROMPTS[1])
    engine = build_engine(tiny_loaded, EngineConfig.of(num_blocks=256), adapters={"B": str(adapters["B"])})
    rids = {
        a: engine.add_beam_request(prompt, BeamSearchParams(3, 10, ignore_eos=True, adapter=a)) for a in (None, "B")
    }
    done = drain_checked(engine)
    assert engine.stats_dict()["beam_forks"] > 0
    assert done[rids[None]].outputs[0].token_ids != done[rids["B"]].outputs[0].token_ids
    for a, r in rids.items():
        model, _ = mlx_lm.load(str(tiny_model_path))
        if a:
            load_adapters(model, str(adapters[a]))
        want = reference_beam_search(model, prompt, 3, 10)
        assert [c.token_ids for c in done[r].outputs] == [toks for _, toks, _ in want], a


def test_disk_hits_never_cross_adapters(tiny_loaded, tiny_model_path, adapters, tmp_path):
    """The prefix cache's disk tier (`prefix_cache_dir`): after A's request, a new engine (nothing
    in memory) serves B's request of the same prompt without A's blocks, and A's from disk."""
    tok = tiny_loaded.tokenizer
    prompt = tok.encode(" ".join(PROMPTS) * 3)
    store = tmp_path / "store"

    def run(adapter):
        config = EngineConfig.of(num_blocks=128, prefix_cache_dir=str(store))
        engine = build_engine(tiny_loaded, config, adapters={k: str(adapters[k]) for k in "AB"})
        rid = engine.add_request(prompt, greedy(8, adapter))
        out = drain_checked(engine)[rid]
        engine.prefix_store.flush()
        return out.num_cached_tokens, out.outputs[0].token_ids

    first, other, again = run("A"), run("B"), run("A")
    assert first[0] == 0 and other[0] == 0 and again[0] == len(prompt) // 16 * 16 - (len(prompt) % 16 == 0) * 16
    assert first[1] == again[1] == reference(tiny_model_path, adapters["A"], prompt, 8)
    assert other[1] == reference(tiny_model_path, adapters["B"], prompt, 8)


def test_draft_speculation_is_verified_with_the_adapter(tiny_loaded, tiny_model_path, adapters):
    """A draft model (here the base checkpoint itself, which knows no adapter) proposes; the target
    verifies each row's proposals with its adapter, so A's tokens stay mlx-lm's with A."""
    config = EngineConfig.of(num_blocks=256, speculative="draft", draft_model=str(tiny_model_path))
    engine = build_engine(tiny_loaded, config, adapters={"A": str(adapters["A"])})
    prompt = tiny_loaded.tokenizer.encode(PROMPTS[1])
    rids = {a: engine.add_request(prompt, greedy(16, a)) for a in (None, "A")}
    done = drain_checked(engine)
    st = engine.stats_dict()
    assert st["spec_proposed_tokens"] > st["spec_accepted_tokens"] > 0  # the base's proposals miss some of A's
    for a, r in rids.items():
        assert done[r].outputs[0].token_ids == reference(tiny_model_path, adapters[a] if a else None, prompt, 16), a
