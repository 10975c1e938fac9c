"""The decode options every command shares: --beam-size, --max-len, --length-penalty and --decode KEY=VALUE
for any other decode setting (config.decode), all defaulting to the model file's own."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any


def add_decode_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--beam-size", type=int, default=None, help="default: the model file's decode setting")
    p.add_argument("--max-len", type=int, default=None, help="default: the model file's decode setting")
    p.add_argument("--length-penalty", type=float, default=None, help="default: the model file's decode setting")
    p.add_argument("--decode", action="append", default=[], metavar="KEY=VALUE",
                   help="any decode setting (config.decode), e.g. block_trigrams=false; repeatable")


def _apply_decode_options(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Every --decode KEY=VALUE set on `cfg` (typed like a config file's decode section), and the explicit
    --beam-size/--max-len/--length-penalty that were given."""
    from captioner.config import set_value

    for item in args.decode:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--decode expects KEY=VALUE, got '{item}'")
        set_value(cfg, f"decode.{key.strip()}", value, "--decode")
    explicit = {"beam_size": args.beam_size, "max_len": args.max_len, "length_penalty": args.length_penalty}
    return {k: v for k, v in explicit.items() if v is not None}


def check_decode_options(args: argparse.Namespace) -> None:
    """The decode options checked without a model (types, config.DecodeConfig.LIMITS, choices), so that a bad one
    ("--beam-size 0") is refused before the model loads. ValueError/TypeError say what was wrong."""
    from captioner.config import Config

    cfg = Config()
    explicit = _apply_decode_options(cfg, args)
    try:
        dataclasses.replace(cfg.decode, **explicit).checked()
    except ValueError as e:  # in the option's own name where it was given as one
        key = str(e).split()[0].removeprefix("decode.")
        raise ValueError(str(e).replace(f"decode.{key}", f"--{key.replace('_', '-')}", 1) if key in explicit
                         else str(e)) from None


def decode_settings(model: Any, args: argparse.Namespace):
    """The model file's decode settings with --beam-size/--max-len/--length-penalty and every --decode
    KEY=VALUE applied (typed and checked like a config file's decode section). ValueError/TypeError
    say what was wrong."""
    from captioner.config import Config

    cfg = Config(decode=dataclasses.replace(model.config.decode))
    explicit = _apply_decode_options(cfg, args)
    return model.decode_settings(**{**dataclasses.asdict(cfg.decode), **explicit})


# settings only beam search reads: a sampled caption is drawn word by word, never searched nor reranked
SEARCH_ONLY = ("beam_size", "length_penalty", "consensus_k", "fitted_choice", "fitted_confidence")
CONSENSUS = ("consensus_k", "fitted_choice", "fitted_confidence")  # what needs the memory beside the file


def describe(settings, sampling: bool = False, consensus: bool = True, fitted=None) -> str:
    """'beam_size 5, max_len 30, ...': every decode setting in use, for the line a command prints. Settings
    that do nothing are left out, so the line never claims them: with `sampling` the beam's (SEARCH_ONLY);
    without `consensus` (the model file has no consensus memory beside it) the ones that need it (CONSENSUS),
    and the line says the rerank is off instead. `fitted` (the file's decoding.resources.Fitted): what of it is in
    use, the choice's weights and the confidence map's threshold (the numbers are the fit's, not settings)."""
    skip = (SEARCH_ONLY if sampling else ()) + (() if consensus else CONSENSUS)
    values = dataclasses.asdict(settings)
    text = ", ".join(f"{k} {v}" for k, v in values.items() if k not in skip)
    if fitted is not None and consensus and not sampling:
        text += fitted_words(fitted, settings)
    return text if consensus or sampling else f"{text}, no consensus rerank (no consensus memory beside the file)"


def fitted_words(fitted, settings) -> str:
    """'; the file's fitted choice (score 1, wide 3.82069, objects 3) and confidence map (sure at 0.3709)': what of
    the model file's fitted data a decode with `settings` uses ("" for none)."""
    parts = []
    if settings.fitted_choice and fitted.choice is not None:
        weights = ", ".join(f"{s} {w:g}" for s, w in fitted.choice.to_json().items() if w)
        parts.append(f"choice ({weights})")
    if fitted.map_in_use(settings) is not None:
        parts.append(f"confidence map (sure at {fitted.confidence.sure_at:g})")
    return f"; the file's fitted {' and '.join(parts)}" if parts else ""


def describe_briefly(settings, stored, sampling: bool = False) -> str:
    """'beam_size 5, max_len 30 (the model file's settings; --verbose lists every one)': the one short line a
    command prints by default. It names the search's size and every setting the command line changed from the model
    file's `stored` ones (describe lists them all); with `sampling`, none of the beam's (SEARCH_ONLY)."""
    now, before = dataclasses.asdict(settings), dataclasses.asdict(stored)
    changed = [k for k in now if now[k] != before.get(k) and not (sampling and k in SEARCH_ONLY)]
    first = ("max_len",) if sampling else ("beam_size", "max_len")
    text = ", ".join(f"{k} {now[k]}" for k in [*first, *(k for k in changed if k not in first)])
    source = f"{len(changed)} changed from the model file's" if changed else "the model file's settings"
    return f"{text} ({source}; --verbose lists every one)"


def has_memory(loaded: Any) -> bool:
    """Whether a loaded Captioner holds a consensus memory (decoding reranks its beams only then)."""
    return loaded.resources.memory is not None
