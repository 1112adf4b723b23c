"""The engine runs behind the walkthrough's sections 3 to 5, recorded as plain data.

Shared by ``paged_attention.ipynb`` and ``scripts/figures.py`` so both show the same runs.
Only the engine's public surface is read: ``LLMEngine.add_request`` / ``step``,
``engine.live_sequences()`` (each with ``block_ids`` and ``sample_index``),
``engine.block_manager.pool.num_used`` and ``engine.stats_dict()``.

Invariants of what is recorded:
- a block table is a list of pool block ids, in the order the sequence's tokens fill them;
- a block's reference count is the number of live sequences whose table holds it (the block
  manager's own count, since only sequences hold blocks);
- every step is followed by ``engine.check_invariants()``, so a record never shows a broken pool.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

from mlxpaged import EngineConfig, LLMEngine, SamplingParams

# Prompt text for the engine runs (the tiny test model's tokenizer was trained on these words).
TEXTS = [
    "The KV cache stores the keys and values of every token a sequence has seen.",
    "Paged attention borrows an idea from operating systems: virtual memory and paging.",
]
INTERLEAVED_PROMPTS = {"A": "The KV cache stores", "B": "Paged attention borrows an idea from operating systems:"}


def model_label(loaded) -> str:
    """The model's name: a converted GGUF's recorded source name, else its folder's name."""
    conversion = loaded.path / "mlxpaged_conversion.json"
    if conversion.exists():
        return json.loads(conversion.read_text()).get("source_name") or loaded.path.name
    return loaded.path.name


def _run(engine: LLMEngine, on_step) -> list:
    """Step until every request finishes, calling ``on_step(step)``; the finished outputs."""
    done, step = [], 0
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
        step += 1
        engine.check_invariants()
        on_step(step)
    return done


def interleaved(loaded, block_size: int = 4, num_blocks: int = 32, steps: int = 40) -> dict[int, dict[str, list[int]]]:
    """Decode the two ``INTERLEAVED_PROMPTS`` together; step -> {label: block ids} while both run."""
    engine = LLMEngine(loaded, EngineConfig.of(block_size=block_size, num_blocks=num_blocks))
    greedy = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    labels = {}
    for label, text in INTERLEAVED_PROMPTS.items():
        ids = loaded.tokenizer.encode(text)
        labels[tuple(ids)] = label  # a sequence is told apart by its prompt
        engine.add_request(ids, greedy, request_id=label)
    snapshots = {}

    def record(step):
        tables = {labels[tuple(s.token_ids[: s.num_prompt_tokens])]: list(s.block_ids) for s in engine.live_sequences()}
        if len(tables) == 2:
            snapshots[step] = tables

    _run(engine, record)
    return snapshots


def cow_prompt(tokenizer, length: int = 44) -> list[int]:
    """A prompt of exactly ``length`` tokens from ``TEXTS``."""
    ids = tokenizer.encode(" ".join(TEXTS) * 3)[:length]
    assert len(ids) == length, f"TEXTS encode to {len(ids)} tokens, fewer than {length}"
    return ids


@dataclass
class ForkRun:
    """One prompt decoded with n samples (copy-on-write forking)."""

    prompt: list[int]
    n: int
    block_size: int
    tables: dict[int, list[list[tuple[int, int]]]]  # step -> per sample: [(block id, ref count)]
    history: list[tuple[int, int, int]]  # (step, blocks in use, sum of table lengths)
    stats: dict  # engine.stats_dict() at the end
    samples: list[list[int]]  # each sample's generated ids


def fork_n(
    loaded,
    prompt: list[int],
    n: int = 4,
    max_tokens: int = 64,
    block_size: int = 16,
    num_blocks: int = 64,
    seed: int = 7,
) -> ForkRun:
    """Decode ``n`` sampled continuations of ``prompt``, recording block tables at every step."""
    params = SamplingParams(
        n=n, temperature=0.9, top_p=0.95, top_k=50, seed=seed, max_tokens=max_tokens, ignore_eos=True
    )
    engine = LLMEngine(loaded, EngineConfig.of(block_size=block_size, num_blocks=num_blocks))
    engine.add_request(prompt, params, request_id="fork")
    pool = engine.block_manager.pool
    tables, history = {}, []

    def record(step):
        seqs = sorted(engine.live_sequences(), key=lambda s: s.sample_index)
        if not seqs:
            return
        refs = Counter(b for s in seqs for b in s.block_ids)
        tables[step] = [[(b, refs[b]) for b in s.block_ids] for s in seqs]
        history.append((step, pool.num_used, sum(len(s.block_ids) for s in seqs)))

    done = _run(engine, record)
    return ForkRun(
        list(prompt), n, block_size, tables, history, engine.stats_dict(), [c.token_ids for c in done[0].outputs]
    )


def prefix_prompts(tokenizer, vocab_size: int, length: int = 96, shared: int = 85) -> dict[str, list[int]]:
    """A; B = A's first ``shared`` tokens then others; C = A with its 3rd token changed."""
    a = tokenizer.encode(" ".join(TEXTS) * 4)[:length]
    tail = tokenizer.encode(" Copy-on-write lets many samples share the blocks of one prompt.")
    b = a[:shared] + tail[: length - shared]
    assert len(a) == len(b) == length and b[shared] != a[shared]
    c = list(a)
    c[2] = a[2] + 1 if a[2] + 1 < vocab_size else a[2] - 1
    return {"A": a, "B": b, "C": c}


def prefix_reuse(loaded, prompts: dict[str, list[int]], block_size: int = 16, num_blocks: int = 64) -> dict[str, int]:
    """Run the prompts one after another in one engine; request id -> prompt tokens reused from the cache."""
    engine = LLMEngine(loaded, EngineConfig.of(block_size=block_size, num_blocks=num_blocks))
    cached = {}
    for rid, ids in prompts.items():  # each arrives after the previous one has finished
        engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=8), request_id=rid)
        cached.update({o.request_id: o.num_cached_tokens for o in _run(engine, lambda step: None)})
    return cached
