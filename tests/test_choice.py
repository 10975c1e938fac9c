"""The choice among the beam's captions (captioner/decoding/choice.py) and its fit (captioner/evaluation/choice_fit.py):
each signal moves the choice the way its weight says, zero weights keep today's order, the least-squares fit finds
the weights that made a candidate's CIDEr, out-of-fold choosing beats the beam's order where a signal carries the
truth, and the fitted weights stored as a model file's fitted data choose as the fit does. The product path: captions
carry their choice score and the app's note says why the caption won."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import captioner
from captioner.config import DecodeConfig
from captioner.decoding.consensus import ConsensusMemory
from captioner.decoding.device_beam import Hypothesis
from captioner.decoding.captions import decide
from captioner.decoding.choice import SIGNALS, Weights, agreements, choose, signals
from captioner.decoding.resources import Fitted
from captioner.decoding.choice import Pool as Candidates
from captioner.evaluation.choice_fit import Pool, as_fitted, fit, out_of_fold
from captioner.vocab import Vocab

EXAMPLES = sorted((Path(captioner.__file__).parent / "assets" / "examples").glob("*.jpg"))
WORDS = ["<pad>", "<start>", "<end>", "<unk>", "a", "dog", "cat", "on", "the", "grass", "sofa", "runs", "sits"]


def _hyp(words: str, score: float) -> Hypothesis:
    vocab = Vocab(WORDS)
    toks = [vocab.stoi[w] for w in words.split()]
    return Hypothesis(toks, torch.zeros(len(toks), 4), score * (len(toks) + 1), score)


def _memory() -> ConsensusMemory:
    vocab = Vocab(WORDS)
    caps = [[[vocab.stoi[w] for w in c.split()] for c in photo] for photo in
            (["a dog runs on the grass", "a dog on the grass"], ["a cat sits on the sofa"], ["a cat on the grass"])]
    return ConsensusMemory.build(torch.eye(3, 8), caps, len(WORDS))


def _feats(photo: int) -> torch.Tensor:
    return torch.eye(3, 8)[photo].expand(1, 4, -1).clone()  # (1, P, D): pooled = memory photo `photo`


def test_zero_weights_keep_the_beams_order_and_every_candidate():
    cands = [_hyp("a cat sits on the sofa", -0.5), _hyp("a dog runs on the grass", -0.9)]
    out = decide([cands], _feats(0), None, _memory(), Vocab(WORDS), DecodeConfig())[0]  # no weights: the beam's
    assert list(out.hyps) == cands and out.choices is None and out.choice_of(1) == (None, None)


@pytest.mark.parametrize("signal, winner", [("consensus", "a dog runs on the grass"),  # memory photo 0's caption
                                            ("agreement", "a cat sits on the sofa"),  # the most shared with the rest
                                            ("length", "a cat sits on the sofa"),  # the first of the longest
                                            ("objects", "a cat sits on the grass")])  # the cat, and no sofa unseen
def test_each_signal_moves_the_choice_its_way(signal, winner):
    """The beam prefers 'a dog on the sofa'; a large weight on one signal puts its own favourite first."""
    cands = [_hyp("a dog on the sofa", -0.3), _hyp("a cat sits on the sofa", -0.6), _hyp("a cat on the sofa", -0.7),
             _hyp("a dog runs on the grass", -0.8), _hyp("a cat sits on the grass", -0.9)]
    probs = torch.zeros(len(captioner.concepts.imagenet.CATEGORIES))  # (C,): the head sees a cat only
    probs[captioner.concepts.imagenet.CATEGORIES.index("cat")] = 0.9
    settings = DecodeConfig(consensus_k=1)
    assert decide([cands], _feats(0), probs[None], _memory(), Vocab(WORDS), settings)[0].best.tokens == cands[0].tokens
    weighted = Weights.from_json({"score": 0.01, "consensus": 0.99} if signal == "consensus"
                                 else {"score": 1.0, signal: 50.0})
    out = decide([cands], _feats(0), probs[None], _memory(), Vocab(WORDS), settings, weights=weighted)[0]
    assert " ".join(Vocab(WORDS).itos[t] for t in out.best.tokens) == winner
    assert out.choices[0] == max(out.choices) and set(out.signals[0]) == set(SIGNALS)


def test_signals_are_computed_only_where_weighed():
    """agreements computes the CIDEr-D signals asked for (the others 0), and the choice says 0 for one it does not
    weigh even where the judge's table holds it."""
    cands = [_hyp("a dog on the sofa", -0.3), _hyp("a cat on the sofa", -0.7)]
    pool = Candidates.of([cands], len(WORDS))
    none = agreements(pool, [[0, 1]], 1, _memory(), [])
    x = signals(pool, 1, none, None, torch.zeros(len(WORDS), 3, dtype=torch.bool))
    assert x[:, 1:4].abs().sum() == 0 and x[:, 0].tolist() == [0.0, pytest.approx(-0.4)]
    table = agreements(pool, [[0, 1]], 1, _memory(), ["consensus", "agreement"])  # (N, 3)
    assert table[:, 0].abs().sum() > 0 and table[:, 1].abs().sum() == 0  # wide not asked: 0
    decision = choose(pool, 1, table, None, Weights.from_json({"score": 1.0, "consensus": 1.0}))
    assert decision.signals[:, 1].tolist() == table[:, 0].tolist() and decision.signals[:, 3].abs().sum() == 0


