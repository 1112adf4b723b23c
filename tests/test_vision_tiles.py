"""Images split into tiles: the tiny checkpoints' processors configured as the real ones split
(`write_tiny_vlm(..., tiles=True)`: SmolVLM's and Idefics3's image splitting, LFM2-VL's tiles and
thumbnail, Gemma 3's pan-and-scan crops), so a 200x150 image becomes several sub-images whose
image tokens sit between row/column markers or text. Each answer is mlx-vlm's own greedy
`generate` on the same checkpoint; Qwen2.5-VL joins with the same image as one large grid of
merged patches (no tiles: its processor sizes the grid to the image).

The engine runs blocks of 4 tokens and prefill chunks of 16, so a tiled image's tens of tokens
cross many chunks and blocks. Then the prefix cache on tiled images, and a server's image limits
and usage on a tiled checkpoint.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # mlx-vlm's processor asks the hub for files it lacks

import mlxpaged  # noqa: E402,F401  (before mlx)

pytest.importorskip("mlx_vlm", reason="[expected] mlx-vlm (the vision extra) is not installed")

from PIL import Image  # noqa: E402
from test_vision import CHUNK, IMAGE, MAX_TOKENS, Case, kept_apart, noise, said  # noqa: E402
from test_vision_routes import chat, url_part  # noqa: E402
from test_vision_server import png64  # noqa: E402

from mlxpaged.engine.multimodal import process_images  # noqa: E402
from mlxpaged.testing.tiny_vlm import TILED, write_tiny_vlm  # noqa: E402
from tests.server_proc import Server  # noqa: E402

W, H = 200, 150  # split by every tiled processor here; 30,000 pixels
PIXELS = W * H  # the server's --max-image-pixels: this image fits, one pixel column more does not


def big(seed: int):
    """A W x H image of 3 x 4 cells of random colours under some noise: each tile sees other
    colours, so a tile's features in another tile's rows change the tokens (noise alone looks the
    same in every tile). The seeds below are ones each family's tokens tell apart (the tests
    assert it)."""
    rng = np.random.default_rng(seed)
    cells = np.kron(rng.random((3, 4, 3)), np.ones((50, 50, 1)))[:H, :W]
    return Image.fromarray(((cells * 0.8 + rng.random((H, W, 3)) * 0.2) * 255).astype(np.uint8))


def sub_images(processed: dict) -> int:
    """How many images the processor made of one image: Idefics3's [1, n, 3, h, w] pixel values,
    Gemma 3's crops [n, 3, h, w], LFM2-VL's tiles of packed patches [n, patches, dim]."""
    shape = processed["pixel_values"].shape
    return shape[1] if len(shape) == 5 else shape[0]


@pytest.fixture(scope="module", params=[*TILED, "qwen2_5_vl"])
def case(request, tmp_path_factory):
    return Case(tmp_path_factory.mktemp("tiles"), request.param, tiles=request.param in TILED)


def test_tiled_images_match_mlx_vlm(case):
    """A tiled image alone, and beside a small image (one sub-image for LFM2-VL and Gemma 3,
    fewer tiles for Idefics3, which splits every image), batched with a text request: mlx-vlm's
    greedy tokens exactly, the tiled image's tokens prefilled across chunk ends."""
    eng = case.llm.engine
    one = case.prompt([IMAGE, said("Describe the image.")])
    jobs = [
        (one, [big(0)]),
        (case.prompt([IMAGE, said("and"), IMAGE, said("Compare.")]), [big(1), noise(2, 40, 20)]),
        (case.prompt([said("Write a Python function that reverses a string.")]), []),
        (one, [big(3)]),
    ]
    inputs = process_images(eng.loaded, eng.tokenizer.encode(one), [big(0)])
    (start, end), processed = inputs.spans[0], inputs.processed[0]
    if case.path.name in TILED:
        assert sub_images(processed) > 1, "the processor did not split the image: nothing tiled is tested"
    assert end - start > 2 * CHUNK, f"{end - start} tokens: the image does not cross several chunks"
    want = [case.reference(p, ims) for p, ims in jobs]
    assert want[0] != want[3], "the tokens do not depend on the tiled image: the test would be blind"
    got, passes = case.run(jobs)
    assert got == want
    assert any(s < at < e for im, at in passes for s, e, _ in im.spans if e - s == end - start)


def test_tiled_images_kept_apart_in_the_prefix_cache(case, monkeypatch):
    """Two different tiled images of one size: no shared block or cached token; the same one
    again: a prefix hit past all its tiles' tokens, the vision tower not run again."""
    kept_apart(case, big(0), big(3), monkeypatch)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from mlx_vlm import load

    path = write_tiny_vlm(tmp_path_factory.mktemp("tiles") / "smolvlm", "smolvlm", tiles=True)
    model, processor = load(str(path))
    limits = ("--max-image-pixels", str(PIXELS), "--max-images", "1")  # one image (of ten sub-images) fits
    s = Server(path, "--num-blocks", "256", "--served-model-name", "tiny-vl", *limits)
    yield s, model, processor
    s.stop()


@pytest.mark.server
@pytest.mark.timeout(120)
def test_server_limits_and_usage_on_tiled_images(server):
    """--max-image-pixels bounds the image as sent (its header's width x height), not the
    processor's tiles (which it resizes: ten 56-pixel squares hold more pixels than the limit),
    and --max-images 1 counts the image, not its sub-images;
    usage and Messages' count_tokens count the image tokens of every tile, as mlx-vlm's prompt
    holds them; the answer, sent beside a text request, is mlx-vlm's."""
    import anthropic
    import openai
    from mlx_vlm import generate

    s, model, processor = server
    question = [IMAGE, said("Describe the image.")]
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )

    def reference(image) -> tuple[str, int]:
        """mlx-vlm's greedy text (special tokens skipped, as the server's) and prompt token count."""
        out = generate(model, processor, prompt, image=[image], max_tokens=MAX_TOKENS, temperature=0.0)
        return processor.tokenizer.decode(list(out.token_ids), skip_special_tokens=True), out.prompt_tokens

    text, prompt_tokens = reference(big(0))
    assert reference(big(3))[0] != text, "the answer does not depend on the image: the test would be blind"
    # the reference prompt holds every tile's image tokens: 9 tiles and the whole image
    ids = processor(text=[prompt], images=[[big(0)]])["input_ids"][0]
    assert list(ids).count(processor.image_token_id) == 10 * processor.image_seq_len

    def part(image) -> dict:
        return url_part(f"data:image/png;base64,{png64(image)}")

    with ThreadPoolExecutor(2) as pool:  # at once: the tiled image and a text request share batches
        image = pool.submit(chat, s, [part(big(0)), said("Describe the image.")])
        pool.submit(chat, s, [said("Write a Python function that reverses a string.")]).result()
        got = image.result()
    assert got.choices[0].message.content == text
    assert got.usage.prompt_tokens == prompt_tokens
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png64(big(0))}}
    counted = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0).messages.count_tokens(
        model="tiny-vl", messages=[{"role": "user", "content": [block, said("Describe the image.")]}]
    )
    assert counted.input_tokens == prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        chat(s, [part(noise(0, W + 1, H)), said("Describe the image.")], max_tokens=1)
    assert e.value.body["param"] == "messages.0.content.0"
    too_many = f"{W + 1}x{H} is more than {PIXELS} pixels (--max-image-pixels)"
    assert e.value.body["message"] == f"messages.0.content.0: {too_many}"
