"""What a new user hits first: every --set counts in every command (a second one used to replace the first), a
captions.txt saved by a spreadsheet (UTF-8 BOM) is read, captioner-prepare reports the vocabulary that
captioner-train will use, and captioner-caption's plain output carries a photo's notes."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from PIL import Image

import captioner
from captioner.checkpoint import load_checkpoint
from captioner.data.flickr8k import load_flickr8k, read_captions

from .conftest import ROOT

CAT = captioner.DEFAULT_CHECKPOINT.parent / "examples" / "cat.jpg"


def test_every_list_option_of_every_command_extends():
    """An option that takes several values (--set, --splits, --metrics ...) must add up when given twice:
    argparse's default action keeps only the last. Checked on every command's source."""
    checked = 0
    for path in sorted((ROOT / "captioner" / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
                continue
            flag = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else ""
            kw = {k.arg: k.value for k in node.keywords}
            if flag.startswith("--") and "nargs" in kw and getattr(kw["nargs"], "value", None) in ("*", "+"):
                checked += 1
                assert getattr(kw.get("action"), "value", None) in ("extend", "append"), f"{path.name} {flag}"
    assert checked >= 5  # --set (prepare, train, export), --splits, --metrics, --average, --only


@pytest.mark.parametrize("command", ["train", "prepare"])
def test_two_set_flags_both_apply(command, tmp_path, monkeypatch, capsys):
    """Both --set flags reach the config: data.root of the first and train.out_dir of the second."""
    import importlib

    import captioner.config as config

    seen = []

    def load_config(path, overrides=()):
        seen.append(list(overrides))
        raise ValueError("stop here")

    monkeypatch.setattr(config, "load_config", load_config)
    main = importlib.import_module(f"captioner.cli.{command}").main
    assert main(["--config", "configs/own_photos.yaml", "--set", "data.root=X", "--set", "train.out_dir=Y",
                 "--device", "cpu"]) == 2
    assert seen == [["data.root=X", "train.out_dir=Y"]]


def test_two_set_flags_both_apply_at_export(tmp_path):
    from captioner.cli.export import main

    out = tmp_path / "m.safetensors"
    assert main([str(captioner.DEFAULT_CHECKPOINT), str(out), "--half", "--set", "decode.beam_size=2",
                 "--set", "decode.max_len=9"]) == 0
    decode = load_checkpoint(out).config.decode
    assert (decode.beam_size, decode.max_len) == (2, 9)


def _own_folder(root: Path, bom: bool) -> Path:
    """10 photos (copies of the example cat), two captions each, one using a new word; no split files."""
    (root / "Images").mkdir(parents=True)
    cat = Image.open(CAT).convert("RGB").resize((64, 64))
    lines = ["image,caption"]
    for i in range(10):
        cat.save(root / "Images" / f"p{i:02d}.jpg")
        lines += [f"p{i:02d}.jpg,a cat sitting on a zorblax", f"p{i:02d}.jpg,a small cat on a wall"]
    (root / "captions.txt").write_text(("\ufeff" if bom else "") + "\n".join(lines) + "\n", encoding="utf-8")
    return root


def test_a_captions_file_with_a_bom_is_read(tmp_path):
    plain = read_captions(_own_folder(tmp_path / "plain", bom=False))
    bom = read_captions(_own_folder(tmp_path / "bom", bom=True))
    assert bom == plain and len(bom) == 10 and "p00.jpg" in bom
    assert len(load_flickr8k(tmp_path / "bom", "train")) == 8


def test_prepare_reports_the_vocabulary_training_uses(bundled, tmp_path, capsys):
    """own_photos.yaml warm-starts from the bundled model: prepare reported the captions' own 10-word vocabulary
    (a third of the words <unk>), train the bundled one extended; now both say the extended one."""
    from captioner.cli.prepare import main

    root = _own_folder(tmp_path / "mine", bom=True)
    assert main(["--config", "configs/own_photos.yaml", "--set", f"data.root={root}", "--no-features",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    n = len(bundled.vocab)
    assert f"({n} words) + 1 new from your captions: zorblax" in out, out
    assert f"vocabulary: {n + 1} words" in out and "UNK rate 0.00%" in out, out


def test_a_photo_missing_on_disk_is_named_and_stops_prepare_unless_skipped(tmp_path, capsys):
    """A half-copied folder: a photo captions.txt lists is not there -> named, exit 2; --skip-missing goes on."""
    from captioner.cli.prepare import main

    root = _own_folder(tmp_path / "mine", bom=False)
    gone = sorted((root / "Images").iterdir())[3]
    gone.unlink()
    args = ["--config", "configs/own_photos.yaml", "--set", f"data.root={root}", "--no-features", "--device", "cpu"]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert err.count("error:") == 1 and gone.name in err and "--skip-missing" in err and "vocabulary" not in out, err
    assert main(args + ["--skip-missing"]) == 0
    out, err = capsys.readouterr()
    assert gone.name in out and "error" not in err and "vocabulary" in out, (out, err)


def test_caption_prints_a_tiny_photos_note_beside_the_plain_caption(tmp_path, capsys):
    from captioner.cli.caption import main

    Image.new("RGB", (1, 1), (200, 30, 30)).save(tmp_path / "dot.png")
    assert main([str(tmp_path / "dot.png"), "--beam-size", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(str(tmp_path / "dot.png") + "\t")  # the caption line is unchanged ...
    assert "note: " in err and "dot.png" in err and "1x1" in err, err  # ... and the note says what was done


def test_a_plain_caption_run_says_little_on_stderr_and_verbose_says_every_setting(capsys):
    """`captioner-caption photo.jpg`: at most 400 characters on stderr, one short line that names the beam and
    says --verbose lists every setting; a changed setting is named; --verbose prints each of them."""
    from captioner.cli.caption import main
    from captioner.config import DecodeConfig

    assert main([str(CAT)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(str(CAT)) and len(err) <= 400 and "beam_size" in err and "--verbose" in err, err
    assert main([str(CAT), "--decode", "block_trigrams=false"]) == 0
    brief = capsys.readouterr().err
    assert "block_trigrams False" in brief and "block_bigrams" not in brief and len(brief) <= 400, brief
    assert main([str(CAT), "--verbose"]) == 0
    verbose = capsys.readouterr().err
    assert len(verbose) > 400 and all(f.name in verbose for f in dataclasses.fields(DecodeConfig)
                                      if not f.name.startswith(("confidence_", "consensus_", "sure_at"))), verbose


def test_a_captions_repr_is_a_line_or_two(capsys):
    """repr(Caption) in a REPL: its text, how sure and its words, in at most 600 characters (the attention maps
    and every other field stay in the object), also for a long explained sentence."""
    model = captioner.load()
    cap = model.caption(CAT)
    text = repr(cap)
    assert len(text) <= 600 and text.count("\n") <= 1 and cap.text in text and "confidence" in text, text
    assert all(w in text for w in cap.words) and "array" not in text
    long = model.explain(CAT, " ".join(["a cat sitting on a wall"] * 40))
    assert len(repr(long)) <= 600 and repr(long).startswith("Caption("), repr(long)


def test_explain_notes_an_unknown_word_once(capsys):
    """captioner-caption --explain with a word the model lacks: one note per photo, not two."""
    from captioner.cli.caption import main

    photo = sorted((ROOT / "captioner" / "assets" / "examples").glob("*.jpg"))[0]
    assert main([str(photo), "--explain", "a zorblax sits on the grass"]) == 0
    out, err = capsys.readouterr()
    assert err.count("not in the model's vocabulary") == 1 and "zorblax" in err and "zorblax(unk)" in out, (out, err)


def test_the_app_listens_on_this_machine_only_unless_told_otherwise(tmp_path):
    """`streamlit run app.py` listened on every interface: a laptop in a café served its photos to the room. The
    setting as streamlit itself reads it from the checkout's .streamlit/config.toml (a HOME of its own, so no
    personal config decides), and the command-line flag docs/app.md gives still opens it."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, sys\nfrom streamlit import config\nout = {}\n"
            "for flags in ({}, {'server.address': '0.0.0.0'}):\n"
            "    config.get_config_options(force_reparse=True, options_from_flags=flags)\n"
            "    out[str(bool(flags))] = [config.get_option('server.address'), config.get_where_defined('server.address')]\n"
            "print(json.dumps(out))")
    env = {**os.environ, "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.splitlines()[-1])
    assert seen["False"] == ["127.0.0.1", str(ROOT / ".streamlit" / "config.toml")]
    assert seen["True"][0] == "0.0.0.0"
    assert "--server.address 0.0.0.0" in (ROOT / "docs" / "app.md").read_text()


def test_a_fully_transparent_png_and_a_panorama_shrunk_on_reading_get_notes_that_say_so(tmp_path, capsys):
    """A fully transparent PNG got a confident caption with no note; a 5000x20 photo's note named the size it was
    shrunk to (1024x4), not the file's. Both notes reach the CLI's stderr, the API's Caption and its Photo."""
    from captioner.cli.caption import main

    from .conftest import tiny_captioner

    clear, wide, part = tmp_path / "clear.png", tmp_path / "wide.png", tmp_path / "part.png"
    Image.new("RGBA", (300, 300), (0, 0, 0, 0)).save(clear)
    Image.linear_gradient("L").resize((5000, 20)).convert("RGB").save(wide)  # a picture, not one flat colour
    some = Image.new("RGBA", (300, 300), (0, 0, 0, 0))
    some.putpixel((3, 3), (255, 0, 0, 255))  # one pixel shows: a picture, however small
    some.save(part)
    model = tiny_captioner()
    cap, shown, partly = (model.caption(str(p), beam_size=1, max_len=3) for p in (clear, wide, part))
    assert cap.notes == ["The image is fully transparent: it holds no picture, so the caption describes an empty "
                         "white image."] and not any("transparent" in n for n in partly.notes)
    assert model.read(str(clear)).notes == cap.notes and model.read(str(clear)).transparent
    side = model.config.model.image_size
    assert shown.notes == [f"The photo is 5000x20 pixels, read at 1024x4 (its longer side brought to 1024): its "
                           f"shorter side is far smaller than the model's {side}x{side} input, enlarged {side // 4}x, "
                           "so the caption rests on very little detail."]
    assert model.read(str(wide)).file_size == (5000, 20) and model.read(str(wide)).size == (1024, 4)
    assert main([str(clear), str(wide), "--beam-size", "1"]) == 0
    err = capsys.readouterr().err
    assert f"note: {clear}: The image is fully transparent" in err and f"note: {wide}: The photo is 5000x20" in err


@pytest.mark.parametrize("text", ["", "\n\n", "\ufeff"])
def test_an_empty_captions_file_says_it_is_empty(tmp_path, text):
    root = _own_folder(tmp_path / "mine", bom=False)
    (root / "captions.txt").write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=r"captions.txt: the file is empty; write a header line 'image,caption'"):
        read_captions(root)
    (root / "captions.txt").write_text("p00.jpg,a dog\n", encoding="utf-8")  # a caption where the header goes
    with pytest.raises(ValueError, match=r"expected a CSV with header 'image,caption', got 'p00.jpg,a dog'"):
        read_captions(root)


