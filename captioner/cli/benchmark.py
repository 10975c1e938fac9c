"""Measure training, evaluation and captioning speed on synthetic inputs of real shapes (no dataset).

    .venv/bin/captioner-benchmark                      # CPU default: flickr8k preset, a few minutes
    .venv/bin/captioner-benchmark --quick --json       # tiny counts (tests)
    .venv/bin/captioner-benchmark --device cuda --preset coco --compile --coco-epoch

Sections (each printed as a table row, or one JSON object with --json):

* train_cached: decoder training throughput (captions/s: forward + backward + Adam step) on cached
  features. "fast" is the real training path: batches of images x 5 captions grouped by caption
  length (BucketBatchSampler), captions sorted by length, W_a a_i projected once per image and shared
  by its captions, padded positions never computed (objectives.CrossEntropy). "naive" is the textbook
  loop on the same model and batch sizes: no length bucketing, every caption carries its own copy
  of the image features (so nothing is shared), W_a a_i recomputed every step, every padded position
  computed (bench/naive.py: naive_loss). Caption lengths are sampled from the dataset's length
  distribution (Flickr8k: 10.8 +- 3.8 words, COCO: 10.5 +- 2.8; measured on the real captions).
  Beside the step, the real loader (data/loader.py) reads batches of the preset's shape from a synthetic
  float16 memory map (bench/loading.py): ms per batch cold (pages dropped from the page cache) and warm.
  `--only load_cached` times that alone (e.g. --preset coco: 16 photos of 14x14x2048 float16, 12 MiB).
* train_encoder: the same with an EfficientNet-Lite0 (224 px, random weights) in the loop, frozen
  (as with augmentation) and fine-tuned.
* eval: images/s of batched beam search at beam 1/3/5 over 1,000 images (100 per call, as evaluate.py
  does), and beam 3 one image per call two ways: the same beam search with a batch of one, and the
  naive mode (one image per call and W_a a_i recomputed at every step, as textbook loops do). The
  ratio to each is printed; the target counts the naive one.
  Decoding time depends on caption length, so the model must stop like a trained one: a checkpoint
  (--checkpoint, default: the bundled model when it exists) or an untrained decoder in which one LSTM
  unit counts steps and drives the <end> logit, calibrated so captions average the dataset's length
  with its spread (a constant <end> bias cannot do it: an untrained decoder then ends every caption
  at the first word or none before max_len). The output says which.
* latency: one PIL image -> caption at beam 3 through Captioner.caption (preprocessing, encoder,
  beam search), p50/p95 over repeated runs; the bundled model, --checkpoint, or a randomly
  initialised model of the bundled recipe (EfficientNet-Lite2, 260 px, 9x9 grid, length counter as
  above) when neither exists. Where the hardware computes bfloat16 natively (preferred_dtype: CPUs
  with AVX512-BF16/AMX, CUDA) the same model is also timed in bfloat16, the faster precision the app
  offers there (its default stays float32).
* latency breakdown: per photo at the stored settings, on real JPEG files (the bundled examples, or
  --photos DIR): read + preprocess, encoder, decoding, concepts, caption() end to end, explain() of a
  12-word sentence (its decoder part and end to end), and caption / explain over preprocess + encoder.
* launches (only with --only launches: counted, not timed): one caption of a read photo and caption_batch of
  up to 32 photos (--photos DIR or the examples) -> aten ops (a GPU's kernel launches), syncs (values read back:
  .item(), nonzero) and host reads (tolist / cpu / numpy); on a CPU also with the GPU's fixed-shape search, eager
  and recorded as one launch (decoding/device_beam.py, bench/launches.py), and one cross-entropy training step at
  the preset's shapes, op by op and recorded (train.capture: training/captured_step.py).
* peak memory: CPU: process max RSS (cumulative high-water mark); CUDA: torch.cuda.max_memory_allocated
  per section.

Timings: every measurement is warmed up first; step times and latencies are medians (the table's
captions/s is captions per batch / median step time), which keeps other load on the machine from
dominating. On CUDA: bf16 autocast for training, optional --compile (decoder step), achieved TFLOP/s
of the decoder training step (main matmuls counted analytically, backward = 2x forward) against
--peak-tflops, and --coco-epoch extrapolates the time of one COCO epoch (113,287 images x 5 captions).
"""
from __future__ import annotations

from captioner.cli import device_refused

import argparse
import json
import sys
import time
from typing import Any

import torch

from ..api import Captioner, default_device, preferred_dtype
from ..model import int8_rows
from ..bench.breakdown import bench_breakdown, photo_files
from ..bench.inference import (EXPLAIN_SENTENCE, bench_eval, bench_explain, bench_latency, default_checkpoint, eval_decoder,
                               latency_captioner)
from ..bench.launches import bench_launches, bench_train_launches
from ..bench.loading import bench_load_cached
from ..bench.report import QUICK_NOTE, format_table, machine, max_key, targets
from ..bench.synthetic import PRESETS
from ..bench.timing import Counts, peak_memory_mb
from ..bench.training import bench_coco_epoch, bench_train_cached, bench_train_encoder, bench_train_scst
from ..model.packed_linear import way


