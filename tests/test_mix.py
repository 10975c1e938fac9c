"""Training on several caption sets at once (data.sources): the config, COCO split files, per-set caches
and val sets, sampling weights, the vocabulary-extending warm start and the word-salad rule; a tiny mixed
run end to end on real photos (train, export, caption)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from captioner.config import Config, DecodeConfig, load_config
from captioner.data import build_mix, build_records
from captioner.data.dataset import BucketBatchSampler
from captioner.vocab import Vocab, is_salad

from .conftest import PAIRED, ROOT, need_flickr, need_paired, run, tiny_decoder


def _mix_sources(limit_split: Path | None = None) -> list[dict]:
    paired = need_paired()
    return [{"name": "flickr8k", "dataset": "flickr8k", "root": str(need_flickr())},
            {"name": "coco_paired", "dataset": "coco", "images": str(paired / "images"),
             "annotations": str(paired / "captions.json"), "train_split": str(limit_split or paired / "split_train.txt"),
             "val_split": str(paired / "split_val.txt"), "weight": 3}]


# ---------------------------------------------------------------- config

def test_sources_from_a_file_and_from_set(tmp_path):
    cfg = load_config(ROOT / "configs" / "mix_cpu.yaml")
    assert [s.name for s in cfg.data.sources] == ["flickr8k", "coco_paired"]
    assert cfg.data.sources[1].weight == 3.0 and cfg.data.sources[1].dataset == "coco"
    again = Config.from_dict(json.loads(json.dumps(cfg.to_dict())))  # as stored in a checkpoint
    assert again.data.sources == cfg.data.sources
    one = load_config(None, ['data.sources=[{"name": "f", "dataset": "flickr8k", "root": "x", "weight": "2"}]'])
    assert one.data.sources[0].weight == 2.0
    assert Config().data.source_list()[0].name == "flickr8k"  # one set: named after data.dataset (old cache names)


@pytest.mark.parametrize("sources, message", [
    ([{"name": "a", "dataset": "flickr8k", "wieght": 2}], "unknown key 'wieght'"),
    ([{"dataset": "flickr8k"}], "needs a name"),
    ([{"name": "a", "dataset": "flickr9k"}], "must be one of"),
    ([{"name": "a", "weight": 0}], "weight must be > 0"),
    ([{"name": "a"}, {"name": "a"}], "must be unique"),
    ([{"name": "a", "weight": "lots"}], "expects float"),
])
def test_bad_sources_are_errors_naming_the_key(sources, message):
    with pytest.raises(ValueError, match=message):
        Config.from_dict({"data": {"sources": sources}})


# ---------------------------------------------------------------- records

def test_both_sets_load_from_real_photos():
    cfg = Config.from_dict({"data": {"sources": _mix_sources()}})
    train, val = build_mix(cfg.data, "train"), build_mix(cfg.data, "val")
    sizes = {src.name: (len(t), len(v)) for (src, t), (_, v) in zip(train, val)}
    assert sizes == {"flickr8k": (6000, 1000), "coco_paired": (1047, 200)}
    coco_train, coco_val = train[1][1], val[1][1]
    assert not {r.path.name for r in coco_train} & {r.path.name for r in coco_val}  # never train on val
    assert all(r.path.is_file() and len(r.captions) >= 4 for r in coco_train + coco_val)
    assert [int(r.image_id) for r in coco_val] == sorted(int(r.image_id) for r in coco_val)


def test_a_split_file_naming_absent_photos_or_photos_without_captions_is_an_error(tmp_path):
    paired = need_paired()
    names = (paired / "split_val.txt").read_text().split()[:3]
    split = tmp_path / "split.txt"
    split.write_text("\n".join(names + ["COCO_val2014_999999999999.jpg", "COCO_val2014_999999999998.jpg"]))
    src = Config.from_dict({"data": {"sources": _mix_sources(split)}}).data.sources[1]
    with pytest.raises(ValueError, match=r"2 photo\(s\) of the split file have no captions.*999999999999"):
        build_records(src, "train")
    images = tmp_path / "images"  # the captions are there, two photos are not
    images.mkdir()
    for n in names[1:]:
        (images / n).symlink_to(paired / "images" / n)
    split.write_text("\n".join(names))
    src.images = str(images)
    with pytest.raises(FileNotFoundError, match=rf"1 photo\(s\) named by the split file are not in .*{names[0]}"):
        build_records(src, "train")


# ---------------------------------------------------------------- sampling weights

def test_sampling_weights_repeat_images_per_epoch_and_replay_on_resume():
    lengths, weights = [10.0] * 40, [1.0] * 30 + [2.5] * 10
    s = BucketBatchSampler(lengths, 4, seed=1, weights=weights)
    s.set_epoch(3)
    seen = [i for b in s.batches() for i in b]
    assert len(s) == len(s.batches())
    assert sorted(set(seen[:])) == list(range(40))
    heavy = [seen.count(i) for i in range(30, 40)]
    assert all(c in (2, 3) for c in heavy) and all(seen.count(i) == 1 for i in range(30))
    again = BucketBatchSampler(lengths, 4, seed=1, weights=weights)
    again.set_epoch(3)
    assert again.batches() == s.batches()  # a resumed run replays the same epoch
    plain = BucketBatchSampler(lengths, 4, seed=1)
    plain.set_epoch(3)
    ones = BucketBatchSampler(lengths, 4, seed=1, weights=[1.0] * 40)
    ones.set_epoch(3)
    assert ones.batches() == plain.batches()  # weights of 1: exactly the unweighted order


# ---------------------------------------------------------------- vocabulary-extending warm start

def test_extended_model_gives_old_words_the_same_scores_before_training():
    from captioner.api import DEFAULT_CHECKPOINT
    from captioner.checkpoint import load_checkpoint, load_model_state
    from captioner.model.show_attend_tell import build_model
    from captioner.training.new_words import grow_vocabulary

    paired = need_paired()
    ckpt = load_checkpoint(DEFAULT_CHECKPOINT)  # what train.init_from reads
    old, cfg = ckpt.vocab, ckpt.config
    model = build_model(cfg.model, len(old), pretrained=False)
    load_model_state(model, ckpt.model_state)
    model.eval()
    captions = [a["caption"] for a in json.loads((paired / "captions.json").read_text())["annotations"]]
    vocab = old.extended(captions, min_count=2)  # coco-paired's words the model file lacks
    assert vocab.itos[:len(old)] == old.itos and len(vocab) > len(old) + 20
    weights = grow_vocabulary(ckpt.model_state, len(vocab))
    grown = build_model(cfg.model, len(vocab), pretrained=False)
    load_model_state(grown, weights)
    grown.eval()
    with torch.no_grad():
        feats = model.encoder(torch.rand(1, 3, cfg.model.image_size, cfg.model.image_size))  # (1, P, D)
    ids = torch.tensor([old.encode("a dog runs on the grass")])
    with torch.no_grad():
        a = model.decoder.teacher_force(feats, ids[:, :-1], torch.tensor([ids.shape[1] - 1])).logits  # (1, T, V)
        b = grown.decoder.teacher_force(feats, ids[:, :-1], torch.tensor([ids.shape[1] - 1])).logits  # (1, T, V')
    assert torch.equal(a, b[..., :len(old)])  # old words: the same scores
    assert (b[..., len(old):].amax(-1) < a.amax(-1)).all()  # no new word starts out as the best guess
    lp_a, lp_b = a.log_softmax(-1), b.log_softmax(-1)[..., :len(old)]
    assert (lp_a - lp_b).abs().max() < 0.5  # the new words take little probability from the old ones
    assert not torch.equal(weights["decoder.embedding.weight"][-1], weights["decoder.embedding.weight"][-2])


# ---------------------------------------------------------------- word salad

@pytest.mark.parametrize("caption, salad", [
    ("a dog runs through the grass", False),
    ("a small black and white is playing with a toy in his mouth", False),
    ("a brown and brown and white is standing in front of a", True),
    ("a man in a black shirt and a black hat and black", True),
    ("a dog and a dog and a dog", True),
    ("a black dog", False),
    ("a dog with a white", True),
    ("", True),
])
def test_the_salad_rule_on_hand_made_captions(caption, salad):
    assert is_salad(caption.split()) is salad


def test_decoding_never_writes_salad_with_the_rule_on():
    from captioner.decoding.rules import Lexicon, Rules
    from captioner.decoding.search import decode
    from captioner.vocab import SpecialIds

    words = ["a", "and", "white", "dog", "cat", "runs"]
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>"] + words)
    dec = tiny_decoder(len(vocab))
    with torch.no_grad():
        dec.out_vocab.bias[vocab.end] += 1.5  # an untrained decoder that sometimes ends its caption
    torch.manual_seed(0)
    feats = torch.randn(24, 4, 16) * 3
    ids, lex = SpecialIds.of(vocab), Lexicon.of(vocab)
    ruled = lambda s: decode(dec, feats, ids, s, Rules(ids, s, lexicon=lex))  # noqa: E731
    for beam in (1, 3):
        off = ruled(DecodeConfig(beam_size=beam, max_len=12, block_salad=False))
        on = ruled(DecodeConfig(beam_size=beam, max_len=12))
        salad_off = sum(is_salad(vocab.decode(h[0].tokens)) for h in off)
        assert salad_off > 0  # an untrained decoder over six words writes salad: the rule has work to do
        ended = [vocab.decode(h[0].tokens) for h in on if len(h[0].tokens) < 12]  # not cut at max_len
        assert ended and not any(is_salad(words) for words in ended), (beam, ended)
        for h in on:  # capped ones too: no content word three times
            words = [w for w in vocab.decode(h[0].tokens) if w not in ("a", "and")]
            assert all(words.count(w) < 3 for w in words), words


# ---------------------------------------------------------------- a tiny mixed run, end to end

@pytest.mark.slow
def test_tiny_mixed_run_trains_exports_and_captions(tmp_path):
    sources = json.dumps([{**s, "weight": w} for s, w in zip(_mix_sources(), (1, 2))])
    common = ["--config", "configs/tiny.yaml", "--set", f"data.sources={sources}", f"data.cache_dir={tmp_path / 'c'}",
              f"train.out_dir={tmp_path / 'run'}", "train.epochs=1", "train.val_metric=CIDEr", "data.limit=6"]
    out = run("scripts/train.py", *common, "--no-progress")
    assert "training mix: flickr8k 6 train / 6 val photos, weight 1; coco_paired 6 train / 6 val photos, weight 2" \
        in out.stdout
    caches = sorted(p.name for p in (tmp_path / "c").glob("*.json"))
    assert [c.split("-")[0] for c in caches] == ["coco_paired", "coco_paired", "flickr8k", "flickr8k"]
    val = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in val if r["kind"] == "val"][-1]
    assert {"flickr8k/CIDEr", "coco_paired/CIDEr", "CIDEr"} <= set(val)
    assert val["CIDEr"] == pytest.approx((val["flickr8k/CIDEr"] + val["coco_paired/CIDEr"]) / 2)
    model = tmp_path / "model.safetensors"
    run("scripts/export.py", str(tmp_path / "run" / "best.safetensors"), str(model))
    photo = str(PAIRED / "images" / (PAIRED / "split_val.txt").read_text().split()[0])
    cap = run("scripts/caption.py", photo, "--checkpoint", str(model), "--json")
    assert json.loads(cap.stdout.splitlines()[0])["caption"]


@pytest.mark.slow
def test_evaluate_a_coco_split_file(tmp_path):
    """evaluate.py --split-file scores only the photos the file names (labelled by it); it is for COCO only."""
    paired = need_paired()
    common = ["scripts/evaluate.py", "--beam-size", "1", "--limit", "2", "--json"]
    out = tmp_path / "e.json"
    run(*common, "--dataset", "coco", "--images", str(paired / "images"), "--annotations",
        str(paired / "captions.json"), "--split-file", str(paired / "split_val.txt"), "--output", str(out))
    written = json.loads(out.read_text())
    val = (paired / "split_val.txt").read_text().split()
    ids = {str(int(n.removesuffix(".jpg").rsplit("_", 1)[1])) for n in val}
    assert written["split"] == "captions-split_val" and {c["image_id"] for c in written["captions"]} <= ids
    bad = run(*common, "--dataset", "flickr8k", "--data-root", str(need_flickr()), "--split-file",
              str(paired / "split_val.txt"), ok=False)
    assert bad.returncode == 2 and "--split-file is for --dataset coco" in bad.stderr


# ---------------------------------------------------------------- the encoder's top tuned on the mix

@pytest.mark.slow
def test_tiny_mixed_run_tunes_the_top_from_each_sets_activation_cache(tmp_path):
    """model.tune_stages on a mix: each set's activation caches (named after it, with mirror images) built
    by prepare and reused by training, both sets sampled by weight, validated per set; the top stages move,
    the lower ones do not; the run resumes, exports and captions; a foreign cache under a set's name is rebuilt."""
    from captioner.checkpoint import load_checkpoint
    from captioner.model.encoder import Encoder

    cache, out = tmp_path / "c", tmp_path / "run"
    sources = json.dumps([{**s, "weight": w} for s, w in zip(_mix_sources(), (1, 2))])
    common = ["--config", "configs/tiny.yaml", "--set", f"data.sources={sources}", f"data.cache_dir={cache}",
              "model.image_size=128", "model.grid_size=4", "model.tune_stages=1", "data.flip=true", "data.limit=4",
              "train.val_limit=2", "train.val_metric=CIDEr", "train.alpha_head=1.0", "train.alpha_cam=1.0"]
    prep = run("scripts/prepare.py", *common, "--no-progress")
    for name in ("flickr8k", "coco_paired"):
        assert f"{name} train: activations (4, " in prep.stdout and f"{name} val: activations (4, " in prep.stdout
        assert (cache / f"{name}-train4-efficientnet_lite0-128px-act{_split_block()}-flip.npy").is_file()
        assert not (cache / f"{name}-val4-efficientnet_lite0-128px-act{_split_block()}-flip.npy").exists()
    first = run("scripts/train.py", *common, f"train.out_dir={out}", "train.epochs=1", "--no-progress")
    assert "does not match" not in first.stdout + first.stderr  # the prepared caches were reused
    assert "8 images" in first.stdout and "3 batches/epoch" in first.stdout  # 4 + 2 x 4 coco photos, 4 a batch
    ref = Encoder("efficientnet_lite0", True, 4).state_dict()
    got = {k.removeprefix("encoder."): v for k, v in load_checkpoint(out / "last.safetensors").model_state.items()
           if k.startswith("encoder.")}
    changed = {k for k in ref if not torch.equal(ref[k], got[k])}
    assert "backbone._conv_head.weight" in changed
    assert not any(k.startswith(("backbone._conv_stem", "backbone._blocks.0.", "backbone._fc")) for k in changed)
    more = run("scripts/train.py", *common, f"train.out_dir={out}", "train.epochs=2", "--no-progress")
    assert "continuing a finished run: 1 epoch(s) done" in more.stdout and "does not match" not in more.stdout
    val = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "val"]
    assert [r["epoch"] for r in val] == [1, 2]
    for name in ("flickr8k", "coco_paired"):
        assert 0.0 <= val[-1][f"{name}/head_top1_agreement"] <= 1.0 and f"{name}/CIDEr" in val[-1]
    model = tmp_path / "model.safetensors"
    run("scripts/export.py", str(out / "best.safetensors"), str(model))
    photo = str(PAIRED / "images" / (PAIRED / "split_val.txt").read_text().split()[0])
    assert json.loads(run("scripts/caption.py", photo, "--checkpoint", str(model), "--json").stdout.splitlines()[0])[
        "caption"]
    stem = f"-train4-efficientnet_lite0-128px-act{_split_block()}"
    for suffix in (".json", ".npy", "-flip.npy", "-logits.npy"):  # flickr8k's photos under coco_paired's name
        (cache / f"coco_paired{stem}{suffix}").write_bytes((cache / f"flickr8k{stem}{suffix}").read_bytes())
    assert not list(cache.glob(f"coco_paired{stem}-*.json"))
    again = run("scripts/train.py", *common, f"train.out_dir={tmp_path / 'run2'}", "train.epochs=1", "--no-progress")
    # the name holds another folder's photos: coco_paired's own cache is written beside it, under the name + a hash of
    # its folders (cache_writer.cache_base), and flickr8k's photos are never read as coco_paired's
    own = [p for p in cache.glob(f"coco_paired{stem}-*.json") if not p.name.endswith(("-flip.json", "-logits.json"))]
    assert len(own) == 1  # built for this run (it did not exist before)
    key = json.loads(own[0].read_text())["key"]
    assert key["images"] != json.loads((cache / f"flickr8k{stem}.json").read_text())["key"]["images"]
    assert (cache / f"coco_paired{stem}.json").read_bytes() == (cache / f"flickr8k{stem}.json").read_bytes()


def _split_block() -> int:
    from captioner.model.encoder import Encoder

    return Encoder("efficientnet_lite0", False, 4).split_block
