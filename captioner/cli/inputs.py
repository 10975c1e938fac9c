"""Which photos captioner-caption reads and where its figures go: the image files of its arguments (a FOLDER
stands for its images, every format the parser reads: images.FORMATS, sorted by path; --recursive adds its
subfolders, never a figure folder), the figure and animation path of each, and the photos loaded by a small
thread pool, one batch ahead of the model."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

LOAD_THREADS = 2  # threads loading the next batch of photos
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


def _load(path: str) -> tuple[str, Any]:
    """(path, PIL image) or (path, ImageError): a bad file is reported, never raised, from a worker."""
    from captioner.images import ImageError, load_image

    try:
        return path, load_image(path)
    except ImageError as e:
        return path, e


def loaded_batches(paths: list[str], batch_size: int, threads: int = LOAD_THREADS) -> Iterator[list[tuple[str, Any]]]:
    """Batches of (path, image or ImageError), in order; the next batch loads while the caller
    works on this one, and at most two batches of images are held at a time."""
    with ThreadPoolExecutor(threads) as pool:
        pending = [pool.submit(_load, p) for p in paths[:batch_size]]
        for k in range(0, len(paths), batch_size):
            following = [pool.submit(_load, p) for p in paths[k + batch_size:k + 2 * batch_size]]
            yield [f.result() for f in pending]
            pending = following


def unsearched_subfolders(folder: Path) -> list[str]:
    """The subfolders of a FOLDER argument (not figure folders) that a search without --recursive skips."""
    if not folder.is_dir():
        return []
    return sorted(d.name for d in folder.iterdir() if d.is_dir() and not (d / FIGURE_MARK).is_file())
