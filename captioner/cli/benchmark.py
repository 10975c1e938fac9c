"""Measure training, evaluation and captioning speed on synthetic inputs of real shapes (no dataset).

    python scripts/benchmark.py                      # CPU default: flickr8k preset, ~2-3 minutes
    python scripts/benchmark.py --quick --json       # tiny counts (tests)
    python scripts/benchmark.py --device cuda --preset coco --compile --coco-epoch

Sections (each printed as a table row, or one JSON object with --json):

* train_cached: decoder training throughput (captions/s: forward + backward + Adam step) on cached
  features. "fast" is the real training path: batches of images x 5 captions grouped by caption
  length (BucketBatchSampler), captions sorted by length, W_a a_i projected once per image and shared
  by its captions, padded positions never computed (forward_loss fast=True). "naive" is the textbook
  loop on the same model and batch sizes: no length bucketing, every caption carries its own copy
  of the image features (so nothing is shared), W_a a_i recomputed every step, every padded position
  computed (forward_loss fast=False). Caption lengths are sampled from the dataset's length
  distribution (Flickr8k: 10.8 +- 3.8 words, COCO: 10.5 +- 2.8; measured on the real captions).
* train_encoder: the same with an EfficientNet-Lite0 (224 px, random weights) in the loop, frozen
  (as with augmentation) and fine-tuned.
* eval: images/s of batched beam search at beam 1/3/5 (100 images per call, as validation does) and of
  the naive one-image-at-a-time beam search (same decode function, one image per call) at beam 3.
  Decoding time depends on caption length, so the model must stop like a trained one: a checkpoint
  (--checkpoint, default: the bundled model when it exists) or an untrained decoder in which one LSTM
  unit counts steps and drives the <end> logit, calibrated so captions average the dataset's length
  with its spread (a constant <end> bias cannot do it: an untrained decoder then ends every caption
  at the first word or none before max_len). The output says which.
* latency: one PIL image -> caption at beam 3 through Captioner.caption (preprocessing, encoder,
  beam search), p50/p95 over repeated runs; the bundled model, --checkpoint, or a randomly
  initialised model of the bundled recipe (EfficientNet-Lite2, 260 px, 9x9 grid, length counter as
  above) when neither exists.
* peak memory: CPU: process max RSS (cumulative high-water mark); CUDA: torch.cuda.max_memory_allocated
  per section.

Timings: every measurement is warmed up first; step times and latencies are medians (the table's
captions/s is captions per batch / median step time), which keeps other load on the machine from
dominating. On CUDA: bf16 autocast for training, optional --compile (decoder step), achieved TFLOP/s
of the decoder training step (main matmuls counted analytically, backward = 2x forward) against
--peak-tflops, and --coco-epoch extrapolates the time of one COCO epoch (113,287 images x 5 captions).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn

COCO_TRAIN_IMAGES = 113_287  # Karpathy train split (train2014 + restval)
CAPTIONS_PER_IMAGE = 5
START, END, PAD = 1, 2, 0  # Vocab's fixed special ids


@dataclass(frozen=True)
class Preset:
    name: str
    vocab: int
    encoder: str  # the encoder the cached features come from
    image_size: int
    grid: int
    feat_dim: int
    embed_dim: int
    hidden_dim: int
    attention_dim: int
    len_mean: float  # words per caption (without <start>/<end>)
    len_std: float
    len_min: int
    len_max: int
    max_decode_len: int

    @property
    def regions(self) -> int:
        return self.grid * self.grid


PRESETS = {
    # configs/flickr8k_cpu.yaml (the bundled model's recipe): Lite2 at 260 px -> 9x9x1280; vocabulary
    # of the words seen >= 5 times in Flickr8k train (~2.5k); lengths measured on captions.txt
    "flickr8k": Preset("flickr8k", 2_500, "efficientnet_lite2", 260, 9, 1280, 512, 512, 512, 10.8, 3.8, 1, 36, 30),
    # configs/coco_resnet101.yaml: ResNet-101 at 448 px -> 14x14x2048, LSTM 1800 (the paper's COCO size)
    "coco": Preset("coco", 10_000, "resnet101", 448, 14, 2048, 512, 1800, 512, 10.5, 2.8, 5, 50, 50),
}


@dataclass
class Counts:
    batch_images: int
    steps: int  # timed steps, fast cached-feature training
    naive_steps: int
    encoder_steps: int
    encoder_batch: int
    warmup: int
    eval_images: int
    naive_eval_images: int
    latency_runs: int
    calib_images: int
    calib_iters: int


def _counts(args: argparse.Namespace, cuda: bool) -> Counts:
    if args.quick:
        c = Counts(batch_images=4, steps=3, naive_steps=1, encoder_steps=1, encoder_batch=1, warmup=1,
                   eval_images=4, naive_eval_images=2, latency_runs=2, calib_images=4, calib_iters=3)
    elif cuda:
        c = Counts(batch_images=16, steps=30, naive_steps=10, encoder_steps=10, encoder_batch=16, warmup=5,
                   eval_images=1000, naive_eval_images=100, latency_runs=30, calib_images=32, calib_iters=6)
    else:  # a 2-core CPU: about 2-3 minutes in all
        c = Counts(batch_images=16, steps=6, naive_steps=2, encoder_steps=2, encoder_batch=16, warmup=1,
                   eval_images=100, naive_eval_images=25, latency_runs=20, calib_images=16, calib_iters=4)
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


# ---------------------------------------------------------------- helpers

class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], Any]) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux, bytes on macOS
    return kb / 2**20 if sys.platform == "darwin" else kb / 1024


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _autocast(device: torch.device, amp: bool):
    if amp and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


def sample_lengths(preset: Preset, n: int, rng: np.random.Generator) -> np.ndarray:
    """Caption lengths in words: a discretised gamma with the dataset's mean and std (right-skewed
    like real captions), clipped to the dataset's range."""
    shape = (preset.len_mean / preset.len_std) ** 2
    scale = preset.len_std ** 2 / preset.len_mean
    return np.clip(np.rint(rng.gamma(shape, scale, size=n)), preset.len_min, preset.len_max).astype(int)


