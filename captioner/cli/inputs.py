"""Which photos captioner-caption reads and where its figures go: the image files of its arguments (a FOLDER
stands for its images, every format the parser reads: images.FORMATS, sorted by path; --recursive adds its
subfolders, never a figure folder), the figure and animation path of each, and the photos read ahead of the model
by a thread pool (read_ahead: decoded and resized in parallel, PIL releasing the GIL, two batches ahead, handed
over in the library's order)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

AHEAD = 2  # batches read ahead of the one the model works on
FIGURE_MARK = ".captioner-figures"  # written into an --attention-dir: folder searches never read it as input


def image_extensions() -> tuple[str, ...]:
    """".jpg", ".tif", ".ppm" ...: every format the image parser reads here (images.FORMATS, one list
    for the parser, the uploader and folder captioning)."""
    from captioner.images import file_extensions

    return tuple(f".{ext.lower()}" for ext in file_extensions())


def _folder_images(folder: Path, recursive: bool, skip: set[Path]) -> tuple[list[Path], list[Path]]:
    """(the folder's image files, the figure folders skipped): a subfolder holding FIGURE_MARK, or one
    of `skip` (this run's --attention-dir), is output, never input."""
    exts = image_extensions()
    if not recursive:
        return [f for f in folder.iterdir() if f.is_file() and f.suffix.lower() in exts], []
    found, skipped = [], []
    for dirpath, dirnames, filenames in os.walk(folder):
        d = Path(dirpath)
        for name in list(dirnames):
            if (d / name / FIGURE_MARK).is_file() or (d / name).resolve() in skip:
                dirnames.remove(name)
                skipped.append(d / name)
        found += [d / n for n in filenames if Path(n).suffix.lower() in exts]
    return found, skipped


def find_images(inputs: list[str], recursive: bool = False, out_dir: str | None = None
                ) -> tuple[list[tuple[str, str]], list[Path]]:
    """([(path, name relative to its FOLDER argument; a file's own name)], skipped figure folders).
    Each folder's images are sorted by path; a folder argument that IS out_dir is an error (its figures
    would be read as photos by the next run)."""
    skip = {Path(out_dir).resolve()} if out_dir else set()
    out: list[tuple[str, str]] = []
    skipped: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            if p.resolve() in skip:
                raise ValueError(f"--attention-dir {out_dir} is the input folder {item}: its figures would be "
                                 f"read as photos by the next run; choose another folder (e.g. {p / 'attention'})")
            files, gone = _folder_images(p, recursive, skip)
            out += sorted((str(f), str(f.relative_to(p))) for f in files)
            skipped += gone
        else:
            out.append((item, p.name))
    return out, skipped


def figure_paths(found: list[tuple[str, str]], out_dir: str, suffix: str = "_attention.png") -> dict[str, Path]:
    """image path -> its figure: out_dir/<relative folder>/<stem><suffix> (_attention.png; --animate:
    _caption.gif), subfolders mirrored. Images whose stems meet (x.jpg and x.png) keep their extension
    (x.jpg_attention.png); two different images that would still share a figure (same name given from two
    folders) are an error naming both."""
    def target(rel: str, full: bool) -> Path:
        r = Path(rel)
        return Path(out_dir) / r.parent / f"{r.name if full else r.stem}{suffix}"

    first = {}
    for path, rel in found:
        first.setdefault(target(rel, False), set()).add(os.path.realpath(path))
    out: dict[str, Path] = {}
    owner: dict[Path, str] = {}
    for path, rel in found:
        fig = target(rel, len(first[target(rel, False)]) > 1)
        if fig in owner and os.path.realpath(owner[fig]) != os.path.realpath(path):
            raise ValueError(f"{owner[fig]} and {path} would both write {fig}; caption them in separate runs or "
                             "give their folder instead (figures mirror the folder's subfolders)")
        owner[fig], out[path] = path, fig
    return out


def reader_threads() -> int:
    """Threads reading photos: one per CPU core this process may use (at least 2, at most 16)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(2, min(16, cores))


def read_ahead(paths: list[str], batch_size: int, read: Callable[[str], Any], threads: int | None = None,
               ahead: int = AHEAD) -> Iterator[list[tuple[str, Any]]]:
    """Batches of (path, read(path) or the ImageError it raised), in the order of `paths`: every photo of the next
    `ahead` batches is being read by the pool (each photo on its own, so a slow one holds up no other) while the
    caller works on this batch, and at most (ahead + 1) batches are held at a time."""
    from captioner.images import ImageError

    def one(path: str) -> tuple[str, Any]:
        try:
            return path, read(path)
        except ImageError as e:  # a bad file is reported, never raised, from a worker
            return path, e

    with ThreadPoolExecutor(threads or reader_threads()) as pool:
        starts = range(0, len(paths), batch_size)
        pending = [[pool.submit(one, p) for p in paths[k:k + batch_size]] for k in starts[:ahead]]
        for i, _ in enumerate(starts):
            if i + ahead < len(starts):  # keep `ahead` batches reading
                k = starts[i + ahead]
                pending.append([pool.submit(one, p) for p in paths[k:k + batch_size]])
            yield [f.result() for f in pending.pop(0)]


def unsearched_subfolders(folder: Path) -> list[str]:
    """The subfolders of a FOLDER argument (not figure folders) that a search without --recursive skips."""
    if not folder.is_dir():
        return []
    return sorted(d.name for d in folder.iterdir() if d.is_dir() and not (d / FIGURE_MARK).is_file())
