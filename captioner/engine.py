"""Training engine: train_one_epoch, evaluate (real decoding metrics), fit (the whole run).

fit() resumes from `last.safetensors` after an interruption, keeps `best.safetensors` chosen on the
validation metric of DECODED captions (never teacher-forced scores), decays the learning rate and
stops early on that metric, and writes metrics.jsonl + training.png next to the checkpoints.
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
from .data.dataset import (Batch, BucketBatchSampler, FeatureDataset, ImageDataset, collate,
                           collate_skip_missing, encode_captions)
from .data.features import build_cache, cache_name
from .decoding import decode
from .logs import JsonlLogger, plot_history
from .loss import LossTerms, caption_loss
from .metrics import score_captions
from .model.captioner import CaptionModel, build_model
from .model.encoder import normalization
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


# ---------------------------------------------------------------- one batch / one epoch

def forward_loss(model: CaptionModel, batch: Batch, cfg: Config, from_features: bool,
                 fast: bool = True) -> LossTerms:
    """Teacher-forced loss of one batch. `fast=False` is the naive reference used by the benchmark:
    W_a a_i recomputed every step and every padded position computed."""
    feats = batch.images if from_features else model.encode(batch.images)  # (Bi, P, D)
    lengths = batch.lengths if fast else torch.full_like(batch.lengths, batch.inputs.shape[1])
    logits, alphas = model.decoder(feats, batch.inputs, lengths, batch.image_index, cache_projection=fast)
    if not fast:  # the naive path ran over padding; mask it out of the attention penalty
        valid = torch.arange(alphas.shape[1], device=alphas.device)[None, :] < batch.lengths[:, None]
        alphas = alphas * valid.unsqueeze(-1)
    return caption_loss(logits, alphas, batch.targets, batch.lengths, cfg.train.alpha_c, cfg.train.label_smoothing)


def training_autocast(device: torch.device, cfg: Config):
    """bf16 autocast: on CUDA with `train.amp` (when the GPU has bf16), on CPU only with
    `train.cpu_amp` (fast only where the CPU computes bf16 natively: see api.preferred_dtype)."""
    if cfg.train.amp and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if cfg.train.cpu_amp and device.type == "cpu":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


def train_one_epoch(model: CaptionModel, train_module: torch.nn.Module, loader: Sequence | DataLoader,
                    optimizer: torch.optim.Optimizer, cfg: Config, device: torch.device, state: TrainState,
                    from_features: bool, on_checkpoint: Callable[[], None], logger: JsonlLogger, log: Log,
                    skip: int = 0, progress: bool = True) -> dict[str, float]:
    from tqdm import tqdm

    model.train()
    if not cfg.model.fine_tune_encoder:
        model.encoder.eval()  # frozen encoder: batch-norm statistics stay ImageNet's
    sums = {"xent": 0.0, "attention": 0.0, "tokens": 0, "batches": 0}
    t0 = time.time()
    bar = tqdm(total=len(loader) + skip, initial=skip, desc=f"epoch {state.epoch + 1}", disable=not progress,
               unit="batch")
    for i, batch in enumerate(loader, start=skip):  # the loader already starts at batch `skip`
        if batch is None:  # every image of this batch was unreadable
            bar.update(1)
            continue
        batch = batch.to(device, non_blocking=True)
        with training_autocast(device, cfg):
            terms = train_module(batch)
        if not torch.isfinite(terms.total):
            raise TrainingError(
                f"loss became {terms.total.item()} at step {state.step} (epoch {state.epoch + 1}); stopping. "
                f"The last good checkpoint is kept. Try a lower train.lr or train.grad_clip.")
        optimizer.zero_grad(set_to_none=True)
        terms.total.backward()
        if cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.train.grad_clip)
        try:
            optimizer.step()
        except RuntimeError as e:  # e.g. overflow with an absurd learning rate
            raise TrainingError(f"optimizer step failed at step {state.step} ({e}); the last good checkpoint is "
                                "kept. Check train.lr.") from None
        state.step += 1
        state.batch_in_epoch = i + 1
        sums["xent"] += terms.xent.item() * terms.n_tokens
        sums["attention"] += terms.attention.item()
        sums["tokens"] += terms.n_tokens
        sums["batches"] += 1
        bar.update(1)
        if state.step % cfg.train.log_every == 0:
            rec = {"kind": "train", "epoch": state.epoch + 1, "step": state.step, "xent": terms.xent.item(),
                   "attention": terms.attention.item(), "lr": optimizer.param_groups[0]["lr"],
                   "time": time.time()}
            logger.write(rec)
            bar.set_postfix(xent=f"{rec['xent']:.3f}", att=f"{rec['attention']:.3f}")
        if cfg.train.checkpoint_every and state.step % cfg.train.checkpoint_every == 0:
            _check_finite(model, state.step)
            on_checkpoint()
        if cfg.train.max_steps and state.step >= cfg.train.max_steps:
            break
    bar.close()
    n = max(sums["tokens"], 1)
    return {"xent": sums["xent"] / n, "attention": sums["attention"] / max(sums["batches"], 1),
            "seconds": time.time() - t0, "batches": sums["batches"]}


def _check_finite(model: torch.nn.Module, step: int) -> None:
    """Never checkpoint NaN/inf weights: stop with a message and keep the last good file."""
    if not all(torch.isfinite(p).all() for p in model.parameters() if p.requires_grad):
        raise TrainingError(f"weights became NaN/inf at step {step}; stopping. The last good checkpoint is kept. "
                            "Try a lower train.lr or train.grad_clip.")


# ---------------------------------------------------------------- decoding + metrics

@torch.no_grad()
def caption_features(model: CaptionModel, feats: np.ndarray | torch.Tensor, vocab: Vocab, beam_size: int,
                     max_len: int, length_penalty: float, device: torch.device, batch_size: int = 100,
                     progress: bool = False, forbid_unk: bool = True) -> list[str]:
    """Cached features (N, P, D) -> N captions, decoded in batches."""
    from tqdm import tqdm

    model.eval()
    out = []
    for k in tqdm(range(0, len(feats), batch_size), desc="decoding", disable=not progress, unit="batch"):
        x = torch.as_tensor(np.asarray(feats[k:k + batch_size], dtype=np.float32))  # (b, P, D)
        x = x.to(device, next(model.decoder.parameters()).dtype)
        hyps = decode(model.decoder, x, vocab.start, vocab.end, vocab.pad, beam_size, max_len, length_penalty,
                      vocab.unk if forbid_unk else None)
        out.extend(" ".join(vocab.decode(h[0].tokens)) for h in hyps)
    return out


@torch.no_grad()
def encode_records(model: CaptionModel, records: Sequence[ImageRecord], image_size: int, device: torch.device,
                   batch_size: int = 32, num_workers: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Images -> features (N', P, D) for the readable ones, and their indices in `records`."""
    mean, std = normalization(model.encoder.name)
    loader = DataLoader(ImageDataset(records, image_size, mean, std), batch_size=batch_size,
                        num_workers=num_workers, collate_fn=_readable)
    model.eval()
    dtype = next(model.encoder.parameters()).dtype
    feats, idx = [], []
    for batch in loader:
        if batch:
            x = torch.stack([s[0] for s in batch]).to(device, dtype)  # (b, 3, S, S) in the model's dtype
            x = x.contiguous(memory_format=torch.channels_last)
            feats.append(model.encode(x).float().cpu())
            idx.extend(s[1] for s in batch)
    return (torch.cat(feats) if feats else torch.zeros(0)), idx


