"""The objects check and the reasons of an unsure caption (captioner/decoding/confidence.py, captions.py different, the
reasons of confidence.why_unsure, evaluation/judged.py): an object the heads barely see lowers the confidence of a
map that weighs it and is named first; otherwise the reason is the signal that lowered the confidence most; the
alternatives shown differ in what they name; a map stored without means still loads and gives today's reasons."""
from __future__ import annotations

import dataclasses

import json
import random

import numpy as np
import torch

from captioner.decoding.captions import different, things
from captioner.decoding.captions import Alternative, Caption
from captioner.decoding.choice import SIGNALS as CHOICE_SIGNALS
from captioner.decoding.choice import Decision, Neighbours, Weights
from captioner.decoding.confidence import REASONS, SIGNALS, ConfidenceMap, judge, why_unsure
from captioner.decoding.resources import Fitted
from captioner.decoding.device_beam import Hypothesis
from captioner.decoding.choice import Pool
from captioner.decoding.confidence import SUPPORT_FLOOR, objects_check, template
from captioner.decoding.reading import HeadReading
from captioner.evaluation.judged import crosstab, matched, photo_key
from captioner.vocab import Vocab

WORDS = ["<pad>", "<start>", "<end>", "<unk>", "a", "man", "cake", "on", "plate", "in", "red", "shirt", "dog"]
CATEGORIES = ("cake", "dog", "dining table")  # a hand-made table: cake, dog, and plate as "dining table"


class People:
    """Word detectors as the check reads them: groups and their words."""

    groups = ["person", "shirt"]
    members = {"person": ("man", "men", "woman"), "shirt": ("shirt", "shirts")}


def _check(p_cake: float, p_person: float = 0.9):
    vocab = Vocab(WORDS)
    cats = torch.zeros(len(WORDS), len(CATEGORIES))  # (V, C)
    cats[WORDS.index("cake"), 0] = cats[WORDS.index("dog"), 1] = cats[WORDS.index("plate"), 2] = 1
    probs = torch.tensor([[p_cake, 0.02, 0.7]])  # (1, C)
    seen = torch.tensor([[p_person, 0.05]])  # (1, K)
    return objects_check(HeadReading(None, probs, seen, 1), People(), vocab, cats), probs


def _tokens(text: str) -> list[int]:
    return [WORDS.index(w) for w in text.split()]


def _sure_signals(text: str, p_cake: float, others: tuple[str, ...] = ()) -> dict[str, float]:
    check, probs = _check(p_cake)
    hyp = Hypothesis(_tokens(text), torch.zeros(0), -3.0, -0.5, word_logps=torch.full((len(text.split()),), -0.5))
    hyps = [hyp] + [Hypothesis(_tokens(o), torch.zeros(0), -4.0, -0.6) for o in others]
    pool = Pool.of([hyps], len(WORDS), least=1)
    n = len(pool)
    x = torch.zeros(n, len(CHOICE_SIGNALS), dtype=torch.float64)  # (N, S) the candidates' choice signals
    x[:, CHOICE_SIGNALS.index("log_prob")] = -0.5
    cider = torch.tensor([[0.4, 0.4, 5.0]] * n, dtype=torch.float64)  # (N, 3) consensus, wide, agreement
    total = torch.zeros(n, dtype=torch.float64)  # (N,) the first chosen, 0.1 over the next
    total[0] = 0.1
    decision = Decision(pool, x, total, torch.arange(n), torch.tensor([0]), torch.tensor([min(1, n - 1)]),
                        Weights.from_json({"score": 1.0, "wide": 1.0}))
    near = Neighbours([[0]], torch.tensor([[0.7]], dtype=torch.float64), 1)
    judged = judge(decision, near, cider, probs.double(), None, None, check, Vocab(WORDS), None)  # every signal
    return dict(zip(SIGNALS, judged.signals[0].tolist()))


def test_each_object_word_is_supported_by_the_strongest_head_that_sees_it():
    check, _ = _check(p_cake=0.03)
    tokens = _tokens("a man in a red shirt on a plate with a cake".replace(" with", "").replace("a cake", "cake"))
    assert [WORDS[t] for t in tokens if check.columns.any(1)[t]] == ["man", "shirt", "plate", "cake"]  # not "a", "red"
    support = {w: float(check.support[0, WORDS.index(w)]) for w in ("man", "shirt", "plate", "cake")}
    assert abs(support["man"] - 0.9) < 1e-6 and abs(support["plate"] - 0.7) < 1e-6  # person detector; the head
    weak = check.unsupported([tokens])[0]
    assert [WORDS[tokens[i]] for i in weak] == ["cake", "shirt"]  # least supported first
    assert all(support[WORDS[tokens[i]]] < SUPPORT_FLOOR for i in weak)
    assert check.unsupported([[]]) == [[]]  # a caption of no words names nothing


