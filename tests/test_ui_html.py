"""The app's HTML pieces (captioner/ui/html.py) without Streamlit: every word escaped, one box per word,
gates, probabilities and attention shown as computed."""
from __future__ import annotations

import re

import numpy as np

from captioner.decoding.captions import Caption
from captioner.ui import html as H


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
    out = H.prob_line(caption())
    assert out.count('class="prob-word"') == 3 and "(unk)" in out
    assert re.findall(r"p=([0-9.]+)<", out) == [f"{np.exp(-0.1):.2f}", f"{np.exp(-3.0):.2f}", f"{np.exp(-0.5):.2f}"]
    assert out.count("#ffd6d6") == 1  # only p=0.05 is below workbench.LOW_PROB


def test_cell_strip_and_concepts():
    out = H.cell_strip(caption(), 0, 0)
    assert re.findall(r"<small>([0-9.]+)</small>", out) == ["0.250", "0.700", "0.250"]
    assert "rgba(255,80,0,1.00)" in out  # the most attentive word is the strongest
    bars = H.concepts_html([("person", 0.8), ("<dog>", 0.05)])
    assert bars.count('class="concept"') == 2 and "&lt;dog&gt;" in bars and "width:80px" in bars
