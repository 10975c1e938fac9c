"""captioner-evaluate's default output names: one file per run, model file and data, so that two runs'
best.safetensors never overwrite each other's results (they were both evaluations/best_<dataset>_<split>.json)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from captioner.cli.evaluate import default_output

from .conftest import need_coco


def named(checkpoint: str | None, dataset: str = "flickr8k", label: str = "test", limit: int | None = None) -> Path:
    return Path(default_output(argparse.Namespace(checkpoint=checkpoint, dataset=dataset, limit=limit), label))


def test_two_runs_best_files_get_different_names(tmp_path):
    a, b = (tmp_path / "runs" / r / "best.safetensors" for r in ("a", "b"))
    assert named(str(a)) != named(str(b))
    assert named(str(a)).name == "a-best_flickr8k_test.json"  # readable: the run folder, then the file
    assert named(str(a)) != named(str(a.with_name("last.safetensors")))  # one run's files differ too
    assert all(p.parent == Path("evaluations") for p in (named(str(a)), named(str(b)), named(None)))


def test_the_same_file_named_from_inside_its_run_folder_gets_the_same_name(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    monkeypatch.chdir(run)
    assert named("best.safetensors") == named(str(run / "best.safetensors"))


def test_bundled_model_and_data_stay_in_the_name():
    assert named(None).name == "bundled_flickr8k_test.json"
    assert named(None, "coco", "val2017", limit=2).name == "bundled_coco_val2017-first2.json"
    assert named("runs/a/best.safetensors", "coco", "val2017") != named("runs/a/best.safetensors")


def test_another_decode_of_the_same_model_keeps_its_own_file():
    plain = Path(default_output(argparse.Namespace(checkpoint=None, dataset="flickr8k", limit=None), "test", {}))
    beam3 = Path(default_output(argparse.Namespace(checkpoint=None, dataset="flickr8k", limit=None), "test",
                                {"beam_size": 3}))
    assert plain.name == "bundled_flickr8k_test.json" and beam3.name == "bundled_flickr8k_test_beam_size3.json"


def test_a_folder_of_the_same_name_elsewhere_never_replaces_the_earlier_result(tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    first, second = tmp_path / "x" / "runs" / "a" / "best.safetensors", tmp_path / "y" / "runs" / "a" / "best.safetensors"
    name = named(str(first))
    name.parent.mkdir()
    name.write_text(json.dumps({"checkpoint": str(first), "model_file": str(first.resolve())}))
    assert named(str(first)) == name  # the same model file: its own result, rewritten
    other = named(str(second))
    assert other != name and other.name.startswith("a-best_flickr8k_test-") and other.parent == name.parent


@pytest.mark.slow
def test_captioner_evaluate_prints_progress_lines_without_a_terminal(tmp_path, capsys):
    """stderr captured (not a terminal): the encoding and the decoding each say how far they are in lines, with
    --json too (the JSON alone on stdout)."""
    from captioner.cli.evaluate import main
    from captioner.evaluation.metrics import java_available

    if not java_available():
        pytest.skip("captioner-evaluate needs java (pycocoevalcap)")
    mini = need_coco()
    assert main(["--dataset", "coco", "--images", str(mini / "train2017"), "--annotations",
                 str(mini / "annotations" / "captions_train2017.json"), "--limit", "3", "--batch-size", "1",
                 "--beam-size", "1", "--json", "--device", "cpu", "--output", str(tmp_path / "e.json")]) == 0
    out, err = capsys.readouterr()
    assert "CIDEr" in json.loads(out)
    assert "encoding: 1/1 batch (100%)" in err and "decoding: 3/3 batch (100%)" in err and "\r" not in err, err
    assert "decoding: 1/3 batch (33%)" in err
