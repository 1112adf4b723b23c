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
    # Few distinct ids, each seen many times: the remembered whole-token texts (`_flushes`) serve
    # most of them, after unfinished UTF-8, after a lone space and as the first token.
    words = tok.encode(" the café 東京 🙂 x\n y", add_special_tokens=False)
    few = words + [rng.randrange(vocab) for _ in range(20)]
    streams += [[rng.choice(few) for _ in range(400)] for _ in range(3)]
    streams.append(words)  # a first token with a leading space, remembered by now: trimmed as mlx-lm's
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
    assert a._memo is b._memo and a._flushes is b._flushes and a.text == "" and a._unflushed_bytes == b""
    assert len(a._flushes) > 10  # the repeated streams were served by the remembered texts
