"""Checkpoints are data, never code: a pickle that would run code is refused without being
unpickled, and every broken or mismatched file is a CheckpointError that says what is wrong.
Writes are atomic: a failed or interrupted save leaves the previous checkpoint intact."""
from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import captioner
from captioner.checkpoint import (FORMAT, CheckpointError, load_checkpoint, load_model_state,
                                  save_checkpoint)
from captioner.model.show_attend_tell import build_model
from captioner.vocab import Vocab

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """(config, vocabulary, model) of the module's shared tiny captioner (tests/conftest.py), read only."""
    return tiny_model.config, tiny_model.vocab, tiny_model.model


@pytest.fixture
def good(tmp_path, tiny):
    cfg, vocab, model = tiny
    path = tmp_path / "good.safetensors"
    save_checkpoint(path, cfg, vocab, model.state_dict(), metrics={"Bleu_4": 0.1})
    return path


def read_raw(path):
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}


def rewrite(src, dst, **meta_changes):
    """Copy a checkpoint with some metadata entries replaced (None deletes the entry)."""
    meta, tensors = read_raw(src)
    meta.update(meta_changes)
    save_file(tensors, str(dst), metadata={k: v for k, v in meta.items() if v is not None})
    return dst


# ----------------------------------------------------------------------------- code execution

