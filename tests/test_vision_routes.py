"""Images on the rest of the routes and their flags, on one tiny Qwen2.5-VL server run with
`--fetch-image-urls` and small image limits: `http(s)` image URLs fetched from a local HTTP
server (and refused when too large, too slow, redirected off http, or missing), `--max-images`,
`--max-image-bytes` and `--max-image-pixels`, Ollama's `images` through the official `ollama`
client, and the web page's attached image in a headless Chromium. Answers are checked against
mlx-vlm's own greedy `generate` on the same checkpoint and image."""

from __future__ import annotations

import base64
import io
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # mlx-vlm's processor (and the server's) ask the hub nothing

import mlxpaged  # noqa: E402,F401  (before mlx)

pytest.importorskip("mlx_vlm", reason="[expected] mlx-vlm (the vision extra) is not installed")

import anthropic  # noqa: E402
import openai  # noqa: E402
from test_vision import IMAGE, MAX_TOKENS, noise, said  # noqa: E402
from test_vision_server import png64, reference  # noqa: E402

from mlxpaged.testing.slowness import wall  # noqa: E402
from mlxpaged.testing.tiny_vlm import write_tiny_vlm  # noqa: E402
from tests.server_proc import Server  # noqa: E402

FETCH_TIMEOUT = 2.0  # --image-fetch-timeout
MAX_BYTES = 40_000  # --max-image-bytes: a 90x60 noise PNG (~16 KB) fits
MAX_PIXELS = 6_000  # --max-image-pixels: 90x60 = 5,400 fits, 100x100 does not
PICTURE = noise(50)


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


class Images(BaseHTTPRequestHandler):
    """A local web server's image addresses: a picture, a redirect to it, and the bad ones."""

    protocol_version = "HTTP/1.0"  # a body without Content-Length ends when the connection closes

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = png(PICTURE)
        if self.path == "/cat.png":
            self._send(200, body, length=True)
        elif self.path == "/moved":
            self._redirect("/cat.png")
        elif self.path == "/to-file":
            self._redirect("file:///etc/passwd")
        elif self.path == "/to-ftp":  # urllib itself would follow this one
            self._redirect("ftp://127.0.0.1/cat.png")
        elif self.path == "/big-declared":  # its Content-Length says it is too large
            self._send(200, b"\0" * (MAX_BYTES + 1), length=True)
        elif self.path == "/big-unsaid":  # no Content-Length: only reading it finds it too large
            self._send(200, b"\0" * (4 * MAX_BYTES), length=False)
        elif self.path == "/trickle":  # a byte every 0.2 s: each read is quick, the whole is not
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                for b in body[:300]:  # a minute of it
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:  # the fetcher gave up and closed the connection
                pass
        else:
            self._send(404, b"no such image", length=True)

    def _send(self, status: int, body: bytes, length: bool):
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def _redirect(self, where: str):
        self.send_response(302)
        self.send_header("Location", where)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def images_site():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from mlx_vlm import load

    path = write_tiny_vlm(tmp_path_factory.mktemp("vlm") / "qwen2_5_vl", "qwen2_5_vl")
    model, processor = load(str(path))
    s = Server(
        path,
        *("--num-blocks", "256", "--served-model-name", "tiny-vl", "--fetch-image-urls"),
        *("--image-fetch-timeout", str(FETCH_TIMEOUT), "--max-images", "2"),
        *("--max-image-bytes", str(MAX_BYTES), "--max-image-pixels", str(MAX_PIXELS)),
        timeout=120,
    )
    yield s, model, processor
    s.stop()


def chat(s, parts: list, max_tokens: int = MAX_TOKENS):
    return s.client().chat.completions.create(
        model="tiny-vl",
        messages=[{"role": "user", "content": parts}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_a_fetched_image_url_answers_as_mlx_vlm(vlm, images_site):
    """An http URL (and one redirected to it) gives mlx-vlm's tokens for the picture it serves, on
    chat, Messages and Responses."""
    s = vlm[0]
    text, prompt_tokens = reference(vlm, [said("What is this?"), IMAGE], [PICTURE])
    for path in ("/cat.png", "/moved"):
        got = chat(s, [said("What is this?"), url_part(images_site + path)])
        assert got.choices[0].message.content == text, path
        assert got.usage.prompt_tokens == prompt_tokens, path
    # the same fetch behind Messages' url source and Responses' input_image
    text, prompt_tokens = reference(vlm, [IMAGE, said("Describe.")], [PICTURE])
    claude = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)
    block = {"type": "image", "source": {"type": "url", "url": images_site + "/cat.png"}}
    msg = claude.messages.create(
        model="tiny-vl",
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [block, {"type": "text", "text": "Describe."}]}],
    )
    assert msg.content[0].text and text.startswith(msg.content[0].text)  # (up to EOS, which mlx-vlm keeps)
    assert msg.usage.input_tokens == prompt_tokens
    resp = s.client().responses.create(
        model="tiny-vl",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": images_site + "/moved"},
                    {"type": "input_text", "text": "Describe."},
                ],
            }
        ],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        store=False,
    )
    assert text.startswith(resp.output_text) and resp.usage.input_tokens == prompt_tokens


