"""A training run, built once: where this process runs (place.py), what the run starts from (a stopped run,
another model file or nothing), the model side (model, vocabulary, optimiser, objective, the precision it trains
in: amp_dtype, fp16's GradScaler), the data side (sources.py), the state, and the pieces beside the loop.
engine.fit drives it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..checkpoint import Checkpoint, load_checkpoint, load_model_state, optimizer_from_tensors
from ..config import Config, TrainConfig
from ..data import ImageRecord, build_mix
from ..data.dataset import BucketBatchSampler
from ..data.loader import RankBatches
from ..evaluation.metrics import java_available, missing_java
from ..logs import JsonlLogger, read_jsonl
from ..model.show_attend_tell import ShowAttendTell, build_model
from .place import Log, Place
from .sources import Mix, RunData, ValSet, build_data
from .objectives import Terms, batch_features, build_objective
from .ema import EMA, PREFIX as EMA_PREFIX
from .optimizer import build_optimizer, keep_roles
from .as_exported import lends_detectors
from .captured_step import CapturedStep, build_captured_step
from .resume import apply_to_optimizer, check_init, check_resume, reopen, restore_random_states, seed_everything
from .stopping import NEVER, StopSignal
from .watch import Watch
from .new_words import NewWordRows, grow_vocabulary, init_from_substitutes, substitutes
from ..vocab import Vocab

RESUMES = ": the last good checkpoint is kept, and the run resumes from it."  # a failed save's last words
BASELINE = "decoder.reinforce_baseline"  # hard attention's moving-average baseline (a buffer, not a weight)


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss became NaN); the message says what happened."""


@dataclass
class StepTally:
    """The running sums of the steps since the previous validation, saved with every checkpoint so that a resumed
    run averages what an uninterrupted one does; kept until the next validation has read them (averages), then
    reset."""

    sums: dict[str, float] = field(default_factory=dict)  # each logged term x what it is a mean over
    counts: dict[str, float] = field(default_factory=dict)  # what each sum's log is a mean over (Terms.count)
    weight: int = 0  # the steps' Terms.weight (what a checkpoint from before per-log counts weighted by)
    batches: int = 0  # micro-batches trained on
    seconds: float = 0.0

    def add(self, terms: Terms, batches: int) -> None:
        """One optimizer step's terms over its `batches` micro-batches."""
        self.batches += batches
        self.weight += terms.weight
        for k, v in terms.logs.items():
            self.sums[k] = self.sums.get(k, 0.0) + v * terms.count(k)
            self.counts[k] = self.counts.get(k, 0.0) + terms.count(k)

    def averages(self) -> dict[str, float]:
        """The steps' mean of each logged term, their seconds and batches (what validation logs beside its scores)."""
        counts = {k: self.counts.get(k, self.weight) for k in self.sums}
        return {**{k: v / max(counts[k], 1) for k, v in self.sums.items()}, "seconds": self.seconds,
                "batches": self.batches}

    def reset(self) -> None:
        """Every field back to its start, for the steps up to the next validation."""
        self.__dict__.update(vars(StepTally()))


RENAMED = {"bad_epochs": "bad_validations", "best_epoch": "best_position"}  # a saved state's old keys -> today's


