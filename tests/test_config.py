"""Typed settings: `--set` coerces strings to the field's type, Optional fields accept none/null."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest

from captioner.config import Config, load_config, set_value


@dataclass
class Section:  # a section with the optional types a recipe may use (annotations are strings here)
    steps: int | None = None
    rate: float | None = 0.5
    name: Optional[str] = "x"
    flag: bool | None = None
    count: int = 3


@pytest.fixture
def cfg() -> Config:
    c = Config()
    c.decode = Section()  # set_value looks settings up on the section object, whatever its class
    return c


def test_optional_fields_take_values_or_none(cfg):
    set_value(cfg, "decode.steps", "7", "--set")
    set_value(cfg, "decode.rate", "1e-3", "--set")
    set_value(cfg, "decode.flag", "yes", "--set")
    assert (cfg.decode.steps, cfg.decode.rate, cfg.decode.flag) == (7, 1e-3, True)
    for word in ("none", "None", "null", " NULL "):
        set_value(cfg, "decode.steps", word, "--set")
        assert cfg.decode.steps is None
    set_value(cfg, "decode.name", None, "file.yaml")  # YAML null
    set_value(cfg, "decode.rate", 2, "file.yaml")  # int where a float is expected
    assert cfg.decode.name is None and cfg.decode.rate == 2.0 and isinstance(cfg.decode.rate, float)


def test_wrong_values_are_clear_errors(cfg):
    with pytest.raises(ValueError, match="decode.steps expects int, got 'seven'"):
        set_value(cfg, "decode.steps", "seven", "--set")
    with pytest.raises(ValueError, match="decode.count expects int"):
        set_value(cfg, "decode.count", "none", "--set")  # not optional: None is not a value
    with pytest.raises(ValueError, match="unknown setting 'decode.bogus'"):
        set_value(cfg, "decode.bogus", "1", "--set")


def test_real_sections_still_coerce():
    c = load_config(None, ["decode.beam_size=5", "train.lr=1e-3", "train.amp=false", "data.dataset=coco"])
    assert (c.decode.beam_size, c.train.lr, c.train.amp, c.data.dataset) == (5, 1e-3, False, "coco")
    with pytest.raises(ValueError, match="--set expects key=value"):
        load_config(None, ["decode.beam_size"])
