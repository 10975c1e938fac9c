"""Device placement without a GPU: the GPU paths run on the CPU under tests/device_check.HostTensors, which
stops, as CUDA would, any operation that mixes a tensor made on the host (a factory without `device=`) with
the model's or its inputs'. On the first real GPU two benchmark sections crashed: the synthetic decoder's
length counter wrote a CPU tensor into a CUDA bias (eval without a checkpoint), and the SCST section built a
bf16 config that the objective refuses (train_scst with autocast). Both fail these tests on the old code."""
from __future__ import annotations

import pytest
import torch

import captioner.cli.benchmark as benchmark
from captioner.bench.synthetic import Preset, install_length_counter, make_batches
from captioner.bench.training import decoder_model, _train_config

from .conftest import ROOT
from .device_check import DeviceMismatch, HostTensors

SMALL = Preset("small", 50, "efficientnet_lite0", 64, 3, 16, 8, 8, 8, 5.0, 1.0, 1, 9, 10)


def test_the_checker_catches_a_host_tensor_written_into_the_model():
    lin = torch.nn.Linear(4, 8)
    with pytest.raises(DeviceMismatch), HostTensors(lin), torch.no_grad():
        lin.bias[[0, 1]] = torch.tensor([1.0, 2.0])  # CUDA: "Expected all tensors to be on the same device"
    x = torch.randn(2, 4)
    with pytest.raises(DeviceMismatch), HostTensors(lin, x):
        lin(x) + torch.ones(2, 8)  # a host tensor in the model's arithmetic
    with HostTensors(lin, x), torch.no_grad():  # what the code should do instead: passes
        lin.bias[[0, 1]] = torch.tensor([1.0, 2.0], device=x.device)
        lin(x) + x.new_ones(2, 8) + torch.ones(2, 8).to(x)


def test_the_length_counter_makes_its_tensors_on_the_decoders_device():
    model = decoder_model(SMALL, False)
    batch = make_batches(SMALL, 1, 2, True)[0]
    with HostTensors(model, batch.visual):
        install_length_counter(model.decoder, batch.visual, 1.5)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("amp", [True, False])
def test_the_scst_benchmark_config_is_one_a_real_run_accepts(device, amp):
    from captioner.decoding.cider import CiderD
    from captioner.training.objectives import SelfCritical
    from captioner.vocab import Vocab

    cfg = _train_config(amp, torch.device(device), "scst")
    assert cfg.train.amp == (amp and device == "cuda") and not cfg.train.cpu_amp
    SelfCritical(cfg, Vocab(["<pad>", "<start>", "<end>", "<unk>", "a"]), CiderD([[[4]]]))  # no ValueError


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["none", "bundled"])
def test_every_benchmark_section_keeps_its_tensors_on_the_device(checkpoint, monkeypatch, capsys):
    """The benchmark's sections as `--device cuda` runs them (autocast on: --cpu-amp here), with no checkpoint
    (the synthetic, length-counting decoder) and with the bundled model (its latency: the product's path)."""
    if checkpoint == "none":
        monkeypatch.setattr(benchmark, "default_checkpoint", lambda path: None)
    with HostTensors():
        assert benchmark.main(["--quick", "--cpu-amp", "--only", "train_cached", "train_scst", "train_encoder",
                               "eval", "latency"]) == 0
    assert "SCST" in capsys.readouterr().out


@pytest.mark.slow
def test_training_keeps_its_tensors_on_the_device(tmp_path, capsys):
    """captioner-train's path (caches, teacher forcing, the step, validation's decoding and scoring) on 8 real
    photos with the tiny recipe."""
    from captioner.config import load_config
    from captioner.training.engine import fit

    from .conftest import need_flickr

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"data.root={need_flickr()}", f"data.cache_dir={tmp_path / 'cache'}",
                                    f"train.out_dir={tmp_path / 'run'}", "train.epochs=1"])
    with HostTensors():
        fit(cfg, device="cpu", progress=False)
    assert (tmp_path / "run" / "best.safetensors").is_file()

