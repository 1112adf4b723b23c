"""Independent references: mlx-lm's own Qwen2 on its contiguous KVCache; sampling in numpy.

The sampling reference follows the documented rules of `mlxpaged/sampler.py` without calling
it: Threefry-2x32 in numpy for a sample's starting key, vLLM's filter order in numpy, and
MLX's own `split`/`gumbel` for the random draws (the PRNG both sides share).
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlxpaged.engine.sampling_params import SamplingParams

_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)


def threefry2x32(key: tuple[int, int], c0, c1) -> tuple[np.ndarray, np.ndarray]:
    """Threefry-2x32-20 (Random123) of the counters (c0, c1) (arrays) under `key`, in numpy."""
    k = [np.uint32(key[0]), np.uint32(key[1])]
    k.append(np.uint32(0x1BD11BDA) ^ k[0] ^ k[1])
    x0 = np.asarray(c0, dtype=np.uint32) + k[0]
    x1 = np.asarray(c1, dtype=np.uint32) + k[1]
    for r in range(20):
        rot = np.uint32(_ROTATIONS[r % 8])
        x0 = x0 + x1
        x1 = ((x1 << rot) | (x1 >> (np.uint32(32) - rot))) ^ x0
        if r % 4 == 3:
            s = r // 4 + 1
            x0 = x0 + k[s % 3]
            x1 = x1 + k[(s + 1) % 3] + np.uint32(s)
    return x0, x1


def ref_sample_keys(seed: int, indices) -> np.ndarray:
    """Starting keys (uint32 [n, 2]) of samples `indices` of a request seeded `seed`:
    Threefry-2x32 of the counter (0, i) under the key (seed >> 32, seed mod 2**32)."""
    idx = np.asarray(indices, dtype=np.uint32)
    y0, y1 = threefry2x32((seed >> 32, seed & 0xFFFFFFFF), np.zeros_like(idx), idx)
    return np.stack([y0, y1], axis=-1)


def vllm_keep_mask(x: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Tokens of tempered logits `x [V]` that top-k, then top-p (on the top-k-renormalized
    distribution, the smallest most-probable prefix reaching `top_p`), keep."""
    x = x.astype(np.float64)
    keep = np.ones(x.shape, dtype=bool)
    if 0 < top_k < x.size:
        keep &= x >= np.sort(x)[-top_k]
    if top_p < 1.0:
        desc = np.sort(x[keep])[::-1]
        probs = np.exp(desc - desc.max())
        probs /= probs.sum()
        before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
        keep &= x >= desc[np.count_nonzero(before < top_p) - 1]
    return keep


def vllm_probs(logits, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """vLLM's sampling distribution: temperature, then top-k, then top-p (float64 [V])."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    keep = vllm_keep_mask(x, top_k, top_p)
    p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    return p / p.sum()


def filters_first_probs(logits, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The other order (mlx-lm's, and mlxpaged's before): top-k/top-p on the untempered
    distribution, then temperature on what is left."""
    x = np.asarray(logits, dtype=np.float64)
    keep = vllm_keep_mask(x, top_k, top_p)
    p = np.where(keep, np.exp((x - x[keep].max()) / temperature), 0.0)
    return p / p.sum()


def ref_draw(logits: mx.array, params: SamplingParams, key: mx.array) -> tuple[int, mx.array]:
    """One draw as the sampler documents it: key, sub = split(key); argmax(kept tempered
    logits + Gumbel(sub)). Returns (token, the advanced key)."""
    if params.greedy:
        return int(np.argmax(np.array(logits.astype(mx.float32)))), key
    key, sub = mx.random.split(key)
    x = np.array(logits.astype(mx.float32)) / np.float32(params.temperature)  # float32, as the sampler
    keep = vllm_keep_mask(x, params.top_k, params.top_p)
    g = np.array(mx.random.gumbel(x.shape, key=sub))
    return int(np.argmax(np.where(keep, x, np.float32(-np.inf)) + g)), key


def contiguous_generate(
    model,
    prompt_ids: list[int],
    max_tokens: int,
    params: SamplingParams | None = None,
    seed: int = 0,
    sample_index: int = 0,
) -> list[int]:
    """Generate with mlx-lm's model and contiguous cache, as sample `sample_index` of a request
    seeded `seed` (sampled with the numpy reference above)."""
    return contiguous_samples(model, prompt_ids, max_tokens, params, seed, [sample_index])[0]


def contiguous_samples(
    model,
    prompt_ids: list[int],
    max_tokens: int,
    params: SamplingParams | None = None,
    seed: int = 0,
    sample_indices=(0,),
) -> list[list[int]]:
    """`contiguous_generate` for several samples of one prompt at once: one row each in a batch
    of mlx-lm's contiguous cache (the prompt is the same length in every row, so no padding)."""
    params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens)
    cache = make_prompt_cache(model)
    keys = [None if params.greedy else mx.array(k) for k in ref_sample_keys(seed, list(sample_indices))]
    x = mx.array([prompt_ids] * len(keys))
    out: list[list[int]] = [[] for _ in keys]
    for _ in range(max_tokens):
        logits = model(x, cache=cache)[:, -1]
        for i in range(len(keys)):
            tok, keys[i] = ref_draw(logits[i], params, keys[i])
            out[i].append(tok)
        x = mx.array([[o[-1]] for o in out])
    return out


