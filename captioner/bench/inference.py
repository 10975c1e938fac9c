"""Evaluation throughput (batched beam search vs one image at a time) and single-image latency."""
from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from .synthetic import (
    END,
    PAD,
    PRESETS,
    START,
    Preset,
    calibrate_lengths,
    decode_lengths,
    make_vocab,
    synthetic_features,
)
from .naive import naive_decoder
from .timing import Counts, Timer, peak_memory_mb, reset_peak


def default_checkpoint(path: str | None) -> str | None:
    from ..api import DEFAULT_CHECKPOINT

    if path:
        return path
    return str(DEFAULT_CHECKPOINT) if DEFAULT_CHECKPOINT.is_file() else None


def eval_decoder(preset: Preset, counts: Counts, checkpoint: str | None, device: torch.device,
                 log: Callable[[str], None]):
    """(decoder, feature shape (P, D), max_len, description) used by eval and, when no checkpoint
    exists, by latency."""
    if checkpoint:
        from ..api import load

        loaded = load(checkpoint, device="cpu")
        dec = loaded.model.decoder
        shape = (loaded.config.model.grid_size ** 2, loaded.model.encoder.out_dim)
        return dec.to(device).eval(), shape, loaded.config.decode.max_len, {"model": f"checkpoint {checkpoint}"}
    from ..model.decoder import Decoder

    torch.manual_seed(0)
    dec = Decoder(preset.vocab, preset.feat_dim, preset.embed_dim, preset.hidden_dim, preset.attention_dim)
    dec = dec.to(device).eval()
    feats = synthetic_features(counts.calib_images, preset, torch.Generator().manual_seed(3)).to(device)
    log(f"calibrating the untrained {preset.name} decoder's length counter on {counts.calib_images} images")
    info = calibrate_lengths(dec, feats, preset.len_mean, preset.len_std, preset.max_decode_len,
                             counts.calib_iters, log)
    info["model"] = (f"untrained {preset.name}-shaped decoder with a step counter driving <end> (captions "
                     f"average {info['calibrated_mean_words']:.1f} words on calibration images)")
    return dec, (preset.regions, preset.feat_dim), preset.max_decode_len, info


@torch.no_grad()
def bench_eval(decoder, shape: tuple[int, int], max_len: int, counts: Counts, device: torch.device,
               beams=(1, 3, 5), log: Callable[[str], None] = print) -> dict[str, Any]:
    """Batched beam search (100 images per call, as evaluate.py does) at each beam size, then beam 3
    one image per call two ways: "one_image" is the product's search (search.decode) with a batch of one (the
    fast path, W_a a_i still projected once per image; on a GPU the fixed-shape search recorded as a CUDA graph,
    decoding/device_beam.py, as a Captioner has it); "naive" is the textbook baseline: the reference
    step (bench/naive.py: Decoder.step, no CPU tricks, search.beam_search), which also recomputes W_a a_i at every
    step as textbook loops do. Both ratios are reported."""
    from ..config import DecodeConfig
    from ..model import graphs
    from ..decoding.search import beam_search, decode
    from ..vocab import SpecialIds

    searches = graphs.Recordings() if device.type == "cuda" else None  # recorded as a Captioner's are on a GPU
    timer = Timer(device)
    n = counts.eval_images
    feats = synthetic_features(n, shape, torch.Generator().manual_seed(4)).to(device)
    result: dict[str, Any] = {"images": n, "batch": min(n, 100), "max_len": max_len}
    reset_peak(device)
    for beam in beams:
        decode_lengths(decoder, feats[:min(n, 8)], beam, max_len, searches=searches)  # warm-up
        log(f"eval/batched beam {beam}: {n} images")
        t, lens = timer.run(partial(decode_lengths, searches=searches), decoder, feats, beam, max_len)
        result[f"beam{beam}"] = {"images_per_s": n / t, "seconds": t, "mean_words": float(np.mean(lens))}
    m = counts.naive_eval_images
    for name, dec, how in (("one_image_beam3", decoder, partial(decode, recorded=searches)),
                           ("naive_beam3", naive_decoder(decoder), beam_search)):
        search = partial(how, dec, ids=SpecialIds(START, END, PAD),
                         settings=DecodeConfig(beam_size=3, max_len=max_len, length_penalty=0.0))
        search(feats[:1])  # warm-up
        log(f"eval/{name.replace('_beam3', '')} beam 3, one image per call: {m} images")
        per_image = [timer(search, feats[i:i + 1]) for i in range(m)]
        rate = m / sum(per_image)
        result[name] = {"images_per_s": rate, "images": m, "ms_per_image_median": statistics.median(per_image) * 1e3,
                        "seconds_1000_images": 1000 / rate}
    result["seconds_1000_images_beam3"] = 1000 / result["beam3"]["images_per_s"]
    result["speedup_beam3"] = result["beam3"]["images_per_s"] / result["naive_beam3"]["images_per_s"]
    result["speedup_beam3_vs_one_image"] = result["beam3"]["images_per_s"] / result["one_image_beam3"]["images_per_s"]
    result["peak_memory_mb"] = peak_memory_mb(device)
    return result