@dataclass
class TrainState:
    """Where a run stands, saved with every resumable checkpoint. Its resume point is (epoch, batch_in_epoch, step):
    a run stopped mid-epoch resumes at batch `batch_in_epoch` of epoch `epoch + 1`. Whether a validation is owed
    there is not stored: it follows from the step and the history (validation_owed), so a run stopped after the
    steps before a validation but before that validation was saved resumes with that validation, then the steps
    after it."""

    epoch: int = 0  # epochs whose steps are done
    batch_in_epoch: int = 0  # optimizer steps' batches done in the current epoch (mid-epoch resume)
    step: int = 0
    lr: float = 0.0
    best_metric: float = -math.inf
    best_position: float = -1  # where the best validation stood in epochs (epoch_position: 1.5 inside epoch 2)
    best_step: int = -1  # its optimizer step
    bad_validations: int = 0  # validations since the best (early stopping counts them)
    since_decay: int = 0  # validations since the learning rate last decayed (plateau decay counts them)
    history: list[dict[str, Any]] = field(default_factory=list)  # every validation's record, its step among them
    finished: bool = False
    tally: StepTally = field(default_factory=StepTally)  # the sums of the steps since the previous validation
    kept_best: list[list[float]] = field(default_factory=list)  # train.keep_best: [val metric, step] of each file

    @property
    def validated_step(self) -> int:
        """The step of the latest validation (0 before any: the start is validated only as a warm start's)."""
        return self.history[-1].get("step", 0) if self.history else 0

    def stopped_at(self, owed: bool) -> str:
        """The resume point in words, for the line a stop prints (`owed`: validation_owed there)."""
        if owed:
            at = f"epoch {self.epoch + 1}, batch {self.batch_in_epoch}" if self.batch_in_epoch else f"epoch {self.epoch}"
            return f"stopped at {at}, step {self.step}, with its validation owed (its steps are saved)"
        return f"stopped at step {self.step}"

    def to_dict(self) -> dict[str, Any]:
        """What a checkpoint saves (plain JSON values)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> "TrainState":
        """A saved state. Older checkpoints still resume: one written while the counts were named for epochs holds
        bad_epochs and best_epoch (now bad_validations and best_position, RENAMED); one written before the tally
        holds its fields flat (epoch_sums, epoch_counts, epoch_weight, epoch_batches, epoch_seconds) and the
        finished epoch's averages (epoch_stats), which the tally's own averages reproduce; one written while the
        state stored whether a validation was owed holds that flag, which validation_owed derives now. Keys
        today's state lacks (those two) are dropped."""
        saved = {RENAMED.get(k, k): v for k, v in saved.items()}
        flat = {k: saved.pop(f"epoch_{k}") for k in ("sums", "counts", "weight", "batches", "seconds")
                if f"epoch_{k}" in saved}
        tally = StepTally(**(saved.pop("tally", None) or flat))
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in known and k != "tally"}, tally=tally)


def validation_due(train: TrainConfig, world_size: int, state: TrainState, epoch_end: bool) -> bool:
    """THE rule for when the run validates, asked after each step inside an epoch and at each epoch's end: at every
    epoch's end (train.val_every_steps 0); else every TrainConfig.val_interval steps (one process's
    val_every_steps, scaled by the number of processes), inside epochs too, and at the run's end (its last epoch,
    train.max_steps), so the last steps are validated too."""
    every = train.val_interval(world_size)
    if not every:
        return epoch_end
    run_ends = (epoch_end and state.epoch >= train.epochs) or bool(train.max_steps and state.step >= train.max_steps)
    return state.step % every == 0 or run_ends


def validation_owed(train: TrainConfig, world_size: int, state: TrainState, steps_per_epoch: int) -> bool:
    """Whether the run owes a validation where `state` stands, derived from the step and the history, never stored
    (like nanoGPT's iter_num % eval_interval): the steps since the latest validation (validated_step) end where THE
    rule validates (validation_due). Where they end is an epoch's end (batch_in_epoch 0 after an epoch) or a step
    inside the epoch; the epoch's last batch, and train.max_steps reached inside it, close the epoch first (the
    loop ends the epoch there), so they are an epoch's end's to validate, not a step's."""
    if state.step <= state.validated_step:  # nothing trained since the latest validation
        return False
    if not state.batch_in_epoch:
        return state.epoch > 0 and validation_due(train, world_size, state, epoch_end=True)
    hit_max = bool(train.max_steps and state.step >= train.max_steps)
    inside = state.batch_in_epoch < steps_per_epoch and not hit_max
    return inside and validation_due(train, world_size, state, epoch_end=False)


