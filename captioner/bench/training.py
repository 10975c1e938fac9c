"""Decoder training throughput: cached features (fast vs naive) with the loader's cost of reading a batch beside
the step (loading.py), the encoder in the loop, and a COCO epoch extrapolated from them."""
from __future__ import annotations

import statistics
from functools import partial
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from .loading import bench_load_cached
from .synthetic import (
    CAPTIONS_PER_IMAGE,
    COCO_TRAIN_IMAGES,
    END,
    PRESETS,
    Preset,
    make_batches,
    naive_batch,
)
from .timing import (
    Counts,
    Timer,
    peak_memory_mb,
    rate,
    reset_peak,
    time_steps,
)


def decoder_train_flops(preset: Preset, batch, fast: bool) -> float:
    """Multiply-adds x 2 of the decoder's matmuls for one teacher-forced batch, x3 for forward +
    backward. Element-wise ops (tanh, softmax, sigmoid) are not counted."""
    E, H, A, D, P, V = (preset.embed_dim, preset.hidden_dim, preset.attention_dim, preset.feat_dim,
                        preset.regions, preset.vocab)
    B, T = batch.inputs.shape
    Bi = batch.visual.shape[0]
    per_row = H * A + P * A + P * D + H + D * 4 * H + H * 4 * H + H * E + D * E + E * V
    if fast:
        row_steps = int(batch.lengths.sum())
        macs = row_steps * per_row + Bi * P * D * A
    else:
        row_steps = B * T
        macs = row_steps * (per_row + P * D * A)
    macs += B * T * E * 4 * H + B * 2 * D * H  # embedding gates for all positions, init_h/init_c
    return 3 * 2 * float(macs)


def _train_config(amp: bool, device: torch.device, objective: str = "xent"):
    """Default training settings with bf16 autocast on or off on `device`, as a real run on it sets them:
    train.amp on a GPU, train.cpu_amp on a CPU, which SCST refuses (its backward through sampled captions is
    far slower in CPU bf16: docs/performance.md), so an SCST benchmark on a CPU runs float32 as SCST training does."""
    from ..config import Config

    cfg = Config()
    cfg.train.objective = objective
    cfg.train.amp = amp and device.type != "cpu"
    cfg.train.cpu_amp = amp and device.type == "cpu" and objective != "scst"
    return cfg


def _scaler(device: torch.device, cfg) -> Any:
    """The GradScaler a training run on `device` would use (fp16 on a GPU without bf16), else None."""
    from ..training.run import grad_scaler

    return grad_scaler(device, cfg)


def _train_step(model, optimizer, batch, cfg, fast: bool, device, scaler=None) -> None:
    """engine.train_step (the step fit() runs) on the real objective (fast) or on the textbook loop
    (naive.naive_loss, same clipping and optimiser); `scaler`: fp16's GradScaler where a run would have one."""
    from ..training.engine import train_step
    from ..training.objectives import CrossEntropy, Terms
    from .naive import naive_loss

    if fast:
        objective = partial(CrossEntropy(cfg), model)
    else:
        def objective(b):
            feats = model.encode(b.visual) if cfg.encoder_in_loop else b.visual
            lt = naive_loss(model.decoder, feats, b, cfg)
            return Terms(lt.total, lt.n_tokens)
    train_step(objective, optimizer, batch, cfg, device, scaler=scaler)


def _recorded_step(captured, optimizer, cfg, batch) -> None:
    """A train.capture step: the recorded forward and backward replayed, then engine.finish_step (clip, optimiser);
    op by op where the shape could not be recorded."""
    from ..training.engine import finish_step, train_step
    from ..training.objectives import CrossEntropy

    terms = captured(batch)
    if terms is None:
        train_step(partial(CrossEntropy(cfg), captured.model), optimizer, batch, cfg, captured.device)
    else:
        finish_step(optimizer, terms, cfg)


def decoder_model(preset: Preset, compile_step: bool):
    from ..model.show_attend_tell import ShowAttendTell
    from ..model.decoder import Decoder

    decoder = Decoder(preset.vocab, preset.feat_dim, preset.embed_dim, preset.hidden_dim, preset.attention_dim, 0.5)
    model = ShowAttendTell(nn.Identity(), decoder)  # type: ignore[arg-type]  # features are cached: no encoder
    if compile_step:
        decoder.compile_step()  # as fit() does
    return model


