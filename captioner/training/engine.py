"""Training engine, read top-down: the whole run, its steps up to each validation, one optimiser step, then the
checkpoints. Like nanoGPT's one step loop with its eval_interval, validation falls where one rule says
(run.validation_due: after each epoch, or every train.val_every_steps steps and at the run's end):

    fit(cfg)                    build_run (run.py): the run's context, one object (Run): the config, the
                                place (place.py: device, rank, log), the model and data sides, the state
      _train(run)               until the run is finished:
        _train_steps(run)         the steps from where the run stands to the next validation due or the epoch's end,
                                  unless a validation is owed where it stands (run.validation_owed: derived from
                                  the step and the history, never stored)
          train_to_validation       batch by batch from the resume point -> _one_step -> train_step
        _close_validation(run)    validate (validation.py), keep best / decay / stop (after_validation.py), save

Beside the loop, not threaded through it: stopping.py (a stop request becomes a saved step and Interrupted),
watch.py (log lines, TensorBoard), save_last / keep_epoch (checkpoints), resume.py (every random state).

The objective (objectives.py: cross-entropy or self-critical) is a callable of one shape, so the loop
never branches on what it optimises. fit() resumes from `last.safetensors` after an interruption,
keeps `best.safetensors` chosen on the validation metric of DECODED captions (validation.py, never
teacher-forced scores) at each validation, decays the learning rate and
stops early on that metric (after_validation.py: with too few val
photos the metric chooses nothing, the last epoch is kept, and the log says so) or decays it per step
(optimizer.lr_scale: warmup, cosine, linear), and writes
metrics.jsonl, TensorBoard events (watch.py) and training.png next to the checkpoints. A stop request
(stopping.py: Ctrl-C, SIGTERM) saves the exact step; every random state is saved with it (resume.py), so a
resumed run logs the same losses as one that never stopped.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..checkpoint import optimizer_to_tensors, save_checkpoint
from ..config import Config
from ..data.dataset import Batch, ImageDataset
from ..data.loader import epoch_loader
from ..logs import plot_history
from .objectives import Terms
from .ema import averaged
from .optimizer import lr_scale, total_steps
from .run import (RESUMES, Log, Run, TrainingError, TrainState, build_run, check_ranks_in_sync, describe_precision,
                  encoder_train_mode, epoch_position, training_autocast, validation_owed)
from .resume import capture_random_states
from .after_validation import announce_small_val, best_line, after_validation, validate_warm_start, why_finished
from .stopping import NEVER, Interrupted, StopSignal
from .validation import validate
from .watch import hparams_of

__all__ = ["TrainingError", "TrainState", "Interrupted", "fit", "train_to_validation", "train_step", "finish_step", "validate",
           "after_validation"]


# ---------------------------------------------------------------- the whole run

def fit(cfg: Config, device: str | torch.device = "cpu", log: Log = print, progress: bool = True,
        rank: int = 0, world_size: int = 1, stop: StopSignal = NEVER) -> dict[str, Any]:
    """Train according to `cfg`; returns the final train state as a dict. Rerunning the same
    command after an interruption resumes from out_dir/last.safetensors. `stop` (StopSignal.catch() in the
    command) turns Ctrl-C / SIGTERM into a saved step and Interrupted."""
    state = None
    try:
        run = build_run(cfg, device, log if rank == 0 else (lambda _: None), progress, rank, world_size, stop)
        state = run.state
        return _train(run)
    except Interrupted as e:
        e.where = e.where or (state.stopped_at(_owed(run)) if state else "stopped before training began")
        raise
    finally:
        if state is not None:
            run.watch.close()


def _train(run: Run) -> dict[str, Any]:
    cfg, state, place = run.cfg, run.state, run.place
    if state.finished:
        place.log(f"{run.last_path}: this run already finished (best {cfg.train.val_metric} "
                  f"{state.best_metric:.4f} at epoch {state.best_position}; {why_finished(state, cfg)}); nothing to do")
        return state.to_dict()
    place.log(f"training on {place.device}: {len(run.dataset)} images, objective {cfg.train.objective}, "
              f"{run.steps_per_epoch} batches/epoch/rank{_accumulated(cfg)}, {_source(cfg)}, "
              f"{describe_precision(place.device, cfg)}, "
              f"{sum(p.numel() for p in run.model.parameters() if p.requires_grad) / 1e6:.1f}M trainable parameters")
    place.log(f"(attention penalty = train.alpha_c {cfg.train.alpha_c:g} x sum over the {cfg.model.grid_size ** 2} regions "
              "of (1 - attention the caption gave it)^2, per caption: the paper's doubly stochastic term, eq. 14)")
    if n := cfg.train.val_interval(place.world_size):
        place.log(f"a validation every {n} optimizer steps ({run.steps_per_epoch / n:.2f} times an epoch of "
                  f"{run.steps_per_epoch} steps{_scaled(cfg, place.world_size)}) and at the run's end; the learning "
                  "rate's plateau decay and early stopping count validations")
    announce_small_val(run)
    if run.new_words and state.step == 0 and not state.history:
        validate_warm_start(run)
    while _owed(run) or state.epoch < cfg.train.epochs:
        if not _owed(run):  # the resume point (TrainState): steps remain before the next validation
            _train_steps(run)
        if _owed(run) and _close_validation(run):
            break
    run.watch.hparams(*hparams_of(cfg.to_dict(), state.history, state.best_position), state.step)
    place.log(f"done: {best_line(run)} -> {run.best_path}")
    return state.to_dict()


def _train_steps(run: Run) -> None:
    """The steps from where the run stands (a resumed epoch, or one that goes on after a validation inside it,
    starts at state.batch_in_epoch) to the next validation due (run.validation_due) or the epoch's end, then saved:
    the steps are on disk before their validation, which a stop may cut short. An epoch that goes on after a
    validation inside it reads on from there as a resumed one does, so a stop at any step resumes to the same
    numbers."""
    state, place = run.state, run.place
    run.sampler.set_epoch(state.epoch)
    skip = run.batches.start = state.batch_in_epoch
    train_to_validation(run, _loader(run), skip=skip)
    if _owed(run):  # a validation inside the epoch (saved by train_to_validation)
        return
    _check_weights_finite(run.model, state.step)
    if place.world_size > 1:
        check_ranks_in_sync(run.model, place.world_size)
        place.log(f"parameters identical across {place.world_size} ranks after step {state.step}")
    state.epoch, state.batch_in_epoch = state.epoch + 1, 0
    if not _owed(run):  # train.val_every_steps: an epoch's end between validations still keeps its weights
        with averaged(run.ema, run.model):
            keep_epoch(run)
    save_last(run)


def _owed(run: Run) -> bool:
    """Whether a validation is owed where the run stands (run.validation_owed: the steps since the latest one end
    where THE rule, run.validation_due, validates)."""
    return validation_owed(run.cfg.train, run.place.world_size, run.state, run.steps_per_epoch)


def _close_validation(run: Run) -> bool:
    """Validate where the run stands (an epoch's end, or a step inside an epoch), keep/decay/stop, save -> stop?
    The tally's averages are the training terms since the previous validation."""
    cfg, state = run.cfg, run.state
    hit_max = bool(cfg.train.max_steps and state.step >= cfg.train.max_steps)
    with averaged(run.ema, run.model):  # train.ema_decay: the average is validated, kept as best and per epoch
        stop = after_validation(run, validate(run, state.tally.averages()), hit_max)
        if not state.batch_in_epoch:  # at an epoch's end
            keep_epoch(run)
    state.tally.reset()
    save_last(run)
    if run.place.main:
        plot_history(run.out / "metrics.jsonl", run.out / "training.png")
    return stop


# ---------------------------------------------------------------- the steps up to a validation, in order

def train_to_validation(run: Run, loader: Sequence | Any, skip: int = 0) -> None:
    """The epoch's steps over `loader` (already starting at batch `skip` when resuming) up to a step due for
    validation inside the epoch (run.validation_due) or the epoch's end. A step due for validation ends the pass
    there, saved (the validation owed: run.validation_owed), for _train to validate before the epoch reads on. The objective's
    logged terms are summed in the train state (its tally, each weighted by what it is a mean over:
    Terms.count) until the validation reads them, so a run stopped and resumed averages exactly what an
    uninterrupted one does. A stop request is honoured after the step it arrives in: that step is saved, then
    Interrupted is raised."""
    from tqdm import tqdm

    cfg, state, model, place = run.cfg, run.state, run.model, run.place
    model.train()
    encoder_train_mode(cfg, model)  # frozen (or BN-frozen tuned) encoder: batch-norm statistics stay ImageNet's
    t0, per_epoch = time.time(), run.steps_per_epoch
    total = total_steps(cfg.train, per_epoch)  # the schedule's length (cosine, linear)
    bar = tqdm(total=per_epoch, initial=skip, desc=f"epoch {state.epoch + 1}", disable=not (place.progress and place.main),
               unit="step")
    run.watch.restart_clock()
    with run.stop.deferred():
        for i, micro in enumerate(loader, start=skip):  # one optimizer step's micro-batches (train.accumulate)
            bar.update(1)
            state.batch_in_epoch = i + 1
            if micro:  # empty: every image of this step was unreadable
                _one_step(run, micro, per_epoch - (i + 1), per_epoch, total)
            if cfg.train.max_steps and state.step >= cfg.train.max_steps:
                break
            owed = _owed(run)  # a validation inside the epoch (its last step is the epoch's end: _train_steps)
            saved = _save_after_step(run, micro, t0, owed)
            t0 = time.time() if saved else t0
            if signum := run.stop.pending(place.world_size, place.device):
                if not saved:
                    state.tally.seconds += time.time() - t0
                    save_last(run)
                raise Interrupted(signum, state.stopped_at(owed) if owed
                                  else f"stopped at epoch {state.epoch + 1}, step {state.step}")
            if owed:
                break
    bar.close()
    state.tally.seconds += time.time() - t0


def _scaled(cfg: Config, world_size: int) -> str:
    """The log's word on train.val_every_steps counting one process's steps, where N processes scale it."""
    if world_size == 1:
        return ", train.val_every_steps"
    return (f"; train.val_every_steps={cfg.train.val_every_steps} counts one process's steps, and each of these "
            f"{world_size} processes' steps reads {world_size} batches")


def _save_after_step(run: Run, micro: list[Any], t0: float, owed: bool) -> bool:
    """The checkpoint after a step, where one is due: before a validation inside the epoch (`owed`), or every
    train.checkpoint_every steps -> saved?"""
    cfg, state = run.cfg, run.state
    periodic = bool(micro and cfg.train.checkpoint_every and state.step % cfg.train.checkpoint_every == 0)
    if not (owed or periodic):
        return False
    _check_weights_finite(run.model, state.step)
    state.tally.seconds += time.time() - t0
    save_last(run)
    return True


def _one_step(run: Run, micro: list[Any], steps_left: int, per_epoch: int, total: int) -> None:
    """An optimizer step over the step's micro-batches (one unless train.accumulate) and its bookkeeping: the
    epoch's tally, the watcher's line. steps_left, per_epoch: this epoch's optimizer
    steps; total: the run's (optimizer.total_steps). train_step moves the micro-batches to the device, one at a
    time, so only one micro-batch is there at once."""
    cfg, state, device = run.cfg, run.state, run.place.device
    scale, where = lr_scale(cfg.train, state.step, total), f" at step {state.step} (epoch {state.epoch + 1})"
    recorded = run.captured(micro[0]) if run.captured is not None and len(micro) == 1 else None
    if recorded is not None:  # train.capture: the backward replayed (captured_step.py), then clip and optimise
        if not math.isfinite(float(recorded.total)):
            raise TrainingError(f"loss became {float(recorded.total)}{where}; stopping. The last good checkpoint "
                                "is kept. Try a lower train.lr or train.grad_clip.")
        terms = finish_step(run.optimizer, recorded, cfg, where, scale, run.scaler)
    else:
        terms = train_step(run.train_module, run.optimizer, micro, cfg, device, where, scale, run.scaler)
    if run.ema is not None:
        run.ema.update(run.model)
    state.step += 1
    state.tally.add(terms, len(micro))  # each log weighted by what it is a mean over (Terms.count)
    run.watch.count(sum(len(b.visual) for b in micro), sum(len(b.inputs) for b in micro))
    if state.step % cfg.train.log_every == 0:
        lr = run.optimizer.param_groups[0]["lr"] * scale  # the rate this step used
        # "epoch": where the run stands in epochs (epoch_position), as in the val records: 0.7 after batch 7 of 10
        rec = {"kind": "train", "epoch": epoch_position(run), "step": state.step, **terms.logs, "lr": lr,
               "grad_norm": float(terms.grad_norm), "time": time.time()}
        run.logger.write(run.watch.report(rec, state.epoch + 1, steps_left,
                                          steps_left + per_epoch * (cfg.train.epochs - state.epoch - 1)))


# ---------------------------------------------------------------- one optimiser step

def train_step(objective: Callable[[Any], Terms], optimizer: torch.optim.Optimizer, batch: Any, cfg: Config,
               device: torch.device, where: str = "", lr_scale: float = 1.0,
               scaler: torch.amp.GradScaler | None = None) -> Terms:
    """THE optimiser step (fit, the benchmark and the tests all call it): objective(batch) under the
    run's autocast, a finite-loss check, backward, gradient clipping over the optimiser's parameters
    (train.grad_clip), the optimiser (Adam or AdamW: optimizer.py) at each group's lr x `lr_scale`
    (optimizer.lr_scale). `batch` may be a list of micro-batches (train.accumulate): their gradients are summed,
    each loss weighted by its share of the step's normaliser (micro_shares), so k micro-batches of B make the
    step one batch of kB would; clipping sees the summed gradient. `scaler`: fp16's GradScaler (run.grad_scaler).
    Each micro-batch (a Batch) goes to `device` here, one at a time: the loop hands over the batches as read.
    `where` ("at step 12 (epoch 1)") goes into the error messages."""
    micro = list(batch) if isinstance(batch, (list, tuple)) else [batch]
    shares = micro_shares(micro, cfg) if len(micro) > 1 else [1.0]
    optimizer.zero_grad(set_to_none=True)
    parts = []
    for i, (b, share) in enumerate(zip(micro, shares)):
        b = b.to(device, non_blocking=True) if isinstance(b, Batch) else b
        with _sync_unless(objective, i == len(micro) - 1):  # DDP: one all-reduce per step, after the last micro-batch
            with training_autocast(device, cfg):
                terms = objective(b)
            if not torch.isfinite(terms.total):
                raise TrainingError(f"loss became {terms.total.item()}{where}; stopping. The last good checkpoint is "
                                    "kept. " + _nonfinite_hint(b, cfg))
            loss = terms.total if share == 1.0 else terms.total * share
            (scaler.scale(loss) if scaler is not None else loss).backward()
        parts.append(terms)
    terms = parts[0] if len(parts) == 1 else _merged(parts, shares)
    return finish_step(optimizer, terms, cfg, where, lr_scale, scaler)


def finish_step(optimizer: torch.optim.Optimizer, terms: Terms, cfg: Config, where: str = "", lr_scale: float = 1.0,
                scaler: torch.amp.GradScaler | None = None) -> Terms:
    """The step once the gradients are in the parameters' .grad (train_step's backward, or a recorded step's replay:
    captured_step.py): clipping over the optimiser's parameters (train.grad_clip; the norm before it is logged) and
    the optimiser at each group's lr x `lr_scale`."""
    if scaler is not None:
        scaler.unscale_(optimizer)  # clipping and the logged norm see the true gradient
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    # the norm before clipping (logged); max_norm inf when clipping is off: measured, not clipped
    terms.grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf)
    try:
        _optimizer_step(optimizer, lr_scale, scaler)
    except RuntimeError as e:  # e.g. overflow with an absurd learning rate
        raise TrainingError(f"optimizer step failed{where} ({e}); the last good checkpoint is kept. "
                            "Check train.lr.") from None
    return terms


