"""The app's HTML pieces (captioner/ui/html.py) without Streamlit: every word escaped, one box per word,
gates, probabilities and attention shown as computed."""
from __future__ import annotations

import re

import numpy as np

from captioner.decoding.captions import Alternative, Caption
from captioner.ui import html as H
from captioner.ui import texts as T
from captioner.ui import workbench as W


def caption(words=("a", "<b>dog</b>", "runs"), betas=(0.9, 0.1, 0.5), lps=(-0.1, -3.0, -0.5)) -> Caption:
    alphas = np.full((len(words), 2, 2), 0.25, np.float32)
    alphas[1] = [[0.7, 0.1], [0.1, 0.1]]
    return Caption(" ".join(words), list(words), alphas, float(sum(lps)) - 0.2, betas=np.array(betas, np.float32),
                   word_log_probs=np.array(lps, np.float32), unknown=[1], contradicted=[1])


def test_beta_line_escapes_fades_and_strikes():
    out = H.beta_line(caption())
    assert "<b>dog</b>" not in out and "&lt;b&gt;dog&lt;/b&gt;" in out  # a typed word is text, never markup
    assert out.count('class="beta-word"') == 3
    assert re.findall(r"opacity:([0-9.]+)", out) == ["0.90", "0.20", "0.50"]  # beta 0.1 stays readable at 0.2
    assert out.count("line-through") == 1  # the contradicted word
    assert H.beta_line(Caption("a", ["a"], np.ones((1, 1, 1), np.float32), -1.0)) == ""  # no betas: no line


def test_prob_line_marks_unlikely_and_unknown_words():
    out = H.prob_line(caption(lps=(-0.1, -3.2, -0.5)))
    assert out.count('class="prob-word"') == 3 and "(unk)" in out
    assert re.findall(r"p=([0-9.]+)<", out) == [f"{np.exp(-0.1):.2f}", f"{np.exp(-3.2):.2f}", f"{np.exp(-0.5):.2f}"]
    assert out.count("#ffd6d6") == 1  # only p=0.04 is below workbench.LOW_PROB


def test_highlight_is_decided_on_the_probability_shown():
    """'playing p=0.05' was highlighted (p=0.0496) and 'on p=0.05' was not (p=0.0504): a word is highlighted
    exactly when the p written under it is below workbench.LOW_PROB."""
    words, ps = ("playing", "on", "the", "grass"), (0.0496, 0.0504, 0.0449, 0.0451)
    cap = caption(words, betas=(0.5,) * 4, lps=tuple(np.log(ps)))
    out = H.prob_line(cap)
    shown = re.findall(r'style="([^"]*)">[^<]*<br><small[^>]*>p=([0-9.]+)</small>', out)
    assert [p for _, p in shown] == ["0.05", "0.05", "0.04", "0.05"]
    assert [("#ffd6d6" in style) for style, _ in shown] == [False, False, True, False]
    assert all(("#ffd6d6" in style) == (float(p) < W.LOW_PROB) for style, p in shown)
    assert W.unlikely_words(cap) == [2]


