"""Embeddings and rerank scores on the engine (pooled requests), and their routes.

References: mlx-lm's own Qwen3 model on the same token ids (its text model's output, the final
norm's, at the last token, L2-normalised with numpy; its logits at the last position for the
reranker's yes/no score), the checkpoint's tokenizer through transformers (its own special tokens,
the reranker card's three-piece tokenization), the official `openai` and `ollama` clients.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

import mlxpaged  # noqa: F401  (first: it points MLX at the system OpenBLAS before MLX loads)

TEXTS = [
    "The KV cache stores the keys and values of every token a sequence has seen.",
    "Paged attention borrows an idea from operating systems: virtual memory and paging. " * 3,
    "Blocks of sixteen tokens",
]
TOL = 2e-5


def write_embedder(path, sentence_transformers: bool):
    """A tiny Qwen3 checkpoint with "yes" and "no" in its vocabulary; with `sentence_transformers`, an
    embedding checkpoint as Qwen3-Embedding ships one (last-token pooling, Normalize, Matryoshka, a
    tokenizer that ends every text with <|endoftext|>, and the weights of transformers' bare text
    model: no `model.` prefix, no output layer), and beside it at `path / "ref"` the same weights as
    mlx-lm loads them."""
    import shutil

    import mlx.core as mx
    from tokenizers import Tokenizer, processors

    from mlxpaged.testing.tiny_model import write_tiny_family, write_tokenizer

    path.mkdir(parents=True)
    vocab = write_tokenizer(path)
    # the embedding checkpoint unties its output layer, which its bare-model weights then lack (as
    # Qwen3-Embedding-8B's); the decoder keeps it tied
    extra = {"is_matryoshka": True, "tie_word_embeddings": False} if sentence_transformers else {}
    write_tiny_family(path, "qwen3", vocab_size=vocab + 2, seed=3, **extra)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens(["yes", "no"])
    if sentence_transformers:
        eot = tok.token_to_id("<|endoftext|>")
        tok.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>", pair="$A <|endoftext|> $B <|endoftext|>", special_tokens=[("<|endoftext|>", eot)]
        )
        (path / "modules.json").write_text(
            json.dumps(
                [
                    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
                ]
            )
        )
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(
            json.dumps(
                {"word_embedding_dimension": 256, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}
            )
        )
    tok.save(str(path / "tokenizer.json"))
    if sentence_transformers:
        shutil.copytree(path, path.parent / "ref")
        weights = mx.load(str(path / "model.safetensors"))
        bare = {k.removeprefix("model."): v for k, v in weights.items() if k != "lm_head.weight"}
        mx.save_safetensors(str(path / "model.safetensors"), bare)
    return path


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """(mlxpaged's load, mlx-lm's model, transformers' tokenizer) of the embedding checkpoint."""
    return _three(write_embedder(tmp_path_factory.mktemp("embedder") / "ckpt", True))


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """The same kind of checkpoint without sentence-transformers files: a decoder LM (and reranker)."""
    return _three(write_embedder(tmp_path_factory.mktemp("decoder") / "ckpt", False))


def _three(path):
    import mlx_lm
    from transformers import AutoTokenizer

    from mlxpaged.loading.loader import load

    ref, _ = mlx_lm.load(str(path.parent / "ref" if (path.parent / "ref").is_dir() else path))
    return load(str(path), "float32"), ref, AutoTokenizer.from_pretrained(str(path))


def ref_hidden(ref, ids: list[int]) -> np.ndarray:
    """mlx-lm's text model (embedding, layers, final norm) on `ids`: every position's hidden state."""
    import mlx.core as mx

    return np.array(ref.model(mx.array(ids)[None])[0].astype(mx.float32))


def ref_embedding(ref, ids: list[int], dims: int | None = None) -> np.ndarray:
    v = ref_hidden(ref, ids)[-1][:dims]
    return v / np.linalg.norm(v)


def ref_score(ref, tok, query: str, doc: str) -> float:
    """Qwen3-Reranker's card: prefix, pair and suffix tokenized apart, then the last position's
    log-softmax over (no, yes), at yes."""
    import mlx.core as mx

    from mlxpaged.server.embeddings_api import RERANK_INSTRUCTION, RERANK_PREFIX, RERANK_SUFFIX

    def enc(t):
        return tok.encode(t, add_special_tokens=False)

    pair = f"<Instruct>: {RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {doc}"
    ids = enc(RERANK_PREFIX) + enc(pair) + enc(RERANK_SUFFIX)
    logits = np.array(ref(mx.array(ids)[None])[0, -1].astype(mx.float32))
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    two = np.array([logits[no], logits[yes]], dtype=np.float64)
    return float(np.exp(two[1] - np.logaddexp(two[0], two[1])))


# -- the engine -----------------------------------------------------------------------------------
def test_reference_tells_last_token_normalised_pooling_apart(embedder):
    """The reference itself separates the invariant from its mutants (first-token pooling, no
    normalisation): the engine tests below compare against it within TOL."""
    _, ref, tok = embedder
    ids = tok.encode(TEXTS[0])
    h = ref_hidden(ref, ids)
    last = ref_embedding(ref, ids)
    assert ids[-1] == tok.convert_tokens_to_ids("<|endoftext|>")  # the tokenizer's own end token
    assert np.abs(h[0] / np.linalg.norm(h[0]) - last).max() > 100 * TOL
    assert np.abs(h[-1] - last).max() > 100 * TOL


def test_embeddings_beside_generation_equal_mlx_lm(embedder):
    """Pooled requests (one chunked across steps) ride the same steps as greedy generation: each
    embedding equals mlx-lm's pooled, normalised hidden state, batched or alone; the generated
    tokens equal those of the same requests run without them; a pooled request decodes nothing and
    holds no block once done; a repeated input takes its prefix from the cache and gives the same
    vector; `dimensions` truncates and renormalises; a score is the reference's yes/no softmax."""
    from mlxpaged.config import EngineConfig
    from mlxpaged.engine.llm_engine import LLMEngine
    from mlxpaged.engine.pooling import PoolingParams
    from mlxpaged.engine.sampling_params import SamplingParams

    loaded, ref, tok = embedder
    config = EngineConfig.of(block_size=16, num_blocks=96, max_num_batched_tokens=32)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    gen_prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]

    def run(with_pooled: bool):
        eng = LLMEngine(loaded, config)
        steps = []  # per step: (decodes, pooled chunks that end their prompt)
        schedule = eng.scheduler.schedule

        def recorded():
            out = schedule()
            steps.append((len(out.decodes), sum(1 for c in out.prefills if c.request.pooling is not None)))
            return out

        eng.scheduler.schedule = recorded
        gens = [eng.add_request(p, greedy) for p in gen_prompts]
        for _ in range(3):
            eng.step()
        pooled = []
        if with_pooled:
            pooled = [eng.add_request(t, PoolingParams()) for t in TEXTS]
            pooled.append(eng.add_request(TEXTS[0], PoolingParams(dimensions=32)))
            pooled.append(eng.add_request(tok.encode(TEXTS[1]), PoolingParams("score", yes_no=(7, 11))))
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
            eng.check_invariants()
        assert eng.block_manager.pool.num_used == 0
        return eng, done, gens, pooled, steps

    eng, done, gens, pooled, steps = run(True)
    _, alone, gens_alone, _, _ = run(False)
    for g, a in zip(gens, gens_alone):
        assert done[g].outputs[0].token_ids == alone[a].outputs[0].token_ids
    assert any(d and p for d, p in steps), "no step held both decodes and pooled prompts"
    for rid, text in zip(pooled, TEXTS):
        out = done[rid]
        assert out.outputs == [] and out.pooled is not None
        np.testing.assert_allclose(out.pooled, ref_embedding(ref, tok.encode(text)), atol=TOL)
    np.testing.assert_allclose(done[pooled[3]].pooled, ref_embedding(ref, tok.encode(TEXTS[0]), 32), atol=TOL)
    # the bare checkpoint has no output layer: its embedding stands in (the logits of the tied matrix)
    import mlx.core as mx

    logits = ref.model.embed_tokens.as_linear(ref.model(mx.array(tok.encode(TEXTS[1]))[None]))[0, -1]
    yes, no = float(logits[7]), float(logits[11])
    assert done[pooled[4]].pooled == pytest.approx([1 / (1 + np.exp(no - yes))], abs=1e-5)

    # alone, and again: the repeat's full blocks come from the prefix cache, its vector unchanged
    for text in (TEXTS[1], TEXTS[1]):
        rid = eng.add_request(text, PoolingParams())
        while eng.has_unfinished_requests():
            for o in eng.step():
                last = o
        assert last.request_id == rid and last.finished
        np.testing.assert_allclose(last.pooled, ref_embedding(ref, tok.encode(text)), atol=TOL)
    assert last.num_cached_tokens >= 16


