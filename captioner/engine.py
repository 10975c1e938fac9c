"""Training engine: one run = build_run() (model, data, objective, optimiser, state), then fit()
loops train_one_epoch -> validate -> end_epoch.

The objective (objectives.py: cross-entropy or self-critical) is a callable of one shape, so the loop
never branches on what it optimises. fit() resumes from `last.safetensors` after an interruption,
keeps `best.safetensors` chosen on the validation metric of DECODED captions (evaluation.py, never
teacher-forced scores), decays the learning rate and stops early on that metric, and writes
metrics.jsonl + training.png next to the checkpoints.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from .checkpoint import (load_checkpoint, load_model_state, optimizer_from_tensors, optimizer_to_tensors,
                         save_checkpoint)
from .config import Config
from .data import ImageRecord, build_records
from .data.dataset import (BucketBatchSampler, FeatureDataset, ImageDataset, collate, collate_skip_missing,
                           encode_captions)
from .data.features import build_cache, cache_name
from .evaluation import encode_records, evaluate_model
from .logs import JsonlLogger, plot_history
from .model.captioner import CaptionModel, build_model
from .model.encoder import normalization
from .objectives import Terms, build_objective
from .vocab import Vocab

Log = Callable[[str], None]


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss became NaN); the message says what happened."""


@dataclass
class TrainState:
    epoch: int = 0  # epochs fully done
    batch_in_epoch: int = 0  # batches done in the current epoch (mid-epoch resume)
    step: int = 0
    lr: float = 0.0
    best_metric: float = -math.inf
    best_epoch: int = -1
    bad_epochs: int = 0
    since_decay: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False


@dataclass
class Run:
    """Everything one training run needs; built once by build_run, then driven by fit."""
    cfg: Config
    device: torch.device
    model: CaptionModel
    vocab: Vocab
    state: TrainState
    optimizer: torch.optim.Optimizer
    train_module: torch.nn.Module  # the objective as a module (DistributedDataParallel wraps it)
    dataset: Any  # FeatureDataset | ImageDataset
    collate_fn: Callable
    sampler: BucketBatchSampler
    batches: "_RankBatches"
    val_records: list[ImageRecord]
    val_feats: Any  # (n_val, P, D) cached features, or None: encode the val images each time
    logger: JsonlLogger
    log: Log
    out: Path
    main: bool
    world_size: int
    progress: bool
    from_features: bool

    @property
    def last_path(self) -> Path:
        return self.out / "last.safetensors"

    @property
    def best_path(self) -> Path:
        return self.out / "best.safetensors"


def training_autocast(device: torch.device, cfg: Config):
    """bf16 autocast: on CUDA with `train.amp` (when the GPU has bf16), on CPU only with
    `train.cpu_amp` (fast only where the CPU computes bf16 natively: see api.preferred_dtype)."""
    if cfg.train.amp and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if cfg.train.cpu_amp and device.type == "cpu":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


class ObjectiveModule(torch.nn.Module):
    """The objective as a module over the model, so DistributedDataParallel sees one forward per batch."""

    def __init__(self, model: CaptionModel, objective: Callable[[CaptionModel, Any], Terms]):
        super().__init__()
        self.model, self.objective = model, objective

    def forward(self, batch) -> Terms:
        return self.objective(self.model, batch)


# ---------------------------------------------------------------- building a run

def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _restore(cfg: Config, last_path: Path, train_records: Sequence[ImageRecord], log: Log, main: bool
             ) -> tuple[Any, Vocab, TrainState, dict | None]:
    """(resume checkpoint or None, vocabulary, state, initial weights or None)."""
    resume = load_checkpoint(last_path) if last_path.is_file() else None
    if resume is not None:
        if not resume.train_state or "state" not in resume.train_state:
            raise TrainingError(f"{last_path} has no training state (is it an exported model?). Move it away "
                                "or choose another train.out_dir.")
        state = TrainState(**resume.train_state["state"])
        if not state.finished:
            log(f"resuming from {last_path}: epoch {state.epoch + 1}, batch {state.batch_in_epoch}, step {state.step}")
        return resume, resume.vocab, state, resume.model_state
    state = TrainState(lr=cfg.train.lr)
    if cfg.train.init_from:  # e.g. SCST starts from a cross-entropy model: its weights AND its vocabulary
        init = load_checkpoint(cfg.train.init_from)
        log(f"starting from the weights of {cfg.train.init_from}")
        return None, init.vocab, state, init.model_state
    captions = [c for r in train_records for c in r.captions]
    vocab = Vocab.build(captions, cfg.data.min_word_count)
    if main:
        log(str(vocab.stats(captions, cfg.data.max_caption_len)))
    return None, vocab, state, None


