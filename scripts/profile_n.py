"""Where the time of one n=4 request goes, against four separate requests for the same prompt
(as mlx_lm.server gets them), in the engine without HTTP, with cProfile.

Cases, each on a fresh engine, sampling at `--temperature` with `ignore_eos` (every sample
makes `--max-tokens` tokens):
- n4: one request with n=4 (the prompt is prefilled once, the samples fork its blocks);
- fan4: four requests, prefix caching on (requests arriving together may share the prompt);
- fan4-nocache: four requests, prefix caching off: each prefills, as the peer does.

    python scripts/profile_n.py                      # the offline 0.5B model (float32)
    python scripts/profile_n.py --tiny --max-tokens 8
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import mlxpaged  # noqa: F401  (first: system BLAS on Linux)


def run(loaded, case: str, prompt: list[int], max_tokens: int, temperature: float, top: int) -> dict:
    from mlxpaged import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(
        loaded, EngineConfig.of(enable_prefix_caching=case != "fan4-nocache", attention_impl="reference")
    )
    if case == "n4":
        engine.add_request(
            prompt, SamplingParams(n=4, temperature=temperature, seed=0, max_tokens=max_tokens, ignore_eos=True)
        )
    else:
        for i in range(4):
            engine.add_request(
                prompt, SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens, ignore_eos=True)
            )
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    prof.disable()
    wall = time.perf_counter() - t0
    st = engine.stats
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return {
        "case": case,
        "wall_s": wall,
        "steps": steps,
        "prefill_tokens": st.computed_prefill_tokens,
        "generation_tokens": st.generation_tokens,
        "prefill_s": st.prefill_time,
        "decode_s": st.decode_time,
        "profile": buf.getvalue(),
    }


def sampling_ms(vocab: int, rows: int, temperature: float, repeats: int = 15) -> float:
    """Median ms of one step's draw for `rows` rows of `vocab` logits (the sampler alone)."""
    import mlx.core as mx

    from mlxpaged import SamplingParams
    from mlxpaged.engine.sampler import sample_arrays, sample_key

    logits = mx.random.normal((rows, vocab))
    mx.eval(logits)
    params = [SamplingParams(temperature=temperature, max_tokens=1)] * rows
    keys = [None if temperature == 0 else sample_key(0, i) for i in range(rows)]
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(*sample_arrays(logits, params, keys).arrays())
        ts.append(time.perf_counter() - t)
    return 1e3 * sorted(ts)[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top", type=int, default=12, help="functions shown per profile (by own time)")
    ap.add_argument("--cases", default="n4,fan4-nocache,fan4")
    args = ap.parse_args()
    from mlxpaged.bench.models import load_models
    from mlxpaged.bench.prompts import builtin_texts

    loaded, _ = load_models(args.model, args.tiny, args.dtype, reference=False)
    ids = loaded.tokenizer.encode(" ".join(builtin_texts()))
    prompt = (ids * (1 + args.prompt_tokens // max(1, len(ids))))[: args.prompt_tokens]
    run(loaded, "n4", prompt[:16], 2, args.temperature, 1)  # warm-up: kernels, allocator
    for case in args.cases.split(","):
        r = run(loaded, case, prompt, args.max_tokens, args.temperature, args.top)
        print(
            f"== {case}: {r['wall_s']:.2f} s, {r['steps']} steps (prefill {r['prefill_s']:.2f} s, decode "
            f"{r['decode_s']:.2f} s), prefill tokens computed {r['prefill_tokens']}, generated {r['generation_tokens']}"
        )
        print("\n".join(r["profile"].splitlines()[4:]))

    vocab = loaded.model.args.vocab_size
    for t in (0.0, args.temperature):
        print(f"sampler alone, 4 rows of {vocab} logits, temperature {t}: {sampling_ms(vocab, 4, t):.2f} ms per step")


if __name__ == "__main__":
    main()
