"""A photo library captioned by captioner-caption --output FILE.jsonl (cli/jsonl_output.py): a line per photo as
it goes, a rerun that captions only the photos the file lacks, torchrun's processes each captioning their own
share into one file; and the mistakes a command answers before its model loads."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time

import pytest
from PIL import Image

import captioner
from captioner.cli.caption import default_batch, main
from captioner.cli.inputs import read_ahead
from captioner.images import ImageError
from captioner.cli.jsonl_output import append_lines, share, written_images

from .conftest import ENV, ROOT, photo, run, tiny_captioner


def images_in(path) -> list[str]:
    return [json.loads(line)["image"] for line in path.read_text().splitlines()]


@pytest.fixture
def library(tmp_path):
    """A folder of 5 photos and a tiny model file."""
    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(5):
        photo(64 + 8 * i, 48).save(folder / f"p{i}.jpg")
    tiny_captioner().save(tmp_path / "tiny.safetensors")
    return folder, str(tmp_path / "tiny.safetensors")


def test_output_twice_each_photo_once_and_a_new_photo_alone_is_captioned(library, tmp_path, capsys):
    folder, model = library
    out = tmp_path / "captions.jsonl"
    args = [str(folder), "--checkpoint", model, "--output", str(out), "--beam-size", "1"]
    assert main(args) == 0
    first = images_in(out)
    assert sorted(first) == sorted(str(p) for p in folder.glob("*.jpg")) and capsys.readouterr().out == ""
    assert main(args) == 0
    assert images_in(out) == first  # the second run captions none
    assert "5 of 5 photo(s) are already in" in capsys.readouterr().err
    photo(30, 90).save(folder / "new.jpg")
    assert main(args + ["--maps"]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["image"] for r in lines] == first + [str(folder / "new.jpg")]  # only the added one, once
    assert "alphas" in lines[-1] and all(r["caption"] for r in lines)


def test_read_ahead_hands_batches_over_in_order_and_holds_a_bounded_window():
    # photos finish in a random order on 4 threads; the batches still come in the library's order, a bad photo in its
    # place, and no more than (ahead + 1) batches are ever being read or held
    paths = [f"p{i}.jpg" for i in range(23)]
    started, lock = [], threading.Lock()

    def read(path):
        with lock:
            started.append(path)
        time.sleep(0.2 if path == "p0.jpg" else random.Random(path).uniform(0, 0.01))  # the first: the slowest
        if path == "p7.jpg":
            raise ImageError("p7.jpg: cannot read image")
        return path.upper()

    seen = []
    for batch in read_ahead(paths, 5, read, threads=4, ahead=2):
        with lock:
            assert len(started) <= len(seen) + 3 * 5  # this batch and the two read ahead
        seen += batch
    assert [p for p, _ in seen] == paths and [len(b) for b in read_ahead(paths, 5, str, threads=2)] == [5, 5, 5, 5, 3]
    assert [r for p, r in seen if p != "p7.jpg"] == [p.upper() for p in paths if p != "p7.jpg"]
    assert isinstance(dict(seen)["p7.jpg"], ImageError) and sorted(started) == sorted(paths)


def test_prepared_photos_caption_as_the_photos_themselves(library):
    # what the reader threads hand over (Captioner.prepare) is read as the file itself would be
    folder, model = library
    loaded = captioner.load(model)
    files = sorted(str(p) for p in folder.glob("*.jpg"))
    by_path = [c.to_dict() for c in loaded.caption_batch(files, beam_size=2)]
    assert [c.to_dict() for c in loaded.caption_batch([loaded.prepare(f) for f in files], beam_size=2)] == by_path
    assert default_batch("cpu") == 16 and default_batch(None) == 16 and default_batch("cuda:1") >= 64


def test_a_half_written_last_line_is_captioned_again_and_cut_off(tmp_path):
    out = tmp_path / "c.jsonl"
    append_lines(out, [json.dumps({"image": "a.jpg"})])
    with open(out, "a") as f:
        f.write('{"image": "b.jpg", "capt')  # a process killed mid-line
    assert written_images(out) == {"a.jpg"}
    append_lines(out, [json.dumps({"image": "b.jpg"}), json.dumps({"image": "b.jpg", "sample": 2})])
    assert [json.loads(x)["image"] for x in out.read_text().splitlines()] == ["a.jpg", "b.jpg", "b.jpg"]


def test_an_output_file_that_is_not_captions_is_refused_before_the_model(tmp_path, capsys):
    other = tmp_path / "notes.jsonl"
    other.write_text("shopping list\nmilk\n")
    with pytest.raises(ValueError, match="line 1 is not a captioner-caption JSON line"):
        written_images(other)
    photo().save(tmp_path / "a.jpg")
    assert main([str(tmp_path / "a.jpg"), "--output", str(other), "--checkpoint", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and str(other) in err and "Traceback" not in err
    assert main([str(tmp_path / "a.jpg"), "--output", str(tmp_path)]) == 2  # a folder
    assert "is a folder" in capsys.readouterr().err


def test_shares_cover_every_photo_once():
    paths = [f"p{i}" for i in range(7)]
    for world in (1, 2, 3):
        shares = [share(paths, r, world) for r in range(world)]
        assert sorted(sum(shares, [])) == sorted(paths)


@pytest.mark.parametrize("extra, says", [
    (["--attention-dir", "README.md"], "--attention-dir README.md is a file"),
    (["--animate", "README.md"], "--animate README.md is a file"),
    (["--maps"], "--maps adds the attention maps to JSON lines"),
    (["--beam-size", "0"], "--beam-size must lie in"),
    (["--temperature", "0.5"], "--temperature only applies with --sample"),
])
def test_option_mistakes_are_one_line_before_the_model_loads(extra, says, capsys):
    """A missing model file shows the model was never loaded: the options are refused first."""
    cat = str(ROOT / "captioner" / "assets" / "examples" / "cat.jpg")
    assert main([cat, "--checkpoint", "no-such-model.safetensors", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and says in err and "no-such-model" not in err and "Traceback" not in err


def test_a_missing_file_or_an_empty_folder_is_answered_at_once(tmp_path):
    """Answered before torch or the model loads: well under the ~8 s a model load takes on a 2-core machine."""
    for target, says in ((tmp_path / "gone.jpg", "gone.jpg: no such file"), (tmp_path, "no images found")):
        t = time.perf_counter()
        proc = run("scripts/caption.py", str(target), ok=False)
        took = time.perf_counter() - t
        assert proc.returncode == 1 and says in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr
        assert "Traceback" not in proc.stderr and took < 4, took


@pytest.mark.slow
def test_torchrun_two_cpu_processes_share_the_photos_into_one_file(library, tmp_path):
    """2 gloo-less CPU processes (they share nothing but the file and its lock): each photo once in one file;
    run again, nothing is captioned."""
    folder, model = library
    for i in range(5, 9):
        Image.new("RGB", (40 + i, 40), (10 * i, 200, 30)).save(folder / f"p{i}.jpg")
    out = tmp_path / "captions.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29541",
           "scripts/caption.py", str(folder), "--checkpoint", model, "--output", str(out), "--beam-size", "1",
           "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(images_in(out)) == sorted(str(p) for p in folder.glob("*.jpg"))  # 9 photos, each once
    assert "rank 0 of 2: 5 photo(s)" in proc.stderr and "rank 1 of 2: 4 photo(s)" in proc.stderr
    assert proc.stderr.count("decoding with") == 1  # the settings are said once, not once per process
    again = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and len(images_in(out)) == 9 and "photo(s) captioned" not in again.stderr
