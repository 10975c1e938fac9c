"""Vocabulary, config and dataset loaders (Flickr8k in both layouts, COCO, Karpathy JSON), feature cache."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

from captioner.config import ModelConfig, load_config
from captioner.data import build_records, load_coco, load_flickr8k, load_karpathy
from captioner.data.dataset import BucketBatchSampler, collate, collate_skip_missing, readable
from captioner.data.features import build_cache, open_cache
from captioner.model.encoder import Encoder, build_preprocess
from captioner.vocab import Vocab, tokenize

from .conftest import ROOT


def test_tokenizer_is_data_free_and_handles_punctuation():
    assert tokenize("A dog, running! Isn't it a T-shirt?") == ["a", "dog", "running", "isn't", "it", "a", "t-shirt"]
    assert tokenize("  ") == []


def test_vocab_roundtrip_and_unk():
    caps = ["a dog runs", "a dog sits", "a cat"]
    v = Vocab.build(caps, min_count=2)
    assert v.itos[:4] == ["<pad>", "<start>", "<end>", "<unk>"] and set(v.itos[4:]) == {"a", "dog"}
    ids = v.encode("A dog flies")
    assert ids[0] == v.start and ids[-1] == v.end and ids[3] == v.unk
    assert v.decode(ids) == ["a", "dog", "<unk>"]
    assert Vocab.from_json(v.to_json()).itos == v.itos
    stats = v.stats(caps)
    assert stats.size == 6 and stats.n_captions == 3 and stats.unk_rate == pytest.approx(3 / 8)


def test_config_layers_and_unknown_keys(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  grid_size: 5\ntrain:\n  lr: 0.001\n")
    cfg = load_config(f, ["train.lr=5e-4", "model.fine_tune_encoder=true"])
    assert cfg.model.grid_size == 5 and cfg.train.lr == 5e-4 and cfg.model.fine_tune_encoder is True
    with pytest.raises(ValueError, match="unknown setting 'train.lrr'"):
        load_config(None, ["train.lrr=1"])
    f.write_text("modle:\n  grid_size: 14\n")
    with pytest.raises(ValueError, match="unknown section 'modle'"):
        load_config(f)
    with pytest.raises(ValueError, match="expects int"):
        load_config(None, ["model.grid_size=big"])


@pytest.mark.parametrize("recipe", sorted((ROOT / "configs").glob("*.yaml")))
def test_shipped_recipes_parse(recipe):
    load_config(recipe)


def test_collate_sorts_and_pads():
    samples = [(torch.zeros(2), [[1, 5, 6, 2], [1, 7, 2]]), (torch.ones(2), [[1, 8, 9, 10, 11, 2]])]
    b = collate(samples)
    assert b.lengths.tolist() == [5, 3, 2] and b.image_index.tolist() == [1, 0, 0]
    assert b.inputs[0].tolist() == [1, 8, 9, 10, 11] and b.targets[0].tolist() == [8, 9, 10, 11, 2]
    assert b.inputs[2].tolist() == [1, 7, 0, 0, 0] and b.targets[2].tolist() == [7, 2, 0, 0, 0]


def test_collate_skip_missing_drops_unreadable_images():
    samples = [None, (torch.ones(2), [[1, 8, 2]]), None]
    b = collate_skip_missing(samples)
    assert b.visual.shape == (1, 2) and b.image_index.tolist() == [0] and b.lengths.tolist() == [2]
    assert collate_skip_missing([None, None]) is None and readable([None, None]) == []


def test_bucket_sampler_covers_everything_and_is_reproducible():
    lengths = list(np.random.RandomState(0).randint(5, 20, size=103))
    s = BucketBatchSampler(lengths, 8, seed=3)
    s.set_epoch(2)
    a = s.batches()
    assert sorted(i for b in a for i in b) == list(range(103))
    s.set_epoch(2)
    assert s.batches() == a
    s.set_epoch(3)
    assert s.batches() != a


def test_flickr8k_kaggle_layout(flickr):
    test = load_flickr8k(flickr, "test")
    assert len(test) == 1000 and all(len(r.captions) == 5 for r in test)
    assert test[0].path.is_file()
    assert len(load_flickr8k(flickr, "val")) == 1000


def test_flickr8k_original_token_layout(flickr, tmp_path):
    # the original release: Flickr8k.token.txt + Flicker8k_Dataset/
    names = (flickr / "Flickr_8k.testImages.txt").read_text().split()[:3]
    (tmp_path / "Flicker8k_Dataset").mkdir()
    lines = []
    for n in names:
        shutil.copy(flickr / "Images" / n, tmp_path / "Flicker8k_Dataset" / n)
        lines += [f"{n}#{k}\tcaption {k} of {n}" for k in range(5)]
    (tmp_path / "Flickr8k.token.txt").write_text("\n".join(lines))
    (tmp_path / "Flickr_8k.testImages.txt").write_text("\n".join(names))
    recs = load_flickr8k(tmp_path, "test")
    assert [r.image_id for r in recs] == names and recs[1].captions[2] == f"caption 2 of {names[1]}"
    assert all(r.path.is_file() for r in recs)


def test_coco_through_pycocotools(coco_mini):
    recs = load_coco(coco_mini / "train2017", coco_mini / "annotations" / "captions_train2017.json")
    assert len(recs) == 80 and all(len(r.captions) >= 5 and r.path.is_file() for r in recs)


def test_karpathy_split_json(tmp_path):
    data = {"images": [
        {"filepath": "val2014", "filename": "a.jpg", "split": "train", "cocoid": 1, "sentences": [{"raw": "A cat."}]},
        {"filepath": "val2014", "filename": "b.jpg", "split": "restval", "cocoid": 2, "sentences": [{"raw": "A dog."}]},
        {"filepath": "val2014", "filename": "c.jpg", "split": "test", "cocoid": 3, "sentences": [{"raw": "A cow."}]},
    ]}
    f = tmp_path / "dataset_coco.json"
    f.write_text(json.dumps(data))
    train = load_karpathy(tmp_path, f, "train")
    assert [r.image_id for r in train] == ["1", "2"] and train[0].path == tmp_path / "val2014" / "a.jpg"
    assert [r.captions for r in load_karpathy(tmp_path, f, "test")] == [["A cow."]]


def test_feature_cache_reused_and_rebuilt_on_mismatch(flickr, tmp_path):
    from captioner.config import DataConfig

    recs = build_records(DataConfig(root=str(flickr), limit=3), "test")
    enc = Encoder("efficientnet_lite0", True, 7)
    logs = []
    c1 = build_cache(tmp_path, "x", enc, 224, recs, num_workers=0, log=logs.append, progress=False)
    assert c1.features.shape == (3, 49, 1280) and c1.features.dtype == np.float16
    assert open_cache(tmp_path, "x", enc, 224, recs) is not None  # reused
    # the recipe's Preprocess names the same cache as the encoder's own normalisation at that size
    prep = build_preprocess(ModelConfig(encoder="efficientnet_lite0", image_size=224, grid_size=7))
    assert open_cache(tmp_path, "x", enc, prep, recs) is not None
    assert open_cache(tmp_path, "x", enc, replace(prep, image_size=192), recs) is None
    with pytest.raises(ValueError, match="build both from one model config"):
        open_cache(tmp_path, "x", enc, replace(prep, grid_size=5), recs)
    # another grid or another input size under the same name: detected, rebuilt, never silently used
    enc5 = Encoder("efficientnet_lite0", True, 5)
    assert open_cache(tmp_path, "x", enc5, 224, recs) is None
    c2 = build_cache(tmp_path, "x", enc5, 224, recs, num_workers=0, log=logs.append, progress=False)
    assert c2.features.shape == (3, 25, 1280)
    assert any("does not match" in m for m in logs)
    # a half-written cache (metadata missing) is not used
    (tmp_path / "x.json").unlink()
    assert open_cache(tmp_path, "x", enc5, 224, recs) is None


def test_two_folders_under_one_name_keep_two_caches(flickr, tmp_path):
    """Own photos: two folders prepared one after the other under one data.name (the same photo names, other
    photos) keep two caches, and neither is read for the other."""
    from captioner.data.records import ImageRecord

    photos = sorted((flickr / "Images").iterdir())[:4]
    folders = {}
    for name, pair in (("a", photos[:2]), ("b", photos[2:])):
        (tmp_path / name / "Images").mkdir(parents=True)
        for k, src in enumerate(pair):
            shutil.copy(src, tmp_path / name / "Images" / f"p{k}.jpg")
        folders[name] = [ImageRecord(f"p{k}.jpg", tmp_path / name / "Images" / f"p{k}.jpg", ["x"]) for k in range(2)]
    enc, cache = Encoder("efficientnet_lite0", True, 7), tmp_path / "cache"
    a = build_cache(cache, "own", enc, 224, folders["a"], num_workers=0, progress=False)
    a_feats = np.array(a.features)
    b = build_cache(cache, "own", enc, 224, folders["b"], num_workers=0, progress=False)
    assert a.path != b.path and a.path.is_file() and b.path.is_file() and len(list(cache.glob("*.npy"))) == 2
    assert not np.array_equal(np.asarray(b.features), a_feats)  # b's photos, not a's under the same names
    again = open_cache(cache, "own", enc, 224, folders["a"])
    assert again is not None and again.path == a.path and np.array_equal(np.asarray(again.features), a_feats)
    assert open_cache(cache, "own", enc, 224, folders["b"]).path == b.path  # prepared again: found, not rebuilt


def test_unreadable_images_are_reported_and_skipped(flickr, tmp_path):
    from captioner.data.records import ImageRecord

    good = build_records(__import__("captioner.config", fromlist=["DataConfig"]).DataConfig(root=str(flickr), limit=2), "test")
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    recs = good + [ImageRecord("broken.jpg", bad, ["x"]), ImageRecord("gone.jpg", tmp_path / "gone.jpg", ["y"])]
    logs = []
    cache = build_cache(tmp_path, "y", Encoder("efficientnet_lite0", True, 7), 224, recs, num_workers=0,
                        log=logs.append, progress=False)
    assert sorted(cache.missing) == ["broken.jpg", "gone.jpg"]
    assert any("2 image(s) could not be read" in m and "broken.jpg" in m for m in logs)


def test_feature_cache_keeps_values_float16_cannot_hold(flickr, tmp_path):
    """A random ResNet's features pass 65504: the cache widens to float32 (equal to the encoder's output),
    never rounds them to inf; an encoder that yields NaN is refused at cache time, naming it."""
    from captioner.config import DataConfig
    from captioner.images import load_image, preprocess

    recs = build_records(DataConfig(root=str(flickr), limit=3), "test")
    enc = Encoder("resnet152", False, 2).eval()
    prep = build_preprocess(ModelConfig(encoder="resnet152", image_size=64, grid_size=2))
    logs = []
    cache = build_cache(tmp_path, "r", enc, prep, recs, batch_size=2, num_workers=0, log=logs.append, progress=False)
    assert cache.features.dtype == np.float32 and any("float32" in m and "resnet152" in m for m in logs)
    x = torch.stack([preprocess(load_image(r.path), 64, prep.mean, prep.std) for r in recs])
    with torch.no_grad():
        direct = enc(x.contiguous(memory_format=torch.channels_last)).numpy()  # (3, 4, 2048)
    assert np.abs(direct).max() > np.finfo(np.float16).max  # the case this test is about
    scale = np.abs(direct).max()  # float16 would be off by up to 5e-4 of each value, or inf
    np.testing.assert_allclose(np.asarray(cache.features), direct, rtol=1e-4, atol=1e-5 * scale)
    assert open_cache(tmp_path, "r", enc, prep, recs) is not None  # a widened cache is reused like any other
    with torch.no_grad():
        enc.backbone[0].weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="resnet152 produced NaN/inf features"):
        build_cache(tmp_path, "n", enc, prep, recs, num_workers=0, progress=False)
    assert not (tmp_path / "n.json").exists()


def test_feature_batches_read_ahead_give_the_batches_of_reading_in_turn():
    """The loader's reader thread (cached features) changes when a batch is read, never what or in which order;
    an early end (a stop, max_steps) ends the thread; a failed read is raised where the batches are taken."""
    import threading

    import numpy as np

    from captioner.data.dataset import BucketBatchSampler, FeatureDataset, collate
    from captioner.data.loader import FeatureBatches, RankBatches

    feats = np.random.RandomState(0).rand(37, 4, 6).astype(np.float16)  # (N, P, D) like a cache
    caps = [[[1] + [4 + i % 5] * (1 + i % 3) + [2]] for i in range(37)]
    ds = FeatureDataset(feats, list(range(37)), caps)
    sampler = BucketBatchSampler([len(c[0]) for c in caps], 4, seed=3)
    ahead = list(FeatureBatches(ds, RankBatches(sampler, 0, 1), collate, prefetch=2))
    in_turn = list(FeatureBatches(ds, RankBatches(sampler, 0, 1), collate, prefetch=0))
    assert len(ahead) == len(in_turn) == len(RankBatches(sampler, 0, 1)) > 5
    for a, b in zip(ahead, in_turn):
        assert a.visual.dtype == torch.float32 and torch.equal(a.visual, b.visual)
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.image_index, b.image_index)
    assert torch.equal(ahead[0].visual[0], torch.from_numpy(feats[next(iter(RankBatches(sampler, 0, 1)))[0]]).float())
    before = threading.active_count()
    for k, _ in enumerate(FeatureBatches(ds, RankBatches(sampler, 0, 1), collate, prefetch=2)):
        if k == 1:
            break
    assert threading.active_count() == before  # the reader ended with the epoch's consumer

    class Broken(FeatureDataset):
        def __getitem__(self, i):
            raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        list(FeatureBatches(Broken(feats, list(range(37)), caps), RankBatches(sampler, 0, 1), collate, prefetch=2))
