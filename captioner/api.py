"""The public API: load() -> Captioner, Captioner.caption(image) -> Caption.

    import captioner
    model = captioner.load()                 # the bundled default model
    cap = model.caption("photo.jpg")         # PIL image, path or bytes
    cap.text, cap.words, cap.alphas, cap.betas, cap.log_prob

Decode settings (beam size, maximum length, length penalty) default to the ones stored in the
model file (config.decode); an explicit argument overrides them for that call.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .checkpoint import CheckpointError, load_checkpoint, load_model_state, save_checkpoint
from .config import Config, DecodeConfig
from .decoding import decode
from .images import ImageError, ImageInput
from .model.captioner import CaptionModel, build_model
from .model.encoder import Preprocess, build_preprocess
from .vocab import Vocab

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "assets" / "default.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_device() -> str:
    """"cuda" when a CUDA GPU is usable, else "cpu": the --device default of every command."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """"float32" / "bfloat16" (or the torch dtypes) -> torch dtype; anything else is an error."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def preferred_dtype(device: str | torch.device = "cpu") -> str:
    """"bfloat16" where the hardware computes it natively (CUDA with bf16, CPUs with AVX512-BF16 or
    AMX: ~3x faster captions at nearly the same quality; Flickr8k test, beam 5: METEOR 0.204 in both,
    BLEU-4 0.208 vs 0.213), else "float32". On other CPUs PyTorch emulates bf16, which is slower."""
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


@dataclass
class Caption:
    text: str
    words: list[str]  # no special tokens
    alphas: np.ndarray  # (len(words), grid_h, grid_w), each map sums to 1, covering the whole image
    log_prob: float  # log p(words, <end> | image) under the model
    alternatives: list[tuple[str, float]] = field(default_factory=list)  # other beam hypotheses (text, log_prob)
    # (len(words),) gate beta of each word in [0, 1]: the share of the attended image context that reached
    # the word (z = beta * sum alpha_i a_i); near 0 = the word barely used the image. Empty when unknown.
    betas: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))


class Captioner:
    """A ready model with its preprocessing (`.preprocess`, callable: image -> (3, S, S) tensor),
    vocabulary and stored decode settings (`.config.decode`)."""

    def __init__(self, model: CaptionModel, vocab: Vocab, config: Config, metrics: dict[str, Any] | None = None,
                 device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32"):
        self.dtype = resolve_dtype(dtype)  # the whole model (encoder and decoder) computes in this type
        self.model = model.eval().to(device=device, dtype=self.dtype)
        self.vocab, self.config, self.metrics = vocab, config, metrics or {}
        self.model.decoder.decode_context = config.decode.hard_context  # how a hard-attention model attends
        self.device = torch.device(device)
        self.preprocess: Preprocess = build_preprocess(config.model)  # any image input -> (3, S, S); ImageError

    @property
    def grid_size(self) -> int:
        return self.config.model.grid_size

    def decode_settings(self, beam_size: int | None = None, max_len: int | None = None,
                        length_penalty: float | None = None) -> DecodeConfig:
        """The settings a caption call uses: each None is the model file's (config.decode)."""
        stored = self.config.decode
        used = dataclasses.replace(
            stored, beam_size=stored.beam_size if beam_size is None else beam_size,
            max_len=stored.max_len if max_len is None else max_len,
            length_penalty=stored.length_penalty if length_penalty is None else length_penalty)
        if used.beam_size < 1 or used.max_len < 1:
            raise ValueError(f"beam_size and max_len must be at least 1, got {used.beam_size} and {used.max_len}")
        return used

    def caption(self, image: ImageInput, beam_size: int | None = None, max_len: int | None = None,
                length_penalty: float | None = None) -> Caption:
        """One image -> Caption; None settings are the model file's (see decode_settings)."""
        return self.caption_batch([image], beam_size, max_len, length_penalty)[0]

    @torch.no_grad()
    def caption_batch(self, images: Sequence[ImageInput], beam_size: int | None = None, max_len: int | None = None,
                      length_penalty: float | None = None) -> list[Caption]:
        """All images decoded together (batched over images and beams). Raises ImageError naming
        the first unusable image."""
        if not images:
            return []
        x = torch.stack([self.preprocess(im) for im in images])  # (B, 3, S, S)
        return self.caption_tensors(x, beam_size, max_len, length_penalty)

    @torch.no_grad()
    def caption_tensors(self, x: torch.Tensor, beam_size: int | None = None, max_len: int | None = None,
                        length_penalty: float | None = None) -> list[Caption]:
        """Preprocessed images (B, 3, S, S) -> captions."""
        s = self.decode_settings(beam_size, max_len, length_penalty)
        x = x.to(self.device, self.dtype).contiguous(memory_format=torch.channels_last)
        feats = self.model.encode(x)  # (B, P, D)
        unk = self.vocab.unk if s.forbid_unk else None
        results = decode(self.model.decoder, feats, self.vocab.start, self.vocab.end, self.vocab.pad,
                         s.beam_size, s.max_len, s.length_penalty, unk, s.block_trigrams)
        g = self.grid_size
        out = []
        for hyps in results:
            best = hyps[0]
            words = [self.vocab.itos[t] for t in best.tokens]
            alphas = best.alphas.float().cpu().numpy().reshape(len(words), g, g)  # (L, G, G)
            betas = best.betas.float().cpu().numpy() if best.betas is not None else np.zeros(0, np.float32)  # (L,)
            alts = [(" ".join(self.vocab.itos[t] for t in h.tokens), h.log_prob) for h in hyps[1:]]
            out.append(Caption(" ".join(words), words, alphas, float(best.log_prob), alts, betas))
        return out

    def save(self, path: str | Path, half: bool = False, metrics: dict[str, Any] | None = None) -> None:
        state = {k: v.float() if v.is_floating_point() else v for k, v in self.model.state_dict().items()}
        save_checkpoint(path, self.config, self.vocab, state,
                        metrics=self.metrics if metrics is None else metrics, half=half)


def load(checkpoint: str | Path | None = None, device: str | torch.device = "cpu",
         dtype: str | torch.dtype = "float32") -> Captioner:
    """A Captioner from a checkpoint file; None loads the bundled default model. dtype "bfloat16"
    runs the model in bf16 (see preferred_dtype for when that is faster)."""
    if checkpoint is None:
        checkpoint = DEFAULT_CHECKPOINT
        if not checkpoint.is_file():
            raise CheckpointError(
                f"the bundled default model is missing ({checkpoint}). Train one with "
                "'python scripts/train.py --config configs/flickr8k_cpu.yaml' and pass its best.safetensors "
                "to captioner.load(path), or reinstall the package.")
    ckpt = load_checkpoint(checkpoint)
    model = build_model(ckpt.config.model, len(ckpt.vocab), pretrained=False)
    load_model_state(model, ckpt.model_state, str(checkpoint))
    return Captioner(model, ckpt.vocab, ckpt.config, ckpt.metrics, device, dtype)


__all__ = ["Caption", "Captioner", "ImageError", "CheckpointError", "load", "preferred_dtype", "default_device",
           "Preprocess", "DEFAULT_CHECKPOINT"]