def epoch_position(run: Any) -> float:
    """Where the run stands in epochs: the completed ones, plus the share done of the current one's steps where a
    validation falls inside an epoch (train.val_every_steps: 1.2825 is batch 2000 of 7081 in epoch 2)."""
    state = run.state
    if not state.batch_in_epoch:
        return state.epoch
    return round(state.epoch + state.batch_in_epoch / run.steps_per_epoch, 4)


@dataclass
class Run:
    """Everything one training run needs; built once by build_run, then driven by fit. Read in groups: the
    config, the place, the model side, the data side, the state, and the pieces beside the loop."""

    cfg: Config
    place: Place  # this process: device, rank, world_size, main, log, progress
    # the model side
    model: ShowAttendTell
    vocab: Vocab
    optimizer: torch.optim.Optimizer
    train_module: torch.nn.Module  # the objective as a module (DistributedDataParallel wraps it)
    scaler: torch.amp.GradScaler | None  # fp16 autocast's loss scaler (grad_scaler); None: bf16 or float32
    ema: EMA | None  # train.ema_decay: the weights' moving average (ema.py); None: off
    new_words: list[str]  # train.extend_vocab: the words the starting file lacked
    start_file: Checkpoint | None  # train.init_from, read once (its weights left out): start_file_of
    # the data side
    dataset: Any  # FeatureDataset | ImageDataset | ActivationDataset
    collate_fn: Callable
    sampler: BucketBatchSampler
    batches: RankBatches  # this rank's share of the sampler's batches (one per optimizer step)
    val_sets: list[ValSet]  # one per caption set: cached features/activations, or None (encode the images each time)
    # where the run stands (saved with every resumable checkpoint)
    state: TrainState
    # beside the loop
    logger: JsonlLogger  # metrics.jsonl
    watch: Watch  # the log_every line, TensorBoard
    stop: StopSignal  # Ctrl-C / SIGTERM -> a saved step
    captured: CapturedStep | None = None  # train.capture: the step recorded per batch shape (captured_step.py)

    @property
    def out(self) -> Path:
        return Path(self.cfg.train.out_dir)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch on this rank: the sampler's batches (batch_images x accumulate photos each)
        shared among the ranks."""
        return len(self.sampler) // self.place.world_size

    @property
    def last_path(self) -> Path:
        return self.out / "last.safetensors"

    @property
    def best_path(self) -> Path:
        return self.out / "best.safetensors"


@dataclass
class Start:
    """What a run starts from: the stopped run's checkpoint (resume; None for a new run), the vocabulary, the
    state, the initial weights (None: a fresh model), the settings this command changed (key -> (stored, new))
    and the train.init_from file where the run reads it (start_file_of)."""

    resume: Any
    vocab: Vocab
    state: TrainState
    weights: dict | None = None
    changed: dict[str, Any] = field(default_factory=dict)
    init: Checkpoint | None = None


class ObjectiveModule(torch.nn.Module):
    """The objective as a module over the model, so DistributedDataParallel sees one forward per batch."""

    def __init__(self, model: ShowAttendTell, objective: Callable[[ShowAttendTell, Any], Terms]):
        super().__init__()
        self.model, self.objective = model, objective

    def forward(self, batch) -> Terms:
        return self.objective(self.model, batch)


def write_config_yaml(cfg: Config, path: Path) -> None:
    """The resolved config as YAML (every key, defaults included), written to a temp name and renamed."""
    import os

    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text("# the resolved config of this run (defaults, the config file, --set), written by captioner-train\n"
                   + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    tmp.replace(path)


def _restore(cfg: Config, place: Place, train_records: Sequence[ImageRecord]) -> Start:
    """What the run starts from: out_dir/last.safetensors (a resumed run takes the command's settings where
    that is safe, resume.check_resume: logged, and refuses other changes), else train.init_from, else nothing."""
    last_path, log, world_size = Path(cfg.train.out_dir) / "last.safetensors", place.log, place.world_size
    resume = load_checkpoint(last_path) if last_path.is_file() else None
    if resume is not None:
        if not resume.train_state or "state" not in resume.train_state:
            raise TrainingError(f"{last_path} has no training state (is it an exported model?). Move it away "
                                "or choose another train.out_dir.")
        if refused := processes_refused(last_path, resume.train_state, world_size):
            raise TrainingError(refused)
        changed = check_resume(resume.config, cfg, str(last_path), log)  # ValueError: an unsafe change
        state = TrainState.from_dict(resume.train_state["state"])
        reopen(state, cfg, log)
        if not state.finished:
            log(f"resuming from {last_path}: epoch {state.epoch + 1}, batch {state.batch_in_epoch}, step {state.step}")
        return Start(resume, resume.vocab, state, resume.model_state, changed, start_file_of(cfg, resuming=True))
    state = TrainState(lr=cfg.train.lr)
    captions = [c for r in train_records for c in r.captions]
    init = start_file_of(cfg, resuming=False)
    if init is not None:  # e.g. SCST starts from a cross-entropy model: its weights AND its vocabulary
        check_init(init.config, cfg, cfg.train.init_from)  # names the model settings that differ
        log(f"starting from the weights of {cfg.train.init_from}")
        if not cfg.train.extend_vocab:
            return Start(None, init.vocab, state, init.model_state, init=init)
        vocab = run_vocabulary(cfg, captions, init.vocab)
        log(f"vocabulary extended from {len(init.vocab)} to {len(vocab)} words (old words keep their ids and rows; "
            f"new: {', '.join(vocab.itos[len(init.vocab):len(init.vocab) + 12])} ...)")
        if place.main:
            log(str(vocab.stats(captions, cfg.data.max_caption_len)))
        return Start(None, vocab, state, grow_vocabulary(init.model_state, len(vocab), cfg.train.seed), init=init)
    vocab = run_vocabulary(cfg, captions, None)
    if place.main:
        log(str(vocab.stats(captions, cfg.data.max_caption_len)))
    return Start(None, vocab, state)


def start_file_of(cfg: Config, resuming: bool) -> Checkpoint | None:
    """train.init_from, read once for the whole run: a new run takes its weights and vocabulary; a run that teaches
    new words counts them from its vocabulary (_new_words), resumed or not; and validation decodes as the export
    will (as_exported.py: its decode settings, its word detectors). None where the run needs nothing of it."""
    if not cfg.train.init_from or (resuming and not (cfg.train.extend_vocab or lends_detectors(cfg))):
        return None
    return load_checkpoint(cfg.train.init_from)


def processes_refused(last_path: Path, train_state: dict[str, Any] | None, world_size: int) -> str:
    """Why a stopped run cannot resume with `world_size` processes ("" where it can): each process saved its random
    states and its share of the batches, so another count would replay batches and draw other samples. The command
    asks before the process group starts (cli/train.py: rank 0 says it, once); _restore asks again (the library)."""
    saved_by = len((train_state or {}).get("rng") or [])  # one random state per process that saved it
    if not saved_by or saved_by == world_size:
        return ""
    return (f"{last_path} was saved by {saved_by} process(es) and this command runs {world_size}: resume with the "
            f"same number (torchrun --nproc_per_node={saved_by}) or choose another train.out_dir")


def run_vocabulary(cfg: Config, captions: Sequence[str], init_vocab: Vocab | None) -> Vocab:
    """The vocabulary a new run trains with (captioner-prepare reports this one): the training captions' words
    seen >= data.min_word_count times; or, from a model file (train.init_from, its vocabulary `init_vocab`),
    that file's vocabulary, extended by the captions' new words when train.extend_vocab."""
    if init_vocab is None:
        return Vocab.build(captions, cfg.data.min_word_count)
    return init_vocab.extended(captions, cfg.data.min_word_count) if cfg.train.extend_vocab else init_vocab


def _model(cfg: Config, vocab_size: int, weights: dict | None, fresh: bool, log: Log) -> ShowAttendTell:
    """A resumed run loads everything. A run initialised from another model file (train.init_from)
    takes its decoder, and its encoder only when fine-tuning: a frozen encoder is the pretrained one
    (model.pretrained), so the feature cache made with it stays valid (an exported fp16 file holds
    rounded encoder weights that would not match it)."""
    if weights is None:
        return build_model(cfg.model, vocab_size)
    if fresh:  # e.g. a hard-attention run started from a soft model: the REINFORCE baseline is this run's own state
        weights = {k: v for k, v in weights.items() if k != BASELINE}
        if cfg.model.attention == "hard":
            weights[BASELINE] = torch.zeros(())
    if not fresh or cfg.model.fine_tune_encoder or cfg.model.tune_stages or cfg.train.init_encoder:
        # a tuned encoder goes on from its weights; train.init_encoder keeps the file's (frozen) encoder
        model = build_model(cfg.model, vocab_size, pretrained=False)
        load_model_state(model, weights, cfg.train.init_from if fresh else "last.safetensors")
        return model
    model = build_model(cfg.model, vocab_size)
    decoder = {k.removeprefix("decoder."): v for k, v in weights.items() if k.startswith("decoder.")}
    load_model_state(model.decoder, decoder, cfg.train.init_from)
    log(f"decoder from {cfg.train.init_from}; frozen encoder: {cfg.model.encoder} with its pretrained weights")
    return model


def _optimizer(cfg: Config, model: ShowAttendTell, resume: Any, device: torch.device,
               changed: dict[str, Any]) -> torch.optim.Optimizer:
    """train.optimizer (optimizer.py) over the decoder and what of the encoder trains, with the stopped run's
    moments when resuming."""
    parts = [("decoder", list(model.decoder.parameters()), cfg.train.lr)]
    if cfg.model.fine_tune_encoder:
        parts.append(("encoder", list(model.encoder.parameters()), cfg.train.encoder_lr))
    elif cfg.model.tune_stages:
        parts.append(("encoder", tuned_parameters(cfg, model), cfg.train.encoder_lr))
    optimizer = build_optimizer(cfg.train, model, parts)
    roles = [(g["role"], g["decay"]) for g in optimizer.param_groups]
    if resume is not None and resume.optimizer_tensors:  # (the weights' averages travel with them: ema.PREFIX)
        optimizer_from_tensors(optimizer, {k: v.to(device) for k, v in resume.optimizer_tensors.items()
                                           if not k.startswith(EMA_PREFIX)}, resume.train_state["optimizer"])
        keep_roles(optimizer, roles)
    apply_to_optimizer(optimizer, changed)  # a new train.lr / encoder_lr / weight_decay replaces the stored one
    return optimizer


def tuned_parameters(cfg: Config, model: ShowAttendTell) -> list[torch.nn.Parameter]:
    """The encoder parameters model.tune_stages trains (none when 0 or when the whole encoder is tuned)."""
    if cfg.model.fine_tune_encoder or not cfg.model.tune_stages:
        return []
    return [p for m in model.encoder.top_modules(cfg.model.tune_stages) for p in m.parameters()]


def encoder_train_mode(cfg: Config, model: ShowAttendTell) -> None:
    """After model.train(): a frozen encoder keeps ImageNet's batch-norm statistics; tuned top stages
    use and update batch statistics only with train.encoder_bn=train."""
    if cfg.model.fine_tune_encoder:
        return
    model.encoder.eval()
    if cfg.model.tune_stages and cfg.train.encoder_bn == "train":
        for m in model.encoder.top_modules(cfg.model.tune_stages):
            m.train()


def build_run(cfg: Config, device: str | torch.device = "cpu", log: Log = print, progress: bool = True,
              rank: int = 0, world_size: int = 1, stop: StopSignal = NEVER) -> Run:
    """The run's context, built in the order a run needs it: where this process runs, what the run starts from,
    the model, its data, the model side that trains it, every random state, then the pieces beside the loop."""
    place = Place(torch.device(device), rank, world_size, log, progress)
    train, val, start = _begin(cfg, place)
    model = _placed_model(cfg, start, place)
    data = build_data(cfg, model, start.vocab, train, val, place)
    # one batch per optimizer step (batch_images x accumulate), split into micro-batches as it is read (loader.py):
    # length sorting, shuffling and sharding see the step's batch, so accumulation k is the k-times batch's run
    sampler = BucketBatchSampler(data.mean_lengths, cfg.train.batch_images * cfg.train.accumulate,
                                 seed=cfg.train.seed, weights=data.weights or None,
                                 min_batches=cfg.train.min_epoch_batches)
    train_module, optimizer, new_words = _model_side(cfg, place, model, start, data)
    _random_states(cfg, start.resume, place)
    out, scaler = Path(cfg.train.out_dir), _scaler(cfg, place, start.resume)
    captured = build_captured_step(cfg, model, place.device, place.world_size, amp_dtype(place.device, cfg),
                                   place.log)
    owed = _owed_at_resume(cfg, place, start, len(sampler) // world_size)
    return Run(cfg, place,
               model=model, vocab=start.vocab, optimizer=optimizer, train_module=train_module,
               scaler=scaler, ema=_ema(cfg, model, start.resume, place.device), captured=captured,
               new_words=new_words, start_file=_without_weights(start.init),
               dataset=data.dataset, collate_fn=data.collate, sampler=sampler,
               batches=RankBatches(sampler, rank, world_size), val_sets=data.val_sets,
               state=start.state,
               logger=_logger(out, place, start, owed), watch=_watch(cfg, out, place, start, owed), stop=stop)


def _begin(cfg: Config, place: Place) -> tuple[Mix, Mix, Start]:
    """The checks said before any data is read, the seed of the model's initial weights, the training mix's
    records and what the run starts from; the resolved config beside the run."""
    if cfg.train.val_metric == "METEOR" and not java_available():  # said before any data is read or trained on
        raise ValueError(f"train.val_metric=METEOR: {missing_java('METEOR')}; or choose train.val_metric=CIDEr")
    seed_everything(cfg.train.seed + place.rank)  # the model's initial weights
    train, val = build_mix(cfg.data, "train"), build_mix(cfg.data, "val")
    if place.main and len(train) > 1:
        place.log("training mix: " + "; ".join(f"{src.name} {len(t)} train / {len(v)} val photos, weight {src.weight:g}"
                                               for (src, t), (_, v) in zip(train, val)))
    start = _restore(cfg, place, [r for _, recs in train for r in recs])
    if place.main:  # the resolved config beside the run, readable without loading a checkpoint (checkpoints hold it too)
        write_config_yaml(cfg, Path(cfg.train.out_dir) / "config.yaml")
    return train, val, start


def _placed_model(cfg: Config, start: Start, place: Place) -> ShowAttendTell:
    """The model on this process's device, its encoder trainable as far as the config tunes it."""
    model = _model(cfg, len(start.vocab), start.weights, start.resume is None, place.log).to(place.device)
    for p in model.encoder.parameters():
        p.requires_grad_(cfg.model.fine_tune_encoder)
    for p in tuned_parameters(cfg, model):
        p.requires_grad_(True)
    return model


