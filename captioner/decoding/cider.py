"""CIDEr-D (Vedantam et al. 2015) on token ids, document frequencies from the training references: SCST's
reward (training/objectives.py) and the consensus rerank's agreement with the nearest training photos'
captions (consensus.py).

For each n = 1..4 a caption is a TF-IDF vector over its n-grams,

    g_n(k) = tf(k) * log(N_images / max(1, df(k)))

with df(k) the number of training images whose references contain n-gram k. Against each reference
r of the image, CIDEr-D takes the cosine similarity with the candidate's counts clipped to the
reference's (min(g_c, g_r) * g_r) and a Gaussian penalty on the length difference,
exp(-(len_c - len_r)^2 / (2 sigma^2)), sigma = 6; the image's score is 10 x the mean over n and over
references. This is coco-caption's CIDEr-D, the reward of self-critical training (Rennie et al.
2017). pycocoevalcap's `Cider` (what evaluation reports) computes the same formula but takes its
document frequencies from the evaluated set itself; given the same frequencies the two are equal
(tests/test_cider.py checks it), with the training set's they agree on ranking.

Captions are token-id lists without <start>/<end>; references are the training captions as the
vocabulary encodes them, so a rare word that became <unk> in a reference never matches (sampled
captions never contain <unk>).
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

Caption = Sequence[int]
NGram = tuple[int, ...]


def ngram_counts(tokens: Caption, n: int = 4) -> list[Counter]:
    """[Counter of 1-grams, ..., Counter of n-grams] of one caption."""
    toks = tuple(tokens)
    return [Counter(toks[i:i + k] for i in range(len(toks) - k + 1)) for k in range(1, n + 1)]


class CiderD:
    """CIDEr-D with document frequencies fixed at construction (the training references)."""

    def __init__(self, references: Sequence[Sequence[Caption]], n: int = 4, sigma: float = 6.0):
        """references: for each training image, its reference captions (token ids)."""
        if not references:
            raise ValueError("CIDEr-D needs the training references to compute document frequencies")
        self.n, self.sigma = n, sigma
        df: Counter = Counter()
        for refs in references:  # each image's distinct n-grams once (zip of shifted copies: no Counter per caption)
            grams: set[NGram] = set()
            for r in refs:
                toks = tuple(r)
                for k in range(1, n + 1):
                    grams.update(zip(*(toks[i:] for i in range(k))))
            df.update(grams)
        self.df = dict(df)
        self.log_n = math.log(float(len(references)))
        self._ref_cache: dict[tuple[Caption, ...], tuple] = {}  # reference set -> its index (_refs)

    def _vector(self, tokens: Caption) -> tuple[list[dict[NGram, float]], list[float], int]:
        """TF-IDF vectors per n, their norms, and the caption length."""
        vecs, norms = [], []
        for counts in ngram_counts(tokens, self.n):
            v = {g: tf * (self.log_n - math.log(max(1.0, self.df.get(g, 0.0)))) for g, tf in counts.items()}
            vecs.append(v)
            norms.append(math.sqrt(sum(x * x for x in v.values())))
        return vecs, norms, len(tokens)

    def _refs(self, refs: Sequence[Caption]) -> tuple[list[dict[NGram, list[tuple[int, float]]]], list[list[float]],
                                                       list[int]]:
        """A reference set as an inverted index: per n, each n-gram -> [(reference, its weight)], and each reference's
        norms and length. A candidate then visits only the references that share its n-grams (a consensus over
        a hundred captions would otherwise loop over every n-gram of every one)."""
        key = tuple(tuple(r) for r in refs)
        hit = self._ref_cache.get(key)
        if hit is None:
            if len(self._ref_cache) > 200_000:  # bound memory on huge datasets
                self._ref_cache.clear()
            index: list[dict[NGram, list[tuple[int, float]]]] = [{} for _ in range(self.n)]
            norms, lengths = [], []
            for j, r in enumerate(key):
                vecs, r_norms, length = self._vector(r)
                for n, v in enumerate(vecs):
                    for g, x in v.items():
                        index[n].setdefault(g, []).append((j, x))
                norms.append(r_norms)
                lengths.append(length)
            hit = self._ref_cache[key] = (index, norms, lengths)
        return hit

    def score_one(self, candidate: Caption, refs: Sequence[Caption]) -> float:
        return self.agreement(candidate, [refs])

    def agreement(self, candidate: Caption, ref_sets: Sequence[Sequence[Caption]]) -> float:
        """CIDEr-D of `candidate` against all the references of several sets at once (= score_one against their
        union); each set's index is cached by the set, so a set met again (a training photo's captions) is free."""
        if not any(ref_sets):
            raise ValueError("every candidate needs at least one reference")
        c_vecs, c_norms, c_len = self._vector(candidate)
        total = 0.0
        for refs in ref_sets:
            index, norms, lengths = self._refs(refs)
            dots = [[0.0] * len(lengths) for _ in range(self.n)]  # (n, refs): clipped counts x reference weights
            for n, cv in enumerate(c_vecs):
                postings, dot = index[n], dots[n]
                for g, x in cv.items():
                    for j, r in postings.get(g, ()):
                        dot[j] += min(x, r) * r
            for j, r_len in enumerate(lengths):
                penalty = math.exp(-((c_len - r_len) ** 2) / (2 * self.sigma ** 2))
                for n in range(self.n):
                    cn, rn = c_norms[n], norms[j][n]
                    if cn == 0.0 or rn == 0.0:
                        continue
                    total += penalty * dots[n][j] / (cn * rn)
        return 10.0 * total / (self.n * sum(len(refs) for refs in ref_sets))

    def score(self, candidates: Sequence[Caption], references: Sequence[Sequence[Caption]]) -> list[float]:
        """candidates[i] scored against references[i] -> one CIDEr-D per candidate."""
        if len(candidates) != len(references):
            raise ValueError(f"{len(candidates)} candidates but {len(references)} reference sets")
        return [self.score_one(c, r) for c, r in zip(candidates, references)]
