"""Validation decodes as the exported file will.

The file a user runs is written by captioner-export, which carries a model file's word detectors and its
decode.person_floor (--detectors-from: the README's own-photos recipe carries the bundled model's). A run that
starts from that file (train.init_from) and keeps its encoder, frozen (train.init_encoder, no
model.tune_stages, no encoder in the loop), reads the same annotation vectors, so its validation can read the
same detectors: the captions it scores, the new words' use it logs and the epoch it keeps are then decoded
with the rules, the evidence and the person floor the exported file decodes with. The detectors are lent to
the model for the validation only (attach, then taken off again): the run's checkpoints stay as they were.
A run that teaches new words (train.extend_vocab) is exported with its starting file's decode settings
(exported_decode), so its validation decodes with those too.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from torch import nn

from ..checkpoint import Checkpoint, load_checkpoint
from ..concepts.detectors import WordDetectors, attach, detectors_of
from ..config import Config, DecodeConfig


def taught_from(cfg: Config) -> Path | None:
    """The model file a run that teaches new words (train.extend_vocab) started from (train.init_from), when it
    is there; None for any other run. captioner-export gives the taught model that file's decode settings and
    consensus memory: photos without the new words are then captioned as the starting model captions them."""
    if not (cfg.train.extend_vocab and cfg.train.init_from):
        return None
    path = Path(cfg.train.init_from)
    return path if path.is_file() else None


def exported_decode(cfg: Config, start_file: Checkpoint | None = None) -> DecodeConfig:
    """The decode settings captioner-export writes for this run (before its --set): for a taught run the
    starting file's own (taught_from: its rules, evidence, floors and whether the veto reads its word detectors,
    as that file decodes, older files' unstored settings filled in as checkpoint.load_checkpoint fills them),
    for any other the run's decode section. `start_file`: that file already read (a training run holds it)."""
    start = taught_from(cfg)
    if not start:
        return dataclasses.replace(cfg.decode)
    return dataclasses.replace((start_file or load_checkpoint(start)).config.decode)


def lends_detectors(cfg: Config) -> bool:
    """Whether the run reads the starting file's encoder unchanged, so that its word detectors (which read that
    encoder's annotation vectors) still hold for the trained model (export_detectors)."""
    frozen = cfg.train.init_encoder and not cfg.encoder_in_loop and cfg.model.tune_stages == 0
    return bool(cfg.train.init_from and frozen)


def export_detectors(cfg: Config, start_file: Checkpoint | None = None) -> tuple[WordDetectors, float] | None:
    """The starting file's word detectors and its person floor, when the run reads its encoder unchanged
    (lends_detectors); None otherwise or when it has none. `start_file`: that file already read."""
    if not lends_detectors(cfg):
        return None
    donor = start_file or load_checkpoint(cfg.train.init_from)
    if donor.detector_info is None:
        return None
    return WordDetectors.from_state(donor.detector_tensors, donor.detector_info), donor.config.decode.person_floor


@contextmanager
def decoding_as_exported(model: nn.Module, cfg: Config, start_file: Checkpoint | None = None
                         ) -> Iterator[DecodeConfig]:
    """with decoding_as_exported(model, cfg) as settings: decode val -> exported_decode(cfg) at train.val_beam_size, and
    (when export_detectors has them and the model carries none) the starting file's detectors on the model
    and its person floor in the settings, until the block ends. `start_file`: train.init_from already read."""
    settings = dataclasses.replace(exported_decode(cfg, start_file), beam_size=cfg.train.val_beam_size)
    lent = None if detectors_of(model) is not None else export_detectors(cfg, start_file)
    if lent is None:
        yield settings
        return
    attach(model, lent[0])
    try:
        yield dataclasses.replace(settings, person_floor=lent[1])
    finally:
        attach(model, None)
