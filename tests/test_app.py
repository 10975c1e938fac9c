"""The Streamlit app (app.py), driven in-process with streamlit.testing.v1.AppTest.

Uses the bundled default model when it exists; otherwise a development checkpoint
(CAPTIONER_CHECKPOINT if set, else /tmp/devmodel/placeholder.safetensors) is passed to the app
through CAPTIONER_CHECKPOINT; with neither, the tests are skipped.
"""
from __future__ import annotations

import dataclasses
import io
import os
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import captioner
from captioner.ui import gallery
from captioner.ui.page_views import LEVEL_ICONS, SCALE_CAPTION
from captioner import images

pytest.importorskip("streamlit.testing.v1", reason="streamlit's AppTest is not available")
from streamlit.testing.v1 import AppTest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "app.py"
EXAMPLES = ROOT / "captioner" / "assets" / "examples"
DEV_CHECKPOINT = Path("/tmp/devmodel/placeholder.safetensors")
TIMEOUT = 120


@pytest.fixture
def app(monkeypatch) -> AppTest:
    """A fresh AppTest of app.py, with a usable model selected (or the test skipped)."""
    if captioner.DEFAULT_CHECKPOINT.is_file():
        monkeypatch.delenv("CAPTIONER_CHECKPOINT", raising=False)  # the app must open on the default
    else:
        dev = Path(os.environ.get("CAPTIONER_CHECKPOINT") or DEV_CHECKPOINT)
        if not dev.is_file():
            pytest.skip(f"no model to run the app with: the bundled default model "
                        f"{captioner.DEFAULT_CHECKPOINT} is missing and there is no development checkpoint "
                        f"(set CAPTIONER_CHECKPOINT or create {DEV_CHECKPOINT})")
        monkeypatch.setenv("CAPTIONER_CHECKPOINT", str(dev))
    monkeypatch.chdir(ROOT)
    return AppTest.from_file(str(APP), default_timeout=TIMEOUT)


@pytest.fixture
def bench(app) -> AppTest:
    """The app with its attention workbench switched on (page_workbench.workbench_on: off when a page opens)."""
    app.session_state["workbench_wanted"] = True
    return app


# ----------------------------------------------------------------------------- reading the page

def errors_of(at: AppTest) -> list:
    """The page's error boxes that say something went wrong (a probably wrong caption's box is an error box too:
    page_views.level_box; it is the caption's level, not a problem)."""
    return [e for e in at.error if e.icon != LEVEL_ICONS["probably wrong"]]


def level_boxes(at: AppTest) -> list:
    """The boxes an unsure caption's line goes in: info, warning, and the probably wrong error box."""
    return [*at.info, *at.warning, *[e for e in at.error if e.icon == LEVEL_ICONS["probably wrong"]]]


