"""Visual word detectors (concepts/detectors.py, Fang et al. 2015): the noisy-OR's invariants, learning
person from a few dozen real Flickr8k photos, the model file round trip, the person veto in decoding and
the JSON that carries the detections."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import captioner
from captioner.checkpoint import CheckpointError, load_checkpoint
from captioner.concepts.detectors import (PERSON, WordDetectors, attach, caption_labels, detectors_of, group_members,
                                          noisy_or_logit)
from captioner.config import DecodeConfig
from captioner.decoding.rules import Evidence, word_categories
from captioner.training import detectors as T
from captioner.vocab import Vocab
from .rules_oracle import evidence_bias

EXAMPLES = captioner.DEFAULT_CHECKPOINT.parent / "examples"


def noisy_or(cell_scores: torch.Tensor) -> torch.Tensor:
    """q = 1 - prod_i (1 - sigmoid(s_i)) as the formula writes it (B, P, K) -> (B, K): what the stable logit
    of concepts/detectors.py must give."""
    return 1 - torch.prod(1 - torch.sigmoid(cell_scores.double()), dim=1).float()


def test_noisy_or_is_a_probability_at_least_the_best_cell_and_monotone():
    s = torch.randn(4, 81, 3) * 4  # (B, P, K)
    q = noisy_or(s)
    assert ((q >= 0) & (q <= 1)).all()
    assert (q >= torch.sigmoid(s).amax(1) - 1e-6).all()  # any cell alone would say at least this much
    assert torch.allclose(torch.sigmoid(noisy_or_logit(s)), q, atol=1e-5)  # the stable logit is the same q
    for cell in (0, 40, 80):  # raising any one cell's score never lowers P(word)
        up = s.clone()
        up[:, cell] += 1.0
        assert (noisy_or(up) >= q - 1e-7).all()


def test_one_hot_cell_gives_that_cells_probability():
    s = torch.full((1, 81, 1), -30.0)
    s[0, 17, 0] = 1.5  # one cell holds the word, the others certainly not
    assert noisy_or(s).item() == pytest.approx(torch.sigmoid(torch.tensor(1.5)).item(), abs=1e-6)
    assert noisy_or(torch.full((1, 81, 1), -30.0)).item() < 1e-9  # no cell: no word


def test_calibration_keeps_the_order_and_the_prior_is_required_when_used():
    det = WordDetectors([PERSON, "dog"], 8)
    det.weight.data.normal_()
    x = torch.randn(40, 9, 8)
    raw = det.raw_logit(x).detach()  # (40, 2)
    labels = (raw + torch.randn(40, 2) > raw.median(0).values).float()  # informative, not separable
    T.calibrate(det, raw, labels)
    p = det(x).detach()
    assert (det.scale > 0.05).all() and torch.equal(raw.argsort(0), p.argsort(0))  # Platt never reorders
    nll = torch.nn.functional.binary_cross_entropy
    assert nll(p, labels) < nll(torch.sigmoid(raw), labels)  # and fits the held-out labels better
    det.prior_weight[0] = 2.0
    with pytest.raises(ValueError, match="prior"):
        det(x)
    assert det(x, torch.zeros(40)).shape == (40, 2)


def test_caption_labels_use_every_word_of_the_group():
    members = group_members([PERSON, "dog", "water"])
    y = caption_labels([["Two girls play in a pool ."], ["A puppy runs ."], ["A brown dog ."]], members)
    assert y.tolist() == [[1, 0, 1], [0, 1, 0], [0, 1, 0]]
    assert {"man", "women", "children", "people", "boy", "player"} <= set(members[PERSON])


def _person_split(records, n: int):
    """n photos, half whose captions all name a person and half whose captions name none."""
    members = group_members([PERSON])
    y = caption_labels([r.captions for r in records], members)[:, 0]
    every = np.array([all(caption_labels([[c]], members)[0, 0] for c in r.captions) for r in records])
    pos = [r for r, e in zip(records, every) if e][: n // 2]
    neg = [r for r, lab in zip(records, y) if lab == 0][: n // 2]
    return pos + neg


@pytest.mark.slow
def test_detector_learnt_from_a_few_dozen_real_photos_separates_person(bundled, flickr, one_torch_thread):
    from captioner.data.flickr8k import load_flickr8k
    from captioner.evaluation.scoring import encode_records

    train = _person_split(load_flickr8k(flickr, "train")[:300], 48)
    held = _person_split(load_flickr8k(flickr, "val")[:200], 24)
    (xt, _), (xh, _) = (encode_records(bundled.model, rs, bundled.preprocess, "cpu", num_workers=0)
                        for rs in (train, held))
    members = group_members([PERSON])
    yt, yh = (caption_labels([r.captions for r in rs], members) for rs in (train, held))
    det = T.fit(WordDetectors([PERSON], xt.shape[-1]), xt, yt, T.FitSettings(epochs=15), log=lambda _: None)
    p = T.probabilities(det, xh)[:, 0].numpy()
    ap = T.average_precision(p, yh[:, 0].numpy())
    chance = float(yh.mean())  # a random ranking's expected AP
    assert ap > chance + 0.25, (ap, chance)


def _person_detector(model, bias: float) -> WordDetectors:
    """A person detector that is sure (bias >> 0) or that rules out a person (bias << 0) on any photo."""
    det = WordDetectors([PERSON, "water"], model.model.encoder.out_dim)
    det.bias.data.fill_(bias)
    return det


def _without_detectors() -> captioner.Captioner:
    """The bundled model as a file without word detectors (the former bundled file's kind) would load."""
    m = captioner.load()
    attach(m.model, None)
    m.config.decode.person_floor = 0.0
    return m


def test_model_file_round_trip_keeps_the_detectors_and_old_files_load(tmp_path):
    old = _without_detectors()
    old.save(tmp_path / "old.safetensors")
    back_old = captioner.load(tmp_path / "old.safetensors")  # a file without detectors loads as before
    assert detectors_of(back_old.model) is None and back_old.config.decode.person_floor == 0
    m = captioner.load()
    det = _person_detector(m, -1.0)
    det.weight.data.normal_(std=0.01)
    det.scale.fill_(1.7)
    det.prior_weight[0] = 3.0
    attach(m.model, det)
    m.config.decode.person_floor = 0.12
    m.save(tmp_path / "det.safetensors", half=True)
    back = captioner.load(tmp_path / "det.safetensors")
    got = detectors_of(back.model)
    assert got is not None and got.groups == [PERSON, "water"] and got.members == det.members
    for k, v in det.state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k  # float32 even in a --half file
    assert back.config.decode.person_floor == 0.12
    ckpt = load_checkpoint(tmp_path / "det.safetensors")
    assert not any(k.startswith("detectors.") for k in ckpt.model_state)  # init_from never sees them


def test_detector_tensors_without_their_description_are_refused(tmp_path):
    from captioner.checkpoint import read_safetensors, write_safetensors

    m = captioner.load()
    attach(m.model, _person_detector(m, 0.0))
    m.save(tmp_path / "det.safetensors")
    tensors, meta = read_safetensors(tmp_path / "det.safetensors")
    del meta["detectors"]
    write_safetensors(tmp_path / "bad.safetensors", tensors, meta)
    with pytest.raises(CheckpointError, match="detector"):
        load_checkpoint(tmp_path / "bad.safetensors")


def test_evidence_vetoes_person_words_below_the_floor():
    v = Vocab(["<pad>", "<start>", "<end>", "<unk>", "a", "man", "women", "dog", "runs"])
    det = WordDetectors([PERSON], 4)
    mask = torch.tensor([float(w in det.members[PERSON]) for w in v.itos])
    probs = torch.full((2, 61), 0.5)  # every seen category plausible: only the person evidence matters
    s = DecodeConfig(evidence=True, person_floor=0.2)
    ev = Evidence(probs, word_categories(v), s, (torch.tensor([0.05, 0.9]), mask))
    assert ev.ruled_out[0, v.stoi["man"]] and ev.ruled_out[0, v.stoi["women"]] and not ev.ruled_out[0, v.stoi["runs"]]
    assert not ev.ruled_out[1, v.stoi["man"]]  # P(person) above the floor: no veto
    b = evidence_bias(ev, torch.tensor([0, 1]), torch.zeros(2, 0, dtype=torch.long))
    assert b[:, v.stoi["man"]].eq(0).all()  # the veto is a ban, not a bias; person words get no bonus
    off = Evidence(probs, word_categories(v), dataclasses.replace(s, person_floor=0.0), (torch.tensor([0.05, 0.9]), mask))
    assert not off.ruled_out[0, v.stoi["man"]]


@pytest.mark.slow
def test_decoding_drops_person_words_the_detector_rules_out():
    m = _without_detectors()
    before = m.caption(EXAMPLES / "astronaut.jpg")
    people = set(WordDetectors([PERSON], 1).members[PERSON])
    assert people & set(before.words), before.text  # the Flickr8k prior names a person here
    with pytest.raises(ValueError, match="person_floor"):
        m.caption(EXAMPLES / "astronaut.jpg", person_floor=0.3)  # no detector in the file: said, not ignored
    attach(m.model, _person_detector(m, -30.0))  # P(person) ~ 0 on every photo
    vetoed = m.caption(EXAMPLES / "astronaut.jpg", person_floor=0.3)
    assert not people & set(vetoed.words), vetoed.text
    kept = m.caption(EXAMPLES / "astronaut.jpg", person_floor=0.0)  # floor off: the detector only informs
    assert kept.words == before.words
    said = m.caption(EXAMPLES / "astronaut.jpg", person_floor=0.3, evidence=False)  # not vetoed, but marked
    assert {said.words[i] for i in said.contradicted} >= people & set(said.words)


def test_caption_concepts_and_json_carry_the_detections():
    m = captioner.load()
    attach(m.model, _person_detector(m, 5.0))  # sure of a person (and of water) everywhere
    cap = m.caption(EXAMPLES / "cat.jpg")
    names = [c for c, _ in cap.concepts]
    assert "person" in names and "water" in names and "cat" in names
    assert [q for _, q in cap.concepts] == sorted((q for _, q in cap.concepts), reverse=True)
    rec = cap.to_dict(maps=False)
    assert {d["word"] for d in rec["detections"]} == {PERSON, "water"}
    assert any(c["category"] == "person" and c["prob"] > 0.99 for c in rec["concepts"])
    seen = m.concepts([EXAMPLES / "cat.jpg"])[0]
    assert seen.prob("person") > 0.99 and "person" in [c for c, _ in seen.top]


def test_export_keeps_the_detectors(tmp_path):
    from captioner.cli.export import main as export

    m = captioner.load()
    det = _person_detector(m, -2.0)
    det.weight.data.normal_(std=0.01)
    attach(m.model, det)
    m.config.decode.person_floor = 0.1
    m.save(tmp_path / "det.safetensors")
    assert export([str(tmp_path / "det.safetensors"), str(tmp_path / "out.safetensors"), "--half"]) == 0
    got = detectors_of(captioner.load(tmp_path / "out.safetensors").model)
    assert got is not None and all(torch.equal(got.state_dict()[k], v) for k, v in det.state_dict().items())


@pytest.mark.slow
def test_train_detectors_cli_writes_a_model_with_its_floor(flickr, tmp_path, one_torch_thread):
    import json

    from captioner.cli.train_detectors import main as train_detectors

    out, report = tmp_path / "model.safetensors", tmp_path / "report.json"
    assert train_detectors(["--data-root", str(flickr), "--cache-dir", str(tmp_path / "cache"), "--out", str(out),
                            "--limit", "24", "--groups", "person,water", "--epochs", "3", "--report", str(report)]) == 0
    got = captioner.load(out)
    r = json.loads(report.read_text())
    assert detectors_of(got.model).groups == [PERSON, "water"]
    assert got.config.decode.person_floor == r["person_floor"] and set(r["ap_val"]) == {PERSON, "water"}
    assert 0 <= r["ap_val"][PERSON] <= 1 and r["person_prior_weight"] in T.PRIOR_WEIGHTS
    cap = got.caption(EXAMPLES / "cat.jpg")
    assert [w for w, _ in cap.detections] == [PERSON, "water"]


@pytest.mark.slow
def test_train_detectors_on_a_mix_with_coco_words_and_noise_negatives(flickr, tmp_path, one_torch_thread):
    """--config: the recipe's caption sets (Flickr8k + coco-paired) are the training photos, a COCO category
    is a word group by its COCO words, and noise photos are negatives of every group."""
    import argparse
    import json

    from captioner.cli.train_detectors import _split_features, _with_noise
    from captioner.cli.train_detectors import main as train_detectors
    from captioner.concepts.detectors import caption_labels, group_members

    from .conftest import need_paired

    need_paired()
    model = captioner.load()
    args = argparse.Namespace(config="configs/mix_cpu.yaml", data_root=None, limit=5, cache_dir=str(tmp_path / "c"),
                              device="cpu")
    x, records = _split_features(args, model, "train")
    assert len(records) == len(x) == 10 and records[5].path.name.startswith("COCO_val2014_")
    x, records = _with_noise(model, x, records, 3)
    members = group_members([PERSON, "giraffe"])
    assert members["giraffe"] == ("giraffe", "giraffes")
    assert caption_labels([r.captions for r in records[-3:]], members).sum() == 0  # noise: no word at all
    out, report = tmp_path / "m.safetensors", tmp_path / "r.json"
    assert train_detectors(["--config", "configs/mix_cpu.yaml", "--cache-dir", str(tmp_path / "c"), "--out", str(out),
                            "--limit", "5", "--noise", "3", "--groups", "person,giraffe", "--epochs", "1",
                            "--report", str(report)]) == 0
    assert detectors_of(captioner.load(out).model).groups == [PERSON, "giraffe"]
    assert json.loads(report.read_text())["positives_train"][PERSON] >= 1


def test_export_carries_detectors_from_a_model_with_the_same_encoder_only(tmp_path):
    """export --detectors-from: detectors (and the person floor) move to a model whose encoder is the donor's
    weight for weight (e.g. a decoder retrained on frozen features); another encoder is refused."""
    from captioner.cli.export import main as export

    from .conftest import tiny_captioner

    bundled = captioner.DEFAULT_CHECKPOINT
    donor = load_checkpoint(bundled)
    if donor.detector_info is None:
        pytest.skip("the bundled model carries no detectors")
    plain = tmp_path / "plain.safetensors"
    m = captioner.load()
    attach(m.model, None)
    m.config.decode.person_floor = 0.0
    m.save(plain)
    assert load_checkpoint(plain).detector_info is None
    out = tmp_path / "with.safetensors"
    assert export([str(plain), str(out), "--detectors-from", str(bundled)]) == 0
    got = load_checkpoint(out)
    assert got.detector_info == donor.detector_info and got.config.decode.person_floor == donor.config.decode.person_floor
    assert all(torch.equal(got.detector_tensors[k], v) for k, v in donor.detector_tensors.items())
    tiny_captioner().save(tmp_path / "tiny.safetensors")
    assert export([str(tmp_path / "tiny.safetensors"), str(tmp_path / "x.safetensors"), "--detectors-from",
                   str(bundled)]) == 2
    assert not (tmp_path / "x.safetensors").exists()