def micro_shares(micro: Sequence[Any], cfg: Config) -> list[float]:
    """Each micro-batch's share of one accumulated step. The objectives divide by tokens: cross-entropy by the
    references' tokens (known from the batch: the shares are exact, the step equals one big batch's), SCST by its
    sampled tokens (known only after sampling: images stand in for them, equal shares per image)."""
    sizes = [float(b.lengths.sum()) if cfg.train.objective == "xe" else float(len(b.visual)) for b in micro]
    total = sum(sizes) or 1.0
    return [s / total for s in sizes]


def _merged(parts: Sequence[Terms], shares: Sequence[float]) -> Terms:
    """One step's Terms from its micro-batches': the weights and counts add up, and each log is the mean over what
    it counts (Terms.count: tokens for the cross-entropy, captions for the attention penalty), so the step logs what
    one batch of all its micro-batches logs."""
    weight = sum(t.weight for t in parts)
    counts = {k: sum(t.count(k) for t in parts) for k in parts[0].logs}
    logs = {k: sum(t.logs.get(k, 0.0) * t.count(k) for t in parts) / max(counts[k], 1) for k in parts[0].logs}
    total = sum(t.total.detach() * s for t, s in zip(parts, shares))
    return Terms(total, weight, logs, counts=counts)


def _sync_unless(objective: Any, last: bool):
    """DistributedDataParallel's no_sync() for every micro-batch but the last (gradients are all-reduced once)."""
    no_sync = getattr(objective, "no_sync", None)
    return contextlib.nullcontext() if last or no_sync is None else no_sync()


