"""The public API: load() -> Captioner; Captioner.read(image) -> Photo; Photo.caption() -> Caption.

    import captioner
    model = captioner.load()                 # the bundled default model
    cap = model.caption("photo.jpg")         # PIL image, path or bytes: read(image).caption()
    caps = model.caption([img1, img2])       # a list in, a list out (= caption_batch: read and decoded together)
    cap.text, cap.words, cap.alphas, cap.betas, cap.log_prob, cap.word_log_probs, cap.concepts
    model.explain("photo.jpg", "a dog runs on the grass")   # any sentence, as a Caption (maps, probabilities)
    photo = model.read("photo.jpg")          # the encoder and its heads once; then ask the photo:
    photo.caption(beam_size=3), photo.explain("a dog"), photo.concepts.top, photo.size, photo.notes
    photo.sample(n=5, seed=0)    # drawn captions (list[Caption]), seeded; temperature 0.6, top_p 0.9 unless given

Decode settings (every field of config.decode: beam size, maximum length, length penalty, trigram
blocking ...) default to the ones stored in the model file; keyword overrides change them for one call:
`captioner.load().caption(img, beam_size=1)`. Any DecodeConfig field is accepted, so a new decode setting needs
no new parameter here. What the file fitted to its own captions (the choice among the beam's captions, the
confidence map: decoding/resources.py) is its data, not a setting: `fitted_choice=False` / `fitted_confidence=False`
turn it off for a call.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

from .model import graphs, int8_rows
from .decoding.captions import Caption
from .decoding.consensus import ConsensusMemory, memory_path
from .decoding.photo import SAMPLE_TEMPERATURE, SAMPLE_TOP_P, Photo, caption_photos
from .decoding.reading import HeadReading, photo_concepts, read_heads
from .decoding.resources import NOTHING, Fitted, Resources, of_file
from .decoding.sampling import Draw, SampleSettings
from .concepts.detectors import WordDetectors, attach, detectors_of
from .concepts.imagenet import THRESHOLD, Concepts
from .checkpoint import CheckpointError, load_checkpoint, load_model_state, save_checkpoint
from .config import DTYPES as DTYPE_NAMES
from .config import REMOVED, Config, DecodeConfig, set_value
from .decoding.photo import NoWordsError
from .images import ImageError, ImageInput, flat_colour, load_image, original_size, was_transparent
from .model.show_attend_tell import ShowAttendTell, build_model
from .model.encoder import Preprocess, build_preprocess
from .vocab import Vocab

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "assets" / "default.safetensors"
# a precision -> the dtype of the model's tensors ("int8": float32 tensors, the decoder step's products in int8)
DTYPES = {name: torch.float32 if name == "int8" else getattr(torch, name) for name in DTYPE_NAMES}


def default_device() -> str:
    """"cuda" when a CUDA GPU is usable, else "cpu": the --device default of every command."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def available_devices() -> list[str]:
    """The devices this machine can compute on: cpu, each CUDA GPU (cuda:0 ...), mps on Apple silicon."""
    cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    mps = getattr(torch.backends, "mps", None)
    return ["cpu", *cuda, *(["mps"] if mps is not None and mps.is_available() else [])]


def check_device(device: str | torch.device) -> torch.device:
    """The device named, or a ValueError that says which devices this machine has ("--device cuda" on a
    machine without a GPU used to end in a CUDA traceback deep inside torch)."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"'{device}' is not a device name; this machine has: {', '.join(available_devices())}") from None
    usable = {"cpu": True, "cuda": torch.cuda.is_available() and (d.index or 0) < torch.cuda.device_count(),
              "mps": "mps" in available_devices()}
    if not usable.get(d.type, False):
        raise ValueError(f"device '{device}' is not available on this machine; it has: {', '.join(available_devices())}")
    return d


@dataclasses.dataclass(frozen=True)
class Prepared:
    """An image as read_batch takes it to the encoder (Captioner.prepare): preprocessed, with its sizes."""

    pixels: torch.Tensor  # (3, S, S) normalised
    size: tuple[int, int]  # (width, height) as read, upright, at most the working side
    file_size: tuple[int, int]  # the file's own (width, height), upright
    clear: bool  # a fully transparent file
    flat: bool  # one flat colour (images.flat_colour)


def _ready(model: ShowAttendTell, device: torch.device, precision: str) -> ShowAttendTell:
    """The caller's model when it is already in eval mode on `device` in `precision`; otherwise a converted
    COPY: a Captioner never changes the model it was given (its device, dtype, step layers or train mode)."""
    p = next(model.parameters())
    if not model.training and p.device == device and int8_rows.precision_of(model.decoder) == precision:
        return model
    ready = copy.deepcopy(model).eval().to(device=device, dtype=DTYPES[precision])
    int8_rows.quantize(ready.decoder, on=precision == "int8")
    return ready


def resolve_precision(dtype: str | torch.dtype) -> str:
    """"float32" / "bfloat16" / "int8" (or the torch dtypes float32, bfloat16) -> the precision's name; anything
    else is an error."""
    if isinstance(dtype, torch.dtype) and dtype in (torch.float32, torch.bfloat16):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A precision (resolve_precision) -> the dtype of the model's tensors."""
    return DTYPES[resolve_precision(dtype)]