def _model_side(cfg: Config, place: Place, model: ShowAttendTell, start: Start, data: RunData
                ) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[str]]:
    """What trains the model: the objective as a module (DDP-wrapped over several processes), the optimiser
    (the stopped run's moments when resuming) and train.extend_vocab's new words."""
    if cfg.train.compile and place.device.type == "cuda":  # the one place compilation is switched on
        model.decoder.compile_step()
    module: torch.nn.Module = ObjectiveModule(model, build_objective(cfg, start.vocab, data.caps))
    if place.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = DDP(module, device_ids=[place.device.index] if place.device.type == "cuda" else None)
    optimizer = _optimizer(cfg, model, start.resume, place.device, start.changed)
    start.state.lr = optimizer.param_groups[0]["lr"]
    new_words = _new_words(cfg, model, start, data, optimizer, place)
    return module, optimizer, new_words


def _owed_at_resume(cfg: Config, place: Place, start: Start, steps_per_epoch: int) -> bool:
    """Whether the stopped run owes the validation of the step it stopped at (validation_owed); said once."""
    if start.resume is None or start.state.finished:
        return False
    owed = validation_owed(cfg.train, place.world_size, start.state, steps_per_epoch)
    if owed:
        place.log(f"the validation of step {start.state.step} is owed: it runs first")
    return owed