def test_a_bare_train_command_says_what_it_will_do_before_it_starts(tmp_path, monkeypatch, capsys):
    """`captioner-train` with no --config started a 13-minute encode of Flickr8k without a word: one line first
    names the settings, the data, the encode ahead and about how long it takes."""
    import captioner.training.engine as engine
    from captioner.cli.train import main

    from .conftest import need_flickr

    flickr = need_flickr()
    started = []
    monkeypatch.setattr(engine, "fit", lambda cfg, **kw: started.append(capsys.readouterr().out))
    assert main(["--set", f"data.root={flickr}", f"data.cache_dir={tmp_path / 'cache'}",
                 f"train.out_dir={tmp_path / 'run'}", "--device", "cpu"]) == 0
    (said,) = started[0].splitlines()  # one line, printed before training starts
    assert said.startswith("no --config: training the built-in defaults (captioner/config.py: efficientnet_lite0")
    assert f"flickr8k from {flickr}" in said and "at most 20 epochs" in said
    assert "it first encodes the 7,000 train and val photos into the feature cache" in said and " min on one CPU" in said
    assert "configs/flickr8k_cpu.yaml" in said
    assert main(["--config", "configs/tiny.yaml", "--set", f"data.root={flickr}", f"data.cache_dir={tmp_path / 'c'}",
                 f"train.out_dir={tmp_path / 'tiny'}", "--device", "cpu"]) == 0
    assert "no --config" not in started[1]  # a recipe says what it is itself


