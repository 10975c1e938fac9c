"""How sure a caption is (captioner/decoding/confidence.py) and its fit (captioner/evaluation/confidence_fit.py):
confidence lies in [0, 1] and rises with each signal its map weighs up, the fit recovers a known relation and judges
it honestly (AUROC, calibration, coverage), the threshold covers what it promises, and every place a caption
appears says how sure it is, or, for a file without a fitted map, that it cannot say."""
from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest
import torch

import captioner
from captioner.config import DecodeConfig
from captioner.decoding.captions import Caption
from captioner.decoding.confidence import FALLBACK_REASONS, GOOD_CIDER, SIGNALS, ConfidenceMap, needs, why_unsure
from captioner.decoding.resources import Fitted
from captioner.evaluation.confidence_fit import Row, auroc, calibration_error, coverage, fit, out_of_fold, threshold
from captioner.ui.texts import NO_CONFIDENCE, sure_line

from .conftest import need_bundled, run

EXAMPLES = sorted((Path(captioner.__file__).parent / "assets" / "examples").glob("*.jpg"))


def _signals(**values: float) -> dict[str, float]:
    return {s: values.get(s, 0.0) for s in SIGNALS}


def _rows(n: int, seed: int = 0) -> list[Row]:
    """Rows whose CIDEr is good with probability sigmoid(4 wide - 2), the other signals noise."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        sig = {s: rng.gauss(0, 1) for s in SIGNALS}
        good = rng.random() < 1 / (1 + math.exp(-(4 * sig["wide"] - 2)))
        out.append(Row(sig, 0.9 if good else 0.1, not good))
    return out


def test_confidence_lies_in_0_1_and_rises_with_each_weighed_signal():
    fitted = ConfidenceMap(-1.0, tuple(0.1 * (i + 1) * (-1) ** i for i in range(len(SIGNALS))), 0.5)
    base = _signals(wide=0.3, nearest=0.8, length=2)
    for s, w in zip(SIGNALS, fitted.weights):
        lo, hi = fitted({**base, s: base[s] - 1.0}), fitted({**base, s: base[s] + 1.0})
        assert 0.0 <= lo <= 1.0 and 0.0 <= hi <= 1.0
        assert (hi > lo) == (w > 0), s
    for extreme in (-1e6, 1e6):  # far outside any val photo's signals: still a probability, no overflow
        assert 0.0 <= fitted({**base, "wide": extreme}) <= 1.0


def test_the_fit_finds_the_signal_that_carries_the_truth_and_stores_it():
    fitted = fit(_rows(800))
    w = dict(zip(SIGNALS, fitted.weights))
    assert w["wide"] > 2.0 and all(abs(v) < 0.5 for s, v in w.items() if s != "wide"), w
    stored = Fitted.from_json(json.loads(json.dumps({"confidence": fitted.rounded().to_json()})))  # as a file holds it
    again = stored.map_in_use(DecodeConfig())
    row = _signals(wide=0.7, margin=0.2)
    assert abs(again(row) - fitted(row)) < 1e-4
    assert stored.map_in_use(DecodeConfig(fitted_confidence=False)) is None  # switched off: no confidence
    assert Fitted().map_in_use(DecodeConfig()) is None  # no fitted map: no confidence
    for bad in ({"bias": 0.0, "weights": {}, "sure_at": 1.5}, {"bias": "high", "weights": {}, "sure_at": 0.5},
                {"bias": 0.0, "weights": {"luck": 1.0}, "sure_at": 0.5}, {"bias": 0.0, "weights": {}}):
        with pytest.raises(ValueError, match="x.safetensors: its fitted data is unusable"):
            Fitted.from_json({"confidence": bad}, "x.safetensors")


def test_out_of_fold_confidence_separates_and_is_calibrated():
    rows = _rows(900, seed=1)
    conf = out_of_fold({"a": rows[:600], "b": rows[600:]})
    everything = conf["a"] + conf["b"]
    good = [r.cider >= GOOD_CIDER for r in rows]
    assert auroc(everything, good) > 0.8
    assert calibration_error(everything, good) < 0.08
    table = coverage(everything, rows)
    assert table["50%"]["CIDEr"] > table["100%"]["CIDEr"]  # the surest half is better than all
    assert table["50%"]["CHAIR-s"] < table["100%"]["CHAIR-s"]


def test_auroc_and_calibration_are_what_they_say():
    assert auroc([0.9, 0.8, 0.2, 0.1], [True, True, False, False]) == 1.0
    assert auroc([0.1, 0.2, 0.8, 0.9], [True, True, False, False]) == 0.0
    assert auroc([0.5, 0.5], [True, False]) == 0.5  # a tie counts half
    assert math.isnan(auroc([0.3], [True]))
    assert calibration_error([0.25] * 4, [True, False, False, False]) == 0.0
    assert abs(calibration_error([0.95] * 2, [False, False]) - 0.95) < 1e-12


def test_the_threshold_is_the_lowest_at_which_sure_captions_are_good_85_percent_of_the_time():
    """sure_at: at or above 60%, the lowest threshold at which the sets' sure captions are good (CIDEr-D >= .5) at
    least 85% of the time out of fold, each set weighed alike; 1.0 where none is."""
    rng = random.Random(0)
    conf = {name: [rng.random() for _ in range(400)] for name in ("a", "b")}
    rows = {name: [Row({s: 0.0 for s in SIGNALS}, 1.0 if rng.random() < c ** lift else 0.0, False)
                   for i, c in enumerate(cs)] for (name, cs), lift in zip(conf.items(), (0.5, 1.0))}

    def precision(name: str, at: float) -> float:
        sure = [r.cider >= 0.5 for c, r in zip(conf[name], rows[name]) if c >= at]
        return sum(sure) / len(sure)

    at = threshold(conf, rows)
    assert at >= 0.6 and (precision("a", at) + precision("b", at)) / 2 >= 0.85
    below = max((c for c in conf["a"] + conf["b"] if 0.6 <= c < at), default=None)
    assert below is None or (precision("a", below) + precision("b", below)) / 2 < 0.85  # no higher than it must be
    assert threshold({"a": [0.9, 0.95]}, {"a": rows["a"][:2]}, precision=1.01) == 1.0  # none: nothing is sure


def _caption(confidence: float | None, sure_at: float = 0.5, **signals: float) -> Caption:
    import numpy as np

    return Caption("a dog on the grass", ["a", "dog", "on", "the", "grass"], np.zeros((5, 1, 1)), -3.0,
                   [("a cat on the grass", -3.5)], confidence=confidence,
                   sure_signals=_signals(**{"nearest": 0.9, "agreement": 6.0, "wide": 0.5, **signals}),
                   settings=dataclasses.asdict(DecodeConfig()), sure_at=sure_at)


def test_a_caption_says_how_sure_and_why_not():
    sure, unsure, none = _caption(0.8), _caption(0.2, agreement=1.0), _caption(None)
    assert sure.sure is True and sure.doubt is None
    assert unsure.sure is False and "a cat on the grass" in unsure.doubt  # it hesitated between the two
    assert none.sure is None and none.doubt is None
    for cap in (sure, unsure, none):
        d = cap.to_dict("x.jpg", maps=False)
        assert {"confidence", "sure"} <= d.keys() and d["sure"] == cap.sure
    assert none.to_dict()["confidence"] is None  # never an invented number
    assert sure_line(None, None, None) == NO_CONFIDENCE
    said = sure_line(0.2, unsure.level, unsure.doubt)
    assert said.startswith("Probably wrong (20% likely") and unsure.doubt in said
    assert sure_line(0.8, "sure", None).startswith("Sure: 80% likely")


def test_sure_only_at_60_percent_and_plain_levels_below():
    """A caption is sure only at the file's sure_at and never below 60% (a file that stores .37 included: "Sure:
    43% likely" read as a contradiction); below, its level says what to do: probably right from 50%, may be wrong
    from 30%, probably wrong under it. The JSON says the level too."""
    from captioner.decoding.confidence import SURE_FLOOR, level

    for sure_at in (0.3709, 0.6, 0.72):
        for c in (0.0, 0.29, 0.3, 0.43, 0.5, 0.59, 0.6, 0.7, 0.72, 0.9, 1.0):
            cap = _caption(c, sure_at=sure_at)
            assert cap.sure == (c >= max(sure_at, SURE_FLOOR)) and (cap.level == "sure") == cap.sure
            if cap.sure:
                assert cap.confidence >= 0.6
            else:
                want = "probably right" if c >= 0.5 else "may be wrong" if c >= 0.3 else "probably wrong"
                assert cap.level == want and cap.doubt
                assert sure_line(c, cap.level, cap.doubt).startswith(want.capitalize())
            assert cap.to_dict(maps=False)["level"] == cap.level
    assert level(0.43, 0.3709) == "may be wrong" and _caption(None).level is None
    assert why_unsure(_signals(nearest=0.5), None).startswith("few photos like this one")


def test_the_shown_number_and_the_level_agree_at_every_band_edge():
    """One number, one level: the app's percentage, the CLI's column and the CSV's confidence are the same rounded
    number (confidence.shown), and the level is that number's band: .4953 is "probably right (50% ...)", .2974 "may
    be wrong (30% ...)", never "may be wrong (50% ...)"; the sure threshold is read the same way."""
    import csv
    import io
    import re

    from captioner.cli.caption import sure_column
    from captioner.ui.gallery import batch_csv

    def band(pct: int, sure_at: float) -> str:  # the documented bands, in whole percents as a person reads them
        if pct >= math.ceil(100 * max(sure_at, 0.6) - 1e-9):
            return "sure"
        return "probably right" if pct >= 50 else "may be wrong" if pct >= 30 else "probably wrong"

    edges = [0.2949, 0.295, 0.2974, 0.3049, 0.4949, 0.495, 0.4953, 0.5049, 0.5949, 0.595, 0.6049, 0.7249, 0.725,
             0.7311, 0.7312, 0.7349, 0.735, 0.7351]
    for sure_at in (0.5, 0.6, 0.7312):
        for c in edges:
            cap = _caption(c, sure_at=sure_at, agreement=1.0)
            pct = int(re.search(r"(\d+)% likely", sure_line(cap.confidence, cap.level, cap.doubt)).group(1))
            assert cap.level == band(pct, sure_at), (c, sure_at, pct, cap.level)
            column = sure_column(cap).strip()
            assert column.startswith(f"{cap.level} {pct / 100:.2f}"), (c, column)
            row = list(csv.reader(io.StringIO(batch_csv([("a.jpg", cap)]).decode("utf-8"))))[1]
            assert row[3] == f"{pct / 100:.2f}" and row[5] == cap.level
    assert _caption(0.4953).level == "probably right" and _caption(0.2974).level == "may be wrong"
    assert _caption(0.4949).level == "may be wrong" and _caption(0.2949).level == "probably wrong"


