"""Streamlit app: caption a photo and show where the model looked for each word.

    streamlit run app.py

Layout and widgets only; loading, captioning and drawing live in the captioner package.
The env var CAPTIONER_CHECKPOINT (optional) names the checkpoint selected when the app opens. The folders
whose model files the page offers are the operator's: `streamlit run app.py -- --checkpoints DIR [DIR ...]`
or CAPTIONER_CHECKPOINT_DIRS (default: runs/ under the working directory); a visitor never types a path.

The page is main(): sidebar() (checkpoint, precision, decode settings and map view: a Settings), then
caption_panel() (the photo, its caption and attention maps), workbench_panel() (explain a typed sentence,
click a region) and compare_panel() (a second model, or this one at other decode settings). A
`captioner.Captioner` is called `loaded` here, so `.model` is always the torch module.
"""
from __future__ import annotations

import dataclasses
import hashlib
import html
import os
import sys
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import streamlit as st

import captioner
from captioner.concepts.imagenet import THRESHOLD as CONCEPT_THRESHOLD
from captioner.concepts.imagenet import imagenet_head_or_none
from captioner.ui import html as html_parts
from captioner.ui import checkpoints, gallery, texts, visualize, workbench
from captioner.images import file_extensions, format_names, load_image, original_size
from captioner.vocab import FUNCTION_WORDS

try:  # click-to-pick a region; without it the row/column menus still pick one
    from streamlit_image_coordinates import streamlit_image_coordinates
except ImportError:  # pragma: no cover - optional component
    streamlit_image_coordinates = None

if TYPE_CHECKING:
    from PIL import Image

EXAMPLES_DIR = Path(captioner.__file__).resolve().parent / "assets" / "examples"
EXAMPLES = {"Cat": "cat.jpg", "Coffee": "coffee.jpg", "Astronaut": "astronaut.jpg"}
UPLOAD_TYPES = file_extensions()  # exactly what load_image reads (images.FORMATS), as its errors list them
GRID_COLUMNS = 4
GRID_SIDE = 320  # grid overlays are drawn on a copy of the photo at most this many pixels on a side
FIGURE_SIDE = 400  # the downloadable figure's panels likewise
GALLERY_COLUMNS = 4  # cards per row when several photos are uploaded
DEFAULT_LABEL = "bundled default model"

Decode = tuple[tuple[str, object], ...]  # decode settings as (name, value) pairs: hashable, a cache key


class View(NamedTuple):
    """How attention maps are drawn (the sidebar's "Attention maps")."""
    opacity: float
    smooth: float
    mode: str  # one of visualize.MODES


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
        """(path, mtime, dtype): how the cached helpers name this model."""
        return self.path, self.mtime, self.dtype

    @property
    def evidence(self) -> bool:
        return bool(dict(self.decode)["evidence"])


@dataclass
class Photo:
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


# ----------------------------------------------------------------------------- cached resources

@st.cache_resource(show_spinner="Loading model ...", max_entries=4)
def get_model(path: str, mtime: float, dtype: str = "float32") -> captioner.Captioner:
    """One model per checkpoint file and precision per process (mtime in the key: a rewritten file
    is reloaded)."""
    return captioner.load(path, dtype=dtype)


@st.cache_resource(show_spinner=False, max_entries=16)
def get_reading(path: str, mtime: float, dtype: str, digest: str, _image) -> captioner.Photo:
    """One photo as one model read it (keyed by the photo's digest): the encoder and its heads run once per
    photo and model, so new decode settings, a typed sentence, another word or region, or a comparison only
    decode (captioner.Photo.caption / explain). Never modified."""
    return get_model(path, mtime, dtype).read(_image)


@st.cache_data(show_spinner=False, max_entries=64)
def get_caption(path: str, mtime: float, dtype: str, digest: str, decode: Decode, _image) -> captioner.Caption:
    """Caption of one decoded photo (keyed by its digest and the decode settings as (name, value) pairs),
    so moving the opacity or word sliders does not decode again."""
    return get_reading(path, mtime, dtype, digest, _image).caption(**dict(decode))


