"""DistributedDataParallel on CPU: torchrun, gloo backend, 2 processes; parameters stay identical."""
from __future__ import annotations

import subprocess
import sys

from .conftest import ROOT, need_flickr
from .test_scripts import ENV


def test_torchrun_two_cpu_ranks_stay_in_sync(tmp_path):
    flickr = need_flickr()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533",
           "scripts/train.py", "--config", "configs/tiny.yaml", "--device", "cpu", "--no-progress", "--set",
           f"data.root={flickr}", f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={tmp_path / 'run'}",
           "train.epochs=2", "train.batch_images=2", "train.val_limit=2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # 8 images / 2 per batch = 4 batches per epoch, 2 per rank
    assert "2 batches/epoch/rank" in proc.stdout
    assert "parameters identical across 2 ranks after step 2" in proc.stdout
    assert "parameters identical across 2 ranks after step 4" in proc.stdout
    assert (tmp_path / "run" / "best.safetensors").is_file()
