"""Stopping and resuming a run exactly: Ctrl-C / SIGTERM mid-epoch save the exact step, print one line
and exit 130 / 143 without a traceback; the rerun's logged losses equal an uninterrupted run's (dropout 0.5:
every random state is saved); a run that built its feature cache trains on what a later run reads; prepare
leaves no temporary file after SIGTERM, and a start sweeps what a kill -9 left. Real subprocesses
(scripts/train.py, scripts/prepare.py) on a few Flickr8k photos."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from captioner.checkpoint import load_checkpoint
from captioner.config import load_config
from captioner.logs import read_jsonl
from captioner.training.stopping import Interrupted

from .conftest import ROOT, need_flickr

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
SETTINGS = ["model.dropout=0.5", "data.limit=24", "train.batch_images=2", "train.epochs=2", "train.val_limit=4",
            "train.log_every=1", "train.checkpoint_every=5"]
STEPS = 2 * 12


def train_cmd(tmp: Path, out: str, cache: str = "cache", *extra: str) -> list[str]:
    return [sys.executable, "scripts/train.py", "--config", "configs/tiny.yaml", "--no-progress", "--threads", "1",
            "--set", f"data.root={need_flickr()}", f"data.cache_dir={tmp / cache}", f"train.out_dir={tmp / out}",
            *SETTINGS, *extra]


def losses(run_dir: Path) -> list[tuple]:
    """Every logged training step's terms, and every epoch's val loss and scores (no timings)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [(r["step"], r["xent"], r["penalty"], r["grad_norm"]) for r in rows if r["kind"] == "train"]
    val = [(r["epoch"], r["train_xent"], r["val_loss"], r["Bleu_4"], r["CIDEr"]) for r in rows if r["kind"] == "val"]
    return train + val


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run that builds its own cache."""
    tmp = tmp_path_factory.mktemp("stop")
    r = subprocess.run(train_cmd(tmp, "reference"), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert len([x for x in losses(tmp / "reference") if len(x) == 4]) == STEPS
    return tmp


def _stop_mid_epoch(cmd: list[str], out: Path, signum: int) -> tuple[subprocess.CompletedProcess, float, int]:
    """Start the run, send `signum` once it has logged 3 steps of its first epoch -> (result, seconds from the
    signal to the exit, the last step logged before the signal)."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not ((out / "metrics.jsonl").is_file() and len(read_jsonl(out / "metrics.jsonl")) >= 3):
        assert p.poll() is None and time.time() < deadline, "the run ended or stalled before it could be stopped"
        time.sleep(0.005)
    p.send_signal(signum)
    t = time.time()
    stdout, stderr = p.communicate(timeout=60)
    return subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr), time.time() - t, 3


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stopped_run_saves_its_step_and_resumes_to_the_same_numbers(reference, signum, code):
    tmp, out = reference, reference / f"stopped_{signum}"
    r, seconds, _ = _stop_mid_epoch(train_cmd(tmp, out.name), out, signum)
    assert r.returncode == code, r.stdout[-2000:] + r.stderr[-2000:]
    assert seconds < 30 and "Traceback" not in r.stderr
    assert "Rerun the same command to resume" in r.stderr and signal.Signals(signum).name in r.stderr
    state = load_checkpoint(out / "last.safetensors").train_state["state"]
    logged = [x[0] for x in losses(out) if len(x) == 4]
    assert state["step"] == logged[-1] and f"step {state['step']}" in r.stderr  # the exact step, nothing lost
    assert state["epoch"] == 0 and 0 < state["batch_in_epoch"] < 12  # mid-epoch
    again = subprocess.run(train_cmd(tmp, out.name), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "note:" not in again.stdout  # the random states were restored, not reseeded
    assert losses(out) == losses(tmp / "reference")  # every step's loss, grad norm and every epoch's val numbers
    assert tensorboard_steps(out) == tensorboard_steps(tmp / "reference") == list(range(1, STEPS + 1))  # each once


def tensorboard_steps(run_dir: Path) -> list[int]:
    """The steps of train/xent in the run's TensorBoard events as TensorBoard reads them (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [e.step for e in events.Scalars("train/xent")]


@pytest.mark.slow
def test_the_run_that_built_the_cache_equals_one_that_read_it(reference):
    tmp = reference
    r = subprocess.run(train_cmd(tmp, "reader"), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "encoding" not in r.stdout  # it read the reference's cache
    assert losses(tmp / "reader") == losses(tmp / "reference")


def _owed(last, steps_per_epoch: int) -> bool:
    """Whether the stopped run's last.safetensors owes a validation where it stands (derived, never stored)."""
    from captioner.training.run import TrainState, validation_owed

    return validation_owed(last.config.train, 1, TrainState.from_dict(last.train_state["state"]), steps_per_epoch)


STOP_IN_VALIDATION = """
import os, signal, sys
import captioner.training.engine as engine
validate = engine.validate
def stopped_validation(run, stats):  # Ctrl-C arrives while epoch 2 is being validated
    if run.state.epoch == 2:
        os.kill(os.getpid(), signal.SIGINT)
    return validate(run, stats)
engine.validate = stopped_validation
from captioner.cli.train import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_stop_during_validation_resumes_with_that_validation(reference):
    """The epoch's steps are saved before its validation: a stop there loses nothing, and the rerun validates
    that epoch first; the numbers are the uninterrupted run's."""
    tmp, out = reference, reference / "in_validation"
    cmd = train_cmd(tmp, out.name)
    r = subprocess.run([sys.executable, "-c", STOP_IN_VALIDATION, *cmd[2:]], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"stopped at epoch 2, step {STEPS}, with its validation owed" in r.stderr
    last = load_checkpoint(out / "last.safetensors")
    state = last.train_state["state"]
    assert _owed(last, STEPS // 2) and state["step"] == STEPS and not state["finished"]
    again = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "epoch 2:" in again.stdout and "epoch 2 step" not in again.stdout
    assert losses(out) == losses(tmp / "reference")


@pytest.mark.slow
def test_training_logs_eta_lines_and_tensorboard_scalars_without_progress_bars(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = subprocess.run(train_cmd(reference, "watched", "cache", "train.epochs=1", "train.log_every=4"), cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stdout.splitlines() if x.startswith("epoch 1 step")]
    assert [x.split(":")[0] for x in lines] == ["epoch 1 step 4", "epoch 1 step 8", "epoch 1 step 12"]
    assert all("captions/s" in x and "epoch ETA" in x and "run ETA" in x and "attention penalty" in x for x in lines)
    assert "attention penalty = " in r.stdout  # said once what it is
    rows = read_jsonl(reference / "reference" / "metrics.jsonl")
    assert all({"captions_per_s", "grad_norm", "lr"} <= set(r) for r in rows if r["kind"] == "train")
    events = EventAccumulator(str(reference / "reference" / "tensorboard")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/xent", "train/penalty", "train/lr", "train/grad_norm", "train/captions_per_s", "val/val_loss",
            "val/Bleu_4", "val/CIDEr"} <= tags
    assert [e.step for e in events.Scalars("train/xent")] == list(range(1, STEPS + 1))
    assert events.Tags()["tensors"] == ["val/captions/text_summary"]
    assert events.Tags()["images"] == ["val/attention"] and len(events.Images("val/attention")) == 2


@pytest.mark.slow  # it shares the module's reference training run
def test_a_finished_run_writes_its_settings_and_val_metrics_to_the_hparams_tab(reference):
    """Once, when the run ends: every scalar setting of the resolved config and the final and best val metrics,
    in the run's own event folder (one run in TensorBoard, not a second one per call), the metrics as scalars too."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(reference / "reference" / "tensorboard")).Reload()
    content = events.PluginTagToContent("hparams")
    assert set(content) == {"_hparams_/experiment", "_hparams_/session_start_info", "_hparams_/session_end_info"}
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["train.batch_images"].number_value == 2 and start.hparams["model.dropout"].number_value == 0.5
    assert start.hparams["model.encoder"].string_value == "efficientnet_lite0"
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    tags = {m.name.tag for m in experiment.metric_infos}
    assert {"hparam/final/CIDEr", "hparam/best/CIDEr", "hparam/final/val_loss", "hparam/best/epoch"} <= tags
    assert tags <= set(events.Tags()["scalars"])  # the tab shows a metric only where it is a scalar
    val = {r["epoch"]: r for r in read_jsonl(reference / "reference" / "metrics.jsonl") if r["kind"] == "val"}
    best = load_checkpoint(reference / "reference" / "last.safetensors").train_state["state"]["best_position"]
    assert events.Scalars("hparam/final/CIDEr")[-1].value == pytest.approx(val[max(val)]["CIDEr"])
    assert events.Scalars("hparam/best/epoch")[-1].value == best
    assert events.Scalars("hparam/best/Bleu_4")[-1].value == pytest.approx(val[best]["Bleu_4"])


def _prepare(tmp: Path, limit: int) -> list[str]:
    return [sys.executable, "scripts/prepare.py", "--config", "configs/tiny.yaml", "--no-progress", "--set",
            f"data.root={need_flickr()}", f"data.cache_dir={tmp / 'cache'}", f"data.limit={limit}",
            "data.num_workers=0", "--splits", "train"]


def _temps(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.tmp*")) if folder.is_dir() else []


def _start_and_wait_for_a_temp(cmd: list[str], folder: Path) -> subprocess.Popen:
    p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not _temps(folder):
        assert p.poll() is None and time.time() < deadline, "prepare ended before it wrote its cache"
        time.sleep(0.01)
    return p


@pytest.mark.slow
def test_prepare_stopped_leaves_no_temporary_file_and_a_killed_ones_is_swept(tmp_path):
    cache = tmp_path / "cache"
    p = _start_and_wait_for_a_temp(_prepare(tmp_path, 400), cache)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143 and "Traceback" not in err and "SIGTERM" in err, err[-2000:]
    assert _temps(cache) == [] and not list(cache.glob("*.json"))  # nothing half-written, nothing passed off as done
    p = _start_and_wait_for_a_temp(_prepare(tmp_path, 400), cache)
    p.kill()  # kill -9: no handler runs, the temporary file stays ...
    p.communicate(timeout=60)
    assert _temps(cache)
    r = subprocess.run(_prepare(tmp_path, 8), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert _temps(cache) == []  # ... until the next start sweeps it (its writer is gone)
    assert "to encode: 8 photos into 1 cache(s)" in r.stdout and "GiB" in r.stdout


@pytest.mark.slow
def test_a_group_ctrl_c_while_caching_with_workers_prints_one_line(tmp_path):
    """The terminal's Ctrl-C reaches the whole process group, loader workers included: they leave it to the main
    process (no worker traceback, no "DataLoader worker exited unexpectedly"), which says one line and exits 130."""
    cache = tmp_path / "cache"
    cmd = [x if x != "data.num_workers=0" else "data.num_workers=2" for x in _prepare(tmp_path, 400)]
    p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)  # its own group, as a terminal's foreground job
    deadline = time.time() + 120
    while not _temps(cache):
        assert p.poll() is None and time.time() < deadline, "prepare ended before it wrote its cache"
        time.sleep(0.01)
    time.sleep(0.5)  # the workers are reading
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=60)
    lines = [x for x in err.splitlines() if x.strip()]
    assert p.returncode == 130 and len(lines) == 1 and "SIGINT" in lines[0], err[-3000:]
    assert _temps(cache) == []


def test_prepare_refuses_before_encoding_when_the_disk_is_short(tmp_path, monkeypatch, capsys):
    from captioner.cli import prepare
    import captioner.diskspace

    monkeypatch.setattr(captioner.diskspace, "free_bytes", lambda _path: 10 << 20)  # 10 MiB free
    code = prepare.main(_prepare(tmp_path, 400)[2:])
    out = capsys.readouterr()
    assert code == 1 and "not enough disk space for the caches" in out.err and "data.cache_dir" in out.err
    assert _temps(tmp_path / "cache") == [] and not list((tmp_path / "cache").glob("*.npy"))


@pytest.mark.slow
def test_keep_epochs_keeps_the_last_k_epochs_weights(reference):
    out = reference / "kept"
    r = subprocess.run(train_cmd(reference, out.name, "cache", "train.epochs=3", "train.keep_epochs=2",
                                 "train.early_stop_patience=5"), cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    kept = sorted(p.name for p in out.glob("epoch_*.safetensors"))
    assert kept == ["epoch_2.safetensors", "epoch_3.safetensors"]
    assert load_checkpoint(out / "epoch_3.safetensors").metrics["epoch"] == 3


def test_a_stop_raised_where_python_cannot_raise_is_raised_again():
    """A signal handled inside a weakref callback (Python prints "Exception ignored in" and goes on) is not lost:
    the stop is raised again in ordinary code (it once let a SIGTERM-ed prepare finish with exit 0)."""
    import weakref

    from captioner.training.stopping import Interrupted, StopSignal

    class Thing:
        pass

    def callback(_ref) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs here, where its exception cannot propagate

    stopped = None
    try:
        with StopSignal().catch():
            thing = Thing()
            ref = weakref.ref(thing, callback)
            del thing
            for _ in range(200):
                time.sleep(0.01)
    except Interrupted as e:
        stopped = e
    assert ref() is None and stopped is not None and stopped.code == 143
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the command's handlers are undone after it


def test_deferred_requests_wait_for_the_step():
    from captioner.training.stopping import Interrupted, StopSignal

    stop = StopSignal()
    with stop.deferred():
        stop.request(signal.SIGINT)  # recorded, not raised: the step finishes and is saved first
        assert stop.pending() == signal.SIGINT
    with pytest.raises(Interrupted) as e:
        stop.request(signal.SIGTERM)
    assert e.value.code == 143 and stop.pending() == signal.SIGINT  # the first request is the one kept


def _interruptible() -> None:
    """The child starts with Ctrl-C's default action, as from a terminal: a suite run in the background (`pytest &`
    in a script) hands its children SIGINT ignored, and Python then installs no handler of its own."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("delay", [0.3, 1.0])
def test_a_ctrl_c_while_the_command_starts_prints_one_line(tmp_path, delay):
    """A Ctrl-C in the first seconds (torch and the library still importing, the config being read) ends in one
    line and exit 130, not a KeyboardInterrupt traceback: the handler is installed before the heavy imports. (The
    interpreter's own start, ~30 ms before any of our code runs, is the window left; on a loaded machine it can
    take longer, so the signal is not sent sooner than 0.3 s.)"""
    p = subprocess.Popen(train_cmd(tmp_path, "early"), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    lines = [x for x in err.splitlines() if x.strip()]
    assert p.returncode == 130 and len(lines) == 1 and lines[0].startswith("SIGINT: "), err[-3000:]


class StopAfter:
    """A stop request that arrives during step `n` (what Ctrl-C does, without a signal): pending() is asked once
    per step."""

    def __init__(self, n: int):
        from captioner.training.stopping import StopSignal

        self.n, self.inner = n, StopSignal()
        self.deferred, self.request = self.inner.deferred, self.inner.request

    def pending(self, world_size: int = 1, device=None) -> int:
        self.n -= 1
        return signal.SIGINT if self.n == 0 else 0


@pytest.mark.slow
def test_an_augmented_run_with_loader_workers_resumes_to_the_same_numbers(tmp_path):
    """Augmentation (random crop + flip) read by two loader workers: a stopped and resumed epoch sees the same
    crops as an uninterrupted one (they are drawn per (seed, epoch, image), not from a worker's generator), so its
    losses equal the uninterrupted run's. Small images, 8 photos, one epoch of 4 steps."""
    from captioner.config import load_config
    from captioner.training.engine import fit
    from captioner.training.stopping import Interrupted

    def cfg(out: str):
        return load_config("configs/tiny.yaml", [
            f"data.root={need_flickr()}", f"train.out_dir={tmp_path / out}", "data.augment=true", "data.num_workers=2",
            "model.image_size=64", "model.grid_size=2", "model.dropout=0.5", "train.batch_images=2",
            "train.val_limit=2", "train.epochs=1", "train.checkpoint_every=0", "train.tensorboard=false",
            "decode.beam_size=1"])

    quiet = {"log": lambda _: None, "progress": False}
    fit(cfg("reference"), **quiet)
    with pytest.raises(Interrupted):
        fit(cfg("stopped"), stop=StopAfter(3), **quiet)  # mid-epoch: batch 4 goes to another worker on resume
    assert load_checkpoint(tmp_path / "stopped" / "last.safetensors").train_state["state"]["step"] == 3
    fit(cfg("stopped"), **quiet)
    assert losses(tmp_path / "stopped") == losses(tmp_path / "reference")


@pytest.mark.parametrize("patience, stops_after", [(0, None), (2, 3)])
def test_early_stop_patience_zero_trains_every_epoch(tmp_path, patience, stops_after):
    """train.early_stop_patience=0 is off: six epochs that never beat the first do not stop the run (and a finished
    one is not called stopped early); 2 stops it after the second epoch without improvement."""
    from types import SimpleNamespace

    from captioner.config import Config
    from captioner.training.after_validation import after_validation, why_finished
    from captioner.training.run import TrainState

    cfg = Config()
    cfg.train.early_stop_patience, cfg.train.epochs, cfg.train.schedule = patience, 6, "cosine"
    said = []
    run = SimpleNamespace(cfg=cfg, state=TrainState(), place=SimpleNamespace(log=said.append, main=False),
                          val_sets=[SimpleNamespace(records=[None] * 50)], best_path=tmp_path / "best.safetensors",
                          optimizer=SimpleNamespace(param_groups=[{"lr": 1e-3}]))
    stopped = None
    for epoch, value in enumerate([0.5, 0.4, 0.3, 0.3, 0.2, 0.1], start=1):
        run.state.epoch = epoch
        if after_validation(run, value, hit_max=False):
            stopped = epoch
            break
    assert stopped == stops_after and run.state.finished
    assert ("stopped early" in why_finished(run.state, cfg)) == bool(patience)
    assert patience or not any("early stopping" in line for line in said)
    with pytest.raises(ValueError, match="train.early_stop_patience must be >= 0"):
        load_config(None, ["train.early_stop_patience=-1"])


def _keep_best_run(tmp_path, monkeypatch, values: list[float]):
    """after_validation after validations scoring `values` at steps 10, 20 ... with train.keep_best=2 (files written as
    text) -> the run."""
    from types import SimpleNamespace

    import captioner.training.after_validation as after_validation
    from captioner.config import Config
    from captioner.training.run import TrainState

    monkeypatch.setattr(after_validation, "save_checkpoint", lambda path, *a, **k: path.write_text("weights"))
    cfg = Config()
    cfg.train.keep_best, cfg.train.epochs, cfg.train.early_stop_patience = 2, 6, 0
    run = SimpleNamespace(cfg=cfg, state=TrainState(history=[{}]), out=tmp_path, vocab=None,
                          model=SimpleNamespace(state_dict=dict), place=SimpleNamespace(log=lambda _: None, main=True),
                          val_sets=[SimpleNamespace(records=[None] * 50)], best_path=tmp_path / "best.safetensors",
                          optimizer=SimpleNamespace(param_groups=[{"lr": 1e-3}]))
    for epoch, value in enumerate(values, start=1):
        run.state.epoch, run.state.step = epoch, 10 * epoch
        after_validation.after_validation(run, value, hit_max=False)
    return run


def test_keep_best_keeps_the_k_best_validations_files(tmp_path, monkeypatch):
    """train.keep_best=2: best_step<S>.safetensors of the two best val metrics so far, the others deleted; the list
    lives in the train state (a resumed run keeps the same files)."""
    run = _keep_best_run(tmp_path, monkeypatch, [0.2, 0.5, 0.3, 0.1, 0.4])
    assert sorted(p.name for p in tmp_path.glob("best_step*")) == ["best_step20.safetensors", "best_step50.safetensors"]
    assert run.state.kept_best == [[0.5, 20], [0.4, 50]]


def test_on_a_tie_the_best_file_is_one_of_the_kept_ones(tmp_path, monkeypatch):
    """Three validations tie: best.safetensors keeps the first (only a better value replaces it), and keep_best ranks
    ties by the same rule, so the kept files are the first two of them, the best among them."""
    run = _keep_best_run(tmp_path, monkeypatch, [0.2, 0.5, 0.5, 0.1, 0.5])
    assert run.state.best_step == 20
    assert run.state.kept_best == [[0.5, 20], [0.5, 30]]
    assert sorted(p.name for p in tmp_path.glob("best_step*")) == ["best_step20.safetensors", "best_step30.safetensors"]


@pytest.mark.parametrize("every, photos_a_step, photos", [(3, 4, 40), (2000, 16, 113_296), (7, 2, 30)])
def test_validations_an_epoch_are_the_same_on_1_2_and_8_processes(every, photos_a_step, photos):
    """train.val_every_steps counts one process's steps: N processes, whose step reads N batches, validate every
    N-th as many steps, so an epoch holds as many validations on any number of processes (within one: the rounding).
    The COCO recipe's 2000 on 8 GPUs: every 250 steps of 885, as often as every 2000 of 7081 on one."""
    from captioner.config import Config
    from captioner.training.run import TrainState, validation_due

    cfg = Config()
    cfg.train.val_every_steps, cfg.train.epochs = every, 3
    counts = {}
    for world in (1, 2, 8):
        state = TrainState()
        steps = -(-photos // (photos_a_step * world))  # an epoch's optimizer steps on `world` processes
        counts[world] = 0
        for state.step in range(1, steps + 1):  # the first of three epochs: its end is not the run's
            counts[world] += validation_due(cfg.train, world, state, epoch_end=state.step == steps)
    assert max(counts.values()) - min(counts.values()) <= 1 and counts[1] >= 1, counts


@pytest.mark.parametrize("every", [0, 2, 3])
def test_a_validation_is_owed_where_the_rule_falls_until_the_history_records_it(every):
    """validation_owed, walked through a run's positions as the loop leaves them (5 steps an epoch, two epochs,
    max_steps 9): owed exactly where validation_due falls (inside an epoch, never on its last batch, or at an epoch's
    end) and that step is not yet in the history; recording it there settles it, and nothing is owed again until a
    step is taken. The validations it asks for are the ones the rule counts, each once."""
    from captioner.config import Config
    from captioner.training.run import TrainState, validation_due, validation_owed

    cfg, per_epoch = Config(), 5
    cfg.train.val_every_steps, cfg.train.epochs, cfg.train.max_steps = every, 2, 9
    state, validated = TrainState(), []
    assert not validation_owed(cfg.train, 1, state, per_epoch)  # the start: nothing trained
    while state.epoch < cfg.train.epochs and state.step < cfg.train.max_steps:
        state.step, state.batch_in_epoch = state.step + 1, state.batch_in_epoch + 1
        inside = state.batch_in_epoch < per_epoch and state.step < cfg.train.max_steps
        if not inside:  # the loop closes the epoch on its last batch or at train.max_steps
            state.epoch, state.batch_in_epoch = state.epoch + 1, 0
        due = validation_due(cfg.train, 1, state, epoch_end=not inside)
        assert validation_owed(cfg.train, 1, state, per_epoch) == due
        if due:
            state.history.append({"step": state.step})
            validated.append(state.step)
            assert not validation_owed(cfg.train, 1, state, per_epoch)
    assert validated == {0: [5, 9], 2: [2, 4, 6, 8, 9], 3: [3, 6, 9]}[every]
    assert not validation_owed(cfg.train, 1, TrainState(step=4, batch_in_epoch=5), per_epoch)  # the epoch's last batch


STEP_VALIDATION = ["data.limit=20", "train.val_limit=20", "train.batch_images=4", "train.epochs=2", "model.dropout=0.5",
                   "train.lr=1e-2", "train.val_metric=Bleu_1", "train.val_every_steps=3", "train.early_stop_patience=0",
                   "train.keep_best=2", "train.checkpoint_every=0", "decode.beam_size=1"]


def _step_validated(tmp: Path, out: str):
    """configs/tiny.yaml on 20 photos, 5 steps an epoch, two epochs, validated every 3 steps (20 val photos: the
    scores choose), the plateau decay and keep_best reading them."""
    return load_config("configs/tiny.yaml", [f"data.root={need_flickr()}", f"data.cache_dir={tmp / 'cache'}",
                                             f"train.out_dir={tmp / out}", *STEP_VALIDATION])


def _records(run_dir: Path) -> tuple[list[tuple], list[tuple]]:
    """(every logged step's terms and rate, every validation's position, train averages, rate and scores)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [(r["step"], r["epoch"], r["xent"], r["penalty"], r["grad_norm"], r["lr"]) for r in rows
             if r["kind"] == "train"]
    val = [(r["step"], r["epoch"], r["train_xent"], r["train_penalty"], r["lr"], r["val_loss"], r["Bleu_1"],
            r["ROUGE_L"]) for r in rows if r["kind"] == "val"]
    return train, val


def _kept(run_dir: Path) -> dict:
    """The best checkpoint (its weights and record), the kept best files and the final state's choices."""
    best = load_checkpoint(run_dir / "best.safetensors")
    state = load_checkpoint(run_dir / "last.safetensors").train_state["state"]
    return {"best": {k: v.clone() for k, v in best.model_state.items()}, "best_val": best.metrics["val"]["Bleu_1"],
            "best_step": best.metrics["step"], "files": sorted(p.name for p in run_dir.glob("best_step*")),
            "state": {k: state[k] for k in ("best_metric", "best_position", "best_step", "kept_best", "lr", "step")}}


@pytest.fixture(scope="module")
def step_reference(tmp_path_factory) -> Path:
    from captioner.training.engine import fit

    tmp = tmp_path_factory.mktemp("step_val")
    fit(_step_validated(tmp, "reference"), log=lambda _: None, progress=False)
    return tmp


@pytest.mark.slow
def test_validation_every_n_steps_falls_inside_epochs_and_at_the_runs_end(step_reference):
    """train.val_every_steps=3 over 2 epochs of 5 steps: validations at steps 3, 6 and 9 (inside the epochs, their
    records carry the step and the fractional epoch) and at the run's last step 10; epoch 1's end (step 5) is not
    validated. Each record's train averages are those of the steps since the previous validation."""
    train, val = _records(step_reference / "reference")
    assert [(v[0], v[1]) for v in val] == [(3, 0.6), (6, 1.2), (9, 1.8), (10, 2)]
    by_step = {t[0]: t for t in train}
    assert all(by_step[v[0]][1] == v[1] for v in val)  # a step's train and val records say the same epoch
    since = [by_step[s][2] for s in (4, 5, 6)]  # a mean over their tokens lies between their means
    assert min(since) <= val[1][2] <= max(since)
    state = _kept(step_reference / "reference")["state"]
    assert state["step"] == 10 and state["best_step"] in (3, 6, 9, 10) and len(state["kept_best"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("where", ["with its validation owed", "after the validation, before its save",
                                   "the step after a validation"])
def test_a_run_validated_every_n_steps_resumes_to_the_same_numbers_and_best(step_reference, monkeypatch, where):
    """Stopped at step 3 where its validation inside epoch 1 is due, or after that validation ran but before it was
    saved, or at step 4 just after it: the resumed run logs every step's loss and rate, every validation's record,
    and keeps the same best checkpoint (bit for bit) and the same keep_best files as the uninterrupted run."""
    import captioner.training.engine as engine

    tmp, out = step_reference, f"stopped_{where.replace(' ', '_').replace(',', '')}"
    quiet = {"log": lambda _: None, "progress": False}
    if where == "after the validation, before its save":
        stop, real = StopAfter(0), engine.after_validation

        def end_then_stop(run, value, hit_max):
            decided = real(run, value, hit_max)
            if run.state.step == 3:
                stop.inner.request(signal.SIGINT)  # outside a step: raised at once
            return decided

        monkeypatch.setattr(engine, "after_validation", end_then_stop)
    else:
        stop = StopAfter(3 if where == "with its validation owed" else 4)
    with pytest.raises(Interrupted):
        engine.fit(_step_validated(tmp, out), stop=stop, **quiet)
    last = load_checkpoint(tmp / out / "last.safetensors")
    saved, owed = last.train_state["state"], where != "the step after a validation"
    assert (saved["step"], _owed(last, 5)) == ((3, True) if owed else (4, False)) and saved["epoch"] == 0
    monkeypatch.undo()
    engine.fit(_step_validated(tmp, out), **quiet)
    assert _records(tmp / out) == _records(tmp / "reference")
    kept, reference = _kept(tmp / out), _kept(tmp / "reference")
    assert kept["best"].keys() == reference["best"].keys()
    assert all(torch.equal(kept["best"][k], reference["best"][k]) for k in reference["best"])
    assert {k: v for k, v in kept.items() if k != "best"} == {k: v for k, v in reference.items() if k != "best"}
    assert _scalar_steps(tmp / out) == _scalar_steps(tmp / "reference")  # each scalar once a step, as uninterrupted


def _scalar_steps(run_dir: Path) -> dict[str, list[int]]:
    """Every TensorBoard scalar's steps as TensorBoard reads them (its purge marks applied), each tag's steps unique."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    steps = {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert all(len(set(s)) == len(s) for s in steps.values()), {t: s for t, s in steps.items() if len(set(s)) < len(s)}
    return steps


@pytest.mark.slow
def test_a_checkpoint_saved_with_the_counts_named_for_epochs_resumes_to_the_same_numbers(step_reference):
    """A last.safetensors whose train state still says bad_epochs and best_epoch (the layout before the counts were
    named for validations: bad_validations, best_position) resumes as today's does: the same records and best."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    import captioner.training.engine as engine
    from captioner.training.run import RENAMED

    tmp, out = step_reference, "stopped_old_layout"
    with pytest.raises(Interrupted):
        engine.fit(_step_validated(tmp, out), stop=StopAfter(4), log=lambda _: None, progress=False)
    last = tmp / out / "last.safetensors"
    with safe_open(str(last), framework="pt") as f:
        meta = dict(f.metadata())
    state = json.loads(meta["train_state"])
    old = {v: k for k, v in RENAMED.items()}
    state["state"] = {old.get(k, k): v for k, v in state["state"].items()}
    assert {"bad_epochs", "best_epoch"} <= set(state["state"]) and "bad_validations" not in state["state"]
    save_file(load_file(str(last)), str(last), metadata={**meta, "train_state": json.dumps(state)})
    engine.fit(_step_validated(tmp, out), log=lambda _: None, progress=False)
    assert _records(tmp / out) == _records(tmp / "reference")
    assert _kept(tmp / out)["state"] == _kept(tmp / "reference")["state"]
