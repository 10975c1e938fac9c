"""Attention overlays: where each word looked, drawn on the ORIGINAL photo.

The grid covers the whole (uncropped) network input, which is the whole photo resized, so a map
stretched over the photo's own width and height lines up with its content. Maps are upsampled
smoothly (bicubic, like the paper's figures) with pixel-centre alignment: grid cell (i, j) covers
rows [i*H/G, (i+1)*H/G) and columns [j*W/G, (j+1)*W/G) of the photo. Nothing here calls plt.show().
"""
from __future__ import annotations

import io
import json
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageFilter

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .api import Caption


def upsample_alpha(alpha: np.ndarray, width: int, height: int, smooth: float = 0.0) -> np.ndarray:
    """alpha (G, G) -> (height, width) map in [0, 1] (scaled so its maximum is 1).
    smooth: Gaussian blur radius in grid cells (0 = none)."""
    a = torch.as_tensor(np.asarray(alpha, dtype=np.float32))[None, None]  # (1, 1, G, G)
    up = F.interpolate(a, size=(height, width), mode="bicubic", align_corners=False)[0, 0].clamp_(min=0)
    m = up.numpy()
    if smooth > 0:
        radius = smooth * max(width, height) / alpha.shape[-1]
        # 8 bits suffice: the colour map has 256 levels (Pillow cannot blur float images)
        im = Image.fromarray(np.round(m / max(float(m.max()), 1e-12) * 255).astype(np.uint8), mode="L")
        m = np.asarray(im.filter(ImageFilter.GaussianBlur(radius)), dtype=np.float32)
    return m / max(float(m.max()), 1e-12)


def overlay(image: Image.Image, alpha: np.ndarray, opacity: float = 0.6, smooth: float = 0.0,
            cmap: str = "jet") -> Image.Image:
    """The photo with one word's attention drawn over it as a heat map, same size as the photo."""
    from matplotlib import colormaps

    image = image.convert("RGB")
    w, h = image.size
    m = upsample_alpha(alpha, w, h, smooth)  # (H, W)
    heat = (colormaps[cmap](m)[..., :3] * 255).astype(np.float32)  # (H, W, 3)
    base = np.asarray(image, dtype=np.float32)
    weight = opacity * (0.25 + 0.75 * m[..., None])  # strongest where the model looked
    out = base * (1 - weight) + heat * weight
    return Image.fromarray(out.clip(0, 255).astype(np.uint8))


def attention_figure(image: Image.Image, caption: "Caption", cols: int = 5, opacity: float = 0.6,
                     smooth: float = 0.0, panel_width: float = 2.6) -> "Figure":
    """One panel per word (plus the photo), each the photo with that word's attention."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    n = len(caption.words) + 1
    cols = max(1, min(cols, n))
    rows = (n + cols - 1) // cols
    w, h = image.size
    panel_h = panel_width * h / w
    fig = Figure(figsize=(cols * panel_width, rows * (panel_h + 0.35)))
    for k in range(rows * cols):
        ax = fig.add_subplot(rows, cols, k + 1)
        ax.axis("off")
        if k == 0:
            ax.imshow(image)
            ax.set_title("input", fontsize=10)
        elif k < n:
            ax.imshow(overlay(image, caption.alphas[k - 1], opacity, smooth))
            ax.set_title(caption.words[k - 1], fontsize=11)
    fig.suptitle(caption.text, fontsize=12)
    fig.tight_layout()
    return fig


def figure_png(fig: "Figure", dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def caption_json(caption: "Caption", image_name: str | None = None) -> dict[str, Any]:
    """JSON-ready record: caption, log-prob, words with their attention grids."""
    return {"image": image_name, "caption": caption.text, "log_prob": caption.log_prob,
            "grid": list(caption.alphas.shape[1:]),
            "words": [{"word": w, "alpha": np.round(a, 5).tolist()} for w, a in zip(caption.words, caption.alphas)],
            "alternatives": [{"caption": t, "log_prob": lp} for t, lp in caption.alternatives]}


def caption_json_bytes(caption: "Caption", image_name: str | None = None) -> bytes:
    return json.dumps(caption_json(caption, image_name)).encode()
