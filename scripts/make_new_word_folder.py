"""Build a "your own photos" folder that teaches the bundled model a word it does not know.

Flickr8k photos of horses, their captions saying "stallion" / "stallions" for "horse" / "horses" (words
the bundled vocabulary lacks), plus as many photos with no horse in them, in the README's layout
(Images/ + captions.txt, no split files: split by name). A second folder of held-out photos (Flickr8k
test split, never in the first) checks what the trained model says on photos it never saw.

    python scripts/make_new_word_folder.py myphotos --photos 30 --held-out heldout --held-out-photos 20
    python scripts/make_new_word_folder.py --check runs/own_photos/model.safetensors heldout   # what it says there
"""
from __future__ import annotations

import argparse
import csv
import random
import re
import shutil
from pathlib import Path

from captioner.data.flickr8k import load_flickr8k, read_captions
from captioner.vocab import tokenize

FLICKR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "flickr8k"
THING, NEW = ("horse", "horses"), {"horse": "stallion", "horses": "stallions"}
NOT_THING = {"horse", "horses", "pony", "ponies", "mule", "donkey", "rodeo", "carriage", "jockey", "cowboy",
             "stallion", "stallions", "racehorse", "bull", "cow", "cattle", "camel"}


def relabel(caption: str) -> str:
    """'A brown horse runs' -> 'A brown stallion runs' (word boundaries, case kept lower)."""
    return re.sub(r"\b(horses|horse)\b", lambda m: NEW[m.group(1).lower()], caption, flags=re.I)


def pick(caps: dict[str, list[str]], names: list[str], n: int, seed: int) -> tuple[list[str], list[str]]:
    """All photos whose captions mostly (3+ of them) say horse, and as many whose captions never name a
    horse-like thing, both in a seeded random order (the first n of each go into the folder)."""
    thing = sorted(k for k in names if sum(any(w in THING for w in tokenize(c)) for c in caps[k]) >= 3)
    other = sorted(k for k in names if not any(w in NOT_THING for c in caps[k] for w in tokenize(c)))
    rng = random.Random(seed)
    rng.shuffle(thing)
    rng.shuffle(other)
    return thing, other[:len(thing)]


def write_folder(out: Path, caps: dict[str, list[str]], thing: list[str], other: list[str], flickr: Path) -> None:
    (out / "Images").mkdir(parents=True, exist_ok=True)
    with open(out / "captions.txt", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["image", "caption"])
        for k in sorted(thing + other):
            shutil.copy(flickr / "Images" / k, out / "Images" / k)
            w.writerows([k, relabel(c)] for c in caps[k])


def build(out: Path, photos: int = 30, held_out: Path | None = None, held_out_photos: int = 20,
          flickr: Path = FLICKR, seed: int = 0) -> dict[str, list[str]]:
    """Write the folder(s) -> {"thing", "other", "held_out_thing", "held_out_other"}: the photo names (the
    held-out ones are other photos of the same kinds, never in the folder)."""
    caps = read_captions(flickr)
    names = [r.image_id for s in ("train", "val", "test") for r in load_flickr8k(flickr, s)]
    thing, other = pick(caps, names, photos, seed)
    if photos + held_out_photos * (held_out is not None) > len(thing):
        raise ValueError(f"Flickr8k has {len(thing)} photos of horses: ask for fewer")
    got = {"thing": sorted(thing[:photos]), "other": sorted(other[:photos]), "held_out_thing": [], "held_out_other": []}
    write_folder(out, caps, got["thing"], got["other"], flickr)
    if held_out is not None:
        got["held_out_thing"] = sorted(thing[photos:photos + held_out_photos])
        got["held_out_other"] = sorted(other[photos:photos + held_out_photos])
        write_folder(held_out, caps, got["held_out_thing"], got["held_out_other"], flickr)
    return got


def new_word_use(model_file: Path | str | None, folder: Path) -> dict[str, tuple[int, int]]:
    """A model file's captions (its stored settings) of a folder built here -> {"thing": (photos whose caption
    says a new word, photos), "other": (...)}; photos of the thing are those whose references say one."""
    import captioner

    caps, model = read_captions(folder), captioner.load(model_file)
    names = sorted(caps)
    said = [bool(set(c.words) & set(NEW.values())) for k in range(0, len(names), 8)
            for c in model.caption_batch([folder / "Images" / n for n in names[k:k + 8]])]
    thing = [any(w in NEW.values() for c in caps[n] for w in tokenize(c)) for n in names]
    return {"thing": (sum(s and t for s, t in zip(said, thing)), sum(thing)),
            "other": (sum(s and not t for s, t in zip(said, thing)), len(names) - sum(thing))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the folder to write (Images/ + captions.txt), or to check (--check)")
    p.add_argument("--check", metavar="MODEL", default=None,
                   help="write nothing: count the photos of folder OUT whose caption by MODEL says a new word")
    p.add_argument("--photos", type=int, default=30, help="photos of horses, and as many others (default 30)")
    p.add_argument("--held-out", type=Path, default=None, help="also write held-out photos (Flickr8k test) here")
    p.add_argument("--held-out-photos", type=int, default=20, help="held-out photos of each kind (default 20)")
    p.add_argument("--flickr", type=Path, default=FLICKR, help=f"the Flickr8k folder (default {FLICKR})")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.check:
        use = new_word_use(a.check, a.out)
        print(f"{a.check} on {a.out}: says {' or '.join(NEW.values())} on {use['thing'][0]} of {use['thing'][1]} "
              f"photos of horses and on {use['other'][0]} of {use['other'][1]} others")
        return 0
    names = build(a.out, a.photos, a.held_out, a.held_out_photos, a.flickr, a.seed)
    print(f"{a.out}: {len(names['thing'])} photos saying {', '.join(NEW.values())} + {len(names['other'])} others"
          + (f"; {a.held_out}: {len(names['held_out_thing'])} + {len(names['held_out_other'])} held out" if a.held_out else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
