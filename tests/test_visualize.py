"""Attention drawing (captioner/ui/visualize.py): faithful upsampling and the gate beta on every word."""
from __future__ import annotations

import dataclasses

import json

import numpy as np
import pytest
from PIL import Image

from captioner.ui import visualize
from captioner.api import Caption


def caption(betas=(0.9, 0.1)) -> Caption:
    rng = np.random.default_rng(0)
    a = rng.random((2, 3, 3)).astype(np.float32)
    return Caption("a dog", ["a", "dog"], a / a.sum(axis=(1, 2), keepdims=True), -1.0,
                   betas=np.asarray(betas, np.float32))


def photo(w: int = 45, h: int = 30) -> Image.Image:
    return Image.fromarray(np.random.default_rng(1).integers(0, 255, (h, w, 3), dtype=np.uint8))


def test_nearest_draws_the_cells_as_blocks():
    a = np.arange(6, dtype=np.float32).reshape(2, 3) + 1
    up = visualize.upsample_alpha(a, 30, 20, mode="nearest")  # cells of 10x10 pixels
    assert np.array_equal(up, np.kron(a / a.max(), np.ones((10, 10))))


def test_bilinear_keeps_cell_values_and_invents_no_extremes():
    a = np.zeros((5, 5), np.float32)
    a[2, 2] = 1.0  # one hot cell: bicubic would ring below 0 / halo around it
    up = visualize.upsample_alpha(a, 55, 55)  # 11 pixels per cell: pixel 5 + 11 i is the centre of cell i
    assert np.allclose(up[5::11, 5::11], a)  # cell centres carry the cell values
    assert up.min() >= 0 and up.max() == pytest.approx(1.0)
    assert (up[:, :11] == 0).all() and (up[:11] == 0).all()  # nothing spills beyond the neighbouring cell
    with pytest.raises(ValueError, match="bilinear, nearest"):
        visualize.upsample_alpha(a, 10, 10, mode="bicubic")


def test_beta_scales_the_heat():
    img, a = photo(), caption().alphas[0]
    bare = visualize.overlay(img, a, opacity=0.8, beta=0.0)
    assert np.array_equal(np.asarray(bare), np.asarray(img))  # the word took nothing from the image
    full = visualize.overlay(img, a, opacity=0.8, beta=1.0)
    assert np.array_equal(np.asarray(full), np.asarray(visualize.overlay(img, a, opacity=0.8)))
    half = np.asarray(visualize.overlay(img, a, opacity=0.8, beta=0.5), np.float32)
    diff = lambda x: np.abs(np.asarray(x, np.float32) - np.asarray(img, np.float32)).mean()  # noqa: E731
    assert 0.3 * diff(full) < np.abs(half - np.asarray(img, np.float32)).mean() < 0.7 * diff(full)


def test_figure_titles_and_json_carry_beta():
    cap = caption()
    fig = visualize.attention_figure(photo(), cap)
    titles = {ax.get_title(): ax.title.get_color() for ax in fig.axes if ax.get_title()}
    assert "a  β=0.90" in titles and "dog  β=0.10" in titles
    assert titles["dog  β=0.10"] != titles["a  β=0.90"]  # the low-beta word is greyed
    record = json.loads(visualize.caption_json_bytes(cap, "x.jpg"))
    assert record["betas"] == [pytest.approx(0.9), pytest.approx(0.1)] and record["words"] == cap.words
    assert np.allclose(record["alphas"], cap.alphas, atol=1e-5)  # the download carries the maps
    # a caption without betas: plain titles, null betas
    plain = Caption("a dog", cap.words, cap.alphas, -1.0)
    assert visualize.word_title("dog", visualize.word_beta(plain, 1)) == "dog"
    assert plain.to_dict()["betas"] == [None, None]
    assert plain.to_dict()["word_log_probs"] == plain.to_dict()["word_probs"] == [None, None]
    scored = Caption("a dog", cap.words, cap.alphas, -1.0, word_log_probs=np.array([-0.25, -0.5], np.float32))
    assert scored.to_dict()["word_log_probs"] == [-0.25, -0.5]
    assert scored.to_dict()["word_probs"] == [pytest.approx(np.exp(-0.25), abs=1e-5), pytest.approx(np.exp(-0.5), abs=1e-5)]


