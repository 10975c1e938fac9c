"""Which model files the app may offer: the operator names the folders on the server side (app.py reads
`.venv/bin/streamlit run app.py -- --checkpoints DIR ...` or CAPTIONER_CHECKPOINT_DIRS); a visitor only picks from
the menu. The search is bounded in depth, files and time, never follows a link out of an allowed folder,
and says when it stopped early."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

MAX_DEPTH, MAX_FILES, MAX_SECONDS = 4, 200, 2.0


@dataclass
class Found:
    files: list[Path] = field(default_factory=list)  # newest first
    stopped: str = ""  # why the search stopped early ("" when it saw everything)


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root)
        return True
    except (ValueError, OSError):
        return False


def find_model_files(folders: Sequence[str | Path], max_depth: int = MAX_DEPTH, max_files: int = MAX_FILES,
                     max_seconds: float = MAX_SECONDS) -> Found:
    """*.safetensors under the allowed folders (at most `max_depth` levels down, `max_files` files,
    `max_seconds`), each resolving inside the folder it was found in (a link out of it is skipped). A model's
    consensus memory (<model>.consensus.safetensors, beside the model it serves) is not a model: left out."""
    found, seen, start = Found(), set(), time.monotonic()
    for folder in folders:
        root = Path(folder).expanduser()
        if not root.is_dir():
            continue
        real_root = root.resolve()
        stack = [(root, 0)]
        while stack:
            if time.monotonic() - start > max_seconds:
                found.stopped = f"the search stopped after {max_seconds:g} s"
                return _sorted(found)
            here, depth = stack.pop()
            try:
                entries = list(os.scandir(here))
            except OSError:
                continue
            for e in entries:
                p = Path(e.path)
                if not _inside(p, real_root):
                    continue  # a link out of the allowed folder
                if e.is_dir() and depth < max_depth:
                    stack.append((p, depth + 1))
                elif _model_name(e.name) and e.is_file() and p.resolve() not in seen:
                    seen.add(p.resolve())
                    found.files.append(p)
                    if len(found.files) >= max_files:
                        found.stopped = f"the search stopped at {max_files} model files"
                        return _sorted(found)
    return _sorted(found)


def _model_name(name: str) -> bool:
    """Whether a file name may be a model file: *.safetensors, but not a consensus memory (loaded with the
    model beside it, never picked on its own)."""
    from captioner.decoding.consensus import SUFFIX

    return name.endswith(".safetensors") and not name.endswith(SUFFIX)


def _sorted(found: Found) -> Found:
    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return 0.0
    found.files.sort(key=mtime, reverse=True)
    return found


def operator_folders(argv: Sequence[str], env_value: str | None, default: Sequence[str] = ("runs",)) -> list[str]:
    """The folders the operator allows: `--checkpoints DIR [DIR ...]` in the app's own arguments (after `--`
    of `.venv/bin/streamlit run app.py`), else CAPTIONER_CHECKPOINT_DIRS (os.pathsep-separated), else `default`."""
    args = list(argv)
    if "--checkpoints" in args:
        out = []
        for a in args[args.index("--checkpoints") + 1:]:
            if a.startswith("--"):
                break
            out.append(a)
        return out
    if env_value:
        return [p for p in env_value.split(os.pathsep) if p]
    return list(default)


def exported(path: str | Path) -> bool:
    """Whether a model file was written by captioner-export (its metrics name the file it came from); reads
    only the file's header."""
    import json

    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return "exported_from" in json.loads((f.metadata() or {}).get("metrics", "{}"))
    except Exception:  # unreadable here: the menu still lists it and loading says what is wrong
        return False


def run_file_note(path: Path, files: Sequence[Path]) -> str | None:
    """What the menu says beside one of a training run's files, or None to leave it out of the menu. A run
    writes best.safetensors (chosen on val) and last.safetensors (the optimiser too, to resume); captioner-export
    writes the file to use and share. last is left out where best is beside it; best says whether it was exported."""
    here = [f for f in files if f.parent == path.parent]
    names = {f.name for f in here}
    if path.name == "last.safetensors":
        return None if "best.safetensors" in names else " (the run's last epoch, kept to resume training)"
    if path.name == "best.safetensors":
        done = any(exported(f) for f in here if f.name not in ("best.safetensors", "last.safetensors"))
        return (" (the run's best on val, before export: pick the exported file)" if done else
                " (the run's best on val, not exported: captioner-export makes the file to use and share)")
    return " (exported: the file to use and share)" if exported(path) else ""