def no_problems(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not errors_of(at), [e.value for e in errors_of(at)]


def caption_text(at: AppTest) -> str:
    """The caption shown as “...” (empty string for an empty caption)."""
    heads = [h.value for h in at.subheader if h.value.startswith("“")]
    assert len(heads) == 1, heads
    return heads[0].split("”")[0].lstrip("“")


def sure_lines(at: AppTest) -> list[str]:
    """The plain-words line under the caption that says how sure it is (ui/texts.sure_line)."""
    from captioner.ui.texts import NO_CONFIDENCE

    said = [c.value for c in at.caption] + [b.value for b in level_boxes(at)]
    return [x for x in said if x.startswith(LEVEL_LINES) or x == NO_CONFIDENCE]


LEVEL_LINES = ("Sure: ", "Probably right (", "May be wrong (", "Probably wrong (")  # ui/texts.sure_line


BETA = re.compile(r" \(β=(\d\.\d\d)\)$")  # the gate beta after a word: "3. dog p=0.61 (β=0.82)"
PROB = re.compile(r" p=(\d\.\d\d|\de-\d\d)\b")  # the word's probability: "3. dog p=0.61", "p=3e-03"


def word_overlays(at: AppTest) -> list[str]:
    """Captions of the per-word grid images without their probability and beta, '1. word', '2. word', ..."""
    caps = [c for im in at.image for c in im.captions]
    return [PROB.sub("", BETA.sub("", c)) for c in caps if c.split(". ", 1)[0].isdigit()]


def overlay_betas(at: AppTest) -> list[float]:
    """The beta shown in each per-word grid caption."""
    caps = [c for im in at.image for c in im.captions if c.split(". ", 1)[0].isdigit()]
    found = [BETA.search(c) for c in caps]
    assert all(found), caps
    return [float(m.group(1)) for m in found]


def beta_line(at: AppTest) -> list[tuple[str, float]]:
    """(word, beta) pairs of the caption line drawn with each word's opacity."""
    html = [m.value for m in at.markdown if 'class="beta-line"' in m.value]
    assert len(html) == 1, [m.value for m in at.markdown]
    pairs = re.findall(r'opacity:([\d.]+)">([^<]*)<br><small[^>]*>β=(\d\.\d\d)</small>', html[0])
    for opacity, _, b in pairs:  # opacity follows beta (floored at 0.2 to stay readable)
        assert float(opacity) == pytest.approx(max(0.2, float(b)), abs=0.011)
    return [(w, float(b)) for _, w, b in pairs]


def photo_caption(at: AppTest) -> str:
    caps = [c for im in at.image for c in im.captions if c.endswith(")") and "x" in c]
    assert caps, [im.captions for im in at.image]
    return caps[0]


def beam(at: AppTest):
    return next(s for s in at.sidebar.slider if s.label == "Beam size")


def check_captioned(at: AppTest, require_words: bool = True) -> list[str]:
    """The page shows a caption, one overlay per word in the grid, and the large single-word view."""
    no_problems(at)
    words = caption_text(at).split()
    if require_words:
        assert words, "empty caption"
    assert word_overlays(at) == [f"{i + 1}. {w}" for i, w in enumerate(words)]
    if words and any("is open for every word" in c.value for c in at.caption):  # the gate never varies: said once
        grid = [c for im in at.image for c in im.captions if c.split(". ", 1)[0].isdigit()]
        assert not any(BETA.search(c) for c in grid), grid  # no "β=1.00" under every word
        assert not [m.value for m in at.markdown if 'class="beta-line"' in m.value]
    elif words:  # the gates vary: every word shows its beta, in the grid and in the caption line
        betas = overlay_betas(at)
        assert len(betas) == len(words) and all(0 <= b <= 1 for b in betas)
        assert beta_line(at) == list(zip(words, betas))
    large = [c for im in at.image for c in im.captions if c.startswith("where “") and " looked (word " in c]
    assert len(large) == (1 if words else 0)
    if words:  # the views carry what the figure carries: each word's probability and the overlays' scale
        grid = [c for im in at.image for c in im.captions if c.split(". ", 1)[0].isdigit()]
        assert all(PROB.search(c) for c in grid + large), grid + large
        assert len([im for im in at.image if SCALE_CAPTION in im.captions]) >= 2  # the word view's, each grid's
    labels = [b.label for b in at.download_button]
    assert any("PNG" in lb for lb in labels) and any("JSON" in lb for lb in labels), labels
    return words


def png_bytes(path: Path, fmt: str = "PNG", **kw) -> bytes:
    return png_bytes_of(Image.open(path), fmt, **kw)


def png_bytes_of(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def huge_png_header(width: int = 30_000, height: int = 30_000) -> bytes:
    """A tiny PNG whose header declares an enormous image (decompression bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


# ----------------------------------------------------------------------------- tests

@pytest.mark.slow
def test_example_photo_is_captioned_then_beam_size_changes(app):
    at = app.run()
    no_problems(at)
    assert "cat.jpg (451x300)" in photo_caption(at)  # the default example, at its own size and aspect
    assert sure_lines(at), "no line says how sure the caption is"  # sure, not sure and why, or that it cannot say
    beam(at).set_value(1).run()  # greedy: a non-empty caption even from an untrained model
    words = check_captioned(at)
    # the large view opens on the caption's first noun, then follows the word selector
    if len(words) > 1:
        from captioner.ui.page_views import first_noun

        assert at.select_slider[0].value == first_noun(words)
        at.select_slider[0].set_value(len(words) - 1).run()
        no_problems(at)
        large = [c for im in at.image for c in im.captions if c.startswith("where “") and " looked (word " in c]
        assert len(large) == 1 and large[0].startswith(f"where “{words[-1]}” looked (word {len(words)} of "
                                                       f"{len(words)}")
        gate_open = any("is open for every word" in c.value for c in at.caption)
        assert ("β=" in large[0]) != gate_open  # its beta only where the gates vary
    # another beam size and another example photo: still fine
    beam(at).set_value(4).run()
    check_captioned(at, require_words=False)
    example = next(s for s in at.selectbox if "example" in s.label)
    example.set_value("Coffee").run()
    check_captioned(at, require_words=False)
    assert "coffee.jpg (600x400)" in photo_caption(at)


def test_a_validation_figure_from_a_few_photos_is_labelled_as_such():
    """The sidebar showed "validation CIDEr 1.666" for a taught model (5 val photos) beside 0.614 for the bundled
    one (1,200 photos), as if comparable."""
    from captioner.ui.page_state import model_info

    from .conftest import tiny_captioner

    model = tiny_captioner()
    model.metrics = {"val": {"CIDEr": 1.666, "n_images": 5}}
    assert model_info(model).endswith("| validation CIDEr 1.666 (5 photos: too few to compare)")
    model.metrics = {"val": {"CIDEr": 0.614, "flickr8k/n_images": 1000, "coco/n_images": 200}}  # a mix: each set's
    assert model_info(model).endswith("| validation CIDEr 0.614 (1,200 photos)")
    model.metrics = {"val": {"CIDEr": 0.5, "a/n_images": 1000, "b/n_images": 6}}
    assert model_info(model).endswith("(1,006 photos: too few to compare)")  # one set too small to compare
    model.metrics = {"val": {"CIDEr": 0.5}}  # a file that does not say
    assert model_info(model).endswith("| validation CIDEr 0.500")


@pytest.mark.parametrize("caption, noun", [("a brown dog runs on the grass", "dog"), ("a black and white cat", "cat"),
                                           ("a man in a red shirt", "man"), ("two young girls play", "girls"),
                                           ("a tennis player hits a ball", "player"), ("a street with a bus", "street"),
                                           ("a glimber is parked", "glimber"), ("a", "a")])
def test_the_word_view_opens_on_the_first_noun_not_the_colour_after_a(caption, noun):
    """The large word view opened on the first word after "a", often a colour ("brown"): now on the thing."""
    from captioner.ui.page_views import first_noun

    words = caption.split()
    assert words[first_noun(words)] == noun


@pytest.mark.parametrize("opacity, smooth, mode", [(0.3, 0.0, "nearest"), (1.0, 1.0, "bilinear"),
                                                   (0.0, 2.0, "bilinear")])
def test_overlay_opacity_and_smoothing(app, opacity, smooth, mode):
    at = app.run()
    for s in at.sidebar.slider:
        if s.label.startswith("Overlay opacity"):
            s.set_value(opacity)
        elif s.label.startswith("Smoothing"):
            s.set_value(smooth)
    next(s for s in at.sidebar.selectbox if s.label == "Map rendering").set_value(mode)
    beam(at).set_value(1)
    at.run()
    assert check_captioned(at)


def test_a_word_naming_an_object_the_encoder_barely_sees_is_pointed_out(bundled, app):
    """Its map may light something else (a trunk for "man", a mitt for "bat"): the word view says so, and only
    for such a word. The cat's caption names a wall the heads do not see (tests/test_confidence.py)."""
    at = app.run()
    cat = bundled.caption(EXAMPLES / "cat.jpg")
    assert cat.unsupported and caption_text(at) == cat.text
    said = lambda: [w.value for w in at.warning if "barely sees" in w.value]  # noqa: E731
    at.select_slider[0].set_value(cat.unsupported[0]).run()
    assert len(said()) == 1 and repr(cat.words[cat.unsupported[0]]) in said()[0]
    at.select_slider[0].set_value(next(i for i in range(len(cat.words)) if i not in cat.unsupported)).run()
    assert not said()


def test_each_word_shows_the_beta_the_model_computed(app, monkeypatch):
    """The betas on the page are the model's gates for those words (a model with varied gates)."""
    real_load = captioner.load

    def load_with_low_gates(*args, **kw):
        model = real_load(*args, **kw)
        with torch.no_grad():  # the bundled model's gates are all ~1; push them around 0.3-0.7
            model.model.decoder.attention.gate.weight.mul_(0.05)
            model.model.decoder.attention.gate.bias.fill_(0.0)
        return model

    import streamlit as st

    monkeypatch.setattr(captioner, "load", load_with_low_gates)
    st.cache_resource.clear()  # the app must load (and cache) the modified model ...
    st.cache_data.clear()
    try:
        at = app.run()
        beam(at).set_value(1).run()
        words = check_captioned(at)
    finally:  # ... and no later test may see it
        st.cache_resource.clear()
        st.cache_data.clear()
    ckpt = os.environ.get("CAPTIONER_CHECKPOINT") or None
    expected = load_with_low_gates(ckpt).caption(EXAMPLES / "cat.jpg", beam_size=1)  # the file's other settings
    assert words == expected.words
    assert overlay_betas(at) == pytest.approx(expected.betas.tolist(), abs=0.0051)
    assert any(b < 0.9 for b in overlay_betas(at))  # the gates really vary, so the check means something


@pytest.mark.slow
def test_uploads_in_every_format(app):
    at = app.run()
    beam(at).set_value(1).run()
    uploader = at.file_uploader[0]
    # the uploader accepts exactly the formats load_image reads and its errors list (one list: images.FORMATS);
    # it refused TIFF and PPM while the error named them
    assert {t.lstrip(".") for t in uploader.allowed_type} == set(images.file_extensions())
    assert uploader.label == f"Upload a photo ({images.format_names(' or ')})"
    assert {"tif", "tiff", "ppm"} <= set(images.file_extensions())
    photo = EXAMPLES / "coffee.jpg"
    for name, data, mime in [
        ("coffee.jpg", photo.read_bytes(), "image/jpeg"),
        ("coffee.png", png_bytes(photo), "image/png"),
        ("coffee.webp", png_bytes(photo, "WEBP", quality=80), "image/webp"),
        ("coffee.gif", png_bytes(photo, "GIF"), "image/gif"),
        ("coffee.bmp", png_bytes(photo, "BMP"), "image/bmp"),
        ("coffee.tiff", png_bytes(photo, "TIFF"), "image/tiff"),
        ("coffee.ppm", png_bytes(photo, "PPM"), "image/x-portable-pixmap"),
    ]:
        at.file_uploader[0].set_value((name, data, mime)).run()
        check_captioned(at)
        assert photo_caption(at) == f"{name} (600x400)"  # the original photo, aspect ratio kept


@pytest.mark.parametrize("name, data, message", [
    ("garbage.jpg", b"this is not a picture at all" * 10, "not an image"),
    ("truncated.jpg", (EXAMPLES / "cat.jpg").read_bytes()[:5000], "truncated"),
    ("empty.png", b"", "empty"),
    ("bomb.png", huge_png_header(), "too large"),
], ids=["garbage", "truncated", "empty", "decompression-bomb"])
def test_bad_upload_shows_an_error_and_the_app_recovers(app, name, data, message):
    at = app.run()
    beam(at).set_value(1).run()
    at.file_uploader[0].set_value((name, data, "image/jpeg")).run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in errors_of(at)]
    assert len(errors) == 1 and name in errors[0] and message in errors[0], errors
    assert not word_overlays(at)
    # a good photo afterwards is captioned as usual
    at.file_uploader[0].set_value(("cat.jpg", (EXAMPLES / "cat.jpg").read_bytes(), "image/jpeg")).run()
    check_captioned(at)
    # and removing the upload goes back to the example photos
    assert not at.file_uploader[0].value  # the box is empty, ready for the next photo (page_photo.take_upload)
    at.button(key="drop_upload").click().run()
    no_problems(at)
    assert "cat.jpg" in photo_caption(at)


def test_image_errors_speak_one_voice_and_a_new_upload_replaces_the_last_error(app):
    """12000x9000 got the project's "too large to decode safely (limit 100,000,000 pixels)" and 40000x40000
    Pillow's "could be decompression bomb DOS attack": one message now. Each upload's run shows only its
    own error: the previous file's error does not stay beside the next one's."""
    at = app.run()
    beam(at).set_value(1).run()
    shown = []
    for name, size in (("big.png", (12000, 9000)), ("huge.png", (40000, 40000)), ("garbage.jpg", None)):
        data = huge_png_header(*size) if size else b"not a picture" * 20
        at.file_uploader[0].set_value((name, data, "image/png")).run()
        assert not at.exception, [e.value for e in at.exception]
        errors = [e.value for e in errors_of(at)]
        assert len(errors) == 1 and name in errors[0], errors  # this file's error alone
        shown.append(errors[0])
    for text, (w, h) in zip(shown, ((12000, 9000), (40000, 40000))):
        assert f"{w}x{h} pixels is too large to decode safely (limit 100,000,000 pixels)" in text
        assert "decompression" not in text and "DOS" not in text
    assert f"({images.format_names()})" in shown[2]  # the formats named are the uploader's
    at.file_uploader[0].set_value(("cat.jpg", (EXAMPLES / "cat.jpg").read_bytes(), "image/jpeg")).run()
    check_captioned(at)  # no error left from the files before


def test_a_tiny_photo_gets_a_note(app):
    """A 10x10 photo got a confident caption and no word that the model saw almost nothing."""
    at = app.run()
    beam(at).set_value(1).run()
    tiny = Image.open(EXAMPLES / "cat.jpg").resize((10, 10))
    at.file_uploader[0].set_value(("tiny.png", png_bytes_of(tiny), "image/png")).run()
    check_captioned(at, require_words=False)
    side = workbench_model(at).config.model.image_size
    notes = [i.value for i in at.info if "10x10 pixels" in i.value]
    assert notes and f"far smaller than the model's {side}x{side} input" in notes[0], [i.value for i in at.info]
    at.file_uploader[0].set_value(("cat.jpg", (EXAMPLES / "cat.jpg").read_bytes(), "image/jpeg")).run()
    assert not [i.value for i in at.info if "far smaller" in i.value]  # a normal photo: no note


@pytest.mark.slow
@pytest.mark.parametrize("size", [(1, 1), (6, 6), (1, 300), (300, 1), (8, 8), (9, 9), (5000, 3000)])
def test_every_photo_size_draws_every_panel(bench, size):
    """A photo narrower or shorter than the attention grid was captioned, then "Click a region" raised
    "x1 must be >= x0" and the comparison below it was never drawn. Sizes at the edges: 1x1, 1xN, the
    bundled grid - 1 and the grid (9), a large one; every panel is drawn with no exception."""
    at = bench.run()
    beam(at).set_value(1).run()
    photo = Image.open(EXAMPLES / "cat.jpg").convert("RGB").resize(size)
    at.file_uploader[0].set_value((f"{size[0]}x{size[1]}.png", png_bytes_of(photo), "image/png")).run()
    no_problems(at)
    check_captioned(at, require_words=False)
    headers = [h.value for h in at.header]
    for panel in ("Click a region", "Compare two models"):
        assert any(panel in h for h in headers), headers


def test_sidebar_claims_no_unmeasured_speed_and_what_evidence_does(app, monkeypatch):
    """The precision menu said "bfloat16 (about 3x faster here)", a speed nobody had measured on that machine
    (and bf16 changes some captions); the evidence switch said it "brings in the object it is sure of" with a stored bonus of 0."""
    monkeypatch.setattr(captioner, "preferred_dtype", lambda device="cpu": "bfloat16")  # a CPU with native bf16
    at = app.run()
    box = next(s for s in at.sidebar.selectbox if s.label == "Precision")
    assert box.options == ["float32", "bfloat16 (native on this machine)", "int8"]
    assert "3x" not in box.help and "faster here" not in box.help
    assert "may be faster" in box.help and "change captions" in box.help
    model = workbench_model(at)
    toggles = [t for t in at.sidebar.toggle if "evidence" in t.label]
    if toggles:  # the bundled model keeps the ImageNet head
        help_text = toggles[0].help
        assert "brings in the object" not in help_text and "vetoes" in help_text
        if model.config.decode.evidence_bonus == 0:
            assert "never brings a word in" in help_text and "evidence bonus is 0" in help_text


def test_beam_hypotheses_in_full_with_the_score_that_ranked_them(app):
    """The grid cut captions off and listed alternatives with a better log-prob than the chosen caption
    without saying that beam search ranks by the length-normalised score."""
    at = app.run()
    no_problems(at)
    model = workbench_model(at)
    cap = model.caption(EXAMPLES / "cat.jpg")  # the page's settings are the file's
    assert cap.alternatives
    ranked_by = "choice (ranks)" if cap.choice is not None else "score (ranks)"  # the choice among them, or the beam
    table = next(t for t in at.table if ranked_by in t.value.columns).value
    assert list(table["caption"]) == [cap.text] + [a.text for a in cap.alternatives]  # in full, ranked
    if cap.choice is not None:  # why the caption won: its choice score beside the runners-up', and the beam's score
        assert list(table["choice (ranks)"]) == pytest.approx([cap.choice] + [a.choice for a in cap.alternatives], abs=1e-3)
        assert list(table["beam score"]) == pytest.approx([cap.score] + [a.score for a in cap.alternatives], abs=1e-3)
        why = [c.value for c in at.caption if c.value.startswith("Chosen with choice score")]
        assert why and "runner-up" in why[0]
    else:
        assert list(table["score (ranks)"]) == pytest.approx([cap.score] + [a.score for a in cap.alternatives], abs=1e-3)
    assert list(table["log-prob"]) == pytest.approx([cap.log_prob] + [a.log_prob for a in cap.alternatives], abs=1e-3)
    note = [c.value for c in at.caption if c.value.startswith("Ranked by")]
    if model.config.decode.length_penalty:
        assert note and "length-normalised" in note[0] and "not by the raw log-prob" in note[0]


def test_compare_with_one_model_file_never_compares_it_with_itself(bench, tmp_path, monkeypatch):
    """On a fresh install (the bundled model only) "Compare two models" offered the bundled model as B and
    showed a table of "=" rows. Now it says how to get a second model and compares other decode settings."""
    monkeypatch.setenv("CAPTIONER_CHECKPOINT_DIRS", str(tmp_path))  # the operator's folder holds no model file
    at = bench.run()
    no_problems(at)
    assert len(next(s for s in at.sidebar.selectbox if s.label == "Checkpoint").options) == 1
    box = next(c for c in at.checkbox if c.key == "compare_on")
    assert box.label == "Compare with other decode settings"
    box.check().run()
    no_problems(at)
    assert any(".venv/bin/captioner-export" in i.value and "-- --checkpoints DIR" in i.value for i in at.info)
    assert not [s for s in at.selectbox if s.label == "Second checkpoint (B)"]
    assert not [d for d in at.dataframe if "likelier under" in d.value.columns]  # no table of "=" rows
    variant = next(s for s in at.selectbox if s.label == "B: the same model with")
    for option in variant.options:
        variant = next(s for s in at.selectbox if s.label == "B: the same model with")
        variant.set_value(option).run()
        no_problems(at)
        heads = [m.value for m in at.markdown if m.value.startswith("**A: ") or m.value.startswith("**B: ")]
        assert len(heads) == 2 and heads[0].split(", ", 1)[1] != heads[1].split(", ", 1)[1], heads  # other settings
    greedy = next(o for o in variant.options if o.startswith("beam 1"))
    next(s for s in at.selectbox if s.label == "B: the same model with").set_value(greedy).run()
    expected = workbench_model(at).caption(EXAMPLES / "cat.jpg", beam_size=1)
    assert any(f"generated: *{expected.text}*" in m.value for m in at.markdown)


def test_operator_folder_is_searched_recursively(app, tmp_path, monkeypatch):
    model_file = Path(_selected_path())
    nested = tmp_path / "exp1" / "ckpt"
    nested.mkdir(parents=True)
    (nested / "mine.safetensors").symlink_to(model_file)  # a link to a file outside: not offered
    (nested / "copy.safetensors").write_bytes(model_file.read_bytes())
    (tmp_path / "broken.safetensors").write_bytes(b"not a checkpoint")
    monkeypatch.setenv("CAPTIONER_CHECKPOINT_DIRS", str(tmp_path))
    at = app.run()
    no_problems(at)
    box = next(s for s in at.sidebar.selectbox if s.label == "Checkpoint")
    assert "exp1/ckpt/copy.safetensors" in box.options and "broken.safetensors" in box.options, box.options
    assert "exp1/ckpt/mine.safetensors" not in box.options  # it resolves outside the allowed folder
    box.set_value("exp1/ckpt/copy.safetensors")
    beam(at).set_value(1)
    at.run()
    check_captioned(at)
    # a broken checkpoint is an error message in the page, not a crash
    next(s for s in at.sidebar.selectbox if s.label == "Checkpoint").set_value("broken.safetensors").run()
    assert not at.exception
    assert any("Cannot load the checkpoint" in e.value for e in at.error), [e.value for e in at.error]
    next(s for s in at.sidebar.selectbox if s.label == "Checkpoint").set_value("exp1/ckpt/copy.safetensors").run()
    check_captioned(at)


def test_a_visitor_cannot_steer_the_server_file_system(app, tmp_path, monkeypatch):
    """Typing a server folder (or '/') into ANY text box of the page never offers or loads a model file
    outside the operator's folders; the default deployment offers the bundled model and runs/."""
    from .conftest import tiny_captioner

    secret = tmp_path / "secret"
    tiny_captioner().save(secret / "private.safetensors")
    runs = tmp_path / "work" / "runs" / "exp"
    tiny_captioner().save(runs / "mine.safetensors")
    import streamlit as st

    monkeypatch.delenv("CAPTIONER_CHECKPOINT_DIRS", raising=False)
    monkeypatch.chdir(tmp_path / "work")  # the default deployment: runs/ under the working directory
    st.cache_data.clear()
    at = app.run()
    no_problems(at)
    box = next(s for s in at.sidebar.selectbox if s.label == "Checkpoint")
    assert DEFAULT_LABEL_OF(box) and "exp/mine.safetensors" in box.options, box.options
    for typed in (str(secret), "/", str(tmp_path)):
        for t in at.text_input:
            t.set_value(typed)
        at.run()
        options = [o for s in at.selectbox for o in s.options]
        assert not any("private" in str(o) for o in options), options
        assert not any(str(secret) in m.value for m in at.markdown)
    assert not any(t.label.startswith("Checkpoint folder") for t in at.sidebar.text_input)


def DEFAULT_LABEL_OF(box) -> bool:
    return not captioner.DEFAULT_CHECKPOINT.is_file() or "bundled default model" in box.options


def _selected_path() -> str:
    """The checkpoint the app opened with (as the test fixture arranged it)."""
    return os.environ.get("CAPTIONER_CHECKPOINT") or str(captioner.DEFAULT_CHECKPOINT)


def test_model_is_loaded_once_per_process(app, monkeypatch):
    import streamlit as st

    calls = []
    real_load = captioner.load

    def counting_load(*args, **kwargs):
        calls.append(args)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(captioner, "load", counting_load)
    st.cache_resource.clear()
    at = app.run()
    beam(at).set_value(1).run()
    check_captioned(at)
    again = AppTest.from_file(str(APP), default_timeout=TIMEOUT).run()  # another session, same process
    no_problems(again)
    assert len(calls) == 1, calls


def test_precision_choice_loads_the_model_in_that_dtype(app, monkeypatch):
    import streamlit as st

    dtypes = []
    real_load = captioner.load

    def recording_load(*args, **kwargs):
        cap = real_load(*args, **kwargs)
        dtypes.append((cap.precision, next(cap.model.parameters()).dtype))
        return cap

    monkeypatch.setattr(captioner, "load", recording_load)
    st.cache_resource.clear()
    at = app.run()
    box = next(s for s in at.sidebar.selectbox if s.label == "Precision")
    assert box.value == "float32"  # the default: the reference numbers; bfloat16 is the faster option
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("int8", torch.float32)):
        next(s for s in at.sidebar.selectbox if s.label == "Precision").set_value(name).run()
        check_captioned(at, require_words=False)
        assert (name, dtype) in dtypes  # int8: float32 tensors, the step's products in int8
    st.cache_resource.clear()


