"""Evidence-aware decoding: the encoder's ImageNet head vetoes object words it rules out and brings
in the object it sees; the bias is exact, per image, and off by default."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import captioner
from captioner.concepts.imagenet import CATEGORIES
from captioner.config import DecodeConfig
from captioner.decoding.evidence import Evidence, word_categories
from captioner.vocab import Vocab

EXAMPLES = captioner.DEFAULT_CHECKPOINT.parent / "examples"


def _vocab() -> Vocab:
    return Vocab(["<pad>", "<start>", "<end>", "<unk>", "a", "dog", "dogs", "puppy", "cat", "man", "hot", "cup"])


def test_word_categories_use_the_grounding_names():
    v = _vocab()
    m = word_categories(v)
    assert m.shape == (len(v), len(CATEGORIES)) and (m.sum(1) <= 1).all()  # a word names at most one category
    dog = CATEGORIES.index("dog")
    assert {v.itos[i] for i in m[:, dog].nonzero().flatten().tolist()} == {"dog", "dogs", "puppy"}
    assert m[v.stoi["man"]].sum() == 0  # person: ImageNet has no class, no evidence either way
    assert m[v.stoi["hot"]].sum() == 0 and m[v.stoi["cup"], CATEGORIES.index("cup")] == 1


def test_bias_penalises_ruled_out_words_and_boosts_seen_ones_once():
    v = _vocab()
    probs = torch.zeros(2, len(CATEGORIES))
    probs[0, CATEGORIES.index("dog")] = 0.9  # image 0 shows a dog, no cat, no cup
    probs[1, CATEGORIES.index("cat")] = 0.6  # image 1 shows a cat
    s = DecodeConfig(evidence=True, evidence_floor=0.05, evidence_penalty=7.0, evidence_bonus=2.0)
    ev = Evidence(probs, word_categories(v), s)
    b = ev.bias(torch.tensor([0, 1]), torch.zeros(2, 0, dtype=torch.long))  # (2, V) before any word
    assert b[0, v.stoi["dog"]] == pytest.approx(1.8) and b[0, v.stoi["puppy"]] == pytest.approx(1.8)
    assert b[0, v.stoi["cat"]] == -7.0 and b[1, v.stoi["dog"]] == -7.0 and b[1, v.stoi["cat"]] == pytest.approx(1.2)
    assert b[:, v.stoi["man"]].eq(0).all() and b[:, v.stoi["a"]].eq(0).all()
    said_dog = torch.tensor([[v.stoi["a"], v.stoi["dog"]]])
    after = ev.bias(torch.tensor([0]), said_dog)  # once named, the bonus stops; the veto stays
    assert after[0, v.stoi["dogs"]] == 0 and after[0, v.stoi["cat"]] == -7.0


@pytest.fixture(scope="module")
def model():
    return captioner.load()


def test_evidence_is_off_unless_asked_and_changes_only_object_words(model):
    assert DecodeConfig().evidence is False  # old model files decode as before
    plain = model.caption(EXAMPLES / "coffee.jpg", evidence=False)
    assert plain.concepts[0][0] == "cup" and plain.concepts[0][1] > 0.5  # the head sees a cup
    seen = model.caption(EXAMPLES / "coffee.jpg", evidence=True, evidence_bonus=15.0)
    assert "dog" not in seen.words and "cup" in seen.words
    cat = model.caption(EXAMPLES / "cat.jpg", evidence=True, evidence_bonus=15.0)
    assert "cat" in cat.words
    assert all(abs(a.sum() - 1) < 1e-4 for a in seen.alphas)  # every word still has its map


def test_batched_evidence_equals_one_by_one(model):
    """Each image's bias follows it through the batch (images leave the batch as they finish)."""
    s = dataclasses.asdict(dataclasses.replace(model.config.decode, evidence=True, evidence_bonus=10.0))
    photos = [EXAMPLES / n for n in ("cat.jpg", "coffee.jpg", "astronaut.jpg")]
    for beam in (1, 3):
        batch = model.caption_batch(photos, **{**s, "beam_size": beam})
        for p, c in zip(photos, batch):
            assert model.caption(p, **{**s, "beam_size": beam}).words == c.words


def test_evidence_is_built_once_per_decode_batch(model, monkeypatch):
    """One photo's evidence is computed once per decode: one Evidence and one word -> category table over
    CATEGORIES (the ruled-out mask's), which decoding's bias and the contradicted words both read; for one
    photo, a batch and an explained sentence alike. Patched where they are defined, so that a second copy
    imported elsewhere is counted too."""
    from captioner.concepts import words as words_module
    from captioner.decoding.photo import caption_photos

    builds = {"evidence": 0, "table": 0}
    real_init, real_table = Evidence.__init__, words_module._word_categories

    def init(self, *args, **kwargs):
        builds["evidence"] += 1
        real_init(self, *args, **kwargs)

    def table(itos, categories):
        builds["table"] += categories == tuple(CATEGORIES)
        return real_table(itos, categories)

    monkeypatch.setattr(Evidence, "__init__", init)
    monkeypatch.setattr(words_module, "_word_categories", table)
    photos = [EXAMPLES / n for n in ("cat.jpg", "coffee.jpg", "astronaut.jpg")]
    read = model.read_batch(photos)
    for evidence in (True, False):  # contradicted words are marked with or without evidence-aware decoding
        for ask in (lambda: read[0].caption(evidence=evidence), lambda: caption_photos(model, read, evidence=evidence),
                    lambda: read[1].explain("a dog and a cat", evidence=evidence)):
            builds.update(evidence=0, table=0)
            ask()
            assert builds == {"evidence": 1, "table": 1}, builds


def test_the_latency_benchmark_times_the_products_caption(model):
    """bench/breakdown.py's two halves make the very caption Captioner.caption() returns (person floor included)."""
    from captioner.bench.breakdown import caption_stages

    settings = model.decode_settings()
    assert settings.person_floor > 0 and settings.evidence  # the stored settings the benchmark times
    for name in ("cat.jpg", "coffee.jpg", "astronaut.jpg"):
        feats = model.read(EXAMPLES / name).features  # (1, P, D)
        decoding, concepts = caption_stages(model, feats, settings)
        timed = concepts(decoding())[0]
        product = model.caption(EXAMPLES / name)
        assert (timed.text, timed.contradicted, timed.concepts) == (product.text, product.contradicted, product.concepts)
        assert timed.log_prob == pytest.approx(product.log_prob, abs=1e-5)


def test_the_dog_floor_rules_out_dog_words_below_it_and_nothing_else():
    v = _vocab()
    probs = torch.zeros(2, len(CATEGORIES))
    probs[:, CATEGORIES.index("dog")] = torch.tensor([0.15, 0.6])  # a doubtful dog, a clear one
    probs[:, CATEGORIES.index("cat")] = 0.15
    for dog_floor, doubtful_out in ((0.0, False), (0.2, True), (0.1, False)):
        s = DecodeConfig(evidence=True, evidence_floor=0.05, dog_floor=dog_floor)
        out = Evidence(probs, word_categories(v), s).ruled_out  # (2, V)
        assert bool(out[0, v.stoi["dog"]]) is doubtful_out and bool(out[0, v.stoi["puppy"]]) is doubtful_out
        assert not out[1, v.stoi["dog"]] and not out[:, v.stoi["cat"]].any()  # the clear dog, another category
