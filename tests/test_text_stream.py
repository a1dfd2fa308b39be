"""TextStream: the streamed deltas add up to the whole answer's decode, for byte-level and
SentencePiece-style (metaspace, byte fallback) tokenizers, and stop strings cut at their first
occurrence."""

from __future__ import annotations

import random

import pytest

from llama_ane.runtime.text_stream import TextStream

TEXTS = ["Hello world, this is a test.", "naïve café — déjà vu 🙂 and 日本語 text", "  leading spaces\n\nnew lines",
         "emoji 👩‍👩‍👧 family", "a" * 50 + " b"]


def _byte_level(tmp_path):
    from transformers import AutoTokenizer

    from llama_ane.testing import make_tiny_tokenizer

    make_tiny_tokenizer(tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)


def _metaspace(tmp_path):
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *bytes_])
    tok.train_from_iterator([t.replace(" ", "▁") for t in TEXTS[:1]] * 20 + ["the quick brown fox"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("make", [_byte_level, _metaspace])
def test_deltas_add_up_to_the_whole_decode(make, tmp_path):
    tok = make(tmp_path)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        stream = TextStream(tok)
        deltas = [stream.push(i) for i in ids]
        assert "".join(deltas) == stream.text == tok.decode(ids, skip_special_tokens=True)
        assert all("\ufffd" not in d for d in deltas)


def test_stop_strings_cut_at_the_earliest_occurrence(tmp_path):
    tok = _byte_level(tmp_path)
    ids = tok.encode("alpha beta. gamma\n\ndelta", add_special_tokens=False)
    stream = TextStream(tok, stops=["gamma", "."])
    shown = ""
    for i in ids:
        shown += stream.push(i)
        if stream.stopped:
            break
    assert stream.stopped and shown == stream.text == "alpha beta"


def test_special_tokens_add_nothing(tmp_path):
    tok = _byte_level(tmp_path)
    ids = tok.encode("one two", add_special_tokens=False)
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    rng = random.Random(0)
    mixed = [t for i in ids for t in ([i, eos] if rng.random() < 0.5 else [i])]
    stream = TextStream(tok)
    assert "".join(stream.push(i) for i in mixed) == "one two"