def test_empty_caption_is_explained_not_crashed(app, monkeypatch):
    """A model may end the caption at once (an untrained one often does with beam search)."""
    import numpy as np
    import streamlit as st

    def empty_caption(self, **overrides):
        g = self.loaded.grid_size
        return captioner.Caption("", [], np.zeros((0, g, g), np.float32), -1.5, [("a cat", -2.0)])

    monkeypatch.setattr(captioner.Photo, "caption", empty_caption)  # what the app decodes with
    st.cache_data.clear()
    try:
        at = app.run()
        assert not at.exception and not errors_of(at)
        assert caption_text(at) == "" and not word_overlays(at)
        assert any("no words" in w.value for w in at.warning), [w.value for w in at.warning]
        assert len(at.download_button) == 2
        (hyps,) = [t.value for t in at.table if "score (ranks)" in t.value.columns]  # the other hypothesis listed
        assert list(hyps["caption"]) == ["(empty)", "a cat"] and list(hyps["log-prob"]) == [-1.5, -2.0]
    finally:
        st.cache_data.clear()  # do not leave the fake caption for other tests


def test_decoding_widgets_start_at_the_model_files_settings(monkeypatch, tmp_path):
    """The decoding widgets start from the checkpoint's stored decode settings, not the app's own."""
    import streamlit as st

    from .conftest import tiny_captioner

    model = tiny_captioner()
    model.config.decode.beam_size, model.config.decode.max_len, model.config.decode.block_trigrams = 5, 23, True
    path = tmp_path / "beam5.safetensors"
    model.save(path)
    monkeypatch.setenv("CAPTIONER_CHECKPOINT", str(path))  # the app opens on this file
    monkeypatch.chdir(ROOT)
    try:
        at = AppTest.from_file(str(APP), default_timeout=TIMEOUT).run()
        assert not at.exception, [e.value for e in at.exception]
        assert beam(at).value == 5
        assert next(s for s in at.sidebar.slider if s.label.startswith("Maximum caption length")).value == 23
        assert next(c for c in at.sidebar.checkbox if "trigram" in c.label).value is True
    finally:
        st.cache_resource.clear()
        st.cache_data.clear()