def synthetic_features(n: int, preset_or_shape, generator: torch.Generator | None = None) -> torch.Tensor:
    """Post-ReLU6-like annotation vectors (n, P, D): non-negative, sparse, at most 6."""
    if isinstance(preset_or_shape, Preset):
        P, D = preset_or_shape.regions, preset_or_shape.feat_dim
    else:
        P, D = preset_or_shape
    return torch.randn(n, P, D, generator=generator).clamp_(0, 6)


def _vocab(size: int):
    from ..vocab import SPECIALS, Vocab

    return Vocab(list(SPECIALS) + [f"w{i}" for i in range(size - len(SPECIALS))])


# ---------------------------------------------------------------- synthetic batches

def make_batches(preset: Preset, n_batches: int, batch_images: int, bucket: bool, seed: int = 0):
    """Batches of (image features, 5 caption id lists) collated like training: a pool of images with
    sampled caption lengths goes through BucketBatchSampler (bucket=True groups similar lengths;
    False is a plain shuffle) and `collate` (captions sorted by length, image_index)."""
    from ..data.dataset import BucketBatchSampler, collate

    rng = np.random.default_rng(seed)
    pool = max(batch_images * 100, n_batches * batch_images)  # >= two bucketing windows (50 batches each)
    lengths = sample_lengths(preset, pool * CAPTIONS_PER_IMAGE, rng).reshape(pool, CAPTIONS_PER_IMAGE)
    sampler = BucketBatchSampler(lengths.mean(1).tolist(), batch_images, seed=seed, bucket=bucket)
    chosen = [b for b in sampler.batches() if len(b) == batch_images][:n_batches]
    g = torch.Generator().manual_seed(seed)
    out = []
    for idx in chosen:
        feats = synthetic_features(len(idx), preset, g)
        samples = []
        for k, i in enumerate(idx):
            caps = [[START] + rng.integers(4, preset.vocab, size=int(L)).tolist() + [END] for L in lengths[i]]
            samples.append((feats[k], caps))
        out.append(collate(samples))
    return out


def naive_batch(batch):
    """The same captions without sharing: each caption carries its own copy of its image's features."""
    from ..data.dataset import Batch

    return Batch(batch.images[batch.image_index].contiguous(), batch.inputs, batch.targets, batch.lengths,
                 torch.arange(len(batch.lengths)))


# ---------------------------------------------------------------- FLOPs (analytic, main matmuls)

def decoder_train_flops(preset: Preset, batch, fast: bool) -> float:
    """Multiply-adds x 2 of the decoder's matmuls for one teacher-forced batch, x3 for forward +
    backward. Element-wise ops (tanh, softmax, sigmoid) are not counted."""
    E, H, A, D, P, V = (preset.embed_dim, preset.hidden_dim, preset.attention_dim, preset.feat_dim,
                        preset.regions, preset.vocab)
    B, T = batch.inputs.shape
    Bi = batch.images.shape[0]
    per_row = H * A + P * A + P * D + H + D * 4 * H + H * 4 * H + H * E + D * E + E * V
    if fast:
        row_steps = int(batch.lengths.sum())
        macs = row_steps * per_row + Bi * P * D * A
    else:
        row_steps = B * T
        macs = row_steps * (per_row + P * D * A)
    macs += B * T * E * 4 * H + B * 2 * D * H  # embedding gates for all positions, init_h/init_c
    return 3 * 2 * float(macs)


