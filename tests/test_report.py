"""Where the model fails: `captioner-evaluate --report` (captioner/ui/report.py) on coco-mini, read back as HTML and
opened in a real, offline chromium."""
from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from captioner.cli.evaluate import main
from captioner.concepts.words import CATEGORY_WORDS, word_table
from captioner.evaluation.hallucination import boxed_categories, caption_hallucination
from captioner.evaluation.boxes import load_instances
from captioner.evaluation.metrics import cider_per_image, score_captions

ROOT = Path(__file__).resolve().parents[1]
MINI = ROOT.parent / "shared" / "data" / "coco-mini"
CAPTIONS = MINI / "annotations" / "captions_train2017.json"
INSTANCES = MINI / "annotations" / "instances_train2017.json"
LIMIT = 6  # photos: enough for an order, small enough for a 2-core machine
CHROMIUM = Path("/usr/bin/chromium")

needs_mini = pytest.mark.skipif(not CAPTIONS.is_file(), reason=f"coco-mini is absent ({CAPTIONS}): the report "
                                "is tested on its photos, boxes and references (see ../shared/data/README.md)")


class Rows(HTMLParser):
    """The page's photo lines: data-image-id, data-cider, and every src= in the page."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self.sources: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "li" and a.get("class") == "photo":
            self.rows.append(a)
        for key in ("src", "href"):
            if key in a:
                self.sources.append(a[key])


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, dict]:
    if not CAPTIONS.is_file():
        pytest.skip(f"coco-mini is absent ({CAPTIONS})")
    out = tmp_path_factory.mktemp("report")
    rc = main(["--dataset", "coco", "--images", str(MINI / "train2017"), "--annotations", str(CAPTIONS),
               "--limit", str(LIMIT), "--output", str(out / "eval.json"), "--report", str(out / "report.html")])
    assert rc == 0
    return out / "report.html", json.loads((out / "eval.json").read_text())


@pytest.mark.slow
@needs_mini
def test_every_photo_worst_first_with_its_caption_and_no_outside_resource(report):
    page, result = report
    text = page.read_text(encoding="utf-8")
    rows = Rows()
    rows.feed(text)
    preds = {c["image_id"]: c["caption"] for c in result["captions"]}
    assert len(preds) == LIMIT and sorted(r["data-image-id"] for r in rows.rows) == sorted(preds)
    ciders = [float(r["data-cider"]) for r in rows.rows]
    assert ciders == sorted(ciders)  # worst first
    # the per-photo CIDEr is the corpus CIDEr's own: their mean is the score at the top
    assert np.mean(ciders) == pytest.approx(result["scores"]["CIDEr"], abs=1e-5)
    plain = re.sub(r"<[^>]+>", "", text)
    for caption in preds.values():
        assert caption in plain  # each photo's caption, words joined as generated
    assert rows.sources and all(s.startswith("data:image/") for s in rows.sources)  # embedded, nothing fetched
    assert "http://" not in text and "https://" not in text


@pytest.mark.slow
@needs_mini
def test_hallucinated_and_missed_objects_are_the_hallucination_modules(report):
    page, result = report
    text = page.read_text(encoding="utf-8")
    instances = load_instances(INSTANCES)
    boxed = boxed_categories(instances, [c["image_id"] for c in result["captions"]])
    records: dict[str, list[str]] = {}
    for a in json.loads(CAPTIONS.read_text())["annotations"]:
        records.setdefault(str(a["image_id"]), []).append(a["caption"])
    table = word_table(CATEGORY_WORDS)
    blocks = dict(re.match(r'data-image-id="([^"]+)"(.*)', b, flags=re.S).groups()
                  for b in text.split('<li class="photo" ')[1:])  # each photo's line, references included
    for c in result["captions"]:
        judged = caption_hallucination(c["image_id"], c["caption"], records[c["image_id"]], boxed[c["image_id"]],
                                       table)
        block = blocks[c["image_id"]]
        hall = re.search(r'class="hall">hallucinated: <span[^>]*>([^<]*)<', block).group(1)
        missed = re.search(r'class="missed">missed \(boxed\): ([^<]*)<', block).group(1)
        assert hall == (", ".join(sorted(judged.hallucinated)) or "none")
        assert missed == (", ".join(sorted(judged.boxed - judged.mentioned)) or "none")
        n_objects = len(judged.mentioned)  # at least one attention figure per named category
        assert block.count('alt="attention of') >= n_objects


@needs_mini
def test_per_image_cider_averages_to_the_corpus_cider():
    data = json.loads(CAPTIONS.read_text())
    refs: dict[str, list[str]] = {}
    for a in data["annotations"]:
        refs.setdefault(str(a["image_id"]), []).append(a["caption"])
    ids = sorted(refs)[:8]
    preds = {i: refs[i][0] for i in ids[:4]} | {i: "a cat sitting on a table" for i in ids[4:]}
    per = cider_per_image(preds, refs)
    assert set(per) == set(preds)
    assert np.mean(list(per.values())) == pytest.approx(score_captions(preds, refs, ["CIDEr"])["CIDEr"], abs=1e-9)
    assert min(per[i] for i in ids[:4]) > max(per[i] for i in ids[4:])  # a reference beats a wrong sentence


@pytest.mark.slow
@pytest.mark.browser
@needs_mini
def test_the_page_opens_offline_in_chromium_and_lists_every_photo_worst_first(report):
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    page_path, result = report
    asked: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM),
                                    args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        context = browser.new_context(offline=True)
        context.on("request", lambda r: asked.append(r.url))
        page = context.new_page()
        page.goto(page_path.as_uri())
        page.wait_for_load_state("load")
        ids = page.eval_on_selector_all("li.photo", "els => els.map(e => e.dataset.imageId)")
        ciders = page.eval_on_selector_all("li.photo .cider", "els => els.map(e => e.textContent)")
        broken = page.eval_on_selector_all("img", "els => els.filter(i => !i.complete || i.naturalWidth === 0).length")
        n_images = page.eval_on_selector_all("img", "els => els.length")
        captions = page.eval_on_selector_all("li.photo .caption", "els => els.map(e => e.innerText)")
        browser.close()
    assert sorted(ids) == sorted(c["image_id"] for c in result["captions"])
    values = [float(c.split()[-1]) for c in ciders]
    assert values == sorted(values)
    assert n_images >= len(ids) and broken == 0  # every thumbnail and overlay decoded
    preds = {c["image_id"]: c["caption"] for c in result["captions"]}
    assert captions == [preds[i] for i in ids]
    assert [u for u in asked if not u.startswith(("file:", "data:"))] == []  # nothing asked of any network


def test_without_boxes_the_references_are_the_truth_and_ties_put_hallucinations_first():
    """Flickr8k's case (no boxes), on hand-made captions over a real photo: no model, no data set needed."""
    from captioner.data import ImageRecord
    from captioner.decoding.captions import Caption
    from captioner.ui.report import photo_reports, report_html

    cat = ROOT / "captioner" / "assets" / "examples" / "cat.jpg"

    def cap(text: str) -> Caption:
        words = text.split()
        return Caption(text, words, np.full((len(words), 3, 3), 1 / 9, np.float32), -3.0)

    refs = ["a cat sits on a sofa next to a dog", "a kitten on a couch"]
    records = [ImageRecord(k, cat, refs) for k in ("good", "bad", "worst")]
    caps = [cap("a cat on a couch"), cap("a horse on a couch"), cap("a pizza")]
    reports = photo_reports(records, caps, {"good": 0.9, "bad": 0.1, "worst": 0.1}, None)
    assert [p.record.image_id for p in reports] == ["worst", "bad", "good"]  # equal CIDEr: more hallucinated first
    assert reports[1].judged.hallucinated == {"horse"} and reports[1].missed == ["cat", "dog"]
    assert reports[2].judged.hallucinated == set() and reports[2].missed == ["dog"]
    page = report_html(reports, {"CIDEr": 0.37}, "hand-made")
    assert page.count("missed (named by the references)") == 3 and "missed (boxed)" not in page
    assert page.count('alt="attention of') == sum(len(p.named) for p in reports) == 5  # pizza; horse, couch; cat, couch
    with pytest.raises(ValueError, match="no CIDEr"):
        photo_reports(records, caps, {"good": 0.9}, None)
    with pytest.raises(ValueError, match="one caption per record"):
        photo_reports(records, caps[:2], {}, None)
