from __future__ import annotations

from pathlib import Path

import pytest
import torch

import captioner
from captioner.model.decoder import Decoder

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
FLICKR = SHARED / "flickr8k"
COCO_MINI = SHARED / "coco-mini"


def need_flickr() -> Path:
    if not (FLICKR / "captions.txt").is_file():
        pytest.skip(f"Flickr8k data not found at {FLICKR} (tests that need real photos are skipped)")
    return FLICKR


def need_coco() -> Path:
    if not (COCO_MINI / "annotations" / "captions_train2017.json").is_file():
        pytest.skip(f"coco-mini data not found at {COCO_MINI}")
    return COCO_MINI


@pytest.fixture
def flickr() -> Path:
    return need_flickr()


@pytest.fixture
def coco_mini() -> Path:
    return need_coco()


def tiny_decoder(vocab_size: int = 12, dropout: float = 0.0, attention: str = "soft") -> Decoder:
    """The tiny decoder the invariant tests share (random tensors, no data): annotations of D = 16, E 8, H 10,
    A 7, in eval mode (a test that wants dropout calls .train())."""
    return Decoder(vocab_size, 16, embed_dim=8, hidden_dim=10, attention_dim=7, dropout=dropout,
                   attention=attention).eval()


@pytest.fixture
def tiny() -> Decoder:
    """A fresh tiny decoder (tiny_decoder()): a test may train or change it."""
    return tiny_decoder()


@pytest.fixture(scope="session")
def bundled() -> captioner.Captioner:
    """The bundled default model (captioner.load()), loaded once for the whole session and shared by every
    module: a test may read it and ask it anything, but must not change it (weights, config, attached
    detectors); a test that changes a model loads its own."""
    if not captioner.DEFAULT_CHECKPOINT.is_file():
        pytest.skip(f"the bundled default model {captioner.DEFAULT_CHECKPOINT} is missing")
    return captioner.load()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Keep torch on one thread in modules that run many small models (2-core machine)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def optimise(objective, model, batch, steps: int, lr: float, cfg=None) -> list[dict[str, float]]:
    """`steps` steps of the engine's own train_step (autocast rule, finite check, clipping, Adam) on
    objective(model, batch), Adam over the decoder; each step's logged scalars."""
    from functools import partial

    from captioner.config import Config
    from captioner.training.engine import train_step

    opt = torch.optim.Adam(model.decoder.parameters(), lr=lr)
    cfg = cfg or Config()
    return [train_step(partial(objective, model), opt, batch, cfg, torch.device("cpu")).logs for _ in range(steps)]
