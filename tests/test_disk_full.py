"""A full disk is an error with a way out, never a lost run: a training epoch, the feature and
activation caches and export each stop with a message naming the file and the space it needs, keep
the previous checkpoint / cache / model file valid, and the same command run again (space freed)
goes on from there.

The full disk is simulated the way it shows up: the free-space figure (shutil.disk_usage) or the
writer itself raising OSError(ENOSPC) part-way through a file (safetensors reports it as
"... (os error 28)"); a real full tmpfs raises the same errors."""
from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import captioner
from captioner import checkpoint, diskspace
from captioner.checkpoint import load_checkpoint, read_safetensors, write_safetensors
from captioner.diskspace import DiskFullError

from .conftest import ROOT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ENOSPC_SAFETENSORS = "Error while serializing: I/O error: No space left on device (os error 28)"


def half_then_full(tmp: Path, tensors, metadata) -> None:
    """What safetensors does on a disk that fills up: part of the file written, then an error."""
    Path(tmp).write_bytes(b"\x00" * 1000)
    raise Exception(ENOSPC_SAFETENSORS)  # safetensors' SafetensorError is a plain Exception subclass


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".tmp" in p.name)


def assert_names_path_and_space(message: str, path: Path) -> None:
    assert str(path) in message and "MiB" in message and "free" in message, message
    assert "rerun the same command" in message, message


# ----------------------------------------------------------------------------- the checkpoint writer

def test_checkpoint_writer_on_a_full_disk_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    write_safetensors(path, {"w": torch.arange(10.0)}, {"v": "1"})
    before = path.read_bytes()
    bigger = {"w": torch.zeros(300_000)}  # 1.2 MB
    # (a) the free space says no before a byte is written
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
    with pytest.raises(DiskFullError) as e:
        write_safetensors(path, bigger, {"v": "2"})
    assert_names_path_and_space(str(e.value), path)
    assert e.value.errno == errno.ENOSPC and e.value.needed > 1_200_000
    monkeypatch.undo()
    # (b) the disk fills up half-way through the file
    def enospc(tmp, tensors, metadata):
        Path(tmp).write_bytes(b"\0" * 99)
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp))
    monkeypatch.setattr(checkpoint, "_write_file", enospc)
    with pytest.raises(DiskFullError) as e:
        write_safetensors(path, bigger, {"v": "2"})
    assert_names_path_and_space(str(e.value), path)
    monkeypatch.undo()
    # (c) the same, as safetensors itself reports it
    monkeypatch.setattr("safetensors.torch.save_file", lambda t, f, metadata=None: half_then_full(f, t, metadata))
    with pytest.raises(DiskFullError) as e:
        captioner.Captioner.save(_tiny(), path)  # the public API says it too
    assert_names_path_and_space(str(e.value), path)
    assert path.read_bytes() == before and read_safetensors(path)[1] == {"v": "1"}  # the old file, intact
    assert leftovers(tmp_path) == []
    monkeypatch.undo()
    write_safetensors(path, bigger, {"v": "2"})  # space again: the same call works
    assert read_safetensors(path)[0]["w"].shape == (300_000,)


def _tiny() -> captioner.Captioner:
    from .conftest import tiny_captioner

    return tiny_captioner()


# ----------------------------------------------------------------------------- training

def _train(argv_out: Path, cache: Path, *extra: str) -> list[str]:
    return ["--config", "configs/tiny.yaml", "--no-progress", "--threads", "1", "--set", f"train.out_dir={argv_out}",
            f"data.cache_dir={cache}", "train.epochs=2", *extra]


def _fail_after_step(step: int):
    """safetensors' writer on a disk that is full once the run is past `step` (what checkpoint._write_file calls)."""
    from safetensors.torch import save_file as real

    def save(tensors, filename, metadata=None):
        state = json.loads((metadata or {}).get("train_state", "{}")).get("state", {})
        if state.get("step", 0) > step:
            return half_then_full(filename, tensors, metadata)
        return real(tensors, filename, metadata=metadata)
    return save


@pytest.mark.slow
def test_full_disk_during_a_training_epoch_keeps_the_last_checkpoint_and_resumes(flickr, tmp_path, monkeypatch,
                                                                                capsys):
    from captioner.cli.train import main

    monkeypatch.chdir(ROOT)
    out, cache = tmp_path / "run", tmp_path / "cache"
    monkeypatch.setattr("safetensors.torch.save_file", _fail_after_step(2))  # epoch 2's mid-epoch checkpoint fails
    assert main(_train(out, cache)) == 1
    err = capsys.readouterr().err
    assert_names_path_and_space(err, out / "last.safetensors")
    assert "the last good checkpoint is kept" in err
    state = load_checkpoint(out / "last.safetensors").train_state["state"]
    assert (state["step"], state["epoch"], state["finished"]) == (2, 1, False)  # the end of epoch 1
    assert load_checkpoint(out / "best.safetensors").train_state is None
    assert leftovers(tmp_path) == []
    monkeypatch.undo()
    monkeypatch.chdir(ROOT)
    assert main(_train(out, cache)) == 0  # space freed: the same command
    log = capsys.readouterr().out
    assert f"resuming from {out / 'last.safetensors'}: epoch 2, batch 0, step 2" in log
    state = load_checkpoint(out / "last.safetensors").train_state["state"]
    assert (state["step"], state["epoch"], state["finished"]) == (4, 2, True)


