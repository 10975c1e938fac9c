"""A full disk is an error with a way out: every writer of big files (checkpoints, feature and
activation caches, exported models) checks the free space before it starts and turns a "No space
left on device" half-way through into a DiskFullError that names the file, the space it needs and
what to do. Writers write to a temporary name and rename, so the previous file stays valid.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left; disk quota exceeded
MARGIN = 1 << 20  # keep 1 MiB spare: metadata, the log line after the write


def mib(n: int | float | None) -> str:
    return "an unknown amount" if n is None else f"{n / 2**20:,.1f} MiB"


class DiskFullError(OSError):
    """Not enough space to write `path`; the message says how much is needed, how much is free and
    what to do. An OSError with errno ENOSPC, so code that already handles OSError still does."""

    def __init__(self, path: str | Path, needed: int | None, free: int | None, then: str = ""):
        self.path, self.needed, self.free = Path(path), needed, free
        self.message = (f"not enough disk space to write {path}: it needs about {mib(needed)}, "
                        f"{mib(free)} free on that file system. Free some space (or choose another folder) "
                        f"and rerun the same command{then or '.'}")
        super().__init__(errno.ENOSPC, self.message)

    def __str__(self) -> str:
        return self.message


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the file system that holds `path` (or its nearest existing parent); None if unknown."""
    p = Path(path).absolute()
    for folder in (p, *p.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def check_space(path: str | Path, needed: int, then: str = "") -> None:
    """Raise DiskFullError before writing `needed` bytes to `path` when the disk cannot hold them."""
    free = free_bytes(path)
    if free is not None and free < needed + MARGIN:
        raise DiskFullError(path, needed, free, then)


@contextmanager
def writing(path: str | Path, needed: int, then: str = "") -> Iterator[None]:
    """Check the space for `needed` bytes, then run the block; a disk that fills up during it
    (ENOSPC/EDQUOT from any write inside) becomes a DiskFullError naming `path`."""
    check_space(path, needed, then)
    try:
        yield
    except DiskFullError:
        raise
    except OSError as e:
        if e.errno not in FULL:
            raise
        raise DiskFullError(path, needed, free_bytes(path), then) from e


def reserve(path: str | Path, size: int) -> None:
    """Allocate `size` bytes of the file at `path` now, so a memory-mapped write into it can never meet
    a full disk half-way (which would kill the process with SIGBUS instead of raising an error)."""
    if not hasattr(os, "posix_fallocate"):
        return
    with open(path, "r+b") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, size)
        except OSError as e:
            if e.errno in FULL:
                raise
            # the file system cannot preallocate (EOPNOTSUPP, EINVAL): the free-space check must do


CACHE_TEMP = re.compile(r".*\.tmp(?P<pid>\d+)(\.f32)?\.npy$")  # a cache being written: NAME.tmpPID[.f32].npy


def remove_stale_temps(folder: str | Path, pattern: re.Pattern) -> list[Path]:
    """Delete the temporary files of writers that were killed mid-write (kill -9 leaves them: no handler runs)
    in `folder`: names matching `pattern` whose `pid` group names a process that no longer runs. A live
    writer's file, this process's, and a name without a pid are left alone. Returns what was removed."""
    try:
        candidates = [(p, m) for p in Path(folder).iterdir() if (m := pattern.fullmatch(p.name))]
    except OSError:
        return []
    removed = []
    for p, m in candidates:
        pid = int(m.group("pid"))
        if pid == os.getpid() or _running(pid):
            continue
        try:
            p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # someone else's process, or unknown: not ours to delete
    return True
