"""Resuming a run: with the command's settings, and with every random state where the stopped run left it.

The config stored in last.safetensors is compared with the command's, key by key.

Safe to change (SAFE_TO_CHANGE: how long and how fast to train, logging, validation, decoding,
where things are written): applied, one logged line per changed key. A larger train.epochs (or
early_stop_patience, or max_steps) reopens a finished run; a new train.lr / encoder_lr /
weight_decay replaces the optimiser's stored (possibly decayed) value.
Anything else (model.*, the data and vocabulary: data.dataset, root, limit, min_word_count ...,
batch size, accumulation and seed, which fix the mid-epoch position, the weights' average, the objective,
the validation metric the best checkpoint was chosen on) would silently mix two runs: refused, with the
differing keys named and what each fixes (FIXED_BY).

Every random state a training step reads (capture, restore) (Python's, NumPy's, torch's CPU and CUDA generators) as JSON,
saved with the resumable checkpoint and restored on resume: a resumed run draws the same dropout masks and
SCST samples as one that never stopped. The batch order needs no state: it is a function of (seed, epoch).
"""
from __future__ import annotations

import os
import random
from typing import Any, Callable

import numpy as np
import torch

from ..config import Config

# keys (section.key) a resumed run may change
SAFE_TO_CHANGE = frozenset(
    [f"train.{k}" for k in (
        "out_dir", "epochs", "lr", "encoder_lr", "encoder_bn", "weight_decay", "grad_clip", "alpha_c", "alpha_head",
        "alpha_cam", "cam_min_prob", "cam_person", "label_smoothing", "lr_decay", "lr_patience", "schedule", "warmup_steps", "min_lr",
        "early_stop_patience", "val_beam_size", "val_limit", "val_every_steps", "amp", "cpu_amp", "compile", "capture", "log_every",
        "checkpoint_every", "max_steps", "scst_samples", "scst_baseline", "scst_max_len", "scst_bad_ending_penalty",
        "scst_dropout", "scst_xent", "scst_reward_end", "hard_expected_prob", "hard_reinforce", "hard_entropy",
        "hard_baseline_decay", "new_words_lr_factor", "keep_epochs", "keep_best", "tensorboard")]
    + [f"data.{k}" for k in ("cache_dir", "num_workers", "max_caption_len")]
    + ["decode.*"])
PATH_KEYS = ("data.root", "data.images", "data.annotations", "data.val_images", "data.val_annotations")
# a changed key -> (the role of the groups it sets, or None: every group that decays; the group's entry)
OPTIMIZER_KEYS = {"train.lr": ("decoder", "lr"), "train.encoder_lr": ("encoder", "lr"),
                  "train.weight_decay": (None, "weight_decay")}


def _flat(cfg: Config) -> dict[str, Any]:
    return {f"{section}.{k}": v for section, values in cfg.to_dict().items() for k, v in values.items()}


def _same(key: str, old: Any, new: Any) -> bool:
    if key in PATH_KEYS and old and new:  # "../shared/data/flickr8k" and its absolute path are one folder
        return os.path.realpath(old) == os.path.realpath(new)
    return old == new


def config_changes(stored: Config, cfg: Config) -> tuple[dict[str, tuple[Any, Any]], dict[str, tuple[Any, Any]]]:
    """(safe, unsafe): key -> (stored value, command's value) for every differing key."""
    old, new = _flat(stored), _flat(cfg)
    safe, unsafe = {}, {}
    for key in new:
        if not _same(key, old.get(key), new[key]):
            ok = key in SAFE_TO_CHANGE or f"{key.split('.')[0]}.*" in SAFE_TO_CHANGE
            (safe if ok else unsafe)[key] = (old.get(key), new[key])
    return safe, unsafe


