"""`POST /v1/embeddings` (OpenAI's shape), `POST /v1/rerank` (the shape vLLM, Jina and Cohere use)
and `POST /v1/score` (vLLM's), over the one admission path; Ollama's `/api/embed` and
`/api/embeddings` call `embed` too.

All run on the engine as pooled requests (engine/pooling.py): each input is one prefill that
samples nothing, batched with the generation requests of the same steps, reusing and filling the
prefix cache, its blocks freed as soon as its last position is computed.

Embeddings are last-token pooled (the final norm's output at the input's last token) and
L2-normalised, as the decoder embedding models define them (Qwen3-Embedding); `dimensions` keeps the
first values (Matryoshka truncation), then normalises again, where the checkpoint supports it. What
a checkpoint says about itself is read from its sentence-transformers files (`PoolingSpec`). Any
decoder LM can embed; a checkpoint whose sentence-transformers files make it an embedding model
serves no generation routes (admission.py refuses them by name).

Rerank scores follow Qwen3-Reranker's model card: each (query, document) pair is written in its
prompt format and scored `softmax(logit(yes), logit(no))[yes]` at the last position.
"""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import Field

from ..engine.encoder import EncoderEngine
from ..engine.pooling import PoolingParams
from ..loading.encoder import EncoderModel, read_json, sentence_pooling
from .admission import Ask, admit
from .bodies import Body
from .errors import APIError
from .jobs import check_model
from .protocol import Text, _Request
from .turns import drain

FLOAT_BYTES = 20  # one float of an answer, as JSON text ("-0.012345678901234567,"); base64 takes less
RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def st_prompts(path: Path) -> dict:
    """The instruction prefixes a checkpoint's `config_sentence_transformers.json` names."""
    st = read_json(path / "config_sentence_transformers.json") or {}
    return st.get("prompts") if isinstance(st.get("prompts"), dict) else {}


@dataclass(frozen=True)
class PoolingSpec:
    """What a checkpoint says about its embeddings: its sentence-transformers files (`modules.json`,
    the Pooling module's `config.json`, `config_sentence_transformers.json`) and config.json.

    Invariant: `refusal` is None exactly when the engine computes this checkpoint's embeddings as
    it defines them (causal attention, last-token pooling)."""

    dims: int  # the hidden size: an embedding's length
    embedding_only: bool = False  # sentence-transformers files: it embeds, it does not generate
    normalize: bool = True
    matryoshka: bool = False  # `dimensions` may truncate (config.json's is_matryoshka, or Qwen3-Embedding's card)
    refusal: str | None = None
    prompts: dict = field(default_factory=dict)  # the checkpoint's instruction prefixes, by name (documented)
    what: str = "an embedding model (its sentence-transformers files say so)"  # an embedding-only model, in words
    # how /v1/rerank scores: "yes_no" (a decoder's yes/no logits), "head" (a cross-encoder's
    # classification output), None (it does not: an encoder embedding model)
    scores: str | None = "yes_no"

    @classmethod
    def of_encoder(cls, loaded: EncoderModel) -> PoolingSpec:
        """An encoder checkpoint's (loading/encoder.py): it embeds, or (a cross-encoder) it scores pairs."""
        matryoshka = bool(loaded.config.get("is_matryoshka") or loaded.config.get("matryoshka_dimensions"))
        if loaded.task == "score":
            return cls(
                loaded.dims,
                True,
                refusal="it is a cross-encoder: it scores (query, document) pairs; use /v1/rerank",
                what="a cross-encoder reranker",
                scores="head",
            )
        prompts = st_prompts(loaded.path)
        return cls(loaded.dims, True, loaded.normalize, matryoshka, None, prompts, "an embedding model", None)

    @classmethod
    def of(cls, path: Path | None, config: dict, name: str) -> PoolingSpec:
        text = config.get("text_config") or config
        dims = int(text.get("hidden_size") or 0)
        matryoshka = bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
        matryoshka = matryoshka or "qwen3-embedding" in f"{name} {path}".lower()  # every size: MRL (its card)
        refusal = None
        if config.get("is_causal") is False or config.get("use_bidirectional_attention"):
            refusal = "it attends bidirectionally (config.json), and this engine's attention is causal"
        elif config.get("architectures") == ["Qwen2Model"] and config.get("auto_map"):
            refusal = "gte-Qwen2's own modeling code attends bidirectionally, and this engine's attention is causal"
        said = sentence_pooling(path) if path is not None else None
        if said is None:
            return cls(dims, matryoshka=matryoshka, refusal=refusal)
        mode, normalize = said
        if mode is not None and mode != "lasttoken" and refusal is None:
            refusal = f"it pools by '{mode}', and decoder embeddings here are last-token pooled"
        return cls(dims, True, normalize, matryoshka, refusal, st_prompts(path))


