"""Build a "your own photos" folder that teaches the bundled model a word it does not know.

Photos of a thing, their captions saying a new word (one the bundled vocabulary lacks) for the thing's word,
plus photos whose captions never name the thing or anything like it, in the README's layout (Images/ +
captions.txt, no split files: split by name). A second folder of held-out photos (of both kinds, never in the
first) checks what the trained model says on photos it never saw. The things (--word):

    horse    Flickr8k (all splits): "stallion" / "stallions" for "horse" / "horses"
    train    coco-paired's TRAIN split: "zoober" / "zoobers" for "train" / "trains" (docs/finetuning.md's example)
    giraffe  coco-paired's TRAIN split: "gombla" / "gomblas" for "giraffe" / "giraffes"
    cat      coco-paired's TRAIN split: "mrowl" / "mrowls" for "cat" / "cats" (ImageNet has five cat classes)

coco-paired's val split is never drawn from: it is where the exported file's CIDEr is checked.

    python scripts/make_new_word_folder.py myphotos --photos 30 --held-out heldout --held-out-photos 20
    python scripts/make_new_word_folder.py trains --word train --photos 26 --held-out trains_heldout --held-out-photos 8
    python scripts/make_new_word_folder.py --check runs/own_photos/model.safetensors heldout   # what it says there
    python scripts/make_new_word_folder.py --word train --unrelated runs/trains/model.safetensors   # everyday photos
    python scripts/make_new_word_folder.py --word train --cider-as-old evaluations/X.json   # CIDEr, zoober read as train
"""
from __future__ import annotations

import argparse
import csv
import json
import random
import re
import shutil
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from captioner.data.flickr8k import load_flickr8k, read_captions
from captioner.vocab import tokenize

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
FLICKR = DATA / "flickr8k"


@dataclass(frozen=True)
class Word:
    """What a folder teaches: the thing's words -> the new words; `near`: words that keep a photo out of the
    "others" (the thing, its kin, what comes with it); `mentions`: captions that must name the thing."""
    new: dict[str, str]
    near: frozenset[str]
    source: str  # "flickr8k" (every split) or "coco-paired" (its train split only)
    mentions: int


WORDS = {
    "horse": Word({"horse": "stallion", "horses": "stallions"}, frozenset(
        "horse horses pony ponies mule donkey rodeo carriage jockey cowboy stallion stallions racehorse bull cow "
        "cattle camel".split()), "flickr8k", 3),
    "train": Word({"train": "zoober", "trains": "zoobers"}, frozenset(
        "train trains tram trams trolley trolleys locomotive locomotives railway railroad railways subway rail "
        "rails track tracks station caboose engine engines freight passenger platform".split()), "coco-paired", 2),
    "giraffe": Word({"giraffe": "gombla", "giraffes": "gomblas"}, frozenset(
        "giraffe giraffes".split()), "coco-paired", 2),
    "cat": Word({"cat": "mrowl", "cats": "mrowls"}, frozenset(
        "cat cats kitten kittens kitty kitties tabby feline felines".split()), "coco-paired", 2),
}
NEW = WORDS["horse"].new  # the default folder's words


def relabel(caption: str, word: Word = WORDS["horse"]) -> str:
    """'A brown horse runs' -> 'A brown stallion runs' (word boundaries, case kept lower)."""
    alts = "|".join(sorted(word.new, key=len, reverse=True))  # plural first
    return re.sub(rf"\b({alts})\b", lambda m: word.new[m.group(1).lower()], caption, flags=re.I)


def read_source(word: Word, data: Path = DATA) -> tuple[dict[str, list[str]], list[str], Path]:
    """-> (captions by photo name, the names that may be drawn, the folder that holds the photos)."""
    if word.source == "flickr8k":
        flickr = data / "flickr8k"
        names = [r.image_id for s in ("train", "val", "test") for r in load_flickr8k(flickr, s)]
        return read_captions(flickr), names, flickr / "Images"
    root = data / "coco-paired"
    coco = json.loads((root / "captions.json").read_text(encoding="utf-8"))
    file_of, caps = {i["id"]: i["file_name"] for i in coco["images"]}, defaultdict(list)
    for a in coco["annotations"]:
        caps[file_of[a["image_id"]]].append(a["caption"].strip())
    names = [n.strip() for n in (root / "split_train.txt").read_text().splitlines() if n.strip()]
    return dict(caps), names, root / "images"


def names_thing(captions: list[str], words) -> int:
    """How many of the captions name one of `words`."""
    return sum(any(w in words for w in tokenize(c)) for c in captions)


def pick(caps: dict[str, list[str]], names: list[str], seed: int,
         word: Word = WORDS["horse"]) -> tuple[list[str], list[str]]:
    """All photos whose captions mostly (`word.mentions` of them) name the thing, and all whose captions name
    nothing near it, both in a seeded random order (the first ones go into the folder, the next are held out)."""
    thing = sorted(k for k in names if names_thing(caps[k], word.new) >= word.mentions)
    other = sorted(k for k in names if not names_thing(caps[k], word.near | set(word.new.values())))
    rng = random.Random(seed)
    rng.shuffle(thing)
    rng.shuffle(other)
    return thing, other


