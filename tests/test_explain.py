"""Explaining a sentence (Captioner.explain, explain.explain_features) and per-word log-probabilities.

Invariants: explaining a caption's own text reproduces what decoding computed for it (maps, gates,
each word's log-probability, the total); a sentence's total is its words' log-probs plus <end>'s;
out-of-vocabulary words are reported, not fatal, and kept as typed (any script); a sentence
with no words is an error, never a score.
"""
from __future__ import annotations

import numpy as np
import pytest

import captioner
from .conftest import photo, tiny_captioner

ATOL = 1e-5


def end_log_prob(cap: captioner.Caption) -> float:
    """log p(<end>) implied by a caption: its total minus its words'."""
    return cap.log_prob - float(np.sum(cap.word_log_probs, dtype=np.float64))


def assert_same(explained: captioner.Caption, decoded: captioner.Caption) -> None:
    assert explained.words == decoded.words
    assert explained.alphas.shape == decoded.alphas.shape
    np.testing.assert_allclose(explained.alphas, decoded.alphas, atol=ATOL)
    np.testing.assert_allclose(explained.betas, decoded.betas, atol=ATOL)
    np.testing.assert_allclose(explained.word_log_probs, decoded.word_log_probs, atol=1e-4)
    assert explained.log_prob == pytest.approx(decoded.log_prob, abs=1e-4)


def check_totals(cap: captioner.Caption) -> None:
    assert cap.word_log_probs.shape == (len(cap.words),)
    assert np.all(cap.word_log_probs <= 0) and np.all(np.isfinite(cap.word_log_probs))
    assert -50 < end_log_prob(cap) <= 1e-6  # a real probability for <end>, not a bookkeeping leftover


def flickr_photos(root, n: int) -> list:
    return sorted((root / "Images").glob("*.jpg"))[:n]


def test_tiny_model_explain_equals_greedy(one_torch_thread):
    model = tiny_captioner()
    img = photo()
    dec = model.caption(img, beam_size=1, block_trigrams=False, max_len=8)
    check_totals(dec)
    exp = model.explain(img, dec.text)
    assert exp.unknown == [] and exp.notes == []
    # a capped caption (no <end> emitted) has no <end> term; compare the words then
    if len(dec.words) < 8:
        assert_same(exp, dec)
    else:
        np.testing.assert_allclose(exp.word_log_probs, dec.word_log_probs, atol=1e-4)


def test_explain_reproduces_greedy_on_real_photos(bundled, flickr, one_torch_thread):
    for path in flickr_photos(flickr, 4):
        dec = bundled.caption(path, beam_size=1, block_trigrams=False)
        check_totals(dec)
        exp = bundled.explain(path, dec.text)
        assert_same(exp, dec)
        check_totals(exp)
        sums = exp.alphas.reshape(len(exp.words), -1).sum(-1)
        np.testing.assert_allclose(sums, 1.0, atol=1e-5)


def test_beam_search_word_log_probs_are_the_words_own(bundled, flickr, one_torch_thread):
    """Beam search records each word's log-prob along the surviving beam: teacher forcing its
    caption must give the same numbers (a beam bookkeeping slip would mix up rows)."""
    paths = flickr_photos(flickr, 3)
    caps = bundled.caption_batch(paths, beam_size=3, block_trigrams=False)
    for path, cap in zip(paths, caps):
        check_totals(cap)
        exp = bundled.explain(path, cap.text)
        np.testing.assert_allclose(cap.word_log_probs, exp.word_log_probs, atol=1e-4)
        assert cap.log_prob == pytest.approx(exp.log_prob, abs=1e-4)


def test_out_of_vocabulary_word_is_reported(bundled, flickr, one_torch_thread):
    word = "zebraquux"
    assert word not in bundled.vocab.stoi
    path = flickr_photos(flickr, 1)[0]
    cap = bundled.explain(path, f"A {word} runs on the grass.")
    assert cap.words == ["a", word, "runs", "on", "the", "grass"]
    assert cap.unknown == [1]
    assert cap.notes[0] == f"‘{word}’ is not in the model's vocabulary (fed as <unk>)"
    assert len(cap.notes) == 2 and "not comparable" in cap.notes[1] and not cap.comparable
    assert cap.alphas.shape[0] == 6 and np.all(np.isfinite(cap.word_log_probs))
    as_unk = bundled.explain(path, "a <unk> runs on the grass")  # the tokenizer drops <>: "unk"
    assert as_unk.words[1] == "unk"


@pytest.mark.parametrize("text", ["", "  ,. ", "!!! ...", "— ¿? —"])
def test_a_sentence_without_words_is_an_error(bundled, flickr, text):
    """explain(photo, "") used to return no words and log p(<end>) as the sentence's score."""
    path = flickr_photos(flickr, 1)[0]
    with pytest.raises(captioner.NoWordsError, match="type at least one word"):
        bundled.explain(path, text)
    assert issubclass(captioner.NoWordsError, ValueError)


