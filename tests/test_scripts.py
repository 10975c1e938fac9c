"""Each script runs end to end on a few real Flickr8k photos, as a user would run it."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import captioner
from captioner.config import DecodeConfig

from .conftest import ENV, ROOT, need_bundled, need_coco, need_flickr, run


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """prepare + train with the tiny recipe on 8 real images; returns the run folder."""
    flickr = need_flickr()
    tmp = tmp_path_factory.mktemp("run")
    common = ["--config", "configs/tiny.yaml", "--set", f"data.root={flickr}", f"data.cache_dir={tmp / 'cache'}",
              f"train.out_dir={tmp / 'run'}"]
    prep = run("scripts/prepare.py", *common, "--no-progress")
    assert "vocabulary:" in prep.stdout and "UNK rate" in prep.stdout and "features (8, 49, 1280)" in prep.stdout
    out = run("scripts/train.py", *common, "--no-progress")
    assert "epoch 2:" in out.stdout and "Bleu_4" in out.stdout
    assert "does not match" not in out.stdout + out.stderr  # the prepared cache was reused, not rebuilt
    return tmp / "run"


@pytest.mark.slow
def test_train_writes_checkpoints_logs_and_plot(trained):
    for name in ("best.safetensors", "last.safetensors", "metrics.jsonl", "training.png"):
        assert (trained / name).is_file(), name
    rows = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if r["kind"] == "val"]
    assert [r["epoch"] for r in val] == [1, 2] and all("Bleu_4" in r and "CIDEr" in r for r in val)
    train = [r for r in rows if r["kind"] == "train"]
    assert train and all(r["xent"] > 0 and r["penalty"] >= 0 for r in train)
    # rerunning a finished run does nothing and says so
    again = run("scripts/train.py", "--config", "configs/tiny.yaml", "--set", f"train.out_dir={trained}",
                f"data.root={need_flickr()}", "--no-progress")
    assert "already finished" in again.stdout


@pytest.mark.slow
def test_evaluate_json(trained, tmp_path):
    out = run("scripts/evaluate.py", "--checkpoint", str(trained / "best.safetensors"), "--dataset", "flickr8k",
              "--data-root", str(need_flickr()), "--split", "test", "--limit", "4", "--beam-size", "2", "--json",
              "--output", str(tmp_path / "caps.json"))
    scores = json.loads(out.stdout)
    assert set(scores) == {"Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "n_images"}
    assert scores["n_images"] == 4 and all(0 <= scores[k] <= 10 for k in scores)
    written = json.loads((tmp_path / "caps.json").read_text())
    assert len(written["captions"]) == 4


@pytest.mark.slow
def test_evaluate_writes_one_result_per_model_and_data_and_says_when_it_replaces_one(tmp_path):
    """No --output: evaluations/<model>_<dataset>_<split>[_<setting><value>].json under the working folder (beam 1
    is not the file's own setting, so it is named); a COCO result never
    lands on the Flickr8k one, and replacing an earlier result is said."""
    need_bundled()
    coco = need_coco()

    def evaluate(*args):
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "evaluate.py"), *args, "--limit", "2",
                               "--beam-size", "1", "--json"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                              timeout=600, check=True)

    flickr_args = ("--dataset", "flickr8k", "--data-root", str(need_flickr()), "--split", "val")
    first = evaluate(*flickr_args)
    evaluate("--dataset", "coco", "--images", str(coco / "train2017"), "--annotations",
             str(coco / "annotations" / "captions_train2017.json"))
    written = sorted(p.name for p in (tmp_path / "evaluations").iterdir())
    assert written == ["bundled_coco_train2017-first2_beam_size1.json", "bundled_flickr8k_val-first2_beam_size1.json"]
    assert "replacing" not in first.stderr
    again = evaluate(*flickr_args)
    assert "note: replacing the earlier result at evaluations/bundled_flickr8k_val-first2_beam_size1.json" in again.stderr


@pytest.mark.parametrize("limit", ["0", "-3"])
def test_evaluate_limit_must_be_positive(limit):
    """--limit 0 evaluated all 1,000 test images although the help says "first N images only"."""
    out = run("scripts/evaluate.py", "--limit", limit, "--json", ok=False)
    assert out.returncode == 2 and f"--limit must be at least 1, got {limit}" in out.stderr and not out.stdout


@pytest.mark.slow
def test_evaluate_coco_annotations(trained, tmp_path):
    coco = need_coco()
    out = run("scripts/evaluate.py", "--checkpoint", str(trained / "best.safetensors"), "--dataset", "coco",
              "--images", str(coco / "train2017"), "--annotations", str(coco / "annotations" / "captions_train2017.json"),
              "--limit", "3", "--beam-size", "1", "--json", "--output", str(tmp_path / "c.json"))
    assert json.loads(out.stdout)["n_images"] == 3


@pytest.mark.slow
def test_caption_cli(trained, tmp_path):
    flickr = need_flickr()
    photos = sorted((flickr / "Images").glob("*.jpg"))[:2]
    bad = tmp_path / "notes.jpg"
    bad.write_text("not a photo")
    out = run("scripts/caption.py", str(photos[0]), str(bad), str(photos[1]), "--checkpoint",
              str(trained / "best.safetensors"), "--json", "--beam-size", "3", "--attention-dir", str(tmp_path / "att"),
              "--verbose", ok=False)
    assert out.returncode != 0  # one image failed ...
    assert "notes.jpg" in out.stderr and "not an image" in out.stderr  # ... with a clear message ...
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["image"] for r in lines] == [str(photos[0]), str(photos[1])]  # ... and the others are captioned
    settings = {f.name for f in dataclasses.fields(DecodeConfig)} | {"precision"}  # every setting in use is recorded
    fields = {"image", "caption", "words", "word_log_probs", "word_probs", "betas", "log_prob", "alternatives",
              "concepts", "detections", "contradicted_words", "unknown_words", "notes", "settings", "grid", "score",
              "choice", "signals", "comparable", "model", "confidence", "sure", "level", "doubt",
              "different_alternatives", "unsupported_words"}
    assert all(set(r) == fields and set(r["settings"]) == settings and r["log_prob"] <= 0
               and r["settings"]["beam_size"] == 3 for r in lines)
    assert "decoding with beam_size 3" in out.stderr and "block_trigrams" in out.stderr
    assert sorted(p.name for p in (tmp_path / "att").glob("*.png")) == sorted(p.stem + "_attention.png" for p in photos)
    assert (tmp_path / "att" / ".captioner-figures").is_file()  # marked: a folder search never reads it as photos


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "auto"])
def test_caption_cli_in_other_precisions(trained, dtype):
    photo = sorted((need_flickr() / "Images").glob("*.jpg"))[0]
    out = run("scripts/caption.py", str(photo), "--checkpoint", str(trained / "best.safetensors"), "--json",
              "--dtype", dtype)
    (line,) = [json.loads(x) for x in out.stdout.splitlines()]
    assert line["image"] == str(photo) and line["log_prob"] <= 0
    assert line["settings"]["precision"] == (captioner.preferred_dtype() if dtype == "auto" else dtype)


@pytest.mark.slow
def test_config_errors_are_clear():
    out = run("scripts/train.py", "--config", "configs/tiny.yaml", "--set", "train.bogus=1", ok=False)
    assert out.returncode == 2 and "unknown setting 'train.bogus'" in out.stderr


@pytest.mark.slow
def test_export_compact_model(trained, tmp_path):
    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps({"dataset": "flickr8k", "split": "test", "beam_size": 3, "length_penalty": 0.0,
                                  "scores": {"Bleu_4": 0.25}}))
    out = tmp_path / "model.safetensors"
    run("scripts/export.py", str(trained / "best.safetensors"), str(out), "--half", "--metrics", str(scores),
        "--set", "decode.length_penalty=0.5")
    import captioner
    import torch

    full, small = captioner.load(trained / "best.safetensors"), captioner.load(out)
    assert out.stat().st_size < (trained / "best.safetensors").stat().st_size
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:  # fp16 decoder; the frozen encoder keeps its exact fp32 weights
        kinds = {(k.split(".")[0], f.get_tensor(k).dtype) for k in f.keys() if f.get_tensor(k).is_floating_point()}
    assert kinds == {("decoder", torch.float16), ("encoder", torch.float32)}
    assert small.config.decode.length_penalty == 0.5
    assert small.metrics["flickr8k_test_beam3"]["scores"]["Bleu_4"] == 0.25
    photo = sorted((need_flickr() / "Images").glob("*.jpg"))[0]
    assert small.caption(photo, length_penalty=0.0).words == full.caption(photo, length_penalty=0.0).words
    bad = run("scripts/export.py", str(trained / "best.safetensors"), str(out), "--set", "train.lr=1", ok=False)
    assert bad.returncode == 2 and "only decode" in bad.stderr


@pytest.mark.slow
def test_export_reports_the_dtypes_the_file_holds_and_names_bad_metrics_files(tmp_path):
    """Re-exporting the bundled (fp16-decoder) model without --half printed "fp32" for a file keeping fp16
    tensors; --metrics x.npy failed with "'utf-8' codec can't decode" and no file name."""
    from collections import Counter

    import numpy as np
    from safetensors import safe_open

    import captioner

    need_bundled()
    out = tmp_path / "again.safetensors"
    printed = run("scripts/export.py", str(captioner.DEFAULT_CHECKPOINT), str(out)).stdout
    with safe_open(str(out), "pt") as f:
        held = Counter((k.split(".")[0], str(f.get_slice(k).get_dtype())) for k in f.keys())
    assert held[("decoder", "F16")] > 0  # the bundled decoder's fp16 tensors are kept as they are ...
    assert f"decoder {held[('decoder', 'F16')]} fp16" in printed and "fp16" in printed  # ... and reported
    assert f"encoder {held[('encoder', 'F32')]} fp32" in printed
    npy = tmp_path / "x.npy"
    np.save(npy, np.arange(40.0))
    bad = run("scripts/export.py", str(captioner.DEFAULT_CHECKPOINT), str(tmp_path / "o.safetensors"),
              "--metrics", str(npy), ok=False)
    assert bad.returncode == 2 and f"--metrics {npy}: not a JSON file" in bad.stderr and "Traceback" not in bad.stderr
    (tmp_path / "list.json").write_text("[1, 2]")
    no_scores = run("scripts/export.py", str(captioner.DEFAULT_CHECKPOINT), str(tmp_path / "o.safetensors"),
                    "--metrics", str(tmp_path / "list.json"), ok=False)
    assert no_scores.returncode == 2 and 'list.json: no "scores" object' in no_scores.stderr
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.slow
def test_export_weight_averaging(trained, tmp_path):
    import captioner
    import torch

    out = tmp_path / "avg.safetensors"
    run("scripts/export.py", str(trained / "best.safetensors"), str(out), "--average",
        str(trained / "last.safetensors"))
    a, b, avg = (captioner.load(p) for p in (trained / "best.safetensors", trained / "last.safetensors", out))
    sa, sb, s = a.model.state_dict(), b.model.state_dict(), avg.model.state_dict()
    for k in ("decoder.out_vocab.weight", "decoder.attention.feat_proj.weight"):
        assert torch.allclose(s[k], (sa[k] + sb[k]) / 2, atol=1e-6)


@pytest.fixture(scope="module")
def beam5_model(tmp_path_factory) -> Path:
    """A tiny untrained model whose file stores decode.beam_size=5, max_len=6 (no training needed)."""
    from .conftest import tiny_captioner

    model = tiny_captioner()
    model.config.decode.beam_size, model.config.decode.max_len = 5, 6
    path = tmp_path_factory.mktemp("beam5") / "beam5.safetensors"
    model.save(path)
    return path


@pytest.mark.slow
def test_caption_cli_uses_the_model_files_decode_settings(beam5_model):
    photo = sorted((need_flickr() / "Images").glob("*.jpg"))[0]
    stored = run("scripts/caption.py", str(photo), "--checkpoint", str(beam5_model), "--json", "--device", "cpu")
    (line,) = [json.loads(x) for x in stored.stdout.splitlines()]
    assert (line["settings"]["beam_size"], line["settings"]["max_len"], line["settings"]["length_penalty"]) == (5, 6, 0.0)
    assert "decoding with beam_size 5, max_len 6" in stored.stderr
    same = run("scripts/caption.py", str(photo), "--checkpoint", str(beam5_model), "--json", "--beam-size", "5")
    assert json.loads(same.stdout) == line  # the stored setting is exactly the explicit one
    greedy = run("scripts/caption.py", str(photo), "--checkpoint", str(beam5_model), "--json", "--beam-size", "1")
    assert json.loads(greedy.stdout)["settings"]["beam_size"] == 1 and json.loads(greedy.stdout)["settings"]["max_len"] == 6


@pytest.mark.slow
def test_evaluate_coco_val_is_recorded_as_val(beam5_model, tmp_path):
    """A COCO caption file is labelled by its own split (captions_val2017 -> val2017), in the output
    JSON and the feature cache name, and the model file's decode settings are recorded."""
    coco = need_coco()
    ann = tmp_path / "captions_val2017.json"
    ann.write_bytes((coco / "annotations" / "captions_train2017.json").read_bytes())
    out = tmp_path / "c.json"
    run("scripts/evaluate.py", "--checkpoint", str(beam5_model), "--dataset", "coco", "--images",
        str(coco / "train2017"), "--annotations", str(ann), "--limit", "2", "--json", "--output", str(out),
        "--cache-dir", str(tmp_path / "cache"), "--device", "cpu")
    written = json.loads(out.read_text())
    assert written["split"] == "val2017" and len(written["captions"]) == 2
    assert (written["beam_size"], written["max_len"], written["length_penalty"]) == (5, 6, 0.0)
    assert [p.name for p in (tmp_path / "cache").glob("*.npy")] == ["coco-val2017-first2-efficientnet_lite0-224px-g7.npy"]


@pytest.mark.slow
def test_evaluate_coco_grounding(tmp_path):
    """--grounding with the bundled model: the instance file beside the captions file, or --instances."""
    need_bundled()
    coco = need_coco()
    ann = coco / "annotations" / "captions_train2017.json"
    common = ["scripts/evaluate.py", "--dataset", "coco", "--images", str(coco / "train2017"), "--limit", "4",
              "--beam-size", "2", "--grounding"]
    out = run(*common, "--annotations", str(ann), "--json", "--output", str(tmp_path / "c.json"))
    scores = json.loads(out.stdout)
    assert scores["n_images"] == 4
    for key in ("grounding_generated", "grounding_teacher_forced"):
        g = scores[key]
        assert {"mass", "baseline", "lift", "n_words", "n_images", "per_category"} <= set(g)
        assert g["n_images"] == 4 and g["n_words"] == sum(c["n_words"] for c in g["per_category"].values())
    tf = scores["grounding_teacher_forced"]
    assert tf["n_words"] > 4 and 0 <= tf["mass"] <= 1 and 0 < tf["baseline"] <= 1 and tf["lift"] > 0
    written = json.loads((tmp_path / "c.json").read_text())
    assert written["grounding_teacher_forced"] == tf
    # a captions file with no instances file beside it: a clear error; --instances fixes it
    lone = tmp_path / "captions_mini.json"
    lone.write_bytes(ann.read_bytes())
    bad = run(*common, "--annotations", str(lone), ok=False)
    assert bad.returncode == 2 and "instances_mini.json" in bad.stderr and "--instances" in bad.stderr
    text = run(*common, "--annotations", str(lone), "--instances", str(ann.with_name("instances_train2017.json")),
               "--output", str(tmp_path / "d.json")).stdout
    assert "grounding (generated)" in text and "grounding (teacher_forced)" in text and "lift" in text


def photo_folder(tmp_path: Path) -> Path:
    """photos/: two real photos (one as PNG), a text file named .jpg, a non-image extension, and
    sub/ with a third photo."""
    from PIL import Image

    photos = sorted((need_flickr() / "Images").glob("*.jpg"))[:3]
    root = tmp_path / "photos"
    (root / "sub").mkdir(parents=True)
    (root / "a.jpg").write_bytes(photos[0].read_bytes())
    Image.open(photos[1]).save(root / "b.png")
    (root / "sub" / "c.jpeg").write_bytes(photos[2].read_bytes())
    (root / "bad.jpg").write_text("not a photo")
    (root / "readme.txt").write_text("ignored: not an image extension")
    return root


@pytest.mark.slow
def test_caption_cli_folder(tmp_path):
    """A folder: its images in sorted order, the bad one reported (exit 1), subfolders only with
    --recursive; the same captions whatever the batch size."""
    need_bundled()
    root = photo_folder(tmp_path)
    flat = run("scripts/caption.py", str(root), "--beam-size", "1", "--batch-size", "16", ok=False)
    assert flat.returncode == 1 and "bad.jpg" in flat.stderr and "readme" not in flat.stderr
    rows = [line.split("\t") for line in flat.stdout.splitlines()]
    assert [r[0] for r in rows] == [str(root / "a.jpg"), str(root / "b.png")]
    assert "has 1 subfolder(s) that were not searched (sub): add --recursive" in flat.stderr  # said, not silent
    deep = run("scripts/caption.py", str(root), "--recursive", "--beam-size", "1", "--batch-size", "2", ok=False)
    rows_deep = [line.split("\t") for line in deep.stdout.splitlines()]
    assert [r[0] for r in rows_deep] == [str(root / "a.jpg"), str(root / "b.png"), str(root / "sub" / "c.jpeg")]
    assert rows_deep[:2] == rows  # batches of 2 (bad file inside one) give the same captions as one batch
    assert deep.stderr.count("error:") == 1 and "not searched" not in deep.stderr


@pytest.mark.slow
def test_caption_cli_folder_json_and_maps(bundled, tmp_path):
    import math

    import captioner

    root = photo_folder(tmp_path)
    (root / "bad.jpg").unlink()
    out = run("scripts/caption.py", str(root), "--recursive", "--json", "--maps", "--batch-size", "2")
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert len(lines) == 3
    model = bundled
    g = model.grid_size
    for r in lines:
        n = len(r["words"])
        assert r["caption"] == " ".join(r["words"]) and len(r["word_log_probs"]) == len(r["betas"]) == n
        assert all(math.isclose(p, math.exp(lp), rel_tol=1e-3, abs_tol=1e-5)
                   for p, lp in zip(r["word_probs"], r["word_log_probs"]))
        assert sum(r["word_log_probs"]) >= r["log_prob"] - 1e-3  # + log p(<end>) <= 0
        assert len(r["alphas"]) == n and all(len(a) == g and len(a[0]) == g for a in r["alphas"])
        assert all(abs(sum(map(sum, a)) - 1) < 1e-3 for a in r["alphas"])
    expect = model.caption(root / "a.jpg", **{k: lines[0]["settings"][k] for k in ("beam_size", "max_len", "block_trigrams")})
    assert lines[0]["caption"] == expect.text
    # one shape for one Caption: the app's download has exactly these keys (one function makes both)
    from captioner.ui.visualize import caption_json_bytes

    assert set(json.loads(caption_json_bytes(expect, "a.jpg"))) == set(lines[0])
    assert {"concepts", "contradicted_words", "word_log_probs", "betas"} <= set(lines[0])
    plain = run("scripts/caption.py", str(root / "a.jpg"), "--json")
    assert "alphas" not in json.loads(plain.stdout)


@pytest.mark.slow
def test_caption_cli_attention_dir_one_figure_per_photo_and_never_read_back(tmp_path):
    """photos/a/x.jpg, a/x.png and b/x.jpg used to write one x_attention.png (the last photo), and a
    figure folder inside the input folder was read as photos by the next --recursive run."""
    from PIL import Image

    need_bundled()
    src = sorted((need_flickr() / "Images").glob("*.jpg"))[:3]
    root = tmp_path / "photos"
    for rel, photo in (("a/x.jpg", src[0]), ("a/x.png", src[1]), ("b/x.jpg", src[2])):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.open(photo).save(root / rel)
    out_dir = root / "out"
    cmd = ["scripts/caption.py", str(root), "--recursive", "--beam-size", "1", "--attention-dir", str(out_dir)]
    first = run(*cmd)
    captioned = [line.split("\t")[0] for line in first.stdout.splitlines()]
    assert captioned == [str(root / r) for r in ("a/x.jpg", "a/x.png", "b/x.jpg")]
    figures = sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*.png"))
    assert figures == ["a/x.jpg_attention.png", "a/x.png_attention.png", "b/x_attention.png"]
    sizes = {Image.open(out_dir / f).size for f in figures}
    assert len({(out_dir / f).read_bytes() for f in figures}) == 3 and all(w * h > 0 for w, h in sizes)
    again = run(*cmd)  # the figure folder inside the input folder is output, never input
    assert again.stdout == first.stdout and "skipping" in again.stderr and str(out_dir) in again.stderr
    plain = run("scripts/caption.py", str(root), "--recursive", "--beam-size", "1")  # marked: skipped without the flag too
    assert [line.split("\t")[0] for line in plain.stdout.splitlines()] == captioned
    same = run("scripts/caption.py", str(root / "a"), "--attention-dir", str(root / "a"), ok=False)
    assert same.returncode == 2 and "is the input folder" in same.stderr and not same.stdout
    twins = run("scripts/caption.py", str(root / "a" / "x.jpg"), str(root / "b" / "x.jpg"), "--attention-dir",
                str(tmp_path / "flat"), ok=False)
    assert twins.returncode == 2 and "would both write" in twins.stderr and not (tmp_path / "flat").exists()


@pytest.mark.slow
def test_caption_cli_explain_matches_the_api_and_refuses_a_sentence_without_words(bundled):
    """--explain is Captioner.explain on the command line: the same words (kept as typed), scores and
    unknown words; a sentence with no words is the same error as in the API (the app shows it as a note)."""
    from captioner.images import load_image

    photo = sorted((need_flickr() / "Images").glob("*.jpg"))[0]
    out = run("scripts/caption.py", str(photo), "--explain", "A dog in a café!", "--json")
    rec = json.loads(out.stdout)
    expect = bundled.explain(load_image(photo), "A dog in a café!")
    assert rec["words"] == expect.words == ["a", "dog", "in", "a", "café"] and rec["unknown_words"] == ["café"]
    assert rec["log_prob"] == pytest.approx(expect.log_prob, abs=1e-3)
    assert "‘café’ is not in the model's vocabulary (fed as <unk>)" in rec["notes"]  # the JSON carries its notes
    assert "café" not in out.stderr  # ... once: not on stderr too (a text line's notes go there: test_new_user)
    assert "decoding with" not in out.stderr and "nothing is decoded" in out.stderr  # it decodes nothing
    bad = run("scripts/caption.py", str(photo), "--explain", "!!! ...", ok=False)
    assert bad.returncode == 2 and "has no words to explain" in bad.stderr and not bad.stdout


@pytest.mark.slow
def test_evaluate_hallucination_coco_and_flickr(tmp_path):
    """--hallucination prints CHAIR-s, CHAIR-i and recall (COCO: boxes + references as truth; Flickr8k:
    the references), with the references' own CHAIR as a human baseline; --decode evidence=true is
    recorded with the settings."""
    need_bundled()
    coco = need_coco()
    out = run("scripts/evaluate.py", "--dataset", "coco", "--images", str(coco / "train2017"), "--annotations",
              str(coco / "annotations" / "captions_train2017.json"), "--limit", "6", "--beam-size", "2",
              "--hallucination", "--decode", "evidence=true", "--json", "--output", str(tmp_path / "c.json"))
    h = json.loads(out.stdout)["hallucination"]
    assert {"chair_s", "chair_i", "recall", "n_captions", "per_category"} <= set(h) and h["n_captions"] == 6
    assert 0 <= h["chair_s"] <= 1 and not h["references_only"]
    written = json.loads((tmp_path / "c.json").read_text())
    assert written["evidence"] is True and written["hallucination"] == h
    assert written["hallucination_references"]["n_captions"] == 30  # every reference against the others
    flickr = need_flickr()
    out = run("scripts/evaluate.py", "--dataset", "flickr8k", "--data-root", str(flickr), "--split", "test",
              "--limit", "4", "--beam-size", "2", "--hallucination", "--output", str(tmp_path / "f.json"))
    assert "hallucination " in out.stdout and "CHAIR" in out.stdout.upper()
    assert json.loads((tmp_path / "f.json").read_text())["hallucination"]["references_only"] is True