def _optimizer_step(optimizer: torch.optim.Optimizer, lr_scale: float, scaler: torch.amp.GradScaler | None) -> None:
    """optimizer.step() at each group's lr x lr_scale; the groups keep their levels (plateau decays, a resumed
    command's new train.lr), so the schedule stays a function of the step alone."""
    levels = [g["lr"] for g in optimizer.param_groups]
    if lr_scale != 1.0:
        for g, level in zip(optimizer.param_groups, levels):
            g["lr"] = level * lr_scale
    try:
        if scaler is None:
            optimizer.step()
        else:  # skips the step where fp16 gradients overflowed, and adapts the scale
            scaler.step(optimizer)
            scaler.update()
    finally:
        for g, level in zip(optimizer.param_groups, levels):
            g["lr"] = level


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


# ---------------------------------------------------------------- checkpoints

def save_last(run: Run) -> None:
    """The resumable checkpoint (weights, optimiser, state and every rank's random states), written atomically
    by rank 0. Every rank calls it at the same points: the random states are gathered first."""
    states = [capture_random_states()]
    if run.place.world_size > 1:
        states = [None] * run.place.world_size
        dist.all_gather_object(states, capture_random_states())
    if not run.place.main:
        return
    opt_tensors, opt_info = optimizer_to_tensors(run.optimizer)
    if run.ema is not None:  # the weights' averages: training tensors like Adam's moments
        opt_tensors.update(run.ema.tensors())
    save_checkpoint(run.last_path, run.cfg, run.vocab, run.model.state_dict(),
                    train_state={"state": run.state.to_dict(), "optimizer": opt_info, "rng": states,
                                 **({"scaler": run.scaler.state_dict()} if run.scaler is not None else {})},
                    optimizer_tensors=opt_tensors, then=RESUMES)


