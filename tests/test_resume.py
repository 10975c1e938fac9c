"""Resuming a run with another command: safe changes (more epochs, a new learning rate ...) are applied
with one logged line each, and a finished run can be extended; changes to the model, the data or the
vocabulary are refused with the differing keys named. scripts/train.py on 8 real photos (configs/tiny.yaml)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from captioner.checkpoint import load_checkpoint
from captioner.config import load_config
from captioner.logs import read_jsonl
from captioner.training.resume import config_changes

from .conftest import need_bundled, need_flickr, run


def test_config_changes_sorts_safe_from_unsafe():
    stored = load_config("configs/tiny.yaml")
    cmd = load_config("configs/tiny.yaml", ["data.limit=12", "train.lr=1", "train.epochs=3", "decode.beam_size=5",
                                            "model.hidden_dim=256", "data.root=" + str(Path("../shared/data/flickr8k")
                                                                                      .resolve())])
    safe, unsafe = config_changes(stored, cmd)
    assert safe == {"train.lr": (3e-3, 1.0), "train.epochs": (2, 3), "decode.beam_size": (3, 5)}
    assert unsafe == {"data.limit": (8, 12), "model.hidden_dim": (128, 256)}  # the same folder by another path is no change


def test_the_refusal_says_what_each_changed_setting_fixes():
    """A changed ema_decay or accumulate is refused with what it really fixes, not as a change of the model or data."""
    from captioner.training.resume import check_resume

    stored = load_config("configs/tiny.yaml")
    cmd = load_config("configs/tiny.yaml", ["train.ema_decay=0.99", "train.accumulate=2", "model.hidden_dim=256"])
    with pytest.raises(ValueError) as refused:
        check_resume(stored, cmd, "runs/x/last.safetensors", lambda _: None)
    said = str(refused.value)
    assert "train.ema_decay: 0.0 (stored) vs 0.99 (this command), it fixes the weights' average" in said
    assert "train.accumulate: 1 (stored) vs 2 (this command), it fixes which photos make each step" in said
    assert "model.hidden_dim: 128 (stored) vs 256 (this command), it fixes the model" in said
    assert "change the model, the data or the vocabulary" not in said and "\n" not in said


def test_the_epoch_tally_adds_averages_resets_and_reads_a_flat_checkpoint():
    """TrainState.tally holds the epoch's sums: a step adds to it, validation reads its averages, reset empties it
    whole; a checkpoint from before the tally (its fields flat, epoch_sums ...) resumes with the same averages."""
    import json

    from captioner.training.objectives import Terms
    from captioner.training.run import StepTally, TrainState

    state = TrainState()
    state.tally.add(Terms(torch.tensor(2.0), 10, {"xent": 2.0, "att": 0.5}, counts={"xent": 10, "att": 2}), 1)
    state.tally.add(Terms(torch.tensor(1.0), 30, {"xent": 1.0, "att": 0.1}, counts={"xent": 30, "att": 6}), 2)
    state.tally.seconds = 3.0
    means = {"xent": (20 + 30) / 40, "att": (1.0 + 0.6) / 8, "seconds": 3.0, "batches": 3}
    assert state.tally.averages() == pytest.approx(means)
    saved = json.loads(json.dumps(state.to_dict()))  # what a checkpoint holds
    assert TrainState.from_dict(saved) == state
    flat = {k: v for k, v in saved.items() if k != "tally"}
    flat.update({f"epoch_{k}": v for k, v in saved["tally"].items()}, epoch_stats=means)
    assert TrainState.from_dict(flat) == state
    state.tally.reset()
    assert state.tally == StepTally() and state.tally.averages() == {"seconds": 0.0, "batches": 0}


def test_the_starting_file_is_read_once_per_run(monkeypatch):
    """train.init_from is read where the run starts, and what reads it later (the new words, validation's decode
    settings and detectors) is handed that reading; a resumed run reads it only where it needs it."""
    import captioner.training.as_exported as as_exported
    import captioner.training.run as run_module
    from captioner.config import Config

    reads = []
    monkeypatch.setattr(run_module, "load_checkpoint", lambda path: reads.append(path) or f"file {path}")
    cfg = Config()
    cfg.train.init_from = "start.safetensors"
    assert run_module.start_file_of(cfg, resuming=False) == "file start.safetensors" and len(reads) == 1
    assert run_module.start_file_of(cfg, resuming=True) is None and len(reads) == 1  # nothing of it is needed
    cfg.train.extend_vocab = True
    assert run_module.start_file_of(cfg, resuming=True) == "file start.safetensors" and len(reads) == 2
    held = load_checkpoint(need_bundled())  # validation's decode settings and detectors from the run's reading
    monkeypatch.setattr(as_exported, "load_checkpoint", lambda path: pytest.fail(f"{path} read again"))
    monkeypatch.setattr(as_exported, "taught_from", lambda c: Path(c.train.init_from))
    cfg.train.init_encoder = True
    assert as_exported.exported_decode(cfg, held) == held.config.decode
    assert as_exported.export_detectors(cfg, held)[1] == held.config.decode.person_floor


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> list[str]:
    """A tiny run trained for one epoch; returns its train.py command (without --set extras)."""
    flickr = need_flickr()
    tmp = tmp_path_factory.mktemp("resume")
    cmd = ["scripts/train.py", "--config", "configs/tiny.yaml", "--no-progress", "--set", f"data.root={flickr}",
           f"data.cache_dir={tmp / 'cache'}", f"train.out_dir={tmp / 'run'}"]
    out = run(*cmd, "train.epochs=1")
    assert "epoch 1:" in out.stdout
    return cmd


def _state(cmd: list[str]) -> dict:
    return load_checkpoint(Path(cmd[-1].split("=", 1)[1]) / "last.safetensors").train_state


@pytest.mark.slow
def test_unsafe_changes_are_refused_with_the_keys_named(finished_run):
    before = _state(finished_run)["state"]["step"]
    out = run(*finished_run, "data.limit=12", "train.lr=1", "train.epochs=3", ok=False)  # a rerun with changes
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "cannot resume" in out.stderr and "data.limit: 8 (stored) vs 12 (this command)" in out.stderr
    assert "train.lr" not in out.stderr and "epoch 2:" not in out.stdout  # safe keys are not the problem
    wider = run(*finished_run, "train.epochs=1", "model.hidden_dim=256", ok=False)
    assert wider.returncode == 2 and "model.hidden_dim: 128 (stored) vs 256 (this command)" in wider.stderr
    assert "another encoder or vocabulary" not in wider.stderr
    assert _state(finished_run)["state"]["step"] == before  # nothing was trained or overwritten


@pytest.mark.slow
def test_a_finished_run_is_extended_with_the_new_learning_rate(finished_run):
    out_dir = Path(finished_run[-1].split("=", 1)[1])
    same = run(*finished_run, "train.epochs=1")
    assert "already finished" in same.stdout and "raise train.epochs to train longer" in same.stdout
    longer = run(*finished_run, "train.epochs=2", "train.lr=1e-3")
    assert "resume: train.epochs 1 -> 2 (changed by this command; applied)" in longer.stdout
    assert "resume: train.lr 0.003 -> 0.001" in longer.stdout
    assert "continuing a finished run: 1 epoch(s) done" in longer.stdout and "epoch 2:" in longer.stdout
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows if r["kind"] == "val"] == [1, 2]
    assert {r["lr"] for r in rows if r["kind"] == "train" and r["epoch"] > 1} == {1e-3}  # the new rate, applied
    st = _state(finished_run)["state"]
    assert st["epoch"] == 2 and st["finished"]
    again = run(*finished_run, "train.epochs=2", "train.lr=1e-3")
    assert "already finished" in again.stdout and "2 of train.epochs=2 done" in again.stdout


@pytest.mark.slow
def test_the_run_folder_holds_its_resolved_config(finished_run):
    import yaml

    out_dir = Path(finished_run[-1].split("=", 1)[1])
    written = yaml.safe_load((out_dir / "config.yaml").read_text())
    assert written == load_checkpoint(out_dir / "last.safetensors").config.to_dict()  # every key, defaults too
    assert written["train"]["out_dir"] == str(out_dir) and written["data"]["limit"] == 8


@pytest.mark.slow
def test_a_resume_with_another_number_of_processes_is_refused(finished_run):
    """A run's batches are sharded by process and every process saved its random states: resuming with another
    count would replay batches and draw other samples, so it is refused before any data is read."""
    from captioner.training.run import TrainingError, build_run

    cfg = load_config("configs/tiny.yaml", finished_run[finished_run.index("--set") + 1:])
    with pytest.raises(TrainingError, match=r"saved by 1 process\(es\) and this command runs 2: .*nproc_per_node=1"):
        build_run(cfg, world_size=2, log=lambda _: None)


OLD = Path(__file__).resolve().parent / "fixtures" / "old_resume"  # made with commit 6c5de00: its make_fixture.py
TIMINGS = ("time", "seconds", "epoch_seconds", "captions_per_s", "images_per_s")


def _old_last(name: str, out: Path, cache: Path) -> None:
    """The fixture's stopped last.safetensors as that run left it: its encoder (the frozen pretrained one, left out
    of the fixture) put back, its paths this machine's; and the lines the stopped run had logged."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from captioner.model.show_attend_tell import build_model

    with safe_open(OLD / f"{name}.safetensors", "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    config = json.loads(meta["config"])
    config["data"].update(root=str(need_flickr()), cache_dir=str(cache))
    config["train"]["out_dir"] = str(out)
    meta["config"] = json.dumps(config)
    stored = load_checkpoint(OLD / f"{name}.safetensors")  # (its missing encoder is only read by load_model_state)
    encoder = build_model(stored.config.model, len(stored.vocab)).state_dict()
    tensors.update({k: v for k, v in encoder.items() if k.startswith("encoder.")})
    out.mkdir(parents=True)
    save_file(tensors, out / "last.safetensors", metadata=meta)
    records = json.loads((OLD / "records.json").read_text())[name]["logged"]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "kind"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["owed", "not_owed", "epoch_end_owed"])