# -- bodies ---------------------------------------------------------------------------------------
class EmbeddingRequest(_Request):
    IGNORED = frozenset({"user"})  # OpenAI's end-user id: changes nothing

    model: Text | None = None
    input: Text | list[int] | list[list[int]] | list[Text]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)


class Document(Body):
    text: Text


class RerankRequest(_Request):
    model: Text | None = None
    query: Text
    documents: list[Text] | list[Document]
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    instruction: Text | None = None  # the Instruct line of the reranker's prompt (default: the card's)

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(_Request):
    """vLLM's `/v1/score`: `text_1` against each `text_2` (one text against many, or pairs in order)."""

    model: Text | None = None
    text_1: Text | list[Text]
    text_2: Text | list[Text]
    instruction: Text | None = None

    def pairs(self) -> list[tuple[str, str]]:
        one, two = self.text_1, self.text_2
        if isinstance(two, str):
            two = [two]
        if isinstance(one, str):
            return [(one, t) for t in two]
        if len(one) != len(two):
            raise APIError(
                400, f"text_1 has {len(one)} texts and text_2 {len(two)}: give one text_1 or as many", param="text_1"
            )
        return list(zip(one, two))


# -- the shared path ------------------------------------------------------------------------------
def check_dimensions(state, dimensions: int | None, param: str = "dimensions") -> None:
    spec: PoolingSpec = state.pooling
    if dimensions is None:
        return
    if not spec.matryoshka:
        raise APIError(
            400,
            f"{param}: '{state.model_id}' was not trained for Matryoshka truncation; leave {param} out",
            param=param,
        )
    if dimensions > spec.dims:
        raise APIError(400, f"{param}: {dimensions} is more than the model's {spec.dims} dimensions", param=param)


async def pooled(
    request: Request, state, prefix: str, model, inputs: list, params: PoolingParams, names: dict, special: bool = True
):
    """Admit `inputs` (texts or token ids) as pooled requests; returns each input's (values, prompt
    tokens, cached tokens), in order. A client gone while waiting aborts them."""
    spec: PoolingSpec = state.pooling
    if spec.refusal is not None and params.task == "embed":
        raise APIError(400, f"'{state.model_id}' cannot be embedded here: {spec.refusal}", param="model")
    per = FLOAT_BYTES * (params.dimensions or spec.dims) if params.task == "embed" else 64  # a score: one float
    ask = Ask(prefix, model, lambda _: params, 0, prompts=inputs, names=names, pooled_bytes=per, special_tokens=special)
    job, prompts = await admit(state, ask)

    async def results():
        try:
            while len(job.final) < len(job.rids):
                for rid, item in await job.sink.get():
                    if isinstance(item, BaseException):
                        raise job.fail(rid, item)
                    job.absorb(rid, item)
            yield [
                (job.final[rid].pooled, len(p), job.final[rid].num_cached_tokens) for rid, p in zip(job.rids, prompts)
            ]
        finally:
            job._abort_unfinished()

    return (await drain(request, results()))[0]


async def embed(request: Request, state, model, inputs: list, dimensions: int | None, names: dict):
    """Each input's embedding (a list of floats) and the prompt tokens of all of them."""
    check_dimensions(state, dimensions, names.get("dimensions", "dimensions"))
    params = PoolingParams("embed", dimensions, state.pooling.normalize)
    got = await pooled(request, state, "embd", model, inputs, params, names)
    return [v for v, _, _ in got], sum(n for _, n, _ in got)


