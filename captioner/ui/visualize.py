"""Attention overlays: where each word looked, drawn on the ORIGINAL photo.

The grid covers the whole (uncropped) network input, which is the whole photo resized, so a map
stretched over the photo's own width and height lines up with its content: grid cell (i, j) covers
rows [i*H/G, (i+1)*H/G) and columns [j*W/G, (j+1)*W/G) of the photo (pixel-centre alignment).

Upsampling. The paper's figures upsample x16 and blur with a Gaussian, which draws blobs sharper or
rounder than a G x G map can know. Here the default is BILINEAR: each cell's value sits at the cell's
centre and is interpolated linearly in between, so the picture is continuous, never leaves the range
of the neighbouring cells (bicubic overshoots: rings and halos that are not in the map) and adds no
detail finer than a cell. mode="nearest" draws the cells as flat blocks (the map exactly as computed,
resolution included). A Gaussian blur (smooth > 0, in cells) is available for the paper's look.

The gate beta. The context that reaches a word is z = beta * sum_i alpha_i a_i (Xu et al. 4.2.1), so
beta * alpha is what the word actually took from each region: the overlay's effect is multiplied by beta
(a word with beta 0.1 shows the photo nearly bare), and in figures a word with beta below LOW_BETA gets a grey
title. Titles read "dog  p=0.61  β=0.82" (its probability, its gate). Nothing here calls plt.show().

The overlay (LIGHT, the paper's own figures): where the word looked lit, the rest dimmed, nothing tinted. Each map
is normalised to the word's own peak (m = alpha / max alpha). The half-attention region is the smallest set of cells
holding half the word's attention (half_mass_cells); the drawn map at or above its weakest cell's level is that
region, outlined. The photo keeps LIT_FLOOR + (1 - LIT_FLOOR) m of its brightness inside the region and DIMMED times
that outside (brightness): linear in m on each side, so the region reads at a glance (measured: bench/overlay_contrast.py)
and nothing finer than the map is drawn. A figure's scale and the app say so in words. A colour map name blends a
heat map instead.
"""
from __future__ import annotations

import functools
import io
import json
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageFilter

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..api import Caption


LIGHT = "light"  # overlay's default: the paper's light mask (where the word looked lit, the rest dimmed)
LIT_FLOOR = 0.3  # the light mask keeps this share of the photo's brightness where the word looked not at all ...
DIMMED = 0.45  # ... and this share more outside the half-attention region (brightness)
OUTLINE_SHARE = 0.006  # the half-attention region's outline: this share of the photo's shorter side wide
OUTLINE_GREY = 235  # the outline's grey level (0-255)
LOW_BETA = 0.5  # below this gate value a word's figure title is grey: it used the image little
MAX_ASPECT = 3.0  # figure panels: a photo longer than 3:1 (either way) is letterboxed to 3:1
PANEL_PIXELS = 640  # the longer side of the photo drawn in a figure panel (its overlays are computed there)
MAX_FIGURE_PIXELS = 12_000_000  # figure_png lowers its dpi so that no PNG exceeds this many pixels
TITLE_INCHES, CAPTION_INCHES = 0.45, 0.4  # a figure's room for each row's word titles and for the caption on top
SCALE_INCHES = 0.5  # a figure's room at the bottom for its scale (what the light mask means)
# zlib level of a figure's PNG: 1 instead of 6 encodes a 1 MB figure in a third of the time, 9% larger (a figure
# is mostly photo, which zlib barely shrinks at any level)
PNG_COMPRESSION = 1
MODES = {"bilinear": "bilinear", "nearest": "nearest-exact"}  # upsampling: ours -> torch's name


