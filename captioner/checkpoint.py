"""Checkpoints: safetensors tensors + JSON metadata (config, vocabulary, metrics, training state).

Loading never unpickles: safetensors only parses a JSON header and raw tensor bytes, so a file
crafted to run code cannot. Writes go to a temporary file that is renamed into place, so a crash
mid-write leaves the previous checkpoint intact.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .config import Config
from .vocab import Vocab

FORMAT = "captioner-checkpoint/1"
_OPT = "optimizer."


class CheckpointError(ValueError):
    """The file is not a usable captioner checkpoint; the message says what is wrong."""


@dataclass
class Checkpoint:
    config: Config
    vocab: Vocab
    model_state: dict[str, torch.Tensor]
    metrics: dict[str, Any] = field(default_factory=dict)
    train_state: dict[str, Any] | None = None  # epoch, step, best, history ... (resumable checkpoints)
    optimizer_tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def save_checkpoint(path: str | Path, config: Config, vocab: Vocab, model_state: dict[str, torch.Tensor],
                    metrics: dict[str, Any] | None = None, train_state: dict[str, Any] | None = None,
                    optimizer_tensors: dict[str, torch.Tensor] | None = None, half: bool = False) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for k, v in model_state.items():
        v = v.detach().cpu()
        if half and v.is_floating_point():
            v = v.half()
        tensors[k] = v.contiguous()
    for k, v in (optimizer_tensors or {}).items():
        tensors[_OPT + k] = v.detach().cpu().contiguous()
    meta = {"format": FORMAT, "config": json.dumps(config.to_dict()), "vocab": vocab.to_json(),
            "metrics": json.dumps(metrics or {})}
    if train_state is not None:
        meta["train_state"] = json.dumps(train_state)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=meta)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never half


def load_checkpoint(path: str | Path) -> Checkpoint:
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        with open(path, "rb") as fh:
            head = fh.read(2)
        hint = (" It looks like a pickle (torch.save) file: captioner never unpickles files, because "
                "unpickling can run arbitrary code. Re-save the weights with safetensors.") if head[:1] == b"\x80" or head == b"PK" else ""
        raise CheckpointError(f"{path}: not a readable safetensors checkpoint ({e}).{hint}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: missing or unknown format tag {meta.get('format')!r}; expected {FORMAT}")
    try:
        config = Config.from_dict(json.loads(meta["config"]), source=f"{path} (config)")
        vocab = Vocab.from_json(meta["vocab"])
        metrics = json.loads(meta.get("metrics", "{}"))
        train_state = json.loads(meta["train_state"]) if "train_state" in meta else None
    except (KeyError, json.JSONDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt metadata ({e})") from None
    model_state = {k: v for k, v in tensors.items() if not k.startswith(_OPT)}
    optim = {k[len(_OPT):]: v for k, v in tensors.items() if k.startswith(_OPT)}
    return Checkpoint(config, vocab, model_state, metrics, train_state, optim)


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """load_state_dict with an error that names what does not match."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        parts = []
        if shapes:
            parts.append("shape mismatch: " + "; ".join(shapes[:5]))
        if missing:
            parts.append(f"{len(missing)} missing tensors (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensors (e.g. {', '.join(unexpected[:3])})")
        raise CheckpointError(f"{source} does not fit the model its config describes: " + "; ".join(parts)
                              + ". Was it made with another encoder or vocabulary?")
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=True)


def optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Optimizer state -> flat tensors + JSON-able scalars (no pickling)."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{pid}.{k}"] = v
            else:
                scalars[f"{pid}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_tensors(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                           info: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    for key, v in info.get("scalars", {}).items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    optimizer.load_state_dict({"state": state, "param_groups": info["param_groups"]})