def _fitted_map() -> ConfidenceMap:
    """A map that weighs the wide consensus up (sure where people say such things of photos like it)."""
    return ConfidenceMap(-1.0, tuple(4.0 if s == "wide" else 0.0 for s in SIGNALS), 0.5)


def test_the_bundled_model_gives_a_confidence_from_its_signals(bundled):
    """With a map in the model file's fitted data every caption of a photo carries confidence and sure (at the
    map's sure_at, never below 60%); with decode.fitted_confidence=false, none."""
    own = bundled.resources
    mapped = captioner.Captioner(bundled.model, bundled.vocab, bundled.config, memory=own.memory,
                                 fitted=dataclasses.replace(own.fitted, confidence=_fitted_map()))
    photo = mapped.read(EXAMPLES[0])
    cap = photo.caption()
    assert 0.0 <= cap.confidence <= 1.0 and cap.sure_at == 0.5 and cap.sure == (cap.confidence >= 0.6)  # the floor
    # only what the map weighs is computed (and the gate's and the fallback reason's): never the other signals
    assert set(cap.sure_signals) == set(needs(_fitted_map())) == {"wide", "unsupported", *FALLBACK_REASONS}
    assert 0.0 < cap.sure_signals["nearest"] <= 1.0 + 1e-6
    assert abs(cap.confidence - 1 / (1 + math.exp(1.0 - 4.0 * cap.sure_signals["wide"]))) < 1e-9
    weighs_template = ConfidenceMap(-1.0, tuple(4.0 if s in ("wide", "template") else 0.0 for s in SIGNALS), 0.5)
    other = captioner.Captioner(bundled.model, bundled.vocab, bundled.config, memory=own.memory,
                                fitted=dataclasses.replace(own.fitted, confidence=weighs_template))
    templated = other.read(EXAMPLES[0]).caption()
    assert "template" in templated.sure_signals and "template" not in cap.sure_signals  # a weight gets its signal
    assert templated.text == cap.text
    plain = photo.caption(fitted_confidence=False)
    assert plain.confidence is None and plain.sure is None
    assert plain.text == cap.text  # how sure never changes the caption


