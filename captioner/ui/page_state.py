"""What the app's page holds: its settings (Settings, View), the photo on screen (Shown) and the cached
models, readings, captions and explanations every panel asks for (Streamlit caches: one encoder run per photo
and model). The panels (page_sidebar, page_photo, page_views, page_workbench) draw; app.py lays them out."""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import streamlit as st
import torch

import captioner
from captioner.model.blas import sum_in_one_order
from ..concepts.imagenet import imagenet_head_or_none
from ..evaluation.metrics import MIN_VAL_PHOTOS, val_photos
from ..images import file_extensions, original_size
from . import checkpoints, visualize

if TYPE_CHECKING:
    from PIL import Image


EXAMPLES_DIR = Path(captioner.__file__).resolve().parent / "assets" / "examples"
EXAMPLES = {"Cat": "cat.jpg", "Coffee": "coffee.jpg", "Astronaut": "astronaut.jpg"}
# A larger photo is refused by the page, with a message, in place of the last one. The uploader's own limit
# (.streamlit/config.toml server.maxUploadSize) stays above it: a file the uploader refuses never reaches the
# page, so the box showed the refused file beside the last one and the page the last photo's error.
MAX_PHOTO_MB = 20
UPLOAD_TYPES = file_extensions()  # exactly what load_image reads (images.FORMATS), as its errors list them
GRID_COLUMNS = 3  # the per-word grid: three a row, so that each word's region reads at a glance
GRID_SIDE = 320  # grid overlays are drawn on a copy of the photo at most this many pixels on a side
FIGURE_SIDE = 400  # the downloadable figure's panels likewise
GALLERY_COLUMNS = 4  # cards per row when several photos are uploaded
DEFAULT_LABEL = "bundled default model"
# what torch computes on in a new thread (OMP_NUM_THREADS, else the cores), read once: every page run is a new thread
THREADS = torch.get_num_threads()


Decode = tuple[tuple[str, object], ...]  # decode settings as (name, value) pairs: hashable, a cache key


class View(NamedTuple):
    """How attention maps are drawn (the sidebar's "Attention maps")."""
    opacity: float
    smooth: float
    mode: str  # one of visualize.MODES
    outline: bool = True  # outline each word's half-attention region


@dataclass(frozen=True)
class Settings:
    """What the sidebar chose: the checkpoint (menu label and file), its precision, decode settings, view."""
    choices: dict[str, str]  # label -> path of every checkpoint the menu offers, in menu order
    label: str
    path: str
    mtime: float  # the file's, part of every cache key: a rewritten file is loaded again
    dtype: str
    decode: Decode
    view: View

    @property
    def model_key(self) -> tuple[str, float, str]:
        """(path, mtime, dtype): how the app's cached functions name this model."""
        return self.path, self.mtime, self.dtype

    @property
    def evidence(self) -> bool:
        return bool(dict(self.decode)["evidence"])


@dataclass
class Shown:
    """The photo on screen: its name, its file's bytes and the decoded image."""
    name: str
    data: bytes
    image: Image.Image

    @cached_property
    def digest(self) -> str:
        """The cache key of this photo's features, captions and explanations."""
        return hashlib.sha256(self.data).hexdigest()

    @cached_property
    def thumb(self) -> Image.Image:
        """The copy the grids and the region view draw on (longer side GRID_SIDE)."""
        return shrink(self.image, GRID_SIDE)


def leave_a_core() -> None:
    """This page run computes on one core fewer than torch would: the page is mostly drawn by a browser on the
    same machine, and two threads beside a busy browser on 2 cores read a photo several times slower than one
    (docs/performance.md, "The app"). Called at the start of every run, since each is a new thread."""
    torch.set_num_threads(max(1, THREADS - 1))


@st.cache_resource(show_spinner="Loading model ...", max_entries=4)
def get_model(path: str, mtime: float, dtype: str = "float32") -> captioner.Captioner:
    """One model per checkpoint file and precision per process (mtime in the key: a rewritten file
    is reloaded). MKL is asked for sums in one order first (model/blas.py): the app's first product comes here.
    What is in memory once the model is (the libraries, the model) lives as long as the process, so it is frozen
    out of the garbage collector's scans: a full collection of it was the longest step between an upload and its
    caption on 2 cores, and one ran after every page run, before the next could start (Streamlit's
    runner.postScriptGC, off in .streamlit/config.toml for the same reason; docs/performance.md, "The app")."""
    sum_in_one_order()
    loaded = captioner.load(path, dtype=dtype)
    gc.collect()
    gc.freeze()
    return loaded


@st.cache_resource(show_spinner=False, max_entries=16)
def get_photo(path: str, mtime: float, dtype: str, digest: str, _image) -> captioner.Photo:
    """One photo as one model read it (keyed by the photo's digest): the encoder and its heads run once per
    photo and model, so new decode settings, a typed sentence, another word or region, or a comparison only
    decode (captioner.Photo.caption / explain). Never modified."""
    return get_model(path, mtime, dtype).read(_image)


@st.cache_data(show_spinner=False, max_entries=64)
def get_caption(path: str, mtime: float, dtype: str, digest: str, decode: Decode, _image) -> captioner.Caption:
    """Caption of one decoded photo (keyed by its digest and the decode settings as (name, value) pairs),
    so moving the opacity or word sliders does not decode again."""
    return get_photo(path, mtime, dtype, digest, _image).caption(**dict(decode))


