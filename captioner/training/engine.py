"""Training engine: fit() builds a Run (run.py) and loops train_one_epoch -> validate -> end_epoch.

The objective (objectives.py: cross-entropy or self-critical) is a callable of one shape, so the loop
never branches on what it optimises. fit() resumes from `last.safetensors` after an interruption,
keeps `best.safetensors` chosen on the validation metric of DECODED captions (evaluation/scoring.py, never
teacher-forced scores), decays the learning rate and stops early on that metric, and writes
metrics.jsonl + training.png next to the checkpoints.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..checkpoint import optimizer_to_tensors, save_checkpoint
from ..config import Config
from ..data.loader import epoch_loader
from ..evaluation.scoring import encode_records, evaluate_model, head_agreement, top_features
from ..model.encoder import build_preprocess
from ..logs import plot_history
from ..evaluation.metrics import METRIC_KEYS
from .as_exported import decoding_as_exported
from .new_words import NEW_WORDS_METRIC, new_word_scores
from .objectives import Terms
from .run import Log, Run, TrainingError, TrainState, build_run, encoder_train_mode

__all__ = ["TrainingError", "TrainState", "fit", "train_one_epoch", "train_step", "validate", "end_epoch",
           "training_autocast"]


def training_autocast(device: torch.device, cfg: Config):
    """bf16 autocast: on CUDA with `train.amp` (when the GPU has bf16), on CPU only with
    `train.cpu_amp` (fast only where the CPU computes bf16 natively: see api.preferred_dtype)."""
    if cfg.train.amp and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if cfg.train.cpu_amp and device.type == "cpu":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


# ---------------------------------------------------------------- one epoch

def train_one_epoch(run: Run, loader: Sequence | Any, skip: int = 0) -> dict[str, float]:
    """One pass over `loader` (already starting at batch `skip` when resuming) -> epoch averages of
    the objective's logged terms (weighted by tokens), seconds and batches."""
    from tqdm import tqdm

    cfg, state, model = run.cfg, run.state, run.model
    model.train()
    encoder_train_mode(cfg, model)  # frozen (or BN-frozen tuned) encoder: batch-norm statistics stay ImageNet's
    sums: dict[str, float] = {}
    weight, batches, t0 = 0, 0, time.time()
    bar = tqdm(total=len(loader) + skip, initial=skip, desc=f"epoch {state.epoch + 1}",
               disable=not (run.progress and run.main), unit="batch")
    for i, batch in enumerate(loader, start=skip):
        bar.update(1)
        if batch is None:  # every image of this batch was unreadable
            continue
        terms = train_step(run.train_module, run.optimizer, batch.to(run.device, non_blocking=True), cfg, run.device,
                           f" at step {state.step} (epoch {state.epoch + 1})")
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


def train_step(objective: Callable[[Any], Terms], optimizer: torch.optim.Optimizer, batch: Any, cfg: Config,
               device: torch.device, where: str = "") -> Terms:
    """THE optimiser step (fit, the benchmark and the tests all call it): objective(batch) under the
    run's autocast, a finite-loss check, backward, gradient clipping over the optimiser's parameters
    (train.grad_clip), Adam. `where` ("at step 12 (epoch 1)") goes into the error messages."""
    with training_autocast(device, cfg):
        terms = objective(batch)
    if not torch.isfinite(terms.total):
        raise TrainingError(f"loss became {terms.total.item()}{where}; stopping. The last good checkpoint is kept. "
                            + _nonfinite_hint(batch, cfg))
    optimizer.zero_grad(set_to_none=True)
    terms.total.backward()
    if cfg.train.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], cfg.train.grad_clip)
    try:
        optimizer.step()
    except RuntimeError as e:  # e.g. overflow with an absurd learning rate
        raise TrainingError(f"optimizer step failed{where} ({e}); the last good checkpoint is kept. "
                            "Check train.lr.") from None
    return terms