# ----------------------------------------------------------------------------- the attention workbench

EXPLAINED = re.compile(r"^“(.*)” p=(\d\.\d\d) \(word (\d+)(?:, as <unk>)?\)$")  # explained-sentence overlay captions


def explained_overlays(at: AppTest) -> list[tuple[str, float]]:
    """(word, p) of each overlay of the explained sentence(s), in page order."""
    found = [EXPLAINED.match(c) for im in at.image for c in im.captions]
    return [(m.group(1), float(m.group(2))) for m in found if m]


def prob_words(at: AppTest, k: int = 0) -> list[tuple[str, float, bool]]:
    """(word, p, highlighted) of the k-th probability line."""
    lines = [m.value for m in at.markdown if 'class="prob-line"' in m.value]
    spans = re.findall(r'title="p=[\d.]+" style="([^"]*)">([^<]*)<br><small[^>]*>p=(\d\.\d\d)</small>', lines[k])
    return [(w, float(p), "background" in style) for style, w, p in spans]


def test_the_workbench_is_drawn_on_demand_and_stays_on(app, monkeypatch):
    """Off when the page opens: no workbench or comparison drawn and no sentence explained (a browser redraws every
    element in each run, so they delayed a new photo's caption); switched on, both are drawn, and a new photo keeps
    them on, after a bad upload too."""
    explained = []
    real_explain = captioner.Photo.explain
    monkeypatch.setattr(captioner.Photo, "explain", lambda self, *a, **k: explained.append(a) or real_explain(
        self, *a, **k))
    import streamlit as st
    st.cache_data.clear()
    at = app.run()
    check_captioned(at)
    panels = ("Explain a sentence", "Click a region", "Compare two models")
    headers = [h.value for h in at.header]
    assert "Attention workbench" in headers and not [p for p in panels if p in headers], headers
    assert not [t for t in at.text_input if t.label == "Sentence to explain"] and not explained
    switch = next(t for t in at.toggle if t.key == "workbench_on")
    assert switch.value is False
    switch.set_value(True).run()
    no_problems(at)
    assert all(p in [h.value for h in at.header] for p in panels)
    assert len(explained) == 1 and explained_overlays(at)
    next(s for s in at.selectbox if "example" in s.label).set_value("Coffee").run()  # a new photo
    check_captioned(at, require_words=False)
    assert next(t for t in at.toggle if t.key == "workbench_on").value is True
    assert all(p in [h.value for h in at.header] for p in panels)
    # a bad upload stops the page above the switch, so the widget is forgotten; the next photo has it on again
    at.file_uploader[0].set_value(("bad.jpg", b"not a photo" * 20, "image/jpeg")).run()
    assert errors_of(at) and not [t for t in at.toggle if t.key == "workbench_on"]
    at.file_uploader[0].set_value(("cat.jpg", (EXAMPLES / "cat.jpg").read_bytes(), "image/jpeg")).run()
    check_captioned(at)
    assert next(t for t in at.toggle if t.key == "workbench_on").value is True
    assert all(p in [h.value for h in at.header] for p in panels)