def write_folder(out: Path, caps: dict[str, list[str]], thing: list[str], other: list[str], images: Path,
                 word: Word = WORDS["horse"]) -> None:
    (out / "Images").mkdir(parents=True, exist_ok=True)
    with open(out / "captions.txt", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["image", "caption"])
        for k in sorted(thing + other):
            shutil.copy(images / k, out / "Images" / k)
            w.writerows([k, relabel(c, word)] for c in caps[k])


def build(out: Path, photos: int = 30, held_out: Path | None = None, held_out_photos: int = 20,
          flickr: Path = FLICKR, seed: int = 0, word: str = "horse", others: int | None = None) -> dict[str, list[str]]:
    """Write the folder(s) -> {"thing", "other", "held_out_thing", "held_out_other"}: the photo names (the
    held-out ones are other photos of the same kinds, never in the folder). `others`: photos without the thing
    in the folder (default: as many as of the thing)."""
    w = WORDS[word]
    caps, names, images = read_source(w, flickr.parent)
    thing, other = pick(caps, names, seed, w)
    others = photos if others is None else others
    want = held_out_photos * (held_out is not None)
    if photos + want > len(thing) or others + want > len(other):
        raise ValueError(f"{w.source} has {len(thing)} photos whose captions name a {word} ({w.mentions}+ of their "
                         f"captions) and {len(other)} others: ask for at most {len(thing) - want} + {len(other) - want}")
    got = {"thing": sorted(thing[:photos]), "other": sorted(other[:others]), "held_out_thing": [], "held_out_other": []}
    write_folder(out, caps, got["thing"], got["other"], images, w)
    if held_out is not None:
        got["held_out_thing"] = sorted(thing[photos:photos + held_out_photos])
        got["held_out_other"] = sorted(other[others:others + held_out_photos])
        write_folder(held_out, caps, got["held_out_thing"], got["held_out_other"], images, w)
    return got


def captions_of(model_file: Path | str | None, paths: list[Path]) -> list[list[str]]:
    """The model file's captions (its stored settings) of the photos, as words, 8 photos a batch."""
    import captioner

    model = captioner.load(model_file)
    return [c.words for k in range(0, len(paths), 8) for c in model.caption_batch(paths[k:k + 8])]


def new_word_use(model_file: Path | str | None, folder: Path, word: str | None = None) -> dict[str, tuple[int, int]]:
    """A model file's captions of a folder built here -> {"thing": (photos whose caption says a new word,
    photos), "other": (...)}; photos of the thing are those whose references say one. Without `word`, the
    thing whose new words the folder's captions use."""
    caps = read_captions(folder)
    names = sorted(caps)
    w = WORDS[word] if word else next(v for v in WORDS.values()
                                      if any(names_thing(caps[n], set(v.new.values())) for n in names))
    said = [bool(set(c) & set(w.new.values())) for c in captions_of(model_file, [folder / "Images" / n for n in names])]
    thing = [names_thing(caps[n], set(w.new.values())) > 0 for n in names]
    return {"thing": (sum(s and t for s, t in zip(said, thing)), sum(thing)),
            "other": (sum(s and not t for s, t in zip(said, thing)), len(names) - sum(thing))}


def folder_word(folder: Path) -> str | None:
    """The thing (a WORDS key) whose new words a folder's captions say most often; None when they say none (not a
    folder this script wrote)."""
    caps = read_captions(folder)
    counts = {k: sum(names_thing(c, set(w.new.values())) > 0 for c in caps.values()) for k, w in WORDS.items()}
    best = max(counts, key=counts.get)
    return best if counts[best] else None


def check_word(folder: Path, word: str | None) -> str:
    """The word to check a folder for: `word` when the folder's captions say its new words, else (without
    --word) the one they say; a ValueError, in one line, for a folder that says another thing's or none."""
    found = folder_word(folder)
    if found is None:
        said = ", ".join(n for w in WORDS.values() for n in w.new.values())
        raise ValueError(f"{folder}: its captions say none of the new words this script teaches ({said}): check "
                         "a folder it wrote (or its --held-out folder)")
    if word is not None and word != found:
        raise ValueError(f"{folder} teaches {' or '.join(WORDS[found].new.values())} for the {found}, not "
                         f"{' or '.join(WORDS[word].new.values())}: pass --word {found} or leave --word out")
    return found


def load_paired_val(data: Path = DATA) -> list:
    """coco-paired's val split as records (image_id: the COCO id, as captioner-evaluate names them)."""
    from captioner.data import load_coco
    from captioner.data.coco import read_split_file

    paired = data / "coco-paired"
    return load_coco(paired / "images", paired / "captions.json", only=read_split_file(paired / "split_val.txt"))