def _caches(cfg: Config, model: CaptionModel, splits: dict[str, list[ImageRecord]], device: torch.device,
            main: bool, world_size: int, log: Log, progress: bool) -> dict[str, Any]:
    """Frozen-encoder feature caches of the splits; rank 0 builds, the others wait and open them."""
    caches = {}
    for split, recs in splits.items():
        name = cache_name(cfg.data.dataset, split if not cfg.data.limit else f"{split}{cfg.data.limit}",
                          cfg.model.encoder, cfg.model.image_size, cfg.model.grid_size)
        if main:
            caches[split] = build_cache(cfg.data.cache_dir, name, model.encoder, cfg.model.image_size, recs,
                                        device, num_workers=cfg.data.num_workers, log=log, progress=progress)
        if world_size > 1:
            dist.barrier()
        if not main:
            caches[split] = build_cache(cfg.data.cache_dir, name, model.encoder, cfg.model.image_size, recs,
                                        device, progress=False, log=log)
    return caches


def _data(cfg: Config, model: CaptionModel, vocab: Vocab, train_records: list[ImageRecord],
          val_records: list[ImageRecord], device: torch.device, main: bool, world_size: int, log: Log,
          progress: bool) -> tuple[Any, list[list[list[int]]], list[float], Callable, list[ImageRecord], Any]:
    """(dataset, its encoded captions, mean caption length per image, collate, val records, val features)."""
    caps = encode_captions(train_records, vocab, cfg.data.max_caption_len)
    if cfg.model.fine_tune_encoder or cfg.data.augment:  # encoder in the loop: images every step
        mean, std = normalization(cfg.model.encoder)
        dataset = ImageDataset(train_records, cfg.model.image_size, mean, std, caps, augment=cfg.data.augment)
        return dataset, caps, _mean_lengths(caps), collate_skip_missing, val_records, None
    caches = _caches(cfg, model, {"train": train_records, "val": val_records}, device, main, world_size, log,
                     progress)
    missing = set(caches["train"].missing)
    keep = [i for i, r in enumerate(train_records) if r.image_id not in missing]
    if missing:
        log(f"skipping {len(missing)} unreadable training image(s)")
    caps = [caps[i] for i in keep]
    dataset = FeatureDataset(caches["train"].features, keep, caps)
    val_missing = set(caches["val"].missing)
    val_keep = [i for i, r in enumerate(val_records) if r.image_id not in val_missing]
    return (dataset, caps, _mean_lengths(caps), collate, [val_records[i] for i in val_keep],
            caches["val"].features[val_keep])


def _mean_lengths(caps: list[list[list[int]]]) -> list[float]:
    return [sum(len(c) for c in cs) / len(cs) for cs in caps]


def _optimizer(cfg: Config, model: CaptionModel, resume: Any, device: torch.device) -> torch.optim.Optimizer:
    groups = [{"params": list(model.decoder.parameters()), "lr": cfg.train.lr}]
    if cfg.model.fine_tune_encoder:
        groups.append({"params": list(model.encoder.parameters()), "lr": cfg.train.encoder_lr})
    optimizer = torch.optim.Adam(groups, weight_decay=cfg.train.weight_decay)
    if resume is not None and resume.optimizer_tensors:
        optimizer_from_tensors(optimizer, {k: v.to(device) for k, v in resume.optimizer_tensors.items()},
                               resume.train_state["optimizer"])
    return optimizer


