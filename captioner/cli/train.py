#!/usr/bin/env python
"""Train a captioner.

    .venv/bin/captioner-train --config configs/flickr8k_cpu.yaml [--set train.lr=1e-3 ...]

Rerun the same command after an interruption to resume. Multi-GPU / multi-node:
    torchrun --nproc_per_node=N scripts/train.py --config configs/coco_resnet101.yaml
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from captioner.cli import device_refused

STARTING = "stopped while starting, before any training"  # what a stop before fit() built its run leaves
LEAVE_AFTER_RANK0_S = 10.0  # a refusing rank's pause before it exits (_refused)


def main(argv: list[str] | None = None) -> int:
    """The command. Its stop handler goes in first, before torch and the library are imported (the slow part of a start): a
    Ctrl-C or SIGTERM at any moment ends in one line and exit 128 + signal, never a traceback. (Only the
    interpreter's own start and this module's few standard imports come before it; a Ctrl-C there, or while
    the handler's module loads, is a KeyboardInterrupt, turned into the same line.)"""
    try:
        from captioner.training.stopping import Interrupted, StopSignal  # standard library only: milliseconds
    except KeyboardInterrupt:
        return _stopped("SIGINT", STARTING, 130)
    returning = False
    try:
        with StopSignal().catch() as stop:
            code = _train(argv, stop)
            returning = True
        return code
    except Interrupted as e:  # Ctrl-C or SIGTERM: a step in training is saved first (engine.train_to_validation)
        return _stopped(e.name, e.where or STARTING, e.code)
    except KeyboardInterrupt:
        if not returning:  # with the handler in place a signal never raises it: code raised it, let it through
            raise
        return _stopped("SIGINT", "stopped as the command ended, its work done and saved", 130)


def _stopped(name: str, where: str, code: int) -> int:
    """The one line a stopped command prints (rank 0 alone under torchrun: every rank stops) -> its exit code."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"\n{name}: {where}. Rerun the same command to resume.", file=sys.stderr, flush=True)
    return code


def _train(argv: list[str] | None, stop) -> int:
    from captioner.cli import numpy_before_torch

    numpy_before_torch()
    import torch

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

    started = _processes(cfg, args)
    if started is None:
        return 2
    device, rank, world = started
    log = print if rank == 0 else (lambda *_: None)
    if args.config is None:  # a bare command: say what it is about to spend the next hour on
        log(bare_plan(cfg), flush=True)
    try:
        fit(cfg, device=device, log=lambda m: log(m, flush=True), progress=not args.no_progress,
            rank=rank, world_size=world, stop=stop)
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


# the feature cache's pace for the built-in defaults (EfficientNet-Lite0 at 224 px, frozen): 12 photos/s on one
# CPU thread of this project's 2-core VM (Flickr8k photos, batches of 16)
DEFAULT_ENCODE_RATE = 12.0


def bare_plan(cfg) -> str:
    """The one line a bare `captioner-train` (no --config) prints before it starts: which settings (the built-in
    defaults), which data, that it encodes the photos into the feature cache first and about how long that takes,
    how many epochs follow, and where the recipes are. A new user typed it to see what it does, and it started
    a 13-minute encode of Flickr8k without a word."""
    from captioner.data import build_mix
    from captioner.training.sources import missing_caches

    m, d, t = cfg.model, cfg.data, cfg.train
    line = (f"no --config: training the built-in defaults (captioner/config.py: {m.encoder} at {m.image_size} px, "
            f"{d.dataset} from {d.root}, at most {t.epochs} epochs, into {t.out_dir}/)")
    try:
        photos = sum(len(recs) for split in ("train", "val") for _, recs in build_mix(d, split))
        missing = missing_caches(cfg)
    except (OSError, ValueError):  # no data there: training itself says what is missing and what to do
        return line + "; see configs/ for the recipes (configs/flickr8k_cpu.yaml made the bundled model)"
    if missing:
        minutes = photos / DEFAULT_ENCODE_RATE / 60
        line += (f"; it first encodes the {photos:,} train and val photos into the feature cache {d.cache_dir}/ "
                 f"(about {max(1, round(minutes))} min on one CPU thread, once)")
    return (line + f", then trains for up to {t.epochs} epochs of several minutes each on a CPU (early stopping may "
            "end it sooner; Ctrl-C stops, the same command resumes). Recipes: configs/ (configs/flickr8k_cpu.yaml "
            "made the bundled model)")


def _processes(cfg, args) -> tuple[str, int, int] | None:
    """(device, rank, world size): torchrun sets them in the environment (the library takes them as arguments).
    A multi-process run needs its feature caches built first: without them every rank refuses (None) before
    the process group starts, so no rank waits on a barrier while another builds them."""
    from captioner.api import default_device
    from captioner.checkpoint import read_train_state
    from captioner.training.run import processes_refused
    from captioner.training.sources import missing_caches

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = args.device or default_device()
    if world == 1:
        return device, rank, world
    if missing := missing_caches(cfg):  # every rank finds them missing; rank 0 alone says so (the same exit code)
        sets = " ".join(f"--set {s}" for s in args.set)
        return _refused(rank, f"torchrun needs the feature caches first ({', '.join(missing)} missing in "
                        f"{cfg.data.cache_dir}). Build them in one process: captioner-prepare --config {args.config} "
                        f"{sets}; then rerun torchrun.")
    last = Path(cfg.train.out_dir) / "last.safetensors"  # every rank reads the same header: all refuse, rank 0 says it
    if refused := processes_refused(last, read_train_state(last) if last.is_file() else None, world):
        return _refused(rank, refused)
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda"):
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
        torch.cuda.set_device(device)
    return device, rank, world


def _refused(rank: int, why: str) -> None:
    """A refusal every rank of a torchrun group reaches before the process group starts: rank 0 alone prints it
    (one line, not one per rank); every rank then exits 2. torchrun reports any group with a non-zero exit in a
    summary of its own after it (its traceback and a box; docs/training.md says why it stays): rank 0 writes the line
    to the error file torchrun names (TORCHELASTIC_ERROR_FILE), so that summary's root cause is this refusal rather
    than a pointer to how to enable tracebacks. The other ranks leave only after a pause: torchrun stops a group as
    soon as one of its processes exits non-zero, so a rank leaving first would stop rank 0 before it prints."""
    import time

    if rank != 0:
        time.sleep(LEAVE_AFTER_RANK0_S)  # torchrun stops this rank as soon as rank 0 has exited
        return None
    print(f"error: {why}", file=sys.stderr)
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        import json

        # the layout torch's own @record writes (its launcher reads py_callstack as the failure's traceback)
        line = f"error: {why}"
        Path(error_file).write_text(json.dumps({"message": {"message": line, "extraInfo": {
            "py_callstack": line, "timestamp": str(int(time.time()))}}}))
    return None


if __name__ == "__main__":
    sys.exit(main())
