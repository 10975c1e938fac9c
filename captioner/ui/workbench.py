"""The attention workbench's logic (the app's "Explain a sentence", "Click a region" and "Compare two
models" views draw what these functions compute; app.py only lays out widgets).

Legend: L words, G grid side (P = G*G cells).

- word probabilities: p = exp(word_log_prob); a word below LOW_PROB is one the model finds unlikely
  there (it would rarely have written it), which is where a typed sentence and the photo disagree.
  Probabilities are shown with PROB_DIGITS decimals, and "below LOW_PROB" is decided on the value shown
  (a word shown as p=0.05 is never highlighted, one shown as p=0.04 always is).
- beam hypotheses: beam search ranks finished captions by their score (log_prob / (words + 1) **
  length_penalty), not by log_prob, so a shorter alternative can have a better log_prob and rank lower.
- "Compare two models" with one model file: the same model at other decode settings (same_model_variants).
- a region: grid cell (row, col) covers rows [row*H/G, (row+1)*H/G) and columns [col*W/G, ...) of
  the photo (the grid covers the whole uncropped photo, see visualize.py). A word's attention at the
  cell is alpha[row, col]; times P it is the lift over a uniform map (1 = looked there no more than
  anywhere else), which is comparable across grid sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from PIL import Image, ImageDraw

if TYPE_CHECKING:
    from ..config import DecodeConfig
    from ..decoding.captions import Caption

LOW_PROB = 0.05  # below this a word is marked unlikely
PROB_DIGITS = 2  # decimals of a probability on the page


def word_probs(caption: "Caption") -> np.ndarray:
    """(L,) probability of each word given the photo and the words before it; empty when unknown."""
    return np.exp(np.asarray(caption.word_log_probs, dtype=np.float64))


def shown_prob(p: float) -> str:
    """A probability as the page writes it ("0.05"): the value highlights are decided on."""
    return f"{p:.{PROB_DIGITS}f}"


def unlikely_words(caption: "Caption", threshold: float = LOW_PROB) -> list[int]:
    """Indices of the words whose probability, as shown (shown_prob), is below `threshold`."""
    return [i for i, p in enumerate(word_probs(caption)) if float(shown_prob(p)) < threshold]


def hypothesis_rows(caption: "Caption") -> list[dict[str, object]]:
    """The caption and its other beam hypotheses, in the order they were ranked, each in full with the beam's
    score and its log-probability (rounded to 3 decimals), its word count and, where the choice among them
    (decoding/choice.py) ranked them, the choice score that did."""
    rows = [(caption.text, caption.score, caption.log_prob, caption.choice, "shown above")]
    rows += [(a.text, a.score, a.log_prob, a.choice, "") for a in caption.alternatives]
    chosen = caption.choice is not None
    return [{"rank": k + 1, "caption": text or "(empty)", **({"choice (ranks)": round(choice, 3)} if chosen else {}),
             ("beam score" if chosen else "score (ranks)"): None if score is None else round(score, 3),
             "log-prob": round(lp, 3), "words": len(text.split()), "": note}
            for k, (text, score, lp, choice, note) in enumerate(rows)]


# what each signal of the choice means to a reader (decoding/choice.py's SIGNALS)
SIGNAL_WORDS = {"score": "the model's own length-normalised score",
                "consensus": "agreement with the captions of the most similar training photos",
                "wide": "agreement with the captions of a wider set of similar training photos",
                "agreement": "agreement with the other candidates",
                "log_prob": "the model's probability per word", "length": "its length",
                "objects": "naming what the encoder's classifier sees",
                "top_object": "naming what the classifier finds most probable"}


def choice_note(caption: "Caption") -> str:
    """Why the caption won the choice among the beam's candidates: its choice score beside the runner-up's and the
    signals (weighted as the model file's fitted choice weighs them) that made the difference; "" without a choice."""
    from ..decoding.choice import SIGNALS

    runner = next((a for a in caption.alternatives if a.choice is not None and a.signals), None)
    if caption.choice is None or runner is None or not caption.signals:
        return ""
    weight = {s: float(caption.weights.get(s, 0.0)) for s in SIGNALS}
    gaps = {s: weight[s] * (caption.signals.get(s, 0.0) - runner.signals.get(s, 0.0)) for s in SIGNALS if weight[s]}
    ahead = sorted((s for s in gaps if gaps[s] > 0), key=lambda s: -gaps[s])[:2]
    behind = sorted((s for s in gaps if gaps[s] < 0), key=lambda s: gaps[s])[:1]
    note = (f"Chosen with choice score {caption.choice:.3f} against {runner.choice:.3f} for the runner-up "
            f"(“{runner.text}”)")
    if ahead:
        note += ": it wins on " + " and ".join(f"{SIGNAL_WORDS[s]} ({gaps[s]:+.3f})" for s in ahead)
    if behind:
        note += f", though it loses on {SIGNAL_WORDS[behind[0]]} ({gaps[behind[0]]:+.3f})"
    return note + "."


def ranking_note(length_penalty: float, scores: Sequence[float | None] = ()) -> str:
    """How the hypotheses were ranked, for the line under their table; `scores`: theirs in the order shown (a
    caption of lower score above a higher one: the consensus rerank put it there, and the note says so)."""
    if not length_penalty:
        note = "Ranked by log-probability (this model file's decode.length_penalty is 0)."
    else:
        note = (f"Ranked by the length-normalised score, log-prob / (words + 1)^{length_penalty:g} (this model file's "
                "decode.length_penalty), not by the raw log-prob: a shorter caption can have a higher log-prob "
                "and still rank lower.")
    known = [s for s in scores if s is not None]
    if any(a < b for a, b in zip(known, known[1:])):
        note += (" Then reranked by the choice score (the model file's fitted choice): the beam's score "
                 "weighed with agreement with the captions of the most similar training photos and the other "
                 "signals, so a caption of lower score can come first.")
    return note


def same_model_variants(page: dict[str, Any], stored: "DecodeConfig", evidence_possible: bool
                        ) -> dict[str, dict[str, Any]]:
    """For "Compare two models" when only one model file is available: label -> decode settings that differ
    from the page's (`page`: the sidebar's settings, name -> value) in one respect: greedy vs beam search
    (the model file's beam, or 3), and evidence-aware decoding off vs on where the encoder allows it."""
    out: dict[str, dict[str, Any]] = {}
    beam = int(page.get("beam_size", stored.beam_size))
    other = 1 if beam != 1 else (stored.beam_size if stored.beam_size != 1 else 3)
    out[f"beam {other}" + (" (greedy)" if other == 1 else "") + f" instead of {beam}"] = {**page, "beam_size": other}
    if evidence_possible:
        on = bool(page.get("evidence", stored.evidence))
        out[f"evidence-aware decoding {'off' if on else 'on'}"] = {**page, "evidence": not on}
    return out


def settings_line(settings: dict[str, Any]) -> str:
    """'beam 5, evidence on, max 30 words' for the decode settings a side of a comparison used."""
    parts = [f"beam {settings['beam_size']}"] if "beam_size" in settings else []
    if "evidence" in settings:
        parts.append(f"evidence {'on' if settings['evidence'] else 'off'}")
    if "max_len" in settings:
        parts.append(f"max {settings['max_len']} words")
    return ", ".join(parts)


@dataclass
class CellWord:
    index: int  # position in the caption
    word: str
    attention: float  # alpha of the word at the cell, in [0, 1]
    lift: float  # attention * P: 1 = no more than a uniform map


def cell_attention(caption: "Caption", row: int, col: int) -> np.ndarray:
    """(L,) each word's attention at grid cell (row, col). IndexError outside the grid."""
    G = caption.alphas.shape[-1]
    if not (0 <= row < caption.alphas.shape[1] and 0 <= col < G):
        raise IndexError(f"cell ({row}, {col}) is outside the {caption.alphas.shape[1]}x{G} grid")
    return caption.alphas[:, row, col].astype(np.float64)


def rank_words_at(caption: "Caption", row: int, col: int) -> list[CellWord]:
    """The caption's words ranked by their attention at cell (row, col), most first (ties: caption order)."""
    att = cell_attention(caption, row, col)
    P = caption.alphas.shape[1] * caption.alphas.shape[2]
    order = sorted(range(len(att)), key=lambda i: (-att[i], i))
    return [CellWord(i, caption.words[i], float(att[i]), float(att[i] * P)) for i in order]


def cell_of_point(x: float, y: float, width: int, height: int, grid: int) -> tuple[int, int]:
    """A pixel (x, y) of a width x height picture -> the (row, col) of the grid cell it falls in."""
    col = min(grid - 1, max(0, int(x * grid / width)))
    row = min(grid - 1, max(0, int(y * grid / height)))
    return row, col


MIN_CELL_PX = 8  # a marked cell is drawn at least this many pixels wide and tall


def mark_cell(image: Image.Image, grid: int, row: int, col: int, colour: str = "#ff2b2b") -> Image.Image:
    """A copy of the photo with grid cell (row, col) outlined and the other cell borders faint.

    A photo with fewer than MIN_CELL_PX pixels per cell on a side (a 6x6 icon, a 1x300 strip: any photo
    the parser accepts) is enlarged on that side first (nearest neighbour, so its pixels stay visible):
    the cell can always be drawn and clicked. The grid covers the whole photo either way, so a click
    maps to the same cell (cell_of_point reads the size it was given)."""
    out = image.convert("RGB")
    w, h = out.size
    side = grid * MIN_CELL_PX
    if w < side or h < side:
        out = out.resize((max(w, side), max(h, side)), Image.Resampling.NEAREST)
    else:
        out = out.copy()
    w, h = out.size
    draw = ImageDraw.Draw(out)
    for k in range(1, grid):  # faint grid
        draw.line([(k * w / grid, 0), (k * w / grid, h)], fill=(255, 255, 255), width=1)
        draw.line([(0, k * h / grid), (w, k * h / grid)], fill=(255, 255, 255), width=1)
    box = (col * w / grid, row * h / grid, (col + 1) * w / grid - 1, (row + 1) * h / grid - 1)
    draw.rectangle(box, outline=colour, width=max(2, round(min(w, h) / 120)))
    return out


def compare_rows(a: "Caption", b: "Caption") -> list[dict[str, object]]:
    """One sentence explained under two models -> per word its probability under each and which
    model found it likelier. Both captions must be explanations of the same words."""
    if a.words != b.words:
        raise ValueError(f"the two explanations have different words: {a.words} vs {b.words}")
    pa, pb = word_probs(a), word_probs(b)
    return [{"word": w, "p (A)": round(float(x), 4), "p (B)": round(float(y), 4),
             "likelier under": "A" if x > y else "B" if y > x else "="}
            for w, x, y in zip(a.words, pa, pb)]
