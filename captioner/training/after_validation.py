"""The decisions after each validation (engine._close_validation calls after_validation; run.validation_due says
when one falls: at each epoch's end, or every train.val_every_steps steps, inside epochs too): which validation's
weights `best.safetensors` holds, when the learning rate decays and when the run stops early (patience counted in
validations), and the log lines that say why.

The validation metric chooses only where it can: with fewer val photos than evaluation.metrics.MIN_VAL_PHOTOS
(tens of own photos split by name leave a handful) one caption moves the score by more than epochs differ, so the
last trained epoch is kept and the metric neither decays the learning rate nor stops the run. A warm start's
epoch 0 (the starting model before any step) is validated too; it can stay the best only where the scores can
choose, and then the run's last line says so.
"""
from __future__ import annotations

from ..checkpoint import save_checkpoint
from ..config import Config
from ..evaluation.metrics import MIN_VAL_PHOTOS
from .run import RESUMES, Run, TrainState, epoch_position
from .validation import validate


def few_val_photos(run: Run) -> int:
    """The smallest val set's photo count when it is below MIN_VAL_PHOTOS (too few to choose an epoch by its
    scores), else 0. The same on every rank: each holds the val records."""
    smallest = min((len(vs.records) for vs in run.val_sets), default=0)
    return smallest if 0 < smallest < MIN_VAL_PHOTOS else 0


def announce_small_val(run: Run) -> None:
    """The run's first word on a val split too small to choose by (few_val_photos): what it does instead."""
    if few := few_val_photos(run):
        t = run.cfg.train
        run.place.log(f"only {few} val photos (fewer than {MIN_VAL_PHOTOS}): too few to tell epochs apart by "
                      f"{t.val_metric}, so best.safetensors is the last trained epoch; the scores are logged for "
                      "information, and neither learning-rate decay nor early stopping reads them. More val photos ("
                      + (f"train.val_limit is {t.val_limit}; " if t.val_limit else "")
                      + "a split file, or more photos in the folder) let the scores choose")


def after_validation(run: Run, value: float, hit_max: bool) -> bool:
    """Keep the best checkpoint, decay the learning rate, decide on early stopping -> stop?
    With too few val photos (few_val_photos) the scores choose nothing: the last trained epoch is kept, the
    learning rate never decays and no epoch stops the run early; the starting model (epoch 0 of a warm start)
    is validated for comparison only. Otherwise a warm start's epoch 0 is the first best, and the log says so."""
    cfg, state, log = run.cfg, run.state, run.place.log
    few, name = few_val_photos(run), cfg.train.val_metric
    at, starting = epoch_position(run), state.epoch == 0 and not state.batch_in_epoch  # (a warm start's epoch 0)
    if few and starting:
        log(f"  the starting model's {name} {value:.4f}, for comparison only: {few} val photos are too few to "
            "choose by, so best.safetensors will be the last trained epoch")
    elif few or value > state.best_metric:
        state.best_metric, state.best_position, state.best_step = value, at, state.step
        state.bad_validations, state.since_decay = 0, 0
        if run.place.main:
            meta = {"val": state.history[-1], "epoch": at, "step": state.step, "objective": cfg.train.objective}
            save_checkpoint(run.best_path, cfg, run.vocab, run.model.state_dict(), metrics=meta, then=RESUMES)
        if few:  # (the log says nothing on other ranks)
            log(f"  kept the last epoch ({name} {value:.4f}; {few} val photos are too few to compare epochs) "
                f"-> {run.best_path}")
        else:
            start = (" (the starting model before any step: a trained epoch replaces it only if it does better)"
                     if starting else "")
            log(f"  new best {name} {value:.4f} -> {run.best_path}{start}")
    else:
        state.bad_validations += 1
        state.since_decay += 1
        plateau = cfg.train.schedule == "plateau"  # cosine/linear decay per step (optimizer.lr_scale), not here
        if plateau and state.since_decay >= cfg.train.lr_patience and cfg.train.lr_decay < 1:
            for g in run.optimizer.param_groups:
                g["lr"] *= cfg.train.lr_decay
            state.since_decay = 0
            log(f"  no improvement: learning rate x{cfg.train.lr_decay} -> {run.optimizer.param_groups[0]['lr']:.2e}")
    if not (few and starting):
        keep_best(run, value, few)
    state.lr = run.optimizer.param_groups[0]["lr"]
    stop = cfg.train.out_of_patience(state.bad_validations) or hit_max
    if stop:
        log(f"reached train.max_steps={cfg.train.max_steps}" if hit_max else
            f"early stopping: no {cfg.train.val_metric} improvement for {state.bad_validations} {validations(cfg)}")
    state.finished = stop or state.epoch >= cfg.train.epochs
    return stop


