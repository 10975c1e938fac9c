"""CIDEr-D (the SCST reward and the consensus agreement): its maximum, equality with the formula's dictionary
arithmetic on random pools (the oracle below) and with pycocoevalcap's CIDEr given the same document frequencies,
ranking agreement with training frequencies, and speed on real captions."""
from __future__ import annotations

import math
import random
import time
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st

from captioner.decoding.cider import CiderD
from captioner.data import build_records
from captioner.config import DataConfig
from captioner.vocab import tokenize

from .device_check import HostTensors


def ngram_counts(tokens, n=4) -> list[Counter]:
    """[Counter of 1-grams, ..., Counter of n-grams] of one caption."""
    toks = tuple(tokens)
    return [Counter(toks[i:i + k] for i in range(len(toks) - k + 1)) for k in range(1, n + 1)]


def _agreement(scorer: CiderD, candidate, ref_sets) -> float:
    """CiderD.agreements of one candidate."""
    return float(scorer.agreements([candidate], [ref_sets])[0])


def test_ngram_counts():
    c = ngram_counts([1, 2, 1, 2], 4)
    assert c[0] == {(1,): 2, (2,): 2} and c[1] == {(1, 2): 2, (2, 1): 1} and c[3] == {(1, 2, 1, 2): 1}


def oracle(references, candidate, ref_sets, n=4, sigma=6.0) -> float:
    """CIDEr-D of candidate against the union of ref_sets, document frequencies from references: the formula in
    dictionaries, one n-gram at a time (cider.py's docstring)."""
    df: Counter = Counter()
    for refs in references:
        df.update({g for r in refs for counts in ngram_counts(r, n) for g in counts})
    log_n = math.log(float(len(references)))

    def vector(tokens):
        vecs = [{g: tf * (log_n - math.log(max(1.0, df[g]))) for g, tf in c.items()} for c in ngram_counts(tokens, n)]
        return vecs, [math.sqrt(sum(x * x for x in v.values())) for v in vecs]

    c_vecs, c_norms = vector(candidate)
    total, count = 0.0, 0
    for r in (r for refs in ref_sets for r in refs):
        r_vecs, r_norms = vector(r)
        penalty = math.exp(-((len(candidate) - len(r)) ** 2) / (2 * sigma ** 2))
        for cv, rv, cn, rn in zip(c_vecs, r_vecs, c_norms, r_norms):
            if cn and rn:
                total += penalty * sum(min(x, rv[g]) * rv[g] for g, x in cv.items() if g in rv) / (cn * rn)
        count += 1
    return 10.0 * total / (n * count)


_words = st.lists(st.integers(0, 6), max_size=9)  # few words: n-grams shared and repeated often


@settings(max_examples=60, deadline=None)
@given(references=st.lists(st.lists(_words, min_size=1, max_size=4), min_size=1, max_size=6),
       pools=st.lists(st.tuples(_words, st.lists(st.integers(0, 5), min_size=1, max_size=3),
                                st.lists(_words, max_size=3)), min_size=1, max_size=5))
def test_agreements_equal_the_dictionary_formula_on_random_pools(references, pools):
    # each candidate against some training images' references (the bank) and captions of its own (other candidates)
    scorer = CiderD(references)
    cands = [c for c, _, _ in pools]
    ref_sets = [[references[j % len(references)] for j in near] + ([own] if own else []) for _, near, own in pools]
    ref_sets = [sets if any(sets) else [[[1, 2]]] for sets in ref_sets]
    batched = scorer.agreements(cands, ref_sets)  # one call for the whole pool
    assert batched.dtype == torch.float64 and batched.shape == (len(cands),)
    for i, (c, sets) in enumerate(zip(cands, ref_sets)):
        want = oracle(references, c, sets)
        assert float(batched[i]) == pytest.approx(want, abs=1e-6, rel=1e-9)
        assert _agreement(scorer, c, sets) == pytest.approx(want, abs=1e-6, rel=1e-9)  # the per-candidate call


def test_agreement_needs_a_reference_and_word_ids_it_can_code():
    scorer = CiderD([[[1, 2, 3]], [[4, 5]]])
    with pytest.raises(ValueError, match="at least one reference"):
        _agreement(scorer, [1, 2], [[]])
    with pytest.raises(ValueError, match="word ids"):
        _agreement(scorer, [scorer.base], [[[1, 2]]])
    assert scorer.to("cpu") is scorer


