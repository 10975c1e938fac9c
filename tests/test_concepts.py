"""COCO concepts from the encoder's ImageNet head (captioner/concepts/imagenet.py): the table, the probabilities,
and that they say what real photos show."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import captioner
from captioner.concepts import imagenet as C
from captioner.concepts.words import CATEGORY_WORDS

EXAMPLES = Path(captioner.__file__).resolve().parent / "assets" / "examples"


# ----------------------------------------------------------------------------- the table

def test_every_name_in_the_table_is_an_imagenet_class():
    names = set(C.imagenet_classes())
    assert len(C.imagenet_classes()) == 1000 and len(names) == 1000  # exact, unique names
    unknown = [(cat, n) for cat, entries in C.CATEGORY_CLASSES.items() for e in entries for n in e.split("..")
               if n not in names]
    assert not unknown, f"not ImageNet class names (exact spelling of torchvision's meta): {unknown}"


def test_the_kept_class_names_are_torchvisions():
    """The class names kept beside the package (read without importing torchvision) are torchvision's, in order."""
    import torchvision

    assert C.imagenet_classes() == tuple(torchvision.models.ResNet50_Weights.DEFAULT.meta["categories"])


def test_a_first_caption_does_not_import_torchvision():
    """Reading a photo with the bundled model leaves torchvision unimported: importing it (and torch's compiler
    with it) took most of a first caption's time."""
    import subprocess
    import sys

    code = ("import sys, captioner; m = captioner.load(); c = m.caption(sys.argv[1]); "
            "assert c.concepts is not None; print('torchvision' in sys.modules)")
    photo = next(p for p in sorted(EXAMPLES.iterdir()) if p.suffix.lower() in (".jpg", ".jpeg"))
    out = subprocess.run([sys.executable, "-c", code, str(photo)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_name_that_is_no_imagenet_class_is_an_error(monkeypatch):
    monkeypatch.setitem(C.CATEGORY_CLASSES, "cat", ("tabby", "house cat"))
    with pytest.raises(ValueError, match="house cat"):
        C.category_classes.__wrapped__()  # the uncached builder, on the patched table


def test_no_imagenet_class_supports_two_categories(monkeypatch):
    counts = Counter(k for idx in C.category_classes().values() for k in idx)
    assert max(counts.values()) == 1
    monkeypatch.setitem(C.CATEGORY_CLASSES, "cup", C.CATEGORY_CLASSES["cup"] + ("goblet",))  # goblet: wine glass
    with pytest.raises(ValueError, match="goblet"):
        C.category_classes.__wrapped__()


def test_seen_and_unseen_split_the_coco_categories():
    seen = set(C.CATEGORY_CLASSES)
    assert seen <= set(CATEGORY_WORDS), f"not COCO categories: {seen - set(CATEGORY_WORDS)}"
    assert not seen & C.UNSEEN
    assert seen | C.UNSEEN == set(CATEGORY_WORDS), f"neither seen nor unseen: {set(CATEGORY_WORDS) - seen - C.UNSEEN}"
    assert {"person", "giraffe"} <= C.UNSEEN


def test_unseen_categories_have_no_imagenet_class_of_their_name():
    """Name search: no ImageNet class is named by a caption word of an unseen category, nor holds the
    category's name, except the homonyms on record (ImageNet's "kite" is a bird)."""
    names = [n for n in C.imagenet_classes() if n not in C.HOMONYMS]
    found = {}
    for cat in C.UNSEEN:
        words = {w.replace("_", " ").lower() for w in CATEGORY_WORDS[cat].split()}
        hits = [n for n in names if n.lower() in words or re.search(rf"\b{re.escape(cat)}s?\b", n, re.I)]
        if hits:
            found[cat] = hits
    assert not found, f"unseen categories that ImageNet may see after all: {found}"


def test_homonyms_support_what_the_record_says():
    names = C.imagenet_classes()
    owner = {names[k]: cat for cat, idx in C.category_classes().items() for k in idx}
    assert {n: owner.get(n) for n in C.HOMONYMS} == C.HOMONYMS


def test_runs_cover_the_breeds_and_birds():
    table, names = C.category_classes(), C.imagenet_classes()
    assert table["dog"] == tuple(range(151, 269))  # all 118 breeds
    assert [names[k] for k in table["cat"]] == ["tabby", "tiger cat", "Persian cat", "Siamese cat", "Egyptian cat"]
    assert {"kite", "goose", "king penguin", "hen", "crane bird"} <= {names[k] for k in table["bird"]}
    assert len(table["bird"]) == 59


# ----------------------------------------------------------------------------- probabilities

def test_probabilities_are_sums_of_class_probabilities_and_at_most_one():
    head = nn.Linear(16, 1000)
    feats = 10 * torch.randn(4, 9, 16)  # (B, P, D), large: peaked softmax
    probs = C.category_probs(C.imagenet_logits(head, feats))  # (B, C)
    assert probs.shape == (4, len(C.CATEGORIES))
    assert (probs >= 0).all() and (probs <= 1).all() and (probs.sum(1) <= 1 + 1e-6).all()
    cls = head(feats.mean(1)).softmax(-1)  # (B, K)
    for c, cat in enumerate(C.CATEGORIES):
        assert torch.allclose(probs[:, c], cls[:, list(C.category_classes()[cat])].sum(1), atol=1e-6)


def test_a_class_logit_far_above_the_rest_gives_its_category():
    head = nn.Linear(1000, 1000, bias=False)
    nn.init.eye_(head.weight)
    feats = torch.zeros(1, 4, 1000)
    feats[..., 207] = 50.0  # golden retriever
    found = C.concepts_of(C.imagenet_logits(head, feats))[0]
    assert found.top[0][0] == "dog" and found.top[0][1] > 0.99
    assert found.classes[0][0] == "golden retriever"
    with pytest.raises(KeyError, match="UNSEEN"):
        found.prob("person")


def test_concepts_keep_what_reaches_the_threshold_most_probable_first():
    head, feats = nn.Linear(8, 1000), 5 * torch.randn(3, 4, 8)
    logits = C.imagenet_logits(head, feats).detach()  # (B, K)
    full = C.category_probs(logits)
    for b, found in enumerate(C.concepts_of(logits, threshold=0.02, top_k=3)):
        expect = {cat for c, cat in enumerate(C.CATEGORIES) if full[b, c] >= 0.02}
        assert {cat for cat, _ in found.top} == expect
        assert [p for _, p in found.top] == sorted((p for _, p in found.top), reverse=True)
        assert len(found.classes) == 3 and found.classes[0][1] >= found.classes[-1][1]


def test_an_encoder_without_an_imagenet_head_is_an_error():
    model = nn.Module()
    model.encoder = nn.Module()
    model.encoder.backbone = nn.Sequential(nn.Conv2d(3, 8, 1))  # as ResNet: avgpool and fc dropped
    with pytest.raises(ValueError, match="no 1000-way ImageNet head"):
        C.encoder_head(model)


# ----------------------------------------------------------------------------- the bundled model, real photos

@torch.no_grad()
def test_head_on_the_mean_annotation_vector_is_the_classifiers_own_output(bundled):
    x = bundled.preprocess(EXAMPLES / "cat.jpg")[None]  # (1, 3, S, S)
    net = bundled.model.encoder.backbone
    assert not net.training  # eval: the classifier's dropout is the identity
    feats = bundled.model.encode(x)  # (1, P, D), what the decoder attends over
    assert torch.allclose(C.imagenet_logits(C.encoder_head(bundled.model), feats), net(x), atol=1e-4)


def test_the_example_photos_show_what_they_show(bundled):
    cat, coffee = bundled.concepts([EXAMPLES / "cat.jpg", EXAMPLES / "coffee.jpg"])
    assert cat.top and cat.top[0][0] == "cat", cat.top
    assert cat.classes[0][0] in {"tabby", "tiger cat", "Persian cat", "Siamese cat", "Egyptian cat"}
    assert coffee.top and coffee.top[0][0] == "cup", coffee.top


@torch.no_grad()
def test_flickr_photos_whose_captions_say_dog_get_a_high_dog_probability(bundled, flickr):
    from captioner.data import load_flickr8k
    from captioner.vocab import tokenize

    words = set(CATEGORY_WORDS["dog"].split())
    mentions = lambda r: sum(bool(words & set(tokenize(c))) for c in r.captions)  # noqa: E731
    test = load_flickr8k(flickr, "test")
    dogs = [r for r in test if mentions(r) == 5][:8]  # every reference says dog
    others = [r for r in test if mentions(r) == 0][:8]
    p_dog = {}
    for name, recs in (("dogs", dogs), ("others", others)):
        found = bundled.concepts([r.path for r in recs], threshold=0.3)
        p_dog[name] = np.array([f.prob("dog") for f in found])
    assert np.median(p_dog["dogs"]) >= 0.4 and p_dog["dogs"].min() >= 0.15, p_dog
    assert np.median(p_dog["others"]) <= 0.1, p_dog
