"""Evaluation, written once: model -> captions -> scores. Training's validation and
scripts/evaluate.py both call `evaluate_model`.

Scores are pycocoevalcap's (metrics.py) on DECODED captions (never teacher-forced), plus two
diagnostics of degenerate captions (metrics.caption_defects).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

from .data import ImageRecord
from .data.dataset import ImageDataset, readable
from .decoding import decode
from .metrics import METRIC_KEYS, caption_defects, score_captions
from .model.captioner import CaptionModel
from .model.encoder import Preprocess
from .vocab import Vocab

Log = Callable[[str], None]


@torch.no_grad()
def caption_features(model: CaptionModel, feats: np.ndarray | torch.Tensor, vocab: Vocab, beam_size: int,
                     max_len: int, length_penalty: float, device: torch.device, batch_size: int = 100,
                     progress: bool = False, forbid_unk: bool = True, block_trigrams: bool = False) -> list[str]:
    """Cached features (N, P, D) -> N captions, decoded in batches."""
    from tqdm import tqdm

    model.eval()
    out = []
    for k in tqdm(range(0, len(feats), batch_size), desc="decoding", disable=not progress, unit="batch"):
        x = torch.as_tensor(np.asarray(feats[k:k + batch_size], dtype=np.float32))  # (b, P, D)
        x = x.to(device, next(model.decoder.parameters()).dtype)
        hyps = decode(model.decoder, x, vocab.start, vocab.end, vocab.pad, beam_size, max_len, length_penalty,
                      vocab.unk if forbid_unk else None, block_trigrams)
        out.extend(" ".join(vocab.decode(h[0].tokens)) for h in hyps)
    return out


@torch.no_grad()
def encode_records(model: CaptionModel, records: Sequence[ImageRecord], preprocess: Preprocess, device: torch.device,
                   batch_size: int = 32, num_workers: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Images -> features (N', P, D) for the readable ones, and their indices in `records`."""
    p = preprocess
    loader = DataLoader(ImageDataset(records, p.image_size, p.mean, p.std), batch_size=batch_size,
                        num_workers=num_workers, collate_fn=readable)
    model.eval()
    dtype = next(model.encoder.parameters()).dtype
    feats, idx = [], []
    for batch in loader:
        if batch:
            x = torch.stack([s[0] for s in batch]).to(device, dtype)  # (b, 3, S, S) in the model's dtype
            x = x.contiguous(memory_format=torch.channels_last)
            feats.append(model.encode(x).float().cpu())
            idx.extend(s[1] for s in batch)
    return (torch.cat(feats) if feats else torch.zeros(0)), idx


def evaluate_model(model: CaptionModel, vocab: Vocab, feats: np.ndarray | torch.Tensor,
                   records: Sequence[ImageRecord], beam_size: int, max_len: int, length_penalty: float,
                   device: torch.device, forbid_unk: bool = True, metrics: Sequence[str] = METRIC_KEYS,
                   batch_size: int = 100, progress: bool = False, log: Log = print, block_trigrams: bool = False
                   ) -> tuple[dict[str, float], dict[str, str]]:
    """Decode features (N, P, D) of `records` (same order) and score them against the records'
    references -> (scores incl. n_images and the defect shares, {image_id: caption})."""
    caps = caption_features(model, feats, vocab, beam_size, max_len, length_penalty, torch.device(device),
                            batch_size, progress, forbid_unk, block_trigrams)
    preds = {r.image_id: c for r, c in zip(records, caps)}
    scores = score_captions(preds, {r.image_id: r.captions for r in records}, metrics, log=log)
    scores.update(caption_defects(caps))
    scores["n_images"] = len(preds)
    return scores, preds
