"""captioner-caption --output FILE.jsonl: a photo library's captions in one JSON-lines file that a rerun resumes.

Each photo's line(s) (the --json line, Caption.to_dict) are appended as soon as the photo is captioned, flushed,
under an exclusive lock on the file (fcntl.flock, where the system has it), so that an interrupted run loses at
most the photo it was writing. A rerun reads the images the file already names (the path as written in each
line) and captions only the others: an interrupted run resumes, a grown folder captions only its new photos.

Under `torchrun --nproc-per-node N` every process takes its own share of the photos (rank r: the r-th, (r+N)-th
... of the sorted list, taken before the file is read, so the shares never depend on what another process has
written yet) and appends to the same file under the lock: the file ends with each photo once, and no process
waits on another. A line left half-written by a killed process is cut off by the next writer.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, Sequence

CHUNK = 1 << 16  # bytes read at a time, from the end, when looking for a half-written last line


def torchrun_place(environ: dict[str, str]) -> tuple[int, int]:
    """(rank, world size) of this process under torchrun (its RANK and WORLD_SIZE), (0, 1) otherwise."""
    return int(environ.get("RANK", "0")), int(environ.get("WORLD_SIZE", "1"))


def share(paths: Sequence[str], rank: int, world: int) -> list[str]:
    """This process's photos: paths[rank::world] (the whole list for one process)."""
    return list(paths[rank::world])


def _lines(path: Path) -> Iterator[tuple[int, str, bool]]:
    """(line number, text, whether it ended with a newline) of each non-empty line of `path`."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                yield n, line, line.endswith("\n")


def written_images(path: str | Path) -> set[str]:
    """The images `path` already holds a line for (empty when there is no file yet). A line that is not a
    captioner-caption JSON line is a ValueError naming the file and the line (the file is someone else's), except
    a last line cut short without its newline (a process killed while writing it: that photo is captioned again)."""
    path = Path(path)
    if not path.exists():
        return set()
    if not path.is_file():
        raise ValueError(f"--output {path} is not a file: name a .jsonl file (made when missing)")
    done = set()
    for n, line, whole in _lines(path):
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict) and isinstance(rec.get("image"), str):
            done.add(rec["image"])
        elif whole:  # (a last line cut short by a killed writer is not: the next append cuts it off)
            raise ValueError(f"--output {path}: line {n} is not a captioner-caption JSON line; name a new file or "
                             "one an earlier --output run wrote")
    return done


def _cut_half_line(f) -> None:
    """Truncate an unfinished last line (a writer killed mid-line): the file then ends at a newline."""
    end = f.seek(0, os.SEEK_END)
    if end == 0:
        return
    f.seek(end - 1)
    if f.read(1) == b"\n":
        return
    pos = end
    while pos > 0:
        start = max(0, pos - CHUNK)
        f.seek(start)
        block = f.read(pos - start)
        cut = block.rfind(b"\n")
        if cut >= 0:
            f.truncate(start + cut + 1)
            return
        pos = start
    f.truncate(0)


def append_lines(path: str | Path, lines: Sequence[str]) -> None:
    """Append one photo's lines to `path` (made with its folder when missing) under an exclusive lock, flushed
    and synced, so that processes sharing the file never interleave and a rerun sees every finished photo."""
    try:
        import fcntl
    except ImportError:  # no flock on this system: one process at a time is still safe
        fcntl = None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:  # appends always go to the end, whoever wrote last
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            _cut_half_line(f)
            f.write("".join(line.rstrip("\n") + "\n" for line in lines).encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        finally:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_UN)