@st.cache_data(show_spinner=False, max_entries=64)
def get_explanation(path: str, mtime: float, dtype: str, digest: str, text: str, hard_context: str,
                    _image) -> captioner.Caption:
    """A typed sentence teacher-forced on one photo (Photo.explain), cached per model, photo and text."""
    cap = get_reading(path, mtime, dtype, digest, _image).explain(text, hard_context=hard_context)
    cap.photo_size = None  # a small photo's note is shown once, by the caption
    return cap


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


def checkpoint_choices(folders: tuple[str, ...]) -> dict[str, str]:
    """label -> path, in menu order: CAPTIONER_CHECKPOINT, the bundled default, then the operator's folders'."""
    choices: dict[str, str] = {}
    seen: set[str] = set()

    def add(label: str, path: str | Path) -> None:
        key = os.path.abspath(path)
        if key not in seen:
            seen.add(key)
            choices[label] = str(path)

    env = os.environ.get("CAPTIONER_CHECKPOINT")
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
        add(label, p)
    return choices


# ----------------------------------------------------------------------------- drawing and wording helpers

def shrink(image, side: int):
    """A copy of the photo, longer side at most `side`, same aspect ratio."""
    small = image.copy()
    small.thumbnail((side, side))
    return small


def figure_bytes(image, cap: captioner.Caption, view: View) -> bytes:
    """The downloadable figure, drawn only when the button is clicked."""
    return visualize.figure_png(visualize.attention_figure(image, cap, opacity=view.opacity, smooth=view.smooth,
                                                           mode=view.mode))


def word_label(cap: captioner.Caption, i: int) -> str:
    """'dog (β=0.82)', or just 'dog' when the caption carries no betas."""
    b = visualize.shown_beta(cap, i)  # None where the gate is open for every word: nothing varies to show
    return cap.words[i] if b is None else f"{cap.words[i]} (β={b:.2f})"


def overlay_grid(image, cap: captioner.Caption, labels: list[str], view: View, columns: int = GRID_COLUMNS) -> None:
    """One small overlay per word (the caption's "All words" and an explained sentence's alike), titled
    by `labels`."""
    opacity, smooth, mode = view
    for start in range(0, len(cap.words), columns):
        for col, i in zip(st.columns(columns), range(start, min(start + columns, len(cap.words)))):
            with col:
                st.image(visualize.overlay(image, cap.alphas[i], opacity, smooth, beta=visualize.word_beta(cap, i),
                                           mode=mode), caption=labels[i], width="stretch")


def explanation_labels(cap: captioner.Caption) -> list[str]:
    """'“word” p=0.31 (word 1)' for each word of an explained sentence; an out-of-vocabulary word's label
    ends '(word 2, as <unk>)': its probability is <unk>'s."""
    return [f"“{w}” p={workbench.shown_prob(p)} (word {i + 1}{', as <unk>' if i in cap.unknown else ''})"
            for i, (w, p) in enumerate(zip(cap.words, workbench.word_probs(cap)))]


def show_explanation(cap: captioner.Caption, image, view: View, columns: int = GRID_COLUMNS) -> None:
    """An explained sentence: its notes, each word's probability, its log-probability (flagged when words
    the vocabulary lacks make it not comparable) and its maps."""
    for note in cap.notes:
        st.info(note)
    st.markdown(html_parts.prob_line(cap), unsafe_allow_html=True)
    total = f"sentence log-probability **{cap.log_prob:.2f}** over {len(cap.words)} words + end"
    if not cap.comparable:
        unknown = ", ".join(f"‘{html.escape(cap.words[i])}’" for i in cap.unknown)
        total += f" (not comparable: {unknown} scored as <unk>)"
    st.markdown(total)
    with st.expander("Where each word of the sentence looked", expanded=False):  # the page stays short
        overlay_grid(image, cap, explanation_labels(cap), view, columns)


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


def photo_label(photo: Photo) -> str:
    """'NAME (451x300)'; a photo shrunk for the page says so: 'NAME (12000x12000, shown at 1024x1024)'."""
    (w, h), shown = original_size(photo.image), photo.image.size
    return f"{photo.name} ({w}x{h})" if (w, h) == shown else f"{photo.name} ({w}x{h}, shown at {shown[0]}x{shown[1]})"


