"""The offline ImageNet weights are really loaded (strictly) and really work on real photos."""
from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch

from captioner.images import load_image, preprocess
from captioner.model import encoder as encoder_module, packed_linear
from captioner.model.encoder import LITE_VARIANTS, Encoder, build_lite, lite_weights_path, normalization
from .conftest import ENV, ROOT, need_bundled

DOG_CLASSES = range(151, 269)  # ImageNet classes 151..268 are dog breeds

# Flickr8k photos whose five captions all say "dog"
DOG_PHOTOS = ["1001773457_577c3a7d70.jpg", "1019077836_6fc9b15408.jpg", "1024138940_f1fefbdce1.jpg",
              "1032122270_ea6f0beedb.jpg", "1015584366_dfcec3c85a.jpg", "1020651753_06077ec457.jpg"]


@pytest.mark.parametrize("name", sorted(LITE_VARIANTS))
def test_lite_weights_load_strictly(name):
    state = torch.load(lite_weights_path(name), map_location="cpu", weights_only=True)
    net = build_lite(name, pretrained=True)
    own = net.state_dict()
    assert set(own) == set(state)  # every key matched, nothing left over
    assert all(torch.equal(own[k], state[k]) for k in state)


@pytest.mark.parametrize("name", sorted(LITE_VARIANTS))
def test_lite_classifies_real_dog_photos_as_dogs(flickr, name):
    caps = (flickr / "captions.txt").read_text()
    photos = [p for p in DOG_PHOTOS if p in caps]
    assert len(photos) >= 3
    net = build_lite(name, pretrained=True).eval()
    size = LITE_VARIANTS[name][2]
    mean, std = normalization(name)
    x = torch.stack([preprocess(load_image(flickr / "Images" / p), size, mean, std) for p in photos])
    with torch.no_grad():
        top5 = net(x).topk(5, dim=-1).indices  # (N, 5)
    hits = [any(int(c) in DOG_CLASSES for c in row) for row in top5]
    top1 = [int(row[0]) in DOG_CLASSES for row in top5]
    assert all(hits), f"{name}: a dog class should be in the top 5 of every dog photo, got {top5.tolist()}"
    assert sum(top1) >= len(photos) - 1, f"{name}: top-1 should be a dog breed, got {top5[:, 0].tolist()}"
    # the same network with random weights does not know dogs: the test can fail
    rand = build_lite(name, pretrained=False).eval()
    with torch.no_grad():
        rand_top1 = rand(x).argmax(-1)
    assert sum(int(c) in DOG_CLASSES for c in rand_top1) < len(photos)


@pytest.mark.parametrize("name,size,grid", [("efficientnet_lite0", 224, 7), ("efficientnet_lite2", 260, 9),
                                            ("efficientnet_lite0", 224, 5)])
def test_encoder_grid(name, size, grid):
    enc = Encoder(name, pretrained=False, grid_size=grid).eval()
    with torch.no_grad():
        out = enc(torch.randn(2, 3, size, size))
    assert out.shape == (2, grid * grid, 1280)


def test_resnet_builds_offline_without_weights():
    enc = Encoder("resnet101", pretrained=False, grid_size=14).eval()
    with torch.no_grad():
        out = enc(torch.randn(1, 3, 224, 224))
    assert out.shape == (1, 196, 2048)  # 7x7 native grid pooled to the paper's 14x14


def test_unknown_encoder_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown encoder 'vgg'"):
        Encoder("vgg", False, 7)


@pytest.mark.parametrize("name,size,native", [("efficientnet_lite2", 260, 17), ("efficientnet_lite0", 224, 14)])
def test_output_stride_16_doubles_the_native_grid(name, size, native):
    coarse = Encoder(name, pretrained=False, grid_size=native).eval()
    fine = Encoder(name, pretrained=False, grid_size=native, output_stride=16).eval()
    fine.load_state_dict(coarse.state_dict())  # dilation adds no parameters
    with torch.no_grad():
        fmap = fine.feature_map(torch.randn(1, 3, size, size))
    assert fmap.shape[-2:] == (native, native)  # not pooled up: the backbone itself is 2x finer


def test_output_stride_16_keeps_what_the_weights_see(flickr):
    """Dilating the last stage keeps each unit's field of view, so the pretrained network still
    recognises the photo; pooled features stay close to the stride-32 ones (a random net would not
    make this pass for the classification check)."""
    photos = [flickr / "Images" / p for p in DOG_PHOTOS if (flickr / "Images" / p).exists()][:4]
    assert photos
    mean, std = normalization("efficientnet_lite0")
    x = torch.stack([preprocess(load_image(p), 224, mean, std) for p in photos])
    coarse = build_lite("efficientnet_lite0", pretrained=True).eval()
    fine = build_lite("efficientnet_lite0", pretrained=True, output_stride=16).eval()
    with torch.no_grad():
        fc, ff = coarse.features(x), fine.features(x)  # (N, 1280, 7, 7), (N, 1280, 14, 14)
        top5 = fine(x).topk(5, dim=-1).indices
    assert ff.shape[-1] == 2 * fc.shape[-1]
    cos = torch.nn.functional.cosine_similarity(fc.mean((2, 3)), ff.mean((2, 3)))
    assert (cos > 0.9).all(), cos
    assert all(any(int(c) in DOG_CLASSES for c in row) for row in top5)


