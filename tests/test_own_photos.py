"""README "Train on your own photos", run as written: a folder of real photos with a captions.txt and no
split files -> prepare -> train (from the bundled model) -> export -> a model file the app's menu offers and
captioner.load captions with. Only the folder, the run folder, the cache and the epochs are changed."""
from __future__ import annotations

import csv
import importlib
import re
import shlex
import shutil
from pathlib import Path

import pytest

import captioner
from captioner.data.flickr8k import by_name_split, load_flickr8k, read_captions

ROOT = Path(__file__).resolve().parents[1]
FLICKR = ROOT.parent / "shared" / "data" / "flickr8k"


def readme_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Train on your own photos", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [shlex.split(line.split("  #")[0]) for line in block.splitlines() if line.strip()]


def test_split_by_name_without_split_files():
    names = [f"{i:03d}.jpg" for i in range(25)]
    parts = {s: by_name_split(names, s) for s in ("train", "val", "test")}
    assert sorted(sum(parts.values(), [])) == names  # every photo in exactly one split
    assert len(parts["val"]) == len(parts["test"]) == 2 and len(parts["train"]) == 21


@pytest.mark.slow
def test_readme_trains_a_model_on_your_own_photos(tmp_path, monkeypatch):
    if not (FLICKR / "captions.txt").is_file():
        pytest.skip(f"Flickr8k is not at {FLICKR} (../shared/data): no real photos to train on")
    own = tmp_path / "myphotos"
    (own / "Images").mkdir(parents=True)
    caps = read_captions(FLICKR)
    names = sorted(r.image_id for r in load_flickr8k(FLICKR, "val"))[:20]
    with open(own / "captions.txt", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["image", "caption"])
        for n in names:
            shutil.copy(FLICKR / "Images" / n, own / "Images" / n)
            w.writerows([n, c] for c in caps[n])
    runs = tmp_path / "runs"
    extra = [f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={runs}", "train.epochs=1"]
    monkeypatch.chdir(ROOT)
    commands = readme_commands()
    assert [c[0] for c in commands] == [".venv/bin/captioner-prepare", ".venv/bin/captioner-train",
                                        ".venv/bin/captioner-export", ".venv/bin/streamlit"]
    for cmd in commands[:3]:
        args = [a.replace("myphotos", str(own)).replace("runs/own_photos", str(runs)) for a in cmd[1:]]
        if "--set" in args:
            at = args.index("--set") + 2  # after the README's one KEY=VALUE
            args[at:at] = extra
        module = cmd[0].removeprefix(".venv/bin/captioner-").replace("-", "_")
        assert importlib.import_module(f"captioner.cli.{module}").main(args) == 0, cmd
    model_file = runs / "model.safetensors"
    assert model_file.is_file() and model_file.stat().st_size < 60 * 2**20  # fp16, the size the README says
    from captioner.ui.checkpoints import find_model_files

    found = find_model_files([runs])
    assert model_file in found.files  # the app's menu offers it (runs/ is searched by default)
    model = captioner.load(model_file)
    assert model.caption(own / "Images" / names[0]).words  # a caption, at the stored settings