def test_an_unsupported_object_lowers_the_confidence_and_is_named_first():
    there, absent = _sure_signals("a man on a plate cake", 0.8), _sure_signals("a man on a plate cake", 0.01)
    assert there["support"] > absent["support"] and absent["unsupported"] == 1 and there["unsupported"] == 0
    means = {s: 0.0 for s in SIGNALS}
    weighs = ConfidenceMap.from_json({"bias": 0.0, "sure_at": 0.7, "means": means,
                                      "weights": {"wide": 2.0, "support": 3.0, "unsupported": -1.0}})
    assert weighs(absent) < weighs(there)
    # the reason: the unsupported object first, though another signal lowered the confidence more
    contributions = weighs.contributions({**absent, "wide": -5.0})
    assert min(contributions, key=contributions.get) == "wide"
    assert why_unsure(absent, "a dog", contributions, ["cake"]) == "it is not sure there is a cake"
    cap = Caption("a man on a plate cake", "a man on a plate cake".split(), np.zeros((6, 1, 1)), -3.0,
                  confidence=weighs(absent), sure_signals=absent, sure_at=0.7, contributions=contributions,
                  unsupported=[5], unseen=[5])
    assert cap.sure is False and cap.doubt == "it is not sure there is a cake"
    # barely seen (support .1-.2), not unseen: never sure, but the reason does not claim the cake may be missing
    # (on the graded captions such an object was there 85% of the time); it says what else it found
    seen = dataclasses.replace(cap, unseen=[])
    assert seen.sure is False and "cake" not in seen.doubt and seen.doubt
    # however confident: a caption naming an object the heads barely see is never sure; its level says so
    confident = dataclasses.replace(cap, confidence=0.99)
    assert confident.sure is False and confident.level == "probably right"
    assert confident.doubt == "it is not sure there is a cake"
    # sure but for an object the heads barely see: that is the reason, named, without claiming it is missing
    barely = dataclasses.replace(confident, unseen=[])
    assert barely.sure is False and barely.doubt == "the encoder barely sees a cake in this photo"
    assert why_unsure({}, None, None, barely=["dogs", "apple"]) == "the encoder barely sees dogs or an apple in this photo"
    assert why_unsure({}, None, None, ["cake"], barely=["dogs"]) == "it is not sure there is a cake"  # unseen first
    assert confident.to_dict(maps=False)["sure"] is False and dataclasses.replace(confident, unsupported=[]).sure
    assert cap.to_dict(maps=False)["unsupported_words"] == ["cake"]
    assert why_unsure({}, None, None, ["dogs", "cake"]) == "it is not sure there are dogs or a cake"


def test_the_reason_is_the_largest_negative_contribution():
    rng = random.Random(0)
    for _ in range(200):
        means = {s: rng.gauss(0, 1) for s in SIGNALS}
        weights = {s: rng.choice([0.0, rng.gauss(0, 2)]) for s in SIGNALS}
        m = ConfidenceMap.from_json({"bias": 0.1, "weights": weights, "sure_at": 0.7, "means": means})
        sig = {s: rng.gauss(0, 1) for s in SIGNALS}
        c = m.contributions(sig)
        assert set(c) == {s for s, w in weights.items() if w}
        assert all(abs(c[s] - weights[s] * (sig[s] - means[s])) < 1e-9 for s in c)
        if not c or min(c.values()) >= 0:
            continue
        worst = min(c, key=c.get)
        want = f"it hesitated between this and “a dog”" if worst == "agreement" else REASONS[worst]
        assert why_unsure(sig, "a dog", c) == want
    # nothing lowered it below the mean: the weak-signal rule speaks
    assert why_unsure({"nearest": 0.5}, None, {"wide": 0.3}).startswith("few photos like this one")


def test_alternatives_shown_for_an_unsure_caption_name_other_things():
    cap = "a white dog sitting on a plate"
    alts = ["a white dog sitting on top of a plate", "a white dog is sitting on a plate", "a white cat sitting on a plate",
            "a white dog sitting on a table", "a small white dog sitting on a plate", "a cat sitting on a plate"]
    shown = different(cap, alts)
    assert shown == ["a white cat sitting on a plate", "a white dog sitting on a table"]
    sets = [things(t) for t in [cap] + shown]
    assert len(set(sets)) == len(sets)  # every line shown names another set of things
    assert all(things(a) in sets for a in alts)  # and none left out names things not shown
    c = Caption(cap, cap.split(), np.zeros((6, 1, 1)), -3.0, [Alternative(a, -4.0) for a in alts])
    assert c.different_alternatives == shown and [a.text for a in c.alternatives] == alts  # alternatives untouched
    # where none names other things, those with another content word
    assert different(cap, ["a white dog sitting on top of a plate", "a white dog laying on a plate"]) == [
        "a white dog laying on a plate"]