def test_typed_words_are_kept_as_typed_in_any_script(bundled, flickr, one_torch_thread):
    """'café naïve résumé' was split into 'caf na ve r sum' and a Japanese sentence into no words."""
    path = flickr_photos(flickr, 1)[0]
    cap = bundled.explain(path, "A dog in a Café, très naïve résumé!")
    assert cap.words == ["a", "dog", "in", "a", "café", "très", "naïve", "résumé"]
    assert cap.unknown == [i for i, w in enumerate(cap.words) if w not in bundled.vocab.stoi] == [4, 5, 6, 7]
    assert cap.notes[0] == "‘café’ is not in the model's vocabulary (fed as <unk>)" and len(cap.notes) == 5
    assert not cap.comparable and "not comparable" in cap.notes[4]  # the total scores four words as <unk>
    assert cap.alphas.shape[0] == 8 and np.all(np.isfinite(cap.word_log_probs))
    # the <unk> words score as <unk> does in that place: the same as typing an unknown ASCII word there
    ascii_unk = bundled.explain(path, "a dog in a zzzq zzzq zzzq zzzq")
    np.testing.assert_allclose(cap.word_log_probs, ascii_unk.word_log_probs, atol=1e-5)
    ja = bundled.explain(path, "犬が 走っている")  # no spaces inside a Japanese word run: kept whole
    assert ja.words == ["犬が", "走っている"] and ja.unknown == [0, 1]
    assert bundled.explain(path, "cafe\u0301").words == ["café"]  # a combining accent is the same word (NFC)
    assert bundled.explain(path, "a man’s dog").words == bundled.explain(path, "a man's dog").words


def test_typed_tokenizer_agrees_with_the_training_one_on_ascii(flickr):
    """On every Flickr8k caption (ASCII) the typed sentence tokenizer gives the vocabulary's tokens:
    the model's captions and their explanations are unchanged."""
    from captioner.vocab import tokenize, tokenize_typed

    lines = (flickr / "captions.txt").read_text(encoding="utf-8").splitlines()[1:]
    captions = [line.split(",", 1)[1] for line in lines if "," in line]
    assert len(captions) > 40000
    ascii_caps = [c for c in captions if c.isascii()]
    assert len(ascii_caps) > 0.99 * len(captions)
    differ = [c for c in ascii_caps if tokenize(c) != tokenize_typed(c)]
    assert not differ, differ[:5]
    assert tokenize("café naïve") == ["caf", "na", "ve"]  # the training tokenizer is unchanged (vocabularies)


def test_unlikely_word_scores_lower(bundled, flickr, one_torch_thread):
    """Swapping a caption's noun for an unrelated one lowers that word's probability."""
    path = flickr_photos(flickr, 1)[0]
    dec = bundled.caption(path, beam_size=1, block_trigrams=False)
    i = max(range(len(dec.words)), key=lambda j: dec.word_log_probs[j])  # the model's surest word
    swapped = list(dec.words)
    swapped[i] = "refrigerator" if dec.words[i] != "refrigerator" else "banana"
    exp = bundled.explain(path, " ".join(swapped))
    assert exp.word_log_probs[i] < dec.word_log_probs[i] - 1.0


def test_hard_model_argmax_context_is_explained_as_decoded(one_torch_thread):
    """A hard-attention model decoded with hard_context=argmax: explain uses the same context, so
    the words' probabilities match (and differ from the expected context's)."""
    import torch

    from captioner.config import DecodeConfig
    from captioner.decoding.search import decode
    from captioner.vocab import SpecialIds
    from captioner.decoding.photo import explain_features
    from captioner.vocab import Vocab
    from .conftest import tiny_decoder

    dec = tiny_decoder(attention="hard")
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>"] + [f"w{i}" for i in range(dec.vocab_size - 4)])
    feats = torch.randn(1, 9, 16)  # (1, P, D) of the tiny decoder (D = 16): a 3x3 grid
    settings = DecodeConfig(beam_size=1, max_len=6, block_trigrams=False, hard_context="argmax")
    ((hyp,),) = decode(dec, feats, SpecialIds.of(vocab), settings)
    words = [vocab.itos[t] for t in hyp.tokens]
    argmax = explain_features(dec, feats, vocab, words, context="argmax")
    np.testing.assert_allclose(argmax.word_log_probs, hyp.word_logps.numpy(), atol=1e-5)
    np.testing.assert_allclose(argmax.alphas.reshape(len(words), -1), hyp.alphas.numpy(), atol=1e-5)
    expected = explain_features(dec, feats, vocab, words, context="expected")
    assert not np.allclose(expected.word_log_probs, argmax.word_log_probs)


def test_unknown_words_make_the_total_not_comparable(one_torch_thread):
    """'a giraffe stands under a tree' (giraffe unknown) outscored the model's own caption: an unknown word is
    scored as <unk>, which stands for every unknown word. The sentence says so: comparable False, a note
    naming the words, and "comparable": false in the JSON; a sentence of known words stays comparable."""
    model = tiny_captioner()
    img = photo()
    own = model.caption(img, beam_size=1, max_len=6)
    assert own.comparable and own.to_dict(maps=False)["comparable"] is True
    known = model.explain(img, "a dog runs on the grass")
    assert known.comparable and known.notes == []
    typed = model.explain(img, "a giraffe runs under the zebra")  # giraffe, under, zebra: not in WORDS
    assert typed.unknown == [1, 3, 5] and typed.comparable is False
    rec = typed.to_dict(maps=False)
    assert rec["comparable"] is False and rec["unknown_words"] == ["giraffe", "under", "zebra"]
    flag = [n for n in typed.notes if "not comparable" in n]
    assert len(flag) == 1 and all(f"‘{w}’" in flag[0] for w in ("giraffe", "under", "zebra"))
    assert rec["notes"] == typed.notes