@st.cache_data(show_spinner=False, max_entries=64)
def get_explanation(path: str, mtime: float, dtype: str, digest: str, text: str, hard_context: str,
                    _image) -> captioner.Caption:
    """A typed sentence teacher-forced on one photo (Photo.explain), cached per model, photo and text."""
    cap = get_photo(path, mtime, dtype, digest, _image).explain(text, hard_context=hard_context)
    return dataclasses.replace(cap, photo_size=None, transparent=False, flat=False)  # its notes: shown once, by the
    # caption


def explain_or_none(path: str, mtime: float, dtype: str, digest: str, text: str, hard_context: str, _image
                    ) -> captioner.Caption | None:
    """get_explanation, or None after an info line when the sentence has no words (NoWordsError)."""
    try:
        return get_explanation(path, mtime, dtype, digest, text, hard_context, _image)
    except captioner.NoWordsError as e:
        st.info(f"{str(e)[0].upper()}{str(e)[1:]}.")
        return None


@st.cache_data(show_spinner=False, ttl=10)
def find_checkpoints(folders: tuple[str, ...]) -> tuple[list[str], str]:
    """(*.safetensors under the operator's folders, newest first; why the search stopped early or "")."""
    found = checkpoints.find_model_files(folders)
    return [str(p) for p in found.files], found.stopped


def checkpoint_choices(folders: tuple[str, ...], selected: str | None = None) -> dict[str, str]:
    """label -> path, in menu order: `selected` (CAPTIONER_CHECKPOINT), the bundled default, then the operator's
    folders'."""
    choices: dict[str, str] = {}
    seen: set[str] = set()

    def add(label: str, path: str | Path) -> None:
        key = os.path.abspath(path)
        if key not in seen:
            seen.add(key)
            choices[label] = str(path)

    env = selected
    if env and Path(env).is_file():
        add(f"{Path(env).name} (CAPTIONER_CHECKPOINT)", env)
    elif env:
        st.warning(f"CAPTIONER_CHECKPOINT names a file that does not exist: {env}")
    if captioner.DEFAULT_CHECKPOINT.is_file():
        add(DEFAULT_LABEL, captioner.DEFAULT_CHECKPOINT)
    files, stopped = find_checkpoints(folders)
    if stopped:
        st.caption(f"Model files: {stopped}; not every file of the allowed folders is listed.")
    for p in files:
        label = p
        for folder in folders:
            try:
                label = str(Path(p).relative_to(Path(folder).expanduser()))
                break
            except ValueError:
                continue
        note = checkpoints.run_file_note(Path(p), [Path(f) for f in files])  # which of a run's files to pick; None: not one to caption with
        if note is not None:
            add(label + note, p)
    return choices


def shrink(image, side: int):
    """A copy of the photo, longer side at most `side`, same aspect ratio."""
    small = image.copy()
    small.thumbnail((side, side))
    return small


def figure_bytes(image, cap: captioner.Caption, view: View) -> bytes:
    """The downloadable figure, drawn only when the button is clicked."""
    return visualize.figure_png(visualize.attention_figure(image, cap, opacity=view.opacity, smooth=view.smooth,
                                                           mode=view.mode, outline=view.outline))


def has_head(loaded: captioner.Captioner) -> bool:
    """Whether the model's encoder keeps the ImageNet head that evidence-aware decoding reads."""
    return imagenet_head_or_none(loaded.model) is not None


def stored_decode(loaded: captioner.Captioner) -> Decode:
    """The decode settings stored in a model's own file, as the page's (name, value) pairs."""
    return tuple(dataclasses.asdict(loaded.config.decode).items())


def decode_for(loaded: captioner.Captioner, decode: Decode) -> Decode:
    """The page's decode settings as one model may use them: evidence off where its encoder has no head
    (a ResNet checkpoint beside the bundled model in a comparison)."""
    return tuple((k, v and has_head(loaded) if k == "evidence" else v) for k, v in decode)


def photo_label(photo: Shown) -> str:
    """'NAME (451x300)'; a photo shrunk for the page says so: 'NAME (12000x12000, shown at 1024x1024)'."""
    (w, h), shown = original_size(photo.image), photo.image.size
    return f"{photo.name} ({w}x{h})" if (w, h) == shown else f"{photo.name} ({w}x{h}, shown at {shown[0]}x{shown[1]})"


def short_error(e: Exception) -> str:
    """An image error's message without its "image: " prefix, to follow the file's name."""
    return str(e).removeprefix("image: ")


def model_info(loaded: captioner.Captioner) -> str:
    """'vgg19, 14x14 attention grid, 2,345 words | validation Bleu-4 0.200, CIDEr 0.500 (1,000 photos)' (scores
    when stored, with the photos they rest on when the file says). A figure from a val split too small to
    compare (MIN_VAL_PHOTOS) says so: 'CIDEr 1.666 (5 photos: too few to compare)', not a number to set beside
    another model's 0.614 from 1,200 photos."""
    info = f"{loaded.config.model.encoder}, {loaded.grid_size}x{loaded.grid_size} attention grid, " \
           f"{len(loaded.vocab):,} words"
    val = loaded.metrics.get("val") if isinstance(loaded.metrics.get("val"), dict) else {}
    scores = [f"{k.replace('_', '-')} {val[k]:.3f}" for k in ("Bleu_4", "CIDEr") if isinstance(val.get(k), (int, float))]
    if scores:
        photos, smallest = val_photos(val)
        few = ": too few to compare" if 0 < smallest < MIN_VAL_PHOTOS else ""
        info += " | validation " + ", ".join(scores) + (f" ({photos:,} photos{few})" if photos else "")
    return info
