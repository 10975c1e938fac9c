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
"""
from __future__ import annotations

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