def test_llm_embed(embedder):
    from mlxpaged.engine.llm import LLM
    from mlxpaged.engine.pooling import PoolingParams

    loaded, ref, tok = embedder
    outs = LLM(loaded, num_blocks=32).embed(TEXTS, PoolingParams(dimensions=16))
    for out, text in zip(outs, TEXTS):
        np.testing.assert_allclose(out.pooled, ref_embedding(ref, tok.encode(text), 16), atol=TOL)


# -- the routes -----------------------------------------------------------------------------------
def _client(loaded, model_id: str, **kw):
    from fastapi.testclient import TestClient

    from mlxpaged.config import EngineConfig
    from mlxpaged.engine.llm_engine import LLMEngine
    from mlxpaged.server.app import build_app
    from mlxpaged.server.engine_loop import EngineLoop
    from mlxpaged.server.metrics import Metrics

    loop = EngineLoop(lambda: LLMEngine(loaded, EngineConfig.of(num_blocks=64, max_num_batched_tokens=48)))
    loop.start()
    return TestClient(build_app(loop, Metrics(), model_id=model_id, **kw))


@pytest.fixture(scope="module")
def served(embedder):
    with _client(embedder[0], "tiny-embed", max_queue=4) as c:
        yield c


@pytest.fixture(scope="module")
def served_decoder(decoder):
    with _client(decoder[0], "tiny-lm") as c:
        yield c