def usable_precision(precision: str, device: str | torch.device) -> str:
    """The precision a model computes in on `device`: "int8" only on a CPU whose torch multiplies int8 matrices
    (int8_rows.available); elsewhere float32, said once per process (a warning), never silently."""
    if precision != "int8" or (torch.device(device).type == "cpu" and int8_rows.available()):
        return precision
    warnings.warn(f"the int8 precision needs a CPU and a torch with int8 products (torch._int_mm); on {device} "
                  "this torch computes in float32 instead", RuntimeWarning, stacklevel=1)
    return "float32"


def preferred_dtype(device: str | torch.device = "cpu") -> str:
    """"bfloat16" where the hardware computes it natively (CUDA with bf16, CPUs with AVX512-BF16 or
    AMX), else "float32". bf16 may be faster there; the gain depends on the machine, and it can change
    individual captions at nearly the same corpus quality (the measurement: docs/performance.md, "Measured
    once, kept out of the code")."""
    device = torch.device(device)
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    if device.type != "cpu":
        return "float32"
    native = False
    try:  # Linux: the kernel lists the CPU's instruction sets; elsewhere assume no native bf16
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        native = "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    return "bfloat16" if native else "float32"


class Captioner:
    """A ready model with its preprocessing (`.preprocess`, callable: image -> (3, S, S) tensor),
    vocabulary and stored decode settings (`.config.decode`)."""

    def __init__(self, model: ShowAttendTell, vocab: Vocab, config: Config, metrics: dict[str, Any] | None = None,
                 device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32", source: str | None = None,
                 capture: bool = True, fitted: Fitted = NOTHING, memory: ConsensusMemory | None = None):
        """capture: on a CUDA GPU, the encoder pass and the beam search are recorded as CUDA graphs once per padded
        batch size and replayed (model/graphs.py, decoding/device_beam.py: the encoder as one launch, the search as a few; the first
        caption of a batch size waits about three searches and two encoder passes more); False runs them op by op.
        fitted, memory: the model file's fitted data and consensus memory (load reads them: resources.of_file).
        All three are this Captioner's own, in `.resources` (decoding/resources.py): another Captioner on the same
        model never changes them."""
        self.device = torch.device(device)
        self.precision = usable_precision(resolve_precision(dtype), self.device)  # named in each caption's settings
        self.dtype = DTYPES[self.precision]  # the whole model's tensors (encoder and decoder) are of this type
        self.model = _ready(model, self.device, self.precision)
        self.model.prepare()  # the packed weights and the word-gate table, made before a caption
        recordings = graphs.recorded() if capture and self.device.type == "cuda" else graphs.EAGER
        self.resources = Resources(fitted, memory, recordings)  # what its decodes read besides the model
        self.vocab, self.config, self.metrics = vocab, config, metrics or {}
        self.source = source  # the model file it was loaded from (None: built in memory); each Caption names it
        self.preprocess: Preprocess = build_preprocess(config.model)  # any image input -> (3, S, S); ImageError

    @property
    def grid_size(self) -> int:
        return self.config.model.grid_size

    def decode_settings(self, **overrides: Any) -> DecodeConfig:
        """The settings a caption call uses: the model file's (config.decode) with `overrides` (any
        DecodeConfig field; None means "the stored value") applied and checked."""
        known = {f.name for f in dataclasses.fields(DecodeConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            gone = "".join(f"; {k} is no longer a setting: {REMOVED[f'decode.{k}']}" for k in unknown
                           if f"decode.{k}" in REMOVED)  # why, where it was removed (config.REMOVED)
            raise TypeError(f"unknown decode setting(s) {', '.join(unknown)}{gone}; known: {', '.join(sorted(known))}")
        cfg = Config(decode=dataclasses.replace(self.config.decode))
        for key, value in overrides.items():  # typed like a config file: "false" is False, 2.5 beams an error
            if value is not None:
                set_value(cfg, f"decode.{key}", value, "decode settings")
        return cfg.decode.checked()  # each setting within config.DecodeConfig.LIMITS

    def read(self, image: ImageInput | Prepared, name: str | None = None) -> Photo:
        """One image (PIL image, path or bytes) -> its Photo: opened, preprocessed and encoded once, the
        encoder's heads applied once; ask it for captions, explanations and concepts (decoding/photo.py).
        ImageError for an unusable image."""
        return self.read_batch([image], [name])[0]

    def prepare(self, image: ImageInput) -> Prepared:
        """One image decoded, made upright RGB and preprocessed for the encoder, its sizes noted: the part of read
        that needs no model, safe to run in worker threads (PIL and these small CPU tensors release the GIL), so a
        library's next photos are prepared while the model reads the last ones. ImageError for an unusable image."""
        img = load_image(image)
        return Prepared(self.preprocess(img), img.size, original_size(img), was_transparent(img), flat_colour(img))

    @torch.no_grad()
    def read_batch(self, images: Sequence[ImageInput | Prepared], names: Sequence[str | None] | None = None
                   ) -> list[Photo]:
        """Several images (or Prepared ones) read together (one encoder and one head pass for the batch) -> their
        Photos. Raises ImageError naming the first unusable image."""
        if not images:
            return []
        ready = [im if isinstance(im, Prepared) else self.prepare(im) for im in images]  # one decoded photo at a time
        feats = self.encode(torch.stack([r.pixels for r in ready]))  # (B, P, D)
        reading = read_heads(self.model, feats)
        side, names = int(self.config.model.image_size), list(names or [None] * len(images))
        return [Photo(self, feats[i:i + 1], reading.rows(i, i + 1), r.size, side, names[i], r.file_size, r.clear,
                      r.flat) for i, r in enumerate(ready)]

    def caption(self, image: ImageInput | list[ImageInput] | tuple[ImageInput, ...], **overrides: Any
                ) -> Caption | list[Caption]:
        """One image -> Caption (`read(image).caption()`); a list (or tuple) of images -> a list of Captions, one
        per image in order (caption_batch), as image pipelines take either. Decode settings are the model file's
        unless overridden (decode_settings)."""
        if isinstance(image, (list, tuple)):
            return self.caption_batch(image, **overrides)
        return self.read(image).caption(**overrides)

    def caption_batch(self, images: Sequence[ImageInput | Prepared], **overrides: Any) -> list[Caption]:
        """All images read and decoded together (batched over images and beams). Raises ImageError naming
        the first unusable image."""
        return caption_photos(self, self.read_batch(images), **overrides)

    def sample(self, image: ImageInput, n: int = 5, temperature: float = SAMPLE_TEMPERATURE, top_k: int = 0,
               top_p: float = SAMPLE_TOP_P, seed: int | None = None, **overrides: Any) -> list[Caption]:
        """One image -> n captions drawn from the model (`read(image).sample(...)`, see Photo.sample: temperature
        (default 0.6), top_k, top_p (default 0.9), seed; decode settings as for caption). Arguments out of range
        raise a ValueError before the image is read."""
        SampleSettings(n, Draw(temperature, top_k, top_p), seed).checked()
        return self.read(image).sample(n, temperature, top_k, top_p, seed, **overrides)

    def explain(self, image: ImageInput | Prepared, text: str, **overrides: Any) -> Caption:
        """Any sentence about one image -> Caption of exactly its words (vocab.tokenize_typed: each kept as
        typed, in any script, lowercased), teacher-forced: where the model looks for each word and how
        likely it finds each (word_log_probs), with the photo's concepts, contradicted words and concept
        maps like a generated caption (`read(image).explain(text)`). Words the vocabulary lacks are fed as
        <unk> and listed in Caption.unknown (and Caption.notes). A sentence with no words ("", "!!! ...")
        raises NoWordsError (a ValueError) before the photo is read. `overrides`: decode settings (only
        hard_context matters, for a hard-attention model)."""
        from .decoding.photo import sentence_words

        sentence_words(text)  # NoWordsError before any work
        return self.read(image).explain(text, **overrides)

    def concepts(self, images: Sequence[ImageInput], threshold: float = THRESHOLD, top_k: int = 5) -> list[Concepts]:
        """What the encoder's heads see in each image (Photo.concepts; read_batch: one encoder pass): COCO
        categories at or above `threshold` and the `top_k` ImageNet classes; with word detectors in the model
        file, also the detected words (person among them) at or above `threshold`. At the default threshold
        `.top` is the list each Caption of the photo carries. An encoder without the ImageNet head sees nothing:
        Concepts.unseen() per image, as Photo.concepts (and empty Caption.concepts)."""
        photos = self.read_batch(images)
        return photo_concepts(HeadReading.together([p.reading for p in photos]), self.model, threshold, top_k)

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Preprocessed images (B, 3, S, S) -> annotation vectors (B, P, D) in the model's dtype."""
        x = x.to(self.device, self.dtype).contiguous(memory_format=torch.channels_last)
        recorded = self.resources.recordings.encoder  # on a GPU: replayed as one launch (model/graphs.py)
        return self.model.encode(x) if recorded is None else graphs.encode(recorded, self.model, x)  # (B, P, D)

    def save(self, path: str | Path, half: bool = False, metrics: dict[str, Any] | None = None) -> None:
        state = {k: v.float() if v.is_floating_point() else v for k, v in self.model.state_dict().items()}
        det = detectors_of(self.model)
        save_checkpoint(path, self.config, self.vocab, state, metrics=self.metrics if metrics is None else metrics,
                        half=half, detector_info=None if det is None else det.info(),
                        fitted=self.resources.fitted.to_json())
        memory = self.resources.memory
        if memory is not None:  # the consensus memory goes beside the file, where load finds it
            memory.save(memory_path(path))


def load(checkpoint: str | Path | None = None, device: str | torch.device = "cpu",
         dtype: str | torch.dtype = "float32", capture: bool = True) -> Captioner:
    """A Captioner from a checkpoint file; None loads the bundled default model. dtype "bfloat16"
    runs the model in bf16 (see preferred_dtype for when that is faster); "int8" runs the decoder step's large
    products in int8 on a CPU (model/int8_rows.py; float32 elsewhere, said once). capture: on a CUDA GPU, the encoder and
    the beam search recorded as CUDA graphs per batch size and replayed (Captioner)."""
    if checkpoint is None:
        checkpoint = DEFAULT_CHECKPOINT
        if not checkpoint.is_file():
            raise CheckpointError(
                f"the bundled default model is missing ({checkpoint}). Train one with "
                "'.venv/bin/captioner-train --config configs/flickr8k_cpu.yaml' and pass its best.safetensors "
                "to captioner.load(path), or reinstall the package.")
    check_device(device)  # before reading the file: a clear error, not a CUDA traceback
    ckpt = load_checkpoint(checkpoint)
    model = build_model(ckpt.config.model, len(ckpt.vocab), pretrained=False)
    load_model_state(model, ckpt.model_state, str(checkpoint))
    if ckpt.detector_info is not None:  # the word-detector head (person evidence), when the file has one
        try:
            attach(model, WordDetectors.from_state(ckpt.detector_tensors, ckpt.detector_info))
        except ValueError as e:
            raise CheckpointError(f"{checkpoint}: {e}") from None
    found = of_file(ckpt, checkpoint, model, device)  # its fitted data and consensus memory (decoding/resources.py)
    precision = usable_precision(resolve_precision(dtype), device)
    model = model.eval().to(device=torch.device(device), dtype=DTYPES[precision])  # ours: converted in place
    int8_rows.quantize(model.decoder, on=precision == "int8")
    return Captioner(model, ckpt.vocab, ckpt.config, ckpt.metrics, device, precision, source=str(checkpoint),
                     capture=capture, fitted=found.fitted, memory=found.memory)


__all__ = ["Caption", "Captioner", "Photo", "Prepared", "ImageError", "CheckpointError", "NoWordsError", "load", "preferred_dtype", "default_device",
           "check_device", "available_devices",
           "Preprocess", "DEFAULT_CHECKPOINT"]
