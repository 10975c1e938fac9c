"""Study (issue: a caption at the encoder's pace on any CPU), a first look: the decoder step's large products (W_h,
W_hh, L_h, L_z, L_o, W_z) as torch's dynamic int8 linear (fbgemm: weights per output channel, activations per
tensor, quantized at each call) in place of the packed float32 product. 1 thread. Prints caption() ms of a read
photo (interleaved), CIDEr (pycocoevalcap, Python tokens) and captions changed on coco-paired val, Flickr8k val and
coco-mini, and whether a photo's caption depends on the photos batched with it. Run from the repository root:
.venv/bin/python docs/studies/int8_step.py (about ten minutes)."""
import csv
import json
import statistics
import time
import warnings
from pathlib import Path

import torch
from pycocoevalcap.cider.cider import Cider

import captioner
from captioner.decoding.photo import caption_photos
from captioner.model import packed_linear

torch.set_num_threads(1)
warnings.filterwarnings("ignore")  # torch's quantized tensors say they are deprecated: part of the finding
DATA = Path("../shared/data")
PLAIN = packed_linear.Linear.forward


def int8_forward(packs: dict):
    def forward(self, x, plain=False):
        p = packs.get(id(self))
        if p is None or torch.is_grad_enabled() or plain:
            return PLAIN(self, x, plain)
        return torch.ops.quantized.linear_dynamic(x.reshape(-1, x.shape[-1]).contiguous(), p).view(*x.shape[:-1], -1)
    return forward


def packed_int8(decoder) -> dict:
    out = {}
    for layer in (decoder.attention.hidden_proj, decoder.gates_hidden, decoder.out_hidden, decoder.out_context,
                  decoder.out_vocab, decoder.gates_context):
        w = layer.weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12).double()
        q = torch.quantize_per_channel(w, scale, torch.zeros(len(w), dtype=torch.long), 0, torch.qint8)
        out[id(layer)] = torch.ops.quantized.linear_prepack(q, None if layer.bias is None else layer.bias.detach().float())
    return out


def norm(s: str) -> str:
    return " ".join(s.lower().replace(".", " ").replace(",", " ").split())


def references() -> dict:
    sets = {}
    for name, d in (("coco-paired val", "coco-paired/captions.json"), ("coco-mini", "coco-mini/annotations/captions_train2017.json")):
        coco = json.load(open(DATA / d))
        fid = {im["id"]: im["file_name"] for im in coco["images"]}
        refs: dict = {}
        for a in coco["annotations"]:
            refs.setdefault(fid[a["image_id"]], []).append(norm(a["caption"]))
        sets[name] = refs
    sets["Flickr8k val"] = {}
    for r in csv.DictReader(open(DATA / "flickr8k/captions.txt")):
        sets["Flickr8k val"].setdefault(r["image"], []).append(norm(r["caption"]))
    return sets


def main() -> None:
    m = captioner.load(dtype="float32")
    compare(m, int8_forward(packed_int8(m.model.decoder)))


def compare(m, fast) -> None:
    """float32 against the int8 forward `fast` of the step's layers: time, CIDEr, captions changed, batch coupling
    (docs/studies/int8_rows.py calls it with its own forward)."""
    refs = references()
    photos = {"coco-paired val": (DATA / "coco-paired/images", [l.strip() for l in open(DATA / "coco-paired/split_val.txt")]),
              "Flickr8k val": (DATA / "flickr8k/Images", [l.strip() for l in open(DATA / "flickr8k/Flickr_8k.devImages.txt") if l.strip()]),
              "coco-mini": (DATA / "coco-mini/train2017", sorted(refs["coco-mini"]))}
    read = [m.read(photos["coco-paired val"][0] / n) for n in photos["coco-paired val"][1][:24]]
    times: dict = {"float32": [], "int8": []}
    for r in range(2):
        for p in read:
            for mode in (("float32", "int8") if r % 2 == 0 else ("int8", "float32")):
                packed_linear.Linear.forward = fast if mode == "int8" else PLAIN
                t = time.perf_counter()
                p.caption()
                times[mode].append(time.perf_counter() - t)
    print(" ".join(f"{k} {1000 * statistics.median(v):.1f} ms" for k, v in times.items()), "(caption() of a read photo, p50)")
    for name, (folder, names) in photos.items():
        texts = {}
        for mode in ("float32", "int8"):
            packed_linear.Linear.forward = fast if mode == "int8" else PLAIN
            texts[mode] = {n: c.text for i in range(0, len(names), 16)
                           for n, c in zip(names[i:i + 16], m.caption_batch([folder / n for n in names[i:i + 16]]))}
            score, _ = Cider().compute_score({n: refs[name][n] for n in names}, {n: [texts[mode][n]] for n in names})
            print(f"{name}: {mode} CIDEr {score:.4f}")
        print(f"{name}: captions changed {sum(texts['float32'][n] != texts['int8'][n] for n in names)} of {len(names)}")
    for mode in ("float32", "int8"):
        packed_linear.Linear.forward = fast if mode == "int8" else PLAIN
        alone = [p.caption().text for p in read[:16]]
        together = [c.text for c in caption_photos(m, read[:16])]
        print(f"{mode}: alone vs in a batch of 16, {sum(a != b for a, b in zip(alone, together))} of 16 differ")
    packed_linear.Linear.forward = PLAIN


if __name__ == "__main__":
    main()