# ----------------------------------------------------------------------------- the caches

def test_full_disk_while_building_the_feature_cache(flickr, tmp_path, monkeypatch, capsys):
    from captioner.config import DataConfig
    from captioner.data import build_records
    from captioner.data import features
    from captioner.model.encoder import Encoder

    recs = build_records(DataConfig(root=str(flickr), limit=3), "test")
    enc = Encoder("efficientnet_lite0", True, 7)
    good = features.build_cache(tmp_path, "good", enc, 224, recs[:2], num_workers=0, progress=False)

    def full(path, size):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(features, "reserve", full)  # the new cache's blocks cannot be allocated
    with pytest.raises(DiskFullError) as e:
        features.build_cache(tmp_path, "new", enc, 224, recs, num_workers=0, progress=False)
    assert_names_path_and_space(str(e.value), tmp_path / "new.npy")
    assert e.value.needed >= 3 * 49 * 1280 * 2
    assert features.open_cache(tmp_path, "new", enc, 224, recs) is None  # nothing half-written is taken for a cache
    assert features.open_cache(tmp_path, "good", enc, 224, recs[:2]) is not None  # the other cache: still valid
    assert np.array_equal(features.open_cache(tmp_path, "good", enc, 224, recs[:2]).features, good.features)
    assert leftovers(tmp_path) == []
    monkeypatch.undo()
    # the training command says the same and exits 1; the same command afterwards builds and trains
    from captioner.cli.train import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(features, "reserve", full)
    out, cache = tmp_path / "run", tmp_path / "cache"
    assert main(_train(out, cache, "train.epochs=1")) == 1
    err = capsys.readouterr().err
    assert "error: not enough disk space to write " + str(cache) in err and ".npy" in err and "MiB" in err, err
    assert not (out / "last.safetensors").exists() and leftovers(tmp_path) == []
    monkeypatch.undo()
    monkeypatch.chdir(ROOT)
    assert main(_train(out, cache, "train.epochs=1")) == 0
    assert load_checkpoint(out / "last.safetensors").train_state["state"]["finished"]


def test_full_disk_while_building_the_activation_cache(flickr, tmp_path, monkeypatch):
    from captioner.config import load_config
    from captioner.data import activations, build_records
    from captioner.model.encoder import Encoder, build_preprocess

    cfg = load_config(ROOT / "configs/tiny.yaml", [f"data.root={flickr}", "data.limit=3", "model.image_size=128", "model.grid_size=4"])
    recs = build_records(cfg.data, "train")
    prep = build_preprocess(cfg.model)
    enc = Encoder(cfg.model.encoder, True, cfg.model.grid_size).eval()
    activations.build_activations(tmp_path, "good", enc, prep, recs[:2], flip=False, num_workers=0, progress=False)
    real = activations.reserve
    calls = []

    def full_on_the_second(path, size):  # the photos fit, their flipped copies do not
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, size)
    monkeypatch.setattr(activations, "reserve", full_on_the_second)
    with pytest.raises(DiskFullError) as e:
        activations.build_activations(tmp_path, "new", enc, prep, recs, flip=True, num_workers=0, progress=False)
    assert_names_path_and_space(str(e.value), tmp_path / "new.npy")
    assert activations.open_activations(tmp_path, "new", enc, prep, recs, flip=True) is None
    assert activations.open_activations(tmp_path, "good", enc, prep, recs[:2], flip=False) is not None
    assert leftovers(tmp_path) == []
    monkeypatch.undo()
    c = activations.build_activations(tmp_path, "new", enc, prep, recs, flip=True, num_workers=0, progress=False)
    assert c.flipped is not None and c.acts.shape[0] == 3


# ----------------------------------------------------------------------------- export

def test_full_disk_during_export_keeps_the_previous_export(tmp_path, monkeypatch, capsys):
    from captioner.cli.export import main

    src, out = tmp_path / "trained.safetensors", tmp_path / "out" / "model.safetensors"
    _tiny().save(src)
    assert main([str(src), str(out), "--set", "decode.beam_size=2"]) == 0
    before = out.read_bytes()
    monkeypatch.setattr("safetensors.torch.save_file", lambda t, f, metadata=None: half_then_full(f, t, metadata))
    assert main([str(src), str(out), "--set", "decode.beam_size=4"]) == 1
    err = capsys.readouterr().err
    assert_names_path_and_space(err, out)
    assert out.read_bytes() == before and captioner.load(out).config.decode.beam_size == 2  # still the old export
    assert leftovers(tmp_path) == []
    monkeypatch.undo()
    assert main([str(src), str(out), "--set", "decode.beam_size=4"]) == 0  # space freed: the same command
    assert captioner.load(out).config.decode.beam_size == 4


def test_the_free_space_check_reads_the_nearest_existing_folder(tmp_path):
    free = diskspace.free_bytes(tmp_path / "not" / "yet" / "made.npy")
    assert free is not None and abs(free - shutil.disk_usage(tmp_path).free) < 2**30
    diskspace.check_space(tmp_path / "x", 1)  # 1 byte fits
    with pytest.raises(DiskFullError, match="x: it needs about"):
        diskspace.check_space(tmp_path / "x", 1 << 62)