def _pools(n: int, seed: int) -> list[Pool]:
    """Photos of 5 candidates whose CIDEr is 2 x signal 'wide' - 1 x 'length' / 10 + noise; the beam's score is noise."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.zeros(5, len(SIGNALS), dtype=torch.float64)
        x[:, 0] = -torch.rand(5, generator=g, dtype=torch.float64)
        x[:, 2] = torch.rand(5, generator=g, dtype=torch.float64)
        x[:, 5] = torch.randint(5, 15, (5,), generator=g).double()
        cider = 2 * x[:, 2] - x[:, 5] / 10 + 0.05 * torch.randn(5, generator=g, dtype=torch.float64)
        out.append(Pool(x, cider))
    return out


def test_the_fit_finds_the_weights_that_made_the_cider():
    w = fit(_pools(300, 0), ["score", "wide", "length"], ridge=1e-6)
    assert w[2] == pytest.approx(2.0, rel=0.05) and w[5] == pytest.approx(-0.1, rel=0.05)
    assert abs(float(w[0])) < 0.1 and w[[1, 3, 4, 6, 7]].abs().sum() == 0  # unused signals stay 0


def test_out_of_fold_choosing_beats_the_beams_order_where_a_signal_carries_the_truth():
    sets = {"a": _pools(60, 1), "b": _pools(40, 2)}
    beam, learned = out_of_fold(sets, ["score"]), out_of_fold(sets, ["score", "wide", "length"])
    assert all(learned[k] > beam[k] + 0.3 for k in sets)


def test_fitted_weights_stored_as_the_files_fitted_data_choose_as_the_fit_does():
    """as_fitted rescales score + consensus = 1; the choice made with the stored weights (read back from their JSON,
    as a model file holds them) equals the fit's argmax; decode.fitted_choice=false keeps the beam's order."""
    weights = torch.tensor([0.8, 0.4, 1.2, -0.3, 0.1, -0.02, 0.5, 0.2], dtype=torch.float64)
    stored = Fitted.from_json(json.loads(json.dumps({"choice": as_fitted(weights)})))
    decode = DecodeConfig(consensus_k=1)
    cands = [_hyp("a dog on the sofa", -0.3), _hyp("a cat sits on the sofa", -0.6), _hyp("a cat on the grass", -0.65),
             _hyp("a dog runs on the grass", -0.8)]
    probs = torch.rand(1, len(captioner.concepts.imagenet.CATEGORIES), generator=torch.Generator().manual_seed(0))
    out = decide([cands], _feats(2), probs, _memory(), Vocab(WORDS), decode, weights=stored.choice_in_use(decode))[0]
    x = torch.stack([torch.tensor([row[s] for s in SIGNALS], dtype=torch.float64) for row in out.signals])  # (n, S)
    assert int((x @ weights).argmax()) == 0 and out.best is not cands[0]  # the fit's own favourite, not the beam's
    off = dataclasses.replace(decode, fitted_choice=False)
    kept = decide([cands], _feats(2), probs, _memory(), Vocab(WORDS), off, weights=stored.choice_in_use(off))[0]
    assert list(kept.hyps) == cands
    with pytest.raises(ValueError, match="positive"):
        as_fitted(torch.tensor([-1.0, 0.5, 0, 0, 0, 0, 0, 0]))
    for bad in ({"choice": {"sharpness": 1.0}}, {"choice": {"wide": float("nan")}}, {"chioce": {}}):
        with pytest.raises(ValueError, match="fitted data"):
            Fitted.from_json(bad, "x.safetensors")


def test_a_caption_says_why_it_won(bundled):
    from captioner.ui.workbench import choice_note, hypothesis_rows

    cap = bundled.caption(EXAMPLES[0])
    assert cap.alternatives and cap.choice is not None and set(cap.signals) == set(SIGNALS)
    assert all(a.choice is not None and a.choice <= cap.choice for a in cap.alternatives)
    assert "choice (ranks)" in hypothesis_rows(cap)[0] and "runner-up" in choice_note(cap)
    rec = cap.to_dict(maps=False)
    assert rec["choice"] == cap.choice and rec["alternatives"][0]["choice"] == cap.alternatives[0].choice
    plain = bundled.caption(EXAMPLES[0], fitted_choice=False)
    assert plain.choice is None and choice_note(plain) == "" and "choice (ranks)" not in hypothesis_rows(plain)[0]


def test_fit_selector_runs_end_to_end_on_a_few_real_photos(tmp_path, coco_mini):
    import json

    from captioner.cli.fit_selector import main

    out = tmp_path / "selector.json"
    rc = main(["--data", str(coco_mini.parent), "--sets", "coco-mini", "--limit", "8", "--cache-dir",
               str(tmp_path / "cache"), "--output", str(out)])
    report = json.loads(out.read_text())
    row = report["headroom"]["coco-mini"][f"beam{report['settings']['beam_size']}"]
    assert row["best of pool"] >= max(row["beam's first"], row["random"], row["current choice"]) > 0
    assert set(report["signals"]) >= {"beam score only", "every signal", *(f"without {s}" for s in SIGNALS[1:])}
    assert "score" in report["kept"] and set(report["weights"]) == set(SIGNALS)
    if rc == 0:  # the weights as a model file's fitted data, valid ones
        assert Fitted.from_json(report["fitted"]).choice.to_json() == report["fitted"]["choice"]
    else:  # 1: on 8 photos the fit gave the score or the consensus a sign the choice cannot hold: said so
        assert rc == 1 and report["fitted"] is None


def test_export_stores_a_reports_fitted_choice_and_keeps_the_rest(tmp_path, bundled):
    """captioner-export --fitted REPORT: the report's choice replaces the file's, the file's confidence map stays;
    without --fitted the export keeps the file's fitted data; a report without "fitted" is refused, naming it."""
    import json

    from captioner.checkpoint import load_checkpoint
    from captioner.cli.export import main

    own = load_checkpoint(captioner.DEFAULT_CHECKPOINT).fitted
    report = tmp_path / "selector.json"
    report.write_text(json.dumps({"fitted": {"choice": {"score": 0.75, "consensus": 0.25, "length": -0.01}}}))
    assert main([str(captioner.DEFAULT_CHECKPOINT), str(tmp_path / "a.safetensors"), "--fitted", str(report)]) == 0
    stored = load_checkpoint(tmp_path / "a.safetensors").fitted
    assert stored["choice"] == {**dict.fromkeys(SIGNALS, 0.0), "score": 0.75, "consensus": 0.25, "length": -0.01}
    # the file's map stays (the same map: a signal added since it was fitted is written with its weight 0)
    assert Fitted.from_json(stored).confidence == Fitted.from_json(own).confidence
    assert main([str(captioner.DEFAULT_CHECKPOINT), str(tmp_path / "b.safetensors")]) == 0
    assert Fitted.from_json(load_checkpoint(tmp_path / "b.safetensors").fitted) == Fitted.from_json(own)
    (tmp_path / "scores.json").write_text(json.dumps({"scores": {}}))
    assert main([str(captioner.DEFAULT_CHECKPOINT), str(tmp_path / "c.safetensors"), "--fitted",
                 str(tmp_path / "scores.json")]) == 2
    assert not (tmp_path / "c.safetensors").exists()
