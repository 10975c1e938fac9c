"""Watching a run while it trains: every train.log_every steps one line (step, loss terms, learning rate,
gradient norm, captions/s, ETA) that prints with or without progress bars, the same numbers in metrics.jsonl,
and TensorBoard event files in <out_dir>/tensorboard (`tensorboard --logdir runs/`): the loss and its parts,
learning rate, gradient norm, throughput, and per epoch the val loss, val metrics, a few val captions and one
val photo's attention maps. A resumed run purges the events logged after its checkpoint, like metrics.jsonl.
When the run ends, its resolved settings and its final and best val metrics go to TensorBoard's HParams tab
(hparams_of), where runs compare side by side.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

NAMES = {"xent": "cross-entropy/token", "penalty": "attention penalty",
         "reward": "reward (CIDEr-D)", "head_kl": "head KL", "cam": "attention-to-CAM"}


def readable(key: str) -> str:
    """A logged term's name for people: 'penalty' is the doubly stochastic attention penalty, not a mystery."""
    return NAMES.get(key, key)


def duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Watch:
    """Throughput, ETA and the TensorBoard writer of one rank-0 process (other ranks: an idle Watch)."""

    def __init__(self, out: Path, enabled: bool, tensorboard: bool, start_step: int, log: Callable[[str], None],
                 validation_owed: bool = False, record_at_start: dict[str, Any] | None = None):
        """start_step: the checkpoint a resumed run starts from (0: a new run). Its writer drops the events the
        stopped run logged after that step; where the step's validation is owed (it runs again, and the stopped
        run may have logged it), from that step itself, and its train record (`record_at_start`, from
        metrics.jsonl) is written again: each scalar once at each step."""
        self.enabled, self.log = enabled, log
        self.writer = None
        if enabled and tensorboard:
            self.writer = _writer(out / "tensorboard", start_step + (not validation_owed) if start_step else 0, log)
            if self.writer is not None and validation_owed and record_at_start is not None:
                self._train_scalars(record_at_start)
        self._t, self._captions, self._images, self._steps = time.time(), 0, 0, 0

    def restart_clock(self) -> None:
        """Start timing afresh (an epoch begins: validation time is not training throughput)."""
        self._t, self._captions, self._images, self._steps = time.time(), 0, 0, 0

    def count(self, images: int, captions: int) -> None:
        self._images, self._captions, self._steps = self._images + images, self._captions + captions, self._steps + 1

    def report(self, record: dict[str, Any], epoch: int, steps_left_epoch: int, steps_left_run: int
               ) -> dict[str, Any]:
        """The log_every line of a step in epoch `epoch` (from 1): `record` (kind train: epoch (the run's position
        in epochs), step, the objective's terms, lr, grad_norm) plus throughput and ETA since the last report;
        returns the record with them added (for metrics.jsonl)."""
        seconds = max(time.time() - self._t, 1e-9)
        per_step = seconds / max(self._steps, 1)
        record = {**record, "captions_per_s": self._captions / seconds, "images_per_s": self._images / seconds}
        self.restart_clock()
        if not self.enabled:
            return record
        terms = " ".join(f"{readable(k)} {v:.4g}" for k, v in record.items() if k in term_keys(record))
        self.log(f"epoch {epoch} step {record['step']}: {terms} | lr {record['lr']:.2e} | grad norm "
                 f"{record['grad_norm']:.3g} | {record['captions_per_s']:.0f} captions/s | epoch ETA "
                 f"{duration(per_step * steps_left_epoch)}, run ETA {duration(per_step * steps_left_run)} "
                 "(training steps only; validation adds to it)")
        self._train_scalars(record)
        return record

    def _train_scalars(self, record: dict[str, Any]) -> None:
        """A train record's terms, rate and throughput as TensorBoard scalars at its step."""
        if self.writer is None:
            return
        for k in [*term_keys(record), "lr", "grad_norm", "captions_per_s", "images_per_s"]:
            if k in record:
                self.writer.add_scalar(f"train/{k}", record[k], record["step"])

    def epoch(self, record: dict[str, Any], examples: Sequence[tuple[str, str, Sequence[str]]],
              figure: Any = None) -> None:
        """After validation: the val record's numbers at its step (its epoch too: val/epoch), captions (id, caption,
        references) and a figure."""
        if self.writer is None:
            return
        step = record["step"]
        self.writer.add_scalar("val/epoch", record["epoch"], step)  # where it stands (1.5: inside epoch 2)
        for k, v in record.items():
            if k not in ("kind", "epoch", "step") and isinstance(v, (int, float)) and math.isfinite(v):
                self.writer.add_scalar(f"val/{k}" if not k.startswith("train_") else f"epoch/{k}", v, step)
        if examples:
            rows = "\n".join(f"| {i} | {c} | {refs[0] if refs else ''} |" for i, c, refs in examples)
            self.writer.add_text("val/captions", "| photo | caption | a reference |\n|---|---|---|\n" + rows, step)
        if figure is not None:
            self.writer.add_figure("val/attention", figure, step)
        self.writer.flush()

    def hparams(self, settings: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        """Once, when the run ends: `settings` and `metrics` (hparams_of) for the HParams tab. They go into this
        run's own event folder (the writer's add_hparams would open a new subfolder, a second run, per call); the
        tab shows a metric only where it is also a scalar, so each is logged as one at `step`."""
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams

        for summary in hparams(settings, metrics):  # the experiment, the session's start and its end
            self.writer.file_writer.add_summary(summary)
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def term_keys(record: dict[str, Any]) -> list[str]:
    """The objective's terms in a train record (what is not bookkeeping)."""
    return [k for k in record if k not in BOOKKEEPING and isinstance(record[k], (int, float))]


BOOKKEEPING = {"kind", "epoch", "step", "lr", "grad_norm", "time", "captions_per_s", "images_per_s"}


NOT_METRICS = {"kind", "epoch", "step", "time", "seconds", "batches"}  # a val record's bookkeeping


def hparams_of(config: dict[str, dict[str, Any]], history: Sequence[dict[str, Any]], best_position: float
               ) -> tuple[dict[str, Any], dict[str, float]]:
    """(settings, metrics) for the HParams tab: every scalar setting of the resolved config ("train.lr": 3e-3;
    lists and unset values are left out) and the val metrics of the last epoch ("hparam/final/CIDEr") and of the
    best one ("hparam/best/CIDEr", and its epoch) from the run's history of val records."""
    settings = {f"{section}.{k}": v for section, values in config.items() for k, v in values.items()
                if isinstance(v, (bool, int, float, str))}
    best = next((r for r in history if r.get("epoch") == best_position), None)
    metrics = {"hparam/best/epoch": float(best_position)} if best else {}
    for which, record in (("final", history[-1] if history else None), ("best", best)):
        for k, v in (record or {}).items():
            if k not in NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                metrics[f"hparam/{which}/{k}"] = float(v)
    return settings, metrics


def _writer(folder: Path, purge_from: int, log: Callable[[str], None]) -> Any:
    """A TensorBoard SummaryWriter that drops the events a stopped run logged at step `purge_from` and after (0:
    none; as metrics.jsonl drops its lines: logs.JsonlLogger.rewind): TensorBoard discards them when it reads the
    purge mark."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's writer needs the tensorboard package
        log("note: the tensorboard package is not installed: no TensorBoard events (pip install tensorboard)")
        return None
    return SummaryWriter(str(folder), purge_step=purge_from or None)


def attention_figure(image_path: str | Path, words: Sequence[str], alphas: Any, grid: int, columns: int = 5):
    """One val photo's caption, a panel per word with where it looked (alphas (T, P), P = grid x grid)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    photo = np.asarray(Image.open(image_path).convert("RGB").resize((224, 224)))
    n = len(words)
    rows = max(1, -(-n // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(2 * columns, 2.1 * rows), squeeze=False)
    for k, ax in enumerate(axes.flat):
        ax.axis("off")
        if k >= n:
            continue
        heat = np.asarray(alphas[k], dtype=np.float32).reshape(grid, grid)
        heat = np.asarray(Image.fromarray(heat / max(float(heat.max()), 1e-9)).resize((224, 224), Image.BILINEAR))
        ax.imshow(photo)
        ax.imshow(heat, cmap="jet", alpha=0.45, vmin=0, vmax=1)
        ax.set_title(words[k], fontsize=10)
    fig.tight_layout()
    return fig
