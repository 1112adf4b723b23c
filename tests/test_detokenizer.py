"""The engine's detokenizer (engine/stopping.py `MemoBPEDetokenizer`, remembered byte maps for the
step's host time) gives mlx-lm's own streaming text, character for character, after every token."""

import random

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

from mlxpaged.engine.stopping import MemoBPEDetokenizer, detokenizers


def test_memo_detokenizer_streams_mlx_lms_text(tiny_loaded):
    tok = tiny_loaded.tokenizer
    theirs_proto = tok.detokenizer
    assert type(theirs_proto) is BPEStreamingDetokenizer  # the tiny tokenizer is byte-level BPE
    make = detokenizers(tok)
    rng = random.Random(0)
    vocab = len(theirs_proto.tokenmap)
    # Random ids hit byte tokens that leave UTF-8 unfinished, lone spaces, and repeats (memo hits);
    # the text encoded and decoded again covers multi-byte characters.
    streams = [[rng.randrange(vocab) for _ in range(300)] for _ in range(6)]
    streams.append(tok.encode("naïve café — 東京 🙂 ok\n  two  spaces", add_special_tokens=False))
    for ids in streams:
        ours, theirs = make(), tok.detokenizer
        assert type(ours) is MemoBPEDetokenizer
        for t in ids:
            ours.add_token(t)
            theirs.add_token(t)
            assert ours.text == theirs.text
        ours.finalize()
        theirs.finalize()
        assert ours.text == theirs.text
    # samples share one table, and a fresh one starts empty
    a, b = make(), make()
    assert a._memo is b._memo and a.text == "" and a._unflushed_bytes == b""
