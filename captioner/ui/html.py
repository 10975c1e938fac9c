"""The app's HTML pieces, pure functions of a Caption (testable without Streamlit): the caption with each
word's gate, the concepts as bars, a sentence with each word's probability, and the words' attention at
one grid cell. Every word is escaped: typed sentences and file names reach the page."""
from __future__ import annotations

import html
from typing import TYPE_CHECKING

from . import workbench
from .visualize import gate_open, word_beta

if TYPE_CHECKING:
    from ..decoding.captions import Caption


def beta_line(cap: "Caption") -> str:
    """The caption, one word per box with its gate beta underneath; a word's opacity is its beta (never
    below 0.2, to stay readable), so words that barely used the image fade; contradicted words are
    struck through. Empty when the caption carries no betas or its gate is open for every word (gate_open)."""
    if gate_open(cap):
        return ""
    boxes = []
    for i, w in enumerate(cap.words):
        b = word_beta(cap, i)
        if b is None:
            return ""
        mark = "text-decoration:line-through wavy #c0392b;" if i in cap.contradicted else ""
        boxes.append(f'<span class="beta-word" title="gate β={b:.2f}" style="display:inline-block;text-align:center;'
                     f'margin:0 0.35em;{mark}opacity:{max(0.2, min(1.0, b)):.2f}">{html.escape(w)}<br>'
                     f'<small style="color:#666">β={b:.2f}</small></span>')
    return f'<div class="beta-line" style="font-size:1.15em;line-height:1.3">{"".join(boxes)}</div>'


def concepts_html(concepts: list[tuple[str, float]]) -> str:
    """The photo's concepts as labelled bars (category, P), in the order given."""
    rows = [f'<div class="concept" style="display:flex;align-items:center;gap:0.5em">'
            f'<span style="width:8em">{html.escape(c)}</span>'
            f'<span style="background:#4c78a8;height:0.8em;width:{max(1, round(100 * q))}px"></span>'
            f'<small>{q:.2f}</small></div>' for c, q in concepts]
    return f'<div class="concepts">{"".join(rows)}</div>'


def prob_line(cap: "Caption") -> str:
    """The sentence, each word with its probability under the model underneath (workbench.shown_prob);
    words shown below workbench.LOW_PROB are highlighted, and out-of-vocabulary words are marked "(unk)"
    (their probability is <unk>'s)."""
    low, boxes = set(workbench.unlikely_words(cap)), []
    for i, (w, p) in enumerate(zip(cap.words, workbench.word_probs(cap))):
        style = "background:#ffd6d6;border-radius:4px;" if i in low else ""
        unk = " (unk)" if i in cap.unknown else ""
        boxes.append(f'<span class="prob-word" title="p={p:.3f}" style="display:inline-block;text-align:center;'
                     f'margin:0 0.3em;padding:0 0.2em;{style}">{html.escape(w)}{unk}<br>'
                     f'<small style="color:#666">p={workbench.shown_prob(p)}</small></span>')
    return f'<div class="prob-line" style="font-size:1.1em;line-height:1.3">{"".join(boxes)}</div>'


def cell_strip(cap: "Caption", row: int, col: int) -> str:
    """The sentence with each word's background as strong as its attention at the cell (relative to the
    most attentive word), the attention underneath."""
    att = workbench.cell_attention(cap, row, col)
    top = max(float(att.max()), 1e-12) if len(att) else 1.0
    boxes = [f'<span class="cell-word" style="display:inline-block;text-align:center;margin:0 0.2em;padding:0 0.2em;'
             f'background:rgba(255,80,0,{a / top:.2f})">{html.escape(w)}<br><small>{a:.3f}</small></span>'
             for w, a in zip(cap.words, att)]
    return f'<div class="cell-strip" style="font-size:1.1em;line-height:1.3">{"".join(boxes)}</div>'


# the page's own style: Streamlit leaves a blank band (6rem) above the first element, the title, under its small
# toolbar; 2.5rem keeps clear of the toolbar
PAGE_STYLE = "<style>[data-testid='stMainBlockContainer'] { padding-top: 2.5rem; }</style>"
