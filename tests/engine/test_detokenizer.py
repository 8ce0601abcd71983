"""Streamed text against the tokenizer's own decode of the whole output, on a byte-level BPE (the
demo's, as GPT-2 and Qwen) and a Llama-style tokenizer (metaspace, byte fallback, a leading space
stripped), and stop strings."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers

from tandem.demo import train_tokenizer
from tandem.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["The expert said: naïve café", "日本語のテキスト and more", "emoji 🎉🎉 here", "plain words only"]


def llama_style_tokenizer() -> Tokenizer:
    """Characters outside the vocabulary fall back to their UTF-8 bytes, a token each, as in
    Llama's and Mistral's tokenizers; decoding strips the space the normalizer put first."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for ch in "▁abcdefghijklmnopqrstuvwxyzTé.,:":
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "t"), ("▁t", "h"), ("e", "x")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


@pytest.fixture(params=["byte-level", "llama-style"], scope="module")
def tokenizer(request):
    return train_tokenizer() if request.param == "byte-level" else llama_style_tokenizer()


def stream(tok, prompt: list[int], output: list[int], stop=()) -> tuple[list[str], str, bool]:
    detok = IncrementalDetokenizer(tok, prompt, tuple(stop))
    deltas, hit = [], False
    for token in output:
        delta, hit = detok.add([token])
        deltas.append(delta)
        if hit:
            break
    return deltas, "" if hit else detok.flush(), hit


def test_streamed_text_is_the_decode_of_the_whole_output(tokenizer):
    rng = random.Random(0)
    vocab = tokenizer.get_vocab_size()
    for trial in range(100):
        prompt = tokenizer.encode(rng.choice(TEXTS)).ids
        # random tokens: half characters, invalid bytes and all
        output = [rng.randrange(vocab) for _ in range(24)] if trial % 2 else tokenizer.encode(rng.choice(TEXTS)).ids
        deltas, tail, _ = stream(tokenizer, prompt, output)
        whole = tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)):]
        if "\ufffd" not in whole:
            assert "".join(deltas) + tail == whole, (prompt, output)
            assert not any("\ufffd" in d for d in deltas)  # no half character is ever streamed
        elif tokenizer.decoder.__class__.__name__ == "ByteLevel":  # invalid UTF-8 too
            assert "".join(deltas) + tail == whole, (prompt, output)
        # (a byte-fallback decoder turns a whole run of byte tokens with invalid UTF-8 in it into
        # U+FFFD, valid bytes too, so where the stream cuts such a run changes the text: no reference)


def test_a_prompt_that_ends_inside_a_character_leaves_it_to_the_output(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        for cut in range(1, len(ids)):
            prompt, output = ids[:cut], ids[cut:]
            # the prompt's whole characters: byte fallback turns each byte of a half one into U+FFFD
            complete = next(len(tokenizer.decode(prompt[:n])) for n in range(cut, -1, -1)
                            if not tokenizer.decode(prompt[:n]).endswith("\ufffd"))
            deltas, tail, _ = stream(tokenizer, prompt, output)
            assert "".join(deltas) + tail == tokenizer.decode(ids)[complete:], (text, cut)


@pytest.mark.parametrize("stop, text", [
    (["lo", "l"], "hé"),  # two complete with one token: the earlier one ends the text, not the first listed
    (["o w", "é"], "h"),
    (["world"], "héllo "),
    (["xyz"], None),
])
def test_the_text_ends_before_the_earliest_stop_string(stop, text):
    tok = train_tokenizer()
    output = tok.encode("héllo world").ids
    deltas, tail, hit = stream(tok, tok.encode("Say: ").ids, output, stop)
    assert hit is (text is not None)
    assert "".join(deltas) + tail == (text if hit else "héllo world")
    # never streamed past what it returns: a stop string is held back until it is recognised
    assert all(not any(s in "".join(deltas[:i + 1]) for s in stop) for i in range(len(deltas)))
