"""The learning rate per optimizer step (train.schedule, train.warmup_steps, train.min_lr).

The optimiser's param groups hold each group's LEVEL: train.lr and train.encoder_lr, multiplied by
train.lr_decay at each plateau (after_validation.after_validation, schedule plateau only). The rate a step uses is
level x lr_scale(step): a pure function of the step about to be taken, so a resumed run (whose state.step
and stored levels are the stopped run's) uses exactly the rates an uninterrupted one does, with no
scheduler object to save. With plateau and no warmup the scale is 1: today's behaviour, number for number.

    warmup   s < W:  (s + 1) / W                       (the first step already moves, at lr / W)
    cosine   after:  m + (1 - m) (1 + cos(pi p)) / 2   p = (s - W) / (total - W): 0 at the first step after warmup
    linear   after:  1 - (1 - m) p                     m = min_lr / lr (encoder_lr ends at the same fraction)

p reaches 1 (the rate min_lr) one step after the run's last, as in Hugging Face's cosine and linear schedules: with
the default min_lr=0 the last step still learns, at a small rate (a schedule ending at min_lr ON the last step would
spend that step at lr 0 and change nothing).
"""
from __future__ import annotations

import math

from ..config import TrainConfig, check_choice


def total_steps(train: TrainConfig, steps_per_epoch: int) -> int:
    """The run's optimizer steps, which cosine/linear decay over: train.epochs x steps per epoch, or
    train.max_steps where that comes first. (Early stopping may end a run before its schedule does.)"""
    total = train.epochs * steps_per_epoch
    return min(total, train.max_steps) if train.max_steps else total


def lr_scale(train: TrainConfig, step: int, total: int) -> float:
    """The factor on each group's level for optimizer step `step` (0-based: state.step before the step) of a
    run of `total` steps."""
    check_choice("train.schedule", train.schedule)
    warm = train.warmup_steps
    if step < warm:
        return (step + 1) / warm
    if train.schedule == "plateau":
        return 1.0
    floor = train.min_lr / train.lr if train.lr else 0.0
    p = min(max((step - warm) / max(total - warm, 1), 0.0), 1.0)
    if train.schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p))
    return 1.0 - (1.0 - floor) * p
