"""Build a model file's consensus memory (captioner/decoding/consensus.py): the pooled features (int8) and captions
(word ids) of the training photos of a recipe's caption sets, written beside the model file, where captioner.load
finds it (<model>.consensus.safetensors). The bundled model's memory (Flickr8k train + coco-paired train):

    .venv/bin/captioner-build-consensus --config configs/mix_cpu.yaml --cache-dir cache

Only the recipe's TRAINING photos go in (never val or test: the rerank is chosen on val). Features come from the
model's own encoder through the feature caches training uses (built here when missing, the longest part of a
first run: one encoder pass per training photo). decode.consensus_k and the model file's fitted choice say how the
memory is used (decode.fitted_choice=false: not at all).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="model file (default: the bundled model)")
    p.add_argument("--config", default="configs/mix_cpu.yaml", help="recipe whose caption sets' train photos go in")
    p.add_argument("--cache-dir", default="cache", help="feature caches (reused when they match the encoder)")
    p.add_argument("--out", default=None, help="default: beside the model file, <model>.consensus.safetensors")
    p.add_argument("--device", default="cpu")
    return p


def main(argv: list[str] | None = None) -> int:
    import numpy as np
    import torch

    import captioner
    from captioner.config import load_config
    from captioner.data import build_mix
    from captioner.data.features import build_cache, encoder_fingerprint
    from captioner.decoding.consensus import ConsensusMemory, memory_path

    args = _parser().parse_args(argv)
    try:
        loaded = captioner.load(args.checkpoint, device=args.device)
        sources = build_mix(load_config(args.config).data, "train")
    except (ValueError, FileNotFoundError, captioner.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pooled, captions = [], []
    for src, records in sources:
        name = loaded.preprocess.cache_name(src.name, "train")  # training's cache of the set, when it has one
        cache = build_cache(args.cache_dir, name, loaded.model.encoder, loaded.preprocess, records, args.device)
        missing = set(cache.missing)
        keep = [i for i, r in enumerate(records) if r.image_id not in missing]
        for k in range(0, len(keep), 500):  # (n, P, D) float16 slices -> (n, D) means
            pooled.append(torch.from_numpy(np.asarray(cache.features[keep[k:k + 500]], dtype=np.float32).mean(1)))
        captions += [[loaded.vocab.encode(c)[1:-1] for c in records[i].captions] for i in keep]
        print(f"{src.name}: {len(keep)} training photos")
    memory = ConsensusMemory.build(torch.cat(pooled), captions, len(loaded.vocab), encoder_fingerprint(loaded.model.encoder))
    out = Path(args.out) if args.out else memory_path(args.checkpoint or captioner.DEFAULT_CHECKPOINT)
    memory.save(out)
    print(f"consensus memory of {len(memory)} photos, {len(memory.caption_ends)} captions -> {out} "
          f"({out.stat().st_size / 2 ** 20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