@pytest.mark.parametrize("size", [(50, 10000), (10000, 50), (640, 480)])
def test_figures_of_extreme_photos_are_capped_in_size_and_aspect(bundled, size):
    """A 50x10000 photo gave a 1300x88816 PNG (Pillow: decompression bomb); a 10000x50 one gave
    1-pixel strips. Panels are letterboxed to at most MAX_ASPECT:1 and the PNG stays under
    MAX_FIGURE_PIXELS, whatever the photo; an ordinary photo is drawn as before (no bands)."""
    import io
    import warnings

    model = bundled
    img = photo(*size)
    cap = model.caption(img, beam_size=1)
    assert cap.words
    png = visualize.figure_png(visualize.attention_figure(img, cap))
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        fig = Image.open(io.BytesIO(png))
        fig.load()
    w, h = fig.size
    assert w * h <= visualize.MAX_FIGURE_PIXELS
    rows = -(-(len(cap.words) + 1) // 5)
    panel_h = h / rows  # each row of panels is at least a third of a panel's width tall: no strips
    panel_w = w / min(5, len(cap.words) + 1)
    assert panel_h >= panel_w / visualize.MAX_ASPECT and panel_h <= panel_w * (visualize.MAX_ASPECT + 0.5)
    boxed = visualize.letterbox(img)
    assert max(boxed.size) / min(boxed.size) <= visualize.MAX_ASPECT + 0.01
    assert (boxed is img) == (size == (640, 480))


def test_png_pixel_cap_lowers_dpi_only_when_needed():
    from matplotlib.figure import Figure

    small = Image.open(__import__("io").BytesIO(visualize.figure_png(Figure(figsize=(4, 3)))))
    assert small.size == (400, 300)  # the requested dpi
    huge = Image.open(__import__("io").BytesIO(visualize.figure_png(Figure(figsize=(10, 900)))))
    assert huge.size[0] * huge.size[1] <= visualize.MAX_FIGURE_PIXELS and huge.size[1] / huge.size[0] == pytest.approx(90, rel=0.02)


def test_an_open_gate_is_said_once_not_per_word():
    """The bundled model's gate is open (beta ~1 for every word): figures and the caption line stop printing
    "β=1.00" per word as if it varied; a caption whose gates vary keeps them; the JSON always has them."""
    from captioner.ui import html as H

    open_cap = caption(betas=(0.999, 0.97))
    assert visualize.gate_open(open_cap) and not visualize.gate_open(caption())
    assert [visualize.shown_beta(open_cap, i) for i in range(2)] == [None, None]
    assert visualize.shown_beta(caption(), 1) == pytest.approx(0.1)
    assert H.beta_line(open_cap) == "" and H.beta_line(caption()) != ""
    fig = visualize.attention_figure(Image.new("RGB", (64, 48)), open_cap)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles and not any("β" in t for t in titles), titles
    assert open_cap.to_dict(maps=False)["betas"] == pytest.approx([0.999, 0.97], abs=1e-4)


@pytest.mark.parametrize("size", [(640, 480), (480, 640), (1000, 300)])
def test_word_titles_never_overlap_the_row_above(size):
    """A 9-word caption is two rows of panels: each second-row word title sits below the first row's photos
    (tight_layout let them run into the photos of the figure ZIP), and the caption on top clears the first row."""
    words = "a man in a red shirt rides a bike".split()
    rng = np.random.default_rng(0)
    a = rng.random((len(words), 3, 3)).astype(np.float32)
    cap = Caption(" ".join(words), words, a / a.sum(axis=(1, 2), keepdims=True), -1.0)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = visualize.attention_figure(photo(*size), cap)
    canvas = FigureCanvasAgg(fig)  # as figure_png draws it
    canvas.draw()
    renderer = canvas.get_renderer()
    image_axes = [ax for ax in fig.axes if ax.images and ax.get_title()]  # the panels, not the scale below
    rows = sorted({round(ax.get_position().y0, 3) for ax in image_axes}, reverse=True)
    assert len(rows) == 2
    top = [ax for ax in image_axes if round(ax.get_position().y0, 3) == rows[0]]
    second = [ax for ax in image_axes if round(ax.get_position().y0, 3) == rows[1]]
    top_bottom = min(ax.get_window_extent(renderer).y0 for ax in top)
    for ax in second:
        assert ax.title.get_window_extent(renderer).y1 <= top_bottom, ax.get_title()
    suptitle = fig._suptitle.get_window_extent(renderer)
    assert all(ax.title.get_window_extent(renderer).y1 <= suptitle.y0 for ax in top)


def test_the_light_mask_dims_without_tinting_and_figures_carry_a_scale_and_probabilities():
    """Figures as clear as the paper's: the photo dimmed where the word looked little, never tinted (jet's blue
    turned white areas cyan), each panel titled with its word's probability, a scale below; an explained
    sentence's figure says it is one."""
    white = Image.new("RGB", (60, 60), (255, 255, 255))
    a = np.zeros((3, 3), np.float32)
    a[0, 0] = 1.0
    lit = np.asarray(visualize.overlay(white, a, outline=False), np.int32)
    assert (lit[..., 0] == lit[..., 1]).all() and (lit[..., 1] == lit[..., 2]).all()  # grey levels only: no tint
    # the peak as is, the rest (outside the half-attention region, no attention) dimmed to the scale's darkest
    assert lit[5, 5, 0] == 255 and abs(lit[55, 55, 0] - 255 * visualize.scale_rows()[1, 0]) <= 1
    cap = dataclasses.replace(caption(), word_log_probs=np.log(np.array([0.5, 0.25], np.float32)))
    fig = visualize.attention_figure(photo(), cap, title=visualize.explained_title("a dog"))
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert "a  p=0.50  β=0.90" in titles and "dog  p=0.25  β=0.10" in titles
    assert fig._suptitle.get_text().startswith('explained: "a dog"')
    scale = [ax for ax in fig.axes if ax.images and not ax.get_title()]
    assert len(scale) == 1 and scale[0].get_label() == "scale"
    words = [t.get_text() for t in fig.texts]
    assert all(w in words for w in visualize.SCALE_WORDS) and "peak" in visualize.SCALE_WORDS[2]
    assert visualize.word_title("cup", None, 0.003) == "cup  p=3e-03"  # a tiny probability is not "0.00"
    assert visualize.attention_figure(photo(), cap)._suptitle.get_text() == cap.text  # a caption: as written


def test_the_half_attention_region_is_lit_and_the_rest_dimmed():
    """A synthetic map whose half of the attention sits in a known block of cells: that block, and only it, is
    the half-attention region, and the default overlay draws it at least 2.5x brighter than the rest on a
    uniform photo (the contrast the app promises: bench/overlay_contrast.py measures it on real photos)."""
    from captioner.bench.overlay_contrast import region_contrast, word_contrast

    a = np.full((7, 7), 0.5 / 45, np.float32)  # the other half spread over 45 cells ...
    a[2:4, 3:5] = 0.5 / 4  # ... half of it in these 4 cells
    cells = visualize.half_mass_cells(a)
    assert cells.sum() == 4 and cells[2:4, 3:5].all()
    region = visualize.cells_on_photo(cells, 70, 70)
    assert region.sum() == 400 and region[20:40, 30:50].all()
    grey = Image.new("RGB", (70, 70), (180, 180, 180))
    assert region_contrast(grey, region) == pytest.approx(1.0)  # the bare photo does not tell them apart
    for mode in visualize.MODES:
        drawn = lambda im, al, b, mode=mode: visualize.overlay(im, al, beta=b, mode=mode)  # noqa: E731
        assert word_contrast(grey, a, None, drawn) >= 2.5, mode
    assert word_contrast(grey, a, 0.0) == pytest.approx(1.0)  # a closed gate: nothing drawn
    # a flat map: no region stands out and the drawing invents none
    flat = visualize.overlay(grey, np.full((7, 7), 1 / 49, np.float32))
    assert np.ptp(np.asarray(flat, np.int32)) <= 1


def test_the_light_mask_is_linear_in_attention_on_each_side_of_the_region():
    """No contrast curve: along a ramp of attention the kept brightness rises in equal steps (linear in the
    word's attention relative to its peak) inside the region and outside it, and never falls."""
    rows = visualize.scale_rows(11)
    assert np.allclose(np.diff(rows[0]), np.diff(rows[0])[0]) and np.allclose(np.diff(rows[1]), np.diff(rows[1])[0])
    assert rows[0, -1] == pytest.approx(1.0) and (rows[1] < rows[0]).all() and (np.diff(rows) > 0).all()
