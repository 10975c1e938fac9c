"""Synthetic inputs of real shapes for the benchmark: dataset presets, annotation vectors, caption
batches collated like training, and a step counter that makes an untrained decoder stop like a
trained one (so decoding costs what a real model's does)."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

COCO_TRAIN_IMAGES = 113_287  # Karpathy train split (train2014 + restval)
CAPTIONS_PER_IMAGE = 5
START, END, PAD = 1, 2, 0  # Vocab's fixed special ids


@dataclass(frozen=True)
class Preset:
    name: str
    vocab: int
    encoder: str  # the encoder the cached features come from
    image_size: int
    grid: int
    feat_dim: int
    embed_dim: int
    hidden_dim: int
    attention_dim: int
    len_mean: float  # words per caption (without <start>/<end>)
    len_std: float
    len_min: int
    len_max: int
    max_decode_len: int

    @property
    def regions(self) -> int:
        return self.grid * self.grid


PRESETS = {
    # configs/flickr8k_cpu.yaml (the bundled model's recipe): Lite2 at 260 px -> 9x9x1280; vocabulary
    # of the words seen >= 5 times in Flickr8k train (~2.5k); lengths measured on captions.txt
    "flickr8k": Preset("flickr8k", 2_500, "efficientnet_lite2", 260, 9, 1280, 512, 512, 512, 10.8, 3.8, 1, 36, 30),
    # configs/coco_resnet101.yaml: ResNet-101 at 448 px -> 14x14x2048, LSTM 1800 (the paper's COCO size)
    "coco": Preset("coco", 10_000, "resnet101", 448, 14, 2048, 512, 1800, 512, 10.5, 2.8, 5, 50, 50),
}


def sample_lengths(preset: Preset, n: int, rng: np.random.Generator) -> np.ndarray:
    """Caption lengths in words: a discretised gamma with the dataset's mean and std (right-skewed
    like real captions), clipped to the dataset's range."""
    shape = (preset.len_mean / preset.len_std) ** 2
    scale = preset.len_std ** 2 / preset.len_mean
    return np.clip(np.rint(rng.gamma(shape, scale, size=n)), preset.len_min, preset.len_max).astype(int)


def synthetic_features(n: int, preset_or_shape, generator: torch.Generator | None = None) -> torch.Tensor:
    """Post-ReLU6-like annotation vectors (n, P, D): non-negative, sparse, at most 6."""
    if isinstance(preset_or_shape, Preset):
        P, D = preset_or_shape.regions, preset_or_shape.feat_dim
    else:
        P, D = preset_or_shape
    return torch.randn(n, P, D, generator=generator).clamp_(0, 6)


def make_vocab(size: int):
    from ..vocab import SPECIALS, Vocab

    return Vocab(list(SPECIALS) + [f"w{i}" for i in range(size - len(SPECIALS))])


# ---------------------------------------------------------------- synthetic batches

def make_batches(preset: Preset, n_batches: int, batch_images: int, bucket: bool, seed: int = 0):
    """Batches of (image features, 5 caption id lists) collated like training: a pool of images with
    sampled caption lengths goes through BucketBatchSampler (bucket=True groups similar lengths;
    False is a plain shuffle) and `collate` (captions sorted by length, image_index)."""
    from ..data.dataset import BucketBatchSampler, collate

    rng = np.random.default_rng(seed)
    pool = max(batch_images * 100, n_batches * batch_images)  # >= two bucketing windows (50 batches each)
    lengths = sample_lengths(preset, pool * CAPTIONS_PER_IMAGE, rng).reshape(pool, CAPTIONS_PER_IMAGE)
    sampler = BucketBatchSampler(lengths.mean(1).tolist(), batch_images, seed=seed, bucket=bucket)
    chosen = [b for b in sampler.batches() if len(b) == batch_images][:n_batches]
    g = torch.Generator().manual_seed(seed)
    out = []
    for idx in chosen:
        feats = synthetic_features(len(idx), preset, g)
        samples = []
        for k, i in enumerate(idx):
            caps = [[START] + rng.integers(4, preset.vocab, size=int(L)).tolist() + [END] for L in lengths[i]]
            samples.append((feats[k], caps))
        out.append(collate(samples))
    return out


def naive_batch(batch):
    """The same captions without sharing: each caption carries its own copy of its image's features."""
    from ..data.dataset import Batch

    return Batch(batch.visual[batch.image_index].contiguous(), batch.inputs, batch.targets, batch.lengths,
                 torch.arange(len(batch.lengths)))


def truncate(batch, steps: int):
    """The first `steps` words of every caption: a cheap warm-up batch of the same width."""
    from ..data.dataset import Batch

    return Batch(batch.visual, batch.inputs[:, :steps], batch.targets[:, :steps], batch.lengths.clamp(max=steps),
                 batch.image_index)


