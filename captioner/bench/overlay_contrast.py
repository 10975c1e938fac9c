"""How clearly the default overlay shows where a word looked: the contrast of its half-attention region.

For each content word of a caption (not a function word: "a", "of", "the" ...), the half-attention region is
the smallest set of grid cells holding at least half the word's attention (visualize.half_mass_cells), as the
block of the photo each cell covers. The word's contrast is the mean luminance (Rec. 709 of the 8-bit RGB) of
its overlay inside that region over the mean outside it: 1.0 when the drawing does not tell the region from
the rest, higher when the region is lit and the rest dimmed. The photo's own brightness is in it too (a dark
dog on snow lowers it), as a person sees it. Over many words the median and the 10th percentile are reported.

    .venv/bin/python -m captioner.cli.overlay_contrast      # 8 coco-paired val photos, the bundled model
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
from PIL import Image

from ..ui import visualize
from ..vocab import FUNCTION_WORDS

if TYPE_CHECKING:
    from ..api import Captioner
    from ..decoding.captions import Caption

LUMA = np.array([0.2126, 0.7152, 0.0722], dtype=np.float64)  # Rec. 709 weights of R, G, B
Draw = Callable[[Image.Image, np.ndarray, "float | None"], Image.Image]  # (photo, alpha (G, G), beta) -> overlay


def default_draw(image: Image.Image, alpha: np.ndarray, beta: float | None) -> Image.Image:
    """The overlay every view draws, at its defaults (visualize.overlay)."""
    return visualize.overlay(image, alpha, beta=beta)


def region_contrast(drawn: Image.Image, region: np.ndarray) -> float:
    """Mean luminance of `drawn` inside `region` ((H, W) bool) over the mean outside it (inf for a black
    outside; nan when either side is empty)."""
    lum = np.asarray(drawn.convert("RGB"), dtype=np.float64) @ LUMA  # (H, W)
    if region.all() or not region.any():
        return float("nan")
    inside, outside = lum[region].mean(), lum[~region].mean()
    return float(inside / outside) if outside > 0 else float("inf")


def word_contrast(image: Image.Image, alpha: np.ndarray, beta: float | None, draw: Draw = default_draw) -> float:
    """One word's contrast: its overlay's half-attention region against the rest of the photo."""
    image = image.convert("RGB")
    region = visualize.cells_on_photo(visualize.half_mass_cells(alpha), *image.size)  # (H, W)
    return region_contrast(draw(image, alpha, beta), region)


def caption_contrasts(image: Image.Image, cap: "Caption", draw: Draw = default_draw) -> list[tuple[str, float]]:
    """(word, contrast) for every content word of the caption."""
    return [(w, word_contrast(image, cap.alphas[i], visualize.word_beta(cap, i), draw))
            for i, w in enumerate(cap.words) if w not in FUNCTION_WORDS]


@dataclass(frozen=True)
class Summary:
    words: int
    median: float
    p10: float
    median_region: float  # the share of the photo the half-attention region covers (median over the words)


def measure(loaded: "Captioner", images: Sequence[Image.Image], draw: Draw = default_draw
            ) -> tuple[Summary, list[list[tuple[str, float]]]]:
    """Every content word's contrast on each photo (captioned at the model's stored settings), and the summary."""
    caps = loaded.caption_batch(list(images))
    per_photo = [caption_contrasts(im, cap, draw) for im, cap in zip(images, caps)]
    values = np.array([c for words in per_photo for _, c in words if np.isfinite(c)])
    shares = [float(visualize.half_mass_cells(cap.alphas[i]).mean()) for cap in caps
              for i, w in enumerate(cap.words) if w not in FUNCTION_WORDS]
    return Summary(len(values), float(np.median(values)), float(np.percentile(values, 10)),
                   float(np.median(shares))), per_photo
