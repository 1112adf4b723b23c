"""Encoder embedding models and cross-encoders through mlx-embeddings (engine/encoder.py), on the
same routes and admission path as the paged engine's pooled requests.

References: mlx-embeddings' own `load` and `generate` on the same texts (its `text_embeds`, its
`last_hidden_state` pooled with numpy where the checkpoint pools by CLS, its cross-encoder's
`pooler_output` on the pair the tokenizer encodes), numpy's sigmoid of the classifier's logits, the
official `openai` client, and a `mlxpaged serve` subprocess serving an encoder beside a decoder.
"""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

import mlxpaged  # noqa: F401  (first: it points MLX at the system OpenBLAS before MLX loads)

TEXTS = [
    "The KV cache stores the keys and values of every token a sequence has seen.",
    "Paged attention borrows an idea from operating systems: virtual memory and paging. " * 2,
    "Blocks of sixteen tokens",
]
TOL = 2e-5
ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]


def write_encoder(path, family: str, pooling: str | None = None, normalize: bool = True, arch=None, seed=0):
    """A tiny random checkpoint of mlx-embeddings' `family`, written with its own ModelArgs and
    Model classes, and a BERT-style tokenizer ([CLS] text [SEP], pairs as [CLS] a [SEP] b [SEP]);
    with `pooling`, sentence-transformers files that pool by it (and Normalize, with `normalize`)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from tokenizers import Tokenizer, processors

    from mlxpaged.testing.tiny_model import write_tokenizer

    path.mkdir(parents=True)
    write_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(["[CLS]", "[SEP]"])
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "model_type": family,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        "vocab_size": tok.get_vocab_size(),
        "pad_token_id": tok.token_to_id("<|endoftext|>"),
    }
    if family == "modernbert":
        cfg |= {"global_attn_every_n_layers": 2, "local_attention": 16, "architectures": arch or ["ModernBertModel"]}
        cfg |= {"bos_token_id": cls_id, "cls_token_id": cls_id, "eos_token_id": sep_id, "sep_token_id": sep_id}
        if arch == ["ModernBertForSequenceClassification"]:
            cfg |= {"classifier_pooling": "cls", "pipeline_config": {"binary_sigmoid": True}}
    arch_mod = importlib.import_module(f"mlx_embeddings.models.{family}")
    mx.random.seed(seed)
    model = arch_mod.Model(arch_mod.ModelArgs.from_dict(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(cfg))
    if pooling is not None:
        modules = ST_MODULES if normalize else ST_MODULES[:2]
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": 64, f"pooling_mode_{pooling}": True})
        )
    return path


CHECKPOINTS = {  # name: (family, sentence-transformers pooling, normalise)
    "bert": ("bert", "mean_tokens", True),  # all-MiniLM's shape
    "bge-m3": ("xlm_roberta", "cls_token", True),  # BGE-M3's: XLM-R, CLS pooling, normalised
    "bert-raw": ("bert", "mean_tokens", False),  # no Normalize module
    "modernbert": ("modernbert", None, True),  # pools inside (classifier_pooling mean); text_embeds normalised
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    out = {
        name: write_encoder(root / name, fam, pool, norm, seed=i)
        for i, (name, (fam, pool, norm)) in enumerate(CHECKPOINTS.items())
    }
    out["rerank"] = write_encoder(root / "rerank", "modernbert", arch=["ModernBertForSequenceClassification"], seed=9)
    return out


def reference(path, texts: list[str], name: str) -> np.ndarray:
    """mlx-embeddings' embeddings of `texts` in one padded batch (its `generate`), pooled as the
    checkpoint says: `text_embeds` (mean, normalised), else its `last_hidden_state`'s first
    position or mean, normalised or not, with numpy."""
    import mlx_embeddings

    model, tok = mlx_embeddings.load(str(path))
    out = mlx_embeddings.generate(model, tok, texts)
    _, pool, norm = CHECKPOINTS[name]
    if pool in (None, "mean_tokens") and norm:
        return np.array(out.text_embeds)
    h = np.array(out.last_hidden_state)
    mask = np.array(tok(texts, padding=True)["attention_mask"], dtype=np.float64)[..., None]
    v = h[:, 0] if pool == "cls_token" else (h * mask).sum(1) / mask.sum(1)
    return v / np.linalg.norm(v, axis=-1, keepdims=True) if norm else v


def engine_of(path):
    from mlxpaged.engine.encoder import EncoderEngine
    from mlxpaged.loading.encoder import load_encoder

    return EncoderEngine(load_encoder(path))


def run(engine, prompts, params) -> list:
    rids = [engine.add_request(p, params, f"r{i}") for i, p in enumerate(prompts)]
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            done[o.request_id] = o
    return [done[r].pooled for r in rids]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_encoder_embeddings_equal_mlx_embeddings(ckpts, name):
    """Each checkpoint's embeddings, in one padded batch, in small batches and alone, equal
    mlx-embeddings' (pooled as its sentence-transformers files say); the reference itself tells
    the pooling apart from its mutants (mean for CLS and back, normalised or not)."""
    from mlxpaged.engine.pooling import PoolingParams

    engine = engine_of(ckpts[name])
    tok = engine.tokenizer
    ids = [tok.encode(t) for t in TEXTS]
    want = reference(ckpts[name], TEXTS, name)
    np.testing.assert_allclose(run(engine, ids, PoolingParams(normalize=engine.loaded.normalize)), want, atol=TOL)
    engine.max_batch_tokens = 2 * max(map(len, ids))  # two inputs a batch at most
    np.testing.assert_allclose(run(engine, ids, PoolingParams()), want, atol=TOL)
    for i, x in enumerate(ids):
        np.testing.assert_allclose(run(engine, [x], PoolingParams())[0], want[i], atol=TOL)
    # dimensions: the first values, normalised again when the model normalises
    got = np.array(run(engine, ids[:1], PoolingParams(dimensions=16)))[0]
    cut = want[0][:16]
    np.testing.assert_allclose(got, cut / np.linalg.norm(cut) if engine.loaded.normalize else cut, atol=TOL)
    if name in ("bert", "bge-m3"):  # the mutants: the other pooling, or no normalisation
        import mlx_embeddings

        model, t = mlx_embeddings.load(str(ckpts[name]))
        out = mlx_embeddings.generate(model, t, TEXTS)
        first = np.array(out.last_hidden_state)[:, 0]
        first = first / np.linalg.norm(first, axis=-1, keepdims=True)
        mean = np.array(out.text_embeds)
        assert np.abs(first - mean).max() > 100 * TOL  # CLS and mean pooling differ
        raw = np.array(out.last_hidden_state)[:, 0]
        assert np.abs(raw - first).max() > 100 * TOL  # normalising changes the values


def test_cross_encoder_scores_equal_its_head(ckpts):
    """A ModernBERT cross-encoder's score of a (query, document) pair is mlx-embeddings' own
    `pooler_output` on the pair the tokenizer encodes: the sigmoid of its classifier's logit."""
    import mlx.core as mx
    import mlx_embeddings

    from mlxpaged.engine.pooling import PoolingParams

    engine = engine_of(ckpts["rerank"])
    model, tok = mlx_embeddings.load(str(ckpts["rerank"]))
    query = "What does the KV cache store?"
    pairs = [tok.encode(query, d) for d in TEXTS]
    got = [v[0] for v in run(engine, pairs, PoolingParams("classify"))]
    want, logits = [], []
    for ids in pairs:
        out = model(mx.array([ids]))
        want.append(float(out.pooler_output[0, 0]))
        h = model.model(mx.array([ids]), attention_mask=mx.ones((1, len(ids))))["last_hidden_state"][:, 0]
        logits.append(float(model.classifier(model.head(h))[0, 0]))
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-np.array(logits))), atol=1e-5)
    assert np.ptp(got) > 1e-4  # the documents score differently