def bench_train_cached(preset: Preset, counts: Counts, device: torch.device, amp: bool, compile_step: bool,
                       peak_tflops: float, log: Callable[[str], None]) -> dict[str, Any]:
    cfg = _train_config(amp, device)
    timer = Timer(device)
    n_caps = counts.batch_images * CAPTIONS_PER_IMAGE
    result: dict[str, Any] = {"preset": preset.name, "batch_images": counts.batch_images,
                              "captions_per_batch": n_caps, "vocab": preset.vocab,
                              "features": f"{preset.grid}x{preset.grid}x{preset.feat_dim}",
                              "decoder": f"E{preset.embed_dim} H{preset.hidden_dim} A{preset.attention_dim}"}
    # on a GPU also the fast step recorded per batch shape (train.capture: training/captured_step.py), where a run
    # records it: not under fp16's GradScaler (a GPU without bf16)
    recorded = device.type == "cuda" and _scaler(device, cfg) is None
    modes = [("fast", True), ("naive", False)] + ([("recorded", True)] if recorded else [])
    for mode, fast in modes:
        n_steps = counts.steps if fast else counts.naive_steps
        warmup = counts.warmup + (2 if compile_step and device.type == "cuda" else 0)
        batches = make_batches(preset, n_steps + warmup, counts.batch_images, bucket=fast, seed=1)
        if not fast:
            batches = [naive_batch(b) for b in batches]
        batches = [b.to(device) for b in batches]
        torch.manual_seed(0)
        model = decoder_model(preset, compile_step).to(device).train()
        optimizer = torch.optim.Adam(model.decoder.parameters(), lr=cfg.train.lr)
        reset_peak(device)
        log(f"train_cached/{mode}: {warmup} warm-up + {n_steps} timed steps of {n_caps} captions")
        # the naive warm-up is truncated on CPU, where one naive step costs tens of seconds
        step = partial(_train_step, model, optimizer, cfg=cfg, fast=fast, device=device,
                       scaler=_scaler(device, cfg))  # a GPU without bf16: fp16 as training runs it
        if mode == "recorded":  # every shape recorded before the timing: a run records each once, then replays
            from ..model.graphs import CudaGraph
            from ..training.captured_step import CapturedStep
            from ..training.run import amp_dtype

            recorded = CapturedStep(model, cfg, device, CudaGraph, amp_dtype(device, cfg))  # as the run records it
            step = partial(_recorded_step, recorded, optimizer, cfg)
            for b in batches[warmup:]:
                step(b)
        times = time_steps(step, batches, warmup, timer, warmup_steps=0 if fast or device.type == "cuda" else 3)
        timed = batches[warmup:]
        r = rate(times, n_caps)
        r["mean_padded_len"] = float(np.mean([b.inputs.shape[1] for b in timed]))
        r["mean_caption_tokens"] = float(np.mean([float(b.lengths.float().mean()) for b in timed]))
        flops = [decoder_train_flops(preset, b, fast) for b in timed]
        r["gflop_per_step"] = statistics.median(flops) / 1e9
        r["tflops"] = sum(flops) / sum(times) / 1e12
        if device.type == "cuda":
            r["mfu"] = r["tflops"] / peak_tflops
        r["peak_memory_mb"] = peak_memory_mb(device)
        result[mode] = r
        del model, optimizer, batches
    result["speedup"] = result["fast"]["captions_per_s"] / result["naive"]["captions_per_s"]
    if "recorded" in result:
        result["recorded_speedup"] = result["recorded"]["captions_per_s"] / result["naive"]["captions_per_s"]
    log(f"train_cached/load: the real loader on a {preset.grid}x{preset.grid}x{preset.feat_dim} float16 memory map")
    result["load"] = bench_load_cached(preset, counts.batch_images, counts.steps + counts.warmup, device)
    return result


def bench_train_encoder(preset: Preset, counts: Counts, device: torch.device, amp: bool, encoder: str,
                        image_size: int, grid: int, log: Callable[[str], None], modes=("frozen", "fine_tuned")
                        ) -> dict[str, Any]:
    """Images -> encoder -> decoder loss -> backward -> Adam, with the encoder frozen or fine-tuned."""
    from ..data.dataset import Batch
    from ..model.show_attend_tell import ShowAttendTell
    from ..model.decoder import Decoder
    from ..model.encoder import Encoder

    cfg = _train_config(amp, device)
    cfg.model.fine_tune_encoder = True  # the encoder runs in the loop (cfg.encoder_in_loop); frozen or not below
    timer = Timer(device)
    bi = counts.encoder_batch
    n_caps = bi * CAPTIONS_PER_IMAGE
    result: dict[str, Any] = {"encoder": encoder, "image_size": image_size, "grid": grid, "batch_images": bi,
                              "captions_per_batch": n_caps}
    for mode in modes:
        torch.manual_seed(0)
        enc = Encoder(encoder, False, grid)
        dec = Decoder(preset.vocab, enc.out_dim, preset.embed_dim, preset.hidden_dim, preset.attention_dim, 0.5)
        model = ShowAttendTell(enc, dec).to(device).to(memory_format=torch.channels_last).train()
        groups = [{"params": list(dec.parameters()), "lr": cfg.train.lr}]
        if mode == "fine_tuned":
            groups.append({"params": list(enc.parameters()), "lr": cfg.train.encoder_lr})
        else:
            enc.requires_grad_(False)
            enc.eval()  # frozen: ImageNet batch-norm statistics, as train_to_validation does
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
            b.visual = b.visual.contiguous(memory_format=torch.channels_last)
            batches.append(b)
        reset_peak(device)
        log(f"train_encoder/{mode}: {encoder} {image_size}px, {warmup} warm-up + {counts.encoder_steps} timed steps")
        step = partial(_train_step, model, optimizer, cfg=cfg, fast=True, device=device, scaler=_scaler(device, cfg))
        times = time_steps(step, batches, warmup, timer)
        r = rate(times, n_caps)
        r["images_per_s"] = bi / statistics.median(times)
        r["peak_memory_mb"] = peak_memory_mb(device)
        if mode == "frozen":  # encoder forward alone: what building the feature cache costs
            enc.eval()
            encode = partial(_encode, enc, batches[-1].visual, device, cfg)
            encode()
            enc_times = [timer(encode) for _ in range(max(2, counts.encoder_steps))]
            r["encode_images_per_s"] = bi / statistics.median(enc_times)
        result[mode] = r
        del model, optimizer, batches
    return result


