"""The Streamlit app in a real browser: `streamlit run app.py` driven by headless Debian chromium
through Playwright. Uploads a photo through the page's file input, checks the caption and the
attention overlays, downloads the results, then uploads bad files and checks the app recovers.
The attention workbench: types a sentence, clicks a region of the photo, compares two checkpoints
(screenshots of each view: docs/workbench_*.png when CAPTIONER_SCREENSHOT_DIR is set).

A screenshot of the captioned page is saved under pytest's tmp_path and, when the env var
CAPTIONER_SCREENSHOT_DIR is set, copied there.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import captioner
from captioner.ui.page_views import first_noun

from .conftest import free_port

pytestmark = [pytest.mark.browser, pytest.mark.slow]  # a real chromium and an app server per test

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "captioner" / "assets" / "examples"
FLICKR_DOGS = ROOT.parent / "shared" / "data" / "flickr8k" / "Images" / "1001773457_577c3a7d70.jpg"  # two dogs
CHROMIUM = Path("/usr/bin/chromium")
DEV_CHECKPOINT = Path("/tmp/devmodel/placeholder.safetensors")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
WAIT_MS = 60_000


def _app_env() -> dict[str, str]:
    env = dict(os.environ)
    if captioner.DEFAULT_CHECKPOINT.is_file():
        env.pop("CAPTIONER_CHECKPOINT", None)  # the app opens on the bundled default model
        return env
    dev = Path(env.get("CAPTIONER_CHECKPOINT") or DEV_CHECKPOINT)
    if not dev.is_file():
        pytest.skip(f"no model to run the app with: the bundled default model {captioner.DEFAULT_CHECKPOINT} "
                    f"is missing and there is no development checkpoint (set CAPTIONER_CHECKPOINT or create "
                    f"{DEV_CHECKPOINT})")
    env["CAPTIONER_CHECKPOINT"] = str(dev)
    return env


@pytest.fixture
def sync_playwright():
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not importable (pip install playwright)")
    return sync_playwright


@pytest.fixture
def app_url(tmp_path, sync_playwright):
    env = _app_env()
    env.setdefault("OMP_NUM_THREADS", "2")
    env["CAPTIONER_CHECKPOINT_DIRS"] = str(tmp_path / "models")  # the operator's folder (the workbench test fills it)
    port = free_port()
    log = open(tmp_path / "streamlit.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true",
         "--server.port", str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"streamlit exited with {proc.returncode}:\n{(tmp_path / 'streamlit.log').read_text()}")
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("streamlit did not become healthy within 60 s")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp_path / "streamlit.log").read_text()
    assert "Traceback" not in text, text


# Streamlit marks its root with the script's run state (data-test-script-state: running / notRunning ...),
# set when the server says so, with no delay. The status widget's running icon, which _settle used to wait
# on after a fixed 300 ms sleep, appears only after a delay of its own: under load a run could still be
# going when the icon had not shown yet, and the test read a half-drawn page (1 run in 7 failed).
COUNT_RUNS = """
window.__runs = 0;
new MutationObserver(records => {
  for (const r of records) {
    if (r.target.getAttribute('data-test-script-state') === 'running') window.__runs += 1;
  }
}).observe(document, {subtree: true, attributes: true, attributeFilter: ['data-test-script-state']});
"""
IDLE = "() => document.querySelector('[data-testid=\"stApp\"]')?.getAttribute('data-test-script-state') === 'notRunning'"


def _new_page(browser, **kwargs):
    page = browser.new_page(**kwargs)
    page.add_init_script(COUNT_RUNS)  # window.__runs: script runs started since the page loaded
    return page


def _settle(page) -> None:
    """Wait until the script run that drew what the caller just waited for has finished: callers first wait
    for content of the run they caused, so a run is known to have started."""
    page.wait_for_function(IDLE, timeout=WAIT_MS)


def _open_workbench(page) -> None:
    """Switch the attention workbench on (page_workbench.workbench_on: off when a page opens) and wait for it."""
    _rerun(page, lambda: page.get_by_text("Open the workbench").click())
    page.get_by_role("heading", name="Explain a sentence").wait_for(timeout=WAIT_MS)


def _rerun(page, action) -> None:
    """Do `action` (an interaction that reruns the script) and wait until that rerun has started and
    finished, counted by COUNT_RUNS: no fixed sleep, whatever the machine's load."""
    before = page.evaluate("window.__runs")
    action()
    page.wait_for_function(f"() => window.__runs > {before} && ({IDLE})()", timeout=WAIT_MS)