def _counts(args: argparse.Namespace, cuda: bool) -> Counts:
    if args.quick:
        c = Counts(batch_images=4, steps=3, naive_steps=1, encoder_steps=1, encoder_batch=1, warmup=1,
                   eval_images=4, naive_eval_images=2, latency_runs=2, calib_images=4, calib_iters=3)
    elif cuda:
        c = Counts(batch_images=16, steps=30, naive_steps=10, encoder_steps=10, encoder_batch=16, warmup=5,
                   eval_images=1000, naive_eval_images=100, latency_runs=30, calib_images=32, calib_iters=6)
    else:  # counts small enough for a 2-core CPU (its run time: docs/performance.md)
        c = Counts(batch_images=16, steps=6, naive_steps=2, encoder_steps=2, encoder_batch=16, warmup=1,
                   eval_images=1000, naive_eval_images=25, latency_runs=20, calib_images=16, calib_iters=4)
    if args.steps:
        c.steps = args.steps
        c.naive_steps = max(1, args.steps // 3)
        c.encoder_steps = max(1, args.steps // 3)
    if args.eval_images:
        c.eval_images = args.eval_images
        c.naive_eval_images = min(c.naive_eval_images, args.eval_images)
    if args.batch_images:
        c.batch_images = c.encoder_batch = args.batch_images
    return c


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="shapes of the cached-feature training and eval benchmarks (default: flickr8k on CPU, coco on CUDA)")
    p.add_argument("--steps", type=int, default=0, help="timed cached-feature training steps (fast mode; naive and "
                   "encoder-in-the-loop modes time a third); 0 = default for the device (CPU 6, CUDA 30)")
    p.add_argument("--batch-images", type=int, default=0, help="images per training batch (x5 captions); default 16")
    p.add_argument("--eval-images", type=int, default=0, help="synthetic images for the eval benchmark "
                   "(default 1000)")
    p.add_argument("--checkpoint", default=None, help="trained model for eval and latency (default: the bundled model "
                   "if present, else an untrained model whose <end> is driven by a calibrated step counter)")
    p.add_argument("--photos", default=None, help="folder of JPEG photos for the latency breakdown (default: the "
                   "bundled example photos); e.g. ../shared/data/coco-mini/train2017 for unseen photos")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default; --quick: 1, which "
                   "keeps timings steady on a machine shared with other jobs)")
    p.add_argument("--no-amp", action="store_true", help="CUDA: train in fp32 instead of bf16 autocast")
    p.add_argument("--cpu-amp", action="store_true", help="CPU: train with bf16 autocast (train.cpu_amp)")
    p.add_argument("--compile", action="store_true", help="CUDA: torch.compile the decoder step")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="device peak for MFU (default: H100 bf16 dense)")
    p.add_argument("--coco-epoch", action="store_true", help="extrapolate one COCO epoch (cached features and "
                   "resnet101 fine-tuning), meant for CUDA")
    p.add_argument("--only", nargs="+", action="extend", default=None, choices=["train_cached", "load_cached", "train_scst", "train_encoder", "eval", "latency",
                            "launches"],
                   help="run only these sections (load_cached: only the loader's read of a cached batch, which "
                   "train_cached times too)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--quick", action="store_true", help="tiny counts (seconds; for tests)")
    args = p.parse_args(argv)
    if device_refused(args.device):
        return 2

    threads_before = torch.get_num_threads()
    threads = args.threads or (1 if args.quick else 0)
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads_before)  # main() may be called in-process (tests)


def _latency(checkpoint: str | None, counts: Any, device: torch.device, photos: Any, log: Any) -> dict[str, Any]:
    """The latency rows: beam 3, the stored settings, explain(), the per-photo breakdown; on a GPU the search run
    eagerly too, bfloat16 where this hardware computes it natively, and int8 at the stored settings on a CPU."""
    loaded, desc = latency_captioner(checkpoint, counts, device, log)
    res = {"latency": {"model": desc, **bench_latency(loaded, counts, device, log=log)},
           "latency_stored": bench_latency(loaded, counts, device, beam=None, log=log),
           "latency_explain": bench_explain(loaded, counts, device, log=log),
           "latency_breakdown": bench_breakdown(loaded, photos, counts, device, EXPLAIN_SENTENCE, log)}
    if device.type == "cuda":  # the same captions with the search run op by op, not replayed as a CUDA graph
        eager, _ = latency_captioner(checkpoint, counts, device, log, capture=False)
        res["latency_eager_search"] = bench_latency(eager, counts, device, log=log)
    if preferred_dtype(device) == "bfloat16":  # the faster precision the app offers on this hardware
        bf16 = Captioner(loaded.model, loaded.vocab, loaded.config, loaded.metrics, device, "bfloat16",  # a copy
                         fitted=loaded.resources.fitted, memory=loaded.resources.memory)
        res["latency_bf16"] = bench_latency(bf16, counts, device, log=log)
    if device.type == "cpu" and int8_rows.available():  # the int8 precision the app offers on a CPU
        int8 = Captioner(loaded.model, loaded.vocab, loaded.config, loaded.metrics, device, "int8",  # a copy
                         fitted=loaded.resources.fitted, memory=loaded.resources.memory)
        res["latency_stored_int8"] = bench_latency(int8, counts, device, beam=None, log=log)
    return res


