"""The paged features on image prompts, against mlx-vlm's own model on the same tiny checkpoint:
image features dropped once prefilled (and made again after a preemption), a bounded encoder
cache, beam search (a plain beam search over mlx-vlm's model and caches), n=4 samples sharing
the prompt's blocks, and n-gram and draft-model speculation (mlx-vlm's greedy tokens exactly).

Two families: Qwen2.5-VL (3-D positions: a beam's or a speculated row's position comes from the
prompt's position delta) and Gemma 3 (1-D, sliding-window layers). Small blocks and prefill
chunks, so images straddle both.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # mlx-vlm's processor asks the hub for files it lacks

import mlxpaged  # noqa: E402,F401  (before mlx)

pytest.importorskip("mlx_vlm", reason="[expected] mlx-vlm (the vision extra) is not installed")

import mlx.core as mx  # noqa: E402
from test_vision import noise  # noqa: E402  (random images of a given size)

from mlxpaged import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from mlxpaged.engine.multimodal import EncoderCache  # noqa: E402
from mlxpaged.testing.tiny_model import write_tiny_family  # noqa: E402
from mlxpaged.testing.tiny_vlm import write_tiny_vlm  # noqa: E402

from reference import reference_beam_search  # noqa: E402

BS, CHUNK = 4, 16  # block size, prefill tokens per step: every image spans several of both
MAX_TOKENS = 12


class Case:
    """One family's tiny checkpoint, mlx-vlm's model and processor on it, and its prompts."""

    def __init__(self, root, model_type: str):
        from mlx_vlm import load

        self.path = write_tiny_vlm(root / model_type, model_type)
        self.model, self.processor = load(str(self.path))

    def llm(self, **kw) -> LLM:
        return LLM(str(self.path), block_size=BS, max_num_batched_tokens=CHUNK, **{"num_blocks": 256, **kw})

    def prompt(self, text: str, images: int = 1) -> str:
        content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
        return self.processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )

    def reference(self, prompt: str, images: list, max_tokens: int = MAX_TOKENS) -> list[int]:
        """mlx-vlm's own greedy `generate` (to max_tokens or its end-of-turn token)."""
        from mlx_vlm import generate

        out = generate(self.model, self.processor, prompt, image=images or None, max_tokens=max_tokens, temperature=0.0)
        return list(out.token_ids)

    def reference_logprobs(self, prompt: str, images: list, max_tokens: int) -> tuple[list[int], list[float]]:
        """mlx-vlm's greedy tokens and each one's log-probability (its `stream_generate`)."""
        from mlx_vlm import stream_generate

        toks, lps = [], []
        for r in stream_generate(
            self.model, self.processor, prompt, image=images or None, max_tokens=max_tokens, temperature=0.0
        ):
            if r.token is None:
                continue
            toks.append(int(r.token))
            lps.append(float(np.asarray(r.logprobs).reshape(-1)[r.token]))
        return toks, lps


class VlmLogits:
    """mlx-vlm's model as `reference_beam_search` calls a model: the prompt through its
    `get_input_embeddings` and language model on mlx-vlm's own cache (as its `generate_step`
    prefills), then one token at a time on that cache (copied per beam by the reference)."""

    def __init__(self, case: Case, prompt: str, images: list):
        from mlx_vlm.generate.dispatch import should_add_special_tokens
        from mlx_vlm.utils import prepare_inputs

        self.model = model = case.model
        # as mlx-vlm's generate prepares them
        inputs = prepare_inputs(
            case.processor,
            images=images,
            prompts=prompt,
            image_token_index=getattr(model.config, "image_token_index", None),
            add_special_tokens=should_add_special_tokens(model.config.model_type, case.processor),
        )
        inputs = dict(inputs)
        self.ids = np.asarray(inputs.pop("input_ids")[0]).tolist()  # mlx-vlm's widened prompt
        self.mask = inputs.pop("attention_mask", None)
        self.pixels = inputs.pop("pixel_values")
        self.kwargs = inputs

    def make_cache(self) -> list:
        from mlx_vlm.models import cache

        return cache.make_prompt_cache(self.model.language_model)

    def __call__(self, ids: mx.array, cache) -> mx.array:
        lm = self.model.language_model
        if ids.shape[1] > 1:  # the prompt
            assert ids[0].tolist() == self.ids
            emb = self.model.get_input_embeddings(ids, self.pixels, mask=self.mask, **self.kwargs)
            extra = {k: v for k, v in emb.to_dict().items() if k != "inputs_embeds" and v is not None}
            return lm(ids, inputs_embeds=emb.inputs_embeds, cache=cache, **{**self.kwargs, **extra}).logits
        return lm(ids, cache=cache).logits


@pytest.fixture(scope="module", params=["qwen2_5_vl", "gemma3"])
def case(request, tmp_path_factory):
    return Case(tmp_path_factory.mktemp("vlm"), request.param)


