"""An exponential moving average of the trained weights (train.ema_decay): after every optimizer step
    shadow <- decay * shadow + (1 - decay) * weight
for each trained parameter (frozen ones never change, so they need none). Validation, best.safetensors and the
kept epochs use the average (`applied`), training goes on from the raw weights; the average is saved with the
resumable checkpoint, so a resumed run averages what an uninterrupted one does.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

PREFIX = "ema."  # its tensors' names among the resumable checkpoint's training tensors


class EMA:
    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        # the trained parameters' names -> their averages, starting at the weights the run starts from
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """After an optimizer step: each average moves (1 - decay) of the way to its weight."""
        for name, p in model.named_parameters():
            if name in self.shadow:
                self.shadow[name].lerp_(p.detach(), 1.0 - self.decay)

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module) -> Iterator[None]:
        """The model holds the averages inside the block and its own weights again after it."""
        params = dict(model.named_parameters())
        raw = {n: params[n].detach().clone() for n in self.shadow}
        with torch.no_grad():
            for n, avg in self.shadow.items():
                params[n].copy_(avg)
        try:
            yield
        finally:
            with torch.no_grad():
                for n, weight in raw.items():
                    params[n].copy_(weight)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The averages under their checkpoint names."""
        return {PREFIX + n: t for n, t in self.shadow.items()}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """The averages a stopped run saved (`tensors`: the checkpoint's training tensors; the others ignored)."""
        saved = {k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)}
        if set(saved) != set(self.shadow):
            raise ValueError(f"the checkpoint's weight averages ({len(saved)}) are not this run's trained parameters "
                             f"({len(self.shadow)})")
        for n, v in saved.items():
            self.shadow[n].copy_(v)


@contextlib.contextmanager
def averaged(ema: EMA | None, model: torch.nn.Module) -> Iterator[None]:
    """ema.applied(model), or nothing when the run keeps no average."""
    if ema is None:
        yield
    else:
        with ema.applied(model):
            yield
