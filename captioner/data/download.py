"""Fetching COCO 2014 and the Karpathy split (scripts/download_coco.py is the command): the official URLs, each
downloaded to `<name>.part` and resumed from where it stopped (an HTTP Range request), checked against its MD5
where one is published, then unpacked into the layout configs/coco_resnet101.yaml reads:

    <dest>/train2014/  <dest>/val2014/  <dest>/annotations/captions_*2014.json  <dest>/dataset_coco.json
"""
from __future__ import annotations

import hashlib
import shutil
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

Log = Callable[[str], None]
CHUNK = 1 << 20  # bytes per read: 1 MiB


@dataclass(frozen=True)
class Download:
    url: str
    md5: str  # "" where none is published (the Karpathy split's zip)
    size: str  # for people: what the disk and the wait will be
    unpacks_to: str  # what in <dest> shows it is already unpacked
    members: tuple[str, ...] = ()  # only these files of the zip (empty: all of it)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[1]


COCO_2014 = (
    Download("http://images.cocodataset.org/zips/train2014.zip", "0da8c0bd3d6becc4dcb32757491aca88", "13 GB",
             "train2014"),
    Download("http://images.cocodataset.org/zips/val2014.zip", "a3d79f5ed8d289b7a7554ce06a5782b3", "6 GB", "val2014"),
    Download("http://images.cocodataset.org/annotations/annotations_trainval2014.zip",
             "0a379cfc70b0e71301e0f377548639bd", "241 MiB", "annotations"),
    # Karpathy's split (train 113,287 with restval, val 5,000, test 5,000), from the "Deep Visual-Semantic
    # Alignments" page; it holds the Flickr8k/30k splits too, of which only the COCO file is unpacked
    Download("https://cs.stanford.edu/people/karpathy/deepimagesent/caption_datasets.zip", "", "tens of MB",
             "dataset_coco.json", ("dataset_coco.json",)),
)


def plan(dest: Path) -> list[str]:
    """One line per file: what is fetched from where, its checksum, and what is already there."""
    lines = []
    for d in COCO_2014:
        check = f"md5 {d.md5}" if d.md5 else "no published checksum"
        lines.append(f"{d.url} -> {dest / d.name} ({d.size}, {check}; {_found(d, dest)})")
    return lines


def _found(d: Download, dest: Path) -> str:
    """What `dest` already holds of one download, in words that claim no more than the files show: a file at the
    final name is only a file of that size until its checksum is read (the real run reads it before unpacking)."""
    done, part = dest / d.name, dest / (d.name + ".part")
    if (dest / d.unpacks_to).exists():
        return f"{d.unpacks_to} is there: skipped"
    if done.is_file():
        mib = f"a {done.stat().st_size / 2**20:,.1f} MiB file is there"
        return (f"{mib}: its md5 is checked before it is unpacked (a wrong one is set aside and fetched again)"
                if d.md5 else f"{mib}: unpacked as it is (nothing to check it against)")
    if part.is_file():
        return f"{part.stat().st_size / 2**20:,.0f} MiB of it fetched into {part.name}: the download resumes there"
    return "to fetch"


def fetch_all(dest: Path, log: Log, keep_zips: bool = False) -> None:
    """Download, check and unpack every file not yet unpacked in `dest`; a rerun after an interruption resumes."""
    dest.mkdir(parents=True, exist_ok=True)
    for d in COCO_2014:
        if (dest / d.unpacks_to).exists():
            log(f"{d.unpacks_to}: already there")
            continue
        archive = fetch(d, dest, log)
        unpack(archive, dest, d.members, log)
        if not keep_zips:
            archive.unlink()


def fetch(d: Download, dest: Path, log: Log) -> Path:
    """<dest>/<name>, downloaded (resumed where a `.part` file is) and checked; a wrong checksum is a ValueError
    and the file is set aside as `.bad`, so the rerun fetches it afresh."""
    done, part = dest / d.name, dest / (d.name + ".part")
    if not done.is_file():
        start = part.stat().st_size if part.is_file() else 0
        request = urllib.request.Request(d.url, headers={"Range": f"bytes={start}-"} if start else {})
        with urllib.request.urlopen(request, timeout=60) as response:
            resumed = start and response.status == 206  # a server that ignores Range sends all of it again
            log(f"{d.name}: {'resuming at ' + format(start / 2**20, ',.0f') + ' MiB' if resumed else 'downloading'}"
                f" ({d.size})")
            with open(part, "ab" if resumed else "wb") as f:
                shutil.copyfileobj(response, f, CHUNK)
        part.replace(done)
    if d.md5:
        got = md5_of(done)
        if got != d.md5:
            done.replace(done.with_name(done.name + ".bad"))
            raise ValueError(f"{done}: md5 {got}, expected {d.md5} (set aside as {done.name}.bad; rerun to fetch it "
                             "again)")
        log(f"{d.name}: md5 ok")
    return done


def md5_of(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def unpack(archive: Path, dest: Path, members: tuple[str, ...], log: Log) -> None:
    """The zip's files (or only `members`, found by their base name) into `dest`, through a temporary folder
    renamed at the end: an interrupted unpack leaves no half folder that would look finished."""
    tmp = dest / f".unpacking-{archive.stem}"
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(archive) as z:
        names = [n for n in z.namelist() if not members or Path(n).name in members]
        log(f"{archive.name}: unpacking {len(names):,} files")
        for n in names:
            z.extract(n, tmp)
    for item in sorted(tmp.rglob("*") if members else tmp.iterdir()):
        if not members or item.name in members:
            item.replace(dest / item.name)
    shutil.rmtree(tmp, ignore_errors=True)