def test_an_annotations_file_that_is_not_json_is_named_in_the_error(tmp_path):
    """`captioner-evaluate --annotations NOTES.JPG (a photo)` said only "Expecting value: line 1 column 1"."""
    from captioner.data.coco import load_coco
    from captioner.data.karpathy import load_karpathy
    from captioner.evaluation.boxes import load_instances

    notes = tmp_path / "notes.jpeg"
    notes.write_bytes(CAT.read_bytes()[:500])  # not text at all
    text = tmp_path / "notes.json"
    text.write_text("my notes, not JSON")
    for bad in (notes, text):
        for read, what in ((lambda p: load_coco(tmp_path, p), "COCO captions"), (load_instances, "COCO instances"),
                           (lambda p: load_karpathy(tmp_path, p, "test"), "Karpathy split")):
            with pytest.raises(ValueError) as e:
                read(bad)
            assert str(bad) in str(e.value) and what in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_captioner_evaluate_names_an_unreadable_annotations_file(tmp_path, capsys):
    from captioner.cli.evaluate import main
    from captioner.evaluation.metrics import java_available

    if not java_available():
        pytest.skip("captioner-evaluate needs java (pycocoevalcap)")
    notes = tmp_path / "notes.jpeg"  # a photo's name where the JSON goes
    notes.write_text("not json")
    assert main(["--dataset", "coco", "--images", str(tmp_path), "--annotations", str(notes)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and str(notes) in err and "Traceback" not in err


def test_a_missing_photo_that_empties_val_is_said_by_prepare_and_by_training(tmp_path, capsys):
    """10 photos, the only val one (the 6th by name) missing on disk: --skip-missing left val empty and
    captioner-train said only "error: no predictions to score" after an epoch."""
    from types import SimpleNamespace

    from captioner.cli.prepare import main
    from captioner.config import Config
    from captioner.data.records import ImageRecord
    from captioner.training.sources import _per_set
    from captioner.vocab import Vocab

    root = _own_folder(tmp_path / "mine", bom=False)
    (root / "Images" / "p05.jpg").unlink()
    args = ["--config", "configs/own_photos.yaml", "--set", f"data.root={root}", "--no-features", "--device", "cpu",
            "--skip-missing"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "val" in err and "p05.jpg" in err and "every 10th photo" in err, err
    val = [ImageRecord("p05.jpg", root / "Images" / "p05.jpg", ["a cat"])]  # the cache could not read it
    train = [ImageRecord("p00.jpg", root / "Images" / "p00.jpg", ["a cat"])]
    cache = SimpleNamespace(missing=["p05.jpg"], features=None)
    src = SimpleNamespace(name="own_photos", weight=1.0)
    with pytest.raises(ValueError, match=r"own_photos: none of the val split's 1 photo\(s\) could be read \(p05.jpg"):
        _per_set(Config(), Vocab(["<pad>", "<start>", "<end>", "<unk>", "a", "cat"]), [(src, train)], [(src, val)],
                 lambda s, splits: {"train": SimpleNamespace(missing=[], features=None), "val": cache}, print)


def test_a_wrong_data_root_for_own_photos_talks_of_the_own_photos_layout(tmp_path, capsys):
    """`captioner-prepare --config configs/own_photos.yaml --set data.root=nothere` talked of Kaggle and Flickr8k."""
    from captioner.cli.prepare import main

    for root, says in ((tmp_path / "nothere", "no such folder"), (tmp_path, "no captions.txt found")):
        assert main(["--config", "configs/own_photos.yaml", "--set", f"data.root={root}", "--no-features"]) == 2
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and says in err and "Train on your own photos" in err, err
        assert "Images/ and captions.txt" in err and "Kaggle layout" not in err


def test_round_nine_smaller_items_explain_truncated_and_json_help(tmp_path, capsys):
    """--explain names no hard_context for a soft-attention model; a truncated JPEG is said in plain words, without
    Pillow's internals; --json's help names the confidence, level and doubt it carries."""
    from captioner.cli.caption import main, parse_args
    from captioner.images import ImageError, load_image

    photo = sorted((ROOT / "captioner" / "assets" / "examples").glob("*.jpg"))[0]
    assert main([str(photo), "--explain", "a cat on a wall"]) == 0
    err = capsys.readouterr().err
    assert "explaining the sentence (teacher forcing); nothing is decoded" in err and "hard_context" not in err
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(photo.read_bytes()[:5000])
    with pytest.raises(ImageError) as e:
        load_image(cut)
    assert "truncated" in str(e.value) and "bytes not processed" not in str(e.value) and "OSError" not in str(e.value)
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(w in help_text for w in ("confidence", "level", "doubt")), help_text
