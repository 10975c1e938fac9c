"""The benchmark's targets, table and machine description."""
from __future__ import annotations

import os
import platform
from typing import Any

import torch

TARGETS = {"train_speedup": 3.0, "eval_speedup_beam3": 10.0, "latency_p50_ms": 250.0, "latency_stored_p50_ms": 150.0,
           "explain_p50_ms": 100.0}


QUICK_NOTE = "not judged: --quick times a few images at tiny counts; run without --quick to judge the targets"


def targets(res: dict[str, Any]) -> dict[str, Any]:
    """name -> {"value", "met"}; a --quick run's "met" is None with a "note": its tiny counts (a few images,
    one thread) cannot say whether a target is met or missed."""
    out = _judged(res)
    if res.get("quick"):
        out = {k: {"value": t["value"], "met": None, "note": QUICK_NOTE} for k, t in out.items()}
    return out


def _judged(res: dict[str, Any]) -> dict[str, Any]:
    out = {}
    if "train_cached" in res:
        v = res["train_cached"]["speedup"]
        out["train_cached_speedup>=3x"] = {"value": v, "met": v >= TARGETS["train_speedup"]}
    if "eval" in res:
        v = res["eval"]["speedup_beam3"]
        out["eval_beam3_speedup>=10x"] = {"value": v, "met": v >= TARGETS["eval_speedup_beam3"]}
    if "latency" in res:
        v = res["latency"]["p50_ms"]
        out["latency_beam3_p50<250ms"] = {"value": v, "met": v < TARGETS["latency_p50_ms"]}
    if "latency_stored" in res:
        v = res["latency_stored"]["p50_ms"]
        out["latency_stored_p50<150ms"] = {"value": v, "met": v < TARGETS["latency_stored_p50_ms"]}
    if "latency_explain" in res:
        v = res["latency_explain"]["p50_ms"]
        out["explain_12_words_p50<100ms"] = {"value": v, "met": v < TARGETS["explain_p50_ms"]}
    return out