def short_error(e: Exception) -> str:
    """An image error's message without its "image: " prefix, to follow the file's name."""
    return str(e).removeprefix("image: ")


def model_info(loaded: captioner.Captioner) -> str:
    """'vgg19, 14x14 attention grid, 2,345 words | validation Bleu-4 0.200, CIDEr 0.500' (scores when stored)."""
    info = f"{loaded.config.model.encoder}, {loaded.grid_size}x{loaded.grid_size} attention grid, " \
           f"{len(loaded.vocab):,} words"
    val = loaded.metrics.get("val") if isinstance(loaded.metrics.get("val"), dict) else {}
    scores = [f"{k.replace('_', '-')} {val[k]:.3f}" for k in ("Bleu_4", "CIDEr") if isinstance(val.get(k), (int, float))]
    if scores:
        info += " | validation " + ", ".join(scores)
    return info


# ----------------------------------------------------------------------------- the sidebar

def sidebar() -> tuple[Settings, captioner.Captioner]:
    """The sidebar: checkpoint menu and precision, then (the model loaded) its decode settings, the map view
    and a line about the model. Stops with an error when there is no model or it cannot be loaded."""
    with st.sidebar:
        st.header("Model")
        # the operator, not a visitor, decides which folders the page may load from (README: deploying the app)
        folders = tuple(checkpoints.operator_folders(sys.argv[1:], os.environ.get("CAPTIONER_CHECKPOINT_DIRS")))
        choices = checkpoint_choices(folders)
        if not choices:
            st.error("No model available: the bundled default model is missing and no *.safetensors file was "
                     "found in the folders this server allows. Train one (python scripts/train.py --config "
                     "configs/flickr8k_cpu.yaml), or start the app with `-- --checkpoints FOLDER`.")
            st.stop()
        label = st.selectbox("Checkpoint", list(choices))
        native = captioner.preferred_dtype() == "bfloat16"
        dtype = st.selectbox("Precision", list(captioner.api.DTYPES),
                             format_func=lambda d: texts.precision_label(d, native), help=texts.PRECISION_HELP)
    mtime, loaded = load_or_stop(label, choices[label], dtype)
    with st.sidebar:
        decode = decode_settings(loaded)
        view = view_settings()
        st.caption(model_info(loaded))
    return Settings(choices, label, choices[label], mtime, dtype, decode, view), loaded


def load_or_stop(label: str, path: str, dtype: str) -> tuple[float, captioner.Captioner]:
    """(the file's mtime, the loaded Captioner); an error in the page and a stop when it cannot be loaded."""
    try:
        mtime = Path(path).stat().st_mtime
        return mtime, get_model(path, mtime, dtype)
    except (captioner.CheckpointError, OSError) as e:
        st.error(f"Cannot load the checkpoint '{label}': {e}")
        st.stop()
    except Exception as e:  # noqa: BLE001 - e.g. a checkpoint from an incompatible version: say so, keep the app alive
        st.error(f"Cannot load the checkpoint '{label}': {type(e).__name__}: {e}")
        st.stop()


def decode_settings(loaded: captioner.Captioner) -> Decode:
    """The "Decoding" widgets, each starting at the model file's own setting."""
    stored = loaded.config.decode
    st.header("Decoding")
    beam_size = st.slider("Beam size", min_value=1, max_value=10, value=min(max(stored.beam_size, 1), 10),
                          help="1 = greedy decoding; larger beams search more captions. Starts at the model "
                               "file's own setting.")
    max_len = st.slider("Maximum caption length (words)", min_value=5, max_value=max(50, stored.max_len),
                        value=max(5, stored.max_len), help="Starts at the model file's own setting.")
    block_trigrams = st.checkbox("Never repeat a phrase (trigram blocking)", value=stored.block_trigrams,
                                 help="Starts at the model file's own setting.")
    block_bigrams = st.checkbox("Never repeat a word pair (bigram blocking)", value=stored.block_bigrams,
                                help="No bigram ending in a content word twice ('white and white'). Starts at the "
                                     "model file's own setting.")
    # evidence-aware decoding needs the encoder's ImageNet head: offered only for models that keep one
    evidence = has_head(loaded) and st.toggle(
        "Say only what the encoder sees (evidence-aware decoding)", value=stored.evidence,
        help=texts.evidence_help(stored))  # what it does with this file's stored floor, bonus and person floor
    return (("beam_size", beam_size), ("max_len", max_len), ("block_trigrams", block_trigrams),
            ("block_bigrams", block_bigrams), ("evidence", evidence))