# -- the routes -----------------------------------------------------------------------------------
def _client(path, model_id: str):
    from fastapi.testclient import TestClient

    from mlxpaged.server.app import build_app
    from mlxpaged.server.engine_loop import EngineLoop
    from mlxpaged.server.metrics import Metrics

    loop = EngineLoop(lambda: engine_of(path))
    loop.start()
    return TestClient(build_app(loop, Metrics(loop), model_id=model_id, max_queue=8))


@pytest.fixture(scope="module")
def served(ckpts):
    with _client(ckpts["bge-m3"], "tiny-bge") as c:
        yield c


@pytest.fixture(scope="module")
def served_rerank(ckpts):
    with _client(ckpts["rerank"], "tiny-rerank") as c:
        yield c


def test_openai_client_embeddings_on_an_encoder(served, ckpts):
    import openai

    want = reference(ckpts["bge-m3"], TEXTS, "bge-m3")
    client = openai.OpenAI(base_url=str(served.base_url) + "/v1", api_key="unused", http_client=served)
    r = client.embeddings.create(model="tiny-bge", input=TEXTS)  # base64 on the wire, decoded by the client
    assert [d.index for d in r.data] == [0, 1, 2]
    np.testing.assert_allclose([d.embedding for d in r.data], want, atol=TOL)
    import mlx_embeddings

    _, tok = mlx_embeddings.load(str(ckpts["bge-m3"]))
    assert r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in TEXTS)
    r = client.embeddings.create(model="tiny-bge", input=[tok.encode(TEXTS[1])], encoding_format="float")
    np.testing.assert_allclose(r.data[0].embedding, want[1], atol=TOL)
    r = served.post("/api/embed", json={"model": "tiny-bge", "input": TEXTS[2]})
    np.testing.assert_allclose(r.json()["embeddings"][0], want[2], atol=TOL)
    r = served.post("/api/embeddings", json={"model": "tiny-bge", "prompt": TEXTS[0]})
    np.testing.assert_allclose(r.json()["embedding"], want[0], atol=TOL)
    model = client.models.list().data[0]
    assert (
        model.id == "tiny-bge"
        and model.model_extra["task"] == "embed"
        and model.model_extra["max_model_len"] == 128 - 1
    )
    assert served.post("/api/show", json={"model": "tiny-bge"}).json()["capabilities"] == ["embedding"]
    assert "mlxpaged_requests_waiting 0.0" in served.get("/metrics").text  # the encoder's own figures
    assert served.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    "path, body, field, words",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model", "does not generate"),
        ("/v1/completions", {"model": "tiny-bge", "prompt": "hi"}, "model", "does not generate"),
        ("/api/generate", {"model": "tiny-bge", "prompt": "hi", "stream": False}, None, "does not generate"),
        ("/v1/embeddings", {"input": ""}, "input", "empty"),
        ("/v1/embeddings", {"input": [[1, 2, 10**6]]}, "input", "vocabulary"),
        ("/v1/embeddings", {"input": [list(range(3, 200))]}, "input", "127"),  # more than its positions
        ("/v1/embeddings", {"input": "a", "dimensions": 8}, "dimensions", "Matryoshka"),
        ("/v1/embeddings", {"input": "a", "pooling": "mean"}, "pooling", "pooling"),
        ("/v1/rerank", {"query": "q", "documents": ["d"]}, "model", "not a reranker"),
    ],
)
def test_bad_requests_to_an_encoder_are_400(served, path, body, field, words):
    r = served.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    message = err if isinstance(err, str) else err["message"]
    assert words in message and (field is None or err["param"] == field), err
    if "does not generate" in message:
        assert "tiny-bge" in message and "embedding model" in message


