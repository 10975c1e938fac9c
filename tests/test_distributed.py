"""DistributedDataParallel on CPU: torchrun, gloo backend, 2 processes. Without its feature cache a multi-process
run is refused before the process group starts (no rank waits on a barrier while another builds it); after
captioner-prepare it trains with parameters identical across ranks."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import captioner

from .conftest import ENV, ROOT, free_port, need_flickr

# the code of this project a traceback can run through: the package (wherever it is imported from) and the scripts
OURS = (Path(captioner.__file__).resolve().parent, (ROOT / "scripts").resolve())
FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line \d+')


def our_frames(stderr: str) -> list[str]:
    """The traceback `File "..."` lines of `stderr` that run through this project's own code (OURS), told by where
    the file lies, not by a word in its path: a checkout or environment under a folder named captioner-main holds
    torch's launcher too (<checkout>/.venv/lib/.../torch/...), and its frames are not ours."""
    frames = []
    for line in stderr.splitlines():
        m = FRAME.match(line)
        if m and any(Path(m["path"]).resolve().is_relative_to(root) for root in OURS):
            frames.append(line)
    return frames


def test_our_frames_are_told_by_where_the_file_lies_not_by_a_word_in_its_path(tmp_path):
    package = OURS[0]
    ours = f'  File "{package / "training" / "engine.py"}", line 12, in fit'
    script = f'  File "{ROOT / "scripts" / "train.py"}", line 3, in <module>'
    theirs = ['  File "/home/u/captioner-main/.venv/lib/python3.11/site-packages/torch/x.py", line 5, in run',
              '  File "/home/u/captioner/.venv/lib/python3.11/site-packages/torch/distributed/run.py", line 9, in main',
              f'  File "{tmp_path / "captioner" / "captioner" / "api.py"}", line 1, in load']  # another copy's
    assert our_frames("\n".join([*theirs, ours, "Traceback (most recent call last):", script])) == [ours, script]
    assert our_frames("\n".join(theirs)) == []


def test_a_refusal_before_the_group_starts_is_said_once_and_is_torchruns_root_cause(tmp_path, monkeypatch, capsys):
    """Every rank reaches the refusal; rank 0 alone prints its line and writes it to the error file torchrun gives
    it, which torchrun's failure report then shows as the root cause (read here by torch's own ProcessFailure).
    The other ranks pause before they exit: torchrun stops the group at the first exit, which must be rank 0's."""
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from captioner.cli.train import LEAVE_AFTER_RANK0_S, _refused

    files, paused = {rank: tmp_path / f"error{rank}.json" for rank in (0, 1)}, {}
    for rank, file in files.items():
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(file))
        monkeypatch.setattr(time, "sleep", lambda s, rank=rank: paused.setdefault(rank, s))
        assert _refused(rank, "saved by 1 process(es) and this command runs 2") is None
    assert capsys.readouterr().err == "error: saved by 1 process(es) and this command runs 2\n"
    assert not files[1].exists() and paused == {1: LEAVE_AFTER_RANK0_S} and LEAVE_AFTER_RANK0_S >= 5
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(files[0]))
    report = ChildFailedError("scripts/train.py", {0: failure}).format_msg()
    assert "traceback : error: saved by 1 process(es) and this command runs 2" in report


