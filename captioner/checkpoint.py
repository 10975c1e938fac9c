"""Checkpoints: safetensors tensors + JSON metadata (config, vocabulary, metrics, training state).

Loading never unpickles: safetensors only parses a JSON header and raw tensor bytes, so a file
crafted to run code cannot. Writes go to a temporary file that is renamed into place, so a crash
mid-write leaves the previous checkpoint intact.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .config import Config, DecodeConfig, migrate, split_fitted
from .diskspace import FULL, remove_stale_temps, writing
from .vocab import Vocab

FORMAT = "captioner-checkpoint/1"
_OPT = "optimizer."
DETECTORS = "detectors."  # tensors of the optional word-detector head (concepts/detectors.py), JSON under "detectors"


class CheckpointError(ValueError):
    """The file is not a usable captioner checkpoint; the message says what is wrong."""


@dataclass
class Checkpoint:
    config: Config
    vocab: Vocab
    model_state: dict[str, torch.Tensor]
    metrics: dict[str, Any] = field(default_factory=dict)
    train_state: dict[str, Any] | None = None  # epoch, step, best, history ... (resumable checkpoints)
    optimizer_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # the word-detector head (without the "detectors." prefix) and its description; empty / None in
    # files without detectors
    detector_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    detector_info: dict[str, Any] | None = None
    # what the model file fitted to its own captions (decoding/resources.py reads it: the choice's weights, the
    # confidence map and its threshold), JSON under "fitted"; {} where nothing was fitted
    fitted: dict[str, Any] = field(default_factory=dict)


def save_checkpoint(path: str | Path, config: Config, vocab: Vocab, model_state: dict[str, torch.Tensor],
                    metrics: dict[str, Any] | None = None, train_state: dict[str, Any] | None = None,
                    optimizer_tensors: dict[str, torch.Tensor] | None = None, half: bool = False,
                    detector_info: dict[str, Any] | None = None, then: str = "",
                    fitted: dict[str, Any] | None = None) -> None:
    """`model_state` may hold the word detectors' tensors ("detectors." keys, kept in float32) when
    `detector_info` describes them; the two come together or not at all. `fitted`: what the file fitted to its
    own captions (decoding/resources.py's JSON; always written, {} for none, so a file of this layout is never read
    as an older one). `then` ends the advice of a DiskFullError (what rerunning the command will do)."""
    if any(k.startswith(DETECTORS) for k in model_state) != (detector_info is not None):
        raise ValueError("word detectors need both their tensors ('detectors.' keys) and detector_info")
    _check_tensors_finite(model_state, f"refusing to save {path}")  # never replace a good checkpoint with a broken one
    # --half never rounds a frozen encoder: it keeps the exact pretrained weights, so the features the
    # decoder sees are the ones it was trained on and evaluation shares training's feature cache (whose
    # key includes the encoder's weights)
    frozen = not config.model.fine_tune_encoder
    tensors = {}
    for k, v in model_state.items():
        v = v.detach().cpu()
        if half and v.is_floating_point() and not (frozen and k.startswith("encoder.")) and not k.startswith(DETECTORS):
            v = v.half()
        tensors[k] = v.contiguous()
    for k, v in (optimizer_tensors or {}).items():
        tensors[_OPT + k] = v.detach().cpu().contiguous()
    meta = {"format": FORMAT, "config": json.dumps(config.to_dict()), "vocab": vocab.to_json(),
            "metrics": json.dumps(metrics or {}), "fitted": json.dumps(fitted or {})}
    if train_state is not None:
        meta["train_state"] = json.dumps(train_state)
    if detector_info is not None:
        meta["detectors"] = json.dumps(detector_info)
    write_safetensors(path, tensors, meta, then)


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                      then: str = "") -> None:
    """Atomically write CPU, contiguous tensors + string metadata (every model file of the project goes
    through here). Too little disk space is a DiskFullError naming the file
    and the space needed (`then` ends its advice); the previous file at `path` stays as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    needed = sum(t.numel() * t.element_size() for t in tensors.values()) + 64 * len(tensors) + \
        sum(len(k) + len(v) for k, v in metadata.items()) + 4096  # tensors + the JSON header
    try:
        with writing(path, needed, then):
            _write_file(tmp, tensors, metadata)
            os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never half
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk or an interrupt leaves no half-written file behind
        raise
    _fsync_dir(path.parent)  # make the rename itself durable


