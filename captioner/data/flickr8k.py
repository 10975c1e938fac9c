"""Flickr8k as users download it, and any folder of photos laid out the same way.

Either the Kaggle layout (`Images/` + `captions.txt`, a CSV `image,caption`) or the original release
(`Flicker8k_Dataset/` + `Flickr8k.token.txt`, lines `name.jpg#k<TAB>caption`), with the official split
files `Flickr_8k.{train,dev,test}Images.txt` (in the root or in a `Flickr8k_text/` subfolder). A folder of
one's own photos (README "Train on your own photos") may have no split files at all: its captioned photos
are then split by name, 80% train, 10% val, 10% test (by_name_split).
"""
from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

from .records import ImageRecord

SPLIT_FILES = {"train": "Flickr_8k.trainImages.txt", "val": "Flickr_8k.devImages.txt", "test": "Flickr_8k.testImages.txt"}


def _find(root: Path, names: list[str]) -> Path | None:
    for name in names:
        for base in (root, root / "Flickr8k_text"):
            if (base / name).exists():
                return base / name
    return None


def read_captions(root: Path) -> dict[str, list[str]]:
    caps: dict[str, list[str]] = defaultdict(list)
    csv_path = _find(root, ["captions.txt"])
    token_path = _find(root, ["Flickr8k.token.txt"])
    if csv_path is not None:
        with open(csv_path, newline="", encoding="utf-8-sig") as f:  # -sig: a spreadsheet's BOM
            reader = csv.reader(f)
            header = next((row for row in reader if any(cell.strip() for cell in row)), None)  # blank lines skipped
            if header is None:  # not "expected a header": the file has nothing at all
                raise ValueError(f"{csv_path}: the file is empty; write a header line 'image,caption' and then one "
                                 "line per caption, e.g. 'photo1.jpg,a dog runs on the grass'")
            if [h.strip().lower() for h in header[:2]] != ["image", "caption"]:
                raise ValueError(f"{csv_path}: expected a CSV with header 'image,caption', got {','.join(header)[:80]!r}")
            for row in reader:
                if len(row) >= 2:
                    caps[row[0].strip()].append(",".join(row[1:]).strip())
    elif token_path is not None:
        for line in token_path.read_text(encoding="utf-8-sig").splitlines():
            if "\t" in line:
                key, caption = line.split("\t", 1)
                caps[key.split("#")[0].strip()].append(caption.strip())
    elif not Path(root).is_dir():
        raise FileNotFoundError(f"{root}: no such folder. Set data.root to the folder that holds Images/ and "
                                "captions.txt: your own photos (README 'Train on your own photos') or Flickr8k")
    else:
        raise FileNotFoundError(
            f"{root}: no captions.txt found. A folder of photos holds Images/ and captions.txt, a CSV with the header "
            "'image,caption' and a line per caption (README 'Train on your own photos'; Flickr8k's Kaggle download "
            "is laid out so too, its original release has Flickr8k.token.txt instead)")
    return caps


def image_dir(root: Path) -> Path:
    for name in ("Images", "Flicker8k_Dataset", "Flickr8k_Dataset"):
        if (root / name).is_dir():
            return root / name
    raise FileNotFoundError(f"{root}: no Images/ or Flicker8k_Dataset/ folder with the photos")


def load_flickr8k(root: str | Path, split: str) -> list[ImageRecord]:
    """Records of one official split ('train', 'val' or 'test'), in the split file's order."""
    root = Path(root)
    if split not in SPLIT_FILES:
        raise ValueError(f"split must be one of {list(SPLIT_FILES)}, got '{split}'")
    split_path = _find(root, [SPLIT_FILES[split]])
    caps = read_captions(root)
    if split_path is None and any(_find(root, [f]) for f in SPLIT_FILES.values()):
        raise FileNotFoundError(f"{root}: split file {SPLIT_FILES[split]} not found (the other split files are there)")
    names = by_name_split(sorted(caps), split) if split_path is None else \
        [n.strip() for n in split_path.read_text(encoding="utf-8-sig").splitlines() if n.strip()]
    if not names:
        raise ValueError(f"{root}: the {split} split is empty: without split files every 10th photo by name goes to "
                         f"val and to test, so give at least 10 captioned photos (or write {SPLIT_FILES[split]})")
    images = image_dir(root)
    return [ImageRecord(n, images / n, caps[n]) for n in names if caps.get(n)]


def by_name_split(names: list[str], split: str) -> list[str]:
    """Sorted photo names -> one split without split files: of every 10 by name, the 6th is val, the 10th
    test, the other 8 train (deterministic; at least one photo in each split from 10 photos on)."""
    slot = {"val": {5}, "test": {9}, "train": {0, 1, 2, 3, 4, 6, 7, 8}}[split]
    return [n for i, n in enumerate(names) if i % 10 in slot]
