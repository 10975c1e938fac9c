"""Validation without Java: evaluation/ptb.py tokenises captions as pycocoevalcap's PTBTokenizer (Stanford's,
in Java) does, so BLEU, ROUGE-L and CIDEr computed on its tokens are the reported scores; training validates
with it and a machine without Java trains, picks its best epoch, and is told in one line what needs Java."""
from __future__ import annotations

import csv
import json
import random
import shutil
import subprocess
import sys

import pytest

from captioner.evaluation.metrics import score_captions
from captioner.evaluation.ptb import ptb_tokenize

from .conftest import ENV, ROOT, SHARED, need_flickr

JAVA = shutil.which("java") is not None
need_java = pytest.mark.skipif(not JAVA, reason="java is not installed: the Java PTB tokenizer cannot be compared")


@pytest.mark.parametrize("text, tokens", [
    ("A dog runs on the grass .", "a dog runs on the grass"),
    ("A man's hat, and the dogs' toys!", "a man 's hat and the dogs toys"),
    ("Two people on ATV 's outside .", "two people on atv 's outside"),
    ("We cannot see it; they don't care", "we can not see it they do n't care"),
    ('A black " ADHD " t-shirt ( almost fish eye )', "a black adhd t-shirt -lrb- almost fish eye -rrb-"),
    ("It reads 11:20 at 3.5 m, $1,000 ...", "it reads 11:20 at 3.5 m $ 1,000"),
    ("Mr. Potato on Sunset Blvd. in the U.S.A today", "mr. potato on sunset blvd. in the u.s.a today"),
    ("a slip 'n' slide at&t", "a slip 'n' slide at & t"),
])
def test_python_tokenizer_known_cases(text, tokens):
    """Cases whose Java output was read off pycocoevalcap's PTBTokenizer."""
    assert ptb_tokenize(text) == tokens


def _captions() -> list[str]:
    caps = []
    flickr = SHARED / "flickr8k" / "captions.txt"
    if flickr.is_file():
        with open(flickr, encoding="utf-8-sig", newline="") as f:
            rows = list(csv.reader(f))[1:]
        caps += [",".join(r[1:]) for r in rows]
    paired = SHARED / "coco-paired" / "captions.json"
    if paired.is_file():
        caps += [a["caption"] for a in json.loads(paired.read_text())["annotations"]]
    return caps


@need_java
def test_python_tokenizer_matches_the_java_one_on_every_reference():
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    caps = _captions()
    if not caps:
        pytest.skip(f"no captions under {SHARED} to compare on")
    java = PTBTokenizer().tokenize({i: [{"caption": c}] for i, c in enumerate(caps)})
    differ = [(c, java[i][0], ptb_tokenize(c)) for i, c in enumerate(caps) if ptb_tokenize(c) != java[i][0]]
    # measured: 5 of 47,000 Flickr8k + coco-paired captions differ ("22 3/4", "in KY.", "I. A")
    assert len(differ) <= len(caps) // 2000, differ[:10]


@need_java
def test_scores_on_python_tokens_equal_the_java_ones():
    """BLEU, ROUGE-L and CIDEr of 300 Flickr8k photos, one reference as the prediction, the others as references
    (a perturbed caption for some): the same to 1e-4 with either tokenizer."""
    flickr = need_flickr()
    with open(flickr / "captions.txt", encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f))[1:]
    refs: dict[str, list[str]] = {}
    for r in rows:
        refs.setdefault(r[0], []).append(",".join(r[1:]))
    rng = random.Random(0)
    ids = sorted(refs)[:300]
    preds = {i: refs[i][0] if rng.random() < .5 else " ".join(reversed(refs[i][0].split())) for i in ids}
    others = {i: refs[i][1:] for i in ids}
    metrics = ["Bleu_1", "Bleu_4", "ROUGE_L", "CIDEr"]
    java = score_captions(preds, others, metrics, tokenizer="java")
    python = score_captions(preds, others, metrics, tokenizer="python")
    assert java.keys() == python.keys()
    for k in metrics:
        assert abs(java[k] - python[k]) < 1e-4, (k, java[k], python[k])


def _no_java_env(tmp_path) -> dict[str, str]:
    empty = tmp_path / "bin"
    empty.mkdir(exist_ok=True)
    return {**ENV, "PATH": str(empty)}  # the scripts run with sys.executable: nothing else is needed on PATH


def _run(args, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_training_without_java_validates_and_keeps_its_best(tmp_path):
    flickr = need_flickr()
    env = _no_java_env(tmp_path)
    common = ["scripts/train.py", "--config", "configs/tiny.yaml", "--no-progress", "--set", f"data.root={flickr}",
              f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={tmp_path / 'run'}"]
    out = _run(common, env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "epoch 1:" in out.stdout and " CIDEr " in out.stdout and "kept the last epoch" in out.stdout, out.stdout  # 4 val photos
    assert (tmp_path / "run" / "best.safetensors").is_file()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows if r["kind"] == "val" and "CIDEr" in r] == [1, 2]
    # METEOR is Java: asked for as the val metric, the run is refused in one line before any work
    meteor = _run([*common[:-2], f"data.cache_dir={tmp_path / 'cache2'}", f"train.out_dir={tmp_path / 'run2'}",
                   "train.val_metric=METEOR"], env)
    assert meteor.returncode == 2 and "Java" in meteor.stderr and len(meteor.stderr.strip().splitlines()) == 1, meteor
    assert not (tmp_path / "cache2").exists() and not (tmp_path / "run2").exists()  # nothing was read or written

    ev = _run(["scripts/evaluate.py", "--checkpoint", str(tmp_path / "run" / "best.safetensors"), "--dataset",
               "flickr8k", "--data-root", str(flickr), "--split", "val", "--limit", "2",
               "--output", str(tmp_path / "eval.json")], env)
    assert ev.returncode == 2 and "Java" in ev.stderr and len(ev.stderr.strip().splitlines()) == 1, ev
    assert not (tmp_path / "eval.json").exists()
