"""Mixed precision in training (train.amp, train.cpu_amp): which autocast type a device gets, and fp16's GradScaler.

bf16 keeps float32's exponent range, so its gradients need no scaling; fp16 (GPUs without bf16: T4, V100)
underflows small gradients to zero unless the loss is scaled up before backward and the gradients down
before the step, which is the GradScaler's job (its scale is saved in last.safetensors' train state and
restored on resume, so a resumed run scales as an uninterrupted one does).
"""
from __future__ import annotations

import torch

from ..config import Config


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


def training_autocast(device: torch.device, cfg: Config):
    """The autocast context of amp_dtype (disabled where that is None)."""
    dtype = amp_dtype(device, cfg)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def grad_scaler(device: torch.device, cfg: Config, bf16: bool | None = None) -> torch.amp.GradScaler | None:
    """A GradScaler where training autocasts to fp16 (amp_dtype), else None: bf16 and float32 need none."""
    if amp_dtype(device, cfg, bf16) is not torch.float16:
        return None
    return torch.amp.GradScaler(device.type)


def describe(device: torch.device, cfg: Config) -> str:
    """The run's one line on its precision (build_run logs it once)."""
    dtype = amp_dtype(device, cfg)
    if dtype is None:
        return "float32" + (" (train.amp is off)" if device.type == "cuda" else "")
    if dtype is torch.float16:
        return "fp16 autocast with a GradScaler (this GPU has no bf16; train.amp=false trains in float32)"
    return f"bf16 autocast on {device.type}"