# what an unsafe key fixes in a run (the refusal says it per key): a section's entry unless the key has its own
FIXED_BY = {
    "model": "the model the checkpoint's weights are",
    "data": "the photos, captions and vocabulary the run trains on",
    "train.batch_images": "which photos make each step, and so where the stopped epoch stands",
    "train.accumulate": "which photos make each step (a step's batch is batch_images x accumulate), and so where "
                        "the stopped epoch stands",
    "train.min_epoch_batches": "the epoch's batches, and so where the stopped epoch stands",
    "train.seed": "the batch order and every random draw of the run",
    "train.ema_decay": "the weights' average the checkpoint holds (validated, kept as best and per epoch)",
    "train.optimizer": "the optimiser whose moments the checkpoint holds",
    "train.objective": "what the run optimises",
    "train.val_metric": "the metric best.safetensors and keep_best were chosen on",
    "train.init_from": "what the run started from", "train.init_encoder": "what the run started from",
    "train.extend_vocab": "the vocabulary", "train.new_words_only": "which weights the run trains",
}


def fixed_by(key: str) -> str:
    """What a setting that cannot change on resume fixes in the run, in words (FIXED_BY)."""
    return FIXED_BY.get(key) or FIXED_BY.get(key.split(".")[0]) or "how the stopped run was built"


def check_resume(stored: Config, cfg: Config, source: str, log: Callable[[str], None]) -> dict[str, tuple[Any, Any]]:
    """The safe changes (logged, one line each); a ValueError naming every unsafe one and what it fixes."""
    safe, unsafe = config_changes(stored, cfg)
    if unsafe:
        listed = "; ".join(f"{k}: {a!r} (stored) vs {b!r} (this command), it fixes {fixed_by(k)}"
                           for k, (a, b) in unsafe.items())
        raise ValueError(f"cannot resume {source} with other settings: {listed}. Use the stored values, or start a "
                         "new run in another train.out_dir (train.init_from can start it from this run's weights).")
    for key, (a, b) in safe.items():
        log(f"resume: {key} {a!r} -> {b!r} (changed by this command; applied)")
    return safe


def reopen(state: Any, cfg: Config, log: Callable[[str], None]) -> None:
    """A finished run whose stopping rule the command relaxed (more epochs, more patience, more steps)
    goes on training; otherwise it stays finished."""
    if not state.finished:
        return
    t = cfg.train
    done = (state.epoch >= t.epochs or t.out_of_patience(state.bad_validations)
            or bool(t.max_steps and state.step >= t.max_steps))
    if not done:
        state.finished = False
        log(f"continuing a finished run: {state.epoch} epoch(s) done, training up to train.epochs={t.epochs}")


def apply_to_optimizer(optimizer: Any, changed: dict[str, tuple[Any, Any]]) -> None:
    """A changed train.lr / encoder_lr / weight_decay replaces the value the optimiser was restored with: the rates
    in the groups of their role (optimizer.py), the decay in the groups that decay."""
    for g in optimizer.param_groups:
        for key, (role, name) in OPTIMIZER_KEYS.items():
            if key in changed and (role == g.get("role") if role else g.get("decay", True)):
                g[name] = changed[key][1]


SHAPE_KEYS = ("encoder", "embed_dim", "hidden_dim", "attention_dim")  # model.* that shape the weights


def check_init(init: Config, cfg: Config, source: str) -> None:
    """train.init_from: a ValueError naming the model settings whose weights cannot be taken over."""
    differ = {k: (getattr(init.model, k), getattr(cfg.model, k)) for k in SHAPE_KEYS
              if getattr(init.model, k) != getattr(cfg.model, k)}
    if differ:
        listed = "; ".join(f"model.{k}: {a!r} in {source} vs {b!r} in this config" for k, (a, b) in differ.items())
        raise ValueError(f"cannot start from {source}: its weights were made with other model settings ({listed}). "
                         "Use its values for these settings.")


# ---------------------------------------------------------------- every random state

def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every CUDA device too


def capture_random_states() -> dict[str, Any]:
    """This process's generators, JSON-able."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": _listed(random.getstate()), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_random_states(state: dict[str, Any]) -> None:
    """Undo capture_random_states(): the generators continue exactly where the saved process left them."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _listed(value: Any) -> Any:
    return [_listed(v) for v in value] if isinstance(value, (tuple, list)) else value
