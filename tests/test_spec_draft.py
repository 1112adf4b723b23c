"""Speculative decoding with a draft model (`speculative="draft"`, engine/draft.py).

References: the same engine without speculation (whose tokens the other tests tie to mlx-lm's
contiguous cache), mlx-lm's contiguous cache itself for the target, and for the draft: every
proposal must be the draft model's own greedy continuation of the sequence's known tokens,
computed by mlx-lm's contiguous cache on the draft checkpoint. That last check fails if the
draft's paged rows are ever stale (a sequence's draft KV kept past a rollback, a preemption or a
copy-on-write copy), which output identity alone cannot see: the target's verification hides a
bad proposal.
"""

from __future__ import annotations

import mlx_lm
import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.engine.draft import DraftProposer
from mlxpaged.errors import MlxPagedError
from mlxpaged.testing.tiny_model import write_tiny_family, write_tiny_qwen2, write_tokenizer

from drive import run_work
from reference import contiguous_generate


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    """A draft of another family and depth with the target's tokenizer: a one-layer Llama."""
    return write_tiny_family(tmp_path_factory.mktemp("draft") / "llama", "llama", seed=5, layers=1)


@pytest.fixture(scope="module")
def mlx_lm_draft(draft_path):
    return mlx_lm.load(str(draft_path))[0]


def engine_for(tiny_loaded, draft: str | None, **kw) -> LLMEngine:
    cfg = dict(
        block_size=4,
        num_blocks=512,
        max_num_batched_tokens=64,
        attention_impl="reference",
        speculative="draft" if draft else None,
        draft_model=str(draft) if draft else None,
        num_speculative_tokens=4,
    )
    return LLMEngine(tiny_loaded, EngineConfig.of(**{**cfg, **kw}))


def check_draft_rows(engine: LLMEngine) -> None:
    engine.check_invariants()
    for seq in engine.live_sequences():
        assert seq.draft_computed <= seq.num_computed_tokens


def run(engine: LLMEngine, work, arrivals: dict[int, list] | None = None) -> dict:
    """Queue `work` [(prompt, params)], step to the end checking the allocator after every step
    (and the draft's stored count against the target's); outputs by request id."""
    return run_work(engine, work, arrivals, after_step=check_draft_rows)


def record_proposals(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """(known tokens, proposal) of every row the draft proposes for."""
    seen = []
    propose = DraftProposer.propose

    def recording(self, specs):
        contexts = [list(d.seq.token_ids) for d in specs]
        propose(self, specs)
        seen.extend((c, list(d.proposal)) for c, d in zip(contexts, specs))

    monkeypatch.setattr(DraftProposer, "propose", recording)
    return seen


def prompt(i: int, length: int = 14) -> list[int]:
    return [(11 * i + 7 * j * j + 3 * j) % 300 + 3 for j in range(length)]


GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


def test_draft_equal_to_the_target_accepts_every_greedy_proposal(tiny_loaded, tiny_model_path, mlx_lm_tiny):
    """The target as its own draft: its greedy proposals are the target's greedy tokens, so all
    are accepted, through ragged arrivals, n=4 forks and a pool tight enough to preempt; the
    tokens are mlx-lm's. A stale draft row anywhere would turn a proposal down."""
    work = [(prompt(i, 6 + 5 * i), GREEDY) for i in range(3)]
    work.append((prompt(7, 9), SamplingParams(n=4, temperature=0, max_tokens=30, ignore_eos=True)))
    later = {4: [(prompt(9, 21), GREEDY)]}
    for num_blocks in (512, 40):
        engine = engine_for(tiny_loaded, tiny_model_path, num_blocks=num_blocks, speculative_max_batch_size=16)
        got = run(engine, work, later)
        model, _ = mlx_lm_tiny
        for rid, p in [("0", work[0][0]), ("3", work[3][0]), ("4", later[4][0][0])]:
            assert all(toks == contiguous_generate(model, p, 30) for toks in got[rid]), rid
        proposed, accepted = engine.stats.spec_proposed_tokens, engine.stats.spec_accepted_tokens
        assert proposed > 100 and accepted == proposed, (proposed, accepted)
        assert (engine.scheduler.num_preemptions > 0) == (num_blocks == 40)


@pytest.mark.parametrize("num_blocks", [512, 40])
def test_proposals_are_the_drafts_own_greedy_tokens(tiny_loaded, draft_path, mlx_lm_draft, monkeypatch, num_blocks):
    """Another family as draft, sampled and greedy requests (rejections, rollbacks), n=4 forks,
    and (40 blocks) preemption: the outputs are those of plain decoding, and every proposal is
    mlx-lm's greedy continuation of the row's tokens on the draft checkpoint."""
    work = [
        (prompt(0, 10), GREEDY),
        (prompt(1, 17), SamplingParams(temperature=0.8, top_k=40, seed=1, max_tokens=30, ignore_eos=True)),
        (prompt(2, 5), SamplingParams(n=4, temperature=0.7, seed=2, max_tokens=25, ignore_eos=True)),
    ]
    later = {3: [(prompt(3, 12), SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True))]}
    ref = run(engine_for(tiny_loaded, None, num_blocks=num_blocks), work, later)
    seen = record_proposals(monkeypatch)
    engine = engine_for(tiny_loaded, draft_path, num_blocks=num_blocks, speculative_max_batch_size=16)
    assert run(engine, work, later) == ref
    assert len(seen) > 40 and engine.stats.spec_verifications == len(seen)
    for context, proposal in seen:
        assert proposal == contiguous_generate(mlx_lm_draft, context, len(proposal)), context
    assert (engine.scheduler.num_preemptions > 0) == (num_blocks == 40)


