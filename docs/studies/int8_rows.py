"""Study (issue: a caption at the encoder's pace on any CPU), the second look: the decoder step's large products
(W_h, W_hh, L_h, L_z, L_o, W_z) as an int8 product per row (torch._int_mm: weights per output channel, each row of
activations quantized with its own scale, with --offset also its own offset; the sums in int32, so exact at any
thread count and in any batch) in place of the packed float32 product. 1 thread. Prints caption() ms of a read photo (interleaved), CIDEr
(pycocoevalcap, Python tokens) and captions changed on coco-paired val, Flickr8k val and coco-mini, and whether a
photo's caption depends on the photos batched with it. Run from the repository root:
.venv/bin/python docs/studies/int8_rows.py [--offset] (about ten minutes)."""
import csv
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from pycocoevalcap.cider.cider import Cider

import captioner
from captioner.decoding.photo import caption_photos
from captioner.model import packed_linear

torch.set_num_threads(1)
DATA = Path("../shared/data")
PLAIN = packed_linear.Linear.forward
ASYMMETRIC = "--offset" in sys.argv  # each row's 256 levels from its least to its largest value (else: scale only)


def int8_forward(packs: dict, asymmetric: bool):
    def forward(self, x, plain=False):
        p = packs.get(id(self))
        if p is None or torch.is_grad_enabled() or plain:
            return PLAIN(self, x, plain)
        w_t, w_scale, w_sum, bias = p  # (in, out) int8, (out,) float, (out,) the int8 weights' sums, (out,)
        rows = x.reshape(-1, x.shape[-1])  # (N, in)
        if not asymmetric:  # x = s q, q in [-127, 127]
            scale = rows.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127  # (N, 1): each row its own
            y = torch._int_mm(torch.round(rows / scale).to(torch.int8), w_t).float() * (scale * w_scale)  # (N, out)
        else:  # x = s (q + 128) + lo, q in [-128, 127]: all 256 levels between the row's least and largest
            lo = rows.amin(1, keepdim=True)  # (N, 1)
            scale = (rows.amax(1, keepdim=True) - lo).clamp_min(1e-12) / 255  # (N, 1)
            q = (torch.round((rows - lo) / scale) - 128).to(torch.int8)  # (N, in)
            acc = torch._int_mm(q, w_t) + 128 * w_sum  # (N, out) int32: sum_k (q + 128) w_q, exact
            y = (acc.float() * scale + lo * w_sum.float()) * w_scale  # (N, out)
        return (y if bias is None else y + bias).view(*x.shape[:-1], -1)
    return forward


def packed_int8(decoder) -> dict:
    out = {}
    for layer in (decoder.attention.hidden_proj, decoder.gates_hidden, decoder.out_hidden, decoder.out_context,
                  decoder.out_vocab, decoder.gates_context):
        w = layer.weight.detach().float()  # (out, in)
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12)  # (out,)
        q = torch.round(w / scale[:, None]).to(torch.int8)  # (out, in)
        out[id(layer)] = q.t(), scale, q.sum(1, dtype=torch.int32), None if layer.bias is None else layer.bias.detach().float()
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
    fast = int8_forward(packed_int8(m.model.decoder), ASYMMETRIC)
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