def decode_in_turns(loaded, prompts: list[list[int]], num_tokens: int, num_blocks: int = 256, block_size: int = 16):
    """Greedy-decode several prompts in one pool, one token each in turn (A, B, A, B, ...).

    Drives the allocator and the model runner directly, so consecutive blocks go to different
    sequences. Returns the sequences (generated ids in `output_token_ids`, tables in `block_ids`).
    """
    from mlxpaged.core.block_manager import BlockManager
    from mlxpaged.core.sequence import Sequence
    from mlxpaged.worker.kv_cache import CacheShape, PagedKVCache
    from mlxpaged.worker.model_runner import ModelRunner

    args = loaded.model.args
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    shape = CacheShape(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, loaded.dtype)
    runner = ModelRunner(loaded.model, PagedKVCache(shape, num_blocks, block_size, spec=loaded.cache_spec), "reference")
    seqs = [Sequence(list(p), len(p)) for i, p in enumerate(prompts)]
    for s in seqs:
        assert bm.allocate_slots(s, s.num_tokens) == []
        logits = runner.prefill(s, s.num_tokens)
        s.num_computed_tokens = s.num_tokens
        s.token_ids.append(int(mx.argmax(logits).item()))
    for _ in range(num_tokens - 1):
        for s in seqs:
            assert bm.allocate_slots(s, 1) == []
            logits = runner.decode([s])
            s.num_computed_tokens += 1
            s.token_ids.append(int(mx.argmax(logits[0]).item()))
    bm.check(seqs)
    return seqs


def tables_interleave(seqs) -> bool:
    """No block is shared, and neither sequence's blocks form one run that the other's avoid."""
    a, b = (set(s.block_ids) for s in seqs[:2])
    return not a & b and max(a) > min(b) and max(b) > min(a)


def reference_beam_search(model, prompt, width, max_tokens, eos=(), length_penalty=1.0):
    """Hugging Face's early_stopping=True beam search, written plainly: a contiguous mlx-lm cache
    per beam, copied when a beam is continued more than once; numpy log-softmax and ranking."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    beams = [([], 0.0, cache, np.array(logits.astype(mx.float32)))]  # (tokens, cumulative logprob, cache, next logits)
    finished = []  # (score, tokens, cumulative)

    def score(cum, tokens, eos_end):
        return cum / max(1, len(tokens) - eos_end) ** length_penalty

    def add(hyp):
        finished.append(hyp)
        finished.sort(key=lambda h: -h[0])
        del finished[width:]

    while True:
        tot = []
        for _toks, cum, _, lg in beams:
            lg = lg.astype(np.float64)
            tot.append(cum + lg - (np.log(np.sum(np.exp(lg - lg.max()))) + lg.max()))
        flat = np.concatenate(tot)
        best = np.lexsort((np.arange(flat.size), -flat))[: 2 * width]  # by value, ties to the lower (beam, token)
        vocab = len(tot[0])
        cands = [(float(flat[i]), int(i // vocab), int(i % vocab)) for i in best]
        live = []
        for rank, (cum, b, t) in enumerate(cands):
            toks = beams[b][0] + [t]
            if t in eos:
                if rank < width:
                    add((score(cum, toks, 1), toks, cum))
            elif len(live) < width:
                live.append((toks, cum, b, t))
        if len(finished) >= width or not live:
            break
        if len(live[0][0]) >= max_tokens:
            for toks, cum, _, _ in live:
                add((score(cum, toks, 0), toks, cum))
            break
        used, nxt = set(), []
        for toks, cum, b, t in live:
            c = beams[b][2] if b not in used else copy.deepcopy(beams[b][2])
            used.add(b)
            nxt.append((toks, cum, c, t))
        beams = []
        for toks, cum, c, t in nxt:
            lg = model(mx.array([[t]]), cache=c)[0, -1]
            beams.append((toks, cum, c, np.array(lg.astype(mx.float32))))
    return finished
