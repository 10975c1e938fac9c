"""Which model files the app may offer (captioner/ui/checkpoints.py): only the operator's folders, bounded
in depth, count and time, never through a link out of an allowed folder."""
from __future__ import annotations

import os

from captioner.ui.checkpoints import find_model_files, operator_folders


def test_only_files_inside_the_allowed_folders_and_bounded(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "a" / "b").mkdir(parents=True)
    outside.mkdir()
    (allowed / "top.safetensors").write_bytes(b"x")
    (allowed / "a" / "b" / "deep.safetensors").write_bytes(b"x")
    (outside / "private.safetensors").write_bytes(b"x")
    (allowed / "link.safetensors").symlink_to(outside / "private.safetensors")
    (allowed / "escape").symlink_to(outside, target_is_directory=True)
    names = {p.name for p in find_model_files([allowed]).files}
    assert names == {"top.safetensors", "deep.safetensors"}  # neither link leads out
    shallow = find_model_files([allowed], max_depth=1)
    assert {p.name for p in shallow.files} == {"top.safetensors"} and shallow.stopped == ""
    capped = find_model_files([allowed], max_files=1)
    assert len(capped.files) == 1 and "stopped at 1 model files" in capped.stopped
    assert find_model_files([tmp_path / "missing"]).files == []


def test_operator_folders_come_from_the_server_side():
    assert operator_folders([], None) == ["runs"]
    assert operator_folders(["--checkpoints", "a", "b", "--other"], "x") == ["a", "b"]
    assert operator_folders([], os.pathsep.join(["m1", "m2"])) == ["m1", "m2"]


def test_a_consensus_memory_is_not_offered_as_a_model(tmp_path):
    """captioner-build-consensus writes <model>.consensus.safetensors beside the model: loading it as a model
    fails ("unknown format tag"), so the menu offers the model alone (its memory comes with it)."""
    (tmp_path / "model.safetensors").write_bytes(b"x")
    (tmp_path / "model.consensus.safetensors").write_bytes(b"x")
    assert [p.name for p in find_model_files([tmp_path]).files] == ["model.safetensors"]
