"""Evidence-aware decoding: the encoder's ImageNet head vetoes object words it rules out and brings
in the object it sees; the veto is a ban (-inf, whatever a model file stored as its old size), the bonus a bias;
both exact, per image, and off by default."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import captioner
from captioner.concepts.imagenet import CATEGORIES
from captioner.config import DecodeConfig
from captioner.decoding.rules import Evidence, word_categories
from captioner.decoding.rules import Lexicon, Rules
from captioner.vocab import SpecialIds, Vocab
from .rules_oracle import evidence_bias

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


def _dog_and_cat(v: Vocab, bonus: float = 2.0) -> Evidence:
    """Image 0 shows a dog (no cat, no cup), image 1 a cat."""
    probs = torch.zeros(2, len(CATEGORIES))
    probs[0, CATEGORIES.index("dog")] = 0.9
    probs[1, CATEGORIES.index("cat")] = 0.6
    return Evidence(probs, word_categories(v), DecodeConfig(evidence=True, evidence_floor=0.05, evidence_bonus=bonus))


def test_the_veto_bans_ruled_out_words_and_the_bonus_boosts_seen_ones_once():
    v = _vocab()
    ev = _dog_and_cat(v)
    assert ev.ruled_out[0, v.stoi["cat"]] and ev.ruled_out[1, v.stoi["dog"]] and ev.ruled_out[1, v.stoi["puppy"]]
    assert not ev.ruled_out[0, v.stoi["dog"]] and not ev.ruled_out[1, v.stoi["cat"]]
    assert not ev.ruled_out[:, v.stoi["man"]].any()
    b = evidence_bias(ev, torch.tensor([0, 1]), torch.zeros(2, 0, dtype=torch.long))  # (2, V) before any word
    assert b[0, v.stoi["dog"]] == pytest.approx(1.8) and b[0, v.stoi["puppy"]] == pytest.approx(1.8)
    assert b[1, v.stoi["cat"]] == pytest.approx(1.2)
    assert b[ev.ruled_out].eq(0).all()  # the veto is no bias: a ruled-out category earns no bonus either
    assert b[:, v.stoi["man"]].eq(0).all() and b[:, v.stoi["a"]].eq(0).all()
    said_dog = torch.tensor([[v.stoi["a"], v.stoi["dog"]]])
    after = evidence_bias(ev, torch.tensor([0]), said_dog)  # once named, the bonus stops
    assert after[0, v.stoi["dogs"]] == 0


@pytest.mark.parametrize("bonus", [0.0, 2.0])
def test_decoding_never_scores_a_vetoed_word_above_minus_infinity(bonus):
    """Rules.scores: a word its row's photo rules out is -inf however likely the model finds it (a ban, as the other
    rules' bans); every other word keeps its log-probability plus its bonus (the rows of image 1, 0, 1)."""
    v = _vocab()
    ev = _dog_and_cat(v, bonus)
    rules = Rules(SpecialIds(v.stoi["<start>"], v.stoi["<end>"], v.stoi["<pad>"], v.stoi["<unk>"]),
                  DecodeConfig(evidence=True, block_salad=False), ev, Lexicon.of(v))
    images = torch.tensor([1, 0, 1])  # (N,)
    logits = torch.zeros(3, len(v))
    logits[:, v.stoi["dog"]] = 50.0  # the model all but certain of "dog", on every row
    scores = rules.scores(logits, torch.zeros(3, 0, dtype=torch.long), rules.start(3), images)  # (3, V)
    assert torch.equal(torch.isneginf(scores[:, 4:]), ev.ruled_out[images][:, 4:])  # <pad>, <start>, <unk> besides
    want = torch.log_softmax(logits, 1) + evidence_bias(ev, images, torch.zeros(3, 0, dtype=torch.long))
    allowed = ~ev.ruled_out[images]
    assert torch.equal(scores[:, 4:][allowed[:, 4:]], want[:, 4:][allowed[:, 4:]])


def test_a_taught_word_inherits_its_source_words_evidence():
    v = Vocab(_vocab().itos + ["zoober", "zoobers", "dude"], {"zoober": "dog", "zoobers": "zoober", "dude": "man"})
    assert v.source("zoobers") == "dog" and v.source("dog") == "dog"  # aliases followed to the end
    m = word_categories(v)
    assert torch.equal(m[v.stoi["zoober"]], m[v.stoi["dog"]]) and torch.equal(m[v.stoi["zoobers"]], m[v.stoi["dog"]])
    assert m[v.stoi["zoober"]].sum() == 1 and m[v.stoi["dude"]].sum() == 0
    assert word_categories(_vocab()).shape[0] == len(_vocab())  # the cache tells vocabularies apart
    probs = torch.zeros(2, len(CATEGORIES))
    probs[0, CATEGORIES.index("dog")] = 0.9  # image 0: a dog; image 1: no dog
    ev = Evidence(probs, m, DecodeConfig(evidence=True, evidence_floor=0.05, evidence_bonus=2.0))
    b = evidence_bias(ev, torch.tensor([0, 1]), torch.zeros(2, 0, dtype=torch.long))  # (2, V)
    for w in ("zoober", "zoobers"):  # what supports "dog" supports its twin; what rules "dog" out rules it out
        assert torch.equal(b[:, v.stoi[w]], b[:, v.stoi["dog"]]) and b[0, v.stoi[w]] > 0
        assert torch.equal(ev.ruled_out[:, v.stoi[w]], ev.ruled_out[:, v.stoi["dog"]]) and ev.ruled_out[1, v.stoi[w]]
    after = evidence_bias(ev, torch.tensor([0]), torch.tensor([[v.stoi["a"], v.stoi["zoober"]]]))
    assert after[0, v.stoi["dog"]] == 0  # saying the twin names the category: no bonus for "dog" after it