def test_agreements_keep_to_the_tables_device():
    # on a GPU the tables live on the model's device: nothing made on the host may meet them (device_check.py)
    scorer = CiderD([[[1, 2, 3], [1, 2]], [[4, 5, 1]], [[2, 3, 3]]])
    bank = scorer._bank
    tables = [scorer.codes, scorer.idf, bank.row, bank.ids, bank.order, bank.weight, bank.starts, bank.norms,
              bank.lengths]
    with HostTensors(*tables):
        got = scorer.agreements([[1, 2, 3], [3, 3], []], [[[[1, 2, 3], [1, 2]]], [[[2, 3, 3]], [[7, 3]]], [[[1]]]])
    assert got.tolist() == pytest.approx([oracle([[[1, 2, 3], [1, 2]], [[4, 5, 1]], [[2, 3, 3]]], c, sets)
                                          for c, sets in (([1, 2, 3], [[[1, 2, 3], [1, 2]]]),
                                                          ([3, 3], [[[2, 3, 3]], [[7, 3]]]), ([], [[[1]]]))], abs=1e-9)


def test_identical_candidate_and_references_score_the_maximum():
    # ten images with distinct captions: every n-gram of image 0 has df < N, so its idf > 0
    refs = [[[10 * i + k for k in range(6)]] * 5 for i in range(10)]
    scorer = CiderD(refs)
    assert _agreement(scorer, refs[0][0], [refs[0]]) == pytest.approx(10.0)
    # any change lowers it: a wrong word, a shorter caption, another image's caption
    assert _agreement(scorer, refs[0][0][:-1] + [99], [refs[0]]) < 10.0
    assert _agreement(scorer, refs[0][0][:4], [refs[0]]) < 10.0
    assert _agreement(scorer, refs[1][0], [refs[0]]) == 0.0


def test_clipping_and_length_penalty():
    refs = [[[1, 2, 3]]] + [[[i, i + 1]] for i in range(10, 30)]
    scorer = CiderD(refs)
    once = _agreement(scorer, [1, 2, 3], [refs[0]])
    assert _agreement(scorer, [1, 2, 3, 1, 2, 3], [refs[0]]) < once  # repeating n-grams is not rewarded
    assert scorer.score([[]], [refs[0]]) == [0.0]  # an empty caption scores 0, no error


def _tokens(records, n):
    ids: dict[str, int] = {}
    enc = lambda s: [ids.setdefault(w, len(ids)) for w in tokenize(s)]  # noqa: E731
    refs = [[enc(c) for c in r.captions] for r in records[:n]]
    return refs, ids


def test_equals_pycocoevalcap_cider_with_the_same_document_frequencies(flickr):
    from pycocoevalcap.cider.cider import Cider

    records = build_records(DataConfig(root=str(flickr), limit=60), "val")
    refs, ids = _tokens(records, 60)
    inv = {i: w for w, i in ids.items()}
    rng = random.Random(0)
    # candidates: a reference of the image itself (with a word dropped) or of another image
    cands = [r[0][:-1] if k % 2 else refs[rng.randrange(len(refs))][1] for k, r in enumerate(refs)]
    ours = CiderD(refs).score(cands, refs)  # document frequencies over these 60 images, as pycocoevalcap's
    gts = {k: [" ".join(inv[w] for w in c) for c in r] for k, r in enumerate(refs)}
    res = {k: [" ".join(inv[w] for w in c)] for k, c in enumerate(cands)}
    _, theirs = Cider().compute_score(gts, res)
    assert ours == pytest.approx(list(theirs), rel=1e-9, abs=1e-9)


@pytest.mark.slow
def test_training_frequencies_rank_like_pycocoevalcap_and_score_fast(flickr):
    from pycocoevalcap.cider.cider import Cider

    train = build_records(DataConfig(root=str(flickr)), "train")
    refs, ids = _tokens(train, len(train))
    scorer = CiderD(refs)
    inv = {i: w for w, i in ids.items()}
    rng = random.Random(1)
    # speed: 5 samples per training image (30,000 captions) as an SCST epoch scores them
    n = len(refs)
    cands = [refs[rng.randrange(n)][rng.randrange(5)] if k % 3 else refs[k // 5][k % 5][:-1] for k in range(5 * n)]
    t0 = time.perf_counter()
    scores = scorer.score(cands, [refs[k // 5] for k in range(5 * n)])
    seconds = time.perf_counter() - t0
    assert seconds < 60, f"scoring {5 * n} samples took {seconds:.1f}s"
    # ranking on the first 300 candidates agrees with pycocoevalcap (its own frequencies)
    m = 300
    gts = {k: [" ".join(inv[w] for w in c) for c in refs[k // 5]] for k in range(m)}
    res = {k: [" ".join(inv[w] for w in cands[k]) or "."] for k in range(m)}
    _, theirs = Cider().compute_score(gts, res)
    assert _spearman(scores[:m], list(theirs)) > 0.9


def _spearman(a, b) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for pos, i in enumerate(order):
            r[i] = pos
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
