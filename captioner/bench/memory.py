"""How many images a training batch can hold on a GPU of a given memory, computed on any machine (a CPU too):
the bytes autograd keeps for backward are counted tensor by tensor (saved-tensor hooks) over a cross-entropy step
on synthetic batches of the preset's shapes, per caption token; the fixed part is the weights, their gradients
and Adam's two moments. Counted in float32 (bf16 autocast keeps some activations in half: an upper bound).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .synthetic import CAPTIONS_PER_IMAGE, Preset, make_batches

HEADROOM = 0.8  # of the GPU's memory: CUDA context, the allocator's fragmentation, the batch being read


@dataclass
class TrainingMemory:
    fixed_bytes: int  # trainable weights + gradients + Adam's moments (float32)
    bytes_per_token: float  # autograd's saved tensors per caption token (words + <end>)
    logits_bytes_per_token: float  # the (tokens, V) logits and their gradient, alive together at the loss

    def batch_images(self, gpu_bytes: float, tokens_per_caption: float) -> int:
        """The largest batch (images, x5 captions) whose longest captions fit `gpu_bytes` x HEADROOM."""
        per_image = CAPTIONS_PER_IMAGE * tokens_per_caption * (self.bytes_per_token + self.logits_bytes_per_token)
        return max(0, int((gpu_bytes * HEADROOM - self.fixed_bytes) // per_image))


def training_memory(preset: Preset, batch_images: int = 2) -> TrainingMemory:
    """Count one teacher-forced step's saved tensors on this machine (CPU is fine: shapes decide the bytes)."""
    from ..config import Config
    from ..training.objectives import CrossEntropy
    from .training import _decoder_model

    model = _decoder_model(preset, False).train()
    params = [p for p in model.parameters() if p.requires_grad]
    fixed = 4 * sum(p.numel() * p.element_size() for p in params)  # weights, grads, exp_avg, exp_avg_sq
    batch = make_batches(preset, 1, batch_images, True, 5)[0]
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        seen[key] = t.untyped_storage().nbytes()  # a storage saved twice (views) counts once
        return t

    cfg = Config()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        CrossEntropy(cfg)(model, batch).total.backward()
    tokens = int(batch.lengths.sum())
    logits = 2 * 4 * preset.vocab  # float32 logits + their gradient, per token
    return TrainingMemory(fixed, sum(seen.values()) / tokens, logits)
