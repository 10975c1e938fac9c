"""Typed configuration: dataclass defaults < YAML/JSON file < `--set key=value` overrides.

Every setting lives in one dataclass below. Unknown keys are errors (a typo in a recipe
should stop the run, not silently train the default). The resolved config is stored as
JSON inside every checkpoint, so a model always knows how it was built.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable

# ---------------------------------------------------------------- the ONE list of values per enumerated setting
# Every module that branches on one of these imports its list from here; load_config checks each value
# against it before any work starts, and the error names the choices.
ENCODERS = ("efficientnet_lite0", "efficientnet_lite2", "resnet101", "resnet152")  # model.encoder
ATTENTIONS = ("soft", "hard")  # model.attention
DATASETS = ("flickr8k", "coco", "karpathy")  # data.dataset
METRICS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr")  # train.val_metric, or:
VAL_METRICS = METRICS + ("CIDEr_new_words",)  # CIDEr + mean F1 of new words' use on val (training/new_words.py)
OBJECTIVES = ("xe", "scst")  # train.objective
SCST_BASELINES = ("mean", "greedy")  # train.scst_baseline
HARD_CONTEXTS = ("expected", "argmax")  # decode.hard_context
BN_MODES = ("frozen", "train")  # train.encoder_bn
SCHEDULES = ("plateau", "cosine", "linear")  # train.schedule
OPTIMIZERS = ("adam", "adamw")  # train.optimizer
DTYPES = ("float32", "bfloat16", "int8")  # the precision of a loaded model (api.load, --dtype; int8: model/int8_rows.py)


@dataclass
class ModelConfig:
    encoder: str = "efficientnet_lite0"  # one of ENCODERS
    pretrained: bool = True  # load ImageNet weights (EfficientNet-Lite: offline; ResNet: torchvision download)
    image_size: int = 224  # square network input; the whole image is resized, never cropped
    grid_size: int = 7  # annotation grid is grid_size x grid_size (paper: 14)
    output_stride: int = 32  # 16 dilates the encoder's last stage: a 2x finer native grid, same weights
    fine_tune_encoder: bool = False  # the whole encoder in the loop on images (GPU path)
    tune_stages: int = 0  # >0: train the encoder's top N stages + head conv from cached activations (CPU path)
    embed_dim: int = 512  # E
    hidden_dim: int = 512  # H
    attention_dim: int = 512  # A
    dropout: float = 0.5
    attention: str = "soft"  # ATTENTIONS: soft (deterministic, Xu et al. 4.2) | hard (stochastic, 4.1: REINFORCE)


@dataclass
class SourceConfig:
    """One caption set: where its photos and captions are, how its train/val photos are chosen, and (in a
    mix, data.sources) how often each of its photos is seen per epoch."""

    dataset: str = "flickr8k"  # one of DATASETS
    root: str = ""  # flickr8k: folder with Images/ + captions.txt (or Flickr8k.token.txt) and the split files
    images: str = ""  # coco/karpathy: image folder (coco: the training images)
    annotations: str = ""  # coco: captions_*.json; karpathy: dataset_*.json
    val_images: str = ""  # coco without split files: validation image folder
    val_annotations: str = ""  # coco without split files: captions_val*.json
    train_split: str = ""  # coco: a file naming the training photos of `annotations`, one file name per line
    val_split: str = ""  # coco: a file naming the validation photos of `annotations`
    name: str = ""  # unique in a mix: names its caches ("<name>-train-...") and val scores ("<name>/CIDEr")
    weight: float = 1.0  # sampling weight in a mix: each photo is seen this many times per epoch on average


@dataclass
class DataConfig(SourceConfig):  # its own SourceConfig keys name the one caption set of a run without data.sources
    root: str = "../shared/data/flickr8k"
    min_word_count: int = 5
    max_caption_len: int = 50  # longer training captions are truncated (in tokens, without <start>/<end>)
    augment: bool = False  # random resized crop + flip while training (needs the encoder in the loop)
    flip: bool = False  # model.tune_stages: also cache each photo's mirror image; each epoch reads one at random
    cache_dir: str = "cache"  # frozen-encoder feature cache
    num_workers: int = 2
    limit: int = 0  # use only the first N images of each split (0 = all); for smoke tests
    # a training mix: several caption sets at once (empty: the one set named by the keys above).
    # In a file: a list of mappings with SourceConfig's keys; with --set: data.sources='[{"name": ...}]' (JSON)
    sources: list[SourceConfig] = field(default_factory=list)

    def cache_split(self, split: str) -> str:
        """The split's name in cache file names: a limited run ("train8") never shares the full split's cache."""
        return f"{split}{self.limit}" if self.limit else split

    def source_list(self) -> list[SourceConfig]:
        """The run's caption sets: data.sources, or the one set this config's own keys name (called after
        data.dataset unless named, so a one-set run keeps the cache names it always had)."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(SourceConfig)}
        return list(self.sources) or [SourceConfig(**{**own, "name": self.name or self.dataset})]


