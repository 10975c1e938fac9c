"""The caption as it is written: one frame per word (ui/animate.py), in the API and `captioner-caption --animate`."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import captioner
from captioner.cli.caption import main
from captioner.decoding.captions import Caption
from captioner.ui.animate import caption_animation, frame

CAT = captioner.DEFAULT_CHECKPOINT.parent / "examples" / "cat.jpg"


def hand_caption(words: list[str], g: int = 3) -> Caption:
    alphas = np.zeros((len(words), g, g), np.float32)
    for i in range(len(words)):
        alphas[i].flat[i % (g * g)] = 1.0  # each word looks at another cell
    return Caption(" ".join(words), words, alphas, -1.0)


@pytest.mark.parametrize("fmt", ["gif", "webp"])
def test_one_frame_per_word_and_the_attention_moves(fmt, tmp_path):
    cap = hand_caption(["a", "dog", "runs", "on", "grass"])
    photo = Image.new("RGB", (300, 200), (120, 120, 120))
    data = caption_animation(photo, cap, fmt=fmt)
    (tmp_path / f"a.{fmt}").write_bytes(data)
    anim = Image.open(tmp_path / f"a.{fmt}")
    assert anim.n_frames == len(cap.words)
    frames = []
    for k in range(anim.n_frames):
        anim.seek(k)
        frames.append(np.asarray(anim.convert("RGB"), dtype=np.int16))
    assert all(f.shape == frames[0].shape for f in frames)
    assert all(np.abs(a - b).sum() > 0 for a, b in zip(frames, frames[1:]))  # each word's frame differs


def test_tiny_and_empty_captions_still_animate():
    assert Image.open(__import__("io").BytesIO(caption_animation(Image.new("RGB", (1, 300)),
                                                                 hand_caption(["a", "cat"])))).n_frames == 2
    empty = Caption("", [], np.zeros((0, 3, 3), np.float32), -1.0)
    assert Image.open(__import__("io").BytesIO(caption_animation(Image.new("RGB", (40, 40)), empty))).n_frames == 1
    assert frame(Image.new("RGB", (6, 6)), hand_caption(["a"]), 0).width >= 100  # enlarged to be readable


def test_caption_animate_writes_one_animation_per_photo(tmp_path, capsys):
    folder = tmp_path / "photos"
    (folder / "sub").mkdir(parents=True)
    Image.open(CAT).convert("RGB").save(folder / "cat.png")
    Image.open(CAT).convert("RGB").resize((200, 150)).save(folder / "sub" / "small.jpg")
    out = tmp_path / "anim"
    assert main([str(folder), "--recursive", "--animate", str(out), "--beam-size", "1"]) == 0
    lines = dict(line.split("\t") for line in capsys.readouterr().out.strip().splitlines())
    for rel in ("cat.png", "sub/small.jpg"):
        anim = Image.open(out / (rel.rsplit(".", 1)[0] + "_caption.gif"))
        assert anim.n_frames == len(lines[str(folder / rel)].split())  # a frame per caption word
