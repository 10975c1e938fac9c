"""README "Train on your own photos", run as written: a folder of real photos with a captions.txt and no
split files -> prepare -> train (from the bundled model) -> export -> a model file the app's menu offers and
captioner.load captions with. Only the folder, the run folder, the cache and the epochs are changed.

The folder (scripts/make_new_word_folder.py): Flickr8k photos of horses whose captions say "stallion", a word
the bundled model lacks, and as many photos without one. The exported model must say the new word on most
held-out photos of horses and on (almost) none of the others, and the log must say how often it did on val."""
from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

import captioner
from captioner.data.flickr8k import by_name_split
from captioner.training.new_words import new_word_scores
from scripts.make_new_word_folder import build, new_word_use

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


def test_new_word_scores_count_uses_where_the_references_use_it():
    from captioner.data import ImageRecord

    recs = [ImageRecord("a", "a.jpg", ["a stallion runs"]), ImageRecord("b", "b.jpg", ["a stallion jumps"]),
            ImageRecord("c", "c.jpg", ["a dog runs"])]
    scores, line = new_word_scores(["stallion", "foal"], {"a": "a stallion", "b": "a horse", "c": "a stallion"}, recs)
    assert line.startswith("new words on val: stallion used in 1 of 2 captions whose references use it, and in 1 "
                           "of the 1 others") and "1 other new word(s)" in line  # foal: no val photo tells
    assert scores == {"new_words_recall": 0.5, "new_words_precision": 0.5, "new_words_F1": 0.5}


@pytest.mark.slow
def test_readme_teaches_the_bundled_model_a_new_word(tmp_path, monkeypatch, capsys):
    if not (FLICKR / "captions.txt").is_file():
        pytest.skip(f"Flickr8k is not at {FLICKR} (../shared/data): no real photos to train on")
    own, held_out = tmp_path / "myphotos", tmp_path / "heldout"
    build(own, photos=25, held_out=held_out, held_out_photos=10, flickr=FLICKR)  # 50 photos: 40 train, 5 val (4 horses)
    runs = tmp_path / "runs"
    extra = [f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={runs}", "train.epochs=2"]
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
    log = capsys.readouterr().out
    assert "new: stallion" in log and "stallion <- horse" in log  # named, and started as the word said in its place
    val_lines = re.findall(r"new words on val: stallion used in (\d+) of (\d+) .*?and in (\d+) of", log)
    print("\n".join(line for line in log.splitlines() if "new words on val" in line))
    assert len(val_lines) == 3  # epoch 0 (the warm start), 1 and 2
    model_file = runs / "model.safetensors"
    assert model_file.is_file() and model_file.stat().st_size < 60 * 2**20  # fp16, the size the README says
    from captioner.ui.checkpoints import find_model_files

    found = find_model_files([runs])
    assert model_file in found.files  # the app's menu offers it (runs/ is searched by default)
    use = new_word_use(model_file, held_out)  # photos it never saw
    assert use["thing"][1] == use["other"][1] == 10
    print("held-out photos saying the new word:", use)
    assert use["thing"][0] >= 6 and use["other"][0] <= 1, use  # most horses, (almost) nothing else


def test_a_small_set_is_passed_over_until_an_epoch_has_min_batches():
    from captioner.data.dataset import BucketBatchSampler

    plain = BucketBatchSampler([5.0] * 40, 16, seed=3)
    small = BucketBatchSampler([5.0] * 40, 16, seed=3, min_batches=20)
    assert len(plain) == len(plain.batches()) == 3
    batches = small.batches()
    assert len(small) == len(batches) == 21  # 7 passes of 3 batches
    assert all(len(set(b)) == len(b) for b in batches)  # no batch holds a photo twice
    assert sorted(i for b in batches for i in b) == sorted(list(range(40)) * 7)
    assert BucketBatchSampler([5.0] * 40, 16, seed=3, min_batches=20).batches() == batches  # (seed, epoch) decide


def test_validation_decodes_as_the_exported_file_will():
    """The own-photos recipe's validation lends the model the starting file's detectors and person floor (what
    captioner-export --detectors-from carries), at the stored beam, and takes them off again afterwards."""
    from torch import nn

    from captioner.checkpoint import load_checkpoint
    from captioner.concepts.detectors import detectors_of
    from captioner.config import load_config
    from captioner.training.as_exported import decoding_as_exported

    cfg = load_config(ROOT / "configs" / "own_photos.yaml")
    cfg.train.init_from = str(captioner.DEFAULT_CHECKPOINT)
    bundled = load_checkpoint(cfg.train.init_from)
    model = nn.Linear(2, 2)
    with decoding_as_exported(model, cfg) as settings:
        det = detectors_of(model)
        assert det is not None and det.groups == bundled.detector_info["groups"]
        assert settings.person_floor == bundled.config.decode.person_floor > 0
        assert settings.beam_size == cfg.decode.beam_size == cfg.train.val_beam_size  # the exported file's beam
    assert detectors_of(model) is None and "detectors." not in str(model.state_dict().keys())  # lent, not kept
    cfg.train.init_encoder = False  # another encoder: the detectors would read other vectors
    with decoding_as_exported(model, cfg) as settings:
        assert detectors_of(model) is None and settings.person_floor == cfg.decode.person_floor