# ---------------------------------------------------------------- training

def _train_step(model, optimizer, batch, cfg, from_features: bool, fast: bool, device, amp: bool) -> None:
    from ..engine import forward_loss

    with _autocast(device, amp):
        terms = forward_loss(model, batch, cfg, from_features, fast=fast)
    optimizer.zero_grad(set_to_none=True)
    terms.total.backward()
    if cfg.train.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.train.grad_clip)
    optimizer.step()


def _decoder_model(preset: Preset, compile_step: bool):
    from ..model.captioner import CaptionModel
    from ..model.decoder import Decoder

    decoder = Decoder(preset.vocab, preset.feat_dim, preset.embed_dim, preset.hidden_dim, preset.attention_dim, 0.5)
    model = CaptionModel(nn.Identity(), decoder)  # type: ignore[arg-type]  # features are cached: no encoder
    if compile_step:
        decoder.step = torch.compile(decoder.step)  # type: ignore[method-assign]  # as fit() does
    return model


def truncate(batch, steps: int):
    """The first `steps` words of every caption: a cheap warm-up batch of the same width."""
    from ..data.dataset import Batch

    return Batch(batch.images, batch.inputs[:, :steps], batch.targets[:, :steps], batch.lengths.clamp(max=steps),
                 batch.image_index)


def _time_steps(step: Callable[[Any], None], batches: list, warmup: int, timer: Timer,
                warmup_steps: int = 0) -> list[float]:
    """Run `warmup` batches untimed (truncated to `warmup_steps` words when > 0: allocator, Adam state
    and kernels warm up without paying for a whole naive step), then time the rest one by one."""
    for b in batches[:warmup]:
        step(truncate(b, warmup_steps) if warmup_steps else b)
    return [timer(lambda b=b: step(b)) for b in batches[warmup:]]


def _rate(times: list[float], items_per_step: float) -> dict[str, float]:
    med = statistics.median(times)
    return {"step_ms_median": med * 1e3, "captions_per_s": items_per_step / med,
            "captions_per_s_mean": items_per_step * len(times) / sum(times), "timed_steps": len(times)}


def bench_train_cached(preset: Preset, counts: Counts, device: torch.device, amp: bool, compile_step: bool,
                       peak_tflops: float, log: Callable[[str], None]) -> dict[str, Any]:
    from ..config import Config

    cfg = Config()
    timer = Timer(device)
    n_caps = counts.batch_images * CAPTIONS_PER_IMAGE
    result: dict[str, Any] = {"preset": preset.name, "batch_images": counts.batch_images,
                              "captions_per_batch": n_caps, "vocab": preset.vocab,
                              "features": f"{preset.grid}x{preset.grid}x{preset.feat_dim}",
                              "decoder": f"E{preset.embed_dim} H{preset.hidden_dim} A{preset.attention_dim}"}
    for mode, fast in (("fast", True), ("naive", False)):
        n_steps = counts.steps if fast else counts.naive_steps
        warmup = counts.warmup + (2 if compile_step and device.type == "cuda" else 0)
        batches = make_batches(preset, n_steps + warmup, counts.batch_images, bucket=fast, seed=1)
        if not fast:
            batches = [naive_batch(b) for b in batches]
        batches = [b.to(device) for b in batches]
        torch.manual_seed(0)
        model = _decoder_model(preset, compile_step).to(device).train()
        optimizer = torch.optim.Adam(model.decoder.parameters(), lr=cfg.train.lr)
        _reset_peak(device)
        log(f"train_cached/{mode}: {warmup} warm-up + {n_steps} timed steps of {n_caps} captions")
        # the naive warm-up is truncated on CPU, where one naive step costs tens of seconds
        times = _time_steps(lambda b: _train_step(model, optimizer, b, cfg, True, fast, device, amp),
                            batches, warmup, timer, warmup_steps=0 if fast or device.type == "cuda" else 3)
        timed = batches[warmup:]
        r = _rate(times, n_caps)
        r["mean_padded_len"] = float(np.mean([b.inputs.shape[1] for b in timed]))
        r["mean_caption_tokens"] = float(np.mean([float(b.lengths.float().mean()) for b in timed]))
        flops = [decoder_train_flops(preset, b, fast) for b in timed]
        r["gflop_per_step"] = statistics.median(flops) / 1e9
        r["tflops"] = sum(flops) / sum(times) / 1e12
        if device.type == "cuda":
            r["mfu"] = r["tflops"] / peak_tflops
        r["peak_memory_mb"] = _peak_memory_mb(device)
        result[mode] = r
        del model, optimizer, batches
    result["speedup"] = result["fast"]["captions_per_s"] / result["naive"]["captions_per_s"]
    return result


