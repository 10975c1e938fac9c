"""Export a trained checkpoint as a compact model file (optionally the package's bundled default).

    .venv/bin/captioner-export runs/flickr8k_cpu/best.safetensors captioner/assets/default.safetensors \
        --half --metrics test_scores.json --set decode.length_penalty=0.5

Keeps only the model tensors (no optimizer state), stores fp16 weights with --half (loaded back as
fp32; a frozen encoder keeps its exact fp32 weights, so features and feature caches match training), records the evaluation scores given with --metrics inside the file, and can change decode
settings (chosen on the validation split) so captioner.load() uses them by default. The file keeps what the
checkpoint fitted to its own captions (decoding/resources.py: the choice among the beam's captions, the confidence
map; a taught run: its starting model's); --fitted stores a captioner-fit-selector report's instead.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("output")
    p.add_argument("--average", nargs="+", action="extend", default=[], metavar="CKPT",
                   help="average the weights with these checkpoints of the same run (e.g. the last epochs)")
    p.add_argument("--half", action="store_true", help="store floating-point tensors as fp16")
    p.add_argument("--metrics", nargs="+", action="extend", default=[], help="JSON files (e.g. evaluate.py --output) to record")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="decode.KEY=VALUE", help="change decode settings")
    p.add_argument("--fitted", nargs="+", action="extend", default=[], metavar="REPORT",
                   help="store the fitted data of these captioner-fit-selector --output reports (its choice among "
                        "the beam's captions, its confidence map), each replacing the part it fitted")
    p.add_argument("--detectors-from", default=None, metavar="MODEL",
                   help="carry the word detectors of this model file (captioner-train-detectors) and its "
                        "decode.person_floor; its encoder must be this checkpoint's, weight for weight")
    return p


def main(argv: list[str] | None = None) -> int:
    from captioner.checkpoint import DETECTORS, CheckpointError, load_checkpoint, save_checkpoint
    from captioner.config import Config, set_value
    from captioner.diskspace import FULL
    from captioner.training.as_exported import exported_decode, taught_from

    args = _parser().parse_args(argv)
    try:
        ckpt = load_checkpoint(args.checkpoint)
        cfg = Config.from_dict(ckpt.config.to_dict())
        if start := taught_from(ckpt.config):  # a run that taught new words: its starting model's decode settings
            cfg.decode = exported_decode(ckpt.config)
        for item in args.set:
            key, _, value = item.partition("=")
            if not key.startswith("decode."):
                raise ValueError(f"only decode.* settings can change at export, got '{key}'")
            set_value(cfg, key, value, "--set")
        state = ckpt.model_state
        if args.average:
            others = [load_checkpoint(path) for path in args.average]
            for other in others:
                if other.vocab.itos != ckpt.vocab.itos or other.config.model != ckpt.config.model:
                    raise ValueError("cannot average checkpoints with another vocabulary or model config")
            # weights of nearby checkpoints of one run; batch-norm counters are integers and stay as they are
            state = {k: (sum(o.model_state[k].double() for o in others) + v.double()).div(len(others) + 1).to(v.dtype)
                     if v.is_floating_point() else v for k, v in state.items()}
        metrics = exported_metrics(ckpt, args)
        fitted = exported_fitted(ckpt, args, start)
        if args.detectors_from:
            ckpt = with_detectors_of(ckpt, cfg, load_checkpoint(args.detectors_from), args.detectors_from)
    except (CheckpointError, ValueError, KeyError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if ckpt.detector_info is not None:  # the word detectors travel with the model (never averaged, never halved)
        state = {**state, **{DETECTORS + k: v for k, v in ckpt.detector_tensors.items()}}
    try:
        save_checkpoint(args.output, cfg, ckpt.vocab, state, metrics=metrics, half=args.half,
                        detector_info=ckpt.detector_info, then=": any file already at the output is left as it was.",
                        fitted=fitted)
    except OSError as e:  # a full disk: DiskFullError names the file and the space it needs
        if e.errno not in FULL:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = Path(args.output).stat().st_size / 2**20
    print(f"wrote {args.output} ({size:.1f} MiB; {stored_dtypes(args.output)}), metrics: {sorted(metrics)}")
    for line in taught_lines(args, ckpt, start):
        print(line)
    return 0


def taught_lines(args: argparse.Namespace, ckpt, start: Path | None) -> list[str]:
    """What the export of a taught model (train.extend_vocab from train.init_from) says about its decode settings
    and consensus memory (written here: taught_memory); nothing for any other checkpoint."""
    if start is not None:
        return [f"decode settings: the starting model's ({start}){', then --set' if args.set else ''}, so that "
                "photos without your new words are captioned as it captions them", taught_memory(args.output, ckpt, start)]
    if ckpt.config.train.extend_vocab and ckpt.config.train.init_from:
        return [f"note: the model it was taught from ({ckpt.config.train.init_from}) is not here (run the export from "
                "the folder training ran in): the file keeps the run's decode settings and gets no consensus memory, "
                "so photos without the new words may be captioned unlike the starting model captions them"]
    return []


def exported_metrics(ckpt, args: argparse.Namespace) -> dict:
    """The metrics the exported file records: the checkpoint's, where it came from (the app's menu names the
    file to pick), what it was averaged with, and each --metrics file's scores."""
    metrics = {**ckpt.metrics, "exported_from": str(args.checkpoint)}
    if args.average:
        metrics["averaged_with"] = [str(a) for a in args.average]
    for path in args.metrics:
        data = read_metrics(path)
        name = f"{data.get('dataset', 'eval')}_{data.get('split', '')}_beam{data.get('beam_size', '')}"
        metrics[name] = {"scores": data["scores"], "beam_size": data.get("beam_size"),
                         "length_penalty": data.get("length_penalty")}
    return metrics