def latency_image():
    """A 500x375 photo-sized PIL image (Flickr8k's typical size) with smooth structure, not white noise."""
    from PIL import Image

    small = np.random.default_rng(5).integers(0, 256, size=(12, 16, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((500, 375), Image.BICUBIC)


def latency_captioner(checkpoint: str | None, counts: Counts, device: torch.device, log: Callable[[str], None],
                      capture: bool = True):
    """(Captioner, description). Without a checkpoint: a randomly initialised model of the bundled
    recipe (flickr8k preset) with the length counter, calibrated on its own encoder's features of
    the benchmark image (a random encoder's features look nothing like the synthetic ones). capture: on a GPU,
    the search recorded as a CUDA graph (api.Captioner)."""
    from ..api import Captioner, load
    from ..config import Config
    from ..model.show_attend_tell import build_model

    if checkpoint:
        return load(checkpoint, device=device, capture=capture), f"checkpoint {checkpoint}"
    p = PRESETS["flickr8k"]
    cfg = Config()
    cfg.model.encoder, cfg.model.image_size, cfg.model.grid_size = p.encoder, p.image_size, p.grid
    cfg.model.embed_dim, cfg.model.hidden_dim, cfg.model.attention_dim = p.embed_dim, p.hidden_dim, p.attention_dim
    cfg.decode.max_len = p.max_decode_len
    torch.manual_seed(0)
    loaded = Captioner(build_model(cfg.model, p.vocab, pretrained=False), make_vocab(p.vocab), cfg, device=device,
                       capture=capture)
    with torch.no_grad():
        x = loaded.preprocess(latency_image()).unsqueeze(0).to(device)
        feats = loaded.model.encode(x.contiguous(memory_format=torch.channels_last))
    log("calibrating the untrained latency model's length counter")
    words = calibrate_lengths(loaded.model.decoder, feats, p.len_mean, 0.0, p.max_decode_len, 6, log)
    words = words["calibrated_mean_words"]
    return loaded, (f"no bundled model: randomly initialised {p.encoder} {p.image_size}px {p.grid}x{p.grid} "
                 f"(configs/flickr8k_cpu.yaml shapes), decoder with a step counter driving <end> ({words:.0f} words)")


def bench_latency(loaded, counts: Counts, device: torch.device, beam: int | None = 3,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Single-image caption latency at `beam`, or with beam None at the model file's stored decode
    settings (beam, evidence, trigram blocking: what users get)."""
    timer = Timer(device)
    img = latency_image()
    words: list[int] = []
    overrides = {} if beam is None else {"beam_size": beam}
    caption_fn = partial(loaded.caption, **overrides)
    for _ in range(max(2, counts.warmup + 1)):
        caption_fn(img)
    reset_peak(device)
    settings = loaded.decode_settings(**overrides)
    log(f"latency: {counts.latency_runs} single-image captions at beam {settings.beam_size}"
        + (" (the file's stored settings)" if beam is None else ""))
    times = []
    for _ in range(counts.latency_runs):
        t, caption = timer.run(caption_fn, img)
        times.append(t)
        words.append(len(caption.words))
    ms = np.array(times) * 1e3
    return {"beam": settings.beam_size, "stored_settings": beam is None, "evidence": settings.evidence,
            "runs": len(times), "p50_ms": float(np.percentile(ms, 50)),
            "p95_ms": float(np.percentile(ms, 95)), "min_ms": float(ms.min()), "mean_words": float(np.mean(words)),
            "image": "500x375 PIL RGB", "peak_memory_mb": peak_memory_mb(device)}



EXPLAIN_SENTENCE = "a brown and white dog is running on the green grass outside"  # 12 words


def bench_explain(loaded, counts: Counts, device: torch.device, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Captioner.explain latency: one photo and a 12-word sentence, preprocessing and encoder included."""
    timer = Timer(device)
    img = latency_image()
    for _ in range(max(2, counts.warmup + 1)):
        loaded.explain(img, EXPLAIN_SENTENCE)
    log(f"latency: {counts.latency_runs} explain() calls of a {len(EXPLAIN_SENTENCE.split())}-word sentence")
    ms = np.array([timer.run(loaded.explain, img, EXPLAIN_SENTENCE)[0] for _ in range(counts.latency_runs)]) * 1e3
    return {"words": len(EXPLAIN_SENTENCE.split()), "runs": len(ms), "p50_ms": float(np.percentile(ms, 50)),
            "p95_ms": float(np.percentile(ms, 95)), "min_ms": float(ms.min()), "mean_words": 12.0,
            "image": "500x375 PIL RGB"}
