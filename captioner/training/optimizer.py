"""The optimiser (train.optimizer): Adam, or AdamW with the usual weight-decay split.

    adam    torch.optim.Adam: train.weight_decay is an L2 term added to every parameter's gradient (how every run
            before AdamW trained; with the default weight_decay 0 the two differ only in the split below)
    adamw   torch.optim.AdamW: decoupled weight decay (Loshchilov & Hutter 2019) on the matrices that multiply
            (linear, LSTM and convolution weights) only; biases, normalisation weights (every 1-D parameter) and
            the word embeddings are not decayed

The embeddings are this project's own exception: nanoGPT decays every tensor of 2+ dimensions, embeddings
included (its configure_optimizers), and timm and Hugging Face's Trainer leave out only biases and normalisation
weights. Here a word's row gets a gradient only in the steps whose captions use the word, while decoupled decay
shrinks every row at every step, so a rare word's row would shrink between its uses (docs/training.md).

One group per learning rate (the decoder's train.lr, the encoder's train.encoder_lr), split in two by decay under
adamw. Each group carries its `role` and whether it `decay`s, so a resumed command's new train.lr, encoder_lr or
weight_decay reaches the right groups (resume.apply_to_optimizer); the optimiser's moments and step counts are
saved in last.safetensors and restored, so a resumed run steps exactly as an uninterrupted one.

The learning rate per optimizer step (total_steps, lr_scale: train.schedule, train.warmup_steps, train.min_lr).

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
from typing import Sequence

import torch
from torch import nn

from ..config import TrainConfig, check_choice

Part = tuple[str, Sequence[nn.Parameter], float]  # (role, its parameters, its learning rate)


def undecayed(model: nn.Module) -> set[int]:
    """The ids of the parameters adamw does not decay: every 1-D parameter (biases, normalisation weights, scalars)
    and every embedding table."""
    skip = {id(p) for p in model.parameters() if p.ndim < 2}
    skip |= {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return skip


def build_optimizer(train: TrainConfig, model: nn.Module, parts: Sequence[Part]) -> torch.optim.Optimizer:
    """train.optimizer over `parts` (parameters of `model`); see the module's table."""
    check_choice("train.optimizer", train.optimizer)
    wd = train.weight_decay
    if train.optimizer == "adam":
        groups = [{"params": list(ps), "lr": lr, "role": role, "decay": True} for role, ps, lr in parts]
        return torch.optim.Adam(groups, weight_decay=wd)
    skip, groups = undecayed(model), []
    for role, ps, lr in parts:
        groups.append({"params": [p for p in ps if id(p) not in skip], "lr": lr, "role": role, "decay": True,
                       "weight_decay": wd})
        groups.append({"params": [p for p in ps if id(p) in skip], "lr": lr, "role": role, "decay": False,
                       "weight_decay": 0.0})
    return torch.optim.AdamW(groups, weight_decay=wd)


def keep_roles(optimizer: torch.optim.Optimizer, roles: Sequence[tuple[str, bool]]) -> None:
    """After load_state_dict (whose stored groups replace the built ones, and a checkpoint from before the roles
    has none): each group's role and decay flag as built."""
    for g, (role, decay) in zip(optimizer.param_groups, roles):
        g["role"], g["decay"] = role, decay


# ---------------------------------------------------------------- the learning rate per step

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