def exported_fitted(ckpt, args: argparse.Namespace, start: Path | None) -> dict:
    """What the exported file stores as its fitted data (decoding/resources.py): the checkpoint's own (a taught run's:
    its starting model's, as its decode settings), each part a --fitted report fitted replaced by the report's.
    ValueError naming a report that holds none or an unusable one."""
    from captioner.checkpoint import load_checkpoint
    from captioner.decoding.resources import Fitted

    source = start if start is not None else args.checkpoint
    out = Fitted.from_json(load_checkpoint(start).fitted if start is not None else ckpt.fitted, str(source))
    for path in args.fitted:
        data = read_report(path, "fitted", "--fitted", "captioner-fit-selector --output")
        out = out.merged(Fitted.from_json(data["fitted"], f"--fitted {path}"))
    return out.to_json()


def taught_memory(output: str, ckpt, start: Path) -> str:
    """Write a taught model's consensus memory beside `output` -> the line that says what it holds (or why there
    is none): the starting model's memory, its photos' captions in ids of the grown vocabulary (a vocabulary that
    only grew keeps every old id), so the rerank weighs every candidate as the starting model's did. Without it
    the taught model reranked nothing, and its captions of photos that have nothing to do with the new words
    changed. (The run's own photos are left out: with them 2 more of 197 unrelated captions changed and the new
    word was said on 1 more of 19 photos of its thing.)"""
    import torch

    import captioner
    from captioner.checkpoint import load_checkpoint
    from captioner.data.features import encoder_fingerprint
    from captioner.decoding.consensus import ConsensusMemory, memory_path

    beside, source = memory_path(output), memory_path(start)
    beside.unlink(missing_ok=True)  # an earlier export's memory would not fit this file
    if not source.is_file():
        return f"no consensus memory: the starting model has none beside it ({source}); the rerank stays off"
    old = ConsensusMemory.load(source)
    ids = [ckpt.vocab.stoi.get(w) for w in load_checkpoint(start).vocab.itos]  # the starting model's id -> ours
    rebuild = f"captioner-build-consensus --checkpoint {output} --config <a recipe of its training photos> writes one"
    if None in ids or len(ids) != old.vocab_size:
        return f"no consensus memory: the vocabulary lost words of the starting model's; {rebuild}"
    if old.encoder and old.encoder != encoder_fingerprint(captioner.load(output).model.encoder):
        return f"no consensus memory: the encoder is not the starting model's (its memory's features); {rebuild}"
    tokens = torch.tensor(ids, dtype=torch.int64)[old.tokens.long()].to(old.tokens.dtype)
    ConsensusMemory(old.features, tokens, old.caption_ends, old.photo_ends, len(ckpt.vocab), old.encoder).save(beside)
    return (f"consensus memory: the starting model's ({len(old):,} photos, {len(old.caption_ends):,} captions) -> "
            f"{beside} ({beside.stat().st_size / 2 ** 20:.1f} MiB)")


def with_detectors_of(ckpt, cfg, donor, name: str):
    """`ckpt` carrying `donor`'s word detectors (and cfg its person floor). Detectors read the encoder's
    annotation vectors, so the two encoders must be identical; a ValueError names the first difference."""
    import dataclasses

    import torch

    if donor.detector_info is None:
        raise ValueError(f"--detectors-from {name} carries no word detectors (make them with captioner-train-detectors)")
    mine = {k: v for k, v in ckpt.model_state.items() if k.startswith("encoder.")}
    theirs = {k: v for k, v in donor.model_state.items() if k.startswith("encoder.")}
    differ = sorted(k for k in mine.keys() | theirs.keys()
                    if k not in mine or k not in theirs or not torch.equal(mine[k].float(), theirs[k].float()))
    if differ:
        raise ValueError(f"--detectors-from {name}: its encoder differs from this checkpoint's ({len(differ)} tensors, "
                         f"e.g. {differ[0]}); train the detectors on this model's encoder instead")
    cfg.decode.person_floor = donor.config.decode.person_floor
    return dataclasses.replace(ckpt, detector_tensors=donor.detector_tensors, detector_info=donor.detector_info)


def read_metrics(path: str) -> dict:
    """One --metrics file (evaluate.py --output JSON, with "scores"); a ValueError naming the file otherwise."""
    return read_report(path, "scores", "--metrics", "evaluate.py --output")


def read_report(path: str, key: str, option: str, writer: str) -> dict:
    """A JSON report holding the object `key` (given with `option`, written by `writer`); a ValueError naming the
    file and the command that writes one otherwise."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{option} {path}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{option} {path}: not a JSON file ({e}); pass the file {writer} wrote") from None
    if not isinstance(data, dict) or not isinstance(data.get(key), dict):
        raise ValueError(f"{option} {path}: no \"{key}\" object; pass the file {writer} wrote")
    return data


def stored_dtypes(path: str) -> str:
    """What the written file holds, read back from it: 'encoder 170 fp32; decoder 22 fp16'."""
    from collections import Counter

    from safetensors import safe_open

    names = {"F32": "fp32", "F16": "fp16", "BF16": "bf16", "I64": "int64"}
    parts: dict[str, Counter] = {}
    with safe_open(path, framework="pt") as f:
        for key in f.keys():
            dtype = str(f.get_slice(key).get_dtype())
            parts.setdefault(key.split(".", 1)[0], Counter())[names.get(dtype, dtype.lower())] += 1
    return "; ".join(f"{part} " + ", ".join(f"{n} {d}" for d, n in sorted(c.items())) for part, c in parts.items())


if __name__ == "__main__":
    sys.exit(main())
