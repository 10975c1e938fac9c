"""How many images a training batch can hold on a GPU of a given memory, computed on any machine (a CPU too):
the bytes autograd keeps for backward are counted tensor by tensor (saved-tensor hooks) over a cross-entropy step
on synthetic batches of the preset's shapes, per caption token; the fixed part is the weights, their gradients
and Adam's two moments. Counted in float32 (bf16 autocast keeps some activations in half: an upper bound). `memory_report(device)` is
scripts/gpu_check.py's memory row: the batches for common GPU sizes, and on a CUDA device one step at the batch
computed for its own memory, its peak measured.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .synthetic import CAPTIONS_PER_IMAGE, PRESETS, Preset, make_batches

HEADROOM = 0.8  # of the GPU's memory: CUDA context, the allocator's fragmentation, the batch being read
LONG_CAPTION_TOKENS = 23  # 22 words + <end>: COCO's 99th percentile of caption length (docs/training.md)
GPU_SIZES_GIB = (16, 24, 40, 80)


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
    from .training import decoder_model

    model = decoder_model(preset, False).train()
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


def memory_report(device: torch.device, preset: Preset = PRESETS["coco"]) -> dict[str, float]:
    """The memory row: the fixed bytes and bytes per token, the batch (images) of long captions that fits each of
    GPU_SIZES_GIB, and on a CUDA device the batch for its own memory with one bf16 step at it, its peak measured."""
    m = training_memory(preset)
    res: dict[str, float] = {"fixed_MiB": round(m.fixed_bytes / 2**20), "KiB_per_token": round(m.bytes_per_token / 1024)}
    for gib in GPU_SIZES_GIB:
        res[f"batch_images_{gib}GiB_p99_captions"] = m.batch_images(gib * 2**30, LONG_CAPTION_TOKENS)
    if device.type == "cuda":
        res.update(_measured_step(m, preset, device))
    return res


def _measured_step(m: TrainingMemory, preset: Preset, device: torch.device) -> dict[str, float]:
    """One bf16 cross-entropy step at the batch computed for this GPU's memory: the peak it allocated."""
    from ..config import Config
    from ..training.objectives import CrossEntropy
    from .training import decoder_model

    total = torch.cuda.get_device_properties(device).total_memory
    n = m.batch_images(total, LONG_CAPTION_TOKENS)
    model = decoder_model(preset, False).to(device).train()
    batch = make_batches(preset, 1, n, True, 5)[0].to(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = CrossEntropy(Config())(model, batch).total
    loss.backward()
    return {"this_gpu_GiB": round(total / 2**30, 1), "computed_batch_images": n,
            "measured_peak_GiB_at_it": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)}