def decode_lengths(decoder, feats: torch.Tensor, beam: int, max_len: int, chunk: int = 100,
                   searches: Any = None) -> list[int]:
    """Words per caption, decoded as evaluate.py decodes (captions_from_features, `chunk` images per call);
    `searches`: the caller's recorded searches of `decoder` (graphs.Recordings; None: op by op)."""
    from ..decoding.captions import captions_from_features
    from ..model.graphs import Recorded
    from ..decoding.resources import Resources
    from ..config import DecodeConfig
    from ..model.show_attend_tell import ShowAttendTell

    settings = DecodeConfig(beam_size=beam, max_len=max_len, length_penalty=0.0, forbid_unk=False)
    model = ShowAttendTell(torch.nn.Identity(), decoder)  # type: ignore[arg-type]  # features given: no encoder
    caps = captions_from_features(model, feats, make_vocab(decoder.vocab_size), settings,
                                  Resources(recordings=Recorded(search=searches)), batch_size=chunk)
    return [len(c.words) for c in caps]


@torch.no_grad()
def install_length_counter(decoder, feats: torch.Tensor, spread_words: float, step: float = 0.025) -> None:
    """Make an untrained decoder stop like a trained one. A random decoder's logits barely depend on
    its state, so it emits <end> at the first step or never (and then runs to max_len, several times
    a real caption's cost); no constant <end> bias fixes that. Instead one LSTM unit k becomes a step
    counter and drives the <end> logit: its gates are constant (input, forget, output gates open,
    candidate = `step`), so c_k(t) = c_k(0) + t * step, and one deep-output dimension j reads
    tanh(50 h_k), which flips from -1 to +1 when c_k crosses 0; the <end> logit is 8 * out_j. The
    start c_k(0) = tanh(f_init,c(mean a_i))_k depends on the image, so lengths spread over images
    (about `spread_words` std); its mean is set by `set_length_offset`. Every tensor keeps its shape,
    so decoding costs exactly what it costs for a trained model of the same size. Every tensor it makes is
    on the decoder's device and nothing is read back to the host (tests/test_device_placement.py)."""
    H = decoder.hidden_dim
    k, j = 0, 0
    rows = [k, H + k, 2 * H + k, 3 * H + k]  # i, f, g, o of unit k
    for lin in (decoder.gates_embed, decoder.gates_context, decoder.gates_hidden):
        lin.weight[rows] = 0
    bias = decoder.gates_hidden.bias
    bias[rows] = torch.tensor([12.0, 12.0, math.atanh(step), 12.0], dtype=bias.dtype, device=bias.device)
    decoder.out_hidden.weight[j] = 0
    decoder.out_hidden.weight[j, k] = 50.0
    decoder.out_hidden.bias[j] = 0
    decoder.out_context.weight[j] = 0
    decoder.out_context.bias[j] = 0
    decoder.embedding.weight[:, j] = 0
    decoder.out_vocab.weight[:, j] = 0
    decoder.out_vocab.weight[END] = 0
    decoder.out_vocab.weight[END, j] = 8.0
    decoder.out_vocab.bias[END] = 0
    # c_k(0) spread: a random direction of f_init,c scaled so it varies by spread_words * step over images
    init_c = decoder.init_c
    m = feats.to(init_c.weight).mean(1)  # (n, D)
    v = torch.randn(m.shape[1], generator=torch.Generator().manual_seed(6)).to(m)  # (D,) the same on every device
    sd = (m @ v).std() if len(m) > 1 else m.new_zeros(())  # () kept on the device: no host sync
    scale = torch.where(sd > 1e-6, spread_words * step / sd.clamp(min=1e-6), sd.new_zeros(()))
    init_c.weight[k] = v * scale if spread_words > 0 else 0.0
    init_c.bias[k] = -(m @ init_c.weight[k]).mean()
    decoder._length_step = step  # type: ignore[attr-defined]


@torch.no_grad()
def set_length_offset(decoder, words: float) -> None:
    """Centre the counter so it crosses zero after about `words` steps (see install_length_counter)."""
    k = 0
    base = getattr(decoder, "_length_base", None)
    if base is None:
        base = decoder._length_base = float(decoder.init_c.bias[k])  # type: ignore[attr-defined]
    decoder.init_c.bias[k] = base + math.atanh(max(-0.99, min(0.99, -words * decoder._length_step)))


@torch.no_grad()
def calibrate_lengths(decoder, feats: torch.Tensor, target_words: float, spread_words: float, max_len: int,
                      iters: int, log: Callable[[str], None] = lambda s: None) -> dict[str, float]:
    """install_length_counter, then bisect its offset until the captions of `feats` average
    `target_words` words; returns the offset and the mean length reached. The counter ignores the
    words, so every beam size gives the same lengths: greedy decoding calibrates them all."""
    install_length_counter(decoder, feats, spread_words)
    beam = 1
    lo, hi = target_words - 4.0, target_words + 4.0  # mean length grows with the offset (about offset - 0.5)
    best = (math.inf, target_words, float("nan"))
    for _ in range(iters):
        mid = (lo + hi) / 2
        set_length_offset(decoder, mid)
        mean = float(np.mean(decode_lengths(decoder, feats, beam, max_len)))
        if abs(mean - target_words) < best[0]:
            best = (abs(mean - target_words), mid, mean)
        if mean < target_words:
            lo = mid
        else:
            hi = mid
    set_length_offset(decoder, best[1])
    log(f"  length counter offset {best[1]:.1f}: captions average {best[2]:.1f} words (target {target_words})")
    return {"length_offset": best[1], "calibrated_mean_words": best[2], "target_words": target_words}
