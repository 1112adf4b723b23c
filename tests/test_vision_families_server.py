"""Every vision family through one server: `mlxpaged serve` holding each family's tiny checkpoint
(`--model NAME=PATH`, loaded when a request names it, at most two loaded at once), and per family
an image chat request (the official `openai` client's `image_url` data URL) sent at the same time
as a text-only request to the same model, so the two share the engine's batches. Each answer's
tokens are mlx-vlm's own greedy `generate` on the same checkpoint, prompt and image."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # mlx-vlm's processor (and the server's) ask the hub nothing

import mlxpaged  # noqa: E402,F401  (before mlx)

pytest.importorskip("mlx_vlm", reason="[expected] mlx-vlm (the vision extra) is not installed")

from PIL import Image  # noqa: E402
from test_vision import IMAGE, MAX_TOKENS, noise, said  # noqa: E402
from test_vision_server import png64  # noqa: E402

from mlxpaged.models.vision import FAMILIES  # noqa: E402
from mlxpaged.testing.tiny_vlm import write_tiny_vlm  # noqa: E402
from tests.server_proc import Server  # noqa: E402

QUESTION = "Describe the image."
TEXT = "Write a Python function that reverses a string."


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlms")
    return {family: write_tiny_vlm(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def server(paths):
    first, *rest = paths
    models = [a for f in rest for a in ("--model", f"{f}={paths[f]}")]
    # --model PATH: served by its folder's name, the family's; two models loaded at most, the
    # least recently used idle one unloaded for the next
    s = Server(paths[first], *models, "--num-blocks", "128", "--max-loaded-models", "2", timeout=120)
    yield s
    s.stop()


def references(path, turns: list[tuple]) -> list[list[str]]:
    """mlx-vlm's greedy answer to each (user turn's content, its images), each token's own text
    (as the server's logprobs name them), up to the end-of-turn token (which the server does not list)."""
    from mlx_vlm import generate, load

    model, processor = load(str(path))
    tok = processor.tokenizer
    out = []
    for content, images in turns:
        messages = [{"role": "user", "content": content}]
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = generate(model, processor, prompt, image=images or None, max_tokens=MAX_TOKENS, temperature=0.0).token_ids
        ids = list(ids)
        if ids and ids[-1] == tok.convert_tokens_to_ids("<|im_end|>"):
            ids = ids[:-1]
        out.append([tok.decode([t]) for t in ids])
    return out


def ask(server, family: str, content) -> list[str]:
    got = server.client(timeout=120).chat.completions.create(
        model=family,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
    )
    assert got.model == family
    return [lp.token for lp in got.choices[0].logprobs.content]


@pytest.mark.timeout(300)
def test_every_family_answers_an_image_beside_a_text_request(server, paths):
    picture, blank = noise(60), Image.new("RGB", (90, 60), "white")
    image_part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png64(picture)}"}}
    for family, path in paths.items():
        with ThreadPoolExecutor(2) as pool:  # at once: the image prompt and the text one in one batch
            image = pool.submit(ask, server, family, [image_part, {"type": "text", "text": QUESTION}])
            text = pool.submit(ask, server, family, TEXT)
            got = image.result(), text.result()
        asked = [IMAGE, said(QUESTION)]
        *want, blind = references(path, [(asked, [picture]), (TEXT, []), (asked, [blank])])
        assert got == tuple(want), family
        assert blind != want[0], f"{family}: the answer does not depend on the image: the test would be blind"
