"""Chat logprobs' `bytes`: each token's own bytes (OpenAI's definition), so that a client joining
consecutive tokens' bytes rebuilds a character split across them; not the UTF-8 of the token's
decoded text, which is U+FFFD for every piece of a split character."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mlxpaged.server.openai_format import TokenText, chat_logprobs

# Characters that Qwen2.5's byte-level vocabulary splits across tokens, among ones it does not.
TEXT = "KV 缓存 🦙 𝄞 ŉ é 中文 😀"


@pytest.fixture(scope="module")
def qwen_tokenizer():
    """Qwen2.5's real tokenizer, as `mlxpaged serve` loads it (mlx-lm's wrapper of the HF tokenizer)."""
    from mlx_lm.tokenizer_utils import load

    from mlxpaged.loading.gguf import convert_gguf
    from mlxpaged.loading.offline_model import ensure_offline_model

    return load(convert_gguf(ensure_offline_model()))


def entries(ids, top):
    """Engine logprob entries for `ids`, each with `top` (id -> logprob) as its alternatives."""
    return [SimpleNamespace(token_id=i, logprob=-0.5, top_logprobs=[(i, -0.5), *top.items()]) for i in ids]


def test_split_characters_join_to_their_utf8_on_qwens_tokenizer(qwen_tokenizer):
    ids = qwen_tokenizer.encode(TEXT, add_special_tokens=False)
    text_of = TokenText(qwen_tokenizer)
    split = [i for i in ids if text_of(i) == "\ufffd"]
    assert len(set(split)) >= 2, "the text must hold characters split across tokens"
    top = {split[0]: -3.0, split[-1]: -4.0}
    content = chat_logprobs(entries(ids, top), text_of)["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == TEXT.encode("utf-8")
    # A piece of a character is not U+FFFD's bytes, and two different pieces differ.
    pieces = {e["token"] for e in content}, {bytes(e["bytes"]) for e in content if e["token"] == "\ufffd"}
    assert "\ufffd" in pieces[0] and b"\xef\xbf\xbd" not in pieces[1] and len(pieces[1]) >= 2
    # The alternatives carry the same bytes as the same token chosen.
    own = {i: e["bytes"] for i, e in zip(ids, content)}
    for e in content:
        assert [alt["bytes"] for alt in e["top_logprobs"]] == [e["bytes"], own[split[0]], own[split[-1]]]
    # Whole tokens: the bytes are the UTF-8 of their text, as before.
    assert all(bytes(e["bytes"]).decode("utf-8") == e["token"] for e in content if "\ufffd" not in e["token"])


class SentencePieceVocab:
    """A SentencePiece vocabulary with byte fallback, as a Llama-2 or Mistral tokenizer.json gives it."""

    pieces = ["<unk>", "<0xE4>", "<0xBD>", "<0xA0>", "\u2581hi", "é", "<s>"]
    added_tokens_decoder = {6: "<s>"}

    def __len__(self):
        return len(self.pieces)

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids] if isinstance(ids, list) else self.pieces[ids]

    @property
    def detokenizer(self):
        from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer

        return SPMStreamingDetokenizer(self)

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


def test_sentencepiece_byte_tokens_and_word_marks():
    text_of = TokenText(SentencePieceVocab())
    assert b"".join(bytes(text_of.bytes_of(i)) for i in (1, 2, 3)) == "你".encode()
    assert bytes(text_of.bytes_of(4)) == b" hi" and bytes(text_of.bytes_of(5)) == "é".encode()
    assert bytes(text_of.bytes_of(6)) == b"<s>"


@pytest.fixture(scope="module")
def app(tiny_loaded):
    """The app in process on the tiny model, whose byte-level vocabulary has a token for every byte."""
    from fastapi.testclient import TestClient

    from mlxpaged.config import EngineConfig
    from mlxpaged.engine.llm_engine import LLMEngine
    from mlxpaged.server.app import build_app
    from mlxpaged.server.engine_loop import EngineLoop
    from mlxpaged.server.metrics import Metrics

    loop = EngineLoop(lambda: LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=64)))
    loop.start()
    try:
        with TestClient(build_app(loop, Metrics(), model_id="tiny")) as c:
            yield c
    finally:
        loop.stop()


def test_chat_route_gives_a_split_characters_bytes(app, tiny_loaded):
    """Each of the three bytes of 你 as a one-token answer (a +100 logit bias): the route reports
    that byte, and the three answers' bytes join to the character."""
    tok = tiny_loaded.tokenizer
    vocab = tok.get_vocab()
    ids = [i for i in (vocab.get(piece) for piece in _byte_level_pieces("你")) if i is not None]
    assert len(ids) == 3, "the tiny vocabulary has a token for each byte"
    got = []
    for i in ids:
        r = app.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "temperature": 0,
                "logit_bias": {str(i): 100},
                "logprobs": True,
            },
        )
        assert r.status_code == 200, r.text
        (entry,) = r.json()["choices"][0]["logprobs"]["content"]
        assert entry["token"] == "\ufffd", entry
        got.append(bytes(entry["bytes"]))
    assert b"".join(got) == "你".encode() and all(len(b) == 1 for b in got)


def _byte_level_pieces(text: str) -> list[str]:
    """The byte-level (GPT-2) spelling of each UTF-8 byte of `text`, by the tokenizers library's own
    pre-tokenizer: how a byte-level vocabulary names its one-byte tokens."""
    from tokenizers.pre_tokenizers import ByteLevel

    ((spelled, _),) = ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    return list(spelled)
