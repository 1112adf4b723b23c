"""Image requests: mlxpaged's engine against mlx-vlm's `generate`, in one run.

python scripts/bench_vision.py                      # a tiny random Qwen2.5-VL (mlxpaged.testing.tiny_vlm)
python scripts/bench_vision.py --model-type gemma3 --size 448 --repeats 5 --json docs/data/FILE.json
python scripts/bench_vision.py --model PATH --size 448 --repeats 3

Three figures, each repeat on new images (no cache holds them), the order alternating by repeat:

- TTFT: mlx-vlm's `stream_generate` to its first token on a new image; mlxpaged's engine (prefix
  caching on) to its first token on another new image (the first request), then the same image
  again (the second request: the encoder cache and the prefix hit). Each time runs from the
  prompt text and the decoded image to the first token (processing, vision tower, prefill).
- n=4 over one image: one request of n=4 greedy samples, against 4 requests of the same prompt
  and image added at once (the prefix cache shares what it can between them), and against
  mlx-vlm's `generate` run 4 times: wall time from the prompt text and decoded image to the last
  token, and the KV blocks held at the peak (with the blocks the samples would hold unshared).
  Every sample's tokens are checked against mlx-vlm's.
- memory per image: the encoder cache's bytes for one image, the image's features a request holds
  while its image tokens are prefilled (dropped after), and the KV bytes of its image tokens
  (mlxpaged's blocks; mlx-vlm's contiguous cache holds the same per token).
Prints each repeat, then medians and ranges; `--json` writes every repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlxpaged  # noqa: E402,F401  (before mlx)


def noise(seed: int, size: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((size, size, 3)) * 255).astype(np.uint8))


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(values: list[float], scale: float = 1e3, unit: str = "ms") -> str:
    s = spread(values)
    return f"{s['median'] * scale:.1f} {unit} ({s['min'] * scale:.1f}-{s['max'] * scale:.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a vision checkpoint (default: a tiny random checkpoint of --model-type)")
    ap.add_argument(
        "--model-type", default="qwen2_5_vl", help="the tiny checkpoint's family (mlxpaged.testing.tiny_vlm)"
    )
    ap.add_argument("--size", type=int, default=224, help="image side in pixels")
    ap.add_argument(
        "--max-image-tokens",
        type=int,
        help="the tiny Qwen checkpoint's image tokens at most (its processor's max_pixels; 64)",
    )
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per sample in the n=4 figure")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write every repeat here")
    args = ap.parse_args()
    if args.repeats < 1 or args.size < 1 or args.max_tokens < 1:
        raise SystemExit("error: --repeats, --size and --max-tokens must be positive")
    from mlx_vlm import generate, load, stream_generate

    from mlxpaged import LLM, SamplingParams

    path = args.model
    if path is None:
        from mlxpaged.testing.tiny_vlm import write_tiny_vlm

        path = str(write_tiny_vlm(Path(tempfile.mkdtemp()) / args.model_type, args.model_type))
        if args.max_image_tokens:
            conf = Path(path) / "preprocessor_config.json"
            pre = json.loads(conf.read_text())
            if "max_pixels" not in pre:
                raise SystemExit(f"error: --max-image-tokens: the tiny {args.model_type} processor has no max_pixels")
            pre["max_pixels"] = args.max_image_tokens * (pre["patch_size"] * pre["merge_size"]) ** 2
            conf.write_text(json.dumps(pre))
    model, processor = load(path)
    llm = LLM(path)
    eng = llm.engine
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    four = SamplingParams(n=4, temperature=0.0, max_tokens=args.max_tokens)
    seeds = iter(range(10**6))

    def vlm_ttft(image) -> float:
        t0 = time.perf_counter()
        for _ in stream_generate(model, processor, prompt, image=[image], max_tokens=1, temperature=0.0):
            return time.perf_counter() - t0
        raise RuntimeError("mlx-vlm generated nothing")

    def ours_ttft(image) -> float:
        t0 = time.perf_counter()
        rid = eng.add_request(prompt, first, images=[image])
        while True:
            for out in eng.step():
                if out.request_id == rid and out.outputs[0].token_ids:
                    dt = time.perf_counter() - t0
                    while eng.has_unfinished_requests():
                        eng.step()
                    return dt

    def vlm_four(image) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outs = [
            list(
                generate(model, processor, prompt, image=[image], max_tokens=args.max_tokens, temperature=0.0).token_ids
            )
            for _ in range(4)
        ]
        return time.perf_counter() - t0, outs

    def ours_four(image, shared: bool) -> tuple[float, list[list[int]], int, int]:
        """(wall time, every sample's tokens, KV blocks in use at the peak, blocks without sharing)."""
        eng.stats.blocks_in_use_peak = eng.stats.blocks_without_sharing_peak = 0
        t0 = time.perf_counter()
        if shared:
            rids = [eng.add_request(prompt, four, images=[image])]
        else:
            rids = [eng.add_request(prompt, greedy, images=[image]) for _ in range(4)]
        outs = llm._drain(rids)
        dt = time.perf_counter() - t0
        toks = [c.token_ids for o in outs for c in o.outputs]
        return dt, toks, eng.stats.blocks_in_use_peak, eng.stats.blocks_without_sharing_peak

    # warm both up (graph building, first allocations)
    vlm_ttft(noise(10**6, args.size))
    ours_ttft(noise(10**6 + 1, args.size))
    vlm_four(noise(10**6 + 2, args.size))
    ours_four(noise(10**6 + 3, args.size), True)
    ours_four(noise(10**6 + 4, args.size), False)

    rows = []
    for r in range(args.repeats):
        row: dict = {}
        a, b = noise(next(seeds), args.size), noise(next(seeds), args.size)
        if r % 2 == 0:
            row["ttft_mlx_vlm"] = vlm_ttft(a)
        row["ttft_first"], row["ttft_again"] = ours_ttft(b), ours_ttft(b)
        if r % 2 == 1:
            row["ttft_mlx_vlm"] = vlm_ttft(a)
        images = [noise(next(seeds), args.size) for _ in range(3)]
        runs = {
            "n4": lambda: ours_four(images[0], True),
            "separate": lambda: ours_four(images[1], False),
            "mlx_vlm": lambda: vlm_four(images[2]),
        }
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        got = {name: runs[name]() for name in order}
        want = [
            list(generate(model, processor, prompt, image=[im], max_tokens=args.max_tokens, temperature=0.0).token_ids)
            for im in images[:2]
        ]
        assert got["n4"][1] == [want[0]] * 4 and got["separate"][1] == [want[1]] * 4, "tokens differ from mlx-vlm's"
        for name in ("n4", "separate"):
            row[f"{name}_s"], _, row[f"{name}_blocks_peak"], row[f"{name}_blocks_unshared"] = got[name]
        row["mlx_vlm_4x_s"] = got["mlx_vlm"][0]
        row["tokens_per_sample"] = len(want[0])
        rows.append(row)
        ms = {k: v * 1e3 for k, v in row.items() if k.endswith("_s") or k.startswith("ttft")}
        print(
            f"repeat {r}: TTFT mlx-vlm {ms['ttft_mlx_vlm']:.1f} ms, mlxpaged first {ms['ttft_first']:.1f} ms, "
            f"same image again {ms['ttft_again']:.1f} ms; 4 samples: n=4 {ms['n4_s']:.1f} ms "
            f"({row['n4_blocks_peak']} blocks, {row['n4_blocks_unshared']} unshared), 4 requests "
            f"{ms['separate_s']:.1f} ms ({row['separate_blocks_peak']} blocks), mlx-vlm 4x {ms['mlx_vlm_4x_s']:.1f} ms"
        )

    # memory held per image (deterministic: one more new image)
    from mlxpaged.engine.multimodal import process_images

    image = noise(next(seeds), args.size)
    inputs = process_images(eng.loaded, eng.tokenizer.encode(prompt), [image])
    before = eng.encoder_cache.nbytes
    rid = eng.add_request(prompt, greedy, images=inputs)
    im = eng._requests[rid].seqs[0].images
    features_held = im.nbytes
    llm._drain([rid])
    bs = eng.block_manager.block_size
    token_bytes = sum(eng.kv_cache.group_block_bytes()) // bs
    memory = {
        "image_tokens": im.num_image_tokens,
        "encoder_cache_bytes": eng.encoder_cache.nbytes - before,
        "features_bytes_while_prefilling": features_held,
        "features_bytes_after_prefill": im.nbytes,
        # a request keeps the smaller of these to make its features again after a preemption
        "decoded_image_bytes": inputs.decoded_bytes,
        "pixel_inputs_bytes": inputs.pixel_bytes,
        "kv_bytes_per_token": token_bytes,
        "kv_bytes_image_tokens": token_bytes * im.num_image_tokens,
        "dtype": str(eng.kv_cache.arrays[0].dtype),
    }

    def col(key: str) -> list[float]:
        return [r[key] for r in rows]

    def ratio(a: str, b: str) -> str:
        return fmt([r[a] / r[b] for r in rows], 1, "x")

    first = rows[0]
    print(
        f"median TTFT ({args.size}x{args.size}, {args.repeats} repeats): mlx-vlm {fmt(col('ttft_mlx_vlm'))}, "
        f"mlxpaged first {fmt(col('ttft_first'))}, same image again {fmt(col('ttft_again'))}; "
        f"ratio mlx-vlm / mlxpaged first {ratio('ttft_mlx_vlm', 'ttft_first')}"
    )
    print(
        f"4 greedy samples of {first['tokens_per_sample']} tokens over one image: n=4 {fmt(col('n4_s'))}, "
        f"4 requests {fmt(col('separate_s'))}, mlx-vlm generate 4x {fmt(col('mlx_vlm_4x_s'))}; "
        f"ratio 4 requests / n=4 {ratio('separate_s', 'n4_s')}, mlx-vlm / n=4 {ratio('mlx_vlm_4x_s', 'n4_s')}; "
        f"KV blocks at the peak: n=4 {first['n4_blocks_peak']} ({first['n4_blocks_unshared']} unshared), "
        f"4 requests {first['separate_blocks_peak']} ({first['separate_blocks_unshared']} unshared)"
    )
    kib = {k: v / 1024 for k, v in memory.items() if "bytes" in k}
    print(
        f"per image ({memory['image_tokens']} image tokens, {memory['dtype']}): encoder cache "
        f"{kib['encoder_cache_bytes']:.1f} KiB, features {kib['features_bytes_while_prefilling']:.1f} KiB while "
        f"prefilling, {memory['features_bytes_after_prefill']} B after (then the smaller of the decoded image, "
        f"{kib['decoded_image_bytes']:.1f} KiB, and its pixel inputs, {kib['pixel_inputs_bytes']:.1f} KiB, kept); "
        f"KV of its tokens {kib['kv_bytes_image_tokens']:.1f} KiB ({memory['kv_bytes_per_token']} B per token)"
    )
    if args.json:
        from mlxpaged.bench.report import provenance

        prov = {k: v for k, v in provenance().items() if k not in ("python", "cwd")}  # no local paths
        doc = {
            "kind": "bench_vision",
            "model": args.model or f"tiny {args.model_type} (mlxpaged.testing.tiny_vlm)",
            "provenance": prov,
            "load_average": os.getloadavg(),
            "settings": {
                "size": args.size,
                "max_image_tokens": args.max_image_tokens,
                "max_tokens": args.max_tokens,
                "repeats": args.repeats,
                "block_size": eng.block_manager.block_size,
            },
            "repeats": rows,
            "memory_per_image": memory,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