def workbench_model(at: AppTest) -> captioner.Captioner:
    return captioner.load(_selected_path())


def test_explain_a_sentence_follows_the_typed_text(bench):
    at = bench.run()
    words = check_captioned(at)
    box = next(t for t in at.text_input if t.label == "Sentence to explain")
    assert box.value == " ".join(words)  # starts from the generated caption
    assert [w for w, _ in explained_overlays(at)] == words
    typed = "a zebraquux sits on the grass"
    box.set_value(typed).run()
    no_problems(at)
    shown = prob_words(at)
    assert [w for w, _, _ in shown] == ["a", "zebraquux (unk)", "sits", "on", "the", "grass"]
    assert [w for w, _ in explained_overlays(at)] == ["a", "zebraquux", "sits", "on", "the", "grass"]
    assert any("‘zebraquux’ is not in the model's vocabulary" in i.value for i in at.info)
    expected = workbench_model(at).explain(load_image_bytes(at), typed)
    probs = np.exp(expected.word_log_probs)
    assert [p for _, p, _ in shown] == pytest.approx(probs, abs=0.006)
    assert [hl for _, _, hl in shown] == [float(f"{q:.2f}") < 0.05 for q in probs]  # unlikely words highlighted
    assert [hl for _, _, hl in shown] == [p < 0.05 for _, p, _ in shown]  # highlighted by the p shown
    # the total scores 'zebraquux' as <unk>: flagged as not comparable (the line, a note, the word's label)
    total = [m.value for m in at.markdown if f"**{expected.log_prob:.2f}**" in m.value]
    assert total and "not comparable: ‘zebraquux’ scored as <unk>" in total[0]
    assert any("not comparable" in i.value and "‘zebraquux’" in i.value for i in at.info)
    labels = [c for im in at.image for c in im.captions if c.startswith("“zebraquux”")]
    assert labels and labels[0].endswith("(word 2, as <unk>)")
    own = workbench_model(at).explain(load_image_bytes(at), " ".join(words))
    next(t for t in at.text_input if t.label == "Sentence to explain").set_value(" ".join(words)).run()
    no_problems(at)  # the model's own caption: comparable, no flag
    assert own.comparable and not [m.value for m in at.markdown if "not comparable" in m.value]


def test_a_sentence_without_words_is_a_note_not_a_score(bench):
    """'!!! ...' used to get a sentence log-probability (that of <end>); now the page says it has no
    words, in the explain, region and compare sections alike, and nothing is scored."""
    at = bench.run()
    check_captioned(at)
    next(t for t in at.text_input if t.label == "Sentence to explain").set_value("!!! ...").run()
    next(c for c in at.checkbox if c.key == "compare_on").check().run()
    no_problems(at)
    assert any("has no words to explain" in i.value for i in at.info), [i.value for i in at.info]
    assert any("no words to rank" in i.value for i in at.info)
    assert not explained_overlays(at) and not [m for m in at.markdown if "sentence log-probability" in m.value]


def load_image_bytes(at: AppTest):
    """The example photo the app opened with (the first example)."""
    from captioner.images import load_image

    return load_image(EXAMPLES / "cat.jpg")


def test_click_a_region_ranks_words_by_attention_there(bench):
    at = bench.run()
    words = check_captioned(at)
    model = workbench_model(at)
    G = model.grid_size
    next(s for s in at.selectbox if s.label == "Row").set_value(0)
    next(s for s in at.selectbox if s.label == "Column").set_value(G - 1)
    at.run()
    no_problems(at)
    assert cell_shown(at) == (0, G - 1)
    table = next(d for d in at.dataframe if "lift" in d.value.columns).value
    alphas = model.explain(load_image_bytes(at), " ".join(words)).alphas[:, 0, G - 1]
    assert sorted(table["word"]) == sorted(words)
    assert list(table["attention"]) == sorted(table["attention"], reverse=True)
    assert list(table["attention"]) == pytest.approx(sorted(alphas, reverse=True), abs=1e-3)
    strip = [m.value for m in at.markdown if 'class="cell-strip"' in m.value]
    assert len(strip) == 1 and all(w in strip[0] for w in words)


def cell_shown(at: AppTest) -> tuple[int, int]:
    """The (row, column) the region view says is picked (a caption under the clickable photo, or the
    photo's own caption without the click component), 0-based as the maps index them: the page numbers cells
    from 1, as it numbers the words, and so does its row menu."""
    texts = [c.value for c in at.caption] + [c for im in at.image for c in im.captions]
    found = [re.fullmatch(r"cell row (\d+), column (\d+) of (\d+)", t) for t in texts]
    (m,) = [m for m in found if m]
    row_menu = next(s for s in at.selectbox if s.label == "Row")
    assert row_menu.options[0] == "1" and row_menu.options[-1] == m.group(3)  # the menu counts from 1 too
    return int(m.group(1)) - 1, int(m.group(2)) - 1


def test_a_click_on_the_photo_picks_its_cell(bench):
    pytest.importorskip("streamlit_image_coordinates")
    at = bench.run()
    check_captioned(at)
    G = workbench_model(at).grid_size
    # what the component sends for a click: pixel offsets in the photo as drawn, and its drawn size
    at.session_state["region_click"] = {"x": 399, "y": 1, "width": 400, "height": 300, "unix_time": 1}
    at.run()
    no_problems(at)
    assert cell_shown(at) == (0, G - 1)
    assert next(s for s in at.selectbox if s.label == "Row").value == 0
    at.session_state["region_click"] = {"x": 0, "y": 299, "width": 400, "height": 300, "unix_time": 2}
    at.run()
    assert cell_shown(at) == (G - 1, 0)