def _caption_shown(page) -> str:
    head = page.locator("h3", has_text="“").first
    head.wait_for(timeout=WAIT_MS)
    return head.inner_text().split("”")[0].lstrip("“").strip()


BETA = re.compile(r" \(β=(\d\.\d\d)\)$")  # the gate beta after a word: "3. dog p=0.61 (β=0.82)"
PROB = re.compile(r" p=(\d\.\d\d|\de-\d\d)\b")  # the word's probability: "3. dog p=0.61"


def _overlay_captions(page, with_beta: bool = False) -> list[str]:
    caps = page.locator('[data-testid="stImageCaption"]').all_inner_texts()
    caps = [c.strip() for c in caps if c.strip().split(". ", 1)[0].isdigit()]
    assert all(PROB.search(c) for c in caps), caps  # every word's probability, as the figure's titles
    return caps if with_beta else [PROB.sub("", BETA.sub("", c)) for c in caps]


def _check_betas(page, words: list[str]) -> list[float] | None:
    """Where the caption's gate is open for every word (the bundled model), the page says so once and shows
    no beta per word (None); otherwise every word shows its beta: in its overlay's caption and in the
    caption line, where the word's opacity is its beta (at least 0.2)."""
    if page.get_by_text("is open for every word").count():
        assert not any(BETA.search(c) for c in _overlay_captions(page, with_beta=True))
        assert page.locator(".beta-line").count() == 0
        return None
    found = [BETA.search(c) for c in _overlay_captions(page, with_beta=True)]
    assert len(found) == len(words) and all(found), _overlay_captions(page, with_beta=True)
    betas = [float(m.group(1)) for m in found]
    assert all(0 <= b <= 1 for b in betas)
    boxes = page.locator(".beta-line .beta-word")
    assert boxes.count() == len(words)
    for k, (w, b) in enumerate(zip(words, betas)):
        box = boxes.nth(k)
        assert box.inner_text().split() == [w, f"β={b:.2f}"]
        opacity = float(box.evaluate("e => getComputedStyle(e).opacity"))
        assert abs(opacity - max(0.2, b)) < 0.011, (w, b, opacity)
    return betas


def _all_overlays(page, words: list[str]) -> list[str]:
    """The grid streams in panel by panel: wait for the last word's overlay, then read them all."""
    last = f"{len(words)}. {words[-1]}"
    page.locator('[data-testid="stImageCaption"]', has_text=last).last.wait_for(timeout=WAIT_MS)
    _settle(page)
    return _overlay_captions(page)


