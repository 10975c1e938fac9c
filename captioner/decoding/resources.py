"""What decoding reads besides the model, the photos and the settings, as one value its owner holds and passes.

    fitted      the model file's fitted choice weights and confidence map (fitted.py)
    memory      the consensus memory beside the file (consensus.py), or None: the beam's order
    recordings  the owner's CUDA graphs of its encoder and search (device_beam.Recorded), or EAGER: op by op

A Captioner (api.py) holds one Resources: `of_file` reads the first two from the file `captioner.load` opened, and
the Captioner adds its own recordings. Decoding is handed it (captions.decode_photos, captions_from_features) and
never looks for it on the torch module or in a process-wide registry, so two Captioners on one model (one recorded,
one op by op; one with a file's fitted data, one without) never change each other's captions. Code that decodes
a model of its own (training's validation, the benchmark's synthetic decoder) passes NONE: nothing fitted, no
memory, op by op.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import Checkpoint, CheckpointError
from ..data.features import encoder_fingerprint
from ..model.show_attend_tell import ShowAttendTell
from .device_beam import EAGER, Recorded
from .consensus import ConsensusMemory, memory_path
from .fitted import NOTHING, Fitted


@dataclass(frozen=True)
class Resources:
    """What a decode reads besides the model (module doc): held by its owner, passed to what decodes."""

    fitted: Fitted = NOTHING
    memory: ConsensusMemory | None = None
    recordings: Recorded = EAGER


NONE = Resources()  # a model of its own: nothing fitted, no consensus memory, everything op by op


def of_file(ckpt: Checkpoint, path: str | Path, model: ShowAttendTell, device: torch.device | str) -> Resources:
    """The fitted data of a model file read as `ckpt` from `path` and the consensus memory beside it (checked to be
    built for `model`'s vocabulary and encoder; its CIDEr-D tables made on `device` now, not in the first caption);
    no recordings. A CheckpointError says what is wrong with which file."""
    try:
        fitted = Fitted.from_json(ckpt.fitted, str(path))
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    beside = memory_path(path)
    if not beside.is_file():
        return Resources(fitted)
    memory = ConsensusMemory.load(beside)
    if memory.vocab_size != len(ckpt.vocab) or memory.encoder not in ("", encoder_fingerprint(model.encoder)):
        raise CheckpointError(f"{beside} was built for another model (its vocabulary or encoder differs from "
                              f"{path}'s): rebuild it with captioner-build-consensus or remove it")
    memory.cider_to(device)  # once per file and process
    return Resources(fitted, memory)


__all__ = ["Resources", "NONE", "of_file"]