def upsample_alpha(alpha: np.ndarray, width: int, height: int, smooth: float = 0.0,
                   mode: str = "bilinear") -> np.ndarray:
    """alpha (G, G) -> (height, width) map in [0, 1] (scaled so its maximum is 1).
    mode: "bilinear" (continuous between cell centres) or "nearest" (flat cell blocks).
    smooth: Gaussian blur radius in grid cells (0 = none)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    a = torch.as_tensor(np.asarray(alpha, dtype=np.float32))[None, None]  # (1, 1, G, G)
    kw = {"align_corners": False} if mode == "bilinear" else {}
    up = F.interpolate(a, size=(height, width), mode=MODES[mode], **kw)[0, 0].clamp_(min=0)
    m = up.numpy()
    if smooth > 0:
        radius = smooth * max(width, height) / alpha.shape[-1]
        # 8 bits suffice: the colour map has 256 levels (Pillow cannot blur float images)
        im = Image.fromarray(np.round(m / max(float(m.max()), 1e-12) * 255).astype(np.uint8), mode="L")
        m = np.asarray(im.filter(ImageFilter.GaussianBlur(radius)), dtype=np.float32)
    return m / max(float(m.max()), 1e-12)


def half_mass_cells(alpha: np.ndarray, mass: float = 0.5) -> np.ndarray:
    """(G, G) bool: the smallest set of cells holding at least `mass` of the word's attention (its largest cells,
    taken in order until their sum reaches mass x the map's total; ties broken by position; a float32 map that sums to exactly half is within 1e-6 of it)."""
    a = np.asarray(alpha, dtype=np.float64)
    flat = a.ravel()
    order = np.argsort(-flat, kind="stable")  # largest first
    cum = np.cumsum(flat[order])
    n = int(np.searchsorted(cum, mass * cum[-1] * (1 - 1e-6))) + 1  # cells needed to reach the mass
    keep = np.zeros(flat.shape, dtype=bool)
    keep[order[:n]] = True
    return keep.reshape(a.shape)


def cells_on_photo(cells: np.ndarray, width: int, height: int) -> np.ndarray:
    """(G, G) bool -> (height, width) bool: each cell as the block of the photo it covers (pixel-centre
    alignment, as upsample_alpha's mode="nearest")."""
    c = torch.as_tensor(np.asarray(cells, dtype=np.float32))[None, None]  # (1, 1, G, G)
    return F.interpolate(c, size=(height, width), mode="nearest-exact")[0, 0].numpy() > 0.5


def half_level(alpha: np.ndarray) -> float:
    """The level of the half-attention region relative to the word's peak: its weakest cell over the strongest.
    The drawn map at or above it is the region (exactly its cells with mode="nearest"; with bilinear, the same
    cells' centres joined smoothly)."""
    a = np.asarray(alpha, dtype=np.float64)
    return float(a[half_mass_cells(a)].min() / max(float(a.max()), 1e-12))


def brightness(m: np.ndarray, inside: np.ndarray) -> np.ndarray:
    """The light mask: the share of the photo's brightness kept at attention m (relative to the word's peak, in
    [0, 1]), LIT_FLOOR at none rising linearly to 1 at the peak, times DIMMED outside the half-attention region.
    Linear in m on each side of the region's edge: no contrast curve, no level the map does not have."""
    return (LIT_FLOOR + (1 - LIT_FLOOR) * m) * np.where(inside, 1.0, DIMMED)


def _outline(inside: np.ndarray) -> np.ndarray:
    """(H, W) bool: a line just outside the region's edge, about OUTLINE_SHARE of the photo's shorter side wide
    (at least one pixel)."""
    width = max(1, round(min(inside.shape) * OUTLINE_SHARE))
    grown = Image.fromarray(inside.astype(np.uint8) * 255, mode="L").filter(ImageFilter.MaxFilter(2 * width + 1))
    return (np.asarray(grown) > 0) & ~inside


def overlay(image: Image.Image, alpha: np.ndarray, opacity: float = 1.0, smooth: float = 0.0,
            cmap: str = LIGHT, beta: float | None = None, mode: str = "bilinear", outline: bool = True
            ) -> Image.Image:
    """The photo with one word's attention drawn on it, same size as the photo. The default (LIGHT) is the
    paper's light mask: the smallest region holding half the word's attention (half_mass_cells) lit, the rest
    dimmed, brighter with more attention on either side (brightness; nothing tinted), the region outlined
    (outline=False leaves the line out). `opacity` scales the whole effect (0: the bare photo).
    Any matplotlib colour map name (e.g. "inferno") blends that heat map over the photo instead.
    beta (the word's gate, None = unknown) scales the effect: what reached the word is beta * alpha."""
    image = image.convert("RGB")
    w, h = image.size
    m = upsample_alpha(alpha, w, h, smooth, mode)  # (H, W), 1 where the word looked most
    base = np.asarray(image, dtype=np.float32)  # (H, W, 3)
    strength = float(np.clip(opacity, 0.0, 1.0)) * (1.0 if beta is None else float(np.clip(beta, 0.0, 1.0)))
    if cmap == LIGHT:
        # (H, W): the half-attention region; blurred, the smallest part of the blurred map holding half its mass
        inside = m >= half_level(m if smooth > 0 else alpha) - 1e-6
        out = base * (1 - strength * (1 - brightness(m, inside)))[..., None]
        if outline and strength > 0 and not inside.all():
            line = _outline(inside)
            out[line] = out[line] * (1 - strength) + np.float32(OUTLINE_GREY) * strength
    else:
        from matplotlib import colormaps

        heat = (colormaps[cmap](m)[..., :3] * 255).astype(np.float32)  # (H, W, 3)
        weight = (strength * (0.25 + 0.75 * m))[..., None]  # strongest where the model looked
        out = base * (1 - weight) + heat * weight
    return Image.fromarray(out.clip(0, 255).astype(np.uint8))