def view_settings() -> View:
    """The "Attention maps" widgets: opacity, smoothing and rendering of every overlay on the page."""
    st.header("Attention maps")
    opacity = st.slider("Overlay opacity", min_value=0.0, max_value=1.0, value=0.6, step=0.05)
    smooth = st.slider("Smoothing (grid cells)", min_value=0.0, max_value=2.0, value=0.0, step=0.1,
                       help="Gaussian blur of the upsampled attention map, in units of one attention cell.")
    mode = st.selectbox("Map rendering", list(visualize.MODES),
                        format_func=lambda m: {"bilinear": "smooth (bilinear)", "nearest": "cells (nearest)"}[m],
                        help="How the coarse attention grid is stretched over the photo: bilinear interpolation "
                             "between cell centres, or each cell as a flat block (the grid as computed). Neither "
                             "invents detail finer than one cell.")
    return View(opacity, smooth, mode)


# ----------------------------------------------------------------------------- the photo and its caption

def photo_input(settings: Settings) -> Photo:
    """A photo from the camera, the upload (several: a gallery, one of them opened below), or one of the bundled
    example photos; a file that is no usable photo is an error (a stop when it is the only photo)."""
    col_upload, col_example = st.columns([3, 2])
    with col_upload:
        uploaded = st.file_uploader(f"Upload photos ({format_names(' or ')}; up to {gallery.MAX_PHOTOS} at once)",
                                    type=UPLOAD_TYPES, accept_multiple_files=True) or []
    with col_example:
        example = st.selectbox("... or pick an example photo", list(EXAMPLES), index=0, disabled=bool(uploaded),
                               help="Used when no photo is uploaded.")
    shot = None
    if st.toggle("Take a photo with the camera", value=False, key="camera_on",
                 help="The browser asks for the camera only when this is on; the photo taken is used instead of "
                      "an upload or an example."):
        shot = st.camera_input("Camera", key="camera_shot")
    if shot is not None:
        files = [("camera.jpg", shot.getvalue())]
    elif uploaded:
        if len(uploaded) > gallery.MAX_PHOTOS:
            st.warning(f"{len(uploaded)} photos chosen: at most {gallery.MAX_PHOTOS} are captioned at once, so the "
                       f"first {gallery.MAX_PHOTOS} are shown; upload the others in another batch.")
        files = [(f.name, f.getvalue()) for f in uploaded[:gallery.MAX_PHOTOS]]
    else:
        files = [(EXAMPLES[example], (EXAMPLES_DIR / EXAMPLES[example]).read_bytes())]
    photos = []
    for name, data in files:
        try:
            photos.append(Photo(name, data, load_image(data)))
        except captioner.ImageError as e:
            st.error(f"Cannot use **{name}**: {short_error(e)}. Please choose another photo.")
    if not photos:
        st.stop()
    return photos[0] if len(photos) == 1 else gallery_panel(settings, photos)


@st.cache_data(show_spinner="Captioning the photos ...", max_entries=8)
def get_gallery(path: str, mtime: float, dtype: str, digests: tuple[str, ...], decode: Decode, _images
                ) -> list[captioner.Caption]:
    """A batch of photos read and decoded together (Captioner.caption_batch), cached per model, photos and
    settings."""
    return get_model(path, mtime, dtype).caption_batch(list(_images), **dict(decode))


