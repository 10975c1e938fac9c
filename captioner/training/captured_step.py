"""The cross-entropy step recorded once per batch shape and replayed (train.capture): on a GPU, a CUDA graph.

At training's batch sizes a GPU waits for the host. One teacher-forced step is T x (attention + LSTM cell) forward
and as many backward, each a few small kernels: over a thousand launches for a batch whose arithmetic takes a
fraction of their time. A CUDA graph records a step's forward, loss and backward once per shape and replays them
as one launch. What stays op by op is short: the batch copied into the recording, the clipping and the optimiser
(engine.finish_step, multi-tensor: a few launches), and one read of the step's loss.

How a recording keeps a graph's contract:
- **Its shape is fixed.** The key is (images, captions rounded up to a multiple of ROWS_STEP, T rounded up to a
  multiple of T_STEP). Each batch's captions are padded to that T, and rows of length 0 fill the count (a COCO
  photo with 6 or 7 captions makes a batch of 16 photos 81 or 82 captions: they share the recording of 88), so one
  recording serves the shapes near it. Decoder.teacher_force_static runs every caption all T steps and masks what
  lies past its end, so nothing depends on the lengths' values. loss.eq14 masks padding out of its sums (a row of
  length 0 counts nowhere), and reads nothing back.
- **Its inputs are static buffers.** Each step copies its batch (features, words, targets, lengths, which image
  each caption is of) into them.
- **Its outputs are the losses and the gradients.** The recording's backward writes gradient buffers of its own.
  After a replay the parameters' .grad point at them, and the optimiser reads them there. Nothing needs zeroing:
  every replay writes them whole.
- **What it reads must stay where it is.** The optimiser updates the parameters in place, and the EMA and
  validation copy in place, so addresses never change.
- **The random numbers.** Dropout in a graph draws new numbers at each replay (PyTorch registers the generator
  with the graph). The warm-up and the recording run under torch.random.fork_rng, so recording draws nothing from
  the run's random stream, and every step's gradients come from a replay. On a CPU, `Rerun` replays by running
  again: there a recorded run is the op-by-op run of teacher_force_static, number for number (the tests).
- **Memory.** The recordings share one memory pool: what one step's forward and backward hold in between (a
  COCO step's activations are gigabytes) is held once, and each recording keeps only its own outputs (the
  gradients, the size of the trained weights). Sharing is safe because replays never overlap and each replay's
  outputs are read (clipped, stepped) before the next one runs; outputs stay referenced, so no other recording
  is given their memory. At most LIMIT shapes are kept; the least recently used goes first.
- **Failure.** A shape that cannot be recorded warns once and runs op by op (engine.train_step).

Not recorded (why_op_by_op says which, once, in the run's log): SCST, hard attention, train.accumulate > 1, the
encoder trained in the step, train.alpha_cam / alpha_head, train.extend_vocab, several processes (DDP all-reduces
during backward) and fp16's GradScaler.

Legend: Bi images, B captions, T steps, P regions, D feature size.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import Config
from ..data.dataset import Batch
from ..model.graphs import CaptureError, CudaGraph, NoHostReads, Rerun
from ..model.show_attend_tell import ShowAttendTell
from .loss import eq14
from .objectives import Terms

T_STEP = 8  # a batch's steps are rounded up to a multiple of this: one recording serves 8 caption lengths
ROWS_STEP = 8  # and its captions to a multiple of this (rows of length 0)
LIMIT = 16  # shapes kept recorded (each holds its gradients; the pool is shared); the least recently used goes first
GRAPHS: dict[str, Callable[[], Any]] = {"cuda": CudaGraph}  # where train.capture records (tests add "cpu": Rerun)


def why_op_by_op(cfg: Config, model: ShowAttendTell, world_size: int, fp16: bool) -> str | None:
    """Why this run's step cannot be recorded (the log says it), or None."""
    t = cfg.train
    reasons = [(t.objective != "xe", f"train.objective is {t.objective} (only cross-entropy is recorded)"),
               (model.decoder.hard, "hard attention samples where it looks"),
               (t.accumulate > 1, "train.accumulate > 1"),
               (cfg.encoder_in_loop or cfg.from_activations, "the encoder trains in the step"),
               (bool(t.alpha_cam or t.alpha_head), "train.alpha_cam / alpha_head read the encoder's head"),
               (t.extend_vocab, "train.extend_vocab"),
               (world_size > 1, "several processes (DDP all-reduces during backward)"),
               (fp16, "fp16 autocast's GradScaler")]
    return next((why for hit, why in reasons if hit), None)


@dataclass
class _Recording:
    inputs: tuple[torch.Tensor, ...]  # static: (Bi, P, D) features, (B, T) inputs and targets, (B,) lengths, index
    graph: Any
    losses: torch.Tensor  # (3,): total, xent per token, lambda x penalty per caption
    grads: list[torch.Tensor]  # one per trained parameter, written by every replay


