"""Evaluation, written once: model -> captions -> scores. Training's validation and
scripts/evaluate.py both call `evaluate_model`.

Scores are pycocoevalcap's (metrics.py) on DECODED captions (never teacher-forced), plus two
diagnostics of degenerate captions (metrics.caption_defects).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..decoding.captions import Caption, captions_from_features
from ..decoding.resources import Resources
from ..config import DecodeConfig
from ..data import ImageRecord
from ..data.dataset import ImageDataset, readable
from ..logs import progress as progress_of
from .metrics import METRIC_KEYS, caption_defects, reference_repeats, score_captions
from ..model.show_attend_tell import ShowAttendTell
from ..model.encoder import Preprocess
from ..vocab import Vocab

Log = Callable[[str], None]


@torch.no_grad()
def encode_records(model: ShowAttendTell, records: Sequence[ImageRecord], preprocess: Preprocess, device: torch.device,
                   batch_size: int = 32, num_workers: int = 0, progress: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Images -> features (N', P, D) for the readable ones, and their indices in `records`; with `progress`, a bar
    or lines on stderr (logs.progress)."""
    p = preprocess
    loader = DataLoader(ImageDataset(records, p.image_size, p.mean, p.std), batch_size=batch_size,
                        num_workers=num_workers, collate_fn=readable)
    model.eval()
    dtype = next(model.encoder.parameters()).dtype
    feats, idx = [], []
    for batch in progress_of(loader, "encoding", enabled=progress):
        if batch:
            x = torch.stack([s[0] for s in batch]).to(device, dtype)  # (b, 3, S, S) in the model's dtype
            x = x.contiguous(memory_format=torch.channels_last)
            feats.append(model.encode(x).float().cpu())
            idx.extend(s[1] for s in batch)
    return (torch.cat(feats) if feats else torch.zeros(0)), idx


def evaluate_model(model: ShowAttendTell, vocab: Vocab, feats: np.ndarray | torch.Tensor,
                   records: Sequence[ImageRecord], settings: DecodeConfig, resources: Resources,
                   metrics: Sequence[str] = METRIC_KEYS,
                   batch_size: int = 100, progress: bool = False, log: Log = print, tokenizer: str = "java"
                   ) -> Evaluation:
    """Decode features (N, P, D) of `records` (same order) with `settings` and what `resources` holds (a loaded
    file's fitted data and consensus memory: Captioner.resources; resources.NONE for a model in training) and
    score them against the
    records' references -> scores (incl. n_images and the defect shares), {image_id: caption} and the
    Captions themselves (words, maps, gates: grounding and the hallucination metric read them). `tokenizer`:
    metrics.score_captions' ("python": no Java needed but for METEOR)."""
    caps = captions_from_features(model, feats, vocab, settings, resources, batch_size, progress)
    preds = {r.image_id: c.text for r, c in zip(records, caps)}
    scores = score_captions(preds, {r.image_id: r.captions for r in records}, metrics, log=log, tokenizer=tokenizer)
    scores.update(caption_defects([c.text for c in caps]))
    scores.update(reference_repeats([r.captions for r in records]))  # people's rates, to compare with
    scores["n_images"] = len(preds)
    return Evaluation(scores, preds, caps)


class Evaluation(NamedTuple):
    scores: dict[str, float]
    preds: dict[str, str]  # image_id -> caption text
    captions: list[Caption]  # in the order of the records


@torch.no_grad()
def top_features(model: torch.nn.Module, acts: Any, device: torch.device, batch_size: int = 64) -> torch.Tensor:
    """Cached lower-stage activations (N, C, h, w) -> features (N, P, D) from the model's current top stages."""
    import numpy as np

    was_training = model.encoder.training
    model.encoder.eval()
    out = []
    for k in range(0, len(acts), batch_size):
        x = torch.from_numpy(np.asarray(acts[k:k + batch_size], dtype=np.float32)).to(device)
        out.append(model.encoder.above_split(x.contiguous(memory_format=torch.channels_last)).float().cpu())
    model.encoder.train(was_training)
    return torch.cat(out)


@torch.no_grad()
def head_agreement(model: torch.nn.Module, feats: torch.Tensor, teacher_logits: Any) -> float:
    """Share of photos whose top-1 ImageNet class under the tuned encoder is the pretrained encoder's:
    how far concepts and evidence (which read the head) have drifted."""
    import numpy as np

    from ..concepts.imagenet import encoder_head, imagenet_logits

    mine = imagenet_logits(encoder_head(model), feats).argmax(1)  # (N,)
    theirs = torch.from_numpy(np.asarray(teacher_logits, dtype=np.float32)).argmax(1)  # (N,)
    return float((mine == theirs).float().mean())