def drain(llm: LLM, rids: list[str], each_step=None) -> list:
    """Step the engine until `rids` finish (`each_step()` after every step); their outputs in order."""
    eng, done = llm.engine, {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        eng.check_invariants()
        if each_step is not None:
            each_step()
    return [done[r] for r in rids]


def tower_calls(llm: LLM, monkeypatch) -> list:
    """A list that grows by one each time the vision tower runs."""
    vlm = llm.engine.loaded.model.model
    tower = type(vlm.vision_tower)
    calls, call = [], tower.__call__
    monkeypatch.setattr(tower, "__call__", lambda self, *a, **k: calls.append(1) or call(self, *a, **k))
    return calls


@pytest.mark.parametrize("size", [(90, 60), (336, 336)])
def test_features_dropped_once_prefilled_and_made_again_after_preemption(case, monkeypatch, size):
    """A request holds its image features exactly while image rows are left to prefill (the
    pass feeding the last one drops them; no request makes them twice unless preempted). A
    request preempted and recomputed makes them again, from the encoder cache (the tower does not
    run) or, with the cache kept empty, from the tower, and still gives mlx-vlm's tokens. (At the
    larger size Gemma 3's request keeps its pixel inputs, smaller than the decoded image, to make
    them again; otherwise the decoded image, processed again.)"""
    from mlxpaged.engine.multimodal import process_images

    jobs = [(case.prompt(f"Describe image {i}."), [noise(40 + i, *size)]) for i in range(3)]
    want = [case.reference(p, ims) for p, ims in jobs]
    probe = case.llm()
    length = len(process_images(probe.engine.loaded, probe.engine.tokenizer.encode(jobs[0][0]), jobs[0][1]).ids)
    # room for one request at full length and another's prompt: the second outgrows it, preempted
    blocks = -(-(length + MAX_TOKENS - 1) // BS) + -(-length // BS)  # the last token's K/V is never written
    for cached in (True, False):
        llm = case.llm(num_blocks=blocks, enable_prefix_caching=False)
        eng = llm.engine
        if not cached:
            eng.encoder_cache = EncoderCache(max_bytes=0)  # holds nothing: a recompute runs the tower
        calls = tower_calls(llm, monkeypatch)
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        rids = [eng.add_request(p, sp, images=ims) for p, ims in jobs]
        reqs = [eng._requests[r] for r in rids]
        images = [r.seqs[0].images for r in reqs]
        assert all(im.held is not None and im.nbytes > 0 for im in images)
        seen = set()

        def check():
            for req, im in zip(reqs, images):
                seq = req.seqs[0]
                if seq.block_table:  # admitted (a preempted one holds no blocks: nothing to say)
                    left = seq.num_computed_tokens <= im.rows[-1]
                    assert (im.held is not None) == left, (seq.num_computed_tokens, im.rows[-1])
                    seen.add(left)

        encoded = len(calls)
        outs = drain(llm, rids, check)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert seen == {True, False}
        assert eng.scheduler.num_preemptions > 0, "the pool was meant to be too small: nothing was preempted"
        assert all(im.held is None for im in images)
        for req, im in zip(reqs, images):
            if req.num_preemptions == 0:
                assert im.num_refills == 0, "a request never preempted made its features twice"
        again = sum(im.num_refills for im in images)
        assert again > 0, "a preempted request was meant to recompute its image rows"
        if cached:
            assert len(calls) == encoded, "the encoder cache held the images: the tower ran again"
        else:
            assert len(calls) > encoded, "the encoder cache held nothing: the features came from nowhere"


def test_the_encoder_cache_stays_within_its_bytes(case):
    """An encoder cache of room for two images, four different images in turn: it never holds
    more than its bytes (least recently used out), and every request gives mlx-vlm's tokens."""
    llm = case.llm()
    eng = llm.engine
    prompt = case.prompt("Describe the image.")
    images = [noise(60 + i) for i in range(4)]
    want = [case.reference(prompt, [im]) for im in images]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    (first,) = drain(llm, [eng.add_request(prompt, sp, images=images[:1])])
    one = eng.encoder_cache.nbytes
    assert one > 0 and len(eng.encoder_cache.entries) == 1
    eng.encoder_cache = cache = EncoderCache(max_bytes=2 * one + one // 2)
    got = [first.outputs[0].token_ids]
    for im in images[1:]:
        (out,) = drain(llm, [eng.add_request(prompt, sp, images=[im])])
        got.append(out.outputs[0].token_ids)
        assert cache.nbytes == sum(size for _, size in cache.entries.values()) <= cache.max_bytes
    assert got == want
    assert len(cache.entries) == 2


def test_beam_search_over_an_image_prompt(case):
    """`LLM.beam_search` over image prompts (vLLM's multimodal dict) gives the beams of a plain beam
    search over mlx-vlm's own model and caches (tokens, cumulative log-probabilities, scores),
    the beams sharing the prompt's blocks; width 1 of that reference is mlx-vlm's greedy output."""
    llm = case.llm()
    eng = llm.engine
    eos = set(eng.eos_token_ids)
    jobs = [(case.prompt("Describe the image."), [noise(70)]), (case.prompt("Compare.", 2), [noise(71), noise(72)])]
    ref = VlmLogits(case, *jobs[0])
    assert [t for t in reference_beam_search(ref, ref.ids, 1, MAX_TOKENS, eos=eos)[0][1] if t not in eos] == (
        case.reference(*jobs[0])
    ), "the reference's width 1 is not mlx-vlm's greedy generate: the reference is wrong"
    width = 3
    outs = llm.beam_search(
        [{"prompt": p, "multi_modal_data": {"image": ims}} for p, ims in jobs],
        BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS),
    )
    for (p, ims), out in zip(jobs, outs):
        ref = VlmLogits(case, p, ims)
        assert out.prompt_token_ids == ref.ids
        want = reference_beam_search(ref, ref.ids, width, MAX_TOKENS, eos=eos)
        assert len(out.outputs) == len(want)
        for c, (score, toks, cum) in zip(out.outputs, want):
            assert c.token_ids == toks
            assert c.cumulative_logprob == pytest.approx(cum, abs=1e-3)
            assert c.score == pytest.approx(score, abs=1e-3)
    st = eng.stats_dict()
    assert st["beam_forks"] > 0 and st["blocks_in_use_peak"] < st["blocks_without_sharing"]


def test_four_samples_share_the_image_prompts_blocks(case):
    """n=4 greedy samples of an image prompt: each gives mlx-vlm's tokens, and once forked the
    four hold the very same blocks for the prompt's full blocks (one block each, four references),
    so the pool holds the prompt once."""
    llm = case.llm()
    eng = llm.engine
    prompt, images = case.prompt("Describe the image."), [noise(80)]
    want = case.reference(prompt, images)
    rid = eng.add_request(prompt, SamplingParams(n=4, temperature=0.0, max_tokens=MAX_TOKENS), images=images)
    req = eng._requests[rid]
    full = req.num_prompt_tokens // BS
    shared = []

    def check():
        live = [s for s in req.seqs if s.block_table]
        if req.prompt_prefilled and len(live) == 4:
            tables = {tuple(s.block_ids[:full]) for s in live}
            assert len(tables) == 1, "the samples hold copies of the prompt's blocks"
            assert all(b.ref_cnt == 4 for b in live[0].block_table[:full])
            shared.append(1)

    (out,) = drain(llm, [rid], check)
    assert [c.token_ids for c in out.outputs] == [want] * 4
    assert shared, "the four samples were never seen forked"


@pytest.fixture(scope="module")
def draft_path(case, tmp_path_factory):
    """A one-layer Llama draft with the checkpoint's tokenizer (its files copied: same vocabulary)."""
    path = write_tiny_family(tmp_path_factory.mktemp("draft") / "llama", "llama", seed=5, layers=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(case.path / name, path / name)
    return path


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_on_image_prompts_gives_mlx_vlms_greedy_tokens(case, method, draft_path):
    """N-gram and draft-model speculation over image prompts (one image, two images, a long
    prompt, beside a text prompt): mlx-vlm's greedy tokens exactly, with proposals made (and for
    n-gram some accepted: rows past the image decode several tokens at once)."""
    long_text = "The KV cache stores the keys and values of every token a sequence has seen. " * 2
    jobs = [
        (case.prompt("Describe the image."), [noise(90)]),
        (case.prompt("Compare.", 2), [noise(91), noise(92)]),
        (case.prompt(long_text), [noise(93)]),
        (case.prompt("Write a Python function that reverses a string.", 0), []),
    ]
    max_tokens = 24  # long enough for the tiny models to repeat themselves (n-gram hits)
    want = [case.reference(p, ims, max_tokens) for p, ims in jobs]
    kw = {"speculative": method, "speculative_max_batch_size": 16}
    if method == "draft":
        kw["draft_model"] = str(draft_path)
    llm = case.llm(**kw)
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
    outs = drain(llm, [eng.add_request(p, sp, images=ims or None) for p, ims in jobs])
    assert [o.outputs[0].token_ids for o in outs] == want
    # each token's log-probability too: a verified row's logits at the wrong position would keep a
    # tiny model's looping argmax but not its value
    for (p, ims), out, toks in zip(jobs, outs, want):
        ref_toks, ref_lps = case.reference_logprobs(p, ims, max_tokens)
        assert ref_toks[: len(toks)] == toks
        got = [lp.logprob for lp in out.outputs[0].logprobs]
        np.testing.assert_allclose(got, ref_lps[: len(got)], atol=2e-3)
    st = eng.stats_dict()
    assert st["spec_proposed_tokens"] > 0
    if method == "ngram":
        assert st["spec_accepted_tokens"] > 0
