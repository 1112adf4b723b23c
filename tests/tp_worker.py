"""One rank of the tensor-parallel tests (started by tests/test_tp.py through `mlx.launch`).

`python tests/tp_worker.py --model DIR --out DIR --mode MODE`, once per rank:
- check: `LLM(DIR, distributed=True)` runs `workload` and writes rank{r}_{i}.json (tokens, pool
  shape, resident weight bytes) and rank{r}_{i}.npz (every step's logits) for the i-th --model
  (`DIR#kv8`: with an 8-bit KV cache); real: `real_workload` (--model default is the offline 0.5B);
- die / hang / diverge: rank 1 kills itself, stops itself, or alters a sampled token at step 3;
- mismatch: rank 1 runs another block size (or --model-1, another checkpoint).
The single-process reference runs `workload` too, so both sides do the very same calls.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlxpaged  # noqa: E402,F401  (first: it points MLX at the system OpenBLAS)

BLOCK_SIZE = 4
GREEDY = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [300, 2, 71], [12] * 9, list(range(20, 47))]


def workload(llm) -> dict:
    """Greedy prompts, n=4 seeded samples, then a prompt that hits the prefix cache; the tokens
    (and cached-token counts) of each, in order."""
    from mlxpaged import SamplingParams

    greedy = llm.generate(GREEDY, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    sampled = llm.generate(
        GREEDY[0], SamplingParams(n=4, temperature=0.9, top_p=0.95, seed=7, max_tokens=10, ignore_eos=True)
    )
    # Shares GREEDY[3]'s first 24 tokens: 6 full blocks of 4 come from the prefix cache.
    hit = llm.generate(GREEDY[3][:24] + [77, 78], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    return {
        "greedy": [o.outputs[0].token_ids for o in greedy],
        "sampled": [c.token_ids for c in sampled[0].outputs],
        "prefix_hit": hit[0].outputs[0].token_ids,
        "prefix_cached_tokens": hit[0].num_cached_tokens,
    }


def record_logits(engine) -> list:
    """Wrap the runner so every step's logits are kept (numpy copies)."""
    import numpy as np

    steps, forward = [], engine.runner.forward

    def wrapped(batch):
        logits = forward(batch)
        steps.append(np.array(logits))
        return logits

    engine.runner.forward = wrapped
    return steps


def weight_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def real_workload(llm, max_tokens: int) -> dict:
    """Greedy tokens of two prompts on the real model."""
    from mlxpaged import SamplingParams

    prompts = ["The KV cache stores", "def fibonacci(n):"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return {"greedy": [o.outputs[0].token_ids for o in outs]}


def _sabotage(engine, mode: str, out: Path) -> None:
    """On rank 1: at step 3 die, stop, or sample another token than rank 0 (the moment it
    does so goes to out/sabotage_time)."""
    import time

    step = engine.step

    def sabotaged():
        if engine.stats.steps == 3:
            (out / "sabotage_time").write_text(repr(time.time()))
            if mode == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "hang":
                os.kill(os.getpid(), signal.SIGSTOP)
            if mode == "diverge":  # the scheduler appends what it is given: hand it other tokens
                update = engine.scheduler.update_from_output

                def altered(step_id, pairs, tokens, logprobs, check_stop):
                    return update(step_id, pairs, [(t + 1) % 300 for t in tokens], logprobs, check_stop)

                engine.scheduler.update_from_output = altered
        return step()

    engine.step = sabotaged


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model", required=True, action="append", help="repeatable (mode check): one run each, files rank{r}_{i}.*"
    )
    ap.add_argument("--model-1", help="rank 1's checkpoint in mode mismatch")
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", default="check", choices=["check", "real", "die", "hang", "diverge", "mismatch"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens in mode real")
    a = ap.parse_args()

    import mlx.core as mx

    rank = mx.distributed.init().rank()
    for i, m in enumerate(a.model):
        m, _, kv = m.partition("#kv")
        run(a, i, None if m == "default" else m, rank, int(kv) if kv else None)


def run(a, index: int, model: str | None, rank: int, kv_bits: int | None = None) -> None:
    import mlx.core as mx

    from mlxpaged import LLM
    from mlxpaged.errors import MlxPagedError

    block_size = BLOCK_SIZE
    if a.mode == "mismatch" and rank == 1:
        model, block_size = a.model_1 or model, BLOCK_SIZE if a.model_1 else 2 * BLOCK_SIZE
    try:
        llm = LLM(model, dtype=a.dtype, distributed=True, block_size=block_size, num_blocks=64, kv_bits=kv_bits)
        eng = llm.engine
        info = {
            "rank": rank,
            "world": eng.group.size(),
            "pool_shape": list(eng.kv_cache.keys[0].shape),
            "num_kv_heads": eng.cache_shape.num_kv_heads,
            "weight_bytes": weight_bytes(eng.loaded.model),
            "active_bytes": mx.get_active_memory(),
        }
        if a.mode in ("die", "hang", "diverge") and rank == 1:
            _sabotage(eng, a.mode, Path(a.out))
        steps = record_logits(eng)
        info.update(real_workload(llm, a.tokens) if a.mode == "real" else workload(llm))
        info["checks"] = eng.num_checks
    except MlxPagedError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    import numpy as np

    out = Path(a.out)
    (out / f"rank{rank}_{index}.json").write_text(json.dumps(info))
    np.savez(out / f"rank{rank}_{index}.npz", *steps)


if __name__ == "__main__":
    main()
