"""Many photos at once: what the app's gallery shows and downloads for a batch of captioned photos.

The app reads the batch with `Captioner.read_batch` and decodes it together (decoding/photo.py
caption_photos); these builders turn (name, Caption) pairs into the batch's CSV (one row per photo), its
JSON (a list of `Caption.to_dict`, the one JSON shape) and a ZIP of the attention figures, and pick the
gallery's thumbnail size. Pure functions of their inputs (tested without Streamlit).
"""
from __future__ import annotations

import csv
import io
import json
import zipfile
from pathlib import PurePath
from typing import TYPE_CHECKING, Callable, Sequence

from PIL import Image

from ..decoding.confidence import shown

if TYPE_CHECKING:
    from ..decoding.captions import Caption

MAX_PHOTOS = 12  # photos one upload may hold: decoded together, each kept with its reading while on screen
THUMB_MAX = 320  # a gallery thumbnail's longer side, at most


def top_concepts(cap: "Caption") -> str:
    """'cat 0.87; person 0.31': what the encoder's heads see, most probable first ('' for none): every concept
    the caption carries (Caption.concepts, P >= THRESHOLD), as the single photo's view and the JSON list them."""
    return "; ".join(f"{c} {p:.2f}" for c, p in cap.concepts)


def batch_csv(items: Sequence[tuple[str, "Caption"]]) -> bytes:
    """One row per photo: file name, caption, log-probability, confidence (the shown number the level reads),
    sure, level and why unsure (empty without a fitted map), top concepts, notes (UTF-8, with header)."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["image", "caption", "log_prob", "confidence", "sure", "level", "reason", "concepts", "notes"])
    for name, cap in items:
        sure = "" if cap.confidence is None else f"{shown(cap.confidence):.2f}"
        w.writerow([name, cap.text, f"{cap.log_prob:.4f}", sure, "" if cap.sure is None else str(cap.sure).lower(),
                    cap.level or "", cap.doubt or "", top_concepts(cap), " | ".join(cap.notes)])
    return buf.getvalue().encode("utf-8")


def batch_json(items: Sequence[tuple[str, "Caption"]], maps: bool = False) -> bytes:
    """A list of each photo's Caption.to_dict (the JSON of captioner-caption --json), in upload order."""
    return json.dumps([cap.to_dict(name, maps=maps) for name, cap in items]).encode("utf-8")


def figures_zip(items: Sequence[tuple[str, "Caption", Image.Image]], figure: Callable[[Image.Image, "Caption"], bytes]
                ) -> bytes:
    """A ZIP of one attention figure per photo, each named after its photo's stem with "_attention" (a number
    added when two uploads share a stem, so no figure overwrites another). Stored, not deflated: a PNG is
    compressed already, and deflating it again gained nothing but time."""
    buf, used = io.BytesIO(), set()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, cap, image in items:
            stem, n = PurePath(name).stem or "image", 1
            target = f"{stem}_attention.png"
            while target in used:
                n += 1
                target = f"{stem}_{n}_attention.png"
            used.add(target)
            z.writestr(target, figure(image, cap))
    return buf.getvalue()


def thumbnail_side(count: int, columns: int) -> int:
    """The longer side of a gallery thumbnail: the page's width shared by `columns` cards, never above
    THUMB_MAX (a single photo needs no gallery)."""
    return min(THUMB_MAX, max(120, 960 // max(1, min(count, columns))))
