"""Rebuild a Hugging Face tokenizer from a qwen2 GGUF's metadata.

llama.cpp stores a GPT-2 style (byte-level BPE) vocabulary as three arrays:
``tokenizer.ggml.tokens`` (the byte-level strings, e.g. ``"Ġthe"``),
``tokenizer.ggml.token_type`` and ``tokenizer.ggml.merges`` (``"Ġ t"``), plus
the pre-tokenizer's name in ``tokenizer.ggml.pre``.  The pipeline around the BPE
model is Qwen2's, as in its published tokenizer.json: NFC normalization, the
Qwen2 split regex, byte-level mapping without a prefix space, a byte-level
decoder.  Transformers can do this too, but its GGUF path imports torch.
"""

from __future__ import annotations

import os
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from .reader import GGUFError, GGUFFile

__all__ = ["load_gguf_tokenizer", "tokenizer_from_metadata", "tokenizer_config_from_metadata", "eos_token_ids"]

# Qwen2's pre-tokenizer split, verbatim from its tokenizer.json (llama.cpp's
# LLAMA_VOCAB_PRE_TYPE_QWEN2 is the same expression with the case-insensitive group spelled out).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)

# llama.cpp's token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Llama 3's split (its tokenizer.json; llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3): as Qwen2's,
# but digits go in runs of up to three.
LLAMA3_PRETOKENIZE_REGEX = QWEN2_PRETOKENIZE_REGEX.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> the split they stand for.
PRETOKENIZE_REGEX = {"qwen2": QWEN2_PRETOKENIZE_REGEX, "llama-bpe": LLAMA3_PRETOKENIZE_REGEX}

# Chat models stop at either of these; llama.cpp's end-of-generation list has them too.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>")


def _vocab_arrays(md: dict[str, Any], name: str) -> tuple[list[str], list[int], list[str]]:
    model = md.get("tokenizer.ggml.model")
    if model is None:
        raise GGUFError(f"{name}: no tokenizer in the GGUF metadata (tokenizer.ggml.model missing)")
    if model != "gpt2":
        raise GGUFError(f"{name}: unsupported tokenizer model {model!r} (mlxpaged reads byte-level BPE, 'gpt2')")
    pre = md.get("tokenizer.ggml.pre", "qwen2")
    if pre not in PRETOKENIZE_REGEX:
        raise GGUFError(
            f"{name}: unsupported pre-tokenizer {pre!r} (mlxpaged supports {', '.join(map(repr, PRETOKENIZE_REGEX))})"
        )
    tokens = md.get("tokenizer.ggml.tokens")
    merges = md.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise GGUFError(f"{name}: GGUF tokenizer metadata lacks tokens or merges")
    types = md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(f"{name}: corrupt tokenizer metadata ({len(tokens)} tokens, {len(types)} token types)")
    return tokens, types, merges


def tokenizer_from_metadata(md: dict[str, Any], name: str = "<gguf>") -> Tokenizer:
    """A ``tokenizers.Tokenizer`` equivalent to Qwen2's tokenizer.json, from GGUF metadata.

    Padding entries (type UNUSED, llama.cpp's ``[PAD151665]`` fillers up to the
    embedding size) are left out, as they are not in the original vocabulary.
    CONTROL tokens become special added tokens and USER_DEFINED ones non-special
    added tokens (e.g. Qwen's ``<tool_call>``), matching the original file.
    """
    tokens, types, merges = _vocab_arrays(md, name)
    vocab = {tok: i for i, (tok, typ) in enumerate(zip(tokens, types)) if typ != UNUSED}
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise GGUFError(f"{name}: corrupt tokenizer merge {m!r}")
        pairs.append((left, right))
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(PRETOKENIZE_REGEX[md.get("tokenizer.ggml.pre", "qwen2")]), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    added = [
        AddedToken(
            tokens[i], special=(types[i] == CONTROL), normalized=False, lstrip=False, rstrip=False, single_word=False
        )
        for i in range(len(tokens))
        if types[i] in (CONTROL, USER_DEFINED)
    ]
    # The added tokens are in the BPE vocabulary already, so they keep their GGUF ids.
    tok.add_tokens(added)
    for a in added:
        if tok.token_to_id(a.content) != vocab[a.content]:
            raise GGUFError(f"{name}: token {a.content!r} appears twice in the GGUF vocabulary")
    return tok


def eos_token_ids(md: dict[str, Any]) -> list[int]:
    """End-of-generation ids: the declared eos/eot/eom plus Qwen's two end tokens when present."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in md and int(md[key]) not in ids:
            ids.append(int(md[key]))
    tokens = md.get("tokenizer.ggml.tokens") or []
    types = md.get("tokenizer.ggml.token_type") or []
    control = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL}
    for text in _END_TOKENS:
        if text in control and control[text] not in ids:
            ids.append(control[text])
    return ids


def tokenizer_config_from_metadata(md: dict[str, Any], name: str = "<gguf>") -> dict[str, Any]:
    """tokenizer_config.json contents, shaped like Qwen2.5's published one."""
    tokens, types, _ = _vocab_arrays(md, name)

    def token(key: str) -> str | None:
        i = md.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    added = {
        str(i): {
            "content": tokens[i],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": types[i] == CONTROL,
        }
        for i in range(len(tokens))
        if types[i] in (CONTROL, USER_DEFINED)
    }
    arch = md.get("general.architecture", "qwen2")
    config: dict[str, Any] = {
        # AutoTokenizer maps this to the fast (tokenizers-backed) class, which reads tokenizer.json.
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": bool(md.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(md.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": int(md.get(f"{arch}.context_length", 32768)),
    }
    template = md.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def load_gguf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer stored in a GGUF file, as a ``tokenizers.Tokenizer``.

    Reads only the metadata (about half a second for Qwen2.5's vocabulary); no
    tensor is touched.  Raises :class:`GGUFError` for an unreadable file or an
    unsupported tokenizer.
    """
    g = GGUFFile(path, read_tensors=False)
    try:
        return tokenizer_from_metadata(g.metadata, str(path))
    finally:
        g.close()
