"""The consensus memory beside a model file: the training photos' pooled features (int8, each row scaled to +-127:
99.3-99.6% of the val photos' 5 nearest kept) and captions, which the choice compares a candidate with (Devlin et
al. 2015). Legend: B photos, P regions, D feature dim, M memory photos, C memory captions, T their words in all.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ..checkpoint import CheckpointError, read_safetensors, write_safetensors
from .cider import CiderD

FORMAT = "captioner-consensus/1"
SUFFIX = ".consensus.safetensors"
REBUILD = "rebuild it with captioner-build-consensus"
_cider_of_file: dict[tuple[str, int, int], CiderD] = {}  # ConsensusMemory.cider of each memory file, this process


def memory_path(model_file: str | Path) -> Path:
    """Where a model file's consensus memory lives: default.safetensors -> default.consensus.safetensors."""
    p = Path(model_file)
    return p.with_name(p.name.removesuffix(".safetensors") + SUFFIX)


@dataclass
class ConsensusMemory:
    features: torch.Tensor  # (M, D) int8, each row a training photo's mean annotation vector, largest entry +-127
    tokens: torch.Tensor  # (T,) int32: every caption's word ids (no <start> / <end>), one after another
    caption_ends: torch.Tensor  # (C,) int64: where each caption ends in `tokens`
    photo_ends: torch.Tensor  # (M,) int64: where each photo's captions end in the caption list
    vocab_size: int  # the vocabulary the ids belong to: the model's
    encoder: str = ""  # fingerprint of the encoder that made the features (data.features.encoder_fingerprint)
    _cider: CiderD | None = field(default=None, repr=False)
    _unit: torch.Tensor | None = field(default=None, repr=False)  # (D, M) float32 at unit length, on the photos' device
    _captions: dict[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict, repr=False)  # captions_of, cached
    _flat: tuple[list[int], list[int], list[int]] = field(default=([], [0], [0]), repr=False)  # words, starts
    source: tuple[str, int, int] | None = field(default=None, repr=False)  # (file, size, mtime) when loaded from one

    @classmethod
    def build(cls, pooled: torch.Tensor, captions: Sequence[Sequence[Sequence[int]]], vocab_size: int,
              encoder: str = "") -> "ConsensusMemory":
        """pooled (M, D); captions: each photo's captions as word ids."""
        if len(pooled) != len(captions) or not len(captions):
            raise ValueError(f"a consensus memory needs one caption list per photo: {len(pooled)} photos, "
                             f"{len(captions)} caption lists")
        if any(not caps for caps in captions):
            raise ValueError("every photo of a consensus memory needs at least one caption")
        peak = pooled.float().abs().amax(1, keepdim=True).clamp_min(1e-12)  # (M, 1)
        quantised = (pooled.float() / peak * 127).round().to(torch.int8)  # (M, D): the direction is what counts
        flat = [list(c) for caps in captions for c in caps]
        lengths = torch.tensor([len(c) for c in flat], dtype=torch.int64)  # (C,)
        per_photo = torch.tensor([len(caps) for caps in captions], dtype=torch.int64)  # (M,)
        tokens = torch.tensor([t for c in flat for t in c], dtype=torch.int32)  # (T,)
        return cls(quantised, tokens, lengths.cumsum(0), per_photo.cumsum(0), int(vocab_size), encoder)

    def __len__(self) -> int:
        return len(self.features)

    def captions_of(self, photo: int) -> tuple[tuple[int, ...], ...]:
        if photo not in self._captions:
            if not self._captions:  # the first call: the flat lists once, not a tensor slice per caption
                self._flat = (self.tokens.tolist(), [0] + self.caption_ends.tolist(), [0] + self.photo_ends.tolist())
            words, caption_at, photo_at = self._flat
            spans = range(photo_at[photo], photo_at[photo + 1])
            self._captions[photo] = tuple(tuple(words[caption_at[c]:caption_at[c + 1]]) for c in spans)
        return self._captions[photo]

    def nearest(self, feats: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """feats (B, P, D) -> cosines, indices (B, k) of the memory photos nearest in pooled features, nearest first."""
        if feats.shape[-1] != self.features.shape[1]:
            raise ValueError(f"the consensus memory holds {self.features.shape[1]}-dim features but the encoder gives "
                             f"{feats.shape[-1]}: {REBUILD} for this model")
        if self._unit is None or self._unit.device != feats.device:  # (D, M) on the photos' device: no read to the host
            self._unit = torch.nn.functional.normalize(self.features.float(), dim=1).T.contiguous().to(feats.device)
        query = torch.nn.functional.normalize(feats.detach().float().mean(1), dim=1)  # (B, D)
        top = (query @ self._unit).topk(min(k, len(self)), dim=1)  # (B, M) cosines -> (B, k)
        return top.values, top.indices

    @property
    def cider(self) -> CiderD:
        """CIDEr-D with the memory's captions' document frequencies, once per process and memory file."""
        if self._cider is None:
            self._cider = _cider_of_file.get(self.source) or CiderD([self.captions_of(j) for j in range(len(self))])
            if self.source:
                _cider_of_file[self.source] = self._cider
        return self._cider

    def cider_to(self, device: torch.device | str) -> CiderD:
        """The CIDEr-D tables moved to `device` (the file's CPU copy stays shared by the process's other loads)."""
        self._cider = self.cider.to(device)
        return self._cider

    def save(self, path: str | Path) -> None:
        tensors = {"features": self.features.contiguous(), "tokens": self.tokens.contiguous(),
                   "caption_ends": self.caption_ends.contiguous(), "photo_ends": self.photo_ends.contiguous()}
        info = json.dumps({"vocab_size": self.vocab_size, "encoder": self.encoder})
        write_safetensors(path, tensors, {"format": FORMAT, "info": info})

    @classmethod
    def load(cls, path: str | Path) -> "ConsensusMemory":
        """A memory written by save; a CheckpointError says what is wrong with the file."""
        tensors, meta = read_safetensors(path)
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not a consensus memory (format {meta.get('format')!r}, expected {FORMAT}); "
                                  f"{REBUILD} or remove it")
        try:
            info = json.loads(meta["info"])
            memory = cls(tensors["features"], tensors["tokens"], tensors["caption_ends"], tensors["photo_ends"],
                         int(info["vocab_size"]), str(info.get("encoder", "")))
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"{path}: corrupt consensus memory ({e}); {REBUILD}") from None
        if len(memory.photo_ends) != len(memory.features) or int(memory.photo_ends[-1]) != len(memory.caption_ends):
            raise CheckpointError(f"{path}: its photos, captions and features do not line up; rebuild it")
        stat = Path(path).stat()
        memory.source = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
        return memory

