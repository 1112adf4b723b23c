"""Vision-language models: mlx-vlm's model, processor and chat template, the language model on
the paged cache, against mlx-vlm's own greedy `generate` on the same tiny checkpoint.

Each checkpoint is written by mlx-vlm's own config and model classes (mlxpaged.testing.tiny_vlm),
its projector drawn large enough that the tokens depend on the image (checked: two images give
two references). The engine runs small blocks and small prefill chunks, so images straddle
blocks and chunks, with image requests batched beside a text request.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # mlx-vlm's processor asks the hub for files it lacks

import mlxpaged  # noqa: E402,F401  (before mlx)

pytest.importorskip("mlx_vlm", reason="[expected] mlx-vlm (the vision extra) is not installed")

from PIL import Image  # noqa: E402

from mlxpaged import LLM, SamplingParams  # noqa: E402
from mlxpaged.testing.tiny_vlm import write_tiny_vlm  # noqa: E402

MAX_TOKENS = 8  # or to the end-of-turn token: mlx-vlm's generate stops there, as the engine does
CHUNK = 16  # prefill tokens per step: every prompt here spans several chunks


IMAGE = {"type": "image"}


def said(text: str) -> dict:
    return {"type": "text", "text": text}


def noise(seed: int, w: int = 90, h: int = 60) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8))


class Case:
    """One model type's checkpoint, mlx-vlm's model and processor on it, and the paged engine."""

    def __init__(self, root, model_type: str, tiles: bool = False):
        from mlx_vlm import load

        self.path = write_tiny_vlm(root / model_type, model_type, tiles=tiles)
        self.model, self.processor = load(str(self.path))
        self.llm = LLM(str(self.path), block_size=4, max_num_batched_tokens=CHUNK, num_blocks=256)

    def prompt(self, content: list) -> str:
        """The chat template's prompt for one user turn of `content` parts (as the server's)."""
        tok = self.processor.tokenizer
        return tok.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )

    def reference(self, prompt: str, images: list) -> list[int]:
        from mlx_vlm import generate

        out = generate(self.model, self.processor, prompt, image=images or None, max_tokens=MAX_TOKENS, temperature=0.0)
        return list(out.token_ids)

    def run(self, jobs: list[tuple[str, list]]) -> tuple[list[list[int]], list]:
        """Every (prompt, images) at once, greedy: the token ids of each, and each pass's image
        prompts with where their tokens in it started."""
        eng = self.llm.engine
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        ids = [eng.add_request(p, sp, images=ims or None) for p, ims in jobs]
        passes = []  # (an image prompt's images, where a pass's tokens of it started)
        forward = eng.runner.forward

        def logged(batch, *args, **kwargs):
            passes.extend((s.images, s.num_computed_tokens) for s, _ in batch if s.images is not None)
            return forward(batch, *args, **kwargs)

        eng.runner.forward = logged
        try:
            return [o.outputs[0].token_ids for o in self.llm._drain(ids)], passes
        finally:
            eng.runner.forward = forward


@pytest.fixture(
    scope="module",
    params=[
        "qwen2_5_vl",
        "qwen3_vl",
        "qwen3_vl_moe",
        "gemma3",
        "smolvlm",
        "idefics3",
        "mistral3",
        "qwen3_5",
        "lfm2_vl",
        "qwen2_vl",
        "pixtral",
        "gemma4",
    ],
)
def case(request, tmp_path_factory):
    return Case(tmp_path_factory.mktemp("vlm"), request.param)


def test_image_prompts_match_mlx_vlm(case):
    """One image, two images, an image after text, and a long prompt whose image straddles a
    prefill chunk's end, batched with a text prompt: mlx-vlm's greedy tokens exactly."""
    text = "Write a Python function that reverses a string."
    long_text = "The KV cache stores the keys and values of every token a sequence has seen. " * 2
    jobs = [
        (case.prompt([IMAGE, said("Describe the image.")]), [noise(0)]),
        (case.prompt([IMAGE, IMAGE, said("Compare.")]), [noise(1), noise(2)]),
        (case.prompt([said("Look at this:"), IMAGE, said("?")]), [noise(3)]),
        (case.prompt([said(long_text), IMAGE, said("ok")]), [noise(4)]),
        (case.prompt([said(text)]), []),
        (case.prompt([IMAGE, said("Describe the image.")]), [noise(5)]),
    ]
    want = [case.reference(p, ims) for p, ims in jobs]
    assert want[0] != want[5], "the tiny checkpoint's tokens do not depend on the image: the test would be blind"
    got, passes = case.run(jobs)
    assert got == want
    # some pass prefilled only part of an image's tokens: the image straddled a chunk's end
    assert any(s < start < e for im, start in passes for s, e, _ in im.spans)


def test_text_model_refuses_images(tmp_path):
    """A text-only model asked about an image: one line naming the model and that it takes no images."""
    from mlxpaged.testing.tiny_model import write_tiny_qwen2

    llm = LLM(str(write_tiny_qwen2(tmp_path / "text")), num_blocks=64)
    with pytest.raises(ValueError, match="model text takes no images"):
        llm.engine.add_request("hi", SamplingParams(max_tokens=1), images=[noise(0)])


def test_images_kept_apart_in_the_prefix_cache(case, monkeypatch):
    """Two different images of one size behind the same text share no block and no cached token
    (the image's hash is in the hash of every block holding its tokens); the same image again is
    a prefix hit past its tokens, and its vision tower does not run again (the encoder cache)."""
    kept_apart(case, noise(10), noise(11), monkeypatch)


def kept_apart(case, x, y, monkeypatch) -> None:
    """`test_images_kept_apart_in_the_prefix_cache`'s checks on images `x` and `y` of one size."""
    eng = case.llm.engine
    prompt = case.prompt([said("Here:"), IMAGE, said("Describe the image.")])
    want_x, want_y = case.reference(prompt, [x]), case.reference(prompt, [y])
    assert want_x != want_y
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    vlm = eng.loaded.model.model
    tower = type(vlm.vision_tower if "vision_tower" in vlm else vlm.vision_model)  # Idefics3's name
    calls = []
    call = tower.__call__
    monkeypatch.setattr(tower, "__call__", lambda self, *a, **k: calls.append(1) or call(self, *a, **k))

    def run(image):
        rid = eng.add_request(prompt, sp, images=[image])
        spans = next(s.images.spans for r in [eng._requests[rid]] for s in r.seqs)
        (out,) = case.llm._drain([rid])
        return out.outputs[0].token_ids, out.num_cached_tokens, spans[0]

    got_x, _, _ = run(x)
    got_y, cached_y, (start, end, _) = run(y)
    assert (got_x, got_y) == (want_x, want_y)
    assert cached_y <= start, f"{cached_y} cached tokens: another image's KV was reused"
    before = len(calls)
    again, cached_again, _ = run(x)
    assert again == want_x
    assert cached_again >= end, "the same image again is a prefix hit past its tokens"
    assert len(calls) == before, "the vision tower ran again on an image it had seen"


def test_samples_and_preemption_keep_image_tokens(case):
    """n=2 greedy samples of an image prompt (forked from its prompt's blocks) and image prompts
    recomputed after preemption (a pool too small for all of them) give mlx-vlm's tokens."""
    from mlxpaged.engine.multimodal import process_images

    jobs = [(case.prompt([IMAGE, said(f"Describe image {i}.")]), [noise(20 + i)]) for i in range(3)]
    # a pool of one request at full length and another's prompt: the second outgrows it, preempted
    loaded = case.llm.engine.loaded
    length = len(process_images(loaded, case.llm.engine.tokenizer.encode(jobs[0][0]), jobs[0][1]).ids)
    blocks = -(-(length + MAX_TOKENS - 1) // 4) + -(-length // 4)  # the last token's K/V is never written
    llm = LLM(
        str(case.path), block_size=4, max_num_batched_tokens=CHUNK, num_blocks=blocks, enable_prefix_caching=False
    )
    eng = llm.engine
    want = [case.reference(p, ims) for p, ims in jobs]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    ids = [eng.add_request(p, sp, images=ims) for p, ims in jobs]
    outs = llm._drain(ids)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert eng.scheduler.num_preemptions > 0, "the pool was meant to be too small: nothing was preempted"
    two = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS)
    (out,) = llm._drain([eng.add_request(*jobs[0][:1], two, images=jobs[0][1])])
    assert [c.token_ids for c in out.outputs] == [want[0], want[0]]


def test_python_api_and_cli_take_images(case, tmp_path):
    """`LLM.generate` with vLLM's multimodal prompt dict, and `mlxpaged generate --image PATH`
    (repeatable, before the prompt's text in its chat turn): mlx-vlm's tokens."""
    import json

    from click.testing import CliRunner

    from mlxpaged.cli.main import main

    x, y = noise(30), noise(31, 56, 84)
    one = case.prompt([IMAGE, said("Describe the image.")])
    two = case.prompt([IMAGE, IMAGE, said("Describe the image.")])
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = case.llm.generate(
        [{"prompt": one, "multi_modal_data": {"image": x}}, {"prompt": two, "multi_modal_data": {"image": [x, y]}}], sp
    )
    assert [o.outputs[0].token_ids for o in outs] == [case.reference(one, [x]), case.reference(two, [x, y])]
    paths = []
    for i, im in enumerate((x, y)):
        paths += ["--image", str(tmp_path / f"{i}.png")]
        im.save(tmp_path / f"{i}.png")
    args = ["generate", "--model", str(case.path), "--prompt", "Describe the image.", "-t", str(MAX_TOKENS)]
    r = CliRunner().invoke(main, [*args, *paths, "--temp", "0", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["outputs"][0]["token_ids"] == case.reference(two, [x, y])
    r = CliRunner().invoke(main, [*args, "--image", str(tmp_path / "missing.png")])
    assert r.exit_code != 0 and "missing.png" in r.output and "Traceback" not in r.output


def test_an_unsupported_vision_family_is_refused_in_one_line(tmp_path):
    """A vision checkpoint whose family's language model does not run here is refused at load,
    naming the type and the families that run (nothing is loaded or half-built); so are LLaVA
    (mlx-vlm's own processor fails on its image prompts, checked here) and a Gemma 4 whose image
    tokens attend both ways, each with its reason."""
    import json
    import re

    from mlxpaged.errors import MlxPagedError
    from mlxpaged.loading.loader import load
    from mlxpaged.models.vision import FAMILIES

    def refused(config: dict, match: str) -> None:
        (tmp_path / "config.json").write_text(json.dumps({**config, "vision_config": {}}))
        with pytest.raises(MlxPagedError, match=match):
            load(str(tmp_path))

    runs = re.escape(f"(it runs {', '.join(FAMILIES)})")
    refused({"model_type": "paligemma"}, rf"^paligemma: a vision model .* {runs}")
    refused({"model_type": "llava"}, r"^llava: mlx-vlm's LLaVA processor .* no LLaVA image prompt")
    bidirectional = {"model_type": "gemma4", "text_config": {"use_bidirectional_attention": "vision"}}
    refused(bidirectional, r"^gemma4: use_bidirectional_attention='vision' .* causal paged attention")


def test_mlx_vlm_runs_no_llava_image_prompt(tmp_path):
    """Why LLaVA is refused: mlx-vlm's own `generate` fails on a LLaVA checkpoint written by its
    own classes (its processor passes `padding` to the image processor). When this starts to pass,
    LLaVA can join FAMILIES and the parametrization above."""
    from mlx_vlm import generate, load

    model, processor = load(str(write_tiny_vlm(tmp_path / "llava", "llava")))
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [IMAGE, said("Describe.")]}], tokenize=False, add_generation_prompt=True
    )
    with pytest.raises(ValueError, match="padding"):
        generate(model, processor, prompt, image=[noise(0)], max_tokens=2, temperature=0.0)