@dataclass
class TrainConfig:
    out_dir: str = "runs/default"
    epochs: int = 20
    batch_images: int = 16  # images per batch; each brings all its captions (5 on Flickr8k/COCO)
    lr: float = 4e-4
    encoder_lr: float = 1e-4  # the encoder's (or its tuned top stages') learning rate
    encoder_bn: str = "frozen"  # BN_MODES, tuned stages: frozen (ImageNet statistics) | train (batch statistics, updated)
    alpha_head: float = 0.0  # tuned stages: + this x KL(pretrained ImageNet head || tuned), keeps concepts valid
    alpha_cam: float = 0.0  # + this x cross-entropy of a concept word's attention to its class activation map
    cam_min_prob: float = 0.1  # supervise a concept word's attention only where P(category) >= this
    cam_person: bool = False  # also person words, towards the map of the clothes people wear (coco-mini lift 1.27 only)
    optimizer: str = "adam"  # OPTIMIZERS: adam (weight_decay as L2 on every gradient) | adamw (decoupled decay,
    # none on biases, norm weights and embeddings: training/optimizer.py); fixed for a run
    weight_decay: float = 0.0  # adamw: e.g. 0.01 (nanoGPT: 0.1); adam: an L2 term (the bundled models: 0)
    grad_clip: float = 5.0
    alpha_c: float = 1.0  # lambda of the doubly stochastic attention penalty
    label_smoothing: float = 0.0
    schedule: str = "plateau"  # SCHEDULES: plateau (the decay below) | cosine, linear (per step from lr to min_lr)
    lr_decay: float = 0.8  # plateau: multiply lr by this when val metric does not improve ...
    lr_patience: int = 1  # ... for this many validations (epochs, unless val_every_steps)
    warmup_steps: int = 0  # the lr rises linearly over the first N optimizer steps (any schedule; 0 = off)
    min_lr: float = 0.0  # cosine/linear: the lr one step after the run's last, so the last step still learns
    # (encoder_lr ends at the same fraction)
    accumulate: int = 1  # k: batches of k x batch_images, each read as k micro-batches of batch_images whose
    # gradients are summed into one optimizer step (the run of a k-times batch on the memory of one)
    ema_decay: float = 0.0  # an exponential moving average of the trained weights (e.g. 0.999; 0 = off): validation,
    # best.safetensors and the kept epochs use the average (training/ema.py)
    early_stop_patience: int = 4  # stop after this many validations (epochs, unless val_every_steps) without
    # improvement; 0 = off (train every epoch)
    val_metric: str = "Bleu_4"  # one of VAL_METRICS, computed on decoded captions
    val_beam_size: int = 1  # 1 = greedy during validation (fast); the metric is still a real decoding metric
    val_limit: int = 0  # validate on the first N val images (0 = all)
    val_every_steps: int = 0  # validate every N optimizer steps of one process, inside epochs too, and at the
    # run's end (0 = after each epoch); best, keep_best, plateau decay and early stopping then count validations.
    # N processes read N batches a step: they validate every N-th as many steps (val_interval), as often an epoch
    amp: bool = True  # CUDA: bf16 autocast where the GPU has bf16, else fp16 with a GradScaler (T4, V100)
    cpu_amp: bool = False  # bf16 autocast on CPU too (opt-in: it pays only where the CPU has AVX512-BF16/AMX)
    compile: bool = False  # torch.compile the decoder (CUDA)
    capture: bool = False  # CUDA: record each batch shape's forward and backward as a CUDA graph, replayed as one
    # launch (training/captured_step.py: cross-entropy only; what it leaves op by op is said in the log)
    seed: int = 0
    log_every: int = 50  # a log line (loss, lr, grad norm, captions/s, ETA) and a metrics.jsonl record every N steps
    checkpoint_every: int = 200  # also save a resumable checkpoint every N steps inside an epoch
    keep_epochs: int = 0  # keep the last k epochs' weights (epoch_E.safetensors: captioner-export --average)
    keep_best: int = 0  # keep the k best validated weights by val_metric (best_step<S>.safetensors; 0 = off)
    tensorboard: bool = True  # TensorBoard events in <out_dir>/tensorboard (needs the tensorboard package)
    max_steps: int = 0  # stop after this many optimizer steps in total (0 = no limit); for tests
    objective: str = "xe"  # OBJECTIVES: xe (cross-entropy, teacher forcing) | scst (self-critical on CIDEr-D)
    init_from: str = ""  # start a new run from this model file's weights and vocabulary (e.g. SCST after xe)
    init_encoder: bool = False  # with init_from and a frozen encoder: take its encoder too (the cache is built with it)
    extend_vocab: bool = False  # with init_from: + the captions' new words (old words keep ids, rows: new_words.py)
    new_words_lr_factor: float = 1.0  # with extend_vocab: Adam's steps on the new words' rows x this
    new_words_only: bool = False  # with extend_vocab: only the new words' rows move (the rest stays the start's)
    min_epoch_batches: int = 0  # a small training set is passed over again until an epoch has this many steps
    scst_samples: int = 5  # K sampled captions per image
    scst_baseline: str = "mean"  # SCST_BASELINES: mean (of the image's other samples) | greedy (greedy caption's reward)
    scst_max_len: int = 20  # longest sampled caption (words + <end>)
    scst_bad_ending_penalty: float = 0.0  # subtracted from the reward of a sample ending in "a", "with", "the" ...
    scst_dropout: bool = False  # sample with dropout on (train mode); off: samples come from the policy decoding uses
    scst_xent: float = 0.0  # + this x teacher-forced cross-entropy on the batch's references (anchors the policy)
    scst_reward_end: bool = False  # count <end> as a word in the CIDEr-D reward: "... with a <end>" matches no reference ending
    # model.attention=hard with objective xe (Xu et al. 4.1, eq. 11-12; defaults from the authors' arctic-captions)
    hard_expected_prob: float = 0.5  # share of batches trained on the expected (soft) context instead (semi_sampling_p)
    hard_reinforce: float = 1.0  # lambda_r of eq. 12 (arctic-captions: 1/10, on a per-step reward)
    hard_entropy: float = 0.002  # lambda_e: entropy bonus (arctic-captions alpha_entropy_c=0.002)
    hard_baseline_decay: float = 0.9  # b <- decay * b + (1 - decay) * mean log p(y|s,a) of the batch

    def val_interval(self, world_size: int) -> int:
        """The optimizer steps between validations on `world_size` processes (0: after each epoch): val_every_steps
        counts one process's steps, and N processes take a step over N batches, so they validate every
        val_every_steps / N steps (rounded, at least 1): the same photos read between validations, and the same
        number of validations an epoch, on 1 or 8 GPUs."""
        if not self.val_every_steps:
            return 0
        return max(1, round(self.val_every_steps / max(world_size, 1)))

    def out_of_patience(self, bad_validations: int) -> bool:
        """Whether early stopping ends the run after `bad_validations` epochs without improvement (never when
        early_stop_patience is 0: off)."""
        return bool(self.early_stop_patience) and bad_validations >= self.early_stop_patience