def test_the_veto_reads_the_detector_named_after_a_category_too():
    """A horse the ImageNet head misses (P .001) but the horse detector sees (.9) is not ruled out; a category
    neither sees stays ruled out; categories without a detector of their name keep the head's P."""
    from captioner.concepts.detectors import WordDetectors
    from captioner.decoding.rules import detected_probs

    det = WordDetectors(["person", "horse"], 4)
    probs = torch.full((2, len(CATEGORIES)), 0.001)
    detections = torch.tensor([[0.5, 0.9], [0.5, 0.002]])  # (B, K): photo 0 shows a horse, photo 1 none
    seen = detected_probs(probs, det, detections)
    horse = CATEGORIES.index("horse")
    assert seen[0, horse] == pytest.approx(0.9) and seen[1, horse] == pytest.approx(0.002)  # the larger of the two
    assert torch.equal(seen[:, :horse], probs[:, :horse]) and detected_probs(probs, None, None) is probs
    v = Vocab(_vocab().itos + ["horse", "stallion"], {"stallion": "horse"})
    ev = Evidence(probs, word_categories(v), DecodeConfig(evidence=True, evidence_floor=0.05), seen=seen)
    assert ev.ruled_out[0, v.stoi["stallion"]] == 0 and ev.ruled_out[1, v.stoi["stallion"]] == 1
    assert ev.ruled_out[0, v.stoi["dog"]] == 1  # no dog detector here: the head's P rules it out


@pytest.mark.slow
def test_the_detectors_veto_is_stored_with_the_model_and_off_for_files_that_predate_it(bundled, tmp_path, monkeypatch):
    """decode.evidence_detectors: on for files written now (the own-photos recipe's exports), off for files that
    predate the setting (the bundled model decodes as it always has); it decides whether the veto asks them."""
    import dataclasses

    from captioner.checkpoint import load_checkpoint
    from captioner.decoding.rules import photo_evidence

    assert bundled.config.decode.evidence_detectors is False and DecodeConfig().evidence_detectors is True
    photo = bundled.read("captioner/assets/examples/cat.jpg")
    reading, vocab, model = photo.reading, bundled.vocab, bundled.model
    # detectors that see every category: with the setting on nothing but person words can be ruled out
    monkeypatch.setattr("captioner.decoding.rules.detected_probs", lambda probs, det, seen: torch.ones_like(probs))
    on = photo_evidence(reading, model, vocab, dataclasses.replace(bundled.config.decode, evidence_detectors=True))
    off = photo_evidence(reading, model, vocab, bundled.config.decode)
    assert (on.ruled_out <= off.ruled_out).all() and (on.ruled_out < off.ruled_out).any()  # detectors lift vetoes
    out = tmp_path / "m.safetensors"
    bundled.save(out)
    assert load_checkpoint(out).config.decode.evidence_detectors is False  # stored as it was loaded


def test_a_taught_words_category_asks_its_detector_even_where_the_file_does_not(bundled, monkeypatch):
    """The bundled file decodes without decode.evidence_detectors, and its head misses many a horse: a model taught
    "stallion" from it said the word only on the 9 of 20 held-out horses where the bundled model said "horse". The
    category of a taught word (and so its source word) now asks the detector of its name; every other category
    stays as the file decodes it, so photos without the taught thing keep their captions."""
    from captioner.decoding.rules import photo_evidence

    reading, model, settings = bundled.read(EXAMPLES / "cat.jpg").reading, bundled.model, bundled.config.decode
    monkeypatch.setattr("captioner.decoding.rules.detected_probs", lambda probs, det, seen: torch.ones_like(probs))
    taught = Vocab([*bundled.vocab.itos, "stallion"], {"stallion": "horse"})
    plain, ev = photo_evidence(reading, model, bundled.vocab, settings), photo_evidence(reading, model, taught, settings)
    horse, old = [taught.stoi[w] for w in ("stallion", "horse")], len(bundled.vocab)
    assert plain.ruled_out[0, taught.stoi["horse"]] == 1  # the head rules a horse out of the cat photo ...
    assert (ev.ruled_out[0, horse] == 0).all()  # ... its detector (here: sees everything) lets both words in
    others = word_categories(bundled.vocab)[:, CATEGORIES.index("horse")] == 0  # every word but horse, pony ...
    assert torch.equal(ev.ruled_out[:, :old][:, others], plain.ruled_out[:, others])  # nothing else changes