def _logger(out: Path, place: Place, start: Start, owed: bool) -> JsonlLogger:
    """metrics.jsonl, written by the main process; a resumed run drops the lines logged after its checkpoint (and
    the validation of its step where that is `owed`: it runs again)."""
    logger = JsonlLogger(out / "metrics.jsonl", enabled=place.main)
    if start.resume is not None:
        logger.rewind(start.state.step, owed)
    return logger


def _watch(cfg: Config, out: Path, place: Place, start: Start, owed: bool) -> Watch:
    """Throughput, ETA and TensorBoard; a resumed run's writer drops the events logged after its checkpoint, as
    metrics.jsonl drops its lines (_logger, which runs first: the step's own train record is read from there)."""
    step, record = start.state.step, None
    if owed and place.main and (out / "metrics.jsonl").is_file():
        record = next((r for r in read_jsonl(out / "metrics.jsonl") if r.get("kind") == "train"
                       and r.get("step") == step), None)
    return Watch(out, place.main, cfg.train.tensorboard, step, place.log, owed, record)


# ---------------------------------------------------------------- the precision the run trains in
# Mixed precision (train.amp, train.cpu_amp), chosen once per run like its device: bf16 keeps float32's exponent
# range, so its gradients need no scaling; fp16 (GPUs without bf16: T4, V100) underflows small gradients to zero
# unless the loss is scaled up before backward and the gradients down before the step, which is the GradScaler's
# job (its scale is saved in last.safetensors' train state and restored here, so a resumed run scales as an
# uninterrupted one does). engine.train_step autocasts to amp_dtype; the recorded step (captured_step.py) is given
# it by build_run.