@dataclass
class DecodeConfig:
    """How captions are searched and which words are allowed: the settings a user chooses. The defaults are what a
    model trained here stores until captioner-export sets others; the bundled model file stores its own, chosen on
    the val sets (each comment names its value where it differs: docs/architecture.md, "Decode settings"). What the
    file fitted to its own captions (the choice's weights among the beam's captions, the confidence map and its
    `sure` threshold) is not a setting: it is the file's data (decoding/resources.py), which the two fitted_* switches
    below turn off."""

    beam_size: int = 3  # captions searched side by side (1 = greedy); bundled file: 5
    max_len: int = 50  # the longest caption, in words; bundled file: 30
    length_penalty: float = 0.0  # score = log_prob / (words + 1)**length_penalty (0 = raw log-prob); bundled: 1
    forbid_unk: bool = True  # never write "<unk>" in a caption
    block_trigrams: bool = False  # never repeat a trigram within a caption ("a red shirt ... a red shirt"); bundled: on
    block_bigrams: bool = False  # never repeat a bigram ending in a content word ("brown and white and white"); bundled: on
    block_salad: bool = True  # never end on a function word or colour, never a content word 3 times (vocab.is_salad)
    block_repeats: bool = False  # never a word twice back to back ("airplane airplane") nor "X and X" (vocab.repeats);
    # bundled: on
    block_content_repeats: bool = False  # never a content word twice ("a kitchen that is in the kitchen"); bundled: on
    hard_context: str = "expected"  # HARD_CONTEXTS, hard-attention models: expected (paper's test time) | argmax
    # evidence-aware decoding (rules.py): the encoder's ImageNet head vetoes object words it rules out
    evidence: bool = False  # on: a word naming a COCO category with P(category) < evidence_floor is never written;
    # bundled: on (it needs an encoder with the ImageNet head: efficientnet_lite0/2)
    evidence_floor: float = 0.05  # P(category) from the ImageNet head below which its words are ruled out (banned)
    evidence_bonus: float = 0.0  # + bonus * P(category) for the words of categories not ruled out; bundled: 3
    person_floor: float = 0.0  # with evidence + word detectors: person words ruled out where P(person) < this
    # (0 = off); bundled: .2
    dog_floor: float = 0.2  # with evidence: dog words ruled out where P(dog) < max(this, evidence_floor)
    evidence_detectors: bool = True  # the veto also asks the file's word detector of a category
    # (rules.detected_probs); bundled: off (the file predates the setting and decodes as it always has: UNSTORED)
    consensus_k: int = 5  # the fitted choice and confidence read the captions of the k training photos nearest
    # in pooled features (decoding/consensus.py: a memory beside the model file)
    fitted_choice: bool = True  # order the beam's captions by the model file's fitted choice (decoding/choice.py:
    # its weights on the beam's score, the nearest photos' captions, the objects the head sees ...), where the file
    # has one and a consensus memory beside it; false: the beam's own order
    fitted_confidence: bool = True  # give each caption the model file's fitted confidence and `sure`
    # (decoding/confidence.py), where the file has a map and a consensus memory; false: no confidence
    # each numeric setting's range: checked() by the API, every command and decoding; the app's widgets read it
    LIMITS: ClassVar[dict[str, tuple[float, float]]] = {
        "beam_size": (1, 16), "max_len": (1, 200), "length_penalty": (0.0, 5.0), "evidence_floor": (0.0, 1.0),
        "evidence_bonus": (0.0, 100.0), "person_floor": (0.0, 1.0), "dog_floor": (0.0, 1.0), "consensus_k": (1, 100)}
    # what a file written before these were stored decodes with, as it always did (checkpoint.load_checkpoint)
    UNSTORED: ClassVar[dict[str, Any]] = {"block_repeats": True, "block_content_repeats": True,
                                          "evidence_detectors": False}

    def checked(self) -> "DecodeConfig":
        """These settings, or a ValueError naming the first one outside its LIMITS (or an unknown hard_context)."""
        for key, (low, high) in self.LIMITS.items():
            value = getattr(self, key)
            if not low <= value <= high:
                raise ValueError(f"decode.{key} must lie in [{low:g}, {high:g}], got {value}")
        check_choice("decode.hard_context", self.hard_context, "decode settings")
        return self


