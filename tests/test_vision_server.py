"""Images through every server route, with the official `openai` and `anthropic` clients'
request bodies: chat `image_url` parts (data URLs), Messages `image` blocks (base64, and inside a
`tool_result`: Claude Code's screenshot shape), Responses `input_image`; against mlx-vlm's own
greedy `generate` on the same tiny checkpoint. Then the refusals: an undecodable image names its
part, a URL is not fetched, too many images, and a text-only model asked about an image."""

from __future__ import annotations

import base64
import io
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # mlx-vlm's processor (and the server's) ask the hub nothing

import mlxpaged  # noqa: E402,F401  (before mlx)

pytest.importorskip("mlx_vlm", reason="[expected] mlx-vlm (the vision extra) is not installed")

import anthropic  # noqa: E402
import openai  # noqa: E402
from test_vision import IMAGE, MAX_TOKENS, noise, said  # noqa: E402

from mlxpaged.testing.tiny_vlm import write_tiny_vlm  # noqa: E402
from tests.server_proc import Server  # noqa: E402


def png64(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from mlx_vlm import load

    path = write_tiny_vlm(tmp_path_factory.mktemp("vlm") / "qwen2_5_vl", "qwen2_5_vl")
    model, processor = load(str(path))
    s = Server(path, "--num-blocks", "256", "--served-model-name", "tiny-vl", timeout=120)
    yield s, model, processor
    s.stop()


def reference(vlm, content: list, images: list, role: str = "user", before: list = ()) -> tuple[str, int]:
    """mlx-vlm's greedy text and prompt token count for one turn of `content` parts."""
    from mlx_vlm import generate

    _, model, processor = vlm
    messages = [*before, {"role": role, "content": content}]
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = generate(model, processor, prompt, image=images, max_tokens=MAX_TOKENS, temperature=0.0)
    return processor.tokenizer.decode(list(out.token_ids)), out.prompt_tokens


def test_chat_image_url_as_the_openai_client_sends_it(vlm):
    s = vlm[0]
    x, y = noise(40), noise(41)
    client = s.client()
    for image in (x, y):
        got = client.chat.completions.create(
            model="tiny-vl",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png64(image)}"}},
                    ],
                }
            ],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        text, prompt_tokens = reference(vlm, [said("What is this?"), IMAGE], [image])
        assert got.choices[0].message.content == text
        assert got.usage.prompt_tokens == prompt_tokens  # the image's tokens counted


def test_messages_image_blocks_and_a_screenshot_in_a_tool_result(vlm):
    """A base64 `image` block in a user turn, and Claude Code's screenshot: an image inside a
    `tool_result` after the assistant's `tool_use`."""
    s = vlm[0]
    x = noise(42)
    client = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)
    src = {"type": "base64", "media_type": "image/png", "data": png64(x)}
    got = client.messages.create(
        model="tiny-vl",
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},
        messages=[
            {"role": "user", "content": [{"type": "image", "source": src}, {"type": "text", "text": "Describe."}]}
        ],
    )
    text, prompt_tokens = reference(vlm, [IMAGE, said("Describe.")], [x])
    assert got.content[0].text and text.startswith(got.content[0].text)  # (up to EOS, which mlx-vlm keeps)
    assert got.usage.input_tokens == prompt_tokens
    shot = client.messages.create(
        model="tiny-vl",
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},
        messages=[
            {"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "image", "source": src}]}
                ],
            },
        ],
    )
    assert shot.usage.input_tokens > got.usage.input_tokens  # the screenshot's image tokens are in the prompt
    assert shot.stop_reason in ("end_turn", "max_tokens")


def test_responses_input_image(vlm):
    s = vlm[0]
    x = noise(43)
    got = s.client().responses.create(
        model="tiny-vl",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": f"data:image/png;base64,{png64(x)}"},
                    {"type": "input_text", "text": "Describe."},
                ],
            }
        ],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        store=False,
    )
    text, prompt_tokens = reference(vlm, [IMAGE, said("Describe.")], [x])
    assert text.startswith(got.output_text)
    assert got.usage.input_tokens == prompt_tokens


def test_image_refusals_name_the_part(vlm):
    s = vlm[0]
    client = s.client()

    def chat(parts):
        return client.chat.completions.create(
            model="tiny-vl", messages=[{"role": "user", "content": parts}], max_tokens=2
        )

    bad = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"not an image").decode()},
    }
    with pytest.raises(openai.BadRequestError, match=r"messages\.0\.content\.1: not a decodable image"):
        chat([said("x"), bad])
    with pytest.raises(
        openai.BadRequestError, match=r"messages\.0\.content\.0: image URLs are not fetched unless .*--fetch-image-urls"
    ):
        chat([{"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/cat.png"}}])
    many = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png64(noise(1, 28, 28))}"}}] * 17
    with pytest.raises(openai.BadRequestError, match=r"17 images, more than the 16 .* \(--max-images\)"):
        chat(many)
    with pytest.raises(openai.BadRequestError, match="input_audio"):
        chat([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])
    claude = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="document"):
        claude.messages.create(
            model="tiny-vl",
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}],
        )


def test_text_model_refuses_an_image(tiny_model_path):
    s = Server(tiny_model_path, "--num-blocks", "64", "--served-model-name", "tiny-text")
    try:
        part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png64(noise(0))}"}}
        with pytest.raises(openai.BadRequestError, match="model tiny-text takes no images"):
            s.client().chat.completions.create(
                model="tiny-text", messages=[{"role": "user", "content": [part]}], max_tokens=2
            )
    finally:
        s.stop()