def test_quantized_target_cache(tiny_loaded, tiny_model_path):
    """An 8-bit target cache beside the draft's float pool: the tokens of plain decoding."""
    work = [(prompt(i, 8 + 3 * i), GREEDY) for i in range(3)]
    ref = run(engine_for(tiny_loaded, None, kv_bits=8, kv_group_size=32), work)
    engine = engine_for(tiny_loaded, tiny_model_path, kv_bits=8, kv_group_size=32)
    assert run(engine, work) == ref
    assert engine.stats.spec_accepted_tokens > 0


def test_growing_pool_grows_and_trims_both_pools(tiny_loaded, tiny_model_path, mlx_lm_tiny):
    engine = engine_for(tiny_loaded, tiny_model_path, num_blocks=None, kv_chunk_blocks=8, kv_memory_gb=0.01)
    got = run(engine, [(prompt(i, 20), GREEDY) for i in range(3)])
    assert engine.drafter.kv_cache.num_blocks == engine.kv_cache.num_blocks > 8
    assert got["1"][0] == contiguous_generate(mlx_lm_tiny[0], prompt(1, 20), 30)
    engine.trim_pool()
    assert engine.drafter.kv_cache.num_blocks == engine.kv_cache.num_blocks == engine.num_blocks


def test_refusals(tiny_loaded, tmp_path):
    with pytest.raises(ValueError, match="needs a draft model"):
        EngineConfig.of(speculative="draft")
    with pytest.raises(ValueError, match="needs speculative='draft'"):
        EngineConfig.of(speculative="ngram", draft_model="x")
    other = write_tiny_qwen2(tmp_path / "other")
    write_tokenizer(other, vocab_size=300)  # another vocabulary
    with pytest.raises(MlxPagedError, match="must share the target's tokenizer"):
        engine_for(tiny_loaded, other)


def test_generate_cli(tiny_model_path, draft_path):
    """`mlxpaged generate --speculative draft --draft-model M --json --temp 0`: the tokens of the
    run without speculation, and the summary names the proposer."""
    import json

    from click.testing import CliRunner

    from mlxpaged.cli.main import main

    base = ["generate", "--model", str(tiny_model_path), "--no-chat", "--prompt", "The KV cache stores"]
    base += ["-t", "24", "--ignore-eos", "--temp", "0", "--attention", "reference"]
    plain = CliRunner().invoke(main, [*base, "--json"])
    spec = CliRunner().invoke(main, [*base, "--json", "--speculative", "draft", "--draft-model", str(tiny_model_path)])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    out = json.loads(spec.output)
    assert out["outputs"][0]["token_ids"] == json.loads(plain.output)["outputs"][0]["token_ids"]
    assert out["stats"]["spec_accepted_tokens"] == out["stats"]["spec_proposed_tokens"] > 0
    summary = CliRunner().invoke(main, [*base, "--speculative", "draft", "--draft-model", str(draft_path)])
    assert summary.exit_code == 0 and "Speculative decoding (draft):" in summary.output
    bad = CliRunner().invoke(main, [*base, "--speculative", "draft", "--draft-model", "/nonexistent/draft"])
    assert bad.exit_code != 0 and "Traceback" not in bad.output and "draft" in bad.output.lower()