# Photo.sample's defaults, the API's and captioner-caption --sample's. Drawn from the model's own distribution
# (temperature 1, no cut), 58 of 60 samples of the bundled model's example photos hold a word it gives under 1%
# ("a bird is standing in front of a celebrate gnawing around her leaves"), the worst averaging exp(-5.2) per
# word; sharper and cut to the nucleus they read as captions (worst exp(-2.8)) and still differ from one another
# (tests/test_sampling_api.py)
SAMPLE_TEMPERATURE = 0.6
SAMPLE_TOP_P = 0.9


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    @property
    def encoder_in_loop(self) -> bool:
        """Whether training runs the encoder on images every step (fine-tuning or augmentation) instead
        of reading cached features: decided here, once, for the run, the objectives and the scripts."""
        return self.model.fine_tune_encoder or self.data.augment

    @property
    def from_activations(self) -> bool:
        """Whether training reads cached lower-stage activations and runs the top stages (model.tune_stages)."""
        return self.model.tune_stages > 0 and not self.encoder_in_loop

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "Config":
        cfg = cls()
        for section, values in d.items():
            if section not in _sections():
                raise ValueError(f"{source}: unknown section '{section}' (known: {', '.join(_sections())})")
            if not isinstance(values, dict):
                raise ValueError(f"{source}: section '{section}' must be a mapping, got {type(values).__name__}")
            for key, value in values.items():
                set_value(cfg, f"{section}.{key}", value, source)
        return cfg