def test_output_stride_is_checked_and_names_its_own_cache():
    from captioner.config import ModelConfig
    from captioner.model.encoder import build_preprocess

    with pytest.raises(ValueError, match="output_stride must be 16 or 32"):
        Encoder("efficientnet_lite0", False, 7, output_stride=8)
    base = ModelConfig(encoder="efficientnet_lite2", image_size=260, grid_size=9)
    fine = ModelConfig(encoder="efficientnet_lite2", image_size=260, grid_size=17, output_stride=16)
    assert build_preprocess(base).cache_name("flickr8k", "train") == "flickr8k-train-efficientnet_lite2-260px-g9"
    assert build_preprocess(fine).cache_name("flickr8k", "train").endswith("-g17-os16")


def _coco_photos(root, n: int) -> list:
    return sorted((root / "train2017").glob("*.jpg"))[:n]


@torch.no_grad()
def test_a_photo_gives_the_same_features_at_any_thread_count_and_in_any_batch(bundled, coco_mini, monkeypatch):
    """The encoder's 1x1 convolutions, each with its batch norm folded in, are packed products on each pixel's row
    (packed_linear.pointwise): a photo's features are bit-identical at 1 and 2 threads and alone or in a batch of
    3 (oneDNN's own convolution gave features up to 2.6e-5 apart), and within float rounding of that convolution
    followed by its batch norm."""
    if not packed_linear.has_onednn():
        pytest.skip("this torch has no oneDNN: the encoder's convolutions are F.conv2d")
    x = torch.stack([bundled.preprocess(p) for p in _coco_photos(coco_mini, 3)])  # (3, 3, S, S)
    old, got = torch.get_num_threads(), {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got[threads, "alone"] = bundled.encode(x[1:2])[0]  # (P, D)
            got[threads, "among 3"] = bundled.encode(x)[1]
    finally:
        torch.set_num_threads(old)
    want = got[1, "alone"]
    assert all(torch.equal(f, want) for f in got.values()), {k: float((f - want).abs().max()) for k, f in got.items()}
    plain = functools.partial(packed_linear.pointwise, plain=True)  # oneDNN's convolution, batch norm, relu6
    monkeypatch.setattr(encoder_module, "pointwise", plain)
    oracle = bundled.encode(x[1:2])[0]
    assert not torch.equal(oracle, want)  # the oracle computes another way ...
    torch.testing.assert_close(oracle, want, atol=1e-4, rtol=1e-4)  # ... to float rounding


def test_the_stem_and_depthwise_convolutions_fold_their_batch_norms_never_stale():
    """conv_bn_relu6: one convolution with its eval-mode batch norm folded into the weight and bias and relu6 in
    place (no batch norm or relu6 pass over the activations), within float rounding of the three layers as written;
    a batch norm changed since (its statistics moved in place) is folded again, never read stale; with autograd the
    layers run as written."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    conv = encoder_module.SameConv2d(16, 16, 3, stride=2, groups=16, bias=False)  # odd 13: SAME pads one side more
    bn = torch.nn.BatchNorm2d(16, eps=1e-3).eval()
    with torch.no_grad():
        for t, (lo, hi) in zip((bn.running_mean, bn.running_var, bn.weight, bn.bias),
                               ((-1, 1), (0.5, 2), (0.5, 2), (-1, 1))):
            t.uniform_(lo, hi)
    x = torch.randn(2, 16, 13, 13)
    as_written = lambda: F.relu6(bn(conv(x)))  # noqa: E731
    with torch.no_grad():
        if not packed_linear.packs(x, conv.weight):
            pytest.skip("this torch computes the encoder's layers as written (no oneDNN)")
        first = encoder_module.conv_bn_relu6(conv, bn, x)
        torch.testing.assert_close(first, as_written(), atol=1e-5, rtol=1e-5)
        bn.running_mean += 0.5  # in place: the tensor's version moves
        moved = encoder_module.conv_bn_relu6(conv, bn, x)
        torch.testing.assert_close(moved, as_written(), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(moved, first)
    assert torch.equal(encoder_module.conv_bn_relu6(conv, bn, x), as_written())  # autograd on: as written


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_captions_are_byte_identical_at_1_and_2_threads(coco_mini, tmp_path, dtype):
    """scripts/caption.py --json on coco-mini photos prints the same bytes at OMP_NUM_THREADS=1 and 2: captions,
    log-probs, word log-probs and choice scores do not depend on the thread count, in float32 and in int8 (its
    integer sums and each row's own scale: model/int8_rows.py)."""
    need_bundled()
    folder = tmp_path / "photos"
    folder.mkdir()
    for p in _coco_photos(coco_mini, 6):
        (folder / p.name).symlink_to(p)
    out = {}
    for threads in ("1", "2"):
        proc = subprocess.run([sys.executable, "scripts/caption.py", str(folder), "--json", "--batch-size", "4",
                               "--dtype", dtype],
                              cwd=ROOT, env={**ENV, "OMP_NUM_THREADS": threads}, capture_output=True, timeout=600)
        assert proc.returncode == 0, proc.stderr.decode()
        out[threads] = proc.stdout
    assert out["1"].count(b"\n") == 6
    assert out["1"] == out["2"]
