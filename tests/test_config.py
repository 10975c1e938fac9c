"""Typed settings: `--set` coerces strings to the field's type; every enumerated setting is checked
against its ONE list of choices when the config is read, before any data or model is touched."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from captioner import config as config_module
from captioner.config import CHOICES, Config, load_config, set_value

ROOT = Path(__file__).resolve().parents[1]


def test_values_are_coerced_to_the_fields_type():
    c = load_config(None, ["decode.beam_size=5", "train.lr=1e-3", "train.amp=false", "data.dataset=coco"])
    assert (c.decode.beam_size, c.train.lr, c.train.amp, c.data.dataset) == (5, 1e-3, False, "coco")
    set_value(c, "train.lr", 2, "file.yaml")  # an int where a float is expected
    assert c.train.lr == 2.0 and isinstance(c.train.lr, float)
    with pytest.raises(ValueError, match="--set expects key=value"):
        load_config(None, ["decode.beam_size"])


def test_wrong_values_are_clear_errors():
    c = Config()
    with pytest.raises(ValueError, match="decode.beam_size expects int, got 'seven'"):
        set_value(c, "decode.beam_size", "seven", "--set")
    with pytest.raises(ValueError, match="decode.beam_size expects int"):
        set_value(c, "decode.beam_size", "none", "--set")  # no setting is optional: None is not a value
    with pytest.raises(ValueError, match="unknown setting 'decode.bogus'"):
        set_value(c, "decode.bogus", "1", "--set")


def _enumerated_fields() -> set[str]:
    """Every str setting whose comment names its list (a module-level tuple of config.py)."""
    lists = {name for name, v in vars(config_module).items() if name.isupper() and isinstance(v, tuple)}
    found = set()
    for section in ("model", "data", "train", "decode"):
        source = Path(config_module.__file__).read_text()
        classes = [c for c in type(getattr(Config(), section)).__mro__ if c.__module__ == config_module.__name__]
        starts = [source.index(f"class {c.__name__}") for c in classes]  # the section's class and its bases
        body = "".join(source[start:source.index("\n\n\n", start)] for start in starts)
        for line in body.splitlines():
            name = line.strip().split(":")[0]
            if ": str =" in line and any(f" {lst}" in line.split("#", 1)[-1] for lst in lists):
                found.add(f"{section}.{name}")
    return found


def test_every_enumerated_setting_has_one_checked_list():
    assert _enumerated_fields() == set(CHOICES), "a setting names a list in its comment but is not checked, or back"
    defaults = Config()
    for name, choices in CHOICES.items():
        section, key = name.split(".")
        assert getattr(getattr(defaults, section), key) in choices  # the default is a valid choice
        with pytest.raises(ValueError, match=f"{name} must be one of {', '.join(choices)}"):
            load_config(None, [f"{name}=surely-not-a-choice"])


def test_config_files_are_checked_too(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  objective: scts\n")
    with pytest.raises(ValueError, match="train.objective must be one of xe, scst, got 'scts'"):
        load_config(bad)


def test_modules_use_the_config_lists():
    """The encoder, decoder, attention and metrics read their choices from config.py, not copies."""
    from captioner.evaluation import metrics
    from captioner.model import attention, decoder, encoder

    assert metrics.METRIC_KEYS is config_module.METRICS
    assert decoder.ATTENTIONS is config_module.ATTENTIONS
    assert set(config_module.HARD_CONTEXTS) <= set(attention.CONTEXTS)
    assert encoder.ENCODERS is config_module.ENCODERS


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["train.val_metric=Bleu4", "train.objective=scts", "decode.hard_context=foo",
                                     "model.encoder=vgg99", "train.scst_baseline=median"])
def test_a_typo_stops_training_before_any_data_is_read(setting, tmp_path):
    """Exit code 2 within seconds, naming the choices, with a data root that does not exist: the
    error comes from the config, not from reading data hours later."""
    t0 = time.time()
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / "configs" / "tiny.yaml"),
                        "--set", setting, "data.root=/nonexistent", f"train.out_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    key = setting.split("=")[0]
    assert f"{key} must be one of {', '.join(CHOICES[key])}" in r.stderr
    assert time.time() - t0 < 30 and not (tmp_path / "run").exists()


def test_a_grid_larger_than_the_feature_map_is_refused():
    """model.output_stride=16 model.grid_size=17 at 224 px average-pooled a 14x14 map UP to 17x17."""
    from captioner.config import ModelConfig, native_grid
    from captioner.model.show_attend_tell import build_model

    with pytest.raises(ValueError, match=r"grid_size=17 is larger than the encoder's 14x14 feature map at "
                                         r"model.image_size=224 .*model.image_size=272 for a native 17x17 map"):
        load_config("configs/tiny.yaml", ["model.output_stride=16", "model.grid_size=17"])
    with pytest.raises(ValueError, match="larger than the encoder's 7x7"):
        build_model(ModelConfig(grid_size=8), 10, pretrained=False)  # also when built from a stored config
    # the documented grids stay valid: 260 px at stride 16 is 17x17 natively, 224 px at 16 pools 14 -> 7
    assert native_grid(ModelConfig(encoder="efficientnet_lite2", image_size=260, output_stride=16)) == 17
    assert native_grid(ModelConfig(image_size=260)) == 9 and native_grid(ModelConfig(image_size=448)) == 14
    load_config("configs/tiny.yaml", ["model.output_stride=16", "model.grid_size=14"])
    load_config("configs/flickr8k_cpu.yaml", ["model.output_stride=16", "model.grid_size=17"])
    import torch

    for size, stride in ((260, 32), (224, 16), (250, 16)):  # the arithmetic is the network's own
        cfg = ModelConfig(image_size=size, output_stride=stride, grid_size=native_grid(ModelConfig(
            image_size=size, output_stride=stride)))
        enc = build_model(cfg, 10, pretrained=False).encoder.eval()
        with torch.no_grad():
            assert enc.feature_map(torch.zeros(1, 3, size, size)).shape[-1] == cfg.grid_size, (size, stride)


def test_every_boolean_flag_of_every_command_is_strict():
    """A boolean option given as text is read by the config system: 'ture' is an error, never False."""
    import pytest as _pytest

    from captioner.cli.train_detectors import _parser
    from captioner.config import parse_bool

    assert parse_bool("yes") is True and parse_bool("OFF") is False
    with _pytest.raises(ValueError, match="expects true/false, got 'ture'"):
        parse_bool("ture")
    p = _parser()
    base = ["--data-root", "x", "--cache-dir", "c", "--out", "o"]
    assert p.parse_args(base + ["--balanced", "false"]).balanced is False
    with _pytest.raises(SystemExit):
        p.parse_args(base + ["--balanced", "ture"])


def test_a_config_names_a_base_and_changes_only_what_it_says(tmp_path):
    """configs/coco_scst.yaml names configs/coco_resnet101.yaml as its base: its model and data are the base's,
    its train keys replace the base's one by one; a loop or a missing base is an error naming the files."""
    from captioner.config import load_config

    base, stage = load_config("configs/coco_resnet101.yaml"), load_config("configs/coco_scst.yaml")
    assert stage.model == base.model and stage.data == base.data
    assert stage.train.objective == "scst" and stage.train.lr == 5e-5 and stage.train.val_limit == base.train.val_limit
    assert stage.decode.beam_size == base.decode.beam_size and stage.decode.max_len == 30
    (tmp_path / "a.yaml").write_text("base: b.yaml\ntrain:\n  lr: 1.0\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ValueError, match="loops"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(FileNotFoundError, match="the base of"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "e.yaml").write_text("base: tiny_copy.yaml\ntrain:\n  epochs: 7\n")
    (tmp_path / "tiny_copy.yaml").write_text(Path("configs/tiny.yaml").read_text())
    tiny, child = load_config("configs/tiny.yaml"), load_config(tmp_path / "e.yaml")
    assert child.train.epochs == 7 and child.train.lr == tiny.train.lr and child.model == tiny.model


def test_a_model_file_with_a_renamed_or_removed_setting_still_loads(tmp_path, monkeypatch):
    """config.RENAMED maps a setting's old stored name to its new one (or None: gone); load_checkpoint applies it
    before the strict check, so the bundled file with its config rewritten the old way loads as before. Without
    the table's lines the same file is refused: the strict check still guards everything else."""
    import captioner
    from captioner import config
    from captioner.checkpoint import CheckpointError, load_checkpoint, read_safetensors, write_safetensors

    tensors, meta = read_safetensors(captioner.DEFAULT_CHECKPOINT)
    stored = json.loads(meta["config"])
    beam = stored["decode"]["beam_size"]
    stored["decode"]["beam_width"] = stored["decode"].pop("beam_size")  # as if an older version called it that
    stored["train"]["old_knob"] = 7  # and had a setting since removed
    old = tmp_path / "old.safetensors"
    write_safetensors(old, tensors, {**meta, "config": json.dumps(stored)})
    with pytest.raises(CheckpointError, match="unknown setting .*RENAMED"):
        load_checkpoint(old)
    monkeypatch.setitem(config.RENAMED, "decode.beam_width", "decode.beam_size")
    monkeypatch.setitem(config.RENAMED, "train.old_knob", None)
    loaded = load_checkpoint(old)
    assert loaded.config.decode.beam_size == beam
    assert loaded.config.to_dict() == load_checkpoint(captioner.DEFAULT_CHECKPOINT).config.to_dict()
    with pytest.raises(ValueError, match="beam_width"):  # a recipe or --set with the old name is still an error
        config.load_config(None, ["decode.beam_width=3"])


def test_a_file_storing_the_old_evidence_penalty_decodes_with_the_ban(tmp_path):
    """decode.evidence_penalty is gone (the evidence's veto is a ban, with no size: decoding/rules.py): the bundled
    file still stores its 10, and a file storing any size loads as it does, with the ban (config.RENAMED drops the
    key); a recipe or --set naming it is an error a person can fix."""
    import captioner
    from captioner import config
    from captioner.checkpoint import load_checkpoint, read_safetensors, write_safetensors

    tensors, meta = read_safetensors(captioner.DEFAULT_CHECKPOINT)
    stored = json.loads(meta["config"])
    assert stored["decode"]["evidence_penalty"] == 10.0 and config.RENAMED["decode.evidence_penalty"] is None
    bundled = load_checkpoint(captioner.DEFAULT_CHECKPOINT).config
    assert "evidence_penalty" not in bundled.to_dict()["decode"] and bundled.decode.evidence
    stored["decode"]["evidence_penalty"] = 0.5  # a mild penalty once let a strong context write the word
    old = tmp_path / "old.safetensors"
    write_safetensors(old, tensors, {**meta, "config": json.dumps(stored)})
    assert load_checkpoint(old).config.to_dict() == bundled.to_dict()
    with pytest.raises(ValueError, match="evidence_penalty' is no longer a setting: the evidence's veto is a ban"):
        config.load_config(None, ["decode.evidence_penalty=10"])
    with pytest.raises(TypeError, match="evidence_penalty is no longer a setting: the evidence's veto is a ban"):
        captioner.load().decode_settings(evidence_penalty=10)  # the API says so too


def _decode_field_lines() -> dict[str, str]:
    """Each DecodeConfig field -> its line in config.py with the comment lines that follow it (its explanation)."""
    import dataclasses
    import inspect

    from captioner.config import DecodeConfig

    lines = inspect.getsource(DecodeConfig).splitlines()
    names = [f.name for f in dataclasses.fields(DecodeConfig)]
    out = {}
    for i, line in enumerate(lines):
        name = line.strip().split(":")[0]
        if name in names:
            more = [x for x in lines[i + 1:i + 3] if x.strip().startswith("#")]
            out[name] = " ".join([line, *more])
    return out


def test_the_decode_settings_are_few_explained_and_checked():
    """A user's decode settings: at most 22, each with a comment saying what it does, each number with a range in
    LIMITS (checked() refuses a value outside it), and none of them a fitted number (those are the model file's
    data: decoding/resources.py)."""
    import dataclasses

    from captioner.config import DecodeConfig, is_old_fitted_key

    fields = dataclasses.fields(DecodeConfig)
    assert len(fields) <= 22, [f.name for f in fields]
    lines = _decode_field_lines()
    assert set(lines) == {f.name for f in fields} and all("#" in line for line in lines.values()), lines
    numeric = {f.name for f in fields if f.type in ("int", "float")}
    assert numeric and numeric == set(DecodeConfig.LIMITS), numeric ^ set(DecodeConfig.LIMITS)
    for key, (low, high) in DecodeConfig.LIMITS.items():
        with pytest.raises(ValueError, match=f"decode.{key} must lie in"):
            dataclasses.replace(DecodeConfig(), **{key: type(getattr(DecodeConfig(), key))(high + 1)}).checked()
    assert not [f.name for f in fields if is_old_fitted_key(f.name)]


def test_where_the_bundled_file_stores_another_value_the_setting_says_so():
    """The config's defaults are what a model trained here stores; each setting the bundled file stores otherwise
    names the bundled file's value in its comment, so the difference is read where the setting is."""
    import dataclasses

    from captioner.checkpoint import load_checkpoint
    from captioner.config import DecodeConfig

    import captioner

    if not captioner.DEFAULT_CHECKPOINT.is_file():
        pytest.skip("the bundled model file is missing")
    stored, lines = load_checkpoint(captioner.DEFAULT_CHECKPOINT).config.decode, _decode_field_lines()
    differ = [f.name for f in dataclasses.fields(DecodeConfig) if getattr(stored, f.name) != getattr(DecodeConfig(), f.name)]
    assert differ and "evidence_detectors" in differ  # a file that predates the setting: UNSTORED
    assert [name for name in differ if "bundled" not in lines[name]] == []


def test_a_fitted_number_set_as_a_decode_setting_says_where_it_went():
    """decode.select_wide, consensus_weight, confidence_* and sure_at were decode settings: a recipe or --set naming
    one is an error that says they are the model file's fitted data now and how to switch them off."""
    for key in ("select_wide", "consensus_weight", "confidence_bias", "sure_at"):
        with pytest.raises(ValueError, match="no longer a decode setting.*fitted data.*fitted_choice=false"):
            load_config(None, [f"decode.{key}=1"])