def bench_train_encoder(preset: Preset, counts: Counts, device: torch.device, amp: bool, encoder: str,
                        image_size: int, grid: int, log: Callable[[str], None], modes=("frozen", "fine_tuned")
                        ) -> dict[str, Any]:
    """Images -> encoder -> decoder loss -> backward -> Adam, with the encoder frozen or fine-tuned."""
    from ..config import Config
    from ..data.dataset import Batch
    from ..model.captioner import CaptionModel
    from ..model.decoder import Decoder
    from ..model.encoder import build_encoder

    cfg = Config()
    timer = Timer(device)
    bi = counts.encoder_batch
    n_caps = bi * CAPTIONS_PER_IMAGE
    result: dict[str, Any] = {"encoder": encoder, "image_size": image_size, "grid": grid, "batch_images": bi,
                              "captions_per_batch": n_caps}
    for mode in modes:
        torch.manual_seed(0)
        enc = build_encoder(encoder, False, grid)
        dec = Decoder(preset.vocab, enc.out_dim, preset.embed_dim, preset.hidden_dim, preset.attention_dim, 0.5)
        model = CaptionModel(enc, dec).to(device).to(memory_format=torch.channels_last).train()
        groups = [{"params": list(dec.parameters()), "lr": cfg.train.lr}]
        if mode == "fine_tuned":
            groups.append({"params": list(enc.parameters()), "lr": cfg.train.encoder_lr})
        else:
            enc.requires_grad_(False)
            enc.eval()  # frozen: ImageNet batch-norm statistics, as train_one_epoch does
        optimizer = torch.optim.Adam(groups)
        warmup = counts.warmup
        shapes = Preset(preset.name, preset.vocab, encoder, image_size, grid, enc.out_dim, preset.embed_dim,
                        preset.hidden_dim, preset.attention_dim, preset.len_mean, preset.len_std, preset.len_min,
                        preset.len_max, preset.max_decode_len)
        batches = []
        g = torch.Generator().manual_seed(2)
        for b in make_batches(shapes, counts.encoder_steps + warmup, bi, bucket=True, seed=2):
            images = torch.randn(bi, 3, image_size, image_size, generator=g)
            b = Batch(images, b.inputs, b.targets, b.lengths, b.image_index).to(device)
            b.images = b.images.contiguous(memory_format=torch.channels_last)
            batches.append(b)
        _reset_peak(device)
        log(f"train_encoder/{mode}: {encoder} {image_size}px, {warmup} warm-up + {counts.encoder_steps} timed steps")
        times = _time_steps(lambda b: _train_step(model, optimizer, b, cfg, False, True, device, amp),
                            batches, warmup, timer)
        r = _rate(times, n_caps)
        r["images_per_s"] = bi / statistics.median(times)
        r["peak_memory_mb"] = _peak_memory_mb(device)
        if mode == "frozen":  # encoder forward alone: what building the feature cache costs
            enc.eval()
            x = batches[-1].images

            def encode():
                with torch.no_grad(), _autocast(device, amp):
                    enc(x)
            encode()
            enc_times = [timer(encode) for _ in range(max(2, counts.encoder_steps))]
            r["encode_images_per_s"] = bi / statistics.median(enc_times)
        result[mode] = r
        del model, optimizer, batches
    return result


# ---------------------------------------------------------------- evaluation

def _decode_lengths(decoder, feats: torch.Tensor, beam: int, max_len: int, chunk: int = 100) -> list[int]:
    from ..decoding import decode

    out = []
    for k in range(0, len(feats), chunk):
        hyps = decode(decoder, feats[k:k + chunk], START, END, PAD, beam, max_len, 0.0)
        out.extend(len(h[0].tokens) for h in hyps)
    return out