def word_beta(caption: "Caption", i: int) -> float | None:
    """The gate of word i, or None when the caption carries no betas."""
    betas = getattr(caption, "betas", None)
    return float(betas[i]) if betas is not None and len(betas) == len(caption.words) else None


GATE_OPEN = 0.95  # every word's beta at or above this: the gate is open, nothing to show per word


def gate_open(caption: "Caption") -> bool:
    """Whether the caption's gate lets the whole attended context through for every word (beta >= GATE_OPEN).
    The bundled model's is open: Flickr8k val (1,000 photos, 9,995 words, beam 5) median beta 0.9997, p1 0.987,
    97% of words shown as 1.00, 12 words below 0.95 (minimum 0.77); coco-paired val (200 photos, 1,947 words)
    median 0.9998, p1 0.984, 6 below 0.95 (minimum 0.81). So the page and the figures say so once instead of
    printing "β=1.00" under every word, and print betas only for the rare caption where a word's gate closes."""
    betas = getattr(caption, "betas", None)
    return betas is not None and len(betas) == len(caption.words) and bool((np.asarray(betas) >= GATE_OPEN).all())


def shown_beta(caption: "Caption", i: int) -> float | None:
    """The beta to print beside word i: its gate where the caption's gates vary, None where they do not
    (gate_open) or are unknown. The overlays still scale the heat by every beta (word_beta)."""
    return None if gate_open(caption) else word_beta(caption, i)


def word_title(word: str, beta: float | None, prob: float | None = None) -> str:
    """'dog  p=0.61  β=0.82': the word, its probability under the model and its gate (each left out when
    unknown)."""
    p = "" if prob is None else f"  {prob_text(prob)}"
    return word + p + ("" if beta is None else f"  β={beta:.2f}")


def prob_text(prob: float) -> str:
    """'p=0.61'; a tiny probability as 'p=3e-03', never 'p=0.00'."""
    return f"p={prob:.2f}" if prob >= 0.01 else f"p={prob:.0e}"


def word_prob(caption: "Caption", i: int) -> float | None:
    """The model's probability of word i (exp of its log-probability), None when the caption carries none."""
    lps = getattr(caption, "word_log_probs", None)
    return float(np.exp(lps[i])) if lps is not None and len(lps) == len(caption.words) else None


