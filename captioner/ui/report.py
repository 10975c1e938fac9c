"""Where the model fails: one self-contained HTML page for the people who train it (captioner-evaluate --report).

Per photo: the thumbnail, the generated caption (object words marked, hallucinated ones struck), the
references, the caption's CIDEr, the objects it hallucinated and the boxed (COCO instances) or referenced
objects it missed, and the attention of every object word (`visualize.overlay`, the figures' overlay), sorted
worst first (lowest CIDEr, then most hallucinated). The corpus scores and CHAIR sit at the top.

Hallucinated and missed objects are captioner/evaluation/hallucination.py's (caption_hallucination: truth =
boxed categories + what the references name; without boxes, the references alone). Every image is embedded
as a data: URI and a Content-Security-Policy forbids anything else, so the page opens offline, from a mail
attachment or a ZIP, exactly as written.
"""
from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from PIL import Image

from ..concepts.words import CATEGORY_WORDS, match_words, word_table
from ..evaluation.hallucination import CaptionHallucination, HallucinationSummary, caption_hallucination
from ..images import load_image
from .visualize import overlay, shown_beta, word_beta, word_title

if TYPE_CHECKING:
    from ..data import ImageRecord
    from ..decoding.captions import Caption

THUMB_SIDE = 240  # a photo's thumbnail, longer side
OBJECT_SIDE = 150  # an object word's attention overlay, longer side
JPEG_QUALITY = 80  # embedded images: small enough that 80 photos make a page of a few MB
SCORE_KEYS = ("Bleu_1", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE")
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"  # nothing can load from anywhere else

STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1100px;color:#222}
table.scores td,table.scores th{padding:.2em .7em;text-align:right;border-bottom:1px solid #ddd}
ol.photos{list-style:none;padding:0} li.photo{display:flex;gap:1em;border-top:1px solid #ccc;padding:.8em 0}
img.thumb{flex:none;align-self:flex-start} .body{flex:1} .caption{font-size:1.15em;margin:.1em 0 .4em}
.object{background:#d8ecff} .hallucinated{background:#ffd6d6;text-decoration:line-through}
.cider{font-weight:600} .refs{margin:.3em 0;color:#555} .objects{display:flex;flex-wrap:wrap;gap:.5em}
figure{margin:0} figcaption{font-size:.85em;text-align:center} .bad{color:#b00}
"""


@dataclass(frozen=True)
class PhotoReport:
    """One photo's line of the report."""
    record: "ImageRecord"
    caption: "Caption"
    cider: float
    judged: CaptionHallucination  # mentioned / hallucinated / truth / boxed categories
    named: tuple[tuple[int, str], ...]  # (word index, category) of each word naming an object

    @property
    def missed(self) -> list[str]:
        """Boxed categories (or, without boxes, those the references name) the caption does not name."""
        return sorted(self.judged.recall_pool - self.judged.mentioned)


def photo_reports(records: Sequence["ImageRecord"], captions: Sequence["Caption"], cider: Mapping[str, float],
                  boxed: Mapping[str, set[str]] | None) -> list[PhotoReport]:
    """Records and their captions (same order), each caption's CIDEr {image_id: score} and the boxed categories
    {image_id: categories} (None: no boxes, truth = the references) -> the report's lines, worst first."""
    if len(records) != len(captions):
        raise ValueError(f"{len(records)} records but {len(captions)} captions: pass one caption per record, "
                         "in the records' order")
    missing = [r.image_id for r in records if r.image_id not in cider]
    if missing:
        raise ValueError(f"{len(missing)} photo(s) have no CIDEr, e.g. {missing[:3]}: score every captioned photo")
    table = word_table(CATEGORY_WORDS)
    out = []
    for r, cap in zip(records, captions):
        judged = caption_hallucination(r.image_id, cap.text, r.captions, None if boxed is None else boxed[r.image_id],
                                       table)
        out.append(PhotoReport(r, cap, float(cider[r.image_id]), judged, tuple(match_words(cap.words, table))))
    return sorted(out, key=lambda p: (p.cider, -len(p.judged.hallucinated), -len(p.missed), p.record.image_id))


def data_uri(image: Image.Image, side: int) -> str:
    """The image shrunk to `side` (longer side) as a JPEG data: URI."""
    img = image.convert("RGB")
    img.thumbnail((side, side))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=JPEG_QUALITY)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _caption_html(p: PhotoReport) -> str:
    """The caption's words, object words marked and hallucinated ones struck through."""
    cats = dict(p.named)
    parts = []
    for i, w in enumerate(p.caption.words):
        cat = cats.get(i)
        if cat is None:
            parts.append(html.escape(w))
        else:
            cls = "hallucinated" if cat in p.judged.hallucinated else "object"
            parts.append(f'<span class="{cls}" title="{html.escape(cat)}">{html.escape(w)}</span>')
    return " ".join(parts)


def _objects_html(p: PhotoReport, photo: Image.Image) -> str:
    """One attention overlay per object word, titled with the word (and its gate where gates vary)."""
    small = photo.copy()
    small.thumbnail((OBJECT_SIDE, OBJECT_SIDE))
    figs = []
    for i, cat in p.named:
        word = p.caption.words[i]
        img = overlay(small, p.caption.alphas[i], beta=word_beta(p.caption, i))
        what = "hallucinated" if cat in p.judged.hallucinated else "in the photo"
        title = html.escape(word_title(word, shown_beta(p.caption, i)))
        figs.append(f'<figure><img src="{data_uri(img, OBJECT_SIDE)}" alt="attention of {html.escape(word)}">'
                    f'<figcaption class="{"bad" if what == "hallucinated" else ""}">{title} ({what})</figcaption>'
                    "</figure>")
    return f'<div class="objects">{"".join(figs)}</div>' if figs else ""


def _photo_html(rank: int, p: PhotoReport) -> str:
    photo = load_image(p.record.path)
    truth = "boxed" if p.judged.boxed is not None else "named by the references"
    hall = ", ".join(sorted(p.judged.hallucinated)) or "none"
    missed = ", ".join(p.missed) or "none"
    refs = "".join(f"<li>{html.escape(c)}</li>" for c in p.record.captions)
    name = html.escape(p.record.path.name)
    return (f'<li class="photo" data-image-id="{html.escape(p.record.image_id)}" data-cider="{p.cider:.6f}">'
            f'<img class="thumb" src="{data_uri(photo, THUMB_SIDE)}" alt="{name}">'
            f'<div class="body"><div>#{rank} <b>{name}</b> · <span class="cider">CIDEr {p.cider:.3f}</span></div>'
            f'<p class="caption">{_caption_html(p)}</p>'
            f'<div class="hall">hallucinated: <span class="{"bad" if p.judged.hallucinated else ""}">'
            f'{html.escape(hall)}</span></div>'
            f'<div class="missed">missed ({truth}): {html.escape(missed)}</div>'
            f'<details class="refs"><summary>{len(p.record.captions)} references</summary><ul>{refs}</ul></details>'
            f"{_objects_html(p, photo)}</div></li>")


def _scores_html(scores: Mapping[str, float], summary: HallucinationSummary) -> str:
    keys = [k for k in SCORE_KEYS if k in scores]
    truth = "references" if summary.references_only else "boxes + references"
    head = "".join(f"<th>{k}</th>" for k in keys) + "<th>CHAIR-s</th><th>CHAIR-i</th><th>object recall</th>"
    vals = [f"{scores[k]:.3f}" for k in keys] + [f"{v:.3f}" for v in (summary.chair_s, summary.chair_i, summary.recall)]
    return (f'<table class="scores"><tr>{head}</tr><tr>{"".join(f"<td>{v}</td>" for v in vals)}</tr></table>'
            f"<p>CHAIR (truth: {truth}): {summary.n_captions_hallucinating} of {summary.n_captions} captions name "
            f"an object that is not there; {summary.n_named_boxed} of {summary.n_boxed} objects named.</p>")


def report_html(reports: Sequence[PhotoReport], scores: Mapping[str, float], title: str) -> str:
    """The whole page: corpus scores and CHAIR at the top, then every photo in the order given (worst first)."""
    summary = HallucinationSummary.of([p.judged for p in reports])
    items = "".join(_photo_html(k + 1, p) for k, p in enumerate(reports))
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
            f"<h1>Where the model fails</h1><p>{html.escape(title)}: {len(reports)} photos, worst first (lowest "
            "CIDEr first). Object words are <span class=\"object\">marked</span>, hallucinated ones "
            "<span class=\"hallucinated\">struck</span>; each object word's attention is drawn below its photo.</p>"
            f'{_scores_html(scores, summary)}<ol class="photos">{items}</ol></body></html>')


def write_report(path: str | Path, records: Sequence["ImageRecord"], captions: Sequence["Caption"],
                 scores: Mapping[str, float], cider: Mapping[str, float], boxed: Mapping[str, set[str]] | None,
                 title: str) -> Path:
    """Build the report of these captions and write it to `path` (folders created) -> the path."""
    page = report_html(photo_reports(records, captions, cider, boxed), scores, title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