class CapturedStep:
    """The recorded forward and backward of one cross-entropy step per batch shape (module doc). `graph` makes the
    recorders: CudaGraph on a GPU, Rerun on a CPU (tests). `amp`: the run's autocast type (run.amp_dtype; None:
    float32), chosen by the run, not here, so the recorded step computes in the precision the op-by-op one does."""

    def __init__(self, model: ShowAttendTell, cfg: Config, device: torch.device, graph: Callable[[], Any],
                 amp: torch.dtype | None, limit: int = LIMIT):
        self.model, self.cfg, self.device, self.make_graph, self.limit = model, cfg, device, graph, limit
        self.amp = amp
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.recorded: OrderedDict[tuple, _Recording | None] = OrderedDict()  # None: failed, op by op
        self.pool = graph.new_pool()  # one memory pool for every recording (module doc)

    def __call__(self, batch: Batch) -> Terms | None:
        """One step's forward and backward on `batch` (as read: on the host) -> its Terms (the caller checks that
        the loss is finite before any weight moves), the gradients in the parameters' .grad; None where this shape
        could not be recorded (the caller runs engine.train_step)."""
        T, rows = _rounded(batch.inputs.shape[1], T_STEP), _rounded(len(batch.inputs), ROWS_STEP)
        key = (len(batch.visual), rows, T, batch.visual.dtype)
        if key not in self.recorded:
            self.recorded[key] = self._record(batch, rows, T)
            while len(self.recorded) > self.limit:
                self.recorded.popitem(last=False)
        self.recorded.move_to_end(key)
        rec = self.recorded[key]
        if rec is None:
            return None
        _load(rec.inputs, batch)
        rec.graph.replay()
        for p, g in zip(self.params, rec.grads):
            p.grad = g
        total, xent, penalty = rec.losses.tolist()  # the step's one read
        return Terms(torch.tensor(total), int(batch.lengths.sum()), {"xent": xent, "penalty": penalty},
                     counts={"penalty": len(batch.lengths)})

    def _record(self, batch: Batch, B: int, T: int) -> _Recording | None:
        """This shape's recording (B captions of T steps), made on `batch` (warmed up and recorded under fork_rng),
        or None with a warning."""
        static = (torch.zeros(batch.visual.shape, dtype=batch.visual.dtype, device=self.device),
                  torch.zeros(B, T, dtype=torch.long, device=self.device),
                  torch.zeros(B, T, dtype=torch.long, device=self.device),
                  torch.zeros(B, dtype=torch.long, device=self.device),
                  torch.zeros(B, dtype=torch.long, device=self.device))
        _load(static, batch)
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                graph = self.make_graph(self.pool)
                out = graph.record(lambda: self._forward_backward(*static))
        except (CaptureError, RuntimeError) as e:
            warnings.warn(f"train.capture: a batch of {len(batch.visual)} images, {B} captions and {T} steps could "
                          f"not be recorded ({e}); that shape trains op by op", RuntimeWarning, stacklevel=2)
            for p in self.params:
                p.grad = None
            return None
        return _Recording(static, graph, out[0], list(out[1:]))

    def _forward_backward(self, feats: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor,
                          lengths: torch.Tensor, image_index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What a recording holds: eq. 14 on the static batch, and its backward into fresh gradients."""
        for p in self.params:
            p.grad = None  # backward then writes the recording's own gradients, never adds to the last ones
        with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None, cache_enabled=False):
            tf = self.model.decoder.teacher_force_static(feats, inputs, lengths, image_index)
            total, xent, penalty = eq14(tf.logits, tf.alphas, targets, lengths, lengths.sum(),
                                        self.cfg.train.alpha_c, self.cfg.train.label_smoothing)
        total.backward()
        losses = torch.stack([total.detach(), xent.detach(), penalty.detach()]).float()  # (3,)
        return (losses, *[p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])


def _rounded(n: int, step: int) -> int:
    return -(-n // step) * step


def _load(static: tuple[torch.Tensor, ...], batch: Batch) -> None:
    """A batch copied into a recording's static inputs, its captions padded to the recording's T and its rows filled
    with captions of length 0 of image 0 (with word 0: a padded step's results are masked, so which word it reads
    does not matter)."""
    feats, inputs, targets, lengths, image_index = static
    B, T = batch.inputs.shape
    feats.copy_(batch.visual, non_blocking=True)
    for buffer, real in ((inputs, batch.inputs), (targets, batch.targets)):
        buffer[:B, :T].copy_(real, non_blocking=True)
        buffer[:B, T:].zero_()
        buffer[B:].zero_()
    for buffer, real in ((lengths, batch.lengths), (image_index, batch.image_index)):
        buffer[:B].copy_(real, non_blocking=True)
        buffer[B:].zero_()


def build_captured_step(cfg: Config, model: ShowAttendTell, device: torch.device, world_size: int,
                        amp: torch.dtype | None, log: Callable[[str], None]) -> CapturedStep | None:
    """train.capture's recorded step for this run (autocast to `amp`: run.amp_dtype), or None (op by op) with the
    reason in the log."""
    if not cfg.train.capture:
        return None
    why = why_op_by_op(cfg, model, world_size, amp is torch.float16)
    if why is None and device.type not in GRAPHS:
        why = f"CUDA graphs need a CUDA GPU, and this run trains on {device.type}"
    if why is not None:
        log(f"train.capture: the step runs op by op: {why}")
        return None
    log(f"train.capture: each batch shape's forward and backward recorded once (at most {LIMIT} shapes, captions "
        f"padded to a multiple of {T_STEP} steps) and replayed")
    return CapturedStep(model, cfg, device, GRAPHS[device.type], amp)

