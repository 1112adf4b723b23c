"""Every route streams the engine's deltas through one event stream.

Driven by the official `openai` and `anthropic` clients (streamed and not) against the app in
this process. References: each route's own non-streamed answer without a stop string (where the
stop string is cut), and `LLM.generate` on the same prompt ids (where the think block ends, by
token id, for the reasoning token counts).
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from mlxpaged import LLM, SamplingParams

MAX = 24
MESSAGES = [{"role": "user", "content": "The KV cache stores"}]


def _app(loaded):
    from fastapi.testclient import TestClient

    from mlxpaged.config import EngineConfig
    from mlxpaged.engine.llm_engine import LLMEngine
    from mlxpaged.server.app import build_app
    from mlxpaged.server.engine_loop import EngineLoop
    from mlxpaged.server.metrics import Metrics

    loop = EngineLoop(lambda: LLMEngine(loaded, EngineConfig.of(num_blocks=64)))
    loop.start()
    return TestClient(build_app(loop, Metrics(), model_id="tiny")), loop


@pytest.fixture(scope="module")
def app(tiny_loaded):
    c, loop = _app(tiny_loaded)
    with c:
        yield c
    loop.stop()


def oa(c) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=c, max_retries=0)


def an(c) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://testserver", api_key="none", http_client=c, max_retries=0)


def answer(c, route: str, stop: list[str] | None, stream: bool) -> tuple[list[str], str | None]:
    """(the text pieces the client got, in order, one list entry per delta; the stop string the
    route reports) for one greedy request."""
    greedy = {"temperature": 0}
    if route == "chat":
        kw = dict(model="tiny", messages=MESSAGES, max_tokens=MAX, stop=stop, **greedy)
        if not stream:
            return [oa(c).chat.completions.create(**kw).choices[0].message.content], None
        chunks = oa(c).chat.completions.create(**kw, stream=True)
        return [ch.choices[0].delta.content or "" for ch in chunks if ch.choices], None
    if route == "completions":
        kw = dict(model="tiny", prompt="The KV cache stores", max_tokens=MAX, stop=stop, **greedy)
        if not stream:
            return [oa(c).completions.create(**kw).choices[0].text], None
        return [ch.choices[0].text for ch in oa(c).completions.create(**kw, stream=True)], None
    if route == "messages":
        kw = dict(
            model="tiny", messages=MESSAGES, max_tokens=MAX, extra_body=greedy
        )  # this client sends no temperature
        if stop:
            kw["stop_sequences"] = stop
        if not stream:
            m = an(c).messages.create(**kw)
            return ["".join(b.text for b in m.content if b.type == "text")], m.stop_sequence
        pieces, seq = [], None
        for e in an(c).messages.create(**kw, stream=True):
            if e.type == "content_block_delta" and e.delta.type == "text_delta":
                pieces.append(e.delta.text)
            elif e.type == "message_delta":
                seq = e.delta.stop_sequence
        return pieces, seq
    assert route == "responses"  # the Responses API takes no stop strings: its deltas against its whole answer
    kw = dict(model="tiny", input=MESSAGES, max_output_tokens=MAX, **greedy)
    if not stream:
        return [oa(c).responses.create(**kw).output_text], None
    return [e.delta for e in oa(c).responses.create(**kw, stream=True) if e.type == "response.output_text.delta"], None


@pytest.fixture(scope="module")
def llm(tiny_loaded):
    return LLM(tiny_loaded, num_blocks=64)


def boundaries(llm, tok, route: str) -> tuple[str, list[int]]:
    """The greedy answer by `LLM.generate` on the route's prompt ids, and where in its text each
    generated token ends (the text of its first k tokens, when that is a prefix of the whole)."""
    if route == "completions":
        ids = tok.encode("The KV cache stores", add_special_tokens=False)
    else:  # chat and Messages render the same prompt
        ids = tok.encode(
            tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=MAX))[0].outputs[0]
    ends = [
        len(t)
        for t in (tok.decode(out.token_ids[:k], skip_special_tokens=True) for k in range(1, len(out.token_ids)))
        if out.text.startswith(t)
    ]
    return out.text, ends


def stop_across_tokens(full: str, ends: list[int]) -> tuple[int, str]:
    """A 6-character stop string astride a boundary of two generated tokens in the answer's
    second half, first found there: the tokens before the boundary complete only a prefix of it."""
    for pos in ends:
        cand = full[pos - 3 : pos + 3]
        plain = "\ufffd" not in cand and "<|" not in full[pos - 14 : pos + 14]  # no byte pieces, no special tokens
        if pos > len(full) // 3 and len(cand) == 6 and plain and full.find(cand) == pos - 3:
            return pos - 3, cand
    raise AssertionError(f"no boundary to put a stop string on in {full!r}")


@pytest.mark.parametrize("route", ["chat", "completions", "messages"])
def test_a_stop_string_split_across_deltas_never_reaches_the_client(app, llm, tiny_loaded, route):
    (full,), _ = answer(app, route, None, False)
    ref, ends = boundaries(llm, tiny_loaded.tokenizer, route)
    assert full == ref  # the route's prompt is the reference's
    at, stop = stop_across_tokens(full, ends)
    (whole,), seq = answer(app, route, [stop], False)
    assert whole == full[:at]
    pieces, seq_streamed = answer(app, route, [stop], True)
    assert "".join(pieces) == whole  # the deltas sum to the whole answer, and no piece was taken back
    sent = ""
    for p in pieces:
        sent += p
        assert full.startswith(sent) and stop not in sent
    if route == "messages":
        assert seq == seq_streamed == stop


@pytest.mark.parametrize("route", ["chat", "completions", "messages", "responses"])
def test_streamed_deltas_equal_the_whole_answer(app, route):
    (whole,), _ = answer(app, route, None, False)
    pieces, _ = answer(app, route, None, True)
    assert whole and "".join(pieces) == whole
    assert len([p for p in pieces if p]) > 1  # streamed in pieces, not as one


def test_n_choices_stream_their_own_deltas(app):
    """Two sampled choices with a seed, streamed and whole: each choice's deltas sum to its text."""
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=MAX, n=2, temperature=1.0, seed=3)
    whole = [ch.message.content for ch in oa(app).chat.completions.create(**kw).choices]
    got = ["", ""]
    roles = []
    for ch in oa(app).chat.completions.create(**kw, stream=True):
        for choice in ch.choices:
            got[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.append(choice.index)
    assert got == whole and whole[0] != whole[1] and sorted(roles) == [0, 1]


# -- reasoning tokens ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """The app on a tiny model that thinks (`write_tiny_thinker`), and an `LLM` of the same weights."""
    from mlxpaged.loading.loader import load
    from mlxpaged.testing.tiny_model import write_tiny_thinker

    path = write_tiny_thinker(tmp_path_factory.mktemp("thinker"))
    loaded = load(str(path), "float32")
    c, loop = _app(loaded)
    with c:
        yield c, loaded.tokenizer, LLM(loaded, num_blocks=64)
    loop.stop()


@pytest.mark.parametrize("closed", [True, False], ids=["think-closed", "think-open"])
def test_reasoning_tokens_are_counted(thinker, closed):
    c, tok, llm = thinker
    end_id = tok.encode("</think>", add_special_tokens=False)[0]
    bias = {end_id: 5} if closed else None
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    ref = llm.generate(ids, SamplingParams(temperature=0, max_tokens=MAX, logit_bias=bias))[0].outputs[0]
    # the prompt opened the block: every token before the first `</think>` is reasoning
    want = ref.token_ids.index(end_id) if end_id in ref.token_ids else len(ref.token_ids)
    assert (0 < want < len(ref.token_ids) - 1) if closed else want == len(ref.token_ids) == MAX
    extra = {"logit_bias": {str(end_id): 5}} if closed else {}
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=MAX, temperature=0, extra_body=extra)
    u = oa(c).chat.completions.create(**kw).usage
    assert (u.completion_tokens, u.completion_tokens_details.reasoning_tokens) == (len(ref.token_ids), want)
    chunks = list(oa(c).chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == want
    if not closed:  # Responses has no logit_bias: the unclosed case
        kw = dict(model="tiny", input=MESSAGES, max_output_tokens=MAX, temperature=0)
        assert oa(c).responses.create(**kw).usage.output_tokens_details.reasoning_tokens == want
        done = [e for e in oa(c).responses.create(**kw, stream=True) if e.type == "response.incomplete"]
        assert done[0].response.usage.output_tokens_details.reasoning_tokens == want