def _readable(samples: list) -> list:
    return [s for s in samples if s is not None]


def evaluate(predictions: dict[str, str], records: Sequence[ImageRecord],
             metrics: Sequence[str] = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "ROUGE_L", "CIDEr"),
             log: Log = print) -> dict[str, float]:
    refs = {r.image_id: r.captions for r in records}
    scores = score_captions(predictions, refs, metrics, log=log)
    scores["n_images"] = len(predictions)
    return scores


# ---------------------------------------------------------------- the whole run

def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class _TrainStep(torch.nn.Module):
    """Wraps the loss so DistributedDataParallel sees one forward per batch."""

    def __init__(self, model: CaptionModel, cfg: Config, from_features: bool):
        super().__init__()
        self.model, self.cfg, self.from_features = model, cfg, from_features

    def forward(self, batch: Batch) -> LossTerms:
        return forward_loss(self.model, batch, self.cfg, self.from_features)


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


def fit(cfg: Config, device: str | torch.device = "cpu", log: Log = print, progress: bool = True,
        rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """Train according to `cfg`; returns the final train state as a dict. Rerunning the same
    command after an interruption resumes from out_dir/last.safetensors."""
    device = torch.device(device)
    out = Path(cfg.train.out_dir)
    main = rank == 0  # rank 0 logs, validates and writes checkpoints
    logger = JsonlLogger(out / "metrics.jsonl", enabled=main)
    _seed(cfg.train.seed + rank)

    train_records = build_records(cfg.data, "train")
    val_records = build_records(cfg.data, "val")
    n_val = cfg.train.val_limit or len(val_records)  # validate on the first n_val (the cache covers all)

    last_path, best_path = out / "last.safetensors", out / "best.safetensors"
    resume = load_checkpoint(last_path) if last_path.is_file() else None
    if resume is not None:
        vocab = resume.vocab
        if not resume.train_state or "state" not in resume.train_state:
            raise TrainingError(f"{last_path} has no training state (is it an exported model?). Move it away "
                                "or choose another train.out_dir.")
        state = TrainState(**resume.train_state["state"])
        if state.finished:
            log(f"{last_path}: this run already finished (best {cfg.train.val_metric} "
                f"{state.best_metric:.4f} at epoch {state.best_epoch}); nothing to do")
            return state.__dict__
        log(f"resuming from {last_path}: epoch {state.epoch + 1}, batch {state.batch_in_epoch}, step {state.step}")
        logger.rewind(state.step, state.epoch)
    else:
        vocab = Vocab.build([c for r in train_records for c in r.captions], cfg.data.min_word_count)
        if main:
            log(str(vocab.stats([c for r in train_records for c in r.captions], cfg.data.max_caption_len)))
        state = TrainState(lr=cfg.train.lr)

    model = build_model(cfg.model, len(vocab), pretrained=None if resume is None else False).to(device)
    if resume is not None:
        load_model_state(model, resume.model_state, str(last_path))
    fine_tune = cfg.model.fine_tune_encoder
    for p in model.encoder.parameters():
        p.requires_grad_(fine_tune)
    from_features = not fine_tune and not cfg.data.augment

    # ---- data
    train_caps = encode_captions(train_records, vocab, cfg.data.max_caption_len)
    mean_len = [sum(len(c) for c in cs) / len(cs) for cs in train_caps]
    if from_features:
        caches = {}
        for split, recs in (("train", train_records), ("val", val_records)):
            name = cache_name(cfg.data.dataset, split if not cfg.data.limit else f"{split}{cfg.data.limit}",
                              cfg.model.encoder, cfg.model.image_size, cfg.model.grid_size)
            if main:  # rank 0 builds; the others wait and open it
                caches[split] = build_cache(cfg.data.cache_dir, name, model.encoder, cfg.model.image_size, recs,
                                            device, num_workers=cfg.data.num_workers, log=log, progress=progress)
            if world_size > 1:
                dist.barrier()
            if not main:
                caches[split] = build_cache(cfg.data.cache_dir, name, model.encoder, cfg.model.image_size, recs,
                                            device, progress=False, log=log)
        missing = set(caches["train"].missing)
        keep = [i for i, r in enumerate(train_records) if r.image_id not in missing]
        if missing:
            log(f"skipping {len(missing)} unreadable training image(s)")
        dataset = FeatureDataset(caches["train"].features, keep, [train_caps[i] for i in keep])
        mean_len = [mean_len[i] for i in keep]
        collate_fn = collate
        val_missing = set(caches["val"].missing)
        val_keep = [i for i, r in enumerate(val_records[:n_val]) if r.image_id not in val_missing]
        val_feats = caches["val"].features[val_keep]  # (n_val, P, D)
    else:
        mean, std = normalization(cfg.model.encoder)
        dataset = ImageDataset(train_records, cfg.model.image_size, mean, std, train_caps, augment=cfg.data.augment)
        collate_fn = collate_skip_missing
    sampler = BucketBatchSampler(mean_len, cfg.train.batch_images, seed=cfg.train.seed)
    rank_batches = _RankBatches(sampler, rank, world_size)

    # ---- optimisation
    groups = [{"params": [p for p in model.decoder.parameters()], "lr": cfg.train.lr}]
    if fine_tune:
        groups.append({"params": [p for p in model.encoder.parameters()], "lr": cfg.train.encoder_lr})
    optimizer = torch.optim.Adam(groups, weight_decay=cfg.train.weight_decay)
    if resume is not None and resume.optimizer_tensors:
        optimizer_from_tensors(optimizer, {k: v.to(device) for k, v in resume.optimizer_tensors.items()},
                               resume.train_state["optimizer"])

    train_module: torch.nn.Module = _TrainStep(model, cfg, from_features)
    if cfg.train.compile and device.type == "cuda":
        model.decoder.recur = torch.compile(model.decoder.recur)  # type: ignore[method-assign]
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_module = DDP(train_module, device_ids=[device.index] if device.type == "cuda" else None)

    def save_last() -> None:
        if not main:
            return
        opt_tensors, opt_info = optimizer_to_tensors(optimizer)
        save_checkpoint(last_path, cfg, vocab, model.state_dict(),
                        train_state={"state": state.__dict__, "optimizer": opt_info}, optimizer_tensors=opt_tensors)

    if main:
        log(f"training on {device}: {len(dataset)} images, {sum(len(c) for c in train_caps)} captions, "
            f"{len(rank_batches)} batches/epoch/rank, {'cached features' if from_features else 'encoder in the loop'}, "
            f"{sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6:.1f}M trainable parameters")

    while state.epoch < cfg.train.epochs:
        sampler.set_epoch(state.epoch)
        skip = rank_batches.start = state.batch_in_epoch
        if from_features:
            loader: Any = _BatchIter(dataset, rank_batches, collate_fn)
        else:
            loader = DataLoader(dataset, batch_sampler=rank_batches, collate_fn=collate_fn,
                                num_workers=cfg.data.num_workers, pin_memory=device.type == "cuda",
                                persistent_workers=False)
        stats = train_one_epoch(model, train_module, loader, optimizer, cfg, device, state, from_features,
                                save_last, logger, log, skip=skip, progress=progress and main)
        hit_max = bool(cfg.train.max_steps and state.step >= cfg.train.max_steps)
        _check_finite(model, state.step)
        if world_size > 1:
            check_ranks_in_sync(model, world_size)
            if main:
                log(f"parameters identical across {world_size} ranks after step {state.step}")
        state.epoch += 1
        state.batch_in_epoch = 0

        # ---- validation on decoded captions (rank 0), decision shared with all ranks
        metric_value = 0.0
        if main:
            if from_features:
                caps = caption_features(model, val_feats, vocab, cfg.train.val_beam_size, cfg.decode.max_len,
                                        cfg.decode.length_penalty, device, forbid_unk=cfg.decode.forbid_unk)
                preds = {val_records[i].image_id: c for i, c in zip(val_keep, caps)}
            else:
                feats, idx = encode_records(model, val_records[:n_val], cfg.model.image_size, device)
                caps = caption_features(model, feats, vocab, cfg.train.val_beam_size, cfg.decode.max_len,
                                        cfg.decode.length_penalty, device, forbid_unk=cfg.decode.forbid_unk)
                preds = {val_records[i].image_id: c for i, c in zip(idx, caps)}
            metric_names = ["Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "ROUGE_L", "CIDEr"]
            if cfg.train.val_metric not in metric_names:
                metric_names.append(cfg.train.val_metric)
            scores = evaluate(preds, val_records[:n_val], metric_names, log=log)
            metric_value = scores[cfg.train.val_metric]
            rec = {"kind": "val", "epoch": state.epoch, "step": state.step, "train_xent": stats["xent"],
                   "train_attention": stats["attention"], "epoch_seconds": stats["seconds"],
                   "lr": optimizer.param_groups[0]["lr"], **scores}
            logger.write(rec)
            state.history.append(rec)
            log(f"epoch {state.epoch}: train xent {stats['xent']:.3f} att {stats['attention']:.3f} "
                f"({stats['seconds']:.0f}s) | val " + " ".join(f"{k} {v:.4f}" for k, v in scores.items()
                                                             if k != "n_images") + f" | e.g. '{caps[0]}'")
        if world_size > 1:
            box = [metric_value]
            dist.broadcast_object_list(box, src=0)
            metric_value = box[0]

        if metric_value > state.best_metric:
            state.best_metric, state.best_epoch, state.bad_epochs, state.since_decay = metric_value, state.epoch, 0, 0
            if main:
                save_checkpoint(best_path, cfg, vocab, model.state_dict(),
                                metrics={"val": state.history[-1], "epoch": state.epoch})
                log(f"  new best {cfg.train.val_metric} {metric_value:.4f} -> {best_path}")
        else:
            state.bad_epochs += 1
            state.since_decay += 1
            if state.since_decay >= cfg.train.lr_patience and cfg.train.lr_decay < 1:
                for g in optimizer.param_groups:
                    g["lr"] *= cfg.train.lr_decay
                state.since_decay = 0
                if main:
                    log(f"  no improvement: learning rate x{cfg.train.lr_decay} -> {optimizer.param_groups[0]['lr']:.2e}")
        state.lr = optimizer.param_groups[0]["lr"]
        stop = state.bad_epochs >= cfg.train.early_stop_patience or hit_max
        if stop and main:
            log(f"early stopping: no {cfg.train.val_metric} improvement for {state.bad_epochs} epoch(s)"
                if not hit_max else f"reached train.max_steps={cfg.train.max_steps}")
        state.finished = stop or state.epoch >= cfg.train.epochs
        save_last()
        if main:
            plot_history(out / "metrics.jsonl", out / "training.png")
        if stop:
            break
    if main:
        log(f"done: best {cfg.train.val_metric} {state.best_metric:.4f} at epoch {state.best_epoch} -> {best_path}")
    return state.__dict__


def check_ranks_in_sync(model: torch.nn.Module, world_size: int) -> None:
    """DistributedDataParallel must keep every rank's parameters identical; verify it (cheaply)."""
    local = torch.stack([p.detach().double().sum() for p in model.parameters() if p.requires_grad]).cpu()
    gathered = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather_object(gathered, local)
    for r, other in enumerate(gathered[1:], start=1):
        if not torch.equal(other, gathered[0]):
            raise TrainingError(f"rank {r}'s parameters differ from rank 0's: distributed training is out of sync")


class _BatchIter:
    """Cached features are a memory map: reading a batch is a slice, no worker processes needed."""

    def __init__(self, dataset: FeatureDataset, batches: _RankBatches, collate_fn):
        self.dataset, self.batches, self.collate_fn = dataset, batches, collate_fn

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for idx in self.batches:
            yield self.collate_fn([self.dataset[i] for i in idx])
