#!/usr/bin/env python
"""Train a captioner.

    .venv/bin/captioner-train --config configs/flickr8k_cpu.yaml [--set train.lr=1e-3 ...]

Rerun the same command after an interruption to resume. Multi-GPU / multi-node:
    torchrun --nproc_per_node=N scripts/train.py --config configs/coco_resnet101.yaml
"""
from __future__ import annotations

from captioner.cli import device_refused

import argparse
import os
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    from captioner.api import default_device
    from captioner.config import load_config
    from captioner.diskspace import FULL, DiskFullError
    from captioner.training.engine import TrainingError, fit

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML/JSON recipe in configs/")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE", help="override settings, e.g. train.lr=1e-3")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch's default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (logs only)")
    args = p.parse_args(argv)
    if device_refused(args.device):
        return 2
    try:
        cfg = load_config(args.config, args.set)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)

    # torchrun sets these; the library takes rank/world size as arguments, never from the environment
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = args.device or default_device()
    if world > 1:
        import torch.distributed as dist

        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend)
        if device.startswith("cuda"):
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
    log = print if rank == 0 else (lambda *_: None)
    try:
        fit(cfg, device=device, log=lambda m: log(m, flush=True), progress=not args.no_progress,
            rank=rank, world_size=world)
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk (DiskFullError names the file and the space it needs)
        if e.errno not in FULL:
            raise
        print(f"error: {e}" if isinstance(e, DiskFullError) else
              f"error: no space left on device writing {e.filename or cfg.train.out_dir} ({e.strerror}). Free some "
              "space and rerun the same command: it resumes from the last good checkpoint.", file=sys.stderr)
        return 1
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