def test_openai_client_embeddings(served, embedder):
    import openai

    _, ref, tok = embedder
    client = openai.OpenAI(base_url=str(served.base_url) + "/v1", api_key="unused", http_client=served)
    r = client.embeddings.create(model="tiny-embed", input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, text in zip(r.data, TEXTS):
        np.testing.assert_allclose(d.embedding, ref_embedding(ref, tok.encode(text)), atol=TOL)
    assert r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in TEXTS)
    ids = [tok.encode(TEXTS[2]), tok.encode(TEXTS[0])]
    r = client.embeddings.create(model="tiny-embed", input=ids, encoding_format="float", dimensions=48)
    for d, x in zip(r.data, ids):
        np.testing.assert_allclose(d.embedding, ref_embedding(ref, x, 48), atol=TOL)
    raw = served.post("/v1/embeddings", json={"input": TEXTS[2], "encoding_format": "base64"}).json()
    got = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(got, ref_embedding(ref, tok.encode(TEXTS[2])), atol=TOL)


def test_ollama_client_embed(served, embedder):
    import ollama

    _, ref, tok = embedder
    client = ollama.Client(host=str(served.base_url), transport=_Whole(served))
    r = client.embed(model="tiny-embed", input=TEXTS[:2], dimensions=64)
    for v, text in zip(r.embeddings, TEXTS):
        np.testing.assert_allclose(v, ref_embedding(ref, tok.encode(text), 64), atol=TOL)
    assert r.prompt_eval_count == sum(len(tok.encode(t)) for t in TEXTS[:2])
    r = client.embeddings(model="tiny-embed", prompt=TEXTS[2])
    np.testing.assert_allclose(r.embedding, ref_embedding(ref, tok.encode(TEXTS[2])), atol=TOL)
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="tiny-embed", input="x", truncate=True)
    assert e.value.status_code == 400 and "truncate" in e.value.error
    assert client.show("tiny-embed").capabilities == ["embedding"]
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="tiny-embed", prompt="hi", stream=False)
    assert e.value.status_code == 400 and "embedding model" in e.value.error


