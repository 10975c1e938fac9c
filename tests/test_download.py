"""The COCO download helper (scripts/download_coco.py, captioner/data/download.py) without the network: the dry run
prints every official URL with its checksum and what is already there, and touches nothing; unpacking puts a zip's
files where the recipe reads them."""
from __future__ import annotations

import subprocess
import sys
import urllib.request
import zipfile

from captioner.data.download import COCO_2014, plan, unpack

from .conftest import ROOT


def test_the_dry_run_prints_the_official_urls_and_fetches_nothing(tmp_path, monkeypatch, capsys):
    from captioner.cli.download_coco import main

    def no_network(*_a, **_k):
        raise AssertionError("the dry run opened a URL")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    dest = tmp_path / "coco"
    assert main(["--dest", str(dest), "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" -> ")[0] for line in out] == [d.url for d in COCO_2014]
    assert "images.cocodataset.org/zips/train2014.zip" in out[0] and "md5 0da8c0bd3d6becc4dcb32757491aca88" in out[0]
    assert "caption_datasets.zip" in out[3] and "no published checksum" in out[3]
    assert not dest.exists()  # nothing written


def test_the_plan_says_what_is_already_there(tmp_path):
    (tmp_path / "train2014").mkdir()
    (tmp_path / "val2014.zip.part").write_bytes(b"x" * (3 << 20))
    lines = plan(tmp_path)
    assert lines[0].endswith("train2014 is there: skipped)") and "to fetch" in lines[2]
    assert "3 MiB of it fetched into val2014.zip.part: the download resumes there" in lines[1]


def test_the_plan_never_calls_a_file_it_did_not_check_downloaded(tmp_path):
    """A 1 MiB file at a 13 GB zip's final name is a file of that size, to be checked, not a finished download."""
    (tmp_path / "train2014.zip").write_bytes(b"x" * (1 << 20))
    (tmp_path / "caption_datasets.zip").write_bytes(b"x" * (1 << 20))
    lines = plan(tmp_path)
    assert not any("downloaded" in line for line in lines)
    assert "a 1.0 MiB file is there: its md5 is checked before it is unpacked" in lines[0]
    assert "a 1.0 MiB file is there: unpacked as it is (nothing to check it against)" in lines[3]


def test_unpacking_keeps_only_the_named_members_and_leaves_no_temporary_folder(tmp_path):
    archive = tmp_path / "caption_datasets.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("dataset_coco.json", '{"images": []}')
        z.writestr("dataset_flickr8k.json", "{}")
    unpack(archive, tmp_path, ("dataset_coco.json",), lambda _m: None)
    assert (tmp_path / "dataset_coco.json").read_text() == '{"images": []}'
    assert not (tmp_path / "dataset_flickr8k.json").exists() and not list(tmp_path.glob(".unpacking-*"))


def test_the_script_is_a_thin_wrapper():
    r = subprocess.run([sys.executable, "scripts/download_coco.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "--dry-run" in r.stdout