class _Payload:
    """Unpickling this calls open(marker, 'w'): it creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _malicious_files(tmp_path, marker):
    payload = {"state_dict": {"w": torch.zeros(2)}, "x": _Payload(marker)}
    files = {}
    files["torch.save zip"] = tmp_path / "model.pt"
    torch.save(payload, files["torch.save zip"])
    files["torch.save legacy"] = tmp_path / "legacy.pth"
    torch.save(payload, files["torch.save legacy"], _use_new_zipfile_serialization=False)
    files["pickle protocol 0"] = tmp_path / "p0.ckpt"
    files["pickle protocol 0"].write_bytes(pickle.dumps(payload, protocol=0))
    files["pickle named .safetensors"] = tmp_path / "disguised.safetensors"
    files["pickle named .safetensors"].write_bytes(pickle.dumps(payload, protocol=4))
    return files


def test_payload_really_runs_code_when_unpickled(tmp_path):
    """Sanity check of the test itself: these files DO create the marker when unpickled."""
    marker = tmp_path / "sanity_marker"
    for name, path in _malicious_files(tmp_path, marker).items():
        if "torch.save" in name:
            torch.load(path, weights_only=False)
        else:
            pickle.loads(path.read_bytes())
        assert marker.exists(), name
        marker.unlink()


@pytest.mark.parametrize("kind", ["torch.save zip", "torch.save legacy", "pickle protocol 0",
                                  "pickle named .safetensors"])
@pytest.mark.parametrize("loader", ["load_checkpoint", "captioner.load"])
def test_pickle_checkpoint_is_refused_and_never_unpickled(tmp_path, monkeypatch, kind, loader):
    marker = tmp_path / "PWNED"
    path = _malicious_files(tmp_path, marker)[kind]

    def forbidden(*a, **k):
        raise AssertionError("something tried to unpickle the checkpoint")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    fn = load_checkpoint if loader == "load_checkpoint" else captioner.load
    with pytest.raises(CheckpointError) as e:
        fn(path)
    msg = str(e.value)
    assert str(path) in msg
    assert "not a safetensors checkpoint" in msg
    assert "never unpickles" in msg
    assert not marker.exists()


@pytest.mark.slow
def test_pickle_checkpoint_refused_in_a_fresh_process(tmp_path):
    """End to end, no monkeypatching: the caption CLI refuses the file and no code runs."""
    marker = tmp_path / "PWNED"
    path = _malicious_files(tmp_path, marker)["torch.save zip"]
    img = tmp_path / "x.png"
    from PIL import Image

    Image.new("RGB", (32, 32), (1, 2, 3)).save(img)
    r = subprocess.run([sys.executable, "-m", "captioner.cli.caption", str(img), "--checkpoint", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "never unpickles" in r.stderr
    assert not marker.exists()


# ----------------------------------------------------------------------------- broken files

@pytest.mark.parametrize("keep", [0.0, 4, 8, 100, 0.5, -1])
def test_truncated_checkpoint(tmp_path, good, keep):
    data = good.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(data) + keep)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:n])
    for fn in (load_checkpoint, captioner.load):
        with pytest.raises(CheckpointError, match="not a safetensors checkpoint, or a truncated one") as e:
            fn(cut)
        assert str(cut) in str(e.value)
    if n > 100:
        assert "cut short" in str(e.value)


def test_missing_and_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nope.safetensors")
    with pytest.raises(CheckpointError, match="directory"):
        captioner.load(tmp_path)


def test_random_bytes(tmp_path):
    p = tmp_path / "r.safetensors"
    p.write_bytes(os.urandom(5000))
    with pytest.raises(CheckpointError, match="not a safetensors checkpoint"):
        captioner.load(p)


def test_wrong_format_tag(tmp_path, good):
    for tag, shown in (("something-else/2", "'something-else/2'"), (None, "None")):
        bad = rewrite(good, tmp_path / "fmt.safetensors", format=tag)
        for fn in (load_checkpoint, captioner.load):
            with pytest.raises(CheckpointError, match="format tag") as e:
                fn(bad)
            assert shown in str(e.value) and FORMAT in str(e.value)


def test_plain_safetensors_without_metadata(tmp_path):
    p = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(3)}, str(p))
    with pytest.raises(CheckpointError, match="format tag"):
        captioner.load(p)


@pytest.mark.parametrize("change,words", [
    ({"config": "{"}, "corrupt metadata"),
    ({"config": "[]"}, "config must be a JSON object"),
    ({"config": "null"}, "config must be a JSON object"),
    ({"config": json.dumps({"model": {"bogus": 1}})}, "unknown setting 'model.bogus'"),
    ({"config": json.dumps({"model": {"embed_dim": "big"}})}, "expects int"),
    ({"config": None}, "no 'config' entry"),
    ({"vocab": None}, "no 'vocab' entry"),
    ({"vocab": '{"itos": ["a", "b"]}'}, "vocabulary must start with"),
    ({"vocab": '["<pad>"]'}, "vocabulary JSON must be an object"),
    ({"metrics": "[1, 2]"}, "metrics must be a JSON object"),
    ({"train_state": "7"}, "train_state must be a JSON object"),
])
def test_corrupt_metadata(tmp_path, good, change, words):
    bad = rewrite(good, tmp_path / "meta.safetensors", **change)
    for fn in (load_checkpoint, captioner.load):
        with pytest.raises(CheckpointError, match="corrupt metadata") as e:
            fn(bad)
        assert words in str(e.value)


# ----------------------------------------------------------------------------- mismatches

def test_vocabulary_does_not_match_embedding(tmp_path, good, tiny):
    _, vocab, _ = tiny
    n = len(vocab)
    bad = rewrite(good, tmp_path / "vocab+2.safetensors", vocab=Vocab(vocab.itos + ["cat", "sofa"]).to_json())
    for fn in (load_checkpoint, captioner.load):
        with pytest.raises(CheckpointError, match="shape mismatch") as e:
            fn(bad)
        msg = str(e.value)
        assert f"{n + 2} words" in msg and "decoder.embedding.weight" in msg and f"({n}, 32)" in msg


def test_vocabulary_mismatch_when_loading_into_a_model(tiny):
    """load_model_state (used by load() and by training resume) names the mismatching tensors."""
    cfg, vocab, model = tiny
    n = len(vocab)
    other = build_model(cfg.model, n + 2)
    with pytest.raises(CheckpointError, match="shape mismatch") as e:
        load_model_state(other, model.state_dict(), "ckpt.safetensors")
    assert f"decoder.embedding.weight: checkpoint ({n}, 32) vs model ({n + 2}, 32)" in str(e.value)


def test_other_encoder_in_config(tmp_path, good):
    """lite0 weights, config says efficientnet_lite2."""
    meta, _ = read_raw(good)
    config = json.loads(meta["config"])
    config["model"]["encoder"] = "efficientnet_lite2"
    bad = rewrite(good, tmp_path / "lite2.safetensors", config=json.dumps(config))
    assert load_checkpoint(bad).config.model.encoder == "efficientnet_lite2"  # the file itself is readable
    with pytest.raises(CheckpointError) as e:
        captioner.load(bad)
    msg = str(e.value)
    assert "does not fit the model its config describes" in msg
    assert "efficientnet_lite2" in msg and "shape mismatch" in msg and "encoder." in msg
    assert "other model settings (model.encoder" in msg


def test_other_decoder_size_in_config(tmp_path, good):
    meta, _ = read_raw(good)
    config = json.loads(meta["config"])
    config["model"]["hidden_dim"] = 64
    bad = rewrite(good, tmp_path / "h64.safetensors", config=json.dumps(config))
    with pytest.raises(CheckpointError, match="shape mismatch"):
        captioner.load(bad)


def test_missing_and_unexpected_tensors(tmp_path, good):
    meta, tensors = read_raw(good)
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    tensors["decoder.extra.weight"] = torch.zeros(2)
    p = tmp_path / "keys.safetensors"
    save_file(tensors, str(p), metadata=meta)
    with pytest.raises(CheckpointError) as e:
        captioner.load(p)
    assert "1 missing tensors" in str(e.value) and dropped in str(e.value)
    assert "1 unexpected tensors" in str(e.value) and "decoder.extra.weight" in str(e.value)


def test_non_finite_weights_are_refused(tmp_path, good):
    meta, tensors = read_raw(good)
    key = next(k for k in sorted(tensors) if k.startswith("decoder.") and tensors[k].is_floating_point())
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] = float("nan")
    p = tmp_path / "nan.safetensors"
    save_file(tensors, str(p), metadata=meta)
    with pytest.raises(CheckpointError, match="NaN or inf") as e:
        captioner.load(p)
    assert key in str(e.value)


def test_good_checkpoint_loads_and_captions(good):
    model = captioner.load(good)
    assert model.metrics == {"Bleu_4": 0.1}
    from PIL import Image

    b = io.BytesIO()
    Image.new("RGB", (40, 30), (100, 50, 25)).save(b, "PNG")
    cap = model.caption(b.getvalue(), beam_size=2, max_len=5)
    assert isinstance(cap, captioner.Caption)


# ----------------------------------------------------------------------------- atomic writes

def _temps(folder):
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


def test_failed_write_keeps_previous_checkpoint(tmp_path, good, tiny, monkeypatch):
    import safetensors.torch as st_torch

    cfg, vocab, model = tiny
    before = good.read_bytes()

    def dies_halfway(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 1000)  # a partial file, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(st_torch, "save_file", dies_halfway)
    with pytest.raises(OSError, match="not enough disk space to write") as e:  # a DiskFullError, an OSError
        save_checkpoint(good, cfg, vocab, model.state_dict(), metrics={"Bleu_4": 0.9})
    assert str(good) in str(e.value) and e.value.errno == 28  # names the file
    assert good.read_bytes() == before
    assert _temps(good.parent) == []  # the partial temp file was removed
    monkeypatch.undo()
    assert load_checkpoint(good).metrics == {"Bleu_4": 0.1}


def test_refuses_to_overwrite_a_good_checkpoint_with_nan_weights(tmp_path, good, tiny):
    cfg, vocab, model = tiny
    before = good.read_bytes()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["decoder.embedding.weight"][0, 0] = float("inf")
    with pytest.raises(CheckpointError, match="refusing to save.*NaN or inf"):
        save_checkpoint(good, cfg, vocab, state)
    assert good.read_bytes() == before
    assert _temps(good.parent) == []


def test_stale_temp_files_of_dead_writers_are_removed(tmp_path, good, tiny):
    cfg, vocab, model = tiny
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a pid whose process has exited
    stale = tmp_path / f".good.safetensors.tmp{dead}"
    stale.write_bytes(b"garbage from a writer killed mid-save")
    live = tmp_path / f".good.safetensors.tmp{os.getppid()}"  # a running process: not ours to delete
    live.write_bytes(b"in progress")
    other = tmp_path / ".other.safetensors.tmp1"
    other.write_bytes(b"another file's temp")
    save_checkpoint(good, cfg, vocab, model.state_dict())
    assert not stale.exists()
    assert live.exists() and other.exists()
    assert load_checkpoint(good).vocab.itos == vocab.itos


@pytest.mark.slow
def test_reader_sees_old_or_new_file_never_half(tmp_path, tiny):
    """Save many times while reading: every read is a complete checkpoint."""
    cfg, vocab, model = tiny
    path = tmp_path / "last.safetensors"
    save_checkpoint(path, cfg, vocab, model.state_dict(), metrics={"i": -1})
    code = (
        "import sys, torch\n"
        "from captioner.checkpoint import load_checkpoint\n"
        "seen = set()\n"
        "for _ in range(40):\n"
        "    seen.add(load_checkpoint(sys.argv[1]).metrics['i'])\n"
        "print(len(seen))\n"
    )
    reader = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    i = 0
    while reader.poll() is None and i < 200:
        save_checkpoint(path, cfg, vocab, model.state_dict(), metrics={"i": i})
        i += 1
    out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err[-2000:]
    assert _temps(tmp_path) == []


def test_resnet_files_hold_each_weight_once_and_old_alias_files_load(tmp_path):
    """A ResNet model registers its body once (safetensors refused the shared `_features` alias); a file
    that still carries the old alias loads when it repeats the weights and is refused when it does not."""
    from captioner.checkpoint import load_checkpoint, save_checkpoint, write_safetensors
    from captioner.config import Config, ModelConfig
    from captioner.model.show_attend_tell import build_model
    from captioner.vocab import Vocab

    cfg = Config(model=ModelConfig(encoder="resnet101", pretrained=False, grid_size=2, hidden_dim=16,
                                   embed_dim=8, attention_dim=8))
    vocab = Vocab.build(["a dog runs"], 1)
    state = build_model(cfg.model, len(vocab), pretrained=False).state_dict()
    assert not any("_features" in k for k in state)
    save_checkpoint(tmp_path / "new.safetensors", cfg, vocab, state)
    assert set(load_checkpoint(tmp_path / "new.safetensors").model_state) == set(state)
    old = {**{k: v.clone() for k, v in state.items()},
           **{k.replace("encoder.backbone.", "encoder._features."): v.clone()
              for k, v in state.items() if k.startswith("encoder.backbone.")}}
    meta = {"format": "captioner-checkpoint/1", "config": __import__("json").dumps(cfg.to_dict()),
            "vocab": vocab.to_json(), "metrics": "{}"}
    write_safetensors(tmp_path / "old.safetensors", old, meta)
    loaded = load_checkpoint(tmp_path / "old.safetensors").model_state
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)
    old["encoder._features.0.weight"] = old["encoder._features.0.weight"] + 1
    write_safetensors(tmp_path / "bad.safetensors", old, meta)
    with pytest.raises(CheckpointError, match="encoder._features.0.weight and encoder.backbone.0.weight"):
        load_checkpoint(tmp_path / "bad.safetensors")