@pytest.mark.slow
def test_torchrun_without_a_cache_is_refused_then_two_cpu_ranks_stay_in_sync(tmp_path):
    flickr = need_flickr()
    settings = [f"data.root={flickr}", f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={tmp_path / 'run'}",
                "train.epochs=2", "train.batch_images=2", "train.val_limit=2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "scripts/train.py", "--config", "configs/tiny.yaml", "--device", "cpu", "--no-progress", "--set", *settings]
    t = time.time()
    refused = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and time.time() - t < 120, refused.stderr[-3000:]
    said = [x for x in refused.stderr.splitlines() if x.startswith("error:")]
    # rank 0 says it, not every rank, and before torchrun stops the group
    assert len(said) == 1 and "torchrun needs the feature caches first" in said[0], refused.stderr[-3000:]
    assert f"traceback : {said[0]}" in refused.stderr  # torchrun's own report names it as the root cause
    assert "captioner-prepare" in refused.stderr
    assert "Timeout" not in refused.stderr and not (tmp_path / "run").exists()
    prepare = [sys.executable, "scripts/prepare.py", "--config", "configs/tiny.yaml", "--no-progress",
               "--set", *settings]
    assert subprocess.run(prepare, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300).returncode == 0
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # 8 images / 2 per batch = 4 batches per epoch, 2 per rank
    assert "2 batches/epoch/rank" in proc.stdout
    assert "parameters identical across 2 ranks after step 2" in proc.stdout
    assert "parameters identical across 2 ranks after step 4" in proc.stdout
    assert (tmp_path / "run" / "best.safetensors").is_file()


@pytest.mark.slow
def test_torchrun_ctrl_c_stops_every_rank_at_one_step_and_resumes_to_the_same_numbers(tmp_path):
    """Ctrl-C reaches every process of the group: each rank finishes the same step (they agree on it), rank 0 saves
    it with both ranks' random states, every rank exits 130 without a traceback of ours, and the rerun logs what
    an uninterrupted two-process run logs (dropout on)."""
    import os
    import signal

    from captioner.checkpoint import load_checkpoint
    from captioner.logs import read_jsonl

    flickr = need_flickr()
    base = [f"data.root={flickr}", f"data.cache_dir={tmp_path / 'cache'}", "data.limit=40", "train.batch_images=2",
            "train.epochs=1", "train.val_limit=2", "train.log_every=1", "model.dropout=0.5"]
    prepare = [sys.executable, "scripts/prepare.py", "--config", "configs/tiny.yaml", "--no-progress", "--set", *base]
    assert subprocess.run(prepare, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300).returncode == 0

    def torchrun(out: str, port: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                "scripts/train.py", "--config", "configs/tiny.yaml", "--device", "cpu", "--no-progress", "--set", *base,
                f"train.out_dir={tmp_path / out}"]

    ref = subprocess.run(torchrun("reference", free_port()), cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=600)
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]
    p = subprocess.Popen(torchrun("stopped", free_port()), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = tmp_path / "stopped" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.is_file() and len(read_jsonl(metrics)) >= 3):
        assert p.poll() is None and time.time() < deadline, "the run ended before it could be stopped"
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    out, err = p.communicate(timeout=120)
    assert err.count("SIGINT: stopped at epoch 1, step") == 1 and "Rerun the same command to resume" in err
    assert our_frames(err) == []  # no traceback of ours (torch's launcher may print its own)
    saved = load_checkpoint(tmp_path / "stopped" / "last.safetensors").train_state
    assert len(saved["rng"]) == 2 and 0 < saved["state"]["batch_in_epoch"] < 10
    again = subprocess.run(torchrun("stopped", free_port()), cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]

    def logged(run: str) -> list[tuple]:
        return [(r["kind"], r["step"], r.get("xent"), r.get("val_loss")) for r in read_jsonl(tmp_path / run / "metrics.jsonl")]

    assert logged("stopped") == logged("reference")


def test_the_refusal_without_a_cache_is_said_by_rank_0_alone(monkeypatch, capsys):
    """Every rank refuses (exit 2, no process group) but only rank 0 prints why: one line, not one per rank."""
    import argparse

    import captioner.cli.train
    import captioner.training.sources
    from captioner.cli.train import _processes
    from captioner.config import Config

    monkeypatch.setattr(captioner.training.sources, "missing_caches", lambda cfg: ["flickr8k_train_x"])
    monkeypatch.setattr(captioner.cli.train, "LEAVE_AFTER_RANK0_S", 0.0)  # the pause torchrun cuts short
    args = argparse.Namespace(device="cpu", set=["train.lr=1e-3"], config="configs/tiny.yaml")
    said = []
    for rank in ("0", "1"):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        assert _processes(Config(), args) is None
        said.append(capsys.readouterr().err)
    assert "torchrun needs the feature caches first" in said[0] and "flickr8k_train_x" in said[0] and said[1] == ""


def test_a_resume_with_another_process_count_is_refused_by_rank_0_alone(tmp_path, monkeypatch, capsys):
    """A run saved by one process, resumed by torchrun with two: every rank refuses before the process group starts
    (exit 2), reading only the checkpoint's header, and rank 0 alone says why in one line."""
    import argparse
    import json

    import torch

    import captioner.cli.train
    import captioner.training.sources
    from captioner.checkpoint import write_safetensors
    from captioner.cli.train import _processes
    from captioner.config import Config

    monkeypatch.setattr(captioner.training.sources, "missing_caches", lambda cfg: [])
    monkeypatch.setattr(captioner.cli.train, "LEAVE_AFTER_RANK0_S", 0.0)  # the pause torchrun cuts short
    cfg = Config()
    cfg.train.out_dir = str(tmp_path)
    write_safetensors(tmp_path / "last.safetensors", {"w": torch.zeros(1)},
                      {"train_state": json.dumps({"state": {}, "rng": [{}]})})
    args = argparse.Namespace(device="cpu", set=[], config="configs/tiny.yaml")
    said = []
    for rank in ("0", "1"):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        assert _processes(cfg, args) is None
        said.append(capsys.readouterr().err)
    assert said[0].count("\n") == 1 and "saved by 1 process(es) and this command runs 2" in said[0]
    assert "--nproc_per_node=1" in said[0] and said[1] == ""