def gallery_panel(settings: Settings, photos: list[Photo]) -> Photo:
    """Several photos: captioned together and shown as cards (thumbnail, caption, top concepts, notes), the
    batch's downloads (CSV, JSON, figures as ZIP); the photo picked opens below with its overlays."""
    caps = get_gallery(*settings.model_key, tuple(p.digest for p in photos), settings.decode, [p.image for p in photos])
    st.header(f"{len(photos)} photos")
    side = gallery.thumbnail_side(len(photos), GALLERY_COLUMNS)
    columns = st.columns(GALLERY_COLUMNS)
    for i, (photo, cap) in enumerate(zip(photos, caps)):
        with columns[i % GALLERY_COLUMNS]:
            st.image(shrink(photo.image, side), caption=f"{i + 1}. {photo.name}")
            st.markdown(f"“{html.escape(cap.text)}”" if cap.words else "“” (empty caption)")
            if cap.concepts:
                st.caption("sees " + gallery.top_concepts(cap))
            for note in cap.notes:
                st.caption(note)
    items = [(p.name, c) for p, c in zip(photos, caps)]
    csv_col, json_col, zip_col = st.columns(3)
    csv_col.download_button("Download all captions (CSV)", data=gallery.batch_csv(items), file_name="captions.csv",
                            mime="text/csv", on_click="ignore", icon=":material/download:")
    json_col.download_button("Download all captions (JSON)", data=gallery.batch_json(items),
                             file_name="captions.json", mime="application/json", on_click="ignore",
                             icon=":material/download:")
    figures = [(p.name, c, shrink(p.image, FIGURE_SIDE)) for p, c in zip(photos, caps)]
    zip_col.download_button("Download the attention figures (ZIP)", file_name="attention_figures.zip",
                            data=partial(gallery.figures_zip, figures, partial(figure_bytes, view=settings.view)),
                            mime="application/zip", on_click="ignore", icon=":material/download:")
    k = st.selectbox("Open a photo: its overlays and workbench below", range(len(photos)),
                     format_func=lambda i: f"{i + 1}. {photos[i].name}", key="gallery_open")
    return photos[k]


def caption_or_stop(settings: Settings, photo: Photo) -> captioner.Caption:
    """The photo's caption at the sidebar's settings; an error in the page and a stop when captioning fails."""
    with st.spinner("Captioning ..."):
        try:
            return get_caption(*settings.model_key, photo.digest, settings.decode, photo.image)
        except captioner.ImageError as e:
            st.error(f"Cannot use **{photo.name}**: {short_error(e)}")
            st.stop()
        except Exception as e:  # noqa: BLE001 - show the problem in the page, keep the app alive
            st.error(f"Captioning failed with this checkpoint: {type(e).__name__}: {e}")
            st.stop()


def caption_panel(settings: Settings, loaded: captioner.Captioner) -> tuple[Photo, captioner.Caption]:
    """Photo input; the photo beside its caption, concepts, beam hypotheses and downloads; then where the
    model looked for one word and for every word. Stops after the downloads when the caption has no words."""
    photo = photo_input(settings)
    cap = caption_or_stop(settings, photo)
    col_photo, col_text = st.columns([1, 1])
    with col_photo:
        st.image(photo.image, caption=photo_label(photo), width="stretch")
    with col_text:
        caption_summary(cap, settings.evidence, loaded.config.decode.length_penalty)
        downloads(photo, cap, settings.view)
    if not cap.words:
        st.warning("The model ended the caption straight away, so there are no words to show attention for. "
                   "Try beam size 1 or another checkpoint.")
        st.stop()
    word_view(photo.image, cap, settings.view)
    st.header("All words")
    overlay_grid(photo.thumb, cap, [f"{i + 1}. {word_label(cap, i)}" for i in range(len(cap.words))],
                 settings.view)
    return photo, cap