@torch.no_grad()
def install_length_counter(decoder, feats: torch.Tensor, spread_words: float, step: float = 0.025) -> None:
    """Make an untrained decoder stop like a trained one. A random decoder's logits barely depend on
    its state, so it emits <end> at the first step or never (and then runs to max_len, several times
    a real caption's cost); no constant <end> bias fixes that. Instead one LSTM unit k becomes a step
    counter and drives the <end> logit: its gates are constant (input, forget, output gates open,
    candidate = `step`), so c_k(t) = c_k(0) + t * step, and one deep-output dimension j reads
    tanh(50 h_k), which flips from -1 to +1 when c_k crosses 0; the <end> logit is 8 * out_j. The
    start c_k(0) = tanh(f_init,c(mean a_i))_k depends on the image, so lengths spread over images
    (about `spread_words` std); its mean is set by `set_length_offset`. Every tensor keeps its shape,
    so decoding costs exactly what it costs for a trained model of the same size."""
    H = decoder.hidden_dim
    k, j = 0, 0
    rows = [k, H + k, 2 * H + k, 3 * H + k]  # i, f, g, o of unit k
    for lin in (decoder.gates_embed, decoder.gates_context, decoder.gates_hidden):
        lin.weight[rows] = 0
    decoder.gates_hidden.bias[rows] = torch.tensor([12.0, 12.0, math.atanh(step), 12.0])
    decoder.out_hidden.weight[j] = 0
    decoder.out_hidden.weight[j, k] = 50.0
    decoder.out_hidden.bias[j] = 0
    decoder.out_context.weight[j] = 0
    decoder.out_context.bias[j] = 0
    decoder.embedding.weight[:, j] = 0
    decoder.out_vocab.weight[:, j] = 0
    decoder.out_vocab.weight[END] = 0
    decoder.out_vocab.weight[END, j] = 8.0
    decoder.out_vocab.bias[END] = 0
    # c_k(0) spread: a random direction of f_init,c scaled so it varies by spread_words * step over images
    m = feats.float().mean(1)  # (n, D)
    v = torch.randn(m.shape[1], generator=torch.Generator().manual_seed(6)).to(m)
    sd = float((m @ v).std()) if len(m) > 1 else 0.0
    decoder.init_c.weight[k] = v * (spread_words * step / sd) if spread_words > 0 and sd > 1e-6 else 0.0
    decoder.init_c.bias[k] = -float((m @ decoder.init_c.weight[k]).mean())
    decoder._length_step = step  # type: ignore[attr-defined]


@torch.no_grad()
def set_length_offset(decoder, words: float) -> None:
    """Centre the counter so it crosses zero after about `words` steps (see install_length_counter)."""
    k = 0
    base = getattr(decoder, "_length_base", None)
    if base is None:
        base = decoder._length_base = float(decoder.init_c.bias[k])  # type: ignore[attr-defined]
    decoder.init_c.bias[k] = base + math.atanh(max(-0.99, min(0.99, -words * decoder._length_step)))


@torch.no_grad()
def calibrate_lengths(decoder, feats: torch.Tensor, target_words: float, spread_words: float, max_len: int,
                      iters: int, log: Callable[[str], None] = lambda s: None) -> dict[str, float]:
    """install_length_counter, then bisect its offset until the captions of `feats` average
    `target_words` words; returns the offset and the mean length reached. The counter ignores the
    words, so every beam size gives the same lengths: greedy decoding calibrates them all."""
    install_length_counter(decoder, feats, spread_words)
    beam = 1
    lo, hi = target_words - 4.0, target_words + 4.0  # mean length grows with the offset (about offset - 0.5)
    best = (math.inf, target_words, float("nan"))
    for _ in range(iters):
        mid = (lo + hi) / 2
        set_length_offset(decoder, mid)
        mean = float(np.mean(_decode_lengths(decoder, feats, beam, max_len)))
        if abs(mean - target_words) < best[0]:
            best = (abs(mean - target_words), mid, mean)
        if mean < target_words:
            lo = mid
        else:
            hi = mid
    set_length_offset(decoder, best[1])
    log(f"  length counter offset {best[1]:.1f}: captions average {best[2]:.1f} words (target {target_words})")
    return {"length_offset": best[1], "calibrated_mean_words": best[2], "target_words": target_words}