def test_compare_two_models_side_by_side(bench, tmp_path, monkeypatch):
    from .conftest import tiny_captioner

    tiny_captioner().save(tmp_path / "tiny.safetensors")
    monkeypatch.setenv("CAPTIONER_CHECKPOINT_DIRS", str(tmp_path))
    at = bench.run()
    words = check_captioned(at)
    next(c for c in at.checkbox if c.label == "Compare with a second checkpoint").check().run()
    no_problems(at)
    second = next(s for s in at.selectbox if s.label == "Second checkpoint (B)")
    assert "tiny.safetensors" in second.options
    second.set_value("tiny.safetensors").run()
    no_problems(at)
    heads = [m.value for m in at.markdown if m.value.startswith("**A: ") or m.value.startswith("**B: ")]
    assert len(heads) == 2 and "tiny.safetensors" in heads[1]
    assert len([m for m in at.markdown if 'class="prob-line"' in m.value]) == 3  # explain view + A + B
    overlays = [w for w, _ in explained_overlays(at)]
    assert overlays == words * 3  # the same sentence, explained in the view and under both models
    table = next(d for d in at.dataframe if "likelier under" in d.value.columns).value
    assert list(table["word"]) == words
    tiny_unknown = [w for w in words if w not in tiny_captioner().vocab.stoi]
    assert all(any(f"‘{w}’" in i.value for i in at.info) for w in tiny_unknown)


@pytest.mark.slow
def test_concepts_and_the_evidence_switch(app):
    """The page shows what the encoder's classifier sees and a switch that starts at the file's evidence
    setting; with it on (the bundled default) the coffee photo is not called a dog."""
    at = app.run()
    ex = next(s for s in at.selectbox if s.label.startswith("... or pick an example"))
    ex.set_value("Coffee").run()
    assert not at.exception, [e.value for e in at.exception]
    toggle = next(t for t in at.sidebar.toggle if "evidence" in t.label)
    assert toggle.value is workbench_model(at).config.decode.evidence
    assert any("cup" in m.value for m in at.markdown if "concept" in m.value)
    if toggle.value:
        assert "dog" not in caption_text(at)


def test_explain_box_follows_a_new_photo(bench):
    """The sentence box starts from the caption of the photo on screen, also after another photo."""
    at = bench.run()
    ex = next(s for s in at.selectbox if s.label.startswith("... or pick an example"))
    ex.set_value("Astronaut").run()
    box = next(t for t in at.text_input if t.label == "Sentence to explain")
    assert box.value == caption_text(at)


def test_a_concept_word_shows_the_classifiers_map_beside_its_attention(app, flickr):
    """A Flickr8k photo of two dogs: the caption names a dog, the classifier sees one, and the large view
    shows the concept map beside the word's attention; a word without a concept shows one image."""
    at = app.run()
    photo = flickr / "Images" / "1001773457_577c3a7d70.jpg"
    at.file_uploader[0].set_value((photo.name, photo.read_bytes(), "image/jpeg")).run()
    words = check_captioned(at)
    cap = workbench_model(at).caption(photo)
    assert cap.words == words
    concept = [i for i in cap.concept_maps if cap.concept_maps[i][0] == "dog"]
    assert concept, f"no dog concept map in {cap.text!r}"
    at.select_slider[0].set_value(concept[0]).run()
    captions = [c for im in at.image for c in im.captions]
    assert any(c.startswith("where the classifier sees a dog (P=") for c in captions), captions
    plain = next(i for i in range(len(words)) if i not in cap.concept_maps)
    at.select_slider[0].set_value(plain).run()
    assert not any(c.startswith("where the classifier sees") for im in at.image for c in im.captions)


@pytest.mark.slow
def test_encoder_runs_once_per_photo(bench, monkeypatch):
    """A new beam size, a typed sentence and a region click decode again from the photo's cached
    reading: the encoder runs once per photo and model (app.get_photo)."""
    import streamlit as st

    encoded = []
    real_encode = captioner.Captioner.encode

    def counting_encode(self, x):
        encoded.append(tuple(x.shape))
        return real_encode(self, x)

    monkeypatch.setattr(captioner.Captioner, "encode", counting_encode)
    st.cache_resource.clear()
    st.cache_data.clear()
    try:
        at = bench.run()
        check_captioned(at)
        beam(at).set_value(2).run()
        check_captioned(at, require_words=False)
        next(t for t in at.text_input if t.label == "Sentence to explain").set_value("a cat on a bed").run()
        no_problems(at)
        assert [w for w, _ in explained_overlays(at)] == ["a", "cat", "on", "a", "bed"]
        assert len(encoded) == 1, encoded
        next(s for s in at.selectbox if "example" in s.label).set_value("Coffee").run()  # a new photo: once more
        check_captioned(at, require_words=False)
        assert len(encoded) == 2, encoded
    finally:
        st.cache_resource.clear()
        st.cache_data.clear()


@pytest.mark.slow
def test_a_new_caption_pauses_once_for_the_browser_to_draw_it(bench, monkeypatch):
    """The run waits DRAW_PAUSE_S after a new caption, before the photo and its maps (the browser draws the caption
    meanwhile); a rerun of the same caption (a word picked, a sentence typed) does not wait again."""
    from captioner.ui import page_photo

    paused = []
    monkeypatch.setattr(page_photo, "sleep", paused.append)
    at = bench.run()
    check_captioned(at)
    assert paused == [page_photo.DRAW_PAUSE_S]
    next(t for t in at.text_input if t.label == "Sentence to explain").set_value("a cat on a bed").run()
    no_problems(at)
    assert paused == [page_photo.DRAW_PAUSE_S]  # the same caption: no second wait
    beam(at).set_value(2).run()  # other settings: a new caption
    check_captioned(at, require_words=False)
    assert paused == [page_photo.DRAW_PAUSE_S] * 2


def test_concepts_panel_shows_the_word_detectors_person(app, tmp_path, monkeypatch):
    """A model file with word detectors: the concepts panel lists person like any concept at the threshold it
    states (a person at P ~ 0 is not listed), and a person the detector rules out is not the caption's subject;
    a detector sure of a person lists it."""
    import re

    import streamlit as st

    from captioner.concepts.imagenet import THRESHOLD
    from captioner.concepts.detectors import PERSON, WordDetectors, attach

    m = captioner.load(_selected_path())
    det = WordDetectors([PERSON, "water"], m.model.encoder.out_dim)
    det.bias.data.fill_(-30.0)  # P(person) ~ 0 on every photo: the panel must say so and the veto must act
    attach(m.model, det)
    m.config.decode.person_floor = 0.2
    m.save(tmp_path / "detectors.safetensors")
    monkeypatch.setenv("CAPTIONER_CHECKPOINT_DIRS", str(tmp_path))
    at = app.run()
    next(s for s in at.sidebar.selectbox if s.label == "Checkpoint").set_value("detectors.safetensors").run()
    ex = next(s for s in at.selectbox if s.label.startswith("... or pick an example"))
    ex.set_value("Astronaut").run()
    no_problems(at)
    panel = "".join(x.value for x in at.markdown if 'class="concepts"' in x.value)  # none: nothing seen at P >= .3
    assert ">person<" not in panel, panel
    assert all(float(p) >= THRESHOLD for p in re.findall(r"<small>([0-9.]+)</small>", panel)), panel
    assert not set(det.members[PERSON]) & set(caption_text(at).split())
    det.bias.data.fill_(30.0)  # P(person) ~ 1: listed
    m.save(tmp_path / "detectors.safetensors")
    st.cache_resource.clear()
    at = app.run()
    next(s for s in at.sidebar.selectbox if s.label == "Checkpoint").set_value("detectors.safetensors").run()
    next(s for s in at.selectbox if s.label.startswith("... or pick an example")).set_value("Astronaut").run()
    panel = [x.value for x in at.markdown if 'class="concepts"' in x.value]
    assert panel and ">person<" in panel[0], panel
    assert any(f"P ≥ {THRESHOLD}" in x.value for x in at.markdown)  # the threshold it states ...
    assert all(float(p) >= THRESHOLD for p in re.findall(r"<small>([0-9.]+)</small>", panel[0])), panel  # ... is met