def caption_summary(cap: captioner.Caption, evidence: bool, length_penalty: float) -> None:
    """The caption with each word's β, its log-probability, notes, what the encoder sees and the other
    beam hypotheses."""
    st.subheader(f"“{cap.text}”" if cap.words else "“” (empty caption)")
    line = html_parts.beta_line(cap)
    if line:
        st.markdown(line, unsafe_allow_html=True)
        st.caption("β: the gate that scales how much of the attended image reaches each word (Xu et al. 2015, "
                   "4.2.1). Faint words (low β) were chosen mostly from the language model, not the photo; their "
                   "heat maps are drawn fainter in proportion.")
    elif visualize.gate_open(cap):
        st.caption(f"The gate β (Xu et al. 2015, 4.2.1: how much of the attended image reaches a word) is open for "
                   f"every word of this caption (β ≥ {visualize.GATE_OPEN}): each word saw the whole attended "
                   "context, so it is not shown per word (the JSON download lists it).")
    st.markdown(f"log-probability **{cap.log_prob:.2f}** over {len(cap.words)} words + end")
    for note in cap.notes:  # e.g. a photo far smaller than the model's input
        st.info(note)
    if cap.concepts:
        st.markdown(f"What the encoder sees at P ≥ {CONCEPT_THRESHOLD} (its ImageNet classifier; person and scene "
                    "words: the model's word detectors)" if cap.detections else
                    f"What the encoder's ImageNet classifier sees at P ≥ {CONCEPT_THRESHOLD}")
        st.markdown(html_parts.concepts_html(cap.concepts), unsafe_allow_html=True)
    if cap.contradicted:
        st.warning("The classifier sees no sign of: " + ", ".join(f"**{cap.words[i]}**" for i in cap.contradicted)
                   + (". Switch on evidence-aware decoding to veto such words." if not evidence else "."))
    if cap.alternatives:  # in full (a table, not a grid that cuts long captions), with the score that ranked them
        st.markdown("Beam hypotheses (rank 1 is the caption above)")
        st.table(workbench.hypothesis_rows(cap))
        st.caption(workbench.ranking_note(length_penalty))


def downloads(photo: Photo, cap: captioner.Caption, view: View) -> None:
    """The attention figure (drawn only when clicked) and the caption with its maps as JSON."""
    stem = Path(photo.name).stem or "image"
    st.download_button("Download attention figure (PNG)", icon=":material/download:",
                       data=partial(figure_bytes, shrink(photo.image, FIGURE_SIDE), cap, view),
                       file_name=f"{stem}_attention.png", mime="image/png", on_click="ignore")
    st.download_button("Download caption and attention maps (JSON)", icon=":material/download:",
                       data=visualize.caption_json_bytes(cap, image_name=photo.name),
                       file_name=f"{stem}_caption.json", mime="application/json", on_click="ignore")


def first_content_word(words: list[str]) -> int:
    """The index the big overlay opens on: the first word that names something (not "a", "the" ...)."""
    return next((i for i, w in enumerate(words) if w not in FUNCTION_WORDS), 0)


def word_view(image, cap: captioner.Caption, view: View) -> None:
    """One word's attention map, large; beside it the classifier's map when the word names what it sees."""
    st.header("Where the model looked")
    n = len(cap.words)
    if n > 1:
        k = st.select_slider("Show where this caption word looked", options=list(range(n)),
                             value=first_content_word(cap.words), format_func=lambda i: f"{i + 1}. {cap.words[i]}")
    else:
        k = 0
    beta_k = visualize.word_beta(cap, k)
    looked = visualize.overlay(image, cap.alphas[k], view.opacity, view.smooth, beta=beta_k, mode=view.mode)
    looked_caption = (f"where “{cap.words[k]}” looked (word {k + 1} of {n}"
                      + ("" if visualize.shown_beta(cap, k) is None else f", β={beta_k:.2f}") + ")")
    if k in cap.concept_maps:  # the word names something the ImageNet classifier sees: its map beside the word's
        category, p, cmap = cap.concept_maps[k]
        seen, word_col = st.columns(2)
        what = "the clothes people wear" if category == "person" else f"a {category}"
        seen.image(visualize.overlay(image, cmap, view.opacity, view.smooth, mode=view.mode),
                   caption=f"where the classifier sees {what} (P={p:.2f})", width="stretch")
        word_col.image(looked, caption=looked_caption, width="stretch")
        st.caption("Left: the encoder's ImageNet classifier applied to every region (a class activation map), "
                   "i.e. where the photo's evidence for the category is. Right: where the decoder looked for the "
                   "word.")
    else:
        st.image(looked, caption=looked_caption, width=min(900, max(600, image.width)))


# ----------------------------------------------------------------------------- the attention workbench

