"""Validation during training: each val set DECODED with the run's decode settings and scored (the selection
metric), plus its teacher-forced loss (cross-entropy per token: comparable with the training loss), a few
captions and one photo's attention maps for the watcher (watch.py)."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..data.dataset import collate, encode_captions
from ..decoding.resources import NONE
from ..evaluation.metrics import METRIC_KEYS
from ..evaluation.scoring import encode_records, evaluate_model, head_agreement, top_features
from ..model.encoder import build_preprocess
from .as_exported import decoding_as_exported
from .loss import caption_loss
from .new_words import NEW_WORDS_METRIC, new_word_scores
from .run import Run, epoch_position
from .watch import attention_figure, readable

EXAMPLES = 4  # val captions shown in TensorBoard each epoch


def validate(run: Run, stats: dict[str, float]) -> float:
    """Rank 0 decodes each val set with train.val_beam_size and the decode settings, scores it
    (evaluation.scoring.evaluate_model) and logs the record; the metric is shared with every rank. In a mix each
    set's scores are logged as "<set>/<metric>" and the val metric is their mean over the sets
    (each caption set counts the same, whatever its size or sampling weight). Every rank's history holds the record:
    whether a validation is owed is read from it (run.validation_owed), the same on every rank."""
    cfg, state, place = run.cfg, run.state, run.place
    value, rec = 0.0, None
    if place.main:
        metrics = [k for k in METRIC_KEYS if k != "METEOR"]  # METEOR (a Java process) only when it is val_metric
        metrics += [cfg.train.val_metric] if cfg.train.val_metric not in metrics + [NEW_WORDS_METRIC] else []
        per_set = {vs.name: _validate_set(run, vs, metrics) for vs in run.val_sets}
        if len(per_set) == 1:
            (scores, shown), = per_set.values()
        else:
            scores = {f"{name}/{k}": v for name, (s, _) in per_set.items() for k, v in s.items()}
            scores[cfg.train.val_metric] = sum(s[cfg.train.val_metric] for s, _ in per_set.values()) / len(per_set)
            shown = {k: [x for _, sh in per_set.values() for x in sh[k]] for k in ("examples", "figures")}
        value = scores[cfg.train.val_metric]
        rec = {"kind": "val", "epoch": epoch_position(run), "step": state.step,  # (epoch 1.5: inside epoch 2)
               **{f"train_{k}": v for k, v in stats.items() if k not in ("seconds", "batches")},
               "epoch_seconds": stats["seconds"], "lr": run.optimizer.param_groups[0]["lr"], **scores}
        run.logger.write(rec)
        state.history.append(rec)
        run.watch.epoch(rec, shown["examples"], shown["figures"][0] if shown["figures"] else None)
        train_txt = ", ".join(f"{readable(k)} {v:.3f}" for k, v in stats.items() if k not in ("seconds", "batches"))
        example = " | ".join(c for _, c, _ in shown["examples"][:1 if len(per_set) == 1 else None:EXAMPLES])
        place.log(f"{_where(run)}: train {train_txt} ({stats['seconds']:.0f}s) | val "
                  + " ".join(f"{k} {v:.4f}" for k, v in scores.items() if not k.endswith("n_images"))
                  + f" | e.g. '{example}'")
    if place.world_size > 1:
        box = [value, rec]
        dist.broadcast_object_list(box, src=0)
        value, rec = box
        if not place.main:
            state.history.append(rec)
    return value


def _where(run: Run) -> str:
    """Where a validation stands, for its log line: "epoch 3"; with train.val_every_steps "step 6000 (epoch 1,
    batch 6000 of 7081)" inside an epoch, "step 7081 (end of epoch 1)" at its end."""
    state = run.state
    if state.batch_in_epoch:
        return f"step {state.step} (epoch {state.epoch + 1}, batch {state.batch_in_epoch} of {run.steps_per_epoch})"
    if run.cfg.train.val_every_steps and state.step:
        return f"step {state.step} (end of epoch {state.epoch})"
    return f"epoch {state.epoch}"