def test_upload_caption_overlays_and_bad_files_in_chromium(app_url, sync_playwright, tmp_path):
    photo = EXAMPLES / "coffee.jpg"
    png = io.BytesIO()
    Image.open(photo).save(png, "PNG")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = _new_page(browser, viewport={"width": 1400, "height": 2600}, accept_downloads=True)
            page.goto(app_url)
            page.get_by_text("cat.jpg (451x300)").wait_for(timeout=WAIT_MS)  # the default example photo
            _settle(page)
            _open_workbench(page)  # it stays on for the photos below
            # how sure the caption is, in plain words under it (a file without a fitted map says it cannot say)
            page.get_by_text(re.compile(r"^(Sure: |Probably right \(|May be wrong \(|Probably wrong \(|This model file has no fitted confidence map)")
                             ).first.wait_for(timeout=WAIT_MS)

            # greedy decoding (beam 1): sidebar slider driven with the keyboard
            beam = page.get_by_role("slider", name="Beam size")
            beam.focus()
            _rerun(page, lambda: beam.press("Home"))
            page.get_by_test_id("stSliderThumbValue").filter(has_text="1").first.wait_for(timeout=WAIT_MS)

            # upload a photo through the real file input
            page.locator('input[type="file"]:not([multiple])').set_input_files(
                files=[{"name": "coffee.png", "mimeType": "image/png", "buffer": png.getvalue()}])
            page.get_by_text("coffee.png (600x400)").wait_for(timeout=WAIT_MS)
            _settle(page)
            words = _caption_shown(page).split()
            assert words, "empty caption"
            assert _all_overlays(page, words) == [f"{i + 1}. {w}" for i, w in enumerate(words)]
            betas = _check_betas(page, words)
            # every overlay is a loaded picture with the photo's aspect ratio (600x400)
            # (the animation, folded in its expander, has its own frame size: not one of these)
            # (the overlays' scale, shown with its words under the large view and above each grid, neither)
            images = page.locator('[data-testid="stImage"]').filter(has_not_text="word by word").filter(
                has_not_text="Lit and outlined").locator("img")
            # the explained sentence's grid is folded away (a shorter page); opened, it streams in after the
            # caption's: wait for its last word's overlay
            page.get_by_text("Where each word of the sentence looked").first.click()
            page.locator('[data-testid="stImageCaption"]', has_text=f"(word {len(words)})").last.wait_for(timeout=WAIT_MS)
            _settle(page)
            # the photo, the large view, one per word, and one per word of the explained sentence (the caption)
            assert images.count() == 2 * len(words) + 2
            for k in range(images.count()):
                img = images.nth(k)
                img.scroll_into_view_if_needed()
                page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=img.element_handle(),
                                       timeout=WAIT_MS)
                w, h = img.evaluate("img => [img.naturalWidth, img.naturalHeight]")
                assert abs(w / h - 1.5) < 0.02, (k, w, h)
            page.evaluate("window.scrollTo(0, 0)")
            shot = tmp_path / "app.png"
            page.screenshot(path=str(shot), full_page=True)
            if os.environ.get("CAPTIONER_SCREENSHOT_DIR"):
                out = Path(os.environ["CAPTIONER_SCREENSHOT_DIR"])
                out.mkdir(parents=True, exist_ok=True)
                shutil.copy(shot, out / "app.png")

            # downloads: the caption JSON and the (lazily drawn) attention figure
            with page.expect_download(timeout=WAIT_MS) as dl:
                page.get_by_role("button", name="Download caption and attention maps (JSON)").click()
            record = json.loads(Path(dl.value.path()).read_text())
            assert record["caption"] == " ".join(words) and len(record["words"]) == len(words)
            if betas is None:  # the gate is open: the JSON still reports each word's beta
                assert len(record["betas"]) == len(words) and min(record["betas"]) >= 0.95
            else:
                assert record["betas"] == pytest.approx(betas, abs=0.0051)
            with page.expect_download(timeout=WAIT_MS) as dl:
                page.get_by_role("button", name="Download attention figure (PNG)").click()
            assert Path(dl.value.path()).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

            # garbage: a clear message in the page, no traceback
            page.locator('input[type="file"]:not([multiple])').set_input_files(
                files=[{"name": "garbage.jpg", "mimeType": "image/jpeg", "buffer": b"definitely not a JPEG" * 50}])
            alert = page.get_by_test_id("stAlert").filter(has_text="garbage.jpg")
            alert.wait_for(timeout=WAIT_MS)
            assert "not an image file" in alert.inner_text()
            _settle(page)
            assert page.get_by_test_id("stException").count() == 0
            assert not _overlay_captions(page)

            # too large (page_state.MAX_PHOTO_MB): refused by the page, the box holding that file alone
            page.locator('input[type="file"]:not([multiple])').set_input_files(
                files=[{"name": "huge.jpg", "mimeType": "image/jpeg", "buffer": b"\xff" * (21 * 2**20)}])
            alert = page.get_by_test_id("stAlert").filter(has_text="huge.jpg")
            alert.wait_for(timeout=WAIT_MS)
            assert "20 MB" in alert.inner_text()
            _settle(page)
            assert page.get_by_test_id("stAlert").filter(has_text="garbage.jpg").count() == 0

            # photos smaller than the attention grid (a 6x6 icon, a 1x300 strip): every panel is drawn, down
            # to the comparison at the bottom ("Click a region" once raised "x1 must be >= x0" and stopped the page)
            for w, h in ((6, 6), (1, 300)):
                buf = io.BytesIO()
                Image.open(EXAMPLES / "cat.jpg").convert("RGB").resize((w, h)).save(buf, "PNG")
                page.locator('input[type="file"]:not([multiple])').set_input_files(
                    files=[{"name": f"tiny{w}x{h}.png", "mimeType": "image/png", "buffer": buf.getvalue()}])
                page.get_by_text(f"tiny{w}x{h}.png ({w}x{h})").wait_for(timeout=WAIT_MS)
                _settle(page)
                page.get_by_role("heading", name="Compare two models").wait_for(timeout=WAIT_MS)
                assert page.get_by_role("heading", name="Click a region").count() == 1
                assert page.get_by_test_id("stException").count() == 0

            # and the app still works: a good photo is captioned again
            page.locator('input[type="file"]:not([multiple])').set_input_files(str(EXAMPLES / "astronaut.jpg"))
            page.get_by_text("astronaut.jpg (512x512)").wait_for(timeout=WAIT_MS)
            _settle(page)
            words = _caption_shown(page).split()
            assert words and _all_overlays(page, words) == [f"{i + 1}. {w}" for i, w in enumerate(words)]
            _check_betas(page, words)
            assert page.get_by_test_id("stAlert").filter(has_text="Cannot use").count() == 0
            assert page.get_by_test_id("stException").count() == 0

            # a word naming what the classifier sees: its concept map beside its attention, both drawn
            if (FLICKR_DOGS).is_file():
                page.locator('input[type="file"]:not([multiple])').set_input_files(str(FLICKR_DOGS))
                page.get_by_text(f"{FLICKR_DOGS.name} (").first.wait_for(timeout=WAIT_MS)
                _settle(page)
                words = _caption_shown(page).split()
                cap = captioner.load().caption(FLICKR_DOGS, beam_size=1)
                assert cap.words == words
                dogs = [i for i, (cat, _, _) in cap.concept_maps.items() if cat == "dog"]
                assert dogs, f"no dog concept map in {cap.text!r}"
                slider = page.locator('input[type="range"][aria-label="Show where this caption word looked"]')
                slider.focus()
                start = first_noun(words)  # the slider opens on the caption's first noun
                for _ in range(abs(dogs[0] - start)):
                    slider.press("ArrowRight" if dogs[0] > start else "ArrowLeft")
                seen = page.locator('[data-testid="stImageCaption"]', has_text="where the classifier sees a dog")
                seen.first.wait_for(timeout=WAIT_MS)
                _settle(page)
                looked = page.locator('[data-testid="stImageCaption"]', has_text=f"where “{words[dogs[0]]}” looked")
                assert looked.count() == 1
                for img in (seen.first, looked.first):
                    pic = img.locator("xpath=ancestor::*[@data-testid='stImage'][1]//img")
                    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=pic.element_handle(),
                                           timeout=WAIT_MS)
                assert page.get_by_test_id("stException").count() == 0
        finally:
            browser.close()


