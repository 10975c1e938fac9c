"""train.ema_decay: the moving average of the trained weights (training/ema.py). With decay 0 the average is the
weights themselves; validation and best.safetensors use the average; a stopped and resumed run averages exactly
what an uninterrupted one does."""
from __future__ import annotations

from functools import partial

import pytest
import torch

from captioner.checkpoint import load_checkpoint
from captioner.config import Config, load_config
from captioner.training.ema import EMA

from .conftest import need_flickr, tiny_decoder
from .test_stopping import StopAfter, losses


def _steps(decoder, ema: EMA, n: int) -> None:
    from captioner.model.show_attend_tell import ShowAttendTell
    from captioner.training.engine import train_step
    from captioner.training.objectives import CrossEntropy

    from captioner.data.dataset import collate

    g = torch.Generator().manual_seed(1)
    batch = collate([(torch.rand(4, 16, generator=g), [[1, 5, 6, 2], [1, 7, 2]]) for _ in range(3)])
    model = ShowAttendTell(torch.nn.Identity(), decoder)  # type: ignore[arg-type]  # features given: no encoder
    opt = torch.optim.Adam(decoder.parameters(), lr=1e-2)
    for _ in range(n):
        train_step(partial(CrossEntropy(Config()), model), opt, batch, Config(), torch.device("cpu"))
        ema.update(decoder)


def test_decay_0_is_the_weights_and_a_decay_averages_them(tiny):
    plain = {n: p.detach().clone() for n, p in tiny.named_parameters()}
    ema0 = EMA(tiny, 0.0)
    _steps(tiny.train(), ema0, 3)
    trained = {n: p.detach().clone() for n, p in tiny.named_parameters()}
    assert any(not torch.equal(plain[n], trained[n]) for n in plain)  # it trained
    with ema0.applied(tiny):
        assert all(torch.equal(p, trained[n]) for n, p in tiny.named_parameters())  # decay 0: the plain weights

    decoder = tiny_decoder().train()
    start = {n: p.detach().clone() for n, p in decoder.named_parameters()}
    ema = EMA(decoder, 0.5)
    _steps(decoder, ema, 1)
    after = dict(decoder.named_parameters())
    for n, avg in ema.shadow.items():  # one step: halfway between the start and the weights
        assert torch.allclose(avg, 0.5 * start[n] + 0.5 * after[n].detach(), atol=1e-7)
    with ema.applied(decoder):
        assert all(torch.equal(p, ema.shadow[n]) for n, p in decoder.named_parameters())
    assert all(torch.equal(p, after[n]) for n, p in decoder.named_parameters())  # the weights are back


def test_a_decay_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="train.ema_decay"):
        load_config(None, ["train.ema_decay=1"])


@pytest.mark.slow
def test_a_run_with_an_average_resumes_exactly_and_keeps_the_average_as_best(tmp_path):
    """Cached features of 8 small photos, an epoch of 4 steps, stopped at step 3 and resumed: every logged loss and
    val score equals the uninterrupted run's, and best.safetensors holds the average, not the raw weights."""
    from captioner.training.engine import fit
    from captioner.training.stopping import Interrupted

    def cfg(out: str):
        return load_config("configs/tiny.yaml", [
            f"data.root={need_flickr()}", f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={tmp_path / out}",
            "train.ema_decay=0.9", "model.image_size=64", "model.grid_size=2", "model.dropout=0.5",
            "train.batch_images=2", "train.epochs=1", "train.val_limit=2", "train.checkpoint_every=0",
            "train.tensorboard=false", "decode.beam_size=1"])

    quiet = {"log": lambda _: None, "progress": False}
    fit(cfg("reference"), **quiet)
    with pytest.raises(Interrupted):
        fit(cfg("stopped"), stop=StopAfter(3), **quiet)
    fit(cfg("stopped"), **quiet)
    assert losses(tmp_path / "stopped") == losses(tmp_path / "reference")
    best, last = (load_checkpoint(tmp_path / "stopped" / f"{k}.safetensors") for k in ("best", "last"))
    ref = load_checkpoint(tmp_path / "reference" / "best.safetensors")
    assert all(torch.equal(v, ref.model_state[k]) for k, v in best.model_state.items())
    key = "decoder.out_vocab.weight"  # 2 val photos are too few to choose by: best is the last epoch, averaged
    assert torch.equal(best.model_state[key], last.optimizer_tensors["ema." + key])
    assert not torch.equal(best.model_state[key], last.model_state[key])