def test_a_checkpoint_that_stored_whether_a_validation_was_owed_resumes_to_the_same_log(tmp_path, name):
    """last.safetensors files written while TrainState stored `validating` (tests/fixtures/old_resume: stopped during
    step 2 with its validation inside epoch 1 owed, or during step 3 after it, or killed during the validation of the
    run's end, epoch 2's end at step 6, saved before it) resume as that code resumed them: the owed validation runs
    first where one is owed, and the whole log (every step's terms and rate, every validation's position and scores)
    is the uninterrupted run's, which that code logged too."""
    from captioner.training.engine import fit

    records = json.loads((OLD / "records.json").read_text())
    state = records[name]["state"]
    assert state["validating"] == (name != "not_owed")  # what the fixture holds
    if name == "epoch_end_owed":  # owed at an epoch's end, not inside one
        assert (state["epoch"], state["batch_in_epoch"], state["step"]) == (2, 0, 6)
    out = tmp_path / name
    _old_last(name, out, tmp_path / "cache")
    cfg = load_config("configs/tiny.yaml", [f"data.root={need_flickr()}", f"data.cache_dir={tmp_path / 'cache'}",
                                            f"train.out_dir={out}", *records["settings"]])
    final = fit(cfg, log=lambda _: None, progress=False)
    logged = [{k: v for k, v in r.items() if k not in TIMINGS} for r in read_jsonl(out / "metrics.jsonl")]
    assert [(r["kind"], r["step"]) for r in logged] == [(r["kind"], r["step"]) for r in records["reference"]]
    for got, want in zip(logged, records["reference"]):  # (the same numbers: approx only for another machine's sums)
        assert got.pop("kind") == want["kind"] and got == pytest.approx(_numbers(want), rel=1e-5), got["step"]
    assert final["step"] == 6 and final["finished"] and final["epoch"] == 2
