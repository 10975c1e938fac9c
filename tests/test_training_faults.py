"""Training survives faults: kill -9 mid-epoch and mid-save, NaN loss, unreadable images in the
dataset, stale feature caches. Real subprocesses running scripts/train.py on a tiny slice of
Flickr8k (12 images, 32-d decoder, 1 thread), small enough that the whole file fits a 2-core CPU's test run."""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from captioner.checkpoint import load_checkpoint
from captioner.logs import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
FLICKR = ROOT.parent / "shared" / "data" / "flickr8k"

pytestmark = pytest.mark.skipif(
    not (FLICKR / "captions.txt").is_file(),
    reason=f"needs the Flickr8k photos at {FLICKR} (captions.txt missing): training-fault tests are skipped")

TINY = ["model.encoder=efficientnet_lite0", "model.image_size=224", "model.grid_size=7", "model.embed_dim=32",
        "model.hidden_dim=32", "model.attention_dim=32", "data.min_word_count=1", "data.limit=12",
        "data.num_workers=0", "train.batch_images=2", "train.checkpoint_every=2", "train.epochs=2",
        "train.val_limit=4", "train.log_every=1"]
STEPS = 2 * 6  # 2 epochs x ceil(12 images / 2 per batch)
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def train_cmd(out: Path, cache: Path, *overrides: str, python: list[str] | None = None) -> list[str]:
    prefix = python or [sys.executable, "scripts/train.py"]
    return [*prefix, "--config", "configs/flickr8k_cpu.yaml", "--no-progress", "--threads", "1", "--set",
            *TINY, f"data.cache_dir={cache}", f"train.out_dir={out}", *overrides]


def run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def state_of(path: Path) -> dict:
    return load_checkpoint(path).train_state["state"]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@contextlib.contextmanager
def killed_on_exit(cmd: list[str], **popen_kwargs):
    """Start cmd; when the block ends, SIGKILL it (the fault under test) and reap it. The process
    never outlives the test, even when the block fails."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, **popen_kwargs)
    try:
        yield p
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for stream in (p.stdout, p.stderr):
            if stream is not None:
                stream.close()


def all_finite(path: Path) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in load_checkpoint(path).model_state.values()
               if v.is_floating_point())


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One uninterrupted reference run; its feature cache is reused by the other runs."""
    base = tmp_path_factory.mktemp("faults")
    cache, ref = base / "cache", base / "reference"
    r = run(train_cmd(ref, cache))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {"base": base, "cache": cache, "ref": ref, "ref_state": state_of(ref / "last.safetensors")}


@pytest.mark.slow
def test_reference_run(shared):
    st = shared["ref_state"]
    assert st["step"] == STEPS and st["epoch"] == 2 and st["finished"]
    assert load_checkpoint(shared["ref"] / "best.safetensors").train_state is None


# ----------------------------------------------------------------------------- (a) + (b) kill -9

