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


def decode_settings(model: Any, args: argparse.Namespace):
    """The model file's decode settings with --beam-size/--max-len/--length-penalty and every --decode
    KEY=VALUE applied (typed and checked like a config file's decode section). ValueError/TypeError
    say what was wrong."""
    from captioner.config import Config, set_value

    cfg = Config(decode=dataclasses.replace(model.config.decode))
    for item in args.decode:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--decode expects KEY=VALUE, got '{item}'")
        set_value(cfg, f"decode.{key.strip()}", value, "--decode")
    explicit = {"beam_size": args.beam_size, "max_len": args.max_len, "length_penalty": args.length_penalty}
    return model.decode_settings(**{**dataclasses.asdict(cfg.decode), **{k: v for k, v in explicit.items()
                                                                          if v is not None}})


def describe(settings) -> str:
    """'beam_size 5, max_len 30, ...': every decode setting in use, for the line a command prints."""
    return ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(settings).items())