def test_rerank_on_a_cross_encoder(served_rerank, ckpts):
    """/v1/rerank and /v1/score on a cross-encoder: each pair's score is mlx-embeddings' own
    `pooler_output` of that pair, best first; embeddings, an instruction and generation are refused."""
    import mlx.core as mx
    import mlx_embeddings

    model, tok = mlx_embeddings.load(str(ckpts["rerank"]))
    query = "What does the KV cache store?"
    want = [float(model(mx.array([tok.encode(query, d)])).pooler_output[0, 0]) for d in TEXTS]
    r = served_rerank.post("/v1/rerank", json={"query": query, "documents": TEXTS, "top_n": 2})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == list(np.argsort(want)[::-1][:2])
    for x in results:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
    r = served_rerank.post("/v1/score", json={"text_1": query, "text_2": TEXTS})
    assert [x["score"] for x in r.json()["data"]] == pytest.approx(want, abs=1e-5)
    assert r.json()["usage"]["prompt_tokens"] == sum(len(tok.encode(query, d)) for d in TEXTS)
    r = served_rerank.post("/v1/rerank", json={"query": query, "documents": TEXTS, "instruction": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "instruction", r.text
    r = served_rerank.post("/v1/embeddings", json={"input": "a"})
    assert r.status_code == 400 and "cross-encoder" in r.json()["error"]["message"], r.text
    r = served_rerank.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "/v1/rerank" in r.json()["error"]["message"], r.text
    assert served_rerank.get("/v1/models").json()["data"][0]["task"] == "score"


def test_the_builder_tells_an_encoder_checkpoint(ckpts):
    """The checkpoint's config decides the engine, in one place (`build_engine` over `load`): the
    server's call gets an encoder engine whose embeddings are mlx-embeddings'; `generate`'s and
    `LLM`'s call (no encoders) refuses the checkpoint in one line naming its family, as before; and
    LoRA adapters on an encoder are refused by name."""
    from mlxpaged.engine.builder import build_engine
    from mlxpaged.engine.encoder import EncoderEngine
    from mlxpaged.engine.pooling import PoolingParams
    from mlxpaged.errors import MlxPagedError

    engine = build_engine(str(ckpts["bert"]), encoders=True)
    assert isinstance(engine, EncoderEngine)
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    np.testing.assert_allclose(run(engine, ids, PoolingParams()), reference(ckpts["bert"], TEXTS, "bert"), atol=TOL)
    with pytest.raises(MlxPagedError, match="'bert'") as refused:
        build_engine(str(ckpts["bert"]))
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="LoRA adapters apply to generative models"):
        build_engine(str(ckpts["bert"]), encoders=True, adapters={"a": str(ckpts["bert"])})


def test_refused_encoder_checkpoints_say_why(tmp_path):
    """A head mlx-embeddings does not have, and a ModernBERT masked LM: one line naming it."""
    from mlxpaged.errors import MlxPagedError
    from mlxpaged.loading.encoder import load_encoder

    p = write_encoder(tmp_path / "mlm", "modernbert", arch=["ModernBertForMaskedLM"])
    with pytest.raises(MlxPagedError, match="masked-LM"):
        load_encoder(p)
    cfg = json.loads((p / "config.json").read_text()) | {"architectures": ["BertForSequenceClassification"]}
    (p / "config.json").write_text(json.dumps(cfg | {"model_type": "bert"}))
    with pytest.raises(MlxPagedError, match="no BertForSequenceClassification head"):
        load_encoder(p)


def test_serve_an_encoder_beside_a_decoder(ckpts, tmp_path):
    """`mlxpaged serve --model emb=ENCODER --model lm=DECODER`: the start-up line says what the
    encoder is (no KV pool), its embeddings equal mlx-embeddings', generation on it is a 400, and
    the decoder beside it still generates."""
    from mlxpaged.testing.tiny_model import write_tiny_qwen2

    from server_proc import Server

    lm = write_tiny_qwen2(tmp_path / "lm")
    want = reference(ckpts["bert"], TEXTS[:2], "bert")
    s = Server(f"emb={ckpts['bert']}", "--model", f"lm={lm}", "--no-web")
    try:
        import httpx

        r = httpx.post(s.url + "/v1/embeddings", json={"model": "emb", "input": TEXTS[:2]}, timeout=60)
        np.testing.assert_allclose([d["embedding"] for d in r.json()["data"]], want, atol=TOL)
        r = httpx.post(s.url + "/v1/completions", json={"model": "emb", "prompt": "hi"}, timeout=60)
        assert r.status_code == 400 and "'emb' is an embedding model; it does not generate" in r.text, r.text
        r = httpx.post(s.url + "/v1/completions", json={"model": "lm", "prompt": "hi", "max_tokens": 2}, timeout=120)
        assert r.status_code == 200, r.text
        tasks = {m["id"]: m.get("task") for m in httpx.get(s.url + "/v1/models").json()["data"]}
        assert tasks == {"emb": "embed", "lm": "generate"}
        line = s.stderr()
        assert "encoder model run by mlx-embeddings: embeddings (mean pooling)" in line and "Traceback" not in line, (
            line
        )
    finally:
        s.stop()