def amp_dtype(device: torch.device, cfg: Config, bf16: bool | None = None) -> torch.dtype | None:
    """The training autocast's type: on CUDA with `train.amp`, bf16 where the GPU computes it, else fp16 (with a
    GradScaler: fp16 gradients underflow without one; T4, V100); on CPU only with `train.cpu_amp`, bf16 (fast
    only where the CPU computes bf16 natively: see api.preferred_dtype). None: float32. `bf16` stands in for
    torch.cuda.is_bf16_supported() (tests)."""
    if cfg.train.amp and device.type == "cuda":
        return torch.bfloat16 if (torch.cuda.is_bf16_supported() if bf16 is None else bf16) else torch.float16
    if cfg.train.cpu_amp and device.type == "cpu":
        return torch.bfloat16
    return None


def training_autocast(device: torch.device, cfg: Config) -> torch.autocast:
    """The autocast context of amp_dtype (disabled where that is None)."""
    dtype = amp_dtype(device, cfg)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def grad_scaler(device: torch.device, cfg: Config, bf16: bool | None = None) -> torch.amp.GradScaler | None:
    """A GradScaler where training autocasts to fp16 (amp_dtype), else None: bf16 and float32 need none."""
    if amp_dtype(device, cfg, bf16) is not torch.float16:
        return None
    return torch.amp.GradScaler(device.type)


