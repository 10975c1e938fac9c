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