# ---------------------------------------------------------------- settings a model file may know by an old name
# "section.key" as an older version stored it -> its name now, or None where the setting is gone (its stored value
# is dropped). load_checkpoint applies this before the strict check (Config.from_dict refuses unknown keys), so a
# model file written before a rename still loads; a recipe or --set with the old name stays an error naming the
# known keys (a person can fix those), and for a removed one saying why (REMOVED). Add a line here (a removed
# setting: in REMOVED) in the change that renames or removes a setting.
REMOVED: dict[str, str] = {  # "section.key" gone -> why, for the error a recipe or --set naming it gets
    # a file storing one (the bundled file's 10, "in effect forbidden") decodes with the ban
    "decode.evidence_penalty": "the evidence's veto is a ban: a word the heads rule out is never written, so it has "
                               "no size (decode.evidence=false turns the evidence off)",
}
RENAMED: dict[str, str | None] = {**dict.fromkeys(REMOVED)}


def migrate(d: dict[str, Any], source: str = "config") -> dict[str, Any]:
    """A stored config (section -> key -> value) with RENAMED applied: an old key's value moves to its new name
    (where the file holds the new name too, that value is kept) or is dropped. Other keys are left as they are,
    for Config.from_dict to check."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in d.items()}
    for old, new in RENAMED.items():
        section, key = old.split(".", 1)
        values = out.get(section)
        if not isinstance(values, dict) or key not in values:
            continue
        value = values.pop(key)
        if new is not None:
            new_section, new_key = new.split(".", 1)
            target = out.setdefault(new_section, {})
            if not isinstance(target, dict):
                raise ValueError(f"{source}: section '{new_section}' must be a mapping, got {type(target).__name__}")
            target.setdefault(new_key, value)
    return out


# ---------------------------------------------------------------- fitted numbers an older file kept as decode settings
# Before a model file stored what it fitted as its own data (decoding/resources.py: "fitted" in its metadata), the
# choice's weights and the confidence map were decode settings: consensus_weight w and select_<signal> (the choice
# weighs the beam's score by 1 - w), confidence_fitted, confidence_bias, confidence_<signal> and sure_at.
# split_fitted moves them out of such a file's decode section (the bundled file was one).
OLD_FITTED_DEFAULTS = {"consensus_weight": 0.3, "sure_at": 0.5}  # what such a file decoded with where it had no key


def is_old_fitted_key(key: str) -> bool:
    """Whether `key` (of the decode section) was one of the fitted numbers older files kept as decode settings."""
    return key in OLD_FITTED_DEFAULTS or key.startswith(("select_", "confidence_"))


def split_fitted(decode: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An older file's stored decode section -> (its settings without the fitted numbers, those numbers as the
    file's fitted data: {"choice": {signal: weight}, "confidence": {"bias", "weights", "sure_at"}}, each part only
    where the file had one), so that it decodes exactly as it did: the same weights, the same map, the same sure_at."""
    settings = {k: v for k, v in decode.items() if not is_old_fitted_key(k)}
    old = {**OLD_FITTED_DEFAULTS, **{k: v for k, v in decode.items() if is_old_fitted_key(k)}}
    fitted: dict[str, Any] = {}
    w = old["consensus_weight"]
    select = {k[len("select_"):]: v for k, v in old.items() if k.startswith("select_")}
    if w or any(select.values()):
        fitted["choice"] = {"score": 1 - w, "consensus": w, **select}
    if old.get("confidence_fitted"):
        weights = {k[len("confidence_"):]: v for k, v in old.items()
                   if k.startswith("confidence_") and k not in ("confidence_fitted", "confidence_bias")}
        fitted["confidence"] = {"bias": old.get("confidence_bias", 0.0), "weights": weights, "sure_at": old["sure_at"]}
    return settings, fitted


