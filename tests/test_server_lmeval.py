"""lm-eval's loglikelihood path through `mlxpaged serve`: `echo` with `logprobs` and `max_tokens: 0`
on /v1/completions, checked against mlx-lm's own contiguous model with the official `openai` client,
then lm-eval 0.4.13's `local-completions` model on a local multiple-choice task against
`mlx_lm.evaluate.MLXLM` (mlx-lm's own lm-eval integration) on the same checkpoint: the same
loglikelihood for every (context, choice) pair, within float tolerance."""

import json

import mlx.core as mx
import numpy as np
import openai
import pytest

from tests.server_proc import Server

QUESTIONS = [
    ("The cat sat on the", [" mat", " moon", " sky"], 0),
    ("Water boils at one hundred", [" degrees", " cats", " apples"], 0),
    ("One, two, three,", [" four", " seven", " blue"], 0),
    ("The opposite of hot is", [" cold", " warm"], 0),
    ("Paris is the capital of", [" France", " Spain", " Peru"], 0),
    ("def add(a, b): return a", [" + b", " - b"], 0),
]


@pytest.fixture(scope="module")
def served(tiny_model_path):
    s = Server(tiny_model_path, "--num-blocks", "256", "--served-model-name", "tiny")
    yield s
    s.stop()


def contiguous_logprobs(model, ids: list[int]) -> np.ndarray:
    x = model(mx.array(ids)[None])[0].astype(mx.float32)
    return np.array(x - mx.logsumexp(x, axis=-1, keepdims=True))


def test_echo_gives_every_prompt_tokens_logprob(served, mlx_lm_tiny):
    model, tok = mlx_lm_tiny
    client = served.client()
    text = "The cat sat on the mat, and the dog sat on the log."
    ids = tok.encode(text)
    want = contiguous_logprobs(model, ids)
    for prompt in (text, ids):  # a text prompt and a token-id prompt
        r = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0)
        c = r.choices[0]
        assert c.text == text and c.finish_reason == "length"
        lp = c.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.token_logprobs) == len(ids) and "".join(lp.tokens) == text
        np.testing.assert_allclose(lp.token_logprobs[1:], [want[p - 1, ids[p]] for p in range(1, len(ids))], atol=2e-4)
        np.testing.assert_allclose([max(t.values()) for t in lp.top_logprobs[1:]], want[:-1].max(-1), atol=2e-4)
        assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    # echo with one generated token: the prompt's entries, then the completion's
    r = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=2, max_tokens=1, temperature=0)
    c = r.choices[0]
    nxt = int(np.argmax(want[-1]))
    assert len(c.logprobs.token_logprobs) == len(ids) + 1 and c.text == text + tok.decode([nxt])
    np.testing.assert_allclose(c.logprobs.token_logprobs[-1], want[-1, nxt], atol=2e-4)
    # top 2 per position; a dict keyed by token text (the legacy shape) folds tokens whose text is
    # the same (byte tokens that decode to U+FFFD alone)
    sizes = [len(t) for t in c.logprobs.top_logprobs[1:]]
    assert max(sizes) == 2 and min(sizes) >= 1 and sizes.count(2) > len(sizes) // 2


@pytest.mark.parametrize(
    "body, param",
    [
        ({"echo": True, "stream": True}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
    ],
)
def test_echo_shapes_we_do_not_serve_are_refused_by_name(served, body, param):
    client = served.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", **body)
    assert param in str(e.value)


def write_task(tmp_path) -> str:
    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps({"q": q, "choices": c, "gold": g}) + "\n" for q, c, g in QUESTIONS))
    (tmp_path / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{gold}}'\n"
        "target_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n"
    )
    return str(tmp_path)


def loglikelihoods(model, tasks_dir) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model, tasks=["tiny_mc"], task_manager=TaskManager(include_path=tasks_dir), log_samples=True
    )
    return {
        (s["doc"]["q"], a[1]): float(r[0][0])
        for s in out["samples"]["tiny_mc"]
        for a, r in zip(s["arguments"].values() if isinstance(s["arguments"], dict) else s["arguments"], s["resps"])
    }


@pytest.mark.timeout(240)
def test_lm_eval_loglikelihoods_equal_mlx_lm_evaluate(served, tiny_model_path, tmp_path):
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from mlx_lm.evaluate import MLXLM

    tasks = write_task(tmp_path)
    ours = LocalCompletionsAPI(
        base_url=served.url + "/v1/completions",
        model="tiny",
        tokenizer=str(tiny_model_path),
        tokenizer_backend="huggingface",
        max_length=512,
    )
    theirs = MLXLM(str(tiny_model_path), use_chat_template=False)
    got, want = loglikelihoods(ours, tasks), loglikelihoods(theirs, tasks)
    assert len(want) == sum(len(c) for _, c, _ in QUESTIONS) and set(got) == set(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-3), k