def _write_file(tmp: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(tmp), metadata=metadata)
    except Exception as e:  # safetensors reports I/O errors as SafetensorError("... (os error 28)")
        code = next((c for c in FULL if f"os error {c})" in str(e)), None)
        if code is None:
            raise
        raise OSError(code, str(e), str(tmp)) from e
    os.chmod(tmp, 0o644)  # safetensors writes 0600; a model file is meant to be shared and packaged
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())  # a full disk may only show here (delayed allocation)


def _check_tensors_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise CheckpointError(f"{what}: {len(bad)} tensor(s) contain NaN or inf (e.g. {', '.join(bad[:3])}); "
                              "a model with non-finite weights cannot caption")


def _remove_stale_temps(path: Path) -> None:
    """Temp files of writers that were killed mid-write (.NAME.tmpPID whose process is gone)."""
    remove_stale_temps(path.parent, re.compile(re.escape(f".{path.name}.tmp") + r"(?P<pid>\d+)"))


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".pkl", ".pickle", ".tar")


def read_safetensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors on the CPU, metadata) of a safetensors file. Never unpickles; a missing, truncated or
    non-safetensors file (e.g. a torch.save pickle) is a CheckpointError that says so."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory; pass the checkpoint file (e.g. {path / 'best.safetensors'})")
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"{path}: not a safetensors checkpoint, or a truncated one ({e}).{_not_safetensors_hint(path)}") from None
    return tensors, meta


def read_train_state(path: str | Path) -> dict[str, Any] | None:
    """The training state of a resumable checkpoint from its JSON header alone (no tensor is read: a COCO
    last.safetensors is most of a GB); None where the file is missing, unreadable or holds none."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            state = json.loads((f.metadata() or {}).get("train_state", "null"))
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError):
        return None
    return state if isinstance(state, dict) else None


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint written by save_checkpoint. Never unpickles; every problem is a CheckpointError."""
    tensors, meta = read_safetensors(path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: missing or unknown format tag {meta.get('format')!r}; expected {FORMAT} "
                              "(a file written by captioner's save_checkpoint / Captioner.save)")
    try:
        config_dict = json.loads(meta["config"])
        if not isinstance(config_dict, dict):
            raise ValueError(f"config must be a JSON object, got {type(config_dict).__name__}")
        config_dict = migrate(config_dict, f"{path} (config)")  # settings renamed or removed since it was written
        config_dict, fitted = _with_fitted(config_dict, meta)
        config = Config.from_dict(config_dict, source=f"{path} (config)")
        vocab = Vocab.from_json(meta["vocab"])
        metrics = json.loads(meta.get("metrics", "{}"))
        if not isinstance(metrics, dict):
            raise ValueError(f"metrics must be a JSON object, got {type(metrics).__name__}")
        train_state = json.loads(meta["train_state"]) if "train_state" in meta else None
        if train_state is not None and not isinstance(train_state, dict):
            raise ValueError(f"train_state must be a JSON object, got {type(train_state).__name__}")
        detector_info = json.loads(meta["detectors"]) if "detectors" in meta else None
        if detector_info is not None and not isinstance(detector_info, dict):
            raise ValueError(f"detectors must be a JSON object, got {type(detector_info).__name__}")
    except KeyError as e:
        raise CheckpointError(f"{path}: corrupt metadata (no {e.args[0]!r} entry)") from None
    except (json.JSONDecodeError, ValueError, TypeError, AttributeError) as e:
        other = ("; a setting this version does not know: if it was renamed or removed, config.RENAMED says how to "
                 "read it" if "unknown setting" in str(e) else "")
        raise CheckpointError(f"{path}: corrupt metadata ({e}){other}") from None
    detectors = {k[len(DETECTORS):]: v for k, v in tensors.items() if k.startswith(DETECTORS)}
    if bool(detectors) != (detector_info is not None):
        raise CheckpointError(f"{path}: word-detector tensors and their 'detectors' description must come together")
    model_state = _without_legacy_aliases(
        {k: v for k, v in tensors.items() if not k.startswith((_OPT, DETECTORS))}, path)
    optim = {k[len(_OPT):]: v for k, v in tensors.items() if k.startswith(_OPT)}
    for key in ("decoder.embedding.weight", "decoder.out_vocab.weight"):  # the vocabulary must fit the weights
        if key in model_state and model_state[key].ndim >= 1 and model_state[key].shape[0] != len(vocab):
            raise CheckpointError(
                f"{path}: shape mismatch: its vocabulary has {len(vocab)} words but {key} has "
                f"{model_state[key].shape[0]} rows {tuple(model_state[key].shape)}; the metadata and the weights "
                "come from different models")
    return Checkpoint(config, vocab, model_state, metrics, train_state, optim, detectors, detector_info, fitted)