def keep_best(run: Run, value: float, few: int) -> None:
    """train.keep_best=k: the k best validated weights by the val metric as best_step<S>.safetensors (S the optimizer
    step), the others deleted; their (value, step) list is in the train state, so a resumed run keeps the same
    files. With too few val photos to choose by (few) the last k are kept. Tied values rank by the rule that picks
    best.safetensors (after_validation: only a better value replaces it): the earlier first, so the best file is always
    one of the kept ones."""
    k, state = run.cfg.train.keep_best, run.state
    if not k:
        return
    score = float(state.step) if few else value  # recency where the scores cannot choose
    kept = sorted(state.kept_best + [[score, state.step]], key=lambda e: (-e[0], e[1]))
    state.kept_best, dropped = kept[:k], kept[k:]
    if not run.place.main:
        return
    if [score, state.step] in state.kept_best:
        meta = {"val": state.history[-1], "epoch": epoch_position(run), "step": state.step,
                "objective": run.cfg.train.objective}
        save_checkpoint(run.out / f"best_step{state.step}.safetensors", run.cfg, run.vocab, run.model.state_dict(),
                        metrics=meta, then=RESUMES)
    for _, step in dropped:
        (run.out / f"best_step{step}.safetensors").unlink(missing_ok=True)


def validate_warm_start(run: Run) -> None:
    """train.extend_vocab: epoch 0 is the warm start before any step, validated like an epoch (how often it
    says the new words on val before training) and the first best where the scores can choose (after_validation)."""
    after_validation(run, validate(run, {"seconds": 0.0, "batches": 0}), False)


def validations(cfg: Config) -> str:
    """What early stopping and plateau decay count: epochs, or validations every train.val_every_steps steps of one
    process (N processes take every N-th as many of theirs: TrainConfig.val_interval)."""
    every = cfg.train.val_every_steps
    return f"validation(s) (every {every} steps of one process)" if every else "epoch(s)"


def why_finished(state: TrainState, cfg: Config) -> str:
    """Which stopping rule ended a finished run, and the setting that would let it go on."""
    if cfg.train.max_steps and state.step >= cfg.train.max_steps:
        return f"train.max_steps={cfg.train.max_steps} reached: raise it to go on"
    if cfg.train.out_of_patience(state.bad_validations):
        return (f"stopped early after {state.bad_validations} {validations(cfg)} without improvement: raise "
                "train.early_stop_patience to go on")
    return f"{state.epoch} of train.epochs={cfg.train.epochs} done: raise train.epochs to train longer"


def best_line(run: Run) -> str:
    """Which epoch best.safetensors holds and why, for the run's last line: the starting model (epoch 0) is
    named as such, so that a run whose trained epochs all lost to it never looks like a trained one."""
    cfg, state = run.cfg, run.state
    best = f"best {cfg.train.val_metric} {state.best_metric:.4f} at epoch {state.best_position}"
    if cfg.train.val_every_steps and state.best_step >= 0:
        best = f"best {cfg.train.val_metric} {state.best_metric:.4f} at step {state.best_step} (epoch {state.best_position})"
    if few := few_val_photos(run):
        return f"{best}, the last trained epoch ({few} val photos are too few to choose by their scores)"
    if state.best_position == 0:
        photos = sum(len(vs.records) for vs in run.val_sets)
        return (f"{best}: the starting model ({cfg.train.init_from or 'train.init_from'}) before any step, because "
                f"none of the {state.epoch} trained epoch(s) beat it on the {photos} val photos (the last one's weights "
                f"are in {run.last_path})")
    return best