def everyday_photos(data: Path = DATA) -> list[tuple[Path, list[str]]]:
    """coco-paired's 200 val photos and coco-mini's 80, with their reference captions."""
    from captioner.data import load_coco

    mini = data / "coco-mini"
    recs = load_paired_val(data) + load_coco(mini / "train2017", mini / "annotations" / "captions_train2017.json")
    return [(r.path, r.captions) for r in recs]


def unrelated_use(model_file: Path | str | None, word: str, data: Path = DATA) -> dict[str, object]:
    """Everyday photos (everyday_photos) whose caption by the model file says a new word: {"unrelated": (k, n)}
    over the photos whose references name nothing near the thing, {"of_the_thing": (k, n)} over the rest, and
    "said": the unrelated photos' captions that say it."""
    w = WORDS[word]
    photos = everyday_photos(data)
    words = captions_of(model_file, [p for p, _ in photos])
    near = [names_thing(refs, w.near) > 0 for _, refs in photos]
    says = [bool(set(c) & set(w.new.values())) for c in words]
    wrong = [" ".join(c) for c, s, n in zip(words, says, near) if s and not n]
    return {"unrelated": (len(wrong), near.count(False)),
            "of_the_thing": (sum(s and n for s, n in zip(says, near)), near.count(True)), "said": wrong}


def cider_as_old(captions_json: Path, word: str, data: Path = DATA) -> tuple[float, float]:
    """captioner-evaluate's captions of coco-paired val (evaluations/*.json) -> (CIDEr as said, CIDEr with the
    new words read as the old ones): what renaming the thing costs against references that call it by its
    old name, apart from what the rest of the model lost."""
    from captioner.evaluation.metrics import score_captions

    back = {v: k for k, v in WORDS[word].new.items()}
    said = {c["image_id"]: c["caption"] for c in json.loads(Path(captions_json).read_text())["captions"]}
    refs = {str(i): caps for i, caps in ((r.image_id, r.captions) for r in load_paired_val(data))}
    old = {k: " ".join(back.get(t, t) for t in c.split()) for k, c in said.items()}
    return tuple(score_captions(p, refs, metrics=("CIDEr",), log=lambda _: None)["CIDEr"] for p in (said, old))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, nargs="?", help="the folder to write (Images/ + captions.txt), or to check (--check)")
    p.add_argument("--word", choices=sorted(WORDS), default=None, help="the thing to teach a new word for "
                   "(default horse; with --check: the one the folder's captions say)")
    p.add_argument("--check", metavar="MODEL", default=None,
                   help="write nothing: count the photos of folder OUT whose caption by MODEL says a new word")
    p.add_argument("--unrelated", metavar="MODEL", default=None,
                   help="write nothing: count coco-paired val's and coco-mini's photos whose caption by MODEL says it")
    p.add_argument("--cider-as-old", metavar="CAPTIONS", type=Path, default=None,
                   help="write nothing: coco-paired val CIDEr of captioner-evaluate's captions (evaluations/*.json) "
                        "as said and with the new words read as the old ones")
    p.add_argument("--photos", type=int, default=30, help="photos of the thing (default 30)")
    p.add_argument("--others", type=int, default=None, help="photos without it (default: as many)")
    p.add_argument("--held-out", type=Path, default=None, help="also write held-out photos here")
    p.add_argument("--held-out-photos", type=int, default=20, help="held-out photos of each kind (default 20)")
    p.add_argument("--flickr", type=Path, default=FLICKR, help=f"the Flickr8k folder (default {FLICKR}); "
                   "coco-paired and coco-mini are looked for beside it")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.check and a.out is not None:
        try:
            a.word = check_word(a.out, a.word)  # before the model loads: a folder of another thing is said at once
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    a.word = a.word or "horse"
    new = " or ".join(WORDS[a.word].new.values())
    if a.unrelated:
        use = unrelated_use(a.unrelated, a.word, a.flickr.parent)
        print(f"{a.unrelated}: says {new} on {use['unrelated'][0]} of {use['unrelated'][1]} everyday photos without "
              f"a {a.word}, and on {use['of_the_thing'][0]} of the {use['of_the_thing'][1]} with one")
        print("\n".join(f"  {c}" for c in use["said"]))
        return 0
    if a.cider_as_old:
        said, old = cider_as_old(a.cider_as_old, a.word, a.flickr.parent)
        print(f"{a.cider_as_old}: CIDEr {said:.3f} as said, {old:.3f} with {new} read as {' or '.join(WORDS[a.word].new)}")
        return 0
    if a.out is None:
        p.error("name the folder to write or check")
    if a.check:
        use = new_word_use(a.check, a.out, a.word)
        print(f"{a.check} on {a.out}: says {new} on {use['thing'][0]} of {use['thing'][1]} "
              f"photos of the {a.word} and on {use['other'][0]} of {use['other'][1]} others")
        return 0
    names = build(a.out, a.photos, a.held_out, a.held_out_photos, a.flickr, a.seed, a.word, a.others)
    print(f"{a.out}: {len(names['thing'])} photos saying {new} + {len(names['other'])} others"
          + (f"; {a.held_out}: {len(names['held_out_thing'])} + {len(names['held_out_other'])} held out" if a.held_out else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