def describe_precision(device: torch.device, cfg: Config) -> str:
    """The run's one line on its precision (engine.fit logs it once)."""
    dtype = amp_dtype(device, cfg)
    if dtype is None:
        return "float32" + (" (train.amp is off)" if device.type == "cuda" else "")
    if dtype is torch.float16:
        return "fp16 autocast with a GradScaler (this GPU has no bf16; train.amp=false trains in float32)"
    return f"bf16 autocast on {device.type}"


def _scaler(cfg: Config, place: Place, resume: Any) -> torch.amp.GradScaler | None:
    """fp16's loss scaler (grad_scaler), from the stopped run's scale and growth count when resuming."""
    scaler = grad_scaler(place.device, cfg)
    if scaler is not None and resume is not None and (resume.train_state or {}).get("scaler"):
        scaler.load_state_dict(resume.train_state["scaler"])
    return scaler


def _ema(cfg: Config, model: ShowAttendTell, resume: Any, device: torch.device) -> EMA | None:
    """train.ema_decay: the average of the trained weights, from the stopped run's when resuming."""
    if not cfg.train.ema_decay:
        return None
    ema = EMA(model, cfg.train.ema_decay)
    if resume is not None:
        try:
            ema.load({k: v.to(device) for k, v in (resume.optimizer_tensors or {}).items()})
        except ValueError as e:
            raise TrainingError(f"{cfg.train.out_dir}/last.safetensors: {e}; resume with the settings it was "
                                "trained with, or choose another train.out_dir") from None
    return ema


