"""A torch / torchvision pair that does not work together (torch 2.13.0+cpu with torchvision 0.28.0
from PyPI fails in `import torchvision` with "operator torchvision::nms does not exist"): one line naming both
versions and the reinstall, no traceback, in the library, the command-line programs and the app, where the work
needs torchvision (a ResNet model file, preparing a dataset); the bundled model (EfficientNet-Lite) never imports
it, so captioning with it still works. The mismatch is faked: `import torchvision` raises what the broken pair
raised."""
from __future__ import annotations

import builtins
from importlib import metadata

import pytest
import torch

import captioner
from captioner.model import vision

from .conftest import ROOT

EXAMPLE = sorted((captioner.DEFAULT_CHECKPOINT.parent / "examples").glob("*.jpg"))[0]


@pytest.fixture
def broken_pair(monkeypatch):
    real_import, real_version = builtins.__import__, metadata.version

    def fake_import(name, *args, **kwargs):
        if name == "torchvision" or name.startswith("torchvision."):
            raise RuntimeError("operator torchvision::nms does not exist")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    monkeypatch.setattr(metadata, "version", lambda p: "0.28.0" if p == "torchvision" else real_version(p))


def _says_the_pair_and_the_fix(line: str) -> None:
    assert "\n" not in line.strip() and "Traceback" not in line, line
    assert "torch 2.13.0+cpu" in line and "torchvision 0.28.0" in line and "nms does not exist" in line, line
    assert "pip install --force-reinstall torch torchvision --index-url" in line and vision.CPU_INDEX in line, line


def test_the_library_names_both_versions_and_the_fix(broken_pair):
    with pytest.raises(vision.TorchvisionMismatch) as e:
        vision.import_torchvision()
    _says_the_pair_and_the_fix(str(e.value))
    _says_the_pair_and_the_fix(vision.torchvision_problem())


def test_a_working_pair_is_no_problem():
    assert vision.torchvision_problem() is None and vision.import_torchvision().__name__ == "torchvision"


@pytest.fixture
def resnet_file(tmp_path):
    """A model file whose encoder is torchvision's ResNet (its weights are never read: the import fails first)."""
    import copy

    from captioner.checkpoint import save_checkpoint

    from .conftest import tiny_captioner

    tiny = tiny_captioner()
    cfg = copy.deepcopy(tiny.config)
    cfg.model.encoder = "resnet101"
    save_checkpoint(tmp_path / "resnet.safetensors", cfg, tiny.vocab, tiny.model.state_dict())
    return tmp_path / "resnet.safetensors"


@pytest.mark.parametrize("program", ["caption", "prepare"])
def test_the_command_line_says_it_in_one_line(program, resnet_file, broken_pair, capsys):
    import importlib

    main = importlib.import_module(f"captioner.cli.{program}").main
    args = ([str(EXAMPLE), "--checkpoint", str(resnet_file)] if program == "caption"
            else ["--config", str(ROOT / "configs" / "tiny.yaml"), "--no-features"])
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and err.count("\n") == 1 and not out, (out, err)
    _says_the_pair_and_the_fix(err)


def test_the_bundled_model_captions_without_torchvision(broken_pair, capsys):
    """Where pip fell back to a mismatched pair, the bundled model still captions (the CLI and the library)."""
    from captioner.cli.caption import main

    assert main([str(EXAMPLE), "--beam-size", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(str(EXAMPLE)) and "error" not in err, (out, err)
    (note,) = [line for line in err.splitlines() if "do not work together" in line]  # said once, in one line
    assert "torch 2.13.0+cpu" in note and "torchvision 0.28.0" in note and "works on" in note
    assert "pip install --force-reinstall torch torchvision" in note and "--index-url" not in note  # the plain install
    assert captioner.load().caption(EXAMPLE, beam_size=1).text


def test_the_app_captions_with_the_bundled_model_and_names_the_pair_for_a_resnet(resnet_file, broken_pair,
                                                                                  monkeypatch):
    testing = pytest.importorskip("streamlit.testing.v1", reason="streamlit's AppTest is not available")
    at = testing.AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
    assert not at.exception and not at.error, [e.value for e in at.error]  # the bundled model: captioned
    assert any(h.value.startswith("“") for h in at.subheader)  # the caption on screen
    assert len([w for w in at.warning if "do not work together" in w.value]) == 1  # and the pair named, once
    monkeypatch.setenv("CAPTIONER_CHECKPOINT", str(resnet_file))
    at = testing.AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
    assert not at.exception and len(at.error) == 1, [e.value for e in at.error]
    _says_the_pair_and_the_fix(at.error[0].value)


def test_a_stop_during_the_import_is_the_stop_not_a_mismatch(monkeypatch):
    """A Ctrl-C that lands inside `import torchvision` can leave a broken import that fails with a RecursionError or
    an ImportError: the stop it was raised while handling goes through, never "torch and torchvision do not work
    together"."""
    import builtins

    import pytest

    from captioner.model import vision

    real = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "torchvision":
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise RecursionError("maximum recursion depth exceeded")
        return real(name, *args, **kwargs)

    monkeypatch.delitem(__import__("sys").modules, "torchvision", raising=False)
    monkeypatch.setattr(builtins, "__import__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        vision.import_torchvision()
