"""What decoding reads besides the model, photos and settings, held and passed by its owner (a Captioner), so two
Captioners on one model never change each other's captions: the file's Fitted data, the consensus memory beside it
(None: the beam's order) and the owner's CUDA graphs (EAGER: op by op); a model of its own passes NONE.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import Checkpoint, CheckpointError
from ..config import DecodeConfig
from ..data.features import encoder_fingerprint
from ..model.graphs import EAGER, Recorded
from ..model.show_attend_tell import ShowAttendTell
from .choice import BEAM_ORDER, Weights
from .confidence import ConfidenceMap
from .consensus import ConsensusMemory, memory_path

REFIT = "re-export it (captioner-export --fitted) or refit (captioner-fit-selector)"


@dataclass(frozen=True)
class Fitted:
    """A model file's fitted choice weights and confidence map (None: not fitted), as its metadata stores them:
    {"choice": {"score": 1.0, "wide": 3.82, ...}, "confidence": {"bias": -0.12, "weights": {...}, "sure_at": .37}}."""
    choice: Weights | None = None
    confidence: ConfidenceMap | None = None

    @classmethod
    def from_json(cls, data: Any, source: str = "model file") -> "Fitted":
        if not isinstance(data, dict) or set(data) - {"choice", "confidence"}:
            raise ValueError(f"{source}: its fitted data must be a mapping of choice and confidence, got {data!r}; "
                             f"{REFIT}")
        try:
            return cls(None if data.get("choice") is None else Weights.from_json(data["choice"]),
                       None if data.get("confidence") is None else ConfidenceMap.from_json(data["confidence"]))
        except ValueError as e:
            raise ValueError(f"{source}: its fitted data is unusable: {e}; {REFIT}") from None

    def to_json(self) -> dict[str, Any]:
        """What the model file stores; {} when nothing was fitted."""
        parts = {"choice": self.choice, "confidence": self.confidence}
        return {name: part.to_json() for name, part in parts.items() if part is not None}

    def merged(self, other: "Fitted") -> "Fitted":
        """Each part replaced by `other`'s where it has one."""
        return Fitted(self.choice if other.choice is None else other.choice,
                      self.confidence if other.confidence is None else other.confidence)

    def choice_in_use(self, settings: DecodeConfig) -> Weights:
        return self.choice if settings.fitted_choice and self.choice is not None else BEAM_ORDER

    def map_in_use(self, settings: DecodeConfig) -> ConfidenceMap | None:
        return self.confidence if settings.fitted_confidence else None


NOTHING = Fitted()


@dataclass(frozen=True)
class Resources:
    fitted: Fitted = NOTHING
    memory: ConsensusMemory | None = None
    recordings: Recorded = EAGER


NONE = Resources()  # a model of its own: nothing fitted, no consensus memory, op by op


def of_file(ckpt: Checkpoint, path: str | Path, model: ShowAttendTell, device: torch.device | str) -> Resources:
    """The fitted data of the file read as `ckpt` from `path` and the memory beside it (checked against `model`'s
    vocabulary and encoder; its CIDEr-D tables made on `device` now); a CheckpointError names what is wrong."""
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