def _validate_set(run: Run, vs: Any, metrics: list[str]) -> tuple[dict[str, float], dict[str, list]]:
    """One val set's scores (val_loss; head_top1_agreement when the top stages are tuned) and what the watcher
    shows: (image id, caption, references) of its first photos and its first photo's attention figure."""
    cfg = run.cfg
    feats, records = vs.feats, vs.records
    if feats is None:  # encoder in the loop: encode the val images with the current encoder
        feats, idx = encode_records(run.model, records, build_preprocess(cfg.model), run.place.device)
        records = [records[i] for i in idx]
    agreement = {}
    if cfg.from_activations:  # cached activations through the tuned top stages
        feats = top_features(run.model, feats, run.place.device)
        agreement = {"head_top1_agreement": head_agreement(run.model, feats, vs.teacher)}
    # decoded as the exported file will (as_exported.py); the Python PTB tokenizer: validation needs no Java
    # (a GPU machine often has none); METEOR still does. NONE: the model in training has no fitted data or
    # consensus memory of its own (the beam's order) and is not recorded (its weights change every step)
    with decoding_as_exported(run.model, cfg, run.start_file) as settings:
        run.model.prepare()  # what decoding reads besides the weights, made from the weights it validates
        scores, preds, caps = evaluate_model(run.model, run.vocab, feats, records, settings, NONE, metrics,
                                             log=run.place.log, tokenizer="python")
    loss = {"val_loss": val_loss(run, feats, records)}
    shown = {"examples": [(r.image_id, c.text, r.captions) for r, c in zip(records[:EXAMPLES], caps)],
             "figures": _figure(run, records, caps)}
    return {**scores, **loss, **agreement, **_new_word_scores(run, scores, preds, records)}, shown


def _figure(run: Run, records: Any, caps: Any) -> list[Any]:
    """The first val photo's attention maps (TensorBoard only; none without a writer or a readable photo)."""
    if run.watch.writer is None or not records or not caps[0].words:
        return []
    try:
        return [attention_figure(records[0].path, caps[0].words, caps[0].alphas, run.cfg.model.grid_size)]
    except OSError:
        return []


@torch.no_grad()
def val_loss(run: Run, feats: Any, records: Any, batch_images: int = 32) -> float:
    """Teacher-forced cross-entropy per token of the val references (eval mode: no dropout, no random draw)."""
    model, was_training = run.model, run.model.training
    model.eval()
    caps = encode_captions(records, run.vocab, run.cfg.data.max_caption_len)
    total, tokens = 0.0, 0
    for k in range(0, len(records), batch_images):
        visual = [torch.as_tensor(np.asarray(feats[i], dtype=np.float32)) for i in range(k, min(k + batch_images, len(records)))]
        batch = collate(list(zip(visual, caps[k:k + batch_images]))).to(run.place.device)
        out = model.decoder.teacher_force(batch.visual.to(next(model.parameters()).dtype), batch.inputs,
                                          batch.lengths, batch.image_index)
        c = caption_loss(out[0], out[1], batch.targets, batch.lengths, 0.0)
        total, tokens = total + c.xent.item() * c.n_tokens, tokens + c.n_tokens
    model.train(was_training)
    return total / max(tokens, 1)


def _new_word_scores(run: Run, scores: dict[str, float], preds: dict[str, str], records: Any) -> dict[str, float]:
    """train.extend_vocab: the new words' use on this val set (logged per word; new_words.py), and the
    val metric CIDEr_new_words (plain CIDEr when the vocabulary has no new word)."""
    if not run.new_words:
        return {NEW_WORDS_METRIC: scores["CIDEr"]} if run.cfg.train.val_metric == NEW_WORDS_METRIC else {}
    new, line = new_word_scores(run.new_words, preds, records)
    run.place.log(f"  {line}")
    return {**new, NEW_WORDS_METRIC: scores["CIDEr"] + new["new_words_F1"]}