def build_run(cfg: Config, device: str | torch.device = "cpu", log: Log = print, progress: bool = True,
              rank: int = 0, world_size: int = 1) -> Run:
    device, out, main = torch.device(device), Path(cfg.train.out_dir), rank == 0
    _seed(cfg.train.seed + rank)
    train_records, val_records = build_records(cfg.data, "train"), build_records(cfg.data, "val")
    val_records = val_records[:cfg.train.val_limit or len(val_records)]
    resume, vocab, state, weights = _restore(cfg, out / "last.safetensors", train_records, log, main)
    model = build_model(cfg.model, len(vocab), pretrained=None if weights is None else False).to(device)
    if weights is not None:
        load_model_state(model, weights, cfg.train.init_from if resume is None else str(out / "last.safetensors"))
    for p in model.encoder.parameters():
        p.requires_grad_(cfg.model.fine_tune_encoder)
    from_features = not cfg.model.fine_tune_encoder and not cfg.data.augment
    dataset, caps, mean_len, collate_fn, val_records, val_feats = _data(
        cfg, model, vocab, train_records, val_records, device, main, world_size, log, progress)
    sampler = BucketBatchSampler(mean_len, cfg.train.batch_images, seed=cfg.train.seed)
    if cfg.train.compile and device.type == "cuda":  # the one place compilation is switched on
        model.decoder.compile_recur()
    module: torch.nn.Module = ObjectiveModule(model, build_objective(cfg, from_features, vocab, caps))
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = DDP(module, device_ids=[device.index] if device.type == "cuda" else None)
    logger = JsonlLogger(out / "metrics.jsonl", enabled=main)
    if resume is not None:
        logger.rewind(state.step, state.epoch)
    return Run(cfg, device, model, vocab, state, _optimizer(cfg, model, resume, device), module, dataset, collate_fn,
               sampler, _RankBatches(sampler, rank, world_size), val_records, val_feats, logger, log, out, main,
               world_size, progress, from_features)


# ---------------------------------------------------------------- one epoch

def train_one_epoch(run: Run, loader: Sequence | DataLoader, skip: int = 0) -> dict[str, float]:
    """One pass over `loader` (already starting at batch `skip` when resuming) -> epoch averages of
    the objective's logged terms (weighted by tokens), seconds and batches."""
    from tqdm import tqdm

    cfg, state, model = run.cfg, run.state, run.model
    model.train()
    if not cfg.model.fine_tune_encoder:
        model.encoder.eval()  # frozen encoder: batch-norm statistics stay ImageNet's
    sums: dict[str, float] = {}
    weight, batches, t0 = 0, 0, time.time()
    bar = tqdm(total=len(loader) + skip, initial=skip, desc=f"epoch {state.epoch + 1}",
               disable=not (run.progress and run.main), unit="batch")
    for i, batch in enumerate(loader, start=skip):
        bar.update(1)
        if batch is None:  # every image of this batch was unreadable
            continue
        terms = _optimise(run, batch.to(run.device, non_blocking=True))
        state.step, state.batch_in_epoch, batches = state.step + 1, i + 1, batches + 1
        weight += terms.weight
        for k, v in terms.logs.items():
            sums[k] = sums.get(k, 0.0) + v * terms.weight
        if state.step % cfg.train.log_every == 0:
            run.logger.write({"kind": "train", "epoch": state.epoch + 1, "step": state.step, **terms.logs,
                              "lr": run.optimizer.param_groups[0]["lr"], "time": time.time()})
            bar.set_postfix({k: f"{v:.3f}" for k, v in terms.logs.items()})
        if cfg.train.checkpoint_every and state.step % cfg.train.checkpoint_every == 0:
            _check_weights_finite(model, state.step)
            save_last(run)
        if cfg.train.max_steps and state.step >= cfg.train.max_steps:
            break
    bar.close()
    return {**{k: v / max(weight, 1) for k, v in sums.items()}, "seconds": time.time() - t0, "batches": batches}


def _optimise(run: Run, batch: Any) -> Terms:
    """Objective, backward, clip, step: one optimiser step."""
    cfg, state = run.cfg, run.state
    with training_autocast(run.device, cfg):
        terms = run.train_module(batch)
    if not torch.isfinite(terms.total):
        raise TrainingError(
            f"loss became {terms.total.item()} at step {state.step} (epoch {state.epoch + 1}); stopping. "
            f"The last good checkpoint is kept. Try a lower train.lr or train.grad_clip.")
    run.optimizer.zero_grad(set_to_none=True)
    terms.total.backward()
    if cfg.train.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_([p for p in run.model.parameters() if p.requires_grad], cfg.train.grad_clip)
    try:
        run.optimizer.step()
    except RuntimeError as e:  # e.g. overflow with an absurd learning rate
        raise TrainingError(f"optimizer step failed at step {state.step} ({e}); the last good checkpoint is "
                            "kept. Check train.lr.") from None
    return terms