def _nonfinite_hint(batch: Any, cfg: Config) -> str:
    """What to try after a non-finite loss: the inputs first (a random encoder's features can be huge),
    then the optimiser settings."""
    visual = getattr(batch, "images", None)
    if torch.is_tensor(visual) and visual.is_floating_point():
        peak = visual.detach().abs().amax().item()
        if not math.isfinite(peak) or peak > 1e4:
            return (f"The batch's encoder inputs reach {peak:.3g}: with model.pretrained={cfg.model.pretrained} the "
                    f"{cfg.model.encoder} features are out of a trainable range; use pretrained weights, or rebuild "
                    "the feature cache (data.cache_dir) if it predates this version.")
    return "Try a lower train.lr or train.grad_clip."


def _check_weights_finite(model: torch.nn.Module, step: int) -> None:
    """Never checkpoint NaN/inf weights: stop with a message and keep the last good file."""
    if not all(torch.isfinite(p).all() for p in model.parameters() if p.requires_grad):
        raise TrainingError(f"weights became NaN/inf at step {step}; stopping. The last good checkpoint is kept. "
                            "Try a lower train.lr or train.grad_clip.")


RESUMES = ": the last good checkpoint is kept, and the run resumes from it."


def save_last(run: Run) -> None:
    """The resumable checkpoint (weights, optimiser, state), written atomically by rank 0."""
    if not run.main:
        return
    opt_tensors, opt_info = optimizer_to_tensors(run.optimizer)
    save_checkpoint(run.last_path, run.cfg, run.vocab, run.model.state_dict(),
                    train_state={"state": run.state.__dict__, "optimizer": opt_info}, optimizer_tensors=opt_tensors,
                    then=RESUMES)


# ---------------------------------------------------------------- validation and the epoch's decisions

def validate(run: Run, stats: dict[str, float]) -> float:
    """Rank 0 decodes each val set with train.val_beam_size and the decode settings, scores it
    (evaluation.scoring.evaluate_model) and logs the record; the metric is shared with every rank. In a mix each
    set's scores are logged as "<set>/<metric>" and the selection metric is their mean over the sets
    (each caption set counts the same, whatever its size or sampling weight)."""
    cfg, state = run.cfg, run.state
    value = 0.0
    if run.main:
        metrics = [k for k in METRIC_KEYS if k != "METEOR"]  # METEOR (a Java process) only when it is val_metric
        metrics += [cfg.train.val_metric] if cfg.train.val_metric not in metrics + [NEW_WORDS_METRIC] else []
        per_set = {vs.name: _validate_set(run, vs, metrics) for vs in run.val_sets}
        if len(per_set) == 1:
            (scores, example), = per_set.values()
        else:
            scores = {f"{name}/{k}": v for name, (s, _) in per_set.items() for k, v in s.items()}
            scores[cfg.train.val_metric] = sum(s[cfg.train.val_metric] for s, _ in per_set.values()) / len(per_set)
            example = " | ".join(f"{name}: {ex}" for name, (_, ex) in per_set.items())
        value = scores[cfg.train.val_metric]
        rec = {"kind": "val", "epoch": state.epoch, "step": state.step,
               **{f"train_{k}": v for k, v in stats.items() if k not in ("seconds", "batches")},
               "epoch_seconds": stats["seconds"], "lr": run.optimizer.param_groups[0]["lr"], **scores}
        run.logger.write(rec)
        state.history.append(rec)
        train_txt = " ".join(f"{k} {v:.3f}" for k, v in stats.items() if k not in ("seconds", "batches"))
        run.log(f"epoch {state.epoch}: train {train_txt} ({stats['seconds']:.0f}s) | val "
                + " ".join(f"{k} {v:.4f}" for k, v in scores.items() if not k.endswith("n_images"))
                + f" | e.g. '{example}'")
    if run.world_size > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    return value


def _validate_set(run: Run, vs: Any, metrics: list[str]) -> tuple[dict[str, float], str]:
    """One val set's scores (with head_top1_agreement when the top stages are tuned) and a caption."""
    cfg = run.cfg
    feats, records = vs.feats, vs.records
    if feats is None:  # encoder in the loop: encode the val images with the current encoder
        feats, idx = encode_records(run.model, records, build_preprocess(cfg.model), run.device)
        records = [records[i] for i in idx]
    agreement = {}
    if cfg.from_activations:  # cached activations through the tuned top stages
        feats = top_features(run.model, feats, run.device)
        agreement = {"head_top1_agreement": head_agreement(run.model, feats, vs.teacher)}
    # decoded as the exported file will (as_exported.py); the Python PTB tokenizer: validation needs no Java
    # (a GPU machine often has none); METEOR still does
    with decoding_as_exported(run.model, cfg) as settings:
        scores, preds, _ = evaluate_model(run.model, run.vocab, feats, records, settings, metrics, log=run.log,
                                          tokenizer="python")
    return {**scores, **agreement, **_new_word_scores(run, scores, preds, records)}, next(iter(preds.values()))


