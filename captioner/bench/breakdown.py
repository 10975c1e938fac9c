"""Where one photo's time goes at the model file's stored settings (what a user waiting on a photo gets):
read + preprocess (file -> (3, S, S) tensor), encoder, decoding (the photo's evidence and beam search: the
product's decode_photos), concepts (the heads' reading, Caption assembly with concepts, contradicted words and
concept maps: the product's dress), caption() and explain() end to end, and explain() of a 12-word
sentence, on real JPEG files (default: the bundled example photos; `--photos DIR` for others, e.g. unseen
COCO photos). Medians over the runs, cycling through the photos; each photo is timed end to end too.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .timing import Counts, Timer

EXAMPLES = Path(__file__).resolve().parents[1] / "assets" / "examples"


def photo_files(folder: str | None) -> list[Path]:
    """The JPEG files of `folder` (sorted), or the bundled example photos when None."""
    root = Path(folder) if folder else EXAMPLES
    photos = sorted(p for p in root.glob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
    if not photos:
        raise ValueError(f"no .jpg/.jpeg photos in {root}; pass a folder of JPEG photos with --photos")
    return photos


def caption_stages(loaded, feats: torch.Tensor, settings) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """The product's caption path after the encoder (captions_from_features: decode, then dress), in two
    timed halves: the first (no argument) -> captions.Decoded (hypotheses, evidence, objects check): the photo's evidence built once (person
    floor included) and decoding.decode; the second, `concepts(decoded)` -> the Captions: the heads' reading
    (read once per photo in the product: Captioner.read), to_caption and annotated's concepts, contradicted
    words and maps."""
    from ..decoding.captions import decode_photos, dress
    from ..decoding.reading import read_heads

    reading = read_heads(loaded.model, feats)  # the heads' one run for this photo

    def concepts(decoded):
        return dress(decoded, read_heads(loaded.model, feats), feats, loaded.model, loaded.vocab, settings,
                     loaded.resources.fitted)

    return (lambda: decode_photos(loaded.model, feats, reading, loaded.vocab, settings, loaded.resources)), concepts


@torch.no_grad()
def bench_breakdown(loaded, photos: list[Path], counts: Counts, device: torch.device, sentence: str,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """Per-photo stage times (ms, medians) at the stored settings, and the two ratios the latency work
    aims at: caption / (preprocess + encoder) and explain / (preprocess + encoder)."""
    timer, settings = Timer(device), loaded.decode_settings()
    runs = max(counts.latency_runs, 1)
    log(f"latency breakdown: {runs} runs over {len(photos)} photos at the stored settings (beam {settings.beam_size})")
    t: dict[str, list[float]] = {k: [] for k in ("read_preprocess", "encoder", "decoding", "concepts", "caption",
                                                 "explain_decoder", "explain")}
    for i in range(runs + 2):  # the first two warm up
        photo = photos[i % len(photos)]
        pre, x = timer.run(loaded.preprocess, photo)
        enc, feats = timer.run(loaded.encode, x.unsqueeze(0))
        decoding, concepts = caption_stages(loaded, feats, settings)
        dec, decoded = timer.run(decoding)
        read = loaded.read(photo)  # the photo read once: explaining it again runs only the decoder
        times = {"read_preprocess": pre, "encoder": enc, "decoding": dec, "concepts": timer(concepts, decoded),
                 "caption": timer(loaded.caption, photo),
                 "explain_decoder": timer(read.explain, sentence),
                 "explain": timer(loaded.explain, photo, sentence)}
        if i >= 2:
            for k, v in times.items():
                t[k].append(v)
    out: dict[str, Any] = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in t.items()}
    front = out["read_preprocess_ms"] + out["encoder_ms"]
    out["caption_over_preprocess_encoder"] = out["caption_ms"] / front
    out["explain_over_preprocess_encoder"] = out["explain_ms"] / front
    out.update(runs=runs, photos=len(photos), photo_folder=str(photos[0].parent), beam=settings.beam_size,
               words=len(sentence.split()), torch_threads=torch.get_num_threads())
    return out