def _with_fitted(config_dict: dict[str, Any], meta: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the stored config, the file's fitted data). A file written before the fitted data had a place of its own
    (no "fitted" entry) kept it among its decode settings: config.split_fitted moves it out, and the settings the
    file predates get the values it has always decoded with (DecodeConfig.UNSTORED), so it decodes as it did."""
    if "fitted" in meta:
        fitted = json.loads(meta["fitted"])
        if not isinstance(fitted, dict):
            raise ValueError(f"fitted must be a JSON object, got {type(fitted).__name__}")
        return config_dict, fitted
    decode = config_dict.get("decode", {})
    if not isinstance(decode, dict):
        return config_dict, {}
    decode, fitted = split_fitted(decode)
    return {**config_dict, "decode": {**DecodeConfig.UNSTORED, **decode}}, fitted


_LEGACY_ALIAS, _BACKBONE = "encoder._features.", "encoder.backbone."


def _without_legacy_aliases(state: dict[str, torch.Tensor], path: str | Path) -> dict[str, torch.Tensor]:
    """Before 0.1.0's fix a ResNet encoder registered its body twice (`backbone` and `_features`), so a
    file written around safetensors' shared-memory check would hold every encoder weight under both
    names. The second name is dropped when it repeats the first; anything else is refused."""
    aliases = [k for k in state if k.startswith(_LEGACY_ALIAS)]
    for k in aliases:
        twin = _BACKBONE + k[len(_LEGACY_ALIAS):]
        if twin in state and not torch.equal(state[twin], state[k]):
            raise CheckpointError(f"{path}: {k} and {twin} should be one tensor (an old ResNet file) but differ; "
                                  "the file was edited or is corrupt. Re-export it from its training checkpoint")
        state.setdefault(twin, state[k])
        del state[k]
    return state


def _not_safetensors_hint(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError:
        head = b""
    if len(head) >= 9 and head[8:9] == b"{":  # u64 header length + JSON header: a safetensors file, cut short
        return " The file looks like a safetensors checkpoint that was cut short or corrupted (an interrupted copy?)."
    what = " It looks like a pickle (torch.save) file." if (
        head[:2] == b"PK" or head[:1] == b"\x80" or path.suffix.lower() in _PICKLE_SUFFIXES) else ""
    return (what + " captioner only reads safetensors checkpoints and never unpickles files, because "
            "unpickling can run arbitrary code. Re-save the weights with safetensors "
            "(captioner.checkpoint.save_checkpoint or Captioner.save).")


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """load_state_dict with an error that names what does not match."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        parts = []
        if shapes:
            parts.append("shape mismatch: " + "; ".join(shapes[:5]))
        if missing:
            parts.append(f"{len(missing)} missing tensors (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensors (e.g. {', '.join(unexpected[:3])})")
        encoder = getattr(getattr(model, "encoder", None), "name", None)
        built = f" (built with encoder {encoder!r})" if isinstance(encoder, str) else ""
        raise CheckpointError(f"{source} does not fit the model its config describes{built}: " + "; ".join(parts)
                              + ". Was it made with other model settings (model.encoder, embed_dim, hidden_dim, "
                              "attention_dim, attention) or another vocabulary?")
    _check_tensors_finite(state, str(source))
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=True)


def optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Optimizer state -> flat tensors + JSON-able scalars (no pickling)."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{pid}.{k}"] = v
            else:
                scalars[f"{pid}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_tensors(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                           info: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    for key, v in info.get("scalars", {}).items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    optimizer.load_state_dict({"state": state, "param_groups": info["param_groups"]})
