"""A tiny model overfits a handful of REAL Flickr8k images until greedy decoding reproduces their
captions: the whole pipeline (image loading, encoder, teacher forcing, loss, decoding) fits together."""
from __future__ import annotations

import pytest
import torch

from functools import partial

from captioner.config import Config, DataConfig
from captioner.data import build_records
from captioner.data.dataset import collate, encode_captions
from captioner.decoding.rules import unruled
from captioner.decoding.search import decode
from captioner.vocab import SpecialIds
from captioner.training.engine import train_step
from captioner.training.objectives import CrossEntropy
from captioner.images import load_image, preprocess
from captioner.model.show_attend_tell import build_model
from captioner.model.encoder import normalization
from captioner.vocab import Vocab


@pytest.mark.slow
def test_tiny_model_memorises_real_images(flickr):
    records = build_records(DataConfig(root=str(flickr), limit=5), "train")
    for r in records:
        r.captions = r.captions[:1]  # one caption per image: a well-defined target
    vocab = Vocab.build([r.captions[0] for r in records], min_count=1)
    cfg = Config()
    cfg.model.encoder, cfg.model.grid_size = "efficientnet_lite0", 7
    cfg.model.embed_dim, cfg.model.hidden_dim, cfg.model.attention_dim, cfg.model.dropout = 64, 128, 64, 0.0
    model = build_model(cfg.model, len(vocab))
    mean, std = normalization("efficientnet_lite0")
    images = torch.stack([preprocess(load_image(r.path), 224, mean, std) for r in records])
    with torch.no_grad():
        feats = model.encoder.eval()(images)  # (5, 49, 1280), frozen encoder
    caps = encode_captions(records, vocab, 50)
    batch = collate([(f, c) for f, c in zip(feats, caps)])
    opt = torch.optim.Adam(model.decoder.parameters(), lr=3e-3)
    first, objective = None, partial(CrossEntropy(cfg), model)
    for step in range(300):
        terms = train_step(objective, opt, batch, cfg, torch.device("cpu"))  # the step fit() runs
        first = terms.logs["xent"] if first is None else first
        if terms.logs["xent"] < 0.02:
            break
    model.eval()
    hyps = decode(model.decoder, feats, SpecialIds.of(vocab), unruled(beam_size=1, max_len=40))  # what it learned, no rule
    got = [" ".join(vocab.decode(h[0].tokens)) for h in hyps]
    want = [" ".join(vocab.decode(ids)) for ids in (c[0] for c in caps)]
    assert terms.logs["xent"] < 0.1 * first
    assert got == want