def _encode(encoder: nn.Module, images: torch.Tensor, device: torch.device, cfg) -> None:
    from ..training.run import training_autocast

    with torch.no_grad(), training_autocast(device, cfg):
        encoder(images)


def bench_coco_epoch(counts: Counts, device: torch.device, amp: bool, compile_step: bool, peak_tflops: float,
                     cached: dict[str, Any] | None, log: Callable[[str], None]) -> dict[str, Any]:
    p = PRESETS["coco"]
    if cached is None or cached.get("preset") != "coco":
        cached = bench_train_cached(p, counts, device, amp, compile_step, peak_tflops, log)
    enc = bench_train_encoder(p, counts, device, amp, "resnet101", p.image_size, p.grid, log)
    captions = COCO_TRAIN_IMAGES * CAPTIONS_PER_IMAGE
    steps = -(-COCO_TRAIN_IMAGES // cached["batch_images"])
    step_s, load_s = cached["fast"]["step_ms_median"] / 1e3, cached["load"]["cold_ms_median"] / 1e3
    return {
        "images": COCO_TRAIN_IMAGES, "captions": captions,
        "cached_captions_per_s": cached["fast"]["captions_per_s"],
        "cached_epoch_minutes": captions / cached["fast"]["captions_per_s"] / 60,
        "load_ms_per_batch": load_s * 1e3,
        # loading read in turn with the step (an upper bound) and hidden behind it by the loader's prefetch thread
        # (where a core is free for it: the GPU case; on a busy CPU the truth lies between)
        "cached_epoch_minutes_with_loading": steps * (step_s + load_s) / 60,
        "cached_epoch_minutes_overlapped": steps * max(step_s, load_s) / 60,
        "feature_cache_build_minutes": COCO_TRAIN_IMAGES / enc["frozen"]["encode_images_per_s"] / 60,
        "frozen_in_loop_epoch_minutes": captions / enc["frozen"]["captions_per_s"] / 60,
        "fine_tune_captions_per_s": enc["fine_tuned"]["captions_per_s"],
        "fine_tune_epoch_minutes": captions / enc["fine_tuned"]["captions_per_s"] / 60,
        "fine_tune_encoder": f"resnet101 {p.image_size}px {p.grid}x{p.grid}, batch {enc['batch_images']} images",
    }


def bench_train_scst(preset: Preset, counts: Counts, device: torch.device, amp: bool, log: Callable[[str], None],
                     samples: int = 5, max_len: int = 20) -> dict[str, Any]:
    """Self-critical steps on cached features: K sampled captions per image (with gradients), their
    CIDEr-D against the image's references (document frequencies from the synthetic pool), the
    mean-of-others baseline, backward, Adam. An untrained decoder rarely says <end>, so samples run
    longer than a trained model's: the rate is a lower bound; the real epoch time is in README."""
    from ..decoding.cider import CiderD
    from ..training.objectives import SelfCritical, batch_references
    from ..vocab import Vocab

    cfg = _train_config(amp, device, "scst")
    cfg.train.scst_samples, cfg.train.scst_max_len = samples, max_len
    batches = [b.to(device) for b in make_batches(preset, counts.steps + counts.warmup, counts.batch_images, True, 2)]
    refs = [r for b in batches for r in batch_references(b, END)]
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>"] + [f"w{i}" for i in range(preset.vocab - 4)])
    objective = SelfCritical(cfg, vocab, CiderD(refs))
    torch.manual_seed(0)
    model = decoder_model(preset, False).to(device).train()
    optimizer = torch.optim.Adam(model.decoder.parameters(), lr=5e-5)
    lengths: list[float] = []
    scaler = _scaler(device, cfg)

    def step(batch) -> None:
        from ..training.engine import train_step

        terms = train_step(partial(objective, model), optimizer, batch, cfg, device, scaler=scaler)
        lengths.append(terms.logs["sample_len"])

    n = counts.batch_images * samples
    log(f"train_scst: {counts.warmup} warm-up + {counts.steps} timed steps of {counts.batch_images} images x {samples} samples")
    r = rate(time_steps(step, batches, counts.warmup, Timer(device)), n)
    r["sampled_captions_per_s"] = r.pop("captions_per_s")
    return {"images_per_batch": counts.batch_images, "samples_per_image": samples,
            "mean_sample_tokens": float(np.mean(lengths[counts.warmup:])), **r}