EXPLAINED = re.compile(r"^“(.*)” p=(\d\.\d\d) \(word (\d+)(?:, as <unk>)?\)$")  # explained-sentence overlay captions
SENTENCE = "a cat zebraquux sits on a bed"


def _section_shot(page, first: str, until: str | None, path: Path) -> None:
    """Screenshot of the page from the header `first` to the header `until` (None: to the end)."""
    top = page.get_by_role("heading", name=first).bounding_box()
    end = page.get_by_role("heading", name=until).bounding_box()["y"] if until else None
    if end is None:  # the bottom of the last element on the page
        last = page.locator('[data-testid="stMainBlockContainer"] [data-testid="stElementContainer"]').last
        box = last.bounding_box()
        end = box["y"] + box["height"] + 30
    page.screenshot(path=str(path), clip={"x": 0, "y": top["y"] - 10, "width": page.viewport_size["width"],
                                          "height": end - top["y"]})
    if os.environ.get("CAPTIONER_SCREENSHOT_DIR"):
        out = Path(os.environ["CAPTIONER_SCREENSHOT_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, out / path.name)


def _prob_lines(page) -> list[list[tuple[str, float, bool]]]:
    """Each probability line: (word, p, highlighted) per word."""
    out = []
    for line in page.locator(".prob-line").all():
        row = []
        for box in line.locator(".prob-word").all():
            word, p = box.inner_text().rsplit("\n", 1)
            style = box.get_attribute("style") or ""
            row.append((word.strip(), float(p.strip().removeprefix("p=")), "background" in style))
        out.append(row)
    return out


def test_workbench_views_in_chromium(app_url, sync_playwright, tmp_path):
    """Explain a typed sentence, click a region, compare with a second checkpoint: what the page
    shows is what the library computes."""
    from captioner.images import load_image

    from .conftest import tiny_captioner

    folder = tmp_path / "models"
    tiny_captioner().save(folder / "tiny.safetensors")
    model = captioner.load(os.environ.get("CAPTIONER_CHECKPOINT") if not captioner.DEFAULT_CHECKPOINT.is_file()
                           else None)
    expected = model.explain(load_image(EXAMPLES / "cat.jpg"), SENTENCE)
    G = model.grid_size
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = _new_page(browser, viewport={"width": 1400, "height": 7000})
            page.goto(app_url)
            page.get_by_text("cat.jpg (451x300)").wait_for(timeout=WAIT_MS)
            _settle(page)
            _open_workbench(page)

            # explain a sentence: the maps and probabilities follow the typed text
            box = page.get_by_label("Sentence to explain")
            box.fill(SENTENCE)
            box.press("Enter")
            note = "‘zebraquux’ is not in the model's vocabulary (fed as <unk>)"
            page.get_by_text(note).wait_for(timeout=WAIT_MS)
            _settle(page)
            page.get_by_text("Where each word of the sentence looked").first.click()  # the folded grid, opened
            page.locator('[data-testid="stImageCaption"]', has_text=f"(word {len(expected.words)}").last.wait_for(
                timeout=WAIT_MS)
            (line,) = _prob_lines(page)
            assert [w for w, _, _ in line] == ["a", "cat", "zebraquux (unk)", "sits", "on", "a", "bed"]
            probs = [float(x) for x in np.exp(expected.word_log_probs)]
            assert [q for _, q, _ in line] == pytest.approx(probs, abs=0.006)
            assert [hl for _, _, hl in line] == [float(f"{q:.2f}") < 0.05 for q in probs]  # by the p shown
            assert page.get_by_text("not comparable: ‘zebraquux’ scored as <unk>").count() == 1
            captions = page.locator('[data-testid="stImageCaption"]').all_inner_texts()
            shown = [EXPLAINED.match(c.strip()) for c in captions]
            assert [m.group(1) for m in shown if m] == expected.words
            _section_shot(page, "Explain a sentence", "Click a region", tmp_path / "workbench_explain.png")

            # click a region: the top-right corner of the photo picks cell (0, G-1)
            frame = page.frame_locator('iframe[title*="image_coordinates"]')
            img = frame.locator("img")
            img.wait_for(timeout=WAIT_MS)
            from playwright.sync_api import TimeoutError as ClickTimeout

            w = img.bounding_box()["width"]
            cell = page.get_by_text(f"cell row 1, column {G} of {G}")  # numbered from 1
            for _ in range(3):  # the component's image can show before its click handler is attached (a CI run
                img.click(position={"x": w - 3, "y": 3})  # lost the first click): click again until it answers
                try:
                    cell.wait_for(timeout=WAIT_MS // 3)
                    break
                except ClickTimeout:
                    continue
            cell.wait_for(timeout=WAIT_MS)
            _settle(page)
            strip = page.locator(".cell-strip .cell-word").all_inner_texts()
            assert [s.split()[0] for s in strip] == expected.words
            att = expected.alphas[:, 0, G - 1]
            assert [float(s.split()[-1]) for s in strip] == pytest.approx(att.tolist(), abs=0.0006)
            _section_shot(page, "Click a region", "Compare two models", tmp_path / "workbench_region.png")

            # compare two models: a second checkpoint from the operator's folder, the same sentence under both
            page.get_by_text("Compare with a second checkpoint").click()
            page.get_by_text("B: tiny.safetensors").wait_for(timeout=WAIT_MS)
            _settle(page)
            lines = _prob_lines(page)
            assert len(lines) == 3 and lines[1] == line  # the view, A (the same model), B
            assert [w for w, _, _ in lines[2]][:2] == ["a", "cat (unk)"]  # not in the tiny vocabulary
            assert page.get_by_text("‘cat’ is not in the model's vocabulary (fed as <unk>)").count() == 1
            assert len(lines[2]) == len(expected.words)
            _section_shot(page, "Compare two models", None, tmp_path / "workbench_compare.png")
            assert page.get_by_test_id("stException").count() == 0
        finally:
            browser.close()
