"""Sampling with fixed shapes (decoding/sampling.sample with check_every > 0, what SCST and Photo.sample use off the
CPU): every row kept to the end and one host read every k steps, so a GPU queues its steps; with greedy draws it
writes what the shrinking CPU loop writes, and under tests/device_check.NoHostSync nothing is read back."""
from __future__ import annotations

import pytest
import torch

from captioner.decoding.sampling import Draw, Renormalised, sample
from captioner.model.decoder import Decoder
from captioner.vocab import SpecialIds

from .device_check import NoHostSync

START, END, PAD = 1, 2, 0


def _decoder(seed: int) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(40, 16, 12, 20, 10, 0.0).eval()


def _trimmed(s, T: int):
    return s.tokens[:, :T], s.log_probs[:, :T], s.mask[:, :T], s.alphas[:, :T], s.betas[:, :T]


@pytest.mark.parametrize("rules", [False, True])
def test_fixed_shapes_write_what_the_shrinking_loop_writes(bundled, rules):
    """The bundled model on its example photos (captions of different lengths), greedy draws (deterministic: the
    two loops must agree token for token), with SCST's scores and with a caption's (every decode rule)."""
    import captioner
    from captioner.decoding.rules import photo_evidence
    from captioner.decoding.reading import read_heads
    from captioner.decoding.rules import Lexicon, Rules

    loaded = bundled
    photos = sorted((captioner.DEFAULT_CHECKPOINT.parent / "examples").glob("*.jpg"))
    feats = loaded.encode(torch.stack([loaded.preprocess(p) for p in photos]))  # (B, P, D)
    settings = loaded.decode_settings()
    ids = SpecialIds.of(loaded.vocab, settings.forbid_unk)
    scores = None
    if rules:
        evidence = photo_evidence(read_heads(loaded.model, feats), loaded.model, loaded.vocab, settings)
        scores = Rules(ids, settings, evidence, Lexicon.of(loaded.vocab))
    greedy = Draw(top_k=1)
    with torch.no_grad():
        shrinking = sample(loaded.model.decoder, feats, ids, 2, 30, draw=greedy, rules=scores, check_every=0)
        fixed = sample(loaded.model.decoder, feats, ids, 2, 30, draw=greedy, rules=scores, check_every=4)
    T = shrinking.tokens.shape[1]
    assert fixed.tokens.shape[1] >= T and not fixed.mask[:, T:].any()  # at most a few all-<pad> steps more
    for a, b in zip(_trimmed(shrinking, T), _trimmed(fixed, T)):
        assert torch.allclose(a.float(), b.float(), atol=1e-5)
    lengths = shrinking.mask.sum(1)
    assert lengths.min() < lengths.max()  # captions of different lengths: the CPU loop really dropped images


def test_fixed_shape_sampling_reads_nothing_back_between_checks():
    dec, feats = _decoder(0), torch.rand(2, 9, 16)
    ids = SpecialIds(START, END, PAD, 3)
    gen = torch.Generator().manual_seed(0)
    scores = Renormalised(ids, feats.device)
    with NoHostSync():  # SCST's sampling with gradients, queued: the check every 100 steps never comes
        s = sample(dec, feats, ids, 5, 10, rules=scores, generator=gen, check_every=100)
    assert s.tokens.shape == (10, 10) and s.log_probs.requires_grad
    assert ((s.alphas.sum(-1) - s.mask.float()).abs() < 1e-5).all()  # each real token's map sums to 1
