"""Fine-tuning the encoder's top stages from cached activations (model.tune_stages), and the terms that
read the ImageNet head (concept maps, head preservation): invariants, a cache that stays honest, and
a real run on a few Flickr8k photos that changes exactly the weights it should."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from captioner.concepts.maps import cam_loss, concept_maps, head_kl
from captioner.concepts.imagenet import CATEGORIES, MAP_CATEGORIES, category_classes
from captioner.config import load_config
from captioner.data import build_records
from captioner.data.activations import build_activations, cache_name, open_activations
from captioner.data.dataset import ActivationDataset, collate
from captioner.model.encoder import Encoder, build_preprocess
from captioner.training.run import encoder_train_mode, tuned_parameters

from .conftest import ROOT

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("output_stride", [32, 16])
def test_top_of_stem_is_the_whole_encoder(output_stride):
    enc = Encoder("efficientnet_lite0", False, 7 if output_stride == 32 else 14, output_stride).eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        acts = enc.below_split(x)  # (2, C, h, w)
        assert acts.shape[-1] == 14  # the input of the last stride-2 stage: stride 16
        assert torch.allclose(enc.above_split(acts), enc(x), atol=1e-5)


def test_top_modules_are_the_top_stages_and_never_the_classifier():
    enc = Encoder("efficientnet_lite0", False, 7)
    net = enc.backbone
    one, two = enc.top_modules(1), enc.top_modules(2)
    assert net._fc not in one + two and net._conv_head in one and net._bn1 in one
    assert set(map(id, one)) < set(map(id, two))
    assert net._blocks[enc.split_block] in two and net._blocks[enc.split_block] not in one
    assert enc.top_modules(0) == []
    with pytest.raises(ValueError, match="tune_stages must be between 0 and 2"):
        enc.top_modules(3)


def test_resnet_says_to_fine_tune_whole():
    enc = Encoder("resnet101", False, 7)
    with pytest.raises(ValueError, match="fine_tune_encoder"):
        enc.below_split(torch.zeros(1, 3, 64, 64))


def _records(flickr, n=3):
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"data.root={flickr}", f"data.limit={n}"])
    return cfg, build_records(cfg.data, "train")


def test_activation_cache_is_keyed_by_the_lower_weights_only(flickr, tmp_path):
    cfg, recs = _records(flickr)
    cfg.model.image_size = 128
    prep = build_preprocess(cfg.model)
    enc = Encoder(cfg.model.encoder, True, cfg.model.grid_size).eval()
    name = cache_name(prep, "flickr8k", "train3", enc.split_block)
    c = build_activations(tmp_path, name, enc, prep, recs, flip=True, num_workers=0, progress=False)
    x = torch.stack([prep(r.path) for r in recs])
    with torch.no_grad():
        assert np.allclose(c.acts[:], enc.below_split(x).numpy(), atol=2e-2)
        assert np.allclose(c.flipped[:], enc.below_split(x.flip(-1)).numpy(), atol=2e-2)
        logits = enc.backbone(x)  # (3, K)
    assert (torch.from_numpy(np.asarray(c.logits[:, 0], dtype=np.float32)).argmax(1) == logits.argmax(1)).all()
    assert open_activations(tmp_path, name, enc, prep, recs, flip=False) is not None  # a flip cache serves both
    with torch.no_grad():
        enc.backbone._conv_head.weight.mul_(2)  # the tuned part changes: still valid
    assert open_activations(tmp_path, name, enc, prep, recs, flip=True) is not None
    with torch.no_grad():
        enc.backbone._blocks[0]._depthwise_conv.weight.add_(0.1)  # a lower weight changes: stale
    assert open_activations(tmp_path, name, enc, prep, recs, flip=True) is None
    assert open_activations(tmp_path, name, enc, prep, recs[:2], flip=True) is None  # another image list


def test_mirror_image_captions_swap_left_and_right():
    acts = np.zeros((1, 2, 3, 3), np.float16)
    flipped = np.ones((1, 2, 3, 3), np.float16)
    logits = np.zeros((1, 2, 4), np.float16)
    logits[0, 1] = 1
    ds = ActivationDataset([(acts, flipped, logits)], [0], [[[1, 7, 8, 2]]], swap={7: 8, 8: 7})
    seen = {}
    for _ in range(40):
        x, caps, lg = ds[0]
        seen[float(x.mean())] = (caps, float(lg.mean()))
    assert seen == {0.0: ([[1, 7, 8, 2]], 0.0), 1.0: ([[1, 8, 7, 2]], 1.0)}
    b = collate([ds[0], ds[0]])
    assert b.teacher_logits.shape == (2, 4) and b.visual.shape == (2, 2, 3, 3)


def _head(D=16, P=9):
    from captioner.concepts.imagenet import imagenet_classes

    head = torch.nn.Linear(D, len(imagenet_classes()))
    torch.nn.init.normal_(head.weight, std=0.1)
    return head


def test_concept_maps_are_distributions_that_peak_where_the_class_is():
    head = _head()
    dog = category_classes()["dog"][0]
    feats = torch.rand(2, 9, 16) * 0.1  # (B, P, D)
    feats[0, 4] += 3 * head.weight[dog].detach() / head.weight[dog].norm()  # region 4 looks like a dog
    maps, probs = concept_maps(head, feats)
    C = len(MAP_CATEGORIES)  # the seen categories, then person
    assert maps.shape == (2, C, 9) and probs.shape == (2, C) and MAP_CATEGORIES[-1] == "person"
    assert torch.allclose(maps.sum(-1), torch.ones(2, C), atol=1e-5) and (maps >= 0).all()
    assert maps[0, CATEGORIES.index("dog")].argmax() == 4
    assert probs[0, CATEGORIES.index("dog")] > probs[1, CATEGORIES.index("dog")]


def test_cam_loss_supervises_only_confident_concept_words_and_is_least_at_the_map():
    C, P, V = len(CATEGORIES), 9, 6
    word_cats = torch.zeros(V, C)
    dog = CATEGORIES.index("dog")
    word_cats[4, dog] = 1  # word 4 = "dog"
    maps = torch.softmax(torch.randn(2, C, P), -1)
    probs = torch.zeros(2, C)
    probs[0, dog] = 0.9  # image 0 confidently has a dog, image 1 does not
    targets = torch.tensor([[3, 4, 2], [3, 4, 2]])  # "a dog <end>" for both images
    lengths = torch.tensor([3, 3])
    index = torch.tensor([0, 1])
    alphas = torch.softmax(torch.randn(2, 3, P), -1).requires_grad_()
    loss, n = cam_loss(alphas, targets, lengths, index, maps, probs, word_cats, 0.1)
    assert n == 1  # only image 0's "dog"
    loss.backward()
    assert alphas.grad[1].abs().sum() == 0 and alphas.grad[0, [0, 2]].abs().sum() == 0
    assert alphas.grad[0, 1].abs().sum() > 0
    at_map = alphas.detach().clone()
    at_map[0, 1] = maps[0, dog]
    best, _ = cam_loss(at_map, targets, lengths, index, maps, probs, word_cats, 0.1)
    assert best <= loss  # cross-entropy is least when the attention is the map
    none, n0 = cam_loss(alphas, targets, torch.tensor([1, 1]), index, maps, probs, word_cats, 0.1)
    assert n0 == 0 and none == 0  # "dog" past the caption's length is padding


def test_head_kl_is_zero_for_the_teachers_own_logits():
    head = _head()
    feats = torch.randn(3, 9, 16)
    from captioner.concepts.imagenet import imagenet_logits

    assert head_kl(head, feats, imagenet_logits(head, feats)).abs() < 1e-5
    assert head_kl(head, feats, torch.randn(3, head.out_features)) > 0


@pytest.mark.parametrize("objective", ["xe", "scst"])
def test_tuning_trains_the_top_stages_only(flickr, tmp_path, objective):
    """A real run on 4 photos (+ mirror images): the tuned top stages and the decoder move; the lower
    stages (the cache's key) and the ImageNet classifier do not; frozen BN keeps ImageNet's statistics."""
    from captioner.checkpoint import load_checkpoint
    from captioner.training.engine import fit

    out = tmp_path / "run"
    cfg = load_config(ROOT / "configs/tiny.yaml", [
        f"data.root={flickr}", "data.limit=4", f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={out}",
        "model.image_size=128", "model.grid_size=4", "model.tune_stages=1", "data.flip=true", "train.epochs=1",
        "train.alpha_cam=1.0", "train.alpha_head=1.0", "train.val_limit=2", "train.checkpoint_every=0",
        f"train.objective={objective}", "train.scst_xent=0.5", "train.scst_samples=2"])
    fit(cfg, log=lambda _: None, progress=False)
    ref = Encoder(cfg.model.encoder, True, cfg.model.grid_size).state_dict()
    got = {k.removeprefix("encoder."): v for k, v in load_checkpoint(out / "last.safetensors").model_state.items()
           if k.startswith("encoder.")}
    changed = {k for k in ref if not torch.equal(ref[k], got[k])}
    last = f"backbone._blocks.{len(Encoder(cfg.model.encoder, False, 4).backbone._blocks) - 1}."
    assert any(k.startswith(last) and k.endswith("weight") for k in changed)
    assert "backbone._conv_head.weight" in changed
    assert all(k.startswith((last, "backbone._conv_head", "backbone._bn1")) for k in changed), changed
    assert not any("running_" in k for k in changed)  # train.encoder_bn=frozen
    rec = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("head_kl" in r and "cam" in r for r in rec if r["kind"] == "train")
    assert 0.0 <= [r for r in rec if r["kind"] == "val"][-1]["head_top1_agreement"] <= 1.0


def test_bn_modes():
    from captioner.model.show_attend_tell import build_model

    cfg = load_config(None, ["model.tune_stages=1", "model.pretrained=false"])
    model = build_model(cfg.model, 10)
    model.train()
    encoder_train_mode(cfg, model)
    assert not any(m.training for m in model.encoder.modules())
    cfg.train.encoder_bn = "train"
    encoder_train_mode(cfg, model)
    top = model.encoder.top_modules(1)
    assert all(m.training for m in top) and not model.encoder.backbone._blocks[0].training
    assert {id(p) for p in tuned_parameters(cfg, model)} == {id(p) for m in top for p in m.parameters()}


def test_person_map_reads_clothes_only():
    from captioner.concepts.imagenet import imagenet_classes, map_membership, person_classes

    m = map_membership()
    names = {imagenet_classes()[k] for k in person_classes()}
    assert {"jersey", "suit", "bikini"} <= names and m[-1].sum() == len(person_classes())
    assert (m[:-1] @ m[-1]).sum() == 0  # no class is both a category's and person's


def test_category_maps_are_rows_of_concept_maps():
    from captioner.concepts.maps import category_maps

    head = _head()
    feats = torch.randn(3, 9, 16)
    maps, probs = concept_maps(head, feats)
    cats = torch.tensor([0, MAP_CATEGORIES.index("dog"), len(MAP_CATEGORIES) - 1])
    one, p = category_maps(head, feats, cats)
    assert torch.allclose(one, maps[torch.arange(3), cats], atol=1e-5)
    assert torch.allclose(p, probs[torch.arange(3), cats], atol=1e-6)


def test_cache_built_mid_chain_keeps_the_pretrained_teacher(flickr, tmp_path):
    """A cache (re)built with an encoder whose top is already tuned stores the PRETRAINED head's logits
    (the alpha_head target), and a cache whose teacher differs from the pretrained one is not used."""
    import json

    cfg, recs = _records(flickr)
    cfg.model.image_size = 128
    prep = build_preprocess(cfg.model)
    pretrained = Encoder(cfg.model.encoder, True, cfg.model.grid_size).eval()
    tuned = Encoder(cfg.model.encoder, True, cfg.model.grid_size).eval()
    with torch.no_grad():
        for m in tuned.top_modules(2):
            for p in m.parameters():
                p.add_(0.05 * torch.randn_like(p))  # a stage-1 top, as a rebuilt cache mid-chain would see it
    name = cache_name(prep, "flickr8k", "train3", tuned.split_block)
    c = build_activations(tmp_path, name, tuned, prep, recs, flip=False, num_workers=0, progress=False)
    x = torch.stack([prep(r.path) for r in recs])
    with torch.no_grad():
        want, tuned_logits = pretrained.backbone(x), tuned.backbone(x)  # (3, K)
    got = torch.from_numpy(np.asarray(c.logits[:, 0], dtype=np.float32))
    assert (got - want).abs().max() < 0.05 < (got - tuned_logits).abs().max()
    meta_path = tmp_path / f"{name}.json"
    meta = json.loads(meta_path.read_text())
    meta["key"]["teacher"] = "0" * 16  # made by another teacher (e.g. an older cache built through a tuned top)
    meta_path.write_text(json.dumps(meta))
    assert open_activations(tmp_path, name, tuned, prep, recs, flip=False) is None
    with torch.no_grad():
        tuned.backbone._blocks[0]._depthwise_conv.weight.add_(0.1)  # lower stages not the pretrained ones
    with pytest.raises(ValueError, match="not its pretrained ImageNet weights"):
        build_activations(tmp_path, "other", tuned, prep, recs, flip=False, num_workers=0, progress=False)


def test_two_folders_under_one_name_keep_two_activation_caches(flickr, tmp_path):
    """Like the feature caches: two folders prepared one after the other under one name (the same photo names,
    other photos) keep two activation caches, and neither is read for the other."""
    import shutil

    from captioner.data.records import ImageRecord

    cfg, _ = _records(flickr, 1)
    cfg.model.image_size = 128
    prep, enc = build_preprocess(cfg.model), Encoder(cfg.model.encoder, True, cfg.model.grid_size).eval()
    photos, folders = sorted((flickr / "Images").iterdir())[:4], {}
    for name, pair in (("a", photos[:2]), ("b", photos[2:])):
        (tmp_path / name / "Images").mkdir(parents=True)
        for k, src in enumerate(pair):
            shutil.copy(src, tmp_path / name / "Images" / f"p{k}.jpg")
        folders[name] = [ImageRecord(f"p{k}.jpg", tmp_path / name / "Images" / f"p{k}.jpg", ["x"]) for k in range(2)]
    cache, name = tmp_path / "cache", cache_name(prep, "own_photos", "train", enc.split_block)
    a = build_activations(cache, name, enc, prep, folders["a"], flip=False, num_workers=0, progress=False)
    a_acts = np.array(a.acts)
    b = build_activations(cache, name, enc, prep, folders["b"], flip=False, num_workers=0, progress=False)
    assert a.path != b.path and a.path.is_file() and b.path.is_file()
    assert len(list(cache.glob("*.json"))) == 2 and len(list(cache.glob("*-logits.npy"))) == 2
    assert not np.array_equal(np.asarray(b.acts), a_acts)  # b's photos, not a's under the same names
    again = open_activations(cache, name, enc, prep, folders["a"], flip=False)
    assert again is not None and again.path == a.path and np.array_equal(np.asarray(again.acts), a_acts)
    assert open_activations(cache, name, enc, prep, folders["b"], flip=False).path == b.path  # found, not rebuilt
