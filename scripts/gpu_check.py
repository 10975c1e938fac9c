#!/usr/bin/env python
"""Every GPU command of the project at small sizes, one table: run once on a machine with a GPU, it gives
every figure docs/performance.md and docs/training.md leave unmeasured.

    .venv/bin/python scripts/gpu_check.py --device cuda --out gpu_check/     # minutes on one GPU
    .venv/bin/python scripts/gpu_check.py --device cpu --quick               # the same commands on a CPU (smoke)

Rows: the benchmark (captions/s, fraction of the GPU's peak, caption() ms, the COCO epoch estimate), the batch
that fits this GPU's memory (computed by bench/memory.py, then one step at that batch measured), and the training
chain on a folder made from the bundled example photos (no dataset needed: the device machine has none):
prepare -> train (stopped by SIGINT mid-run, resumed) -> SCST -> export -> caption, and torchrun over every GPU.
Each row gives the command's exit code; the JSON of all of it goes to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def run(cmd: list[str], timeout: float = 600, stop_after: str = "") -> tuple[int, str, float]:
    """(exit code, output, seconds); with `stop_after`, SIGINT once that text is printed (then wait)."""
    t = time.time()
    p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    for line in p.stdout:  # type: ignore[union-attr]
        out.append(line)
        if stop_after and stop_after in line:
            p.send_signal(signal.SIGINT)
            stop_after = ""
        if time.time() - t > timeout:
            p.kill()
    p.wait()
    return p.returncode, "".join(out), time.time() - t


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="gpu_check", help="folder for the JSON and the runs (replaced)")
    p.add_argument("--quick", action="store_true", help="tiny benchmark counts (a smoke run)")
    args = p.parse_args()
    out = Path(args.out).absolute()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    py, rows, figures = sys.executable, [], {}
    bench = [py, "scripts/benchmark.py", "--device", args.device, "--json"] + (
        ["--quick"] if args.quick else ["--preset", "coco", "--compile", "--coco-epoch"])
    code, text, secs = run(bench, 900)
    (out / "benchmark.log").write_text(text)
    figures["benchmark"] = _last_json(text)
    rows.append(("benchmark " + " ".join(bench[3:]), code, secs, _bench_summary(figures["benchmark"])))
    code, text, secs = run([py, "-c", MEMORY, args.device], 300)
    figures["memory"] = _last_json(text)
    rows.append(("batch for this device's memory (bench/memory.py)", code, secs, _memory_summary(figures["memory"])))
    rows += _training_chain(py, out, args.device, figures)
    print("\n| command | exit | seconds | figures |\n|---|---|---|---|")
    for cmd, code, secs, note in rows:
        print(f"| {cmd} | {code} | {secs:.0f} | {note} |")
    (out / "gpu_check.json").write_text(json.dumps({"rows": rows, "figures": figures}, indent=1, default=str))
    return 0 if all(code in (0, 130) for _, code, _, _ in rows) else 1


def _training_chain(py: str, out: Path, device: str, figures: dict) -> list[tuple]:
    folder = photo_folder(out / "photos", 12)
    common = ["--config", "configs/tiny.yaml", "--set", f"data.root={folder}", f"data.cache_dir={out / 'cache'}",
              "data.limit=0", "train.batch_images=4", "train.log_every=1", "train.checkpoint_every=1000",
              "train.val_metric=CIDEr", "train.val_limit=0"]
    xe = [*common, f"train.out_dir={out / 'xe'}", "train.epochs=3", "model.dropout=0.5"]
    rows = []
    for name, cmd, stop in [
            ("prepare", [py, "scripts/prepare.py", "--device", device, "--no-progress", *common], ""),
            ("train, SIGINT at step 3", [py, "scripts/train.py", "--device", device, "--no-progress", *xe], "step 3:"),
            ("train, resumed", [py, "scripts/train.py", "--device", device, "--no-progress", *xe], ""),
            ("SCST from it", [py, "scripts/train.py", "--device", device, "--no-progress", *common,
                              f"train.out_dir={out / 'scst'}", f"train.init_from={out / 'xe' / 'best.safetensors'}",
                              "train.objective=scst", "train.epochs=1", "train.lr=5e-5"], ""),
            ("export", [py, "scripts/export.py", str(out / "scst" / "best.safetensors"), str(out / "model.safetensors"),
                        "--half"], ""),
            ("caption", [py, "scripts/caption.py", "--device", device, "--checkpoint", str(out / "model.safetensors"),
                         "captioner/assets/examples/cat.jpg"], ""),
            ("torchrun, every GPU", [py, "-m", "torch.distributed.run", f"--nproc_per_node={_gpus(device)}",
                                     "scripts/train.py", "--device", device, "--no-progress", *xe[:-2],
                                     f"train.out_dir={out / 'ddp'}", "train.epochs=1"], "")]:
        code, text, secs = run(cmd, 600, stop)
        (out / f"{name.replace(',', '').replace(' ', '_')}.log").write_text(text)
        figures[name] = text[-1500:]
        lines = [x for x in text.splitlines() if "captions/s" in x or "Rerun" in x or x.startswith(("epoch", "done"))]
        rows.append((name, code, secs, (lines[-1][:160] if lines else text.strip().splitlines()[-1][:160] if text.strip() else "")))
    return rows


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
    if not res:
        return "no JSON (see benchmark.log)"
    flat: dict[str, float] = {}

    def walk(prefix: str, v) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else k, x)
        elif isinstance(v, (int, float)) and any(w in prefix for w in WANTED):
            flat[prefix] = v

    walk("", res)
    return "; ".join(f"{k} {v:.4g}" for k, v in flat.items())


WANTED = ("captions_per_s", "images_per_s", "p50", "minutes", "cold_ms", "peak_fraction", "fraction_of_peak", "tflops")


def _memory_summary(res: dict) -> str:
    return "; ".join(f"{k}: {v}" for k, v in res.items()) if res else "no JSON (see the log)"


MEMORY = """
import json, sys, torch
from captioner.bench.memory import training_memory
from captioner.bench.synthetic import PRESETS
device = torch.device(sys.argv[1])
m = training_memory(PRESETS["coco"])
res = {"fixed_MiB": round(m.fixed_bytes / 2**20), "KiB_per_token": round(m.bytes_per_token / 1024)}
for gib in (16, 24, 40, 80):
    res[f"batch_images_{gib}GiB_p99_captions"] = m.batch_images(gib * 2**30, 23)
if device.type == "cuda":
    from captioner.bench.training import _decoder_model
    from captioner.bench.synthetic import make_batches
    from captioner.config import Config
    from captioner.training.objectives import CrossEntropy
    total = torch.cuda.get_device_properties(device).total_memory
    n = m.batch_images(total, 23)
    model = _decoder_model(PRESETS["coco"], False).to(device).train()
    batch = make_batches(PRESETS["coco"], 1, n, True, 5)[0].to(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = CrossEntropy(Config())(model, batch).total
    loss.backward()
    res.update({"this_gpu_GiB": round(total / 2**30, 1), "computed_batch_images": n,
                "measured_peak_GiB_at_it": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)})
print(json.dumps(res))
"""


if __name__ == "__main__":
    sys.exit(main())