def _new_word_scores(run: Run, scores: dict[str, float], preds: dict[str, str], records: Any) -> dict[str, float]:
    """train.extend_vocab: the new words' use on this val set (logged per word; new_words.py), and the
    selection metric CIDEr_new_words (plain CIDEr when the vocabulary has no new word)."""
    if not run.new_words:
        return {NEW_WORDS_METRIC: scores["CIDEr"]} if run.cfg.train.val_metric == NEW_WORDS_METRIC else {}
    new, line = new_word_scores(run.new_words, preds, records)
    run.log(f"  {line}")
    return {**new, NEW_WORDS_METRIC: scores["CIDEr"] + new["new_words_F1"]}


def end_epoch(run: Run, value: float, hit_max: bool) -> bool:
    """Keep the best checkpoint, decay the learning rate, decide on early stopping -> stop?"""
    cfg, state = run.cfg, run.state
    if value > state.best_metric:
        state.best_metric, state.best_epoch, state.bad_epochs, state.since_decay = value, state.epoch, 0, 0
        if run.main:
            meta = {"val": state.history[-1], "epoch": state.epoch, "objective": cfg.train.objective}
            save_checkpoint(run.best_path, cfg, run.vocab, run.model.state_dict(), metrics=meta, then=RESUMES)
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
                f"{state.best_metric:.4f} at epoch {state.best_epoch}; {_why_finished(state, cfg)}); nothing to do")
        return state.__dict__
    run.log(f"training on {run.device}: {len(run.dataset)} images, objective {cfg.train.objective}, "
            f"{len(run.batches)} batches/epoch/rank, {_source(cfg)}, "
            f"{sum(p.numel() for p in run.model.parameters() if p.requires_grad) / 1e6:.1f}M trainable parameters")
    if run.new_words and state.step == 0 and not state.history:
        validate_warm_start(run)
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


def validate_warm_start(run: Run) -> None:
    """train.extend_vocab: epoch 0 is the warm start before any step, validated like an epoch (how often it
    says the new words on val before training) and the first best."""
    end_epoch(run, validate(run, {"seconds": 0.0, "batches": 0}), False)


def _why_finished(state: TrainState, cfg: Config) -> str:
    """Which stopping rule ended a finished run, and the setting that would let it go on."""
    if cfg.train.max_steps and state.step >= cfg.train.max_steps:
        return f"train.max_steps={cfg.train.max_steps} reached: raise it to go on"
    if state.bad_epochs >= cfg.train.early_stop_patience:
        return (f"stopped early after {state.bad_epochs} epoch(s) without improvement: raise "
                "train.early_stop_patience to go on")
    return f"{state.epoch} of train.epochs={cfg.train.epochs} done: raise train.epochs to train longer"


def _source(cfg: Config) -> str:
    if cfg.from_activations:
        return f"cached activations through {cfg.model.tune_stages} tuned top stage(s)"
    return "encoder in the loop" if cfg.encoder_in_loop else "cached features"


def _loader(run: Run) -> Any:
    return epoch_loader(run.dataset, run.batches, run.collate_fn, not run.cfg.encoder_in_loop,
                        run.cfg.data.num_workers, run.device.type == "cuda")


def check_ranks_in_sync(model: torch.nn.Module, world_size: int) -> None:
    """DistributedDataParallel must keep every rank's parameters identical; verify it (cheaply)."""
    local = torch.stack([p.detach().double().sum() for p in model.parameters() if p.requires_grad]).cpu()
    gathered = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather_object(gathered, local)
    for r, other in enumerate(gathered[1:], start=1):
        if not torch.equal(other, gathered[0]):
            raise TrainingError(f"rank {r}'s parameters differ from rank 0's: distributed training is out of sync")
