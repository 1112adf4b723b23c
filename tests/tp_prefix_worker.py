"""One rank of the tensor-parallel disk-tier test (started by tests/test_prefix_disk.py through `mlx.launch`).

`python tests/tp_prefix_worker.py --model DIR --store DIR --out FILE_PREFIX`: serves PROMPT greedily
on `LLM(DIR, distributed=True, prefix_cache_dir=STORE)` and writes {out}{rank}.json with the
tokens, the cached-token count and the store's own hit count.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlxpaged  # noqa: E402,F401  (first: it points MLX at the system OpenBLAS)

BLOCK_SIZE = 4
PROMPT = [(7 * i + 3) % 300 + 3 for i in range(40)]  # 9 full blocks before the last token


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from mlxpaged import LLM, SamplingParams

    llm = LLM(
        args.model, dtype="float32", block_size=BLOCK_SIZE, num_blocks=64, distributed=True, prefix_cache_dir=args.store
    )
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    store = llm.engine.prefix_store
    store.flush()
    rank = llm.engine.rank
    Path(f"{args.out}{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "tokens": out.outputs[0].token_ids,
                "cached": out.num_cached_tokens,
                "local_hit_blocks": store.stats.hit_blocks,
                "namespace_dir": str(store.dir),
            }
        )
    )


if __name__ == "__main__":
    main()