def _sources(value: Any, source: str) -> list[SourceConfig]:
    """data.sources from a file's list of mappings or --set's JSON text; every key checked like the others."""
    try:
        value = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: data.sources expects a JSON list of mappings, got '{value}' ({e})") from None
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise ValueError(f"{source}: data.sources expects a list of mappings, got {value!r}")
    out = []
    for i, item in enumerate(value):
        src, name = SourceConfig(), f"data.sources[{i}]"
        for key, v in item.items():
            _set_typed(src, key, v, f"{name}.{key}", source, f"unknown key '{key}' in {name}")
        if not src.name:
            raise ValueError(f"{source}: {name} needs a name (it names the caches and the val scores)")
        check_choice("data.dataset", src.dataset, f"{source}: {name}")
        if not src.weight > 0:
            raise ValueError(f"{source}: {name}.weight must be > 0, got {src.weight}")
        out.append(src)
    if len({s.name for s in out}) != len(out):
        raise ValueError(f"{source}: data.sources names must be unique, got {[s.name for s in out]}")
    return out


def _set_typed(obj: Any, key: str, value: Any, name: str, source: str, unknown: str) -> None:
    """obj.key = value coerced to the field's type; an unknown key is an error listing the known ones."""
    types = {f.name: f.type for f in dataclasses.fields(obj)}
    if key not in types:
        raise ValueError(f"{source}: {unknown}. Known keys: {', '.join(sorted(types))}")
    typ = _SCALARS[types[key] if isinstance(types[key], str) else types[key].__name__]
    setattr(obj, key, _coerce(value, typ, name, source))


def _sections() -> list[str]:
    return [f.name for f in dataclasses.fields(Config)]


def _coerce(value: Any, typ: type, name: str, source: str) -> Any:
    if isinstance(value, str) and typ is not str:
        text = value.strip()
        if typ is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"{source}: {name} expects true/false, got '{value}'")
        try:
            return typ(text)
        except ValueError:
            raise ValueError(f"{source}: {name} expects {typ.__name__}, got '{value}'") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ValueError(f"{source}: {name} expects {typ.__name__}, got {value!r}")
    return value


def parse_bool(text: str) -> bool:
    """A command-line boolean read like a config file's: true/false, yes/no, on/off, 1/0; anything else
    ("ture") is a ValueError, never silently False."""
    return _coerce(text, bool, "a true/false option", "command line")


CHOICES: dict[str, tuple[str, ...]] = {
    "model.encoder": ENCODERS, "model.attention": ATTENTIONS, "data.dataset": DATASETS,
    "train.val_metric": VAL_METRICS, "train.objective": OBJECTIVES, "train.scst_baseline": SCST_BASELINES,
    "decode.hard_context": HARD_CONTEXTS, "train.encoder_bn": BN_MODES, "train.schedule": SCHEDULES,
    "train.optimizer": OPTIMIZERS,
}
_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}


def check_choice(name: str, value: Any, source: str = "config") -> None:
    """Raise a ValueError naming the valid choices when `value` is not one of setting `name`'s."""
    if name in CHOICES and value not in CHOICES[name]:
        raise ValueError(f"{source}: {name} must be one of {', '.join(CHOICES[name])}, got {value!r}")


def set_value(cfg: Config, dotted: str, value: Any, source: str) -> None:
    parts = dotted.split(".")
    if len(parts) != 2 or parts[0] not in _sections():
        raise ValueError(f"{source}: '{dotted}' is not a setting; use section.key with section in {_sections()}")
    section = getattr(cfg, parts[0])
    if dotted == "data.sources":
        section.sources = _sources(value, source)
        return
    if parts[0] == "decode" and is_old_fitted_key(parts[1]):
        raise ValueError(f"{source}: '{dotted}' is no longer a decode setting: the choice's weights, the confidence "
                         "map and sure_at are the model file's fitted data (captioner-fit-selector fits them, "
                         "captioner-export --fitted stores them); decode.fitted_choice=false keeps the beam's order, "
                         "decode.fitted_confidence=false gives no confidence")
    if dotted in REMOVED:
        raise ValueError(f"{source}: '{dotted}' is no longer a setting: {REMOVED[dotted]}")
    _set_typed(section, parts[1], value, dotted, source, f"unknown setting '{dotted}' in [{parts[0]}]")
    check_choice(dotted, getattr(section, parts[1]), source)  # fail when the config is read, not hours into a run


