"""What a model file fitted to its own captions, read as the file's data and never as a user's setting.

Two things are fitted after training, on the val sets, by `captioner-fit-selector` (evaluation/choice_fit.py,
evaluation/confidence_fit.py):

    choice      the weight of each signal in the choice among the beam's finished captions (choice.py)
    confidence  the logistic map of how sure a caption is and the threshold of `sure` (confidence.py)

The fitter writes them in its report (--output, "fitted"); `captioner-export --fitted REPORT` stores them in the
model file's metadata under "fitted", as JSON (checkpoint.py: read without unpickling):

    {"choice": {"score": 1.0, "consensus": 0.0, "wide": 3.82069, ..., "objects": 3.0, "top_object": 0.0},
     "confidence": {"bias": -0.123361, "weights": {"wide": 1.66427, ...}, "sure_at": 0.3709}}

either part absent where none was fitted. `captioner.load` reads them (resources.of_file) into the Captioner's
Resources, beside the consensus memory, and decoding is handed them there; `Captioner.save` and the export keep them. A user
does not set these numbers, only whether they are used: decode.fitted_choice=false keeps the beam's order,
decode.fitted_confidence=false gives no confidence. A file written before they had a place of their own kept them
as decode settings (decode.consensus_weight, select_*, confidence_*, sure_at): config.split_fitted moves them here
when it loads, so it decodes exactly as it did.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import DecodeConfig
from .choice import BEAM_ORDER, Weights
from .confidence import ConfidenceMap

PARTS = ("choice", "confidence")


@dataclass(frozen=True)
class Fitted:
    """A model file's fitted choice weights and confidence map (None: not fitted)."""

    choice: Weights | None = None
    confidence: ConfidenceMap | None = None

    @classmethod
    def from_json(cls, data: Any, source: str = "model file") -> "Fitted":
        """The file's "fitted" entry -> Fitted; a ValueError names the file and what is wrong."""
        if not isinstance(data, dict) or set(data) - set(PARTS):
            raise ValueError(f"{source}: its fitted data must be a mapping of {' and '.join(PARTS)}, got {data!r}; "
                             "re-export it (captioner-export --fitted) or refit (captioner-fit-selector)")
        try:
            return cls(None if data.get("choice") is None else Weights.from_json(data["choice"]),
                       None if data.get("confidence") is None else ConfidenceMap.from_json(data["confidence"]))
        except ValueError as e:
            raise ValueError(f"{source}: its fitted data is unusable: {e}; re-export it (captioner-export --fitted) "
                             "or refit (captioner-fit-selector)") from None

    def to_json(self) -> dict[str, Any]:
        """What the model file stores (from_json reads it back); {} when nothing was fitted."""
        out: dict[str, Any] = {}
        if self.choice is not None:
            out["choice"] = self.choice.to_json()
        if self.confidence is not None:
            out["confidence"] = self.confidence.to_json()
        return out

    def merged(self, other: "Fitted") -> "Fitted":
        """These parts, each replaced by `other`'s where it has one (a newer fit of the choice or the map)."""
        return Fitted(self.choice if other.choice is None else other.choice,
                      self.confidence if other.confidence is None else other.confidence)

    def choice_in_use(self, settings: DecodeConfig) -> Weights:
        """The choice's weights a decode with `settings` uses: the fitted ones, unless decode.fitted_choice is off
        or none were fitted (then the beam's own order)."""
        return self.choice if settings.fitted_choice and self.choice is not None else BEAM_ORDER

    def map_in_use(self, settings: DecodeConfig) -> ConfidenceMap | None:
        """The confidence map a decode with `settings` uses: the fitted one unless decode.fitted_confidence is off."""
        return self.confidence if settings.fitted_confidence else None


NOTHING = Fitted()

