"""Every encoder choice trains (cached features and the encoder in the loop), saves, resumes, exports,
loads through `captioner.load` and captions a real photo. Weights are not downloaded: random ResNets
(model.pretrained=false) at tiny sizes, so their features exceed float16's range (the cache widens)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import captioner
from captioner.training import engine
from captioner.checkpoint import load_checkpoint
from captioner.cli import export as export_cli
from captioner.cli import train as train_cli
from captioner.config import ENCODERS

pytestmark = pytest.mark.slow


def _train_args(encoder: str, flickr: Path, tmp: Path, out: str, *extra: str) -> list[str]:
    return ["--config", "configs/tiny.yaml", "--no-progress", "--set", f"model.encoder={encoder}",
            "model.pretrained=false", "model.image_size=64", "model.grid_size=2", "model.hidden_dim=32",
            "model.embed_dim=16", "model.attention_dim=16", "data.limit=4", f"data.root={flickr}",
            f"data.cache_dir={tmp / 'cache'}", f"train.out_dir={tmp / out}", "train.batch_images=2",
            "train.epochs=1", "train.checkpoint_every=1", "train.val_limit=2", "decode.max_len=5", *extra]


def _interrupted_then_resumed(args: list[str], monkeypatch, capsys) -> str:
    """Train, interrupted (KeyboardInterrupt) at the second step; the same command again resumes."""
    real, calls = engine.train_step, []

    def interrupt_second(*a, **k):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(engine, "train_step", interrupt_second)
        with pytest.raises(KeyboardInterrupt):
            train_cli.main(args)
    capsys.readouterr()
    assert train_cli.main(args) == 0
    return capsys.readouterr().out


def _export_load_caption(run: Path, tmp: Path, photo: Path, half: bool) -> captioner.api.Captioner:
    out = tmp / f"{run.name}{'-half' if half else ''}.safetensors"
    assert export_cli.main([str(run / "best.safetensors"), str(out), *(["--half"] if half else [])]) == 0
    model = captioner.load(out)
    cap = model.caption(photo, beam_size=2)  # two steps of training: the caption may well be empty
    assert cap.alphas.shape == (len(cap.words), 2, 2) and torch.isfinite(torch.tensor(cap.log_prob))
    assert all(w in model.vocab.stoi for w in cap.words)
    exp = model.explain(photo, "a dog runs on the grass")  # every word's map over the 2 x 2 grid sums to 1
    assert exp.alphas.shape == (6, 2, 2)
    assert torch.allclose(torch.as_tensor(exp.alphas).sum((1, 2)).float(), torch.ones(6), atol=1e-4)
    return model


@pytest.mark.parametrize("encoder", ENCODERS)
def test_encoder_trains_saves_resumes_exports_and_captions(encoder, flickr, tmp_path, monkeypatch, capsys,
                                                             one_torch_thread):
    photo = sorted((flickr / "Images").glob("*.jpg"))[0]
    # 1. cached features: interrupted mid-epoch, resumed by the same command, exported (fp32 and --half)
    cached = _train_args(encoder, flickr, tmp_path, "cached")
    out = _interrupted_then_resumed(cached, monkeypatch, capsys)
    assert "resuming from" in out and "epoch 1, batch 1, step 1" in out, out
    last = load_checkpoint(tmp_path / "cached" / "last.safetensors")
    assert last.train_state["state"]["finished"] and last.train_state["state"]["step"] == 2
    assert not any(k.startswith("encoder._features.") for k in last.model_state)  # each module saved once
    for half in (False, True):
        _export_load_caption(tmp_path / "cached", tmp_path, photo, half)

    # 2. the encoder in the loop (model.fine_tune_encoder): its weights change, save, export, load, caption
    loop = _train_args(encoder, flickr, tmp_path, "loop", "model.fine_tune_encoder=true")
    assert train_cli.main(loop) == 0
    trained = load_checkpoint(tmp_path / "loop" / "last.safetensors").model_state
    fresh = load_checkpoint(tmp_path / "cached" / "last.safetensors").model_state  # same seed, frozen encoder
    tuned = [k for k in trained if k.startswith("encoder.") and trained[k].is_floating_point()
             and not torch.equal(trained[k], fresh[k])]
    assert tuned, "fine_tune_encoder=true should change encoder weights"
    model = _export_load_caption(tmp_path / "loop", tmp_path, photo, half=True)
    assert model.model.encoder.name == encoder


def test_coco_resnet101_recipe_smoke_run_on_coco_mini(coco_mini, tmp_path, capsys, one_torch_thread):
    """The mission's GPU recipe, as written (ResNet-101, 448 px, 14 x 14 grid, 1800-unit LSTM, lambda = 1),
    on the CPU with random encoder weights: a few steps on coco-mini, then export --half, load, caption."""
    ann = coco_mini / "annotations" / "captions_train2017.json"
    args = ["--config", "configs/coco_resnet101.yaml", "--no-progress", "--set", "model.pretrained=false",
            "data.dataset=coco", f"data.images={coco_mini / 'train2017'}", f"data.annotations={ann}",
            f"data.val_annotations={ann}", "data.limit=4", "data.num_workers=0", f"data.cache_dir={tmp_path / 'c'}",
            f"train.out_dir={tmp_path / 'run'}", "train.batch_images=2", "train.max_steps=2", "train.val_limit=2",
            "decode.max_len=5"]
    assert train_cli.main(args) == 0
    out = capsys.readouterr().out
    assert "reached train.max_steps=2" in out and "resnet101" in out, out
    ckpt = load_checkpoint(tmp_path / "run" / "best.safetensors")
    assert (ckpt.config.model.grid_size, ckpt.config.model.hidden_dim, ckpt.config.model.image_size) == (14, 1800, 448)
    photo = sorted((coco_mini / "train2017").glob("*.jpg"))[0]
    out_file = tmp_path / "coco.safetensors"
    assert export_cli.main([str(tmp_path / "run" / "best.safetensors"), str(out_file), "--half"]) == 0
    model = captioner.load(out_file)
    cap = model.caption(photo)
    assert cap.alphas.shape == (len(cap.words), 14, 14) and model.model.encoder.name == "resnet101"
