"""--device naming a device the machine lacks: every command says so in one line (exit code 2, no
traceback) naming the devices it has; captioner.load says the same as a ValueError."""
from __future__ import annotations

import importlib

import pytest
import torch

import captioner

MISSING = "cuda:7" if torch.cuda.device_count() < 8 else "mps"  # a device this machine does not have


@pytest.mark.parametrize("command,args", [
    ("caption", ["captioner/assets/examples/cat.jpg"]),
    ("evaluate", ["--dataset", "flickr8k", "--data-root", "nowhere", "--split", "val"]),
    ("train", ["--config", "configs/tiny.yaml"]),
    ("prepare", ["--config", "configs/tiny.yaml"]),
    ("benchmark", []),
    ("train_detectors", ["--cache-dir", "nowhere", "--out", "nowhere.safetensors"]),
])
def test_every_command_refuses_a_missing_device_in_one_line(command, args, capsys):
    main = importlib.import_module(f"captioner.cli.{command}").main
    assert main([*args, "--device", MISSING]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("error:") and MISSING in err and "cpu" in err


def test_load_names_the_devices_there_are():
    assert captioner.available_devices()[0] == "cpu"
    assert captioner.check_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="this machine has: cpu"):
        captioner.load(device="not-a-device")
    with pytest.raises(ValueError, match=f"'{MISSING}' is not available"):
        captioner.load(device=MISSING)