def test_compare_the_bundled_model_with_a_resnet_checkpoint(bench, tmp_path, monkeypatch):
    """Evidence-aware decoding is the bundled model's setting, and a ResNet has no ImageNet head: each side
    of a comparison decodes with what it can use, so the ResNet side captions instead of failing."""
    from captioner.config import Config, ModelConfig
    from captioner.model.show_attend_tell import build_model

    from .conftest import tiny_captioner

    base = tiny_captioner()
    cfg = Config(model=ModelConfig(encoder="resnet101", pretrained=False, image_size=64, grid_size=2,
                                   embed_dim=8, hidden_dim=16, attention_dim=8))
    resnet = captioner.Captioner(build_model(cfg.model, len(base.vocab), pretrained=False).eval(), base.vocab, cfg)
    resnet.save(tmp_path / "resnet.safetensors")
    monkeypatch.setenv("CAPTIONER_CHECKPOINT_DIRS", str(tmp_path))
    at = bench.run()
    check_captioned(at)
    next(c for c in at.checkbox if c.label == "Compare with a second checkpoint").check().run()
    next(s for s in at.selectbox if s.label == "Second checkpoint (B)").set_value("resnet.safetensors").run()
    no_problems(at)
    assert any(m.value.startswith("**B: resnet.safetensors") for m in at.markdown)


def test_compare_decodes_b_with_its_own_stored_settings(bundled, bench, tmp_path, monkeypatch):
    """B was decoded with A's sidebar settings and the page did not say which B used: B now decodes with the
    settings stored in its own file unless the user asks for the sidebar's, and both sides say theirs."""
    import dataclasses

    other = captioner.Captioner(bundled.model, bundled.vocab,
                                dataclasses.replace(bundled.config, decode=dataclasses.replace(
                                    bundled.config.decode, beam_size=1, max_len=7)),
                                fitted=bundled.resources.fitted, memory=bundled.resources.memory)  # the file's data
    other.save(tmp_path / "greedy.safetensors", half=True)
    monkeypatch.setenv("CAPTIONER_CHECKPOINT_DIRS", str(tmp_path))
    at = bench.run()
    check_captioned(at)
    next(c for c in at.checkbox if c.label == "Compare with a second checkpoint").check().run()
    next(s for s in at.selectbox if s.label == "Second checkpoint (B)").set_value("greedy.safetensors").run()
    no_problems(at)
    heads = [m.value for m in at.markdown if m.value.startswith(("**A: ", "**B: "))]
    a_beam = bundled.config.decode.beam_size
    assert any(h.startswith("**B: greedy.safetensors, beam 1") and "max 7 words" in h for h in heads), heads
    assert any(h.startswith("**A: ") and f"beam {a_beam}" in h for h in heads), heads
    next(c for c in at.checkbox if c.label == "Decode B with the sidebar's settings too").check().run()
    no_problems(at)
    heads = [m.value for m in at.markdown if m.value.startswith("**B: ")]
    assert heads and f"beam {a_beam}" in heads[0], heads


@pytest.mark.slow
def test_a_shrunk_upload_says_its_original_size(app):
    """A 12000x12000 upload was labelled "(1024x1024)" with no word that it was shrunk."""
    at = app.run()
    beam(at).set_value(1).run()
    big = Image.new("RGB", (6000, 4000), (90, 120, 60))
    at.file_uploader[0].set_value(("big.png", png_bytes_of(big), "image/png")).run()
    no_problems(at)
    assert photo_caption(at) == "big.png (6000x4000, shown at 1024x683)", photo_caption(at)


def test_a_camera_photo_is_captioned(bundled, app):
    """A camera source beside upload and the examples: off until asked (the browser asks for the camera only
    then); a photo taken is captioned like an upload, and equals what the library says of it."""
    import io

    at = app.run()
    assert not at.camera_input  # no camera prompt on a plain visit
    next(t for t in at.toggle if t.label == "Take a photo with the camera").set_value(True).run()
    assert len(at.camera_input) == 1
    buf = io.BytesIO()
    Image.open(EXAMPLES / "coffee.jpg").convert("RGB").save(buf, "JPEG")
    at.camera_input[0].set_value(("shot.jpg", buf.getvalue(), "image/jpeg")).run()
    words = check_captioned(at)
    assert photo_caption(at).startswith("camera.jpg (600x400)")
    assert words == bundled.caption(buf.getvalue()).words


def test_several_photos_make_a_gallery_and_one_opens_below(bundled, app):
    """Several photos uploaded at once: captioned together, one card each (the caption the library gives that
    photo), the batch downloads, a bad file named without losing the others, and the photo picked opens below."""
    at = app.run()
    files = [(n, (EXAMPLES / n).read_bytes(), "image/jpeg") for n in ("cat.jpg", "coffee.jpg", "astronaut.jpg")]
    at.file_uploader[1].set_value(files + [("broken.jpg", b"not a photo" * 20, "image/jpeg")]).run()
    assert not at.exception
    assert any("broken.jpg" in e.value for e in at.error)  # named; the three photos still shown
    assert any(h.value == "3 photos" for h in at.header)
    expected = bundled.caption_batch([EXAMPLES / n for n, _, _ in files])
    shown = [m.value for m in at.markdown if m.value.startswith("“")]  # a sure caption's plain line
    shown += [b.value for b in level_boxes(at) if b.value.startswith("**")]  # an unsure one's box
    assert all(any(f"“{c.text}”" in x for x in shown) for c in expected)
    labels = [b.label for b in at.download_button]
    for kind in ("CSV", "JSON", "ZIP"):
        assert any(kind in lb for lb in labels), labels
    opener = next(s for s in at.selectbox if s.label.startswith("Open a photo"))
    opener.set_value(1).run()
    assert caption_text(at) == expected[1].text and photo_caption(at).startswith("coffee.jpg (600x400)")


def test_an_unsure_card_in_the_gallery_looks_different_from_a_sure_one(bundled, app, tmp_path, monkeypatch):
    """A sure caption is a plain line with a quiet note under it; an unsure one is a box named by its level (an
    error box when probably wrong, a warning when it may be wrong, an info box when probably right) and why (they looked alike).
    None of the bundled examples is sure at the file's threshold, so the app runs a copy of the bundled model whose
    threshold is the 60% floor, where the coffee's caption (.66, every object seen) is."""
    fitted = bundled.resources.fitted
    lenient = captioner.Captioner(bundled.model, bundled.vocab, bundled.config, bundled.metrics,
                                  fitted=dataclasses.replace(fitted, confidence=dataclasses.replace(fitted.confidence,
                                                                                                    sure_at=0.6)),
                                  memory=bundled.resources.memory)
    lenient.save(tmp_path / "lenient.safetensors")
    lenient = captioner.load(tmp_path / "lenient.safetensors")
    monkeypatch.setenv("CAPTIONER_CHECKPOINT", str(tmp_path / "lenient.safetensors"))
    at = app.run()
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (200, 260, 3), dtype=np.uint8))
    files = [("coffee.jpg", (EXAMPLES / "coffee.jpg").read_bytes(), "image/jpeg"),
             ("noise.png", png_bytes_of(noise), "image/png")]
    sure, unsure = lenient.caption_batch([EXAMPLES / "coffee.jpg", noise])
    assert sure.sure is True and unsure.sure is False  # the model's own verdicts on these two
    at.file_uploader[1].set_value(files).run()
    no_problems(at)
    plain = [m.value for m in at.markdown if m.value.startswith("“")]
    boxes = level_boxes(at)
    boxed = [b.value for b in boxes if f"“{unsure.text}”" in b.value]
    assert f"“{sure.text}”" in plain and f"“{unsure.text}”" not in plain
    assert len(boxed) == 1 and boxed[0].startswith(f"**{unsure.level.capitalize()} (") and unsure.doubt in boxed[0]
    assert not any(f"“{sure.text}”" in b.value for b in boxes)
    if unsure.level == "probably wrong":  # its box is an error box, louder than may be wrong's warning
        assert any(f"“{unsure.text}”" in e.value for e in at.error)