def _random_states(cfg: Config, resume: Any, place: Place) -> None:
    """A resumed run continues every generator where the stopped one left it; a new run starts them from the
    seed here, after its caches are built, so a run that built them draws what one that read them draws."""
    saved = (resume.train_state or {}).get("rng") if resume is not None else None
    if saved and len(saved) == place.world_size:
        restore_random_states(saved[place.rank])
        return
    if resume is not None:
        place.log(f"note: {'this checkpoint holds no random states' if not saved else f'it was saved by {len(saved)} process(es)'}:"
            " the resumed run's dropout and samples differ from an uninterrupted run's")
    seed_everything(cfg.train.seed + place.rank + 7919 * (resume is not None))


def _new_words(cfg: Config, model: ShowAttendTell, start: Start, data: RunData, optimizer: torch.optim.Optimizer,
               place: Place) -> list[str]:
    """train.extend_vocab: the words the starting file (start.init) lacks. A fresh run starts each as the old word
    the starting model says in its place (new_words.py); train.new_words_lr_factor speeds up their rows."""
    if not (cfg.train.init_from and cfg.train.extend_vocab):
        return []
    vocab, old_size = start.vocab, len(start.init.vocab)
    if start.resume is None and len(vocab) > old_size:
        votes, said = substitutes(model.decoder, data.dataset, data.collate, lambda b: batch_features(model, b, cfg),
                                  old_size, place.device, cfg.train.batch_images)
        place.log("new words start as the old word the starting model says in their place: "
            + "; ".join(init_from_substitutes(model.decoder, votes, vocab, said)))
    if (cfg.train.new_words_lr_factor != 1 or cfg.train.new_words_only) and len(vocab) > old_size:
        NewWordRows(optimizer, model.decoder, old_size, cfg.train.new_words_lr_factor, cfg.train.new_words_only)
    return vocab.itos[old_size:]


def _without_weights(init: Checkpoint | None) -> Checkpoint | None:
    """The train.init_from file as the run keeps it: its weights are in the model already."""
    return None if init is None else replace(init, model_state={}, optimizer_tensors={})


def check_ranks_in_sync(model: torch.nn.Module, world_size: int) -> None:
    """DistributedDataParallel must keep every rank's parameters identical; verify it (cheaply)."""
    local = torch.stack([p.detach().double().sum() for p in model.parameters() if p.requires_grad]).cpu()
    gathered = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather_object(gathered, local)
    for r, other in enumerate(gathered[1:], start=1):
        if not torch.equal(other, gathered[0]):
            raise TrainingError(f"rank {r}'s parameters differ from rank 0's: distributed training is out of sync")
