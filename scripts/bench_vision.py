"""Time to first token of a one-image request: mlxpaged's engine against mlx-vlm's `generate`.

python scripts/bench_vision.py                      # a tiny random Qwen2.5-VL (mlxpaged.testing.tiny_vlm)
python scripts/bench_vision.py --model PATH --size 448 --repeats 3

Per repeat, alternating: mlx-vlm's `stream_generate` to its first token on a new image; mlxpaged's
engine (prefix caching on) to its first token on another new image (the first request), then the
same image again (the second request: the encoder cache and the prefix hit). Each time runs from
the prompt text and the decoded image to the first token (processing, vision tower, prefill).
Prints each repeat and the medians.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a vision checkpoint (default: a tiny random Qwen2.5-VL)")
    ap.add_argument("--size", type=int, default=224, help="image side in pixels")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from mlx_vlm import load, stream_generate

    from mlxpaged import LLM, SamplingParams

    path = args.model
    if path is None:
        from mlxpaged.testing.tiny_vlm import write_tiny_vlm

        path = str(write_tiny_vlm(Path(tempfile.mkdtemp()) / "qwen2_5_vl"))
    model, processor = load(path)
    llm = LLM(path)
    eng = llm.engine
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    sp = SamplingParams(temperature=0.0, max_tokens=1)

    def vlm_ttft(image) -> float:
        t0 = time.perf_counter()
        for _ in stream_generate(model, processor, prompt, image=[image], max_tokens=1, temperature=0.0):
            return time.perf_counter() - t0
        raise RuntimeError("mlx-vlm generated nothing")

    def ours_ttft(image) -> float:
        t0 = time.perf_counter()
        rid = eng.add_request(prompt, sp, images=[image])
        while True:
            for out in eng.step():
                if out.request_id == rid and out.outputs[0].token_ids:
                    dt = time.perf_counter() - t0
                    while eng.has_unfinished_requests():
                        eng.step()
                    return dt

    vlm_ttft(noise(999, args.size))  # warm both up (graph building, first allocations)
    ours_ttft(noise(998, args.size))
    rows = []
    for r in range(args.repeats):
        a, b = noise(2 * r, args.size), noise(2 * r + 1, args.size)
        rows.append((vlm_ttft(a), ours_ttft(b), ours_ttft(b)))
        print(
            f"repeat {r}: mlx-vlm {rows[-1][0] * 1e3:.1f} ms, mlxpaged first {rows[-1][1] * 1e3:.1f} ms, "
            f"same image again {rows[-1][2] * 1e3:.1f} ms"
        )
    med = [statistics.median(c) for c in zip(*rows)]
    print(
        f"median TTFT ({args.size}x{args.size}, {args.repeats} repeats): mlx-vlm {med[0] * 1e3:.1f} ms, "
        f"mlxpaged first {med[1] * 1e3:.1f} ms, same image again {med[2] * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