def _default_checkpoint(path: str | None) -> str | None:
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

        cap = load(checkpoint, device="cpu")
        dec = cap.model.decoder
        shape = (cap.config.model.grid_size ** 2, cap.model.encoder.out_dim)
        return dec.to(device).eval(), shape, cap.config.decode.max_len, {"model": f"checkpoint {checkpoint}"}
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
    from ..decoding import decode

    timer = Timer(device)
    n = counts.eval_images
    feats = synthetic_features(n, shape, torch.Generator().manual_seed(4)).to(device)
    result: dict[str, Any] = {"images": n, "batch": min(n, 100), "max_len": max_len}
    _reset_peak(device)
    for beam in beams:
        _decode_lengths(decoder, feats[:min(n, 8)], beam, max_len)  # warm-up
        lens: list[int] = []
        log(f"eval/batched beam {beam}: {n} images")
        t = timer(lambda: lens.extend(_decode_lengths(decoder, feats, beam, max_len)))
        result[f"beam{beam}"] = {"images_per_s": n / t, "seconds": t, "mean_words": float(np.mean(lens))}
    m = counts.naive_eval_images
    decode(decoder, feats[:1], START, END, PAD, 3, max_len)  # warm-up
    log(f"eval/naive beam 3, one image per call: {m} images")
    per_image = [timer(lambda i=i: decode(decoder, feats[i:i + 1], START, END, PAD, 3, max_len)) for i in range(m)]
    result["naive_beam3"] = {"images_per_s": m / sum(per_image), "images": m,
                             "ms_per_image_median": statistics.median(per_image) * 1e3}
    result["speedup_beam3"] = result["beam3"]["images_per_s"] / result["naive_beam3"]["images_per_s"]
    result["seconds_1000_images_beam3"] = 1000 / result["beam3"]["images_per_s"]
    result["naive_seconds_1000_images_beam3"] = 1000 / result["naive_beam3"]["images_per_s"]
    result["peak_memory_mb"] = _peak_memory_mb(device)
    return result


# ---------------------------------------------------------------- single-image latency

