"""DistributedDataParallel on CPU: torchrun, gloo backend, 2 processes. Without its feature cache a multi-process
run is refused before the process group starts (no rank waits on a barrier while another builds it); after
captioner-prepare it trains with parameters identical across ranks."""
from __future__ import annotations

import subprocess
import sys
import time

from .conftest import ROOT, need_flickr
from .test_scripts import ENV


def test_torchrun_without_a_cache_is_refused_then_two_cpu_ranks_stay_in_sync(tmp_path):
    flickr = need_flickr()
    settings = [f"data.root={flickr}", f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={tmp_path / 'run'}",
                "train.epochs=2", "train.batch_images=2", "train.val_limit=2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533",
           "scripts/train.py", "--config", "configs/tiny.yaml", "--device", "cpu", "--no-progress", "--set", *settings]
    t = time.time()
    refused = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and time.time() - t < 120
    assert "torchrun needs the feature caches first" in refused.stderr and "captioner-prepare" in refused.stderr
    assert "Timeout" not in refused.stderr and not (tmp_path / "run").exists()
    prepare = [sys.executable, "scripts/prepare_data.py", "--config", "configs/tiny.yaml", "--no-progress",
               "--set", *settings]
    assert subprocess.run(prepare, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300).returncode == 0
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # 8 images / 2 per batch = 4 batches per epoch, 2 per rank
    assert "2 batches/epoch/rank" in proc.stdout
    assert "parameters identical across 2 ranks after step 2" in proc.stdout
    assert "parameters identical across 2 ranks after step 4" in proc.stdout
    assert (tmp_path / "run" / "best.safetensors").is_file()


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
    prepare = [sys.executable, "scripts/prepare_data.py", "--config", "configs/tiny.yaml", "--no-progress", "--set", *base]
    assert subprocess.run(prepare, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300).returncode == 0

    def torchrun(out: str, port: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                "scripts/train.py", "--config", "configs/tiny.yaml", "--device", "cpu", "--no-progress", "--set", *base,
                f"train.out_dir={tmp_path / out}"]

    ref = subprocess.run(torchrun("reference", 29541), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]
    p = subprocess.Popen(torchrun("stopped", 29542), cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    metrics = tmp_path / "stopped" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.is_file() and len(read_jsonl(metrics)) >= 3):
        assert p.poll() is None and time.time() < deadline, "the run ended before it could be stopped"
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    out, err = p.communicate(timeout=120)
    assert err.count("SIGINT: stopped at epoch 1, step") == 1 and "Rerun the same command to resume" in err
    assert "captioner" not in "".join(line for line in err.splitlines() if line.startswith("  File"))  # no traceback of ours
    saved = load_checkpoint(tmp_path / "stopped" / "last.safetensors").train_state
    assert len(saved["rng"]) == 2 and 0 < saved["state"]["batch_in_epoch"] < 10
    again = subprocess.run(torchrun("stopped", 29543), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]

    def logged(run: str) -> list[tuple]:
        return [(r["kind"], r["step"], r.get("xent"), r.get("val_loss")) for r in read_jsonl(tmp_path / run / "metrics.jsonl")]

    assert logged("stopped") == logged("reference")
