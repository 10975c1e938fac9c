"""decoding/device_beam.py: beam search with fixed shapes (for a GPU: no host sync inside the loop) finds the
hypotheses search.beam_search finds: random decoders over many settings, and the bundled model on real photos
at its stored settings (evidence, person floor, every rule)."""
from __future__ import annotations

import pytest
import torch

import captioner
from captioner.config import DecodeConfig
from captioner.decoding.device_beam import beam_search_on_device, search_on_device
from captioner.decoding.rules import Lexicon, Rules, unruled
from captioner.decoding.search import beam_search
from captioner.model.decoder import Decoder
from captioner.vocab import SpecialIds

from .device_check import HostTensors, NoHostSync

START, END, PAD = 1, 2, 0
LEX = Lexicon(function_words=(4, 5), bad_last=(4, 5), joiners=(4,))  # 4 plays "and", 5 "a"


def same(a, b) -> None:
    """Two searches' outputs: per image the same hypotheses in the same order (words, scores, maps, gates)."""
    assert len(a) == len(b)
    for ha, hb in zip(a, b):
        assert [h.tokens for h in ha] == [h.tokens for h in hb]
        for x, y in zip(ha, hb):
            assert x.log_prob == pytest.approx(y.log_prob, abs=1e-4) and x.score == pytest.approx(y.score, abs=1e-4)
            assert torch.allclose(x.alphas.cpu(), y.alphas.cpu(), atol=1e-5)
            assert torch.allclose(x.word_logps.cpu(), y.word_logps.cpu(), atol=1e-4)
            assert torch.allclose(x.betas.cpu().float(), y.betas.cpu().float(), atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("beam, max_len, length_penalty", [(2, 6, 0.0), (3, 9, 1.0), (5, 12, 0.7), (4, 3, 0.0)])
def test_random_decoders_find_the_same_hypotheses(seed, beam, max_len, length_penalty):
    torch.manual_seed(seed)
    V = 40
    dec = Decoder(V, 16, 12, 20, 10, 0.0).eval()
    with torch.no_grad():
        dec.out_vocab.bias[END] += 2.0 * (seed % 3)  # some searches end early, some run to max_len
    feats = torch.rand(3, 9, 16)
    ids = SpecialIds(START, END, PAD, 3)
    for settings in (unruled(beam_size=beam, max_len=max_len, length_penalty=length_penalty),
                     DecodeConfig(beam_size=beam, max_len=max_len, length_penalty=length_penalty, block_trigrams=True,
                                  block_bigrams=True, block_repeats=True, block_content_repeats=True)):
        rules = Rules(ids, settings, lexicon=LEX)
        same(beam_search(dec, feats, ids, settings, rules),
             beam_search_on_device(dec, feats, ids, settings, rules, check_every=1))


def test_the_bundled_model_on_real_photos_at_its_stored_settings(bundled, monkeypatch):
    from captioner.decoding.rules import photo_evidence
    from captioner.decoding.reading import read_heads

    loaded = bundled
    photos = sorted((captioner.DEFAULT_CHECKPOINT.parent / "examples").glob("*.jpg"))
    feats = loaded.encode(torch.stack([loaded.preprocess(p) for p in photos]))  # (B, P, D)
    settings = loaded.decode_settings()
    ids = SpecialIds.of(loaded.vocab, settings.forbid_unk)
    evidence = photo_evidence(read_heads(loaded.model, feats), loaded.model, loaded.vocab, settings)
    rules = lambda: Rules(ids, settings, evidence, Lexicon.of(loaded.vocab))  # noqa: E731
    want = beam_search(loaded.model.decoder, feats, ids, settings, rules())
    with HostTensors(loaded.model, feats):  # every tensor it makes on the model's device (tests/device_check.py)
        got = beam_search_on_device(loaded.model.decoder, feats, ids, settings, rules())
    same(want, got)
    assert all(len(h) == settings.beam_size for h in want)
    with NoHostSync():  # the product's step (evidence, person floor, every rule) queued without a read
        found = search_on_device(loaded.model.decoder, feats, ids, settings, rules(), check_every=1000)
    same(want, found.hypotheses())


def test_no_host_sync_between_checks(monkeypatch):
    """The step's word-gate table is made whole (Decoder.make_word_gates): no read of which words are known."""
    torch.manual_seed(0)
    dec = Decoder(40, 16, 12, 20, 10, 0.0).eval()
    feats = torch.rand(2, 9, 16)
    ids = SpecialIds(START, END, PAD, 3)
    settings = DecodeConfig(beam_size=3, max_len=8, block_trigrams=True, block_bigrams=True, block_repeats=True,
                            block_content_repeats=True)
    with NoHostSync():  # the whole search queued: the check every 100 steps never comes within max_len
        found = search_on_device(dec, feats, ids, settings, Rules(ids, settings, lexicon=LEX), check_every=100)
    same(beam_search(dec, feats, ids, settings, Rules(ids, settings, lexicon=LEX)), found.hypotheses())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_one_beam_on_the_device_is_greedy(seed, length_penalty):
    """decode() on a GPU takes the fixed-shape search for beam 1 too: the same words, log-probabilities and maps
    as greedy decoding's own loop (tests/greedy_oracle.py), and its score is the log-probability."""
    from .greedy_oracle import greedy_decode

    torch.manual_seed(seed)
    dec = Decoder(40, 16, 12, 20, 10, 0.0).eval()
    with torch.no_grad():
        dec.out_vocab.bias[END] += 1.5 * (seed % 2)
    feats = torch.rand(4, 9, 16)
    ids = SpecialIds(START, END, PAD, 3)
    settings = DecodeConfig(beam_size=1, max_len=10, length_penalty=length_penalty, block_trigrams=True,
                            block_repeats=True)
    rules = Rules(ids, settings, lexicon=LEX)
    same([[h] for h in greedy_decode(dec, feats, ids, settings, rules)],
         beam_search_on_device(dec, feats, ids, settings, rules, check_every=1, greedy_scores=True))