@pytest.mark.slow
def test_every_json_line_carries_confidence_and_sure(tmp_path):
    """captioner-caption --json: the keys on every line; the text output says it in its last column; a file
    without a map says so once on stderr."""
    need_bundled()
    out = run("scripts/caption.py", *map(str, EXAMPLES[:2]), "--json")
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert len(lines) == 2 and all({"confidence", "sure", "level"} <= x.keys() for x in lines)
    if captioner.load().resources.fitted.confidence is None:
        assert out.stderr.count("no fitted confidence map") == 1
        assert all(x["confidence"] is None for x in lines)
    else:
        assert all(0 <= x["confidence"] <= 1 and isinstance(x["sure"], bool) for x in lines)
        assert all(x["level"] in ("sure", "probably right", "may be wrong", "probably wrong") for x in lines)
        text = run("scripts/caption.py", str(EXAMPLES[0]))
        assert text.stdout.split("\t")[2].startswith(("sure ", "probably right ", "may be wrong ", "probably wrong "))


def test_evaluate_coverage_reports_the_surest_shares_or_says_why_not():
    """captioner-evaluate --coverage: per-photo CIDEr-D and CHAIR beside each caption's confidence -> the coverage
    table, AUROC and calibration; captions without a confidence -> None and one line that says why."""
    from captioner.cli.evaluate import coverage_report
    from captioner.data.records import ImageRecord
    from captioner.evaluation.metrics import java_available

    if not java_available():
        pytest.skip("no Java: pycocoevalcap's PTB tokenizer (captioner-evaluate's scores) needs it")
    refs = {"1": ["a dog runs on the grass", "a brown dog on grass"], "2": ["a cat sits on a sofa", "a cat on a couch"],
            "3": ["a man rides a bike", "a person on a bicycle"], "4": ["two birds on a wire", "birds sit on a wire"]}
    texts = {"1": "a dog runs on the grass", "2": "a cat sits on a sofa", "3": "a pizza on a table", "4": "a cat on a bed"}
    records = [ImageRecord(i, Path(f"{i}.jpg"), r) for i, r in refs.items()]
    said = []
    caps = [_caption(None) for _ in records]
    assert coverage_report(caps, records, None, said.append) is None and "not measured" in said[0]
    caps = []
    for i, conf in zip(refs, (0.9, 0.8, 0.2, 0.1)):  # sure of the two right ones
        caps.append(dataclasses.replace(_caption(conf), text=texts[i], words=texts[i].split()))
    out = coverage_report(caps, records, None, said.append)
    assert out["AUROC good"] == 1.0 and out["sure"]["share"] == 0.5
    assert out["coverage"]["50%"]["CIDEr"] > out["coverage"]["100%"]["CIDEr"]
    assert out["coverage"]["50%"]["CHAIR-s"] == 0.0 < out["coverage"]["100%"]["CHAIR-s"]  # the pizza and the cat
    assert any(line.startswith("coverage") for line in said) and any("AUROC" in line for line in said)


def test_the_bundled_file_calls_sure_only_what_is_good_85_percent_of_the_time_on_val(bundled):
    """The bundled file's sure_at is the one chosen on val (out of fold, sure captions good 85% of the time), above
    the 60% floor: "Sure: 43% likely" is never said; the README's astronaut (wrong) is not sure, and neither is the
    cat, confident as it is: the photo is a close-up of its face and there is no wall (the objects check)."""
    from captioner.decoding.confidence import SURE_FLOOR

    sure_at = bundled.resources.fitted.confidence.sure_at
    assert SURE_FLOOR <= sure_at < 0.8
    astronaut, cat = bundled.caption_batch(EXAMPLES[:2])  # (sorted by name)
    assert cat.confidence >= sure_at and cat.sure is False and cat.level == "probably right"
    assert [cat.words[i] for i in cat.unsupported] == ["wall"] and cat.doubt == "it is not sure there is a wall"
    assert astronaut.sure is False and astronaut.level in ("may be wrong", "probably wrong", "probably right")
