"""The decision after the beam, batched (confidence.decide: choice.choose over a choice.Pool, then confidence.judge):
on pools hypothesis draws (photos with one to six candidates of any length, the head's P,
a person detector, the objects check, every weight and a fitted map) it orders, scores and judges every photo's
candidates as the per-photo arithmetic does (tests/decision_oracle.py), and it reads the host once per batch."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from captioner.bench.launches import SYNCS  # the benchmark's own list of the ops that sync
from captioner.config import DecodeConfig
from captioner.decoding import choice
from captioner.decoding.confidence import decide
from captioner.decoding.confidence import SIGNALS as SURE_SIGNALS
from captioner.decoding.confidence import ConfidenceMap, needs
from captioner.decoding.consensus import ConsensusMemory
from captioner.decoding.device_beam import Hypothesis
from captioner.decoding.choice import Pool
from captioner.decoding.confidence import ObjectCheck
from captioner.vocab import Vocab

from . import decision_oracle as oracle

WORDS = ["<pad>", "<start>", "<end>", "<unk>", "a", "dog", "cat", "man", "on", "the", "grass", "sofa", "cake", "runs"]
V, C, M, D = len(WORDS), 3, 5, 6
CATEGORY_OF = {"dog": 0, "cat": 1, "cake": 2}  # (V, C) which words name a category
PEOPLE = ("man",)
CONTENT = list(range(4, V))


def _tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    categories = torch.zeros(V, C, dtype=torch.bool)
    for w, c in CATEGORY_OF.items():
        categories[WORDS.index(w), c] = True
    person = torch.tensor([float(w in PEOPLE) for w in WORDS])  # (V,)
    columns = torch.cat([categories, torch.zeros(V, M - C, dtype=torch.bool)], 1)  # (V, M)
    columns[WORDS.index("man"), C] = columns[WORDS.index("grass"), C + 1] = True
    return categories, person, columns


def _memory(seed: int) -> ConsensusMemory:
    g = torch.Generator().manual_seed(seed)
    caps = [[torch.randint(4, V, (int(torch.randint(1, 7, (), generator=g)),), generator=g).tolist()
             for _ in range(int(torch.randint(1, 4, (), generator=g)))] for _ in range(12)]
    return ConsensusMemory.build(torch.randn(12, D, generator=g), caps, V)


hypothesis_lists = st.lists(st.lists(st.tuples(st.lists(st.sampled_from(CONTENT), max_size=7),
                                               st.floats(-9, 0, allow_nan=False), st.booleans()),
                                     min_size=1, max_size=6), min_size=1, max_size=5)


def _hyps(drawn) -> list[list[Hypothesis]]:
    out = []
    for photo in drawn:
        hs = []
        for tokens, lp, with_words in photo:
            words = torch.linspace(lp / 2, -0.1, len(tokens)) if with_words else None  # (L,)
            hs.append(Hypothesis(list(tokens), torch.zeros(len(tokens), 4), lp, lp / (len(tokens) + 1), None, words))
        out.append(sorted(hs, key=lambda h: -h.score))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=hypothesis_lists, seed=st.integers(0, 2 ** 16), weighed=st.lists(st.booleans(), min_size=8, max_size=8),
       with_head=st.booleans(), with_person=st.booleans(), with_check=st.booleans(), with_map=st.booleans())
def test_the_batched_decision_equals_the_per_photo_one(drawn, seed, weighed, with_head, with_person, with_check,
                                                        with_map):
    g = torch.Generator().manual_seed(seed)
    hyps, B = _hyps(drawn), len(drawn)
    memory, (categories, person_words, columns) = _memory(seed), _tables()
    feats = torch.randn(B, 4, D, generator=g)  # (B, P, D)
    probs = torch.rand(B, C, generator=g) if with_head else None  # (B, C)
    person = (torch.rand(B, generator=g), person_words) if with_person and with_head else None
    check = ObjectCheck(torch.rand(B, V, generator=g) * columns.any(1), columns) if with_check else None
    weights = choice.Weights(tuple(float(torch.randn((), generator=g)) if w else 0.0 for w in weighed))
    fitted = ConfidenceMap(0.3, tuple(float(x) for x in torch.randn(len(SURE_SIGNALS), generator=g)), 0.6) \
        if with_map else None
    settings_ = DecodeConfig(consensus_k=3)
    vocab = Vocab(WORDS)
    kw = dict(person=person, categories=categories if with_head else None, check=check)
    how_sure = with_map or with_check
    judged = SURE_SIGNALS if how_sure and fitted is None else None  # no map: every signal (the fit)
    got = decide(copy.deepcopy(hyps), feats, probs, memory, vocab, settings_, weights, fitted, judged, **kw)
    want = oracle.choose(copy.deepcopy(hyps), feats, probs, memory, vocab, settings_, how_sure=how_sure,
                         weights=weights, fitted=fitted, **kw)
    assert [[h.tokens for h in d.hyps] for d in got] == [[h.tokens for h in p] for p in want]
    for d, q in zip(got, want):
        for i, o in enumerate(q):
            total, signals = d.choice_of(i)
            assert (total is None) == (o.choice is None) and (signals is None) == (o.signals is None)
            if total is not None:
                assert total == pytest.approx(o.choice, abs=1e-6)
                assert signals == pytest.approx(o.signals, abs=1e-6)
        o = q[0]
        assert (d.sure_signals is None) == (o.sure_signals is None)
        if d.sure_signals is not None:  # the judge computes what the map weighs (needs), the oracle every one
            assert set(d.sure_signals) == set(SURE_SIGNALS if fitted is None else needs(fitted))
            assert d.sure_signals == pytest.approx({s: o.sure_signals[s] for s in d.sure_signals}, abs=1e-6)
        assert (d.confidence is None) == (o.confidence is None)
        if d.confidence is not None:
            assert d.confidence == pytest.approx(o.confidence, abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(drawn=hypothesis_lists, seed=st.integers(0, 2 ** 16))
def test_every_signal_of_a_pool_equals_each_photos_own(drawn, seed):
    g = torch.Generator().manual_seed(seed)
    hyps, memory, (categories, person_words, _) = _hyps(drawn), _memory(seed), _tables()
    probs, person = torch.rand(len(hyps), C, generator=g), (torch.rand(len(hyps), generator=g), person_words)
    nearest = [torch.randperm(12, generator=g)[:8].tolist() for _ in hyps]
    every = choice.Weights((1.0,) * len(choice.SIGNALS))
    pool = Pool.of(hyps, V, least=1)
    cider = choice.agreements(pool, nearest, 2, memory, choice.CIDER_SIGNALS)  # (N, 3)
    got = choice.signals(pool, len(hyps), cider, probs, categories, person)  # (N, S)
    want = torch.cat([oracle.choice_signals(hs, near[:2], near, probs[b], categories, memory, every,
                                            (float(person[0][b]), person[1].bool()))
                      for b, (hs, near) in enumerate(zip(hyps, nearest))])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)



class _Reads(TorchDispatchMode):
    """Counts the ops that make a GPU's host wait (a value read back, a data-dependent shape)."""

    def __init__(self):
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.syncs += str(func) in SYNCS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("photos", [1, 16])
def test_the_decision_reads_the_host_a_few_times_per_batch_not_per_photo(photos):
    g = torch.Generator().manual_seed(photos)
    memory, (categories, person_words, columns) = _memory(photos), _tables()
    hyps = [[Hypothesis(torch.randint(4, V, (6,), generator=g).tolist(), torch.zeros(6, 4), -3.0 - i, -0.5 - i,
                        None, torch.full((6,), -0.5)) for i in range(5)] for _ in range(photos)]
    probs = torch.rand(photos, C, generator=g)
    kw = dict(person=(torch.rand(photos, generator=g), person_words), categories=categories,
              check=ObjectCheck(torch.rand(photos, V, generator=g), columns))
    weights = choice.Weights((1.0, 1.0, 1.0, 1.0, 0.5, 0.0, 1.0, 1.0))
    reads = _Reads()
    with reads:
        out = decide(hyps, torch.randn(photos, 4, D, generator=g), probs, memory, Vocab(WORDS),
                     DecodeConfig(consensus_k=3), weights, ConfidenceMap(0.0, (1.0,) * len(SURE_SIGNALS), 0.6), **kw)
    assert all(d.confidence is not None for d in out)
    assert reads.syncs <= 12  # the CIDEr-D pass's few, whatever the batch (it was ~30 a photo)


def test_a_caption_on_the_gpus_search_waits_on_the_device_a_few_times_not_once_a_step(bundled):
    """bench/launches.py's counts on the bundled model and the example photos: the GPU's search (device_beam, run on
    the CPU) with the batched decision reads back at most 8 values for one caption and as few for a batch."""
    from captioner.bench.breakdown import photo_files
    from captioner.bench.launches import bench_launches

    gpu = bench_launches(bundled, photo_files(None), gpu_search=True)
    assert gpu["one_caption"]["syncs"] <= 8 and gpu["batch"]["syncs"] <= 8, gpu
    cpu = bench_launches(bundled, photo_files(None))  # the CPU's beam reads once a step: finished photos leave
    assert cpu["search"] == "cpu beam" and cpu["one_caption"]["syncs"] > gpu["one_caption"]["syncs"]