class _Whole:
    """An `httpx` transport answering through the in-process app's test client (which speaks
    `httpx2`), each response read whole: the `ollama` client builds its own `httpx` client."""

    def __init__(self, client):
        self.client = client

    def handle_request(self, request):
        import httpx

        r = self.client.request(request.method, str(request.url), headers=dict(request.headers), content=request.read())
        return httpx.Response(r.status_code, headers=dict(r.headers), content=r.content)

    def close(self):
        pass


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": ["a", "b", "c", "d", "e"]}, "input"),  # more than --max-queue 4
        ({"input": [[1, 2, 10**6]]}, "input"),
        ({"input": "a", "encoding_format": "binary"}, "encoding_format"),
        ({"input": "a", "dimensions": 257}, "dimensions"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "pooling": "mean"}, "pooling"),
    ],
)
def test_bad_embedding_requests_name_the_field(served, body, field):
    r = served.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


def test_an_embedding_model_generates_nothing(served):
    r = served.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "embedding model" in r.json()["error"]["message"]


def test_a_decoder_lm_embeds_and_reranks(served_decoder, decoder):
    """A checkpoint without sentence-transformers files embeds (last token, normalised) but refuses
    `dimensions` by name; /v1/rerank scores each pair as the reranker card does, best first."""
    _, ref, tok = decoder
    r = served_decoder.post("/v1/embeddings", json={"input": [TEXTS[0]]})
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], ref_embedding(ref, tok.encode(TEXTS[0])), atol=TOL)
    r = served_decoder.post("/v1/embeddings", json={"input": "a", "dimensions": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions" and "tiny-lm" in r.text
    query = "What does the KV cache store?"
    r = served_decoder.post("/v1/rerank", json={"query": query, "documents": TEXTS, "top_n": 2})
    assert r.status_code == 200, r.text
    want = [ref_score(ref, tok, query, d) for d in TEXTS]
    results = r.json()["results"]
    assert [x["index"] for x in results] == list(np.argsort(want)[::-1][:2])
    for x in results:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
        assert x["document"] == {"text": TEXTS[x["index"]]}
    r = served_decoder.post("/v1/rerank", json={"query": query, "documents": [], "top_n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    r = served_decoder.post("/v1/score", json={"text_1": query, "text_2": TEXTS[1:]})
    assert [x["score"] for x in r.json()["data"]] == pytest.approx(want[1:], abs=1e-5)
    r = served_decoder.post("/v1/score", json={"text_1": [query], "text_2": TEXTS[1:]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_1"


def test_pooled_requests_cross_to_tensor_parallel_ranks_whole():
    """Rank 0 sends each request's params as JSON; a pooled request's come back equal."""
    from mlxpaged.engine.pooling import PoolingParams
    from mlxpaged.server.engine_loop import EngineRequest

    for params in (PoolingParams(dimensions=8, normalize=False), PoolingParams("score", yes_no=(3, 4))):
        req = EngineRequest([1, 2, 3], params, "r")
        assert EngineRequest.from_wire(json.loads(json.dumps(req.to_wire()))) == req