def latency_image():
    """A 500x375 photo-sized PIL image (Flickr8k's typical size) with smooth structure, not white noise."""
    from PIL import Image

    small = np.random.default_rng(5).integers(0, 256, size=(12, 16, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((500, 375), Image.BICUBIC)


def latency_captioner(checkpoint: str | None, counts: Counts, device: torch.device, log: Callable[[str], None]):
    """(Captioner, description). Without a checkpoint: a randomly initialised model of the bundled
    recipe (flickr8k preset) with the length counter, calibrated on its own encoder's features of
    the benchmark image (a random encoder's features look nothing like the synthetic ones)."""
    from ..api import Captioner, load
    from ..config import Config
    from ..model.captioner import build_model

    if checkpoint:
        return load(checkpoint, device=device), f"checkpoint {checkpoint}"
    p = PRESETS["flickr8k"]
    cfg = Config()
    cfg.model.encoder, cfg.model.image_size, cfg.model.grid_size = p.encoder, p.image_size, p.grid
    cfg.model.embed_dim, cfg.model.hidden_dim, cfg.model.attention_dim = p.embed_dim, p.hidden_dim, p.attention_dim
    cfg.decode.max_len = p.max_decode_len
    torch.manual_seed(0)
    cap = Captioner(build_model(cfg.model, p.vocab, pretrained=False), _vocab(p.vocab), cfg, device=device)
    with torch.no_grad():
        x = cap.preprocess(latency_image()).unsqueeze(0).to(device)
        feats = cap.model.encode(x.contiguous(memory_format=torch.channels_last))
    log("calibrating the untrained latency model's length counter")
    words = calibrate_lengths(cap.model.decoder, feats, p.len_mean, 0.0, p.max_decode_len, 6, log)
    words = words["calibrated_mean_words"]
    return cap, (f"no bundled model: randomly initialised {p.encoder} {p.image_size}px {p.grid}x{p.grid} "
                 f"(configs/flickr8k_cpu.yaml shapes), decoder with a step counter driving <end> ({words:.0f} words)")


def bench_latency(cap, counts: Counts, device: torch.device, beam: int = 3, log: Callable[[str], None] = print
                  ) -> dict[str, Any]:
    timer = Timer(device)
    img = latency_image()
    words: list[int] = []
    for _ in range(max(2, counts.warmup + 1)):
        cap.caption(img, beam_size=beam)
    _reset_peak(device)
    log(f"latency: {counts.latency_runs} single-image captions at beam {beam}")
    times = []
    for _ in range(counts.latency_runs):
        out: list = []
        times.append(timer(lambda: out.append(cap.caption(img, beam_size=beam))))
        words.append(len(out[0].words))
    ms = np.array(times) * 1e3
    return {"beam": beam, "runs": len(times), "p50_ms": float(np.percentile(ms, 50)),
            "p95_ms": float(np.percentile(ms, 95)), "min_ms": float(ms.min()), "mean_words": float(np.mean(words)),
            "image": "500x375 PIL RGB", "peak_memory_mb": _peak_memory_mb(device)}


# ---------------------------------------------------------------- COCO epoch (CUDA)

def bench_coco_epoch(counts: Counts, device: torch.device, amp: bool, compile_step: bool, peak_tflops: float,
                     cached: dict[str, Any] | None, log: Callable[[str], None]) -> dict[str, Any]:
    p = PRESETS["coco"]
    if cached is None or cached.get("preset") != "coco":
        cached = bench_train_cached(p, counts, device, amp, compile_step, peak_tflops, log)
    enc = bench_train_encoder(p, counts, device, amp, "resnet101", p.image_size, p.grid, log)
    captions = COCO_TRAIN_IMAGES * CAPTIONS_PER_IMAGE
    return {
        "images": COCO_TRAIN_IMAGES, "captions": captions,
        "cached_captions_per_s": cached["fast"]["captions_per_s"],
        "cached_epoch_minutes": captions / cached["fast"]["captions_per_s"] / 60,
        "feature_cache_build_minutes": COCO_TRAIN_IMAGES / enc["frozen"]["encode_images_per_s"] / 60,
        "frozen_in_loop_epoch_minutes": captions / enc["frozen"]["captions_per_s"] / 60,
        "fine_tune_captions_per_s": enc["fine_tuned"]["captions_per_s"],
        "fine_tune_epoch_minutes": captions / enc["fine_tuned"]["captions_per_s"] / 60,
        "fine_tune_encoder": f"resnet101 {p.image_size}px {p.grid}x{p.grid}, batch {enc['batch_images']} images",
    }


# ---------------------------------------------------------------- report

TARGETS = {"train_speedup": 3.0, "eval_speedup_beam3": 10.0, "latency_p50_ms": 250.0}


def _targets(res: dict[str, Any]) -> dict[str, Any]:
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
    return out


def format_table(res: dict[str, Any]) -> str:
    rows: list[tuple[str, str, str]] = []
    tc = res.get("train_cached")
    if tc:
        what = f"{tc['batch_images']} img x 5 caps, {tc['features']}, V={tc['vocab']}"
        for mode in ("fast", "naive"):
            r = tc[mode]
            extra = (f"median step {r['step_ms_median']:.0f} ms, padded length {r['mean_padded_len']:.1f}, "
                     f"{r['mean_caption_tokens']:.1f} tokens/caption")
            if "mfu" in r:
                extra += f", {r['tflops']:.1f} TFLOP/s ({r['mfu']:.1%} of peak)"
            rows.append((f"train, cached features, {mode}", f"{r['captions_per_s']:,.0f} captions/s", extra))
        rows.append(("  fast / naive", f"{tc['speedup']:.1f}x", what))
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
        nv = ev["naive_beam3"]
        rows.append(("eval, beam 3, one image per call", f"{nv['images_per_s']:,.1f} images/s",
                     f"{nv['images']} images, {nv['ms_per_image_median']:.0f} ms/image"))
        rows.append(("  batched / one-at-a-time (beam 3)", f"{ev['speedup_beam3']:.1f}x",
                     f"1,000 images: {ev['seconds_1000_images_beam3']:.1f} s vs {ev['naive_seconds_1000_images_beam3']:.0f} s"))
    la = res.get("latency")
    if la:
        rows.append(("caption latency, 1 image, beam 3", f"p50 {la['p50_ms']:.0f} ms, p95 {la['p95_ms']:.0f} ms",
                     f"incl. preprocessing of a {la['image']}, {la['mean_words']:.1f} words"))
    co = res.get("coco_epoch")
    if co:
        rows.append(("COCO epoch, cached features", f"{co['cached_epoch_minutes']:.1f} min",
                     f"+ {co['feature_cache_build_minutes']:.1f} min to build the cache once"))
        rows.append(("COCO epoch, resnet101 fine-tuned", f"{co['fine_tune_epoch_minutes']:.1f} min", co["fine_tune_encoder"]))
    rows.append(("peak memory", f"{res['peak_memory_mb']:,.0f} MiB",
                 "max RSS of the process" if res["device"] == "cpu" else "torch.cuda.max_memory_allocated"))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"| {'measurement'.ljust(w0)} | {'result'.ljust(w1)} | notes |", f"|{'-' * (w0 + 2)}|{'-' * (w1 + 2)}|-------|"]
    lines += [f"| {a.ljust(w0)} | {b.ljust(w1)} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def _max_key(d: Any, key: str) -> float:
    """Largest value of `key` anywhere in nested dicts (CUDA peaks are reset per section)."""
    if not isinstance(d, dict):
        return 0.0
    return max([float(d.get(key, 0.0))] + [_max_key(v, key) for v in d.values()])


def _machine(device: torch.device, threads: int) -> dict[str, Any]:
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="shapes of the cached-feature training and eval benchmarks (default: flickr8k on CPU, coco on CUDA)")
    p.add_argument("--steps", type=int, default=0, help="timed cached-feature training steps (fast mode; naive and "
                   "encoder-in-the-loop modes time a third); 0 = default for the device (CPU 6, CUDA 30)")
    p.add_argument("--batch-images", type=int, default=0, help="images per training batch (x5 captions); default 16")
    p.add_argument("--eval-images", type=int, default=0, help="synthetic images for the eval benchmark "
                   "(default 100 on CPU, 1000 on CUDA)")
    p.add_argument("--checkpoint", default=None, help="trained model for eval and latency (default: the bundled model "
                   "if present, else an untrained model whose <end> is driven by a calibrated step counter)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default; --quick: 1, which "
                   "keeps timings steady on a machine shared with other jobs)")
    p.add_argument("--no-amp", action="store_true", help="CUDA: train in fp32 instead of bf16 autocast")
    p.add_argument("--compile", action="store_true", help="CUDA: torch.compile the decoder step")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="device peak for MFU (default: H100 bf16 dense)")
    p.add_argument("--coco-epoch", action="store_true", help="extrapolate one COCO epoch (cached features and "
                   "resnet101 fine-tuning), meant for CUDA")
    p.add_argument("--only", nargs="*", default=None, choices=["train_cached", "train_encoder", "eval", "latency"],
                   help="run only these sections")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--quick", action="store_true", help="tiny counts (seconds; for tests)")
    args = p.parse_args(argv)

    threads_before = torch.get_num_threads()
    threads = args.threads or (1 if args.quick else 0)
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads_before)  # main() may be called in-process (tests)