def test_the_last_uploader_given_files_is_the_photo_on_screen(app):
    """A gallery empties the single uploader (it kept its old file beside the gallery), and a single photo
    given while the gallery shows empties the gallery's uploader and opens that photo."""
    at = app.run()
    cat, coffee = ((n, (EXAMPLES / n).read_bytes(), "image/jpeg") for n in ("cat.jpg", "coffee.jpg"))
    at.file_uploader[0].set_value(cat).run()
    assert photo_caption(at).startswith("cat.jpg")
    at.file_uploader[1].set_value([cat, coffee]).run()
    no_problems(at)
    assert any(h.value == "2 photos" for h in at.header) and not at.file_uploader[0].value
    at.file_uploader[0].set_value(coffee).run()
    no_problems(at)
    assert not any(h.value.endswith(" photos") for h in at.header) and not at.file_uploader[1].value
    assert photo_caption(at).startswith("coffee.jpg")


def test_more_photos_than_a_batch_holds_get_a_message(app):
    """... and while the gallery shows, the example menu is off (it stayed live and changed nothing)."""
    at = app.run()
    example_menu = lambda: next(s for s in at.selectbox if s.label.startswith("... or pick an example"))  # noqa: E731
    assert not example_menu().disabled
    tiny = png_bytes_of(Image.new("RGB", (40, 30), (200, 10, 10)))
    n = gallery.MAX_PHOTOS + 2
    at.file_uploader[1].set_value([(f"p{i}.png", tiny, "image/png") for i in range(n)]).run()
    assert not at.exception and example_menu().disabled
    assert any(f"{n} photos chosen: at most {gallery.MAX_PHOTOS}" in w.value for w in at.warning)
    assert any(h.value == f"{gallery.MAX_PHOTOS} photos" for h in at.header)
    shown = " ".join(at.selectbox(key="gallery_open").options)  # each "N. name": the photos the gallery holds
    assert f"p{n - 1}.png" in shown and "p0.png" not in shown  # the newest chosen (a new batch is appended)


def test_the_caption_as_it_is_written_is_shown_and_downloadable(bundled, app):
    """The animation (a frame per word, ui/animate.py) is offered as a GIF and played on request: it is drawn only
    then (about half a second a photo, which came before the overlays)."""
    import io

    at = app.run()
    words = check_captioned(at)
    assert any(b.label == "Download the caption as it is written (GIF)" for b in at.download_button)
    gif = lambda: [im for im in at.image if any("word by word" in c for c in im.captions)]  # noqa: E731
    assert gif() == []
    at.toggle(key="play_caption").set_value(True).run()
    assert not at.exception and len(gif()) == 1
    cap = bundled.caption(EXAMPLES / "cat.jpg")
    assert cap.words == words
    from captioner.ui.animate import caption_animation
    assert Image.open(io.BytesIO(caption_animation(Image.open(EXAMPLES / "cat.jpg"), cap))).n_frames == len(words)


def test_the_menu_says_which_of_a_runs_files_to_pick(app, tmp_path, monkeypatch):
    """A training run writes best.safetensors and last.safetensors; the menu listed both without a word."""
    import shutil

    run = tmp_path / "myrun"
    run.mkdir()
    for name in ("best.safetensors", "last.safetensors"):
        shutil.copy(captioner.DEFAULT_CHECKPOINT, run / name)
    monkeypatch.setenv("CAPTIONER_CHECKPOINT_DIRS", str(tmp_path))
    at = app.run()
    options = next(s for s in at.selectbox if s.label == "Checkpoint").options
    assert "myrun/best.safetensors (the run's best on val, not exported: captioner-export makes the file to use " \
        "and share)" in options, options
    assert not any("last.safetensors" in o for o in options), options  # the resume file is not one to caption with
    # once exported, the export is the one to pick and best says so
    from captioner.cli.export import main as export

    from captioner.ui.page_state import find_checkpoints

    assert export([str(run / "best.safetensors"), str(run / "model.safetensors"), "--half"]) == 0
    find_checkpoints.clear()  # the folder search is cached for 10 s
    at = app.run()
    options = next(s for s in at.selectbox if s.label == "Checkpoint").options
    assert "myrun/model.safetensors (exported: the file to use and share)" in options, options
    assert "myrun/best.safetensors (the run's best on val, before export: pick the exported file)" in options, options
    # a run that stopped before its first best still offers its last epoch
    (run / "best.safetensors").unlink()
    find_checkpoints.clear()
    at = app.run()
    options = next(s for s in at.selectbox if s.label == "Checkpoint").options
    assert "myrun/last.safetensors (the run's last epoch, kept to resume training)" in options, options


@pytest.mark.slow
def test_concurrent_sessions_stay_isolated(app):
    """Three sessions open at once, each with its own photo, typed sentence and region: each page shows
    only its own, equal to what the library computes. The sessions' steps are interleaved (A, B, C, A, B,
    C ...) in one thread, so they share the server's caches (st.cache_*) as a real server's sessions do.
    They are not driven from threads: AppTest is not thread-safe (its script runs share one runtime
    context; threads failed 1 run in 5 with KeyError('$$ID-...') inside Streamlit, never in the app)."""
    jobs = {"Cat": "a cat on a wall", "Coffee": "a cup of coffee", "Astronaut": "a man in a white suit"}
    files = {"Cat": "cat.jpg", "Coffee": "coffee.jpg", "Astronaut": "astronaut.jpg"}
    sessions = {example: AppTest.from_file(str(APP), default_timeout=TIMEOUT) for example in jobs}
    for at in sessions.values():
        at.session_state["workbench_wanted"] = True
    steps = [
        lambda at, example: at.run(),
        lambda at, example: next(s for s in at.selectbox if s.label.startswith("... or pick an example"))
        .set_value(example).run(),
        lambda at, example: next(t for t in at.text_input if t.label == "Sentence to explain")
        .set_value(jobs[example]).run(),
        lambda at, example: next(s for s in at.selectbox if s.label == "Row").set_value(0).run(),
    ]
    for step in steps:
        for example, at in sessions.items():
            step(at, example)
    model = captioner.load(_selected_path())
    for example, at in sessions.items():
        problems = [e.value for e in at.exception] + [e.value for e in errors_of(at)]
        assert not problems, (example, problems)
        assert photo_caption(at).startswith(files[example]), (example, photo_caption(at))  # its own photo ...
        assert [w for w, _ in explained_overlays(at)] == jobs[example].split()  # ... its own sentence ...
        image = (EXAMPLES / files[example]).read_bytes()
        assert caption_text(at) == model.caption(image).text  # ... and its own caption


def test_a_too_large_photo_is_refused_by_the_page_in_place_of_the_last_one(app):
    """The uploader's own limit refused a 27 MB photo in the browser: the page never heard of it, so the box
    showed two files and the page the last photo's error. The page refuses it now, as the one photo on screen."""
    import tomllib

    from captioner.ui.page_state import MAX_PHOTO_MB

    config = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert config["server"]["maxUploadSize"] > MAX_PHOTO_MB  # the uploader passes what the page refuses
    at = app.run()
    beam(at).set_value(1).run()
    at.file_uploader[0].set_value(("garbage.jpg", b"not a picture" * 20, "image/jpeg")).run()
    assert [e.value for e in at.error if "garbage.jpg" in e.value]
    big = (EXAMPLES / "cat.jpg").read_bytes() + b"\0" * (MAX_PHOTO_MB * 2**20)  # a real JPEG, padded past the limit
    at.file_uploader[0].set_value(("big.jpg", big, "image/jpeg")).run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in errors_of(at)]
    assert len(errors) == 1 and "big.jpg" in errors[0] and f"{MAX_PHOTO_MB} MB" in errors[0], errors
    assert not word_overlays(at)
    at.file_uploader[0].set_value(("cat.jpg", (EXAMPLES / "cat.jpg").read_bytes(), "image/jpeg")).run()
    check_captioned(at)  # and the next photo is captioned, no error left