def encoded(values: list[float], fmt: str):
    if fmt == "base64":  # OpenAI's: the float32 little-endian bytes
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return values


def register_embeddings(router: APIRouter, state, path: Path | None, config: dict) -> None:
    engine = state.engine_loop.engine
    if isinstance(engine, EncoderEngine):
        state.pooling = PoolingSpec.of_encoder(engine.loaded)
    else:
        state.pooling = PoolingSpec.of(path, config, state.model_id)

    @router.post("/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        inputs = body.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]  # one text, or one list of token ids
        values, tokens = await embed(
            request, state, body.model, list(inputs), body.dimensions, {"prompt": "input", "prompts": "inputs"}
        )
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": encoded(v, body.encoding_format)}
                for i, v in enumerate(values)
            ],
            "model": state.model_id,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    async def scores(request, model, pairs: list[tuple[str, str]], instruction, param: str):
        """Each (query, document) pair's relevance and the prompt tokens of all of them."""
        spec: PoolingSpec = state.pooling
        if spec.scores is None:
            check_model(state, model)
            raise APIError(400, f"'{state.model_id}' is {spec.what}, not a reranker: use /v1/embeddings", param="model")
        if not pairs:
            raise APIError(400, f"{param} is empty", param=param)
        if spec.scores == "head":  # a cross-encoder reads the pair itself, tokenized as a pair
            if instruction is not None:
                raise APIError(
                    400,
                    f"instruction: '{state.model_id}' is a cross-encoder; it takes no instruction",
                    param="instruction",
                )
            params, inputs, special = PoolingParams("classify"), list(pairs), True
        else:
            params = PoolingParams("score", yes_no=yes_no_ids(state))
            inputs, special = [rerank_prompt(q, d, instruction) for q, d in pairs], False
        names = {"prompt": param, "prompts": param}
        got = await pooled(request, state, "rerank", model, inputs, params, names, special)
        return [v[0] for v, _, _ in got], sum(n for _, n, _ in got)

    @router.post("/score")
    async def score(body: ScoreRequest, request: Request):
        values, total = await scores(request, body.model, body.pairs(), body.instruction, "text_2")
        return {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": state.model_id,
            "data": [{"index": i, "object": "score", "score": v} for i, v in enumerate(values)],
            "usage": {"prompt_tokens": total, "total_tokens": total},
        }

    @router.post("/rerank")
    async def rerank(body: RerankRequest, request: Request):
        docs = body.texts()
        values, total = await scores(
            request, body.model, [(body.query, d) for d in docs], body.instruction, "documents"
        )
        order = sorted(range(len(docs)), key=lambda i: -values[i])[: body.top_n]
        results = []
        for i in order:
            r = {"index": i, "relevance_score": values[i]}
            if body.return_documents:
                r["document"] = {"text": docs[i]}
            results.append(r)
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": state.model_id,
            "created": int(time.time()),
            "usage": {"prompt_tokens": total, "total_tokens": total},
            "results": results,
        }


def yes_no_ids(state) -> tuple[int, int]:
    """The reranker's answer tokens ("yes", "no"): its card's `convert_tokens_to_ids`."""
    tok = state.engine_loop.engine.tokenizer
    vocab = tok.get_vocab()
    missing = [t for t in ("yes", "no") if t not in vocab]
    if missing:
        raise APIError(
            400, f"'{state.model_id}' is no yes/no reranker: its vocabulary has no '{missing[0]}' token", param="model"
        )
    return vocab["yes"], vocab["no"]


def rerank_prompt(query: str, doc: str, instruction: str | None) -> str:
    """A pair in Qwen3-Reranker's prompt format, tokenized with no special tokens added (the format
    writes its own). Its card tokenizes the prefix, the pair and the suffix apart; the pieces meet
    at special tokens, where the tokenizer splits the text first, so one call gives the same ids."""
    ins = instruction if instruction is not None else RERANK_INSTRUCTION
    return f"{RERANK_PREFIX}<Instruct>: {ins}\n<Query>: {query}\n<Document>: {doc}{RERANK_SUFFIX}"