def test_image_url_refusals_name_the_part_within_the_time_cap(vlm, images_site):
    s = vlm[0]
    refusals = {
        "/big-declared": f"is {MAX_BYTES + 1} bytes, more than {MAX_BYTES} \\(--max-image-bytes\\)",
        "/big-unsaid": f"is more than {MAX_BYTES} bytes \\(--max-image-bytes\\)",
        "/to-file": "redirected to a non-http\\(s\\) URL \\(file:\\)",
        "/to-ftp": "redirected to a non-http\\(s\\) URL \\(ftp:\\)",
        "/missing.png": "HTTP 404",
        "/trickle": f"took longer than {FETCH_TIMEOUT:g} s \\(--image-fetch-timeout\\)",
    }
    for path, why in refusals.items():
        t0 = time.monotonic()
        with pytest.raises(openai.BadRequestError, match=rf"^.*messages\.0\.content\.1: .*{why}") as e:
            chat(s, [said("x"), url_part(images_site + path)], max_tokens=2)
        assert e.value.status_code == 400
        assert time.monotonic() - t0 < FETCH_TIMEOUT + wall(3), path  # the cap holds, a trickle included
    assert s.client().models.list().data  # the server still answers


def test_image_limit_flags(vlm):
    """--max-images 2, --max-image-bytes and --max-image-pixels, each refused by name and part."""
    s = vlm[0]
    small = url_part(f"data:image/png;base64,{png64(noise(1, 20, 20))}")
    with pytest.raises(openai.BadRequestError, match=r"3 images, more than the 2 .*\(--max-images\)"):
        chat(s, [small] * 3, max_tokens=2)
    two = chat(s, [small, small], max_tokens=2)  # two are within the limit
    assert two.usage.prompt_tokens > 0
    wide = url_part(f"data:image/png;base64,{png64(noise(2, 100, 100))}")
    with pytest.raises(openai.BadRequestError, match=rf"messages\.0\.content\.1: 100x100 is more than {MAX_PIXELS}"):
        chat(s, [small, wide], max_tokens=2)
    heavy = url_part("data:image/png;base64," + base64.b64encode(png(PICTURE) + b"\0" * MAX_BYTES).decode())
    with pytest.raises(openai.BadRequestError, match=rf"content\.0: the image is larger than {MAX_BYTES} bytes"):
        chat(s, [heavy], max_tokens=2)


def test_ollama_images_on_chat_and_generate(vlm):
    """Ollama's `images` (the official client base64-encodes the bytes it is given): the image
    before the message's text, as mlx-vlm answers it."""
    import ollama

    s, raw = vlm[0], png(PICTURE)
    client = ollama.Client(host=s.url)
    assert "vision" in client.show("tiny-vl").capabilities
    text, prompt_tokens = reference(vlm, [IMAGE, said("Describe.")], [PICTURE])
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    got = client.chat("tiny-vl", messages=[{"role": "user", "content": "Describe.", "images": [raw]}], options=options)
    assert got.message.content and text.startswith(got.message.content)  # (up to EOS, which mlx-vlm keeps)
    assert got.prompt_eval_count == prompt_tokens  # the image's tokens are in the prompt
    gen = client.generate("tiny-vl", prompt="Describe.", images=[raw], options=options)
    assert gen.response == got.message.content and gen.prompt_eval_count == prompt_tokens
    bad = base64.b64encode(b"not an image").decode()
    with pytest.raises(ollama.ResponseError, match=r"images\.0: not a decodable image"):
        client.generate("tiny-vl", prompt="Describe.", images=[bad], options=options)
    with pytest.raises(ollama.ResponseError, match=r"images: a raw prompt takes no images"):
        client.generate("tiny-vl", prompt="Describe.", images=[raw], raw=True, options=options)


def test_web_page_attaches_an_image(vlm, tmp_path):
    """The page's file input: the image shows as a thumbnail in the message, and the answer and
    its prompt tokens are mlx-vlm's for that image after the text."""
    from test_web import _answers, _ask, _browser, _console_errors, _css, _open, _text, _wait

    s = vlm[0]
    path = tmp_path / "picture.png"
    path.write_bytes(png(PICTURE))
    driver = _browser()
    try:
        _open(driver, s)
        _css(driver, "#image")[0].send_keys(str(path))
        _wait(driver, lambda d: _css(d, "#attached img.thumb"), what="the attachment's thumbnail")
        _ask(driver, "What is this?", temperature=0, max_tokens=MAX_TOKENS)
        _wait(driver, lambda d: _answers(d) and _answers(d)[0][1].startswith("finish"), what="the answer")
        answer = _answers(driver)[0][0]
        text, prompt_tokens = reference(vlm, [said("What is this?"), IMAGE], [PICTURE])
        assert answer and text.startswith(answer)
        usage = _wait(driver, lambda d: _text(d, ".turn:last-child .usage"), what="the usage line")
        assert usage.startswith(f"prompt {prompt_tokens} tokens")  # the image's tokens were sent
        width, src = driver.execute_script(
            "const i = document.querySelector('.turn .user img.thumb'); return [i.naturalWidth, i.src];"
        )
        assert width == PICTURE.size[0] and src == "data:image/png;base64," + png64(PICTURE)
        assert not _css(driver, "#attached img")  # sent: the composer is empty again
        assert _console_errors(driver) == []
    finally:
        driver.quit()
