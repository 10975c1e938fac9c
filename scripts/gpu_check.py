#!/usr/bin/env python
"""Every GPU command of the project at small sizes, one table: run once on a machine with a GPU, it gives
every figure docs/performance.md and docs/training.md leave unmeasured.

    .venv/bin/python scripts/gpu_check.py --device cuda --out gpu_check/     # minutes on one GPU
    .venv/bin/python scripts/gpu_check.py --device cpu --quick               # the same commands on a CPU (smoke)
    .venv/bin/python scripts/gpu_check.py --device cuda --only recorded latency launches library   # a short lease
    .venv/bin/python scripts/gpu_check.py --device cuda --only training memory     # the training step's rows

Rows: the benchmark (captions/s, fraction of the GPU's peak, caption() ms, the COCO epoch estimate), the batch
that fits this GPU's memory (computed by bench/memory.py, then one step at that batch measured), the search
recorded as a CUDA graph against the eager one (tests/test_captured.py), caption() and one image per call
recorded and op by op, the launches and syncs of a caption (bench/launches.py), a photo library of 480 photos at
batch 64 (photos/s), the training step recorded as a CUDA graph against op by op (tests/test_captured_step.py) and
its captions/s op by op, recorded and naive at two batch sizes (benchmark --only train_cached), and the training
chain on a folder made from the bundled example photos (no dataset needed: the device machine has none):
prepare -> train (stopped by SIGINT mid-run, resumed) -> SCST -> export -> caption, and torchrun over every GPU.
Each row is one command in its own process group, killed when it runs past its time limit (a silent hang too);
a row passes when it exits 0, or 130 for the one row stopped by SIGINT on purpose (and only if it was). The table
gives each row's verdict, exit code and seconds; the JSON of all of it goes to --out; the exit code is 0 only when
every row passed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
INTERRUPTED = 130  # a command stopped by SIGINT (128 + 2), as train.py exits after saving


@dataclass
class Row:
    """One command of the check: it passes with exit code 0, or 130 when `stop_after` asks for a SIGINT."""
    name: str
    cmd: list[str]
    timeout: float = 600  # seconds before the command's whole process group is killed
    stop_after: str = ""  # send SIGINT once a line of output contains this
    summarise: Callable[[dict], str] | None = None  # the command prints JSON: its figures' summary for the table


@dataclass
class Outcome:
    code: int  # the exit code (negative: killed by that signal)
    output: str
    seconds: float
    timed_out: bool
    interrupted: bool  # the SIGINT `stop_after` asked for was sent


def run(row: Row) -> Outcome:
    """Run the row's command, its output read by a thread so the time limit holds while nothing is printed."""
    t = time.monotonic()
    p = subprocess.Popen(row.cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)  # its own process group: a timeout kills torchrun's ranks too
    lines: list[str] = []
    sent = threading.Event()

    def read() -> None:
        for line in p.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if row.stop_after and row.stop_after in line and not sent.is_set():
                sent.set()
                p.send_signal(signal.SIGINT)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    try:
        p.wait(row.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # a timeout, a Ctrl-C of this script, or a child left holding the output: end the group
        _kill_group(p)
    reader.join(5)
    return Outcome(p.wait(), "".join(lines), time.monotonic() - t, timed_out, sent.is_set())


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group has ended
        pass


def verdict(row: Row, res: Outcome) -> str:
    """"ok", or what went wrong: a timeout, an exit code other than the row's, a SIGINT that was never sent."""
    if res.timed_out:
        return f"killed after {row.timeout:.0f} s"
    if row.stop_after and not res.interrupted:
        return f"never printed {row.stop_after!r} (no SIGINT sent)"
    want = INTERRUPTED if row.stop_after else 0
    return "ok" if res.code == want else f"exit {res.code}, expected {want}"


def settings(values: dict[str, object]) -> list[str]:
    """A --set argument from named settings: {"train.epochs": 3} -> ["--set", "train.epochs=3"]."""
    return ["--set", *(f"{k}={v}" for k, v in values.items())]


def photo_folder(folder: Path, copies: int) -> Path:
    """The bundled example photos, each as `copies` variants (crops, mirror images), with captions."""
    from PIL import Image, ImageOps

    captions = {"cat": "a cat sitting on a wall", "coffee": "a cup of coffee on a table",
                "astronaut": "a woman in a white suit standing in front of a flag"}
    (folder / "Images").mkdir(parents=True, exist_ok=True)
    lines = ["image,caption"]
    for name, caption in captions.items():
        photo = Image.open(ROOT / "captioner" / "assets" / "examples" / f"{name}.jpg").convert("RGB")
        for k in range(copies):
            w, h = photo.size
            crop = photo.crop((k % 4 * w // 40, k // 4 % 4 * h // 40, w - k % 3 * w // 40, h - k % 5 * h // 50))
            (ImageOps.mirror(crop) if k % 2 else crop).save(folder / "Images" / f"{name}_{k:02d}.jpg")
            lines += [f"{name}_{k:02d}.jpg,{caption}", f"{name}_{k:02d}.jpg,{caption.replace('a ', 'the ', 1)}"]
    (folder / "captions.txt").write_text("\n".join(lines) + "\n")
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="gpu_check", help="folder for the JSON and the runs (replaced)")
    p.add_argument("--quick", action="store_true", help="tiny benchmark counts (a smoke run: about a minute on a CPU)")
    p.add_argument("--memory-row", action="store_true", help="only print the memory row's JSON (the check runs this "
                   "in a process of its own)")
    p.add_argument("--only", nargs="+", metavar="WORD", default=None, help="run only the rows whose name has one "
                   "of these words (case-insensitive), e.g. --only recorded latency launches library: the rows a "
                   "short device lease has time for")
    args = p.parse_args(argv)
    if args.memory_row:
        import torch

        from captioner.bench.memory import memory_report

        print(json.dumps(memory_report(torch.device(args.device))))
        return 0
    out = Path(args.out).absolute()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    py, table, figures = sys.executable, [], {}
    bench = ["--device", args.device, "--json", *(["--quick"] if args.quick else
                                                  ["--preset", "coco", "--compile", "--coco-epoch"])]
    rows = [Row("benchmark " + " ".join(bench[1:]), [py, "scripts/benchmark.py", *bench], 900, "", _bench_summary),
            Row("batch for this device's memory (bench/memory.py)",
                [py, "scripts/gpu_check.py", "--memory-row", "--device", args.device], 300, "", _memory_summary),
            *_library_rows(py, out, args.device, 20 if args.quick else 160, args.quick),
            *_training_rows(py, args.device, args.quick),
            *_training_chain(py, out, args.device)]
    for row in chosen(rows, args.only):
        res = run(row)
        (out / f"{_file_name(row.name)}.log").write_text(res.output)
        figures[row.name] = _figures(row, res)
        table.append({"command": row.name, "verdict": verdict(row, res), "exit": res.code,
                      "seconds": round(res.seconds, 1), "figures": _summary(row, figures[row.name], res.output)})
    print("\n| command | verdict | exit | seconds | figures |\n|---|---|---|---|---|")
    for r in table:
        print(f"| {r['command']} | {r['verdict']} | {r['exit']} | {r['seconds']:.0f} | {r['figures']} |")
    (out / "gpu_check.json").write_text(json.dumps({"rows": table, "figures": figures}, indent=1, default=str))
    return 0 if all(r["verdict"] == "ok" for r in table) else 1


def chosen(rows: list[Row], words: list[str] | None) -> list[Row]:
    """The rows whose name has one of `words` (case-insensitive; all rows without words); a word no row has is an
    error that lists the rows."""
    if not words:
        return rows
    unknown = [w for w in words if not any(w.lower() in r.name.lower() for r in rows)]
    if unknown:
        raise SystemExit(f"error: --only {' '.join(unknown)}: no row's name has it; the rows: "
                         + "; ".join(r.name for r in rows))
    return [r for r in rows if any(w.lower() in r.name.lower() for w in words)]


def _file_name(name: str) -> str:
    """A row's log file name: "train, SIGINT at step 3" -> "train_SIGINT_at_step_3"."""
    return re.sub(r"\W+", "_", name.split(" (")[0]).strip("_")


def _figures(row: Row, res: Outcome) -> dict | str:
    return _last_json(res.output) if row.summarise else res.output[-1500:]


def _summary(row: Row, figures: dict | str, text: str) -> str:
    if row.summarise:
        return row.summarise(figures) if figures else f"no JSON (see {_file_name(row.name)}.log)"  # type: ignore[arg-type]
    lines = [x for x in text.splitlines() if "captions/s" in x or "photos/s" in x or "Rerun" in x
             or x.startswith(("epoch", "done"))]
    last = lines or text.strip().splitlines() or [""]
    return last[-1][:160]


def _library_rows(py: str, out: Path, device: str, copies: int, quick: bool) -> list[Row]:
    """The search recorded as a CUDA graph checked against the eager one (tests/test_captured.py); caption() and one
    image per call, recorded and op by op (the benchmark's latency and eval sections); then a photo library of
    3 x copies photos: the launches and syncs of one caption and of a batch of 32 of them (bench/launches.py), then
    all captioned into a JSON-lines file at the GPU's batch (64): photos/s."""
    folder = photo_folder(out / "library", copies) / "Images"
    return [Row("the recorded search captions as the eager one on this GPU (tests/test_captured.py)",
                [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_captured.py"], 300),
            Row("latency: caption() recorded and op by op, one image per call (benchmark --only latency eval)",
                [py, "scripts/benchmark.py", "--device", device, "--only", "latency", "eval", "--json",
                 *(["--quick"] if quick else [])], 600, "", _bench_summary),
            Row("launches: ops and syncs of one caption and of a batch of 32 (bench/launches.py)",
                [py, "scripts/benchmark.py", "--device", device, "--only", "launches", "--photos", str(folder),
                 "--json"], 300, "", _bench_summary),
            Row(f"a photo library of {3 * copies} photos, --batch-size 64",
                [py, "scripts/caption.py", str(folder), "--device", device, "--batch-size", "64",
                 "--output", str(out / "library.jsonl")], 600)]


def _training_rows(py: str, device: str, quick: bool) -> list[Row]:
    """The training step recorded per batch shape (train.capture) checked against op by op
    (tests/test_captured_step.py), then the cached-feature step's captions/s op by op, recorded and naive (the
    textbook loop): at the Flickr8k recipe's shapes (16 photos x 5 captions a step, 9x9x1280, H 512) and at the
    COCO preset's with 64 photos a step (what a larger batch gives)."""
    bench = [py, "scripts/benchmark.py", "--device", device, "--only", "train_cached", "--json",
             *(["--quick"] if quick else [])]
    return [Row("the recorded training step trains as op by op on this GPU (tests/test_captured_step.py)",
                [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_captured_step.py"], 300),
            Row("training: op by op, recorded, naive; flickr8k shapes, 16 photos a step",
                [*bench, "--preset", "flickr8k"], 600, "", _bench_summary),
            Row("training: op by op, recorded, naive; coco shapes, 64 photos a step",
                [*bench, "--preset", "coco", "--batch-images", "4" if quick else "64"], 600, "", _bench_summary)]


def _training_chain(py: str, out: Path, device: str) -> list[Row]:
    """prepare -> train (SIGINT at step 3) -> resumed -> SCST -> export -> caption, and torchrun over every GPU."""
    folder = photo_folder(out / "photos", 12)
    common = {"data.root": folder, "data.cache_dir": out / "cache", "data.limit": 0, "train.batch_images": 4,
              "train.log_every": 1, "train.checkpoint_every": 1000, "train.val_metric": "CIDEr", "train.val_limit": 0}
    xe = settings({**common, "train.out_dir": out / "xe", "train.epochs": 3, "model.dropout": 0.5})
    scst = settings({**common, "train.out_dir": out / "scst", "train.init_from": out / "xe" / "best.safetensors",
                     "train.objective": "scst", "train.epochs": 1, "train.lr": 5e-5})
    ddp = settings({**common, "train.out_dir": out / "ddp", "train.epochs": 1})
    train = ["scripts/train.py", "--device", device, "--no-progress", "--config", "configs/tiny.yaml"]
    model = str(out / "model.safetensors")
    return [Row("prepare", [py, "scripts/prepare.py", "--device", device, "--no-progress", "--config",
                            "configs/tiny.yaml", *settings(common)]),
            Row("train, SIGINT at step 3", [py, *train, *xe], stop_after="step 3:"),
            Row("train, resumed", [py, *train, *xe]),
            Row("SCST from it", [py, *train, *scst]),
            Row("export", [py, "scripts/export.py", str(out / "scst" / "best.safetensors"), model, "--half"]),
            Row("caption", [py, "scripts/caption.py", "--device", device, "--checkpoint", model,
                            "captioner/assets/examples/cat.jpg"]),
            Row("torchrun, every GPU", [py, "-m", "torch.distributed.run", f"--nproc_per_node={_gpus(device)}",
                                        *train, *ddp])]


def _gpus(device: str) -> int:
    import torch

    return max(1, torch.cuda.device_count()) if device.startswith("cuda") else 2


def _last_json(text: str) -> dict:
    """The last JSON object the command printed (one line, or indented over several from a line "{")."""
    lines = text.splitlines()
    for k in range(len(lines) - 1, -1, -1):
        if lines[k].startswith("{"):
            try:
                return json.loads("\n".join(lines[k:]))
            except json.JSONDecodeError:
                continue
    return {}


def _bench_summary(res: dict) -> str:
    """The figures the docs leave unmeasured: throughput, fraction of peak, latency medians, the COCO epoch."""
    flat: dict[str, float] = {}

    def walk(prefix: str, v) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else k, x)
        elif isinstance(v, (int, float)) and any(w in prefix for w in WANTED):
            flat[prefix] = v

    walk("", res)
    return "; ".join(f"{k} {v:.4g}" for k, v in flat.items())


def _memory_summary(res: dict) -> str:
    return "; ".join(f"{k}: {v}" for k, v in res.items())


WANTED = ("captions_per_s", "images_per_s", "p50", "minutes", "cold_ms", "peak_fraction", "fraction_of_peak", "tflops",
          "ops", "syncs")


if __name__ == "__main__":
    sys.exit(main())