def _check_weights_finite(model: torch.nn.Module, step: int) -> None:
    """Never checkpoint NaN/inf weights: stop with a message and keep the last good file."""
    if not all(torch.isfinite(p).all() for p in model.parameters() if p.requires_grad):
        raise TrainingError(f"weights became NaN/inf at step {step}; stopping. The last good checkpoint is kept. "
                            "Try a lower train.lr or train.grad_clip.")


def save_last(run: Run) -> None:
    """The resumable checkpoint (weights, optimiser, state), written atomically by rank 0."""
    if not run.main:
        return
    opt_tensors, opt_info = optimizer_to_tensors(run.optimizer)
    save_checkpoint(run.last_path, run.cfg, run.vocab, run.model.state_dict(),
                    train_state={"state": run.state.__dict__, "optimizer": opt_info}, optimizer_tensors=opt_tensors)


# ---------------------------------------------------------------- validation and the epoch's decisions

def validate(run: Run, stats: dict[str, float]) -> float:
    """Rank 0 decodes the val images with train.val_beam_size and the decode settings, scores them
    (evaluation.evaluate_model), logs the record; the metric is shared with every rank."""
    cfg, state = run.cfg, run.state
    value = 0.0
    if run.main:
        feats, records = run.val_feats, run.val_records
        if feats is None:  # encoder in the loop: encode the val images with the current encoder
            feats, idx = encode_records(run.model, records, cfg.model.image_size, run.device)
            records = [records[i] for i in idx]
        metrics = ["Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "ROUGE_L", "CIDEr"]
        metrics += [cfg.train.val_metric] if cfg.train.val_metric not in metrics else []
        scores, preds = evaluate_model(run.model, run.vocab, feats, records, cfg.train.val_beam_size,
                                       cfg.decode.max_len, cfg.decode.length_penalty, run.device,
                                       cfg.decode.forbid_unk, metrics, log=run.log)
        value = scores[cfg.train.val_metric]
        rec = {"kind": "val", "epoch": state.epoch, "step": state.step,
               **{f"train_{k}": v for k, v in stats.items() if k not in ("seconds", "batches")},
               "epoch_seconds": stats["seconds"], "lr": run.optimizer.param_groups[0]["lr"], **scores}
        run.logger.write(rec)
        state.history.append(rec)
        train_txt = " ".join(f"{k} {v:.3f}" for k, v in stats.items() if k not in ("seconds", "batches"))
        run.log(f"epoch {state.epoch}: train {train_txt} ({stats['seconds']:.0f}s) | val "
                + " ".join(f"{k} {v:.4f}" for k, v in scores.items() if k != "n_images")
                + f" | e.g. '{next(iter(preds.values()))}'")
    if run.world_size > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    return value


def end_epoch(run: Run, value: float, hit_max: bool) -> bool:
    """Keep the best checkpoint, decay the learning rate, decide on early stopping -> stop?"""
    cfg, state = run.cfg, run.state
    if value > state.best_metric:
        state.best_metric, state.best_epoch, state.bad_epochs, state.since_decay = value, state.epoch, 0, 0
        if run.main:
            meta = {"val": state.history[-1], "epoch": state.epoch, "objective": cfg.train.objective}
            save_checkpoint(run.best_path, cfg, run.vocab, run.model.state_dict(), metrics=meta)
            run.log(f"  new best {cfg.train.val_metric} {value:.4f} -> {run.best_path}")
    else:
        state.bad_epochs += 1
        state.since_decay += 1
        if state.since_decay >= cfg.train.lr_patience and cfg.train.lr_decay < 1:
            for g in run.optimizer.param_groups:
                g["lr"] *= cfg.train.lr_decay
            state.since_decay = 0
            run.log(f"  no improvement: learning rate x{cfg.train.lr_decay} -> {run.optimizer.param_groups[0]['lr']:.2e}")
    state.lr = run.optimizer.param_groups[0]["lr"]
    stop = state.bad_epochs >= cfg.train.early_stop_patience or hit_max
    if stop:
        run.log(f"reached train.max_steps={cfg.train.max_steps}" if hit_max else
                f"early stopping: no {cfg.train.val_metric} improvement for {state.bad_epochs} epoch(s)")
    state.finished = stop or state.epoch >= cfg.train.epochs
    return stop


# ---------------------------------------------------------------- the whole run

def fit(cfg: Config, device: str | torch.device = "cpu", log: Log = print, progress: bool = True,
        rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """Train according to `cfg`; returns the final train state as a dict. Rerunning the same
    command after an interruption resumes from out_dir/last.safetensors."""
    run = build_run(cfg, device, log if rank == 0 else (lambda _: None), progress, rank, world_size)
    state = run.state
    if state.finished:
        run.log(f"{run.last_path}: this run already finished (best {cfg.train.val_metric} "
                f"{state.best_metric:.4f} at epoch {state.best_epoch}); nothing to do")
        return state.__dict__
    run.log(f"training on {run.device} ({cfg.train.objective}): {len(run.dataset)} images, "
            f"{len(run.batches)} batches/epoch/rank, {'cached features' if run.from_features else 'encoder in the loop'}, "
            f"{sum(p.numel() for p in run.model.parameters() if p.requires_grad) / 1e6:.1f}M trainable parameters")
    while state.epoch < cfg.train.epochs:
        run.sampler.set_epoch(state.epoch)
        skip = run.batches.start = state.batch_in_epoch
        stats = train_one_epoch(run, _loader(run), skip=skip)
        hit_max = bool(cfg.train.max_steps and state.step >= cfg.train.max_steps)
        _check_weights_finite(run.model, state.step)
        if world_size > 1:
            check_ranks_in_sync(run.model, world_size)
            run.log(f"parameters identical across {world_size} ranks after step {state.step}")
        state.epoch, state.batch_in_epoch = state.epoch + 1, 0
        stop = end_epoch(run, validate(run, stats), hit_max)
        save_last(run)
        if run.main:
            plot_history(run.out / "metrics.jsonl", run.out / "training.png")
        if stop:
            break
    run.log(f"done: best {cfg.train.val_metric} {state.best_metric:.4f} at epoch {state.best_epoch} -> {run.best_path}")
    return state.__dict__


def _loader(run: Run) -> Any:
    if run.from_features:  # a memory map: reading a batch is a slice, no worker processes needed
        return _BatchIter(run.dataset, run.batches, run.collate_fn)
    return DataLoader(run.dataset, batch_sampler=run.batches, collate_fn=run.collate_fn,
                      num_workers=run.cfg.data.num_workers, pin_memory=run.device.type == "cuda")


def check_ranks_in_sync(model: torch.nn.Module, world_size: int) -> None:
    """DistributedDataParallel must keep every rank's parameters identical; verify it (cheaply)."""
    local = torch.stack([p.detach().double().sum() for p in model.parameters() if p.requires_grad]).cpu()
    gathered = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather_object(gathered, local)
    for r, other in enumerate(gathered[1:], start=1):
        if not torch.equal(other, gathered[0]):
            raise TrainingError(f"rank {r}'s parameters differ from rank 0's: distributed training is out of sync")


class _RankBatches:
    """Every rank takes its share of the same batch order; all ranks run the same number of steps."""

    def __init__(self, sampler: BucketBatchSampler, rank: int, world: int):
        self.sampler, self.rank, self.world = sampler, rank, world
        self.start = 0  # batches of this epoch already done (resume)

    def __iter__(self):
        batches = self.sampler.batches()
        n = len(batches) // self.world
        mine = batches[self.rank * n:(self.rank + 1) * n] if self.world > 1 else batches
        return iter(mine[self.start:])

    def __len__(self) -> int:
        return len(self.sampler) // self.world - self.start


class _BatchIter:
    """Cached features are a memory map: reading a batch is a slice, no worker processes needed."""

    def __init__(self, dataset: FeatureDataset, batches: _RankBatches, collate_fn):
        self.dataset, self.batches, self.collate_fn = dataset, batches, collate_fn

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for idx in self.batches:
            yield self.collate_fn([self.dataset[i] for i in idx])