def workbench_panel(settings: Settings, loaded: captioner.Captioner, photo: Photo, cap: captioner.Caption
                    ) -> tuple[str, captioner.Caption | None]:
    """Explain a typed sentence, then rank its words at a picked region. Returns (the sentence, its
    explanation, or None when it has no words)."""
    st.header("Explain a sentence")
    st.caption("Type any sentence about the photo: the model reads it word by word (teacher forcing) and shows "
               "where it looks for each word and how likely it finds it. Words below "
               f"p={workbench.LOW_PROB} are highlighted.")
    # keyed by photo and caption: a new photo (or new decode settings) starts the box from its own caption
    sentence = st.text_input("Sentence to explain", value=cap.text,
                             key=f"explain_text-{photo.digest}-{hashlib.sha256(cap.text.encode()).hexdigest()[:12]}")
    explained = explain_or_none(*settings.model_key, photo.digest, sentence, loaded.config.decode.hard_context,
                                photo.image)  # None: no words
    if explained is not None:
        show_explanation(explained, photo.thumb, settings.view)
    region_view(explained, photo.thumb, loaded.grid_size)
    return sentence, explained


def follow_click(grid: int) -> None:
    """A new click on the photo picks its cell in the row and column menus; they start in the middle, and
    a new grid size starts them over."""
    click = st.session_state.get("region_click")
    if click and click.get("unix_time") != st.session_state.get("region_click_seen"):
        st.session_state["region_click_seen"] = click.get("unix_time")
        st.session_state["region_row"], st.session_state["region_col"] = workbench.cell_of_point(
            click["x"], click["y"], click["width"], click["height"], grid)
    for key in ("region_row", "region_col"):
        if st.session_state.get(key) not in range(grid):
            st.session_state[key] = grid // 2


def region_view(explained: captioner.Caption | None, thumb, grid: int) -> None:
    """Click a region: pick a cell of the attention grid (a click or the menus), and the explained
    sentence's words ranked by their attention there."""
    st.header("Click a region")
    st.caption(f"Click the photo (or pick a row and column) to choose a cell of the {grid}x{grid} attention grid: "
               "the words of the sentence above are ranked by how much attention they paid to it (lift: times a "
               "uniform map's share).")
    follow_click(grid)
    col_cell, col_rank = st.columns([1, 1])
    with col_cell:
        pick_row, pick_col = st.columns(2)
        row = pick_row.selectbox("Row", list(range(grid)), key="region_row")
        column = pick_col.selectbox("Column", list(range(grid)), key="region_col")
        marked = workbench.mark_cell(thumb, grid, row, column)
        if streamlit_image_coordinates is not None:
            streamlit_image_coordinates(marked, key="region_click", width="stretch", cursor="crosshair")
            st.caption(f"cell row {row}, column {column}")
        else:
            st.image(marked, caption=f"cell row {row}, column {column}", width="stretch")
    with col_rank:
        if explained is not None:
            st.markdown(html_parts.cell_strip(explained, row, column), unsafe_allow_html=True)
            st.dataframe([{"word": r.word, "position": r.index + 1, "attention": round(r.attention, 4),
                           "lift": round(r.lift, 2)} for r in workbench.rank_words_at(explained, row, column)],
                         hide_index=True, width="stretch", key="region_ranking")
        else:
            st.info("The sentence has no words to rank.")


# ----------------------------------------------------------------------------- comparisons

def compare_panel(settings: Settings, loaded: captioner.Captioner, photo: Photo, cap: captioner.Caption,
                  sentence: str, explained: captioner.Caption | None) -> None:
    """Compare two models: a second checkpoint of the menu, or (one model file) this one at other decode
    settings. Never the model on screen against itself."""
    st.header("Compare two models")
    others = [lb for lb in settings.choices if lb != settings.label]
    on = st.checkbox("Compare with a second checkpoint" if others else "Compare with other decode settings",
                     value=False, key="compare_on")
    if on and not others:
        compare_decode_settings(settings, loaded, photo, cap)
    elif on:
        compare_models(settings, others, photo, cap, sentence, explained)