def native_grid(model: ModelConfig) -> int:
    """The side of the encoder's own feature map for model.image_size and output_stride (every stride-2
    layer pads, so a side of S gives ceil(S / stride)): 224 px -> 7 at stride 32, 14 at stride 16."""
    return -(-model.image_size // model.output_stride)


def check_grid(model: ModelConfig, source: str = "config") -> None:
    """A ValueError when model.grid_size exceeds the native map: pooling it UP would interpolate a coarser
    map into cells that hold no information of their own."""
    native = native_grid(model)
    if model.grid_size > native:
        need = model.grid_size * model.output_stride
        raise ValueError(
            f"{source}: model.grid_size={model.grid_size} is larger than the encoder's {native}x{native} feature map "
            f"at model.image_size={model.image_size} with model.output_stride={model.output_stride}; the map would be "
            f"stretched, not pooled. Use model.grid_size <= {native}, or model.image_size={need} for a native "
            f"{model.grid_size}x{model.grid_size} map.")


def read_config_file(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config file's sections as a mapping. A top-level `base: <file>` (a path relative to this file) is read first
    and this file's keys replace its keys one by one (a list, such as data.sources, is replaced whole), so a
    stage names only what it changes. A base chain that loops, or a missing file, is an error naming the files."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}" + (f" (the base of {_seen[-1]})" if _seen else ""))
    if path.resolve() in _seen:
        raise ValueError(f"config base chain loops: {' -> '.join(str(p) for p in (*_seen, path.resolve()))}")
    import yaml  # YAML or JSON (JSON is YAML)

    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config file is a mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ValueError(f"{path}: 'base' names one config file, got {base!r}")
    merged = read_config_file(path.parent / base, (*_seen, path.resolve()))
    for section, values in data.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section] = {**merged[section], **values}
        else:
            merged[section] = values
    return merged


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Defaults, then the YAML/JSON file at `path` (after the files it names as `base`, see read_config_file),
    then `key=value` overrides (e.g. 'train.lr=1e-3')."""
    cfg = Config()
    if path is not None:
        cfg = Config.from_dict(read_config_file(path), source=str(path))
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got '{item}'")
        key, value = item.split("=", 1)
        set_value(cfg, key.strip(), value, source="--set")
    check_grid(cfg.model)
    check_steps(cfg.train)
    return cfg


def check_steps(train: TrainConfig, source: str = "config") -> None:
    """A ValueError for step settings no run can use: accumulation below 1, negative warmup, a final
    learning rate above the starting one, an average's decay outside [0, 1), a negative count."""
    if train.accumulate < 1:
        raise ValueError(f"{source}: train.accumulate must be >= 1 (micro-batches per optimizer step), "
                         f"got {train.accumulate}")
    if train.warmup_steps < 0:
        raise ValueError(f"{source}: train.warmup_steps must be >= 0, got {train.warmup_steps}")
    if not 0 <= train.ema_decay < 1:
        raise ValueError(f"{source}: train.ema_decay must lie in [0, 1) (0 = no average), got {train.ema_decay:g}")
    if train.val_every_steps < 0:
        raise ValueError(f"{source}: train.val_every_steps must be >= 0 (0 = validate after each epoch), "
                         f"got {train.val_every_steps}")
    if train.keep_best < 0:
        raise ValueError(f"{source}: train.keep_best must be >= 0 (0 = off), got {train.keep_best}")
    if train.early_stop_patience < 0:
        raise ValueError(f"{source}: train.early_stop_patience must be >= 0 (0 = no early stopping), "
                         f"got {train.early_stop_patience}")
    if not 0 <= train.min_lr <= train.lr:
        raise ValueError(f"{source}: train.min_lr must lie in [0, train.lr={train.lr:g}], got {train.min_lr:g}")
