"""What the tests share: where the real data lives (or a skip that says it is absent), the tiny random models
(a decoder, a whole captioner), the bundled model loaded once, a random photo, and the runner for commands."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from captioner.model.blas import sum_in_one_order

sum_in_one_order()  # MKL's sums in one order, as the commands ask, before any product (model/blas.py)

import torch  # noqa: E402
from PIL import Image  # noqa: E402

import captioner
from captioner.config import Config
from captioner.model.decoder import Decoder
from captioner.vocab import SpecialIds

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
FLICKR = SHARED / "flickr8k"
COCO_MINI = SHARED / "coco-mini"
PAIRED = SHARED / "coco-paired"

# PYTHONPATH: the scripts import THIS checkout's package, not whichever one is installed
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

# the tiny captioner's words (after <pad> <start> <end> <unk>)
WORDS = ["a", "dog", "runs", "on", "the", "grass", "man", "red"]


def need_flickr() -> Path:
    if not (FLICKR / "captions.txt").is_file():
        pytest.skip(f"Flickr8k data not found at {FLICKR} (tests that need real photos are skipped)")
    return FLICKR


def need_coco() -> Path:
    if not (COCO_MINI / "annotations" / "captions_train2017.json").is_file():
        pytest.skip(f"coco-mini data not found at {COCO_MINI}")
    return COCO_MINI


def need_paired() -> Path:
    if not (PAIRED / "captions.json").is_file():
        pytest.skip(f"coco-paired data not found at {PAIRED} (tests that need real COCO photos are skipped)")
    return PAIRED


def need_bundled() -> Path:
    """The bundled model file, or a skip: for tests that run a command on it rather than load it here."""
    if not captioner.DEFAULT_CHECKPOINT.is_file():
        pytest.skip(f"the bundled default model {captioner.DEFAULT_CHECKPOINT} is missing")
    return captioner.DEFAULT_CHECKPOINT


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it): a server or torchrun group of one test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args: str, ok: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python *args` in the repository root with this checkout's package; an AssertionError that shows both
    streams when it fails (unless ok=False)."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    if ok and proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


@pytest.fixture
def flickr() -> Path:
    return need_flickr()


@pytest.fixture
def coco_mini() -> Path:
    return need_coco()


# the tiny decoder's random tensors: B images, P = 9 regions (a 3x3 grid), D = 16 features; its special ids
B, P, D = 3, 9, 16
START, END, PAD = 1, 2, 0
IDS = SpecialIds(START, END, PAD)


def batch(V: int, lengths=(6, 4, 2)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random teacher-forcing captions over a V-word vocabulary: (inputs, targets, lengths, mask), inputs and
    targets (N, T) padded with PAD past each length, inputs starting with START."""
    T = max(lengths)
    lengths = torch.tensor(lengths)
    inputs = torch.randint(4, V, (len(lengths), T))
    inputs[:, 0] = START
    targets = torch.randint(4, V, (len(lengths), T))
    mask = torch.arange(T)[None] < lengths[:, None]
    inputs[~mask], targets[~mask] = PAD, PAD
    return inputs, targets, lengths, mask


def tiny_decoder(vocab_size: int = 12, dropout: float = 0.0, attention: str = "soft") -> Decoder:
    """The tiny decoder the invariant tests share (random tensors, no data): annotations of D = 16, E 8, H 10,
    A 7, in eval mode (a test that wants dropout calls .train())."""
    return Decoder(vocab_size, 16, embed_dim=8, hidden_dim=10, attention_dim=7, dropout=dropout,
                   attention=attention).eval()


@pytest.fixture
def tiny() -> Decoder:
    """A fresh tiny decoder (tiny_decoder()): a test may train or change it."""
    return tiny_decoder()


def tiny_config(grid: int = 7) -> Config:
    """The tiny captioner's settings: an untrained EfficientNet-Lite0 (no download), a grid x grid map, E = H = A
    = 32."""
    cfg = Config()
    cfg.model.encoder, cfg.model.pretrained, cfg.model.grid_size = "efficientnet_lite0", False, grid
    cfg.model.embed_dim = cfg.model.hidden_dim = cfg.model.attention_dim = 32
    return cfg


def tiny_captioner(grid: int = 7) -> captioner.Captioner:
    """A fresh random whole captioner (encoder, decoder, the 12-word vocabulary of WORDS) a test may change."""
    from captioner.model.show_attend_tell import build_model
    from captioner.vocab import Vocab

    cfg = tiny_config(grid)
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>", *WORDS])
    model = build_model(cfg.model, len(vocab))
    with torch.no_grad():
        model.decoder.out_vocab.bias[vocab.end] -= 3.0  # an untrained model would often end at once
    return captioner.Captioner(model, vocab, cfg)


@pytest.fixture(scope="module")
def tiny_model() -> captioner.Captioner:
    """One tiny_captioner() per module, for tests that only read it (save it, caption with it)."""
    torch.manual_seed(0)
    return tiny_captioner()


def photo(w: int = 320, h: int = 200) -> Image.Image:
    """A w x h photo of RGB noise, the same every call."""
    rng = np.random.RandomState(0)
    return Image.fromarray(rng.randint(0, 255, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="session")
def bundled() -> captioner.Captioner:
    """The bundled default model (captioner.load()), loaded once for the whole session and shared by every
    module: a test may read it and ask it anything, but must not change it (weights, config, attached
    detectors); a test that changes a model loads its own."""
    need_bundled()
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