def compare_decode_settings(settings: Settings, loaded: captioner.Captioner, photo: Photo,
                            cap: captioner.Caption) -> None:
    """One model file: B is the same model at other decode settings, and the page says how to get a second
    model."""
    st.info("Only one model file is available, so B is this model at other decode settings. To compare two "
            "models, export a second model file (`python scripts/export_model.py RUN/best.safetensors "
            "DIR/other.safetensors`) and start the app with `streamlit run app.py -- --checkpoints DIR`.")
    decode_a = dict(settings.decode)
    variants = workbench.same_model_variants(decode_a, loaded.config.decode, has_head(loaded))
    decode_b = variants[st.selectbox("B: the same model with", list(variants), key="compare_variant")]
    try:
        cap_b = get_caption(*settings.model_key, photo.digest, tuple(decode_b.items()), photo.image)
    except Exception as e:  # noqa: BLE001 - a message, not a crash
        st.error(f"Captioning failed with these settings: {type(e).__name__}: {e}")
        st.stop()
    for side, which, used, generated in zip(st.columns(2), "AB", (decode_a, decode_b), (cap, cap_b)):
        with side:
            st.markdown(f"**{which}: {html.escape(settings.label)}, {workbench.settings_line(used)}**")
            st.markdown(f"generated: *{html.escape(generated.text) or '(empty)'}* (log-prob {generated.log_prob:.2f})")
    if cap_b.text == cap.text:
        st.info("Both settings give the same caption for this photo.")
    st.caption("A typed sentence's word probabilities do not depend on decode settings (the model reads it word "
               "by word), so with one model only the generated captions differ; the per-word table needs two models.")


def compare_models(settings: Settings, others: list[str], photo: Photo, cap: captioner.Caption, sentence: str,
                   explained: captioner.Caption | None) -> None:
    """A second checkpoint (B) beside the one on screen: both captions, the typed sentence explained under
    each, and a per-word table. Each side decodes with what its model can use."""
    label_b = st.selectbox("Second checkpoint (B)", others, key="compare_ckpt")
    same = st.checkbox("Decode B with the sidebar's settings too", value=False, key="compare_same_settings",
                       help="Off: each model decodes with the settings stored in its own file (A: the sidebar).")
    path_b = settings.choices[label_b]
    try:
        mtime_b = Path(path_b).stat().st_mtime
        loaded_b = get_model(path_b, mtime_b, settings.dtype)
        decode_b = decode_for(loaded_b, settings.decode) if same else stored_decode(loaded_b)
        cap_b = get_caption(path_b, mtime_b, settings.dtype, photo.digest, decode_b, photo.image)
        explained_b = None if explained is None else get_explanation(  # None: the sentence has no words
            path_b, mtime_b, settings.dtype, photo.digest, sentence, loaded_b.config.decode.hard_context, photo.image)
    except Exception as e:  # noqa: BLE001 - a broken second checkpoint is a message, not a crash
        st.error(f"Cannot use the checkpoint '{label_b}': {type(e).__name__}: {e}")
        st.stop()
    st.markdown(f"The sentence “{html.escape(sentence)}” under both models:")
    for side, which, lb, used, generated, exp in zip(st.columns(2), "AB", (settings.label, label_b),
                                                     (settings.decode, decode_b), (cap, cap_b), (explained, explained_b)):
        with side:
            st.markdown(f"**{which}: {html.escape(lb)}, {workbench.settings_line(dict(used))}**")
            st.markdown(f"generated: *{html.escape(generated.text) or '(empty)'}* ({generated.log_prob:.2f})")
            if exp is not None:
                show_explanation(exp, photo.thumb, settings.view, columns=2)
    if explained is not None:
        st.dataframe(workbench.compare_rows(explained, explained_b), hide_index=True, width="stretch",
                     key="compare_table")


# ----------------------------------------------------------------------------- the page

def main() -> None:
    """The page, top to bottom (Streamlit runs this file again on every interaction)."""
    st.set_page_config(page_title="Show, Attend and Tell", page_icon=":frame_with_picture:", layout="wide")
    st.title("Show, Attend and Tell")
    st.caption("Image captioning with soft attention: for every word, the heat map shows where in the photo "
               "the model was looking when it chose that word.")
    settings, loaded = sidebar()
    photo, cap = caption_panel(settings, loaded)
    sentence, explained = workbench_panel(settings, loaded, photo, cap)
    compare_panel(settings, loaded, photo, cap, sentence, explained)


if __name__ == "__main__":  # `streamlit run` and AppTest run this file as __main__; an import only defines
    main()