def _scst_rows(ts: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    if not ts:
        return []
    return [("train, self-critical (SCST), cached", f"{ts['sampled_captions_per_s']:,.0f} sampled captions/s",
             f"{ts['images_per_batch']} img x {ts['samples_per_image']} samples, median step "
             f"{ts['step_ms_median']:.0f} ms, {ts['mean_sample_tokens']:.1f} tokens/sample")]


def _load_rows(ld: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    if not ld:
        return []
    return [("  loading a cached batch (the real loader)", f"{ld['cold_ms_median']:.1f} ms cold, "
             f"{ld['warm_ms_median']:.1f} ms warm", f"{ld['batch_images']} img of {ld['shape']} "
             f"({ld['batch_mib']:.1f} MiB) from a memory map: read, collate, float32")]


def _coco_rows(co: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    if not co:
        return []
    return [("COCO epoch, cached features", f"{co['cached_epoch_minutes']:.1f} min",
             f"+ {co['feature_cache_build_minutes']:.1f} min to build the cache once"),
            ("  with loading", f"{co['cached_epoch_minutes_overlapped']:.1f} - "
             f"{co['cached_epoch_minutes_with_loading']:.1f} min",
             f"{co['load_ms_per_batch']:.1f} ms/batch, hidden by prefetch .. read in turn"),
            ("COCO epoch, resnet101 fine-tuned", f"{co['fine_tune_epoch_minutes']:.1f} min", co["fine_tune_encoder"])]


def _breakdown_rows(bd: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    if not bd:
        return []
    return [("one photo at the stored settings: read + preprocess / encoder / decoding / concepts",
             f"{bd['read_preprocess_ms']:.1f} / {bd['encoder_ms']:.1f} / {bd['decoding_ms']:.1f} / "
             f"{bd['concepts_ms']:.1f} ms", f"medians of {bd['runs']} runs over {bd['photos']} JPEGs in "
             f"{bd['photo_folder']}, beam {bd['beam']}"),
            ("  caption() / explain() end to end", f"{bd['caption_ms']:.1f} / {bd['explain_ms']:.1f} ms",
             f"{bd['caption_over_preprocess_encoder']:.2f}x / {bd['explain_over_preprocess_encoder']:.2f}x "
             f"preprocess + encoder; explain's decoder part {bd['explain_decoder_ms']:.1f} ms ({bd['words']} words)")]


def _train_cached_rows(tc: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """The cached-feature training rows: op by op (fast), naive, and recorded (train.capture, on a GPU)."""
    if not tc:
        return []
    rows, what = [], f"{tc['batch_images']} img x 5 caps, {tc['features']}, V={tc['vocab']}"
    for mode in ("fast", "naive", "recorded"):
        if mode not in tc:  # recorded: CUDA only
            continue
        r = tc[mode]
        extra = (f"median step {r['step_ms_median']:.0f} ms, padded length {r['mean_padded_len']:.1f}, "
                 f"{r['mean_caption_tokens']:.1f} tokens/caption")
        if "mfu" in r:
            extra += f", {r['tflops']:.1f} TFLOP/s ({r['mfu']:.1%} of peak)"
        rows.append((f"train, cached features, {mode}", f"{r['captions_per_s']:,.0f} captions/s", extra))
    rows.append(("  fast / naive", f"{tc['speedup']:.1f}x", what))
    if "recorded_speedup" in tc:
        rows.append(("  recorded / naive", f"{tc['recorded_speedup']:.1f}x", "train.capture: one graph a shape"))
    return rows + _load_rows(tc.get("load"))


def format_table(res: dict[str, Any]) -> str:
    rows: list[tuple[str, str, str]] = []
    rows += _train_cached_rows(res.get("train_cached"))
    rows += _load_rows(res.get("load_cached"))
    rows += _scst_rows(res.get("train_scst"))
    te = res.get("train_encoder")
    if te:
        for mode in ("frozen", "fine_tuned"):
            r = te[mode]
            rows.append((f"train, {te['encoder']} {te['image_size']}px in loop, {mode.replace('_', '-')}",
                         f"{r['captions_per_s']:,.0f} captions/s",
                         f"{r['images_per_s']:.1f} images/s, median step {r['step_ms_median']:.0f} ms"))
    ev = res.get("eval")
    if ev:
        for beam in (1, 3, 5):
            r = ev.get(f"beam{beam}")
            if r:
                rows.append((f"eval, batched beam {beam}", f"{r['images_per_s']:,.1f} images/s",
                             f"{ev['images']} images, {r['mean_words']:.1f} words/caption"))
        for key, label in (("one_image_beam3", "eval, beam 3, one image per call"),
                           ("naive_beam3", "eval, beam 3, naive")):
            r = ev[key]
            how = "W_a a_i projected once" if key == "one_image_beam3" else "one image per call, W_a a_i every step"
            rows.append((label, f"{r['images_per_s']:,.1f} images/s",
                         f"{r['images']} images, {r['ms_per_image_median']:.0f} ms/image, {how}"))
        rows.append(("  batched / naive (beam 3)", f"{ev['speedup_beam3']:.1f}x",
                     f"1,000 images: {ev['seconds_1000_images_beam3']:.1f} s vs "
                     f"{ev['naive_beam3']['seconds_1000_images']:.0f} s"))
        rows.append(("  batched / one image per call", f"{ev['speedup_beam3_vs_one_image']:.1f}x",
                     f"1,000 images: {ev['seconds_1000_images_beam3']:.1f} s vs "
                     f"{ev['one_image_beam3']['seconds_1000_images']:.0f} s"))
    for key, label in (("latency", "caption latency, 1 image, beam 3"), ("latency_bf16", "  the same in bfloat16"),
                       ("latency_eager_search", "  the same, the search not recorded (--eager)"),
                       ("latency_stored", "caption latency, 1 image, the file's stored settings"),
                       ("latency_stored_int8", "  the same in int8 (the decoder step's products)"),
                       ("latency_explain", "explain() latency, 1 image, 12-word sentence")):
        la = res.get(key)
        if la:
            rows.append((label, f"p50 {la['p50_ms']:.0f} ms, p95 {la['p95_ms']:.0f} ms",
                         f"incl. preprocessing of a {la['image']}, {la['mean_words']:.1f} words"))
    rows += _breakdown_rows(res.get("latency_breakdown"))
    rows += _launches_rows(res)
    rows += _coco_rows(res.get("coco_epoch"))
    rows.append(("peak memory", f"{res['peak_memory_mb']:,.0f} MiB",
                 "max RSS of the process" if res["device"] == "cpu" else "torch.cuda.max_memory_allocated"))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"| {'measurement'.ljust(w0)} | {'result'.ljust(w1)} | notes |", f"|{'-' * (w0 + 2)}|{'-' * (w1 + 2)}|-------|"]
    lines += [f"| {a.ljust(w0)} | {b.ljust(w1)} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def _launches_rows(res: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = []
    for key in ("launches", "launches_device_search", "launches_captured_search"):
        lc = res.get(key)
        if lc:
            one, many = lc["one_caption"], lc["batch"]
            rows.append((f"launches, one caption ({lc['search']})", f"{one['ops']:,} ops, {one['syncs']} syncs",
                         f"{one['kernels']:,} of the ops compute (not views), {one['reads']} host reads "
                         "(bench/launches.py)"))
            rows.append((f"launches, caption_batch of {lc['batch_photos']}",
                         f"{lc['batch_ops_per_photo']:,.0f} ops a photo, {many['syncs']} syncs",
                         f"{lc['batch_kernels_per_photo']:,.0f} compute a photo, {many['reads']} host reads in all, "
                         "reading included"))
    tl = res.get("launches_train_step")
    if tl:
        for mode in ("op_by_op", "recorded"):
            c = tl[mode]
            rows.append((f"launches, a training step {mode.replace('_', ' ')}", f"{c['ops']:,} ops, {c['syncs']} syncs",
                         f"{c['kernels']:,} compute, {c['graph_launches']} graph launches; {tl['batch_images']} "
                         f"photos x 5 captions of {tl['words']} words, {tl['preset']} shapes; "
                         f"{tl['optimizer_host_reads']} syncs are Adam's host-side counters"))
    return rows


def max_key(d: Any, key: str) -> float:
    """Largest value of `key` anywhere in nested dicts (CUDA peaks are reset per section)."""
    if not isinstance(d, dict):
        return 0.0
    return max([float(d.get(key, 0.0))] + [max_key(v, key) for v in d.values()])


def machine(device: torch.device, threads: int) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
                            "cpu_count": os.cpu_count(), "torch_threads": threads, "platform": platform.platform()}
    try:
        info["load_average_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
