"""Every path runs the one attention the model defines: sharpen AdditiveAttention's alpha (a patch of its
`weights`, the eq. 4-5 every step calls) and each path's output changes: a photo's caption (the API), the
batched beam search on a CPU and with fixed shapes, greedy decoding, explaining a sentence, SCST's sampled
captions and the teacher-forced loss. A path with its own copy of the attention would not notice."""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
import torch

import captioner
from captioner.config import Config
from captioner.data.dataset import Batch
from captioner.decoding.device_beam import beam_search_on_device
from captioner.decoding.sampling import sample
from captioner.decoding.search import beam_search, decode
from captioner.model.attention import AdditiveAttention
from captioner.training.objectives import CrossEntropy
from captioner.vocab import SpecialIds

EXAMPLES = sorted((captioner.DEFAULT_CHECKPOINT.parent / "examples").glob("*.jpg"))
SENTENCE = "a cat sitting on a table"


def _paths(bundled: captioner.Captioner) -> dict[str, Callable[[], np.ndarray]]:
    """Each path that steps the decoder -> a function returning what it computed, as one flat array."""
    dec, vocab = bundled.model.decoder, bundled.vocab
    feats = torch.cat([p.features for p in bundled.read_batch(EXAMPLES)])  # (3, P, D)
    settings = bundled.decode_settings()
    ids = SpecialIds.of(vocab, settings.forbid_unk)
    greedy = bundled.decode_settings(beam_size=1)

    def flat(*xs) -> np.ndarray:
        return np.concatenate([np.asarray(x, dtype=np.float64).ravel() for x in xs])

    def hyps(found) -> np.ndarray:
        return flat(*[h.alphas for hs in found for h in hs], [h.log_prob for hs in found for h in hs])

    def scst_sample() -> np.ndarray:
        s = sample(dec, feats, ids, 3, 8, generator=torch.Generator().manual_seed(0))  # with autograd, as SCST
        assert s.log_probs.requires_grad
        return flat(s.alphas.detach(), s.log_probs.detach())

    def loss() -> np.ndarray:
        captions = [[vocab.stoi[w] for w in SENTENCE.split()]] * 3
        inputs = torch.tensor([[vocab.start] + c for c in captions])  # (3, T)
        targets = torch.tensor([c + [vocab.end] for c in captions])
        batch = Batch(feats, inputs, targets, torch.full((3,), inputs.shape[1]), torch.arange(3))
        return flat(CrossEntropy(Config(), vocab)(bundled.model, batch).total.detach())

    return {"caption (API)": lambda: flat(bundled.caption(EXAMPLES[0]).alphas),
            "explain (API)": lambda: flat(bundled.explain(EXAMPLES[0], SENTENCE).alphas),
            "beam search": lambda: hyps(beam_search(dec, feats, ids, settings)),
            "beam search, fixed shapes": lambda: hyps(beam_search_on_device(dec, feats, ids, settings)),
            "greedy (beam 1)": lambda: hyps(decode(dec, feats, ids, greedy)),
            "SCST sample": scst_sample, "teacher-forced loss": loss}


@pytest.mark.slow
def test_sharpening_the_attention_changes_every_path(bundled, one_torch_thread, monkeypatch):
    paths = _paths(bundled)
    before = {name: run() for name, run in paths.items()}
    again = {name: run() for name, run in paths.items()}
    for name in paths:  # each path is deterministic: any change below is the patch's
        np.testing.assert_array_equal(again[name], before[name], err_msg=name)
    weights, calls = AdditiveAttention.weights, []

    def sharper(self, feats, feat_proj, h, literal=False):
        alpha, beta = weights(self, feats, feat_proj, h, literal)
        calls.append(h.shape[0])
        return torch.softmax(4 * alpha.log(), dim=-1), beta  # alpha^4, renormalised

    monkeypatch.setattr(AdditiveAttention, "weights", sharper)
    for name, run in paths.items():
        del calls[:]
        after = run()
        assert calls, f"{name} never called AdditiveAttention.weights"
        assert after.shape != before[name].shape or not np.allclose(after, before[name], atol=1e-4), \
            f"{name} did not change when the attention did"


def test_compiling_the_step_compiles_what_every_path_runs(tiny, monkeypatch):
    """train.compile (Decoder.compile_step) wraps `recur`: teacher forcing, beam search, greedy decoding and
    sampling then all run the wrapped function (here a counting stand-in for torch.compile)."""
    from captioner.decoding.rules import unruled
    from .conftest import IDS, D, P, batch

    runs: list[str] = []

    def compile(fn):
        def compiled(*args, **kwargs):
            runs.append(fn.__name__)
            return fn(*args, **kwargs)
        return compiled

    monkeypatch.setattr(torch, "compile", compile)
    dec = tiny
    dec.compile_step()
    feats = torch.randn(3, P, D)
    inputs, _, lengths, _ = batch(12)
    paths = {"teacher forcing": lambda: dec.teacher_force(feats, inputs, lengths),
             "beam search": lambda: beam_search(dec, feats, IDS, unruled(beam_size=3, max_len=5)),
             "beam search, fixed shapes": lambda: beam_search_on_device(dec, feats, IDS,
                                                                        unruled(beam_size=3, max_len=5)),
             "greedy (beam 1)": lambda: decode(dec, feats, IDS, unruled(beam_size=1, max_len=5)),
             "sampling": lambda: sample(dec, feats, IDS, 2, 5)}
    for name, run in paths.items():
        del runs[:]
        run()
        assert runs and set(runs) == {"recur"}, name
