"""Every random state a training step reads (Python's, NumPy's, torch's CPU and CUDA generators) as JSON,
saved with the resumable checkpoint and restored on resume: a resumed run draws the same dropout masks and
SCST samples as one that never stopped. The batch order needs no state: it is a function of (seed, epoch)."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every CUDA device too


def capture() -> dict[str, Any]:
    """This process's generators, JSON-able."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": _listed(random.getstate()), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore(state: dict[str, Any]) -> None:
    """Undo capture(): the generators continue exactly where the saved process left them."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _listed(value: Any) -> Any:
    return [_listed(v) for v in value] if isinstance(value, (tuple, list)) else value