def test_hypotheses_are_listed_in_full_with_the_score_that_ranked_them():
    """The table cut captions off and showed only log-probs, so an alternative with a better log-prob than the
    caption shown looked like a ranking mistake; each row now has the score beam search ranked by."""
    long = "a man in a red shirt and blue jeans is sitting on a wooden bench next to a small brown dog"
    cap = Caption("a dog runs", ["a", "dog", "runs"], np.full((3, 2, 2), 0.25, np.float32), -4.0, score=-1.0,
                  alternatives=[Alternative("a dog", -3.5, -3.5 / 3), Alternative(long, -20.0, -20.0 / 22)])
    rows = W.hypothesis_rows(cap)
    assert [r["caption"] for r in rows] == ["a dog runs", "a dog", long]  # in full, in rank order
    assert [r["rank"] for r in rows] == [1, 2, 3] and [r["words"] for r in rows] == [3, 2, 21]
    assert [r["score (ranks)"] for r in rows] == [-1.0, round(-3.5 / 3, 3), round(-20 / 22, 3)]
    assert rows[1]["log-prob"] > rows[0]["log-prob"]  # a better log-prob, ranked lower: the note says why
    assert "length-normalised" in W.ranking_note(1.0) and "(words + 1)^1" in W.ranking_note(1.0)
    assert "log-probability" in W.ranking_note(0.0) and "length-normalised" not in W.ranking_note(0.0)
    assert "reranked" not in W.ranking_note(1.0, [-0.5, -0.7, None]) and "reranked" in W.ranking_note(1.0, [-0.7, -0.5])
    assert Caption("a", ["a"], np.ones((1, 1, 1), np.float32), -1.0).to_dict(maps=False)["score"] is None
    assert cap.to_dict(maps=False)["alternatives"][0] == {"caption": "a dog", "log_prob": -3.5, "score": -3.5 / 3,
                                                           "choice": None}
    legacy = Caption("", [], np.zeros((0, 2, 2), np.float32), -1.5, [("a cat", -2.0)])  # (text, log_prob) pairs
    assert legacy.alternatives == [Alternative("a cat", -2.0, None)]
    assert [r["score (ranks)"] for r in W.hypothesis_rows(legacy)] == [None, None]


def test_one_model_compares_other_decode_settings_never_the_same():
    from captioner.config import DecodeConfig

    stored = DecodeConfig(beam_size=5, evidence=True)
    page = {"beam_size": 5, "max_len": 30, "block_trigrams": True, "block_bigrams": True, "evidence": True}
    variants = W.same_model_variants(page, stored, evidence_possible=True)
    assert variants == {"beam 1 (greedy) instead of 5": {**page, "beam_size": 1},
                        "evidence-aware decoding off": {**page, "evidence": False}}
    assert all(v != page for v in variants.values())
    greedy = W.same_model_variants({**page, "beam_size": 1, "evidence": False}, stored, evidence_possible=False)
    assert list(greedy) == ["beam 5 instead of 1"]  # the model file's beam; no evidence without an ImageNet head
    assert W.same_model_variants({"beam_size": 1}, DecodeConfig(beam_size=1), False) == {
        "beam 3 instead of 1": {"beam_size": 3}}
    assert W.settings_line(page) == "beam 5, evidence on, max 30 words"


def test_sidebar_help_claims_only_what_the_model_file_does():
    from captioner.config import DecodeConfig

    # the precision menu: no speed factor; bf16 may be faster and can change captions
    assert T.precision_label("bfloat16", True) == "bfloat16 (native on this machine)"
    assert T.precision_label("bfloat16", False) == "bfloat16" and T.precision_label("float32", True) == "float32"
    assert "3x" not in T.PRECISION_HELP and "may be faster" in T.PRECISION_HELP
    assert "change captions" in T.PRECISION_HELP
    # the evidence switch: with the stored bonus 0 it only vetoes; with a bonus it also favours seen objects
    veto_only = T.evidence_help(DecodeConfig(evidence=True, evidence_bonus=0.0, person_floor=0.3))
    assert "vetoes" in veto_only and "never brings a word in" in veto_only and "brings in the object" not in veto_only
    assert "never writes them" in veto_only  # the veto is a ban (it has no size to call it a penalty by)
    assert "person detector" in veto_only and "0.3" in veto_only
    bonus = T.evidence_help(DecodeConfig(evidence=True, evidence_bonus=2.0))
    assert "favours the words of objects it does see" in bonus and "never brings" not in bonus
    assert "person" not in bonus  # no person floor stored: no claim about person words


def test_cell_strip_and_concepts():
    out = H.cell_strip(caption(), 0, 0)
    assert re.findall(r"<small>([0-9.]+)</small>", out) == ["0.250", "0.700", "0.250"]
    assert "rgba(255,80,0,1.00)" in out  # the most attentive word is the strongest
    bars = H.concepts_html([("person", 0.8), ("<dog>", 0.05)])
    assert bars.count('class="concept"') == 2 and "&lt;dog&gt;" in bars and "width:80px" in bars