def _run(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    cuda = device.type == "cuda"
    preset = PRESETS[args.preset or ("coco" if cuda and not args.quick else "flickr8k")]
    counts = _counts(args, cuda)
    amp = cuda and not args.no_amp
    compile_step = args.compile and cuda
    if cuda:
        torch.backends.cudnn.benchmark = True
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    sections = set(args.only) if args.only else {"train_cached", "train_encoder", "eval", "latency"}

    t_start = time.perf_counter()
    res: dict[str, Any] = {"device": device.type, "preset": preset.name, "quick": args.quick, "amp_bf16": amp,
                           "compile": compile_step, "machine": _machine(device, torch.get_num_threads())}
    torch.manual_seed(0)
    if "train_cached" in sections:
        res["train_cached"] = bench_train_cached(preset, counts, device, amp, compile_step, args.peak_tflops, log)
    if "train_encoder" in sections:
        res["train_encoder"] = bench_train_encoder(preset, counts, device, amp, "efficientnet_lite0", 224, 7, log)
    checkpoint = _default_checkpoint(args.checkpoint)
    if "eval" in sections:
        eval_model = eval_decoder(preset, counts, checkpoint, device, log)
        dec, shape, max_len, info = eval_model
        res["eval"] = {"model": info["model"], **bench_eval(dec, shape, max_len, counts, device, log=log)}
        if "length_offset" in info:
            res["eval"]["length_counter_offset"] = info["length_offset"]
    if "latency" in sections:
        cap, desc = latency_captioner(checkpoint, counts, device, log)
        res["latency"] = {"model": desc, **bench_latency(cap, counts, device, log=log)}
    if args.coco_epoch:
        if not cuda:
            log("note: --coco-epoch on CPU measures COCO shapes with ResNet-101 in the loop; this is slow")
        res["coco_epoch"] = bench_coco_epoch(counts, device, amp, compile_step, args.peak_tflops,
                                             res.get("train_cached"), log)
    res["peak_memory_mb"] = _peak_memory_mb(device) if not cuda else _max_key(res, "peak_memory_mb")
    res["targets"] = _targets(res)
    res["seconds"] = time.perf_counter() - t_start
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        m = res["machine"]
        print(f"\ncaptioner benchmark: {m['device']} ({m.get('gpu') or m.get('cpu', '')}), {m['cpu_count']} CPUs, "
              f"{m['torch_threads']} torch threads, torch {m['torch']}, preset {preset.name}"
              + (f", load average {m['load_average_1m']:.1f} at start" if "load_average_1m" in m else ""))
        if "eval" in res:
            print(f"eval model: {res['eval']['model']}")
        if "latency" in res:
            print(f"latency model: {res['latency']['model']}")
        print(format_table(res))
        for name, t in res["targets"].items():
            print(f"target {name}: {t['value']:.1f} -> {'met' if t['met'] else 'MISSED'}")
        print(f"({res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
