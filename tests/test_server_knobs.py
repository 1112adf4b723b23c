"""The sampling knobs over HTTP: the `openai` client's fields (and vLLM's `min_p` and
`repetition_penalty` as extra body fields) reach `SamplingParams`, and bad values get a 400."""

from __future__ import annotations

import httpx
import openai
import pytest

from mlxpaged import LLM, SamplingParams

from server_proc import Server

PROMPT = "The KV cache stores the keys"


@pytest.fixture(scope="module")
def server(tiny_model_path):
    s = Server(tiny_model_path, "--num-blocks", "256")
    yield s
    s.stop()


def test_knobs_reach_the_sampler(server, tiny_loaded, tiny_model_path):
    """Completions and chat with every knob give LLM.generate's text with the same SamplingParams."""
    llm = LLM(tiny_loaded, num_blocks=128)
    knobs = dict(presence_penalty=0.8, frequency_penalty=-0.4, logit_bias={"17": 3.0, "40": -100})
    extra = dict(min_p=0.05, repetition_penalty=1.3)
    sp = SamplingParams(temperature=0.9, seed=11, max_tokens=20, ignore_eos=True, **knobs, **extra)
    want = llm.generate(PROMPT, sp)[0].outputs[0].text
    r = server.client().completions.create(
        model=str(tiny_model_path),
        prompt=PROMPT,
        temperature=0.9,
        seed=11,
        max_tokens=20,
        extra_body=dict(ignore_eos=True, **extra),
        **knobs,
    )
    assert r.choices[0].text == want
    plain = llm.generate(PROMPT, SamplingParams(temperature=0.9, seed=11, max_tokens=20, ignore_eos=True))[0]
    assert plain.outputs[0].text != want  # the knobs changed something
    forced = server.client().chat.completions.create(
        model=str(tiny_model_path),
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        logit_bias={"37": 100},
        extra_body=dict(ignore_eos=True),
    )
    assert forced.choices[0].message.content == tiny_loaded.tokenizer.decode([37] * 6)


@pytest.mark.parametrize(
    "field,value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"99999": 1}),
    ],
)
def test_bad_knobs_get_400(server, tiny_model_path, field, value):
    r = httpx.post(
        server.url + "/v1/completions", json={"model": str(tiny_model_path), "prompt": "hi", field: value}, timeout=30
    )
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "logit_bias" in msg if field == "logit_bias" else field in msg
    assert "\n" not in msg
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=str(tiny_model_path), prompt="hi", extra_body={field: value})