def test_a_map_stored_without_means_still_loads_and_gives_the_old_reasons():
    old = {"confidence": {"bias": -0.113936, "weights": {"wide": 1.67347, "consensus": 1.49096, "log_prob": 1.39865},
                          "sure_at": 0.692609}}
    fitted = Fitted.from_json(json.loads(json.dumps(old)))
    assert fitted.confidence.means is None and fitted.confidence.contributions({s: 0.0 for s in SIGNALS}) == {}
    assert "means" not in fitted.to_json()["confidence"]  # re-exported as it was
    sig = {s: 0.0 for s in SIGNALS} | {"nearest": 0.5}
    assert why_unsure(sig, None, fitted.confidence.contributions(sig)).startswith("few photos like this one")
    means = dict.fromkeys(SIGNALS, 0.25)
    again = Fitted.from_json({"confidence": {**old["confidence"], "means": means}})
    assert again.confidence.to_json()["means"] == means and again.confidence.rounded().means == (0.25,) * len(SIGNALS)


def test_the_template_flag_and_judged_rows_matched_by_photo_and_caption():
    assert template("a little girl in a pink shirt is playing in the water") == 1.0
    assert template("a man in a red jacket") == 1.0 and template("a dog in the red grass") == 0.0
    assert photo_key("COCO_val2014_000000000074.jpg") == photo_key("74") == photo_key("000000000074.jpg") == "74"
    judged = [{"image": "COCO_val2014_000000000074.jpg", "caption": "a dog", "judged": "wrong"},
              {"image": "x", "caption": "a cat", "judged": "right"},
              {"image": "y", "caption": "a cow", "judged": "partly"}]
    pairs = matched(judged, [("74", "a dog", 0.8, True), ("x", "a cat", 0.9, True), ("y", "another caption", 0.1, True)])
    assert pairs == [("wrong", 0.8, True), ("right", 0.9, True)]  # another caption of photo y is not its grade's
    t = crosstab(pairs, 0.7)
    assert t["sure"] == 2 and t["wrong and sure"] == 1 and t["right and not sure"] == 0 and t["AUROC not wrong"] == 1.0
    # a caption naming an object the heads barely see is not sure, however confident (as a Caption's level)
    t = crosstab([("wrong", 0.8, False), ("right", 0.9, True), ("right", 0.95, False)], 0.7)
    assert t["sure"] == 1 and t["wrong and sure"] == 0 and t["right and not sure"] == 1


def test_a_reason_says_what_it_found_about_this_photo():
    """An unsure caption's reason names what it found (new user, round nine): the words the model found unlikely,
    named; how people described the most similar training photos, quoted; the caption it hesitated over; never only
    that a signal is weak while any of those is known."""
    import numpy as np

    from captioner.decoding.captions import Caption
    from captioner.decoding.confidence import why_unsure

    assert (why_unsure({}, None, {"consensus": -1.0}, described="a dog on a beach")
            == "the photos most like this one were described as “a dog on a beach”")
    assert why_unsure({}, None, {"log_prob": -1.0}, unlikely=["kite"]) == "the model found “kite” unlikely for this photo"
    assert why_unsure({}, "a cat on a wall", {"log_prob": 1.0}) == "it hesitated between this and “a cat on a wall”"
    assert "weaker" not in why_unsure({}, None, {"log_prob": 1.0}, unlikely=["kite"])
    assert (why_unsure({"nearest": 0.5}, None, {"wide": 0.3}, described="a cat on a mat")
            == "few photos like this one among those it learned from (the nearest: “a cat on a mat”)")
    words = ["a", "kite", "on", "a", "beach"]
    cap = Caption(" ".join(words), words, np.zeros((5, 1, 1)), -4.0, [],
                  word_log_probs=np.log([0.9, 0.05, 0.9, 0.9, 0.6]).astype(np.float32), confidence=0.2, sure_at=0.7,
                  contributions={"log_prob": -1.0, "consensus": -0.5}, described="a man flying a kite")
    assert cap.doubt == "the model found “kite” unlikely for this photo"  # "beach" (.6) is not named
    quoted = dataclasses.replace(cap, contributions={"log_prob": -0.5, "consensus": -1.0})
    assert quoted.doubt == "the photos most like this one were described as “a man flying a kite”"