def _train_records(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == "train":
            out.append(rec)
    return out


def _logged_past_checkpoint(out: Path) -> bool:
    records = _train_records(out / "metrics.jsonl")
    last = out / "last.safetensors"
    return bool(records) and last.is_file() and records[-1]["step"] > state_of(last)["step"]


def _kill_after_a_checkpoint(cmd: list[str], out: Path, tmp_path: Path) -> None:
    """Run cmd and SIGKILL it once it has logged steps its last checkpoint lacks."""
    with open(tmp_path / "killed.log", "w") as log, \
            killed_on_exit(cmd, stdout=log, stderr=subprocess.STDOUT) as p:
        deadline = time.time() + 180
        while not _logged_past_checkpoint(out):  # the kill lands after steps the checkpoint lacks
            assert p.poll() is None, "the run finished before it could be killed: " + (tmp_path / "killed.log").read_text()
            assert time.time() < deadline, "no checkpoint within 180 s"
            time.sleep(0.02)
    assert p.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_kill_9_mid_epoch_then_resume(shared, tmp_path):
    out = tmp_path / "killed"
    last = out / "last.safetensors"
    _kill_after_a_checkpoint(train_cmd(out, shared["cache"]), out, tmp_path)

    st = state_of(last)  # the checkpoint written before the kill is complete and loads
    assert st["epoch"] == 0 and 0 < st["batch_in_epoch"] < 6 and not st["finished"], st
    assert all_finite(last)

    # (b) a writer killed mid-save leaves a half-written temp file next to the checkpoint:
    # it must neither break the resume nor be mistaken for the checkpoint
    junk = out / f".last.safetensors.tmp{dead_pid()}"
    junk.write_bytes(last.read_bytes()[: last.stat().st_size // 3])
    garbage = out / f".best.safetensors.tmp{dead_pid()}"
    garbage.write_bytes(b"\x00garbage")

    r = run(train_cmd(out, shared["cache"]))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resuming from {last}: epoch 1, batch {st['batch_in_epoch']}, step {st['step']}" in r.stdout
    final = state_of(last)
    assert final["step"] == shared["ref_state"]["step"] == STEPS
    assert final["finished"] and final["epoch"] == 2
    assert [h["epoch"] for h in final["history"]] == [1, 2]
    # the log says each step and epoch once: what the killed run logged after its checkpoint was dropped
    assert [r["step"] for r in _train_records(out / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert [r["epoch"] for r in read_jsonl(out / "metrics.jsonl") if r.get("kind") == "val"] == [1, 2]
    assert not junk.exists() and not garbage.exists()  # stale temps of dead writers are cleaned up
    assert (out / "best.safetensors").is_file()
    # a third run has nothing to do
    r = run(train_cmd(out, shared["cache"]))
    assert r.returncode == 0 and "already finished" in r.stdout


@pytest.mark.slow
def test_self_critical_run_resumes_after_kill_9(shared, tmp_path):
    """SCST from the reference cross-entropy model: killed mid-epoch, resumed, each step logged once,
    validation on CIDEr, the objective recorded in the best model file, the plot drawn."""
    out = tmp_path / "scst"
    scst = ["train.objective=scst", f"train.init_from={shared['ref'] / 'best.safetensors'}", "train.lr=5e-5",
            "train.val_metric=CIDEr", "train.scst_max_len=12"]
    _kill_after_a_checkpoint(train_cmd(out, shared["cache"], *scst), out, tmp_path)
    r = run(train_cmd(out, shared["cache"], *scst))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resuming from" in r.stdout
    final = state_of(out / "last.safetensors")
    assert final["finished"] and final["step"] == STEPS
    train = _train_records(out / "metrics.jsonl")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert all({"reward", "baseline", "penalty", "sample_len"} <= set(r) for r in train)
    val = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("kind") == "val"]
    assert [r["epoch"] for r in val] == [1, 2] and all("CIDEr" in r and "bad_ending" in r for r in val)
    assert load_checkpoint(out / "best.safetensors").metrics["objective"] == "scst"
    assert (out / "training.png").stat().st_size > 0


WRITER = textwrap.dedent("""
    import sys, torch
    from captioner.checkpoint import save_checkpoint
    from captioner.config import Config
    from captioner.vocab import Vocab
    torch.manual_seed(0)
    state = {f"decoder.w{i}": torch.randn(1_000_000) for i in range(12)}  # 48 MB: each save takes a while
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>", "a"])
    i = 0
    while True:
        save_checkpoint(sys.argv[1], Config(), vocab, state, metrics={"i": i}, train_state={"i": i})
        print(i, flush=True)
        i += 1
""")


@pytest.mark.slow
def test_kill_9_while_writing_a_checkpoint(tmp_path):
    """Kill a process at random moments of a save loop: the checkpoint on disk always loads
    (temp file + atomic rename), and leftovers of killed writers are removed by the next save."""
    path = tmp_path / "last.safetensors"
    rng = random.Random(0)
    seen, killed_mid_write = -1, 0
    for attempt in range(20):  # kill at random moments until some kills have landed inside a save
        if attempt >= 4 and killed_mid_write >= 1:
            break
        with killed_on_exit([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) as p:
            first = p.stdout.readline()  # one complete save, then kill during a later one
            assert first.strip().isdigit(), p.stderr.read()
            time.sleep(rng.uniform(0.0, 0.4))
        ck = load_checkpoint(path)
        assert ck.metrics["i"] >= 0 and ck.metrics["i"] == ck.train_state["i"]
        seen = max(seen, ck.metrics["i"])
        killed_mid_write += any(tmp_path.glob(".last.safetensors.tmp*"))
    assert killed_mid_write >= 1, "no kill landed inside a save; the test did not exercise anything"
    # the next writer removes the dead writers' temp files
    from captioner.checkpoint import save_checkpoint
    from captioner.config import Config
    from captioner.vocab import Vocab

    save_checkpoint(path, Config(), Vocab(["<pad>", "<start>", "<end>", "<unk>"]), {"w": torch.zeros(2)})
    assert not list(tmp_path.glob(".last.safetensors.tmp*"))


# ----------------------------------------------------------------------------- (c) NaN

NAN_LOSS = textwrap.dedent("""
    import dataclasses, sys
    import captioner.training.objectives as objectives
    real, calls = objectives.caption_loss, [0]
    def poisoned(*args, **kwargs):  # the loss becomes NaN on the 5th batch
        terms = real(*args, **kwargs)
        calls[0] += 1
        return dataclasses.replace(terms, total=terms.total * float("nan")) if calls[0] >= 5 else terms
    objectives.caption_loss = poisoned
    from captioner.cli.train import main
    sys.exit(main(sys.argv[1:]))
""")

NAN_WEIGHTS = textwrap.dedent("""
    import sys, torch
    real, steps = torch.optim.Adam.step, [0]
    def step(self, *args, **kwargs):  # the 4th update leaves NaN weights behind, right before a checkpoint
        out = real(self, *args, **kwargs)
        steps[0] += 1
        if steps[0] == 4:
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("nan"))
        return out
    torch.optim.Adam.step = step
    from captioner.cli.train import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_nan_loss_stops_with_a_clear_message_and_keeps_the_last_good_checkpoint(shared, tmp_path):
    out = tmp_path / "nan"
    r = run(train_cmd(out, shared["cache"], python=[sys.executable, "-c", NAN_LOSS]))
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "loss became nan at step 4 (epoch 1)" in r.stderr
    assert "last good checkpoint is kept" in r.stderr and "Traceback" not in r.stderr
    last = out / "last.safetensors"
    st = state_of(last)  # the checkpoint of step 4 (checkpoint_every=2), not a half-written or NaN one
    assert st["step"] == 4 and not st["finished"]
    assert all_finite(last)
    assert not (out / "best.safetensors").exists()  # no epoch was completed
    # the same command without the fault resumes from the good checkpoint and finishes
    r = run(train_cmd(out, shared["cache"]))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "resuming from" in r.stdout
    assert state_of(last)["step"] == STEPS


@pytest.mark.slow
def test_nan_loss_from_a_huge_learning_rate(shared, tmp_path):
    """Through configuration only: lr=1e37 blows the weights up after one Adam step."""
    out = tmp_path / "lr"
    r = run(train_cmd(out, shared["cache"], "train.lr=1e37", "train.grad_clip=0"))
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "loss became nan at step 1" in r.stderr and "Try a lower train.lr" in r.stderr
    assert "Traceback" not in r.stderr
    for name in ("last.safetensors", "best.safetensors"):
        if (out / name).exists():
            assert all_finite(out / name)


@pytest.mark.slow
def test_absurd_learning_rate_is_a_clear_error_not_a_traceback(shared, tmp_path):
    r = run(train_cmd(tmp_path / "lr38", shared["cache"], "train.lr=1e38", "train.grad_clip=0"))
    assert r.returncode in (1, 2) and "error:" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr[-1500:]


@pytest.mark.slow
def test_nan_weights_never_overwrite_the_last_good_checkpoint(shared, tmp_path):
    out = tmp_path / "nanw"
    r = run(train_cmd(out, shared["cache"], python=[sys.executable, "-c", NAN_WEIGHTS]))
    assert r.returncode != 0, r.stdout[-2000:]
    assert "NaN" in r.stderr or "nan" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    last = out / "last.safetensors"
    st = state_of(last)
    assert st["step"] == 2  # the step-4 checkpoint (NaN weights) was refused; step 2's is intact
    assert all_finite(last)


# ----------------------------------------------------------------------------- (d) unreadable images

def _mini_flickr(dst: Path, n_train: int = 8, n_val: int = 3) -> tuple[list[str], list[str]]:
    import csv

    caps: dict[str, list[str]] = {}
    with open(FLICKR / "captions.txt", newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        next(reader)
        for row in reader:
            caps.setdefault(row[0], []).append(",".join(row[1:]))
    def first(split_file: str, n: int) -> list[str]:
        names = [s.strip() for s in (FLICKR / split_file).read_text().splitlines() if s.strip()]
        return [s for s in names if s in caps and (FLICKR / "Images" / s).is_file()][:n]
    train, val = first("Flickr_8k.trainImages.txt", n_train), first("Flickr_8k.devImages.txt", n_val)
    (dst / "Images").mkdir(parents=True)
    for name in train + val:
        shutil.copy(FLICKR / "Images" / name, dst / "Images" / name)
    with open(dst / "captions.txt", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["image", "caption"])
        for name in train + val:
            for c in caps[name]:
                w.writerow([name, c])
    (dst / "Flickr_8k.trainImages.txt").write_text("\n".join(train) + "\n")
    (dst / "Flickr_8k.devImages.txt").write_text("\n".join(val) + "\n")
    (dst / "Flickr_8k.testImages.txt").write_text(val[0] + "\n")
    return train, val


@pytest.mark.slow
def test_unreadable_images_are_reported_by_name_and_skipped(tmp_path):
    root = tmp_path / "flickr"
    train, val = _mini_flickr(root)
    corrupt, deleted, bad_val = train[2], train[5], val[1]
    p = root / "Images" / corrupt
    p.write_bytes(p.read_bytes()[:2000])  # a truncated JPEG
    (root / "Images" / deleted).unlink()
    (root / "Images" / bad_val).write_bytes(b"this is not a jpeg")
    out = tmp_path / "run"
    r = run(train_cmd(out, tmp_path / "cache", f"data.root={root}", "data.limit=0", "train.epochs=1",
                      "train.val_limit=0"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = r.stdout + r.stderr
    assert "2 image(s) could not be read" in text and corrupt in text and deleted in text
    assert "1 image(s) could not be read" in text and bad_val in text
    assert "skipping 2 unreadable training image(s)" in text
    assert "training on cpu: 6 images" in text
    st = state_of(out / "last.safetensors")
    assert st["finished"] and st["step"] == 3  # 6 readable images / 2 per batch
    assert st["history"][-1]["n_images"] == 2  # validated on the 2 readable val images


# ----------------------------------------------------------------------------- (e) stale feature cache

@pytest.mark.slow
def test_feature_cache_from_another_grid_is_detected_and_rebuilt(shared, tmp_path):
    cache = shared["cache"]
    g7 = sorted(cache.glob("*-g7.npy"))
    assert len(g7) == 2, list(cache.iterdir())
    # plant the 7x7 caches under the 5x5 names, as if the cache had been made by another configuration
    planted = []
    for npy in g7:
        for suffix in (".npy", ".json"):
            src = npy.with_suffix(suffix)
            dst = src.with_name(src.name.replace("-g7", "-g5"))
            shutil.copy(src, dst)
            planted.append(dst)
    out = tmp_path / "g5"
    r = run(train_cmd(out, cache, "model.grid_size=5", "train.epochs=1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("does not match this encoder/grid/image list: rebuilding") == 2, r.stdout
    for npy in (p for p in planted if p.suffix == ".npy"):
        feats = np.load(npy, mmap_mode="r")
        assert feats.shape[1:] == (25, 1280), (npy.name, feats.shape)
        assert json.loads(npy.with_suffix(".json").read_text())["key"]["grid_size"] == 5
    for npy in g7:  # the 7x7 caches are untouched
        assert np.load(npy, mmap_mode="r").shape[1:] == (49, 1280)
    assert load_checkpoint(out / "last.safetensors").config.model.grid_size == 5
    assert state_of(out / "last.safetensors")["finished"]


def test_truncated_feature_cache_is_rebuilt(tmp_path):
    from captioner.data import ImageRecord
    from captioner.data.features import build_cache
    from captioner.model.encoder import Encoder

    torch.manual_seed(0)
    names = sorted(p.name for p in (FLICKR / "Images").iterdir())[:2]
    records = [ImageRecord(n, FLICKR / "Images" / n, ["a caption"]) for n in names]
    enc = Encoder("efficientnet_lite0", False, 7)
    first = build_cache(tmp_path, "c", enc, 224, records, num_workers=0, progress=False)
    expected = np.array(first.features)
    npy = first.path
    del first
    npy.write_bytes(npy.read_bytes()[: npy.stat().st_size // 2])  # damaged on disk; the .json still matches
    again = build_cache(tmp_path, "c", enc, 224, records, num_workers=0, progress=False)
    assert again.features.shape == expected.shape
    np.testing.assert_array_equal(np.asarray(again.features), expected)