def _run(args: argparse.Namespace) -> int:
    device = torch.device(args.device or default_device())
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    cuda = device.type == "cuda"
    preset = PRESETS[args.preset or ("coco" if cuda and not args.quick else "flickr8k")]
    counts = _counts(args, cuda)
    amp = (cuda and not args.no_amp) or (not cuda and args.cpu_amp)
    compile_step = args.compile and cuda
    if cuda:
        torch.backends.cudnn.benchmark = True
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    sections = set(args.only) if args.only else {"train_cached", "train_scst", "train_encoder", "eval", "latency"}

    t_start = time.perf_counter()
    res: dict[str, Any] = {"device": device.type, "preset": preset.name, "quick": args.quick, "amp_bf16": amp,
                           "compile": compile_step, "machine": machine(device, torch.get_num_threads())}
    torch.manual_seed(0)
    if "train_cached" in sections:
        res["train_cached"] = bench_train_cached(preset, counts, device, amp, compile_step, args.peak_tflops, log)
    if "load_cached" in sections and "train_cached" not in sections:
        res["load_cached"] = bench_load_cached(preset, counts.batch_images, counts.steps + counts.warmup, device)
    if "train_scst" in sections:
        res["train_scst"] = bench_train_scst(preset, counts, device, amp, log)
    if "train_encoder" in sections:
        res["train_encoder"] = bench_train_encoder(preset, counts, device, amp, "efficientnet_lite0", 224, 7, log)
    checkpoint = default_checkpoint(args.checkpoint)
    if "eval" in sections:
        eval_model = eval_decoder(preset, counts, checkpoint, device, log)
        dec, shape, max_len, info = eval_model
        res["eval"] = {"model": info["model"], **bench_eval(dec, shape, max_len, counts, device, log=log)}
        if "length_offset" in info:
            res["eval"]["length_counter_offset"] = info["length_offset"]
    if "latency" in sections:
        res.update(_latency(checkpoint, counts, device, photo_files(args.photos), log))
    if "launches" in sections:  # counted, not timed: a CPU's view of a GPU's launches and waits
        loaded, _ = latency_captioner(checkpoint, counts, device, log)
        res["launches"] = bench_launches(loaded, photo_files(args.photos))
        if not cuda:
            res["launches_device_search"] = bench_launches(loaded, photo_files(args.photos), gpu_search=True)
            res["launches_captured_search"] = bench_launches(loaded, photo_files(args.photos), captured=True)
            res["launches_train_step"] = bench_train_launches(preset, counts.batch_images)
    if args.coco_epoch:
        if not cuda:
            log("note: --coco-epoch on CPU measures COCO shapes with ResNet-101 in the loop; this is slow")
        res["coco_epoch"] = bench_coco_epoch(counts, device, amp, compile_step, args.peak_tflops,
                                             res.get("train_cached"), log)
    res["products"] = way()  # how this torch computes the step's linear layers (model/packed_linear.py)
    res["peak_memory_mb"] = peak_memory_mb(device) if not cuda else max_key(res, "peak_memory_mb")
    res["targets"] = targets(res)
    res["seconds"] = time.perf_counter() - t_start
    _report(res, preset.name, amp, args.json)
    return 0


def _report(res: dict[str, Any], preset: str, amp: bool, as_json: bool) -> None:
    if as_json:
        print(json.dumps(res, indent=2))
    else:
        m = res["machine"]
        print(f"\ncaptioner benchmark: {m['device']} ({m.get('gpu') or m.get('cpu', '')}), {m['cpu_count']} CPUs, "
              f"{m['torch_threads']} torch threads, torch {m['torch']}, preset {preset}"
              + (", training in bf16 autocast" if amp else "")
              + (f", load average {m['load_average_1m']:.1f} at start" if "load_average_1m" in m else ""))
        if "eval" in res:
            print(f"eval model: {res['eval']['model']}")
        if "latency" in res:
            print(f"latency model: {res['latency']['model']}")
        print(format_table(res))
        print(f"linear layers of the step on this CPU (model/packed_linear.py): {res['products']}"
              + ("" if res["products"] == "packed" else " (no oneDNN in this torch)"))
        for name, t in res["targets"].items():
            verdict = "not judged (--quick)" if t["met"] is None else "met" if t["met"] else "MISSED"
            print(f"target {name}: {t['value']:.1f} -> {verdict}")
        if res["quick"] and res["targets"]:
            print(f"targets {QUICK_NOTE}")
        print(f"({res['seconds']:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
