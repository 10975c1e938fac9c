"""captioner-caption's sampling options: --sample N draws N captions per image instead of decoding one
(Photo.sample: each word from the model's distribution under the same decode rules), --temperature, --top-k,
--top-p and --seed; checked once (SampleSettings.checked), before any work, in the options' own names.

Each caption is one line, "PATH<TAB>sample I<TAB>CAPTION", or a --json line whose settings.sample says n,
temperature, top_k, top_p, seed and index. --seed S gives the same captions again (each photo is sampled on its
own, so its captions do not depend on the other photos of the run); without it every photo gets a fresh seed,
recorded in its --json lines. Figures and animations are NAME_sample<I>_attention.png and NAME_sample<I>_caption.gif.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

# SampleSettings' argument -> its option here
OPTIONS = {"n": "--sample", "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed"}


def add_sample_options(p: argparse.ArgumentParser) -> None:
    from captioner.config import SAMPLE_TEMPERATURE, SAMPLE_TOP_P

    p.add_argument("--sample", type=int, default=None, metavar="N",
                   help="draw N captions per image from the model instead of decoding one (see --temperature, "
                   "--top-k, --top-p, --seed)")
    # None: not given (they only mean something with --sample: given without it, the command refuses them)
    p.add_argument("--temperature", type=float, default=None, help="with --sample: > 0; below 1 sharper (towards "
                   f"greedy), above 1 more varied, 1 the model's own distribution (default {SAMPLE_TEMPERATURE:g})")
    p.add_argument("--top-k", type=int, default=None, help="with --sample: draw each word among the K most likely "
                   "only (default 0: no cut; 1 = greedy)")
    p.add_argument("--top-p", type=float, default=None, help="with --sample: nucleus, draw each word among the "
                   f"fewest most likely words holding probability P, in (0, 1] (1: no cut; default {SAMPLE_TOP_P:g})")
    p.add_argument("--seed", type=int, default=None, help="with --sample: the same seed gives the same captions "
                   "(default: a fresh seed per photo, recorded in --json)")


def sample_request(args: argparse.Namespace) -> Any:
    """--sample's SampleSettings (checked: a ValueError names the option out of range), or None without --sample.
    A drawing option without --sample is a ValueError: the caption would be decoded as if it were not there."""
    if args.sample is None:
        given = [OPTIONS[k] for k in ("temperature", "top_k", "top_p", "seed") if getattr(args, k) is not None]
        if given:
            many = len(given) > 1
            raise ValueError(f"{', '.join(given)} only appl{'y' if many else 'ies'} with --sample N (drawn captions); "
                             f"add --sample N or leave {'them' if many else 'it'} out")
        return None
    from captioner.config import SAMPLE_TEMPERATURE, SAMPLE_TOP_P
    from captioner.decoding.sampling import Draw, SampleSettings

    if args.explain is not None:
        raise ValueError("--sample draws captions and --explain scores a given sentence: use one of them")
    draw = Draw(SAMPLE_TEMPERATURE if args.temperature is None else args.temperature,
                0 if args.top_k is None else args.top_k, SAMPLE_TOP_P if args.top_p is None else args.top_p)
    try:
        return SampleSettings(args.sample, draw, args.seed).checked()
    except ValueError as e:  # the API's message ("top_k must be ..."), in the command's option names
        name, _, rest = str(e).partition(" ")
        raise ValueError(f"{OPTIONS.get(name, name)} {rest}") from None


def sampling_line(request: Any, rules: str) -> str:
    """The line the command prints before sampling: what is drawn, how, and under which decode rules (the
    settings a sample uses: no beam, so no beam_size, length_penalty nor consensus rerank)."""
    d = request.draw
    seed = "fresh per photo" if request.seed is None else request.seed
    return (f"sampling {request.n} caption(s) per image (temperature {d.temperature:g}, top_k {d.top_k}, top_p "
            f"{d.top_p:g}, seed {seed}) under the rules of {rules}")


def request_samples(photo: Any, request: Any, settings: dict[str, Any]) -> list[Any]:
    """One photo's drawn Captions (Photo.sample), the photo on its own: the same seed, the same captions."""
    d = request.draw
    return photo.sample(request.n, d.temperature, d.top_k, d.top_p, request.seed, **settings)


def numbered(paths: list[Path | None], index: int, request: Any) -> list[Path | None]:
    """The figure and animation paths of caption `index` (1, 2 ...): as they are without --sample; for a sample
    <stem>_attention.png -> <stem>_sample<I>_attention.png (and so for _caption.gif)."""
    if request is None:
        return paths
    return [None if p is None else p.with_name("{0}_sample{2}_{1}".format(*p.name.rpartition("_")[::2], index))
            for p in paths]
