"""Study (issue: a caption at the encoder's pace on any CPU): which of the int8 precision's six layers
(model/int8_rows.py) costs the CIDEr, each as a plain Int8Linear, and last the library's own form (quantize: L_o as
Int8Logits, each row's largest logits again in float32). The bundled model's captions of Flickr8k val (1,000 photos, read once, stored
settings, batches of 16) with int8 products in each subset of layers, against float32; CIDEr by pycocoevalcap on
Python tokens. Run from the repository root: .venv/bin/python docs/studies/int8_layers.py (about five minutes)."""
import csv
from pathlib import Path

import torch
from pycocoevalcap.cider.cider import Cider

import captioner
from captioner.decoding.photo import caption_photos
from captioner.model import int8_rows
from captioner.model.int8_rows import STEP_LAYERS, Int8Linear, quantize, swap
from captioner.model.packed_linear import Linear

DATA = Path("../shared/data/flickr8k")
SUBSETS = {"float32": (), "all six": STEP_LAYERS, "all but L_o": tuple(n for n in STEP_LAYERS if n != "out_vocab"),
           "L_o only": ("out_vocab",), "all but W_z": tuple(n for n in STEP_LAYERS if n != "gates_context"),
           "all six, L_o's top logits in float32 (the library's)": None}


def norm(s: str) -> str:
    return " ".join(s.lower().replace(".", " ").replace(",", " ").split())


def use(decoder, layers) -> None:
    """The step layers in `layers` as Int8Linear, the others as Linear."""
    for name in STEP_LAYERS:
        swap(decoder, name, Int8Linear if name in layers else Linear)


def main() -> None:
    torch.set_num_threads(2)
    refs: dict = {}
    for r in csv.DictReader(open(DATA / "captions.txt")):
        refs.setdefault(r["image"], []).append(norm(r["caption"]))
    names = [line.strip() for line in open(DATA / "Flickr_8k.devImages.txt") if line.strip()]
    m = captioner.load()
    photos = [p for k in range(0, len(names), 50) for p in m.read_batch([DATA / "Images" / n for n in names[k:k + 50]])]
    base = None
    for label, layers in SUBSETS.items():
        use(m.model.decoder, () if layers is None else layers)
        if layers is None:
            quantize(m.model.decoder)  # from float32 Linear layers: L_o as Int8Logits
        caps = {n: c.text for k in range(0, len(photos), 16)
                for n, c in zip(names[k:k + 16], caption_photos(m, photos[k:k + 16]))}
        score, _ = Cider().compute_score({n: refs[n] for n in names}, {n: [caps[n]] for n in names})
        base = base or caps
        print(f"{label}: Flickr8k val CIDEr {score:.4f}, captions changed {sum(caps[n] != base[n] for n in names)}")


if __name__ == "__main__":
    assert int8_rows.available(), "this torch has no int8 product on a CPU"
    main()