def keep_epoch(run: Run) -> None:
    """train.keep_epochs: the weights after each epoch as epoch_E.safetensors, the last k kept (for
    captioner-export --average); older ones are deleted. Its "val" is the latest validation's record."""
    k = run.cfg.train.keep_epochs
    if not (k and run.place.main):
        return
    save_checkpoint(run.out / f"epoch_{run.state.epoch}.safetensors", run.cfg, run.vocab, run.model.state_dict(),
                    metrics={"val": run.state.history[-1] if run.state.history else {}, "epoch": run.state.epoch},
                    then=RESUMES)
    for old in sorted(run.out.glob("epoch_*.safetensors"), key=lambda p: int(p.stem.split("_")[1]))[:-k]:
        old.unlink(missing_ok=True)


# ---------------------------------------------------------------- what the log says, the epoch's loader

def _accumulated(cfg: Config) -> str:
    t = cfg.train
    if t.accumulate == 1:
        return ""
    return (f" of {t.accumulate * t.batch_images} images, each read as {t.accumulate} micro-batches of "
            f"{t.batch_images} (train.accumulate)")


def _source(cfg: Config) -> str:
    if cfg.from_activations:
        return f"cached activations through {cfg.model.tune_stages} tuned top stage(s)"
    return "encoder in the loop" if cfg.encoder_in_loop else "cached features"


def _loader(run: Run) -> Any:
    # the images' loader draws its workers' seeds from its own generator, never the global one (which would
    # make a resumed epoch's dropout differ from an uninterrupted one's)
    seed = run.cfg.train.seed * 100_003 + run.state.epoch
    if isinstance(run.dataset, ImageDataset):  # its augmentations are drawn per (seed, epoch, image), in any worker
        run.dataset.set_epoch(run.state.epoch)
    return epoch_loader(run.dataset, run.batches, run.collate_fn, not run.cfg.encoder_in_loop,
                        run.cfg.data.num_workers, run.place.device.type == "cuda", seed, run.cfg.train.batch_images)