def test_a_word_taught_from_a_person_word_is_a_person_word():
    from captioner.concepts.detectors import WordDetectors
    from captioner.decoding.rules import person_word_mask
    v = Vocab(_vocab().itos + ["dude"], {"dude": "man"})
    mask = person_word_mask(v, WordDetectors(["person", "dog"], 4))
    assert mask[v.stoi["dude"]] == 1 and mask[v.stoi["man"]] == 1 and mask[v.stoi["dog"]] == 0


def test_evidence_is_off_unless_asked_and_changes_only_object_words(bundled):
    assert DecodeConfig().evidence is False  # old model files decode as before
    plain = bundled.caption(EXAMPLES / "coffee.jpg", evidence=False)
    assert plain.concepts[0][0] == "cup" and plain.concepts[0][1] > 0.5  # the head sees a cup
    seen = bundled.caption(EXAMPLES / "coffee.jpg", evidence=True, evidence_bonus=15.0)
    assert "dog" not in seen.words and "cup" in seen.words
    cat = bundled.caption(EXAMPLES / "cat.jpg", evidence=True, evidence_bonus=15.0)
    assert "cat" in cat.words
    assert all(abs(a.sum() - 1) < 1e-4 for a in seen.alphas)  # every word still has its map


def test_batched_evidence_equals_one_by_one(bundled):
    """Each image's bias follows it through the batch (images leave the batch as they finish)."""
    s = dataclasses.asdict(dataclasses.replace(bundled.config.decode, evidence=True, evidence_bonus=10.0))
    photos = [EXAMPLES / n for n in ("cat.jpg", "coffee.jpg", "astronaut.jpg")]
    for beam in (1, 3):
        batch = bundled.caption_batch(photos, **{**s, "beam_size": beam})
        for p, c in zip(photos, batch):
            assert bundled.caption(p, **{**s, "beam_size": beam}).words == c.words


def test_evidence_is_built_once_per_decode_batch(bundled, monkeypatch):
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

    def table(itos, categories, *taught):
        builds["table"] += categories == tuple(CATEGORIES)
        return real_table(itos, categories, *taught)

    monkeypatch.setattr(Evidence, "__init__", init)
    monkeypatch.setattr(words_module, "_word_categories", table)
    photos = [EXAMPLES / n for n in ("cat.jpg", "coffee.jpg", "astronaut.jpg")]
    read = bundled.read_batch(photos)
    for evidence in (True, False):  # contradicted words are marked with or without evidence-aware decoding
        for ask in (lambda: read[0].caption(evidence=evidence),
                    lambda: caption_photos(bundled, read, evidence=evidence),
                    lambda: read[1].explain("a dog and a cat", evidence=evidence)):
            builds.update(evidence=0, table=0)
            ask()
            assert builds == {"evidence": 1, "table": 1}, builds


def test_the_latency_benchmark_times_the_products_caption(bundled):
    """bench/breakdown.py's two halves make the very caption Captioner.caption() returns (person floor included)."""
    from captioner.bench.breakdown import caption_stages

    settings = bundled.decode_settings()
    assert settings.person_floor > 0 and settings.evidence  # the stored settings the benchmark times
    for name in ("cat.jpg", "coffee.jpg", "astronaut.jpg"):
        feats = bundled.read(EXAMPLES / name).features  # (1, P, D)
        decoding, concepts = caption_stages(bundled, feats, settings)
        timed = concepts(decoding())[0]
        product = bundled.caption(EXAMPLES / name)
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


def test_one_caption_computes_its_ruled_out_words_once(bundled, monkeypatch):
    """A photo's ruled-out words (category and person words alike) come from one call per caption: photo_evidence's
    Evidence holds them for decoding, the caption's contradicted words and the choice."""
    import sys
    from pathlib import Path

    import captioner
    from captioner.decoding import rules as evidence

    calls = []
    real = evidence.ruled_out_words
    monkeypatch.setattr(evidence, "ruled_out_words", lambda *a, **k: calls.append(1) or real(*a, **k))
    outer = []

    def profile(frame, event, arg):  # every outermost call of a function named *ruled_out* in the package
        def named(f) -> bool:
            return "ruled_out" in f.f_code.co_name and "/captioner/" in f.f_code.co_filename

        if event == "call" and named(frame):
            f = frame.f_back
            while f is not None and not named(f):
                f = f.f_back
            if f is None:
                outer.append(frame.f_code.co_name)
    photo = bundled.read(Path(captioner.__file__).parent / "assets" / "examples" / "cat.jpg")
    sys.setprofile(profile)
    try:
        photo.caption()
    finally:
        sys.setprofile(None)
    assert len(calls) == 1 and len(outer) == 1, outer