def letterbox(image: Image.Image, max_aspect: float = MAX_ASPECT, fill: tuple[int, int, int] = (255, 255, 255)
              ) -> Image.Image:
    """The image centred on a `fill` canvas that is at most max_aspect:1 either way (unchanged when it
    already is): a 10000x50 strip becomes a readable 10000x3333 panel, not a 1-pixel line."""
    w, h = image.size
    W, H = max(w, round(h / max_aspect)), max(h, round(w / max_aspect))
    if (W, H) == (w, h):
        return image
    canvas = Image.new("RGB", (W, H), fill)
    canvas.paste(image.convert("RGB"), ((W - w) // 2, (H - h) // 2))
    return canvas


SCALE_WORDS = ("half the attention (outlined)", "the rest",
               "brighter = more attention, up to the word's own peak")  # what the scale's two rows and ramp mean


def scale_rows(n: int = 256) -> np.ndarray:
    """(2, n) brightness kept from no attention to the word's peak (left to right): inside the half-attention
    region (row 0) and outside it (row 1): the light mask's own rule (brightness), for the scale."""
    m = np.linspace(0, 1, n, dtype=np.float32)[None, :]  # (1, n)
    return np.concatenate([brightness(m, np.ones_like(m, bool)), brightness(m, np.zeros_like(m, bool))])


def _scale(fig: "Figure", bottom: float, tall: float, left: float = 0.4, wide: float = 0.22) -> None:
    """The light mask's scale in the figure band [bottom, bottom + tall] (figure fractions), its ramp at
    [left, left + wide]: a ramp per row (the half-attention region, the rest) from no attention to the word's own
    peak, with its words either side."""
    ax = fig.add_axes((left, bottom, wide, tall))
    ax.imshow(scale_rows(), cmap="gray", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_label("scale")
    for row, words in enumerate(SCALE_WORDS[:2]):
        fig.text(left - 0.01, bottom + tall * (0.75 - 0.5 * row), words, ha="right", va="center", fontsize=9)
    fig.text(left + wide + 0.01, bottom + tall / 2, SCALE_WORDS[2], ha="left", va="center", fontsize=9)


@functools.lru_cache(maxsize=1)
def scale_png(width: float = 9.0) -> bytes:
    """The figures' scale alone (the app shows it beside its overlays), as PNG bytes: its words fit `width`
    inches."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, SCALE_INCHES))
    _scale(fig, 0.2, 0.6, left=0.28, wide=0.22)
    return figure_png(fig, dpi=110)


def attention_figure(image: Image.Image, caption: "Caption", cols: int = 5, opacity: float = 1.0,
                     smooth: float = 0.0, panel_width: float = 2.6, mode: str = "bilinear",
                     title: str | None = None, outline: bool = True) -> "Figure":
    """One panel per word (plus the photo), each the photo under that word's light mask (overlay), titled with
    the word, its probability and its gate beta (grey below LOW_BETA; the mask scaled by beta), the caption on top
    (or `title`: an explained sentence says it is one) and a scale below. Each panel shows the
    photo at most PANEL_PIXELS on its longer side, letterboxed to at most MAX_ASPECT:1 (an extreme
    photo keeps its shape inside a white band instead of making the figure a strip or a tower)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    n = len(caption.words) + 1
    cols = max(1, min(cols, n))
    rows = (n + cols - 1) // cols
    image = image.convert("RGB")
    image.thumbnail((PANEL_PIXELS, PANEL_PIXELS))  # a copy by convert; overlays are computed at this size
    w, h = letterbox(image).size
    panel_h = panel_width * h / w
    # every panel has the same size, so the layout is computed here, once: each row gets TITLE_INCHES above its
    # photos for the word titles (tight_layout let the second row's titles run into the first row's photos) and
    # the caption CAPTION_INCHES on top. Matplotlib's constrained layout found the same places by measuring every
    # title at every draw, a large share of a figure's time (measured with PNG_COMPRESSION: docs/performance.md)
    height = rows * (panel_h + TITLE_INCHES) + CAPTION_INCHES + SCALE_INCHES
    fig = Figure(figsize=(cols * panel_width, height))
    fig.subplots_adjust(left=0.005, right=0.995, bottom=SCALE_INCHES / height,
                        top=1 - (CAPTION_INCHES + TITLE_INCHES) / height,
                        wspace=0.04, hspace=TITLE_INCHES / panel_h)
    for k in range(rows * cols):
        ax = fig.add_subplot(rows, cols, k + 1)
        ax.axis("off")
        if k == 0:
            ax.imshow(letterbox(image))
            ax.set_title("input", fontsize=10)
        elif k < n:
            beta = word_beta(caption, k - 1)
            ax.imshow(letterbox(overlay(image, caption.alphas[k - 1], opacity, smooth, beta=beta, mode=mode,
                                                 outline=outline)))
            low = beta is not None and beta < LOW_BETA
            ax.set_title(word_title(caption.words[k - 1], shown_beta(caption, k - 1), word_prob(caption, k - 1)),
                         fontsize=10, color="0.55" if low else "black")
    fig.suptitle(caption.text if title is None else title, fontsize=12, y=1 - 0.08 / height, va="top")
    _scale(fig, 0.1 / height, (SCALE_INCHES - 0.16) / height)
    return fig


def explained_title(sentence: str) -> str:
    """An explained sentence's figure title: 'explained: "a dog runs"', so that it never reads as a caption the
    model wrote."""
    return f'explained: "{sentence}" (each word\'s probability and attention as the model reads it)'



def figure_png(fig: "Figure", dpi: int = 100) -> bytes:
    """The figure as PNG bytes, at `dpi` or lower so that it holds at most MAX_FIGURE_PIXELS pixels."""
    w_in, h_in = fig.get_size_inches()
    dpi = min(float(dpi), (MAX_FIGURE_PIXELS / max(w_in * h_in, 1e-9)) ** 0.5)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, pil_kwargs={"compress_level": PNG_COMPRESSION})
    return buf.getvalue()


def caption_json_bytes(caption: "Caption", image_name: str | None = None) -> bytes:
    """The app's download: Caption.to_dict (with the caption's own settings and model file), the shape of
    captioner-caption --json --maps."""
    return json.dumps(caption.to_dict(image_name, maps=True)).encode()
