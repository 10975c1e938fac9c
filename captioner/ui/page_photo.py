"""The app's photo input (camera, upload of one or several photos, the examples), the gallery of a batch, and
the panel of the photo on screen with its caption and attention maps."""
from __future__ import annotations

import html
from functools import partial
from time import sleep

import streamlit as st

import captioner
from ..concepts.imagenet import THRESHOLD
from ..images import format_names, load_image
from . import gallery, texts
from .page_state import (EXAMPLES, EXAMPLES_DIR, FIGURE_SIDE, GALLERY_COLUMNS, MAX_PHOTO_MB, UPLOAD_TYPES, Decode,
                         Settings, Shown, figure_bytes, get_caption, get_model, photo_label, short_error, shrink)
from .page_views import LEVEL_ICONS, caption_summary, downloads, level_box, overlay_grid, word_label, word_view

# After a new caption, the run waits this long before the photo and its maps: the browser (on a small machine, on
# the same cores) draws the caption while nothing else wants the CPU (docs/performance.md, "The pause after a new
# caption"); the maps come that much later.
DRAW_PAUSE_S = 0.1


def photo_input(settings: Settings) -> Shown:
    """A photo from the camera, an upload (one photo; a new upload replaces it), a batch of photos (a gallery,
    one of them opened below), or one of the bundled example photos; a file that is no usable photo, or one over
    MAX_PHOTO_MB, is an error (a stop when it is the only photo)."""
    col_upload, col_example = st.columns([3, 2])
    with col_upload:
        st.file_uploader(f"Upload a photo ({format_names(' or ')})", type=UPLOAD_TYPES, key=uploader_key("upload"),
                         on_change=take_upload)
        uploaded = st.session_state.get("uploaded")  # (name, bytes): the box itself is empty again (take_upload)
        if uploaded is not None:
            st.button(f"Remove {uploaded[0]} (back to the example photos)", key="drop_upload",
                      on_click=lambda: st.session_state.pop("uploaded", None), icon=":material/close:")
    # the batch and the camera come below: their last values say whether one of them is what the page shows
    elsewhere = bool(st.session_state.get(uploader_key("batch_upload"))) or bool(
        st.session_state.get("camera_on") and st.session_state.get("camera_shot") is not None)
    with col_example:
        example = st.selectbox("... or pick an example photo", list(EXAMPLES), index=0,
                               disabled=uploaded is not None or elsewhere,
                               help="Used when no photo is uploaded, no gallery is shown and no camera photo taken.")
    batch = st.file_uploader(f"... or several photos at once (up to {gallery.MAX_PHOTOS}): a gallery",
                             type=UPLOAD_TYPES, accept_multiple_files=True, key=uploader_key("batch_upload"),
                             on_change=take_batch) or []
    shot = None
    if st.toggle("Take a photo with the camera", value=False, key="camera_on",
                 help="The browser asks for the camera only when this is on; the photo taken is used instead of "
                      "an upload or an example."):
        shot = st.camera_input("Camera", key="camera_shot")
    return chosen_photo(settings, shot, uploaded, batch, example)


def uploader_key(name: str) -> str:
    """The widget key of an uploader ("upload": one photo, "batch_upload": the gallery's), renewed by
    renew(): a new key is a new, empty widget."""
    return f"{name}_{st.session_state.get(name + '_round', 0)}"


def renew(name: str) -> None:
    """Empties uploader `name` by giving it a new key."""
    st.session_state[name + "_round"] = st.session_state.get(name + "_round", 0) + 1


def take_upload() -> None:
    """The single uploader's new file becomes the page's photo (st.session_state["uploaded"]) and the box is
    emptied for the next one. A browser replacing the file a box holds first empties the box: every new photo ran
    the page twice, the first time for the example photo (its caption on screen for a moment, the new photo's
    run waiting for it to stop). The gallery's uploader is emptied too: the last uploader given files decides."""
    given = st.session_state.get(uploader_key("upload"))
    if given is not None:
        st.session_state["uploaded"] = (given.name, given.getvalue())
        renew("upload")
        renew("batch_upload")


def take_batch() -> None:
    """A batch given to the gallery's uploader replaces the single photo: it was kept beside the gallery, and a new
    single photo was hidden behind the gallery."""
    if st.session_state.get(uploader_key("batch_upload")):
        st.session_state.pop("uploaded", None)


def chosen_photo(settings: Settings, shot, uploaded, batch: list, example: str) -> Shown:
    """The photo on screen from what was given, in this order: a camera shot, a batch (the gallery), an
    upload, the example."""
    if shot is not None:
        files = [("camera.jpg", shot.getvalue())]
    elif batch:
        if len(batch) > gallery.MAX_PHOTOS:  # the uploader appends a new batch to the old: the newest are shown
            st.warning(f"{len(batch)} photos chosen: at most {gallery.MAX_PHOTOS} are captioned at once, so the "
                       f"last {gallery.MAX_PHOTOS} chosen are shown; remove some (×) to see the earlier ones.")
        files = [(f.name, f.getvalue()) for f in batch[-gallery.MAX_PHOTOS:]]
    elif uploaded is not None:
        files = [uploaded]
    else:
        files = [(EXAMPLES[example], (EXAMPLES_DIR / EXAMPLES[example]).read_bytes())]
    photos = []
    for name, data in files:
        if len(data) > MAX_PHOTO_MB * 2**20:
            st.error(f"Cannot use **{name}**: it is {len(data) / 2**20:.0f} MB, more than the {MAX_PHOTO_MB} MB a "
                     "photo may have here. Please choose a smaller photo (a JPEG of it, or fewer pixels).")
            continue
        try:
            photos.append(Shown(name, data, load_image(data)))
        except captioner.ImageError as e:
            st.error(f"Cannot use **{name}**: {short_error(e)}. Please choose another photo.")
    if not photos:
        st.stop()
    return photos[0] if len(files) == 1 else gallery_panel(settings, photos)


@st.cache_data(show_spinner="Captioning the photos ...", max_entries=8)
def get_gallery(path: str, mtime: float, dtype: str, digests: tuple[str, ...], decode: Decode, _images
                ) -> list[captioner.Caption]:
    """A batch of photos read and decoded together (Captioner.caption_batch), cached per model, photos and
    settings."""
    return get_model(path, mtime, dtype).caption_batch(list(_images), **dict(decode))


def gallery_panel(settings: Settings, photos: list[Shown]) -> Shown:
    """Several photos: captioned together and shown as cards (thumbnail, caption, top concepts, notes), the
    batch's downloads (CSV, JSON, figures as ZIP); the photo picked opens below with its overlays."""
    caps = get_gallery(*settings.model_key, tuple(p.digest for p in photos), settings.decode, [p.image for p in photos])
    st.header(f"{len(photos)} photos")
    side = gallery.thumbnail_side(len(photos), GALLERY_COLUMNS)
    columns = st.columns(GALLERY_COLUMNS)
    for i, (photo, cap) in enumerate(zip(photos, caps)):
        with columns[i % GALLERY_COLUMNS], st.container(border=True):
            gallery_card(f"{i + 1}. {photo.name}", shrink(photo.image, side), cap)
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


def gallery_card(label: str, thumb, cap: captioner.Caption) -> None:
    """One photo of the gallery: its thumbnail, caption, how sure, concepts and notes. An unsure caption is a box
    named by its level (page_views.level_box: an info box when probably right, a warning when it may be or probably is
    wrong) with the reason, never the plain line a sure one is."""
    st.image(thumb, caption=label)
    said = f"“{html.escape(cap.text)}”" if cap.words else "“” (empty caption)"
    if cap.sure is False:  # a box as loud as the doubt (page_views.level_box)
        advice = texts.level_advice(cap.level, cap.doubt)
        level_box(cap.level)(f"**{texts.level_head(cap.confidence, cap.level)}:** {said}  \n"
                             f"{advice[0].upper()}{advice[1:]}.", icon=LEVEL_ICONS[cap.level])
    else:
        st.markdown(said)
        if cap.confidence is not None:
            st.caption(texts.sure_line(cap.confidence, cap.level, cap.doubt))
    if cap.concepts:
        st.caption(f"sees (P ≥ {THRESHOLD}) " + gallery.top_concepts(cap))
    for note in cap.notes:
        st.caption(note)


def caption_or_stop(settings: Settings, photo: Shown) -> captioner.Caption:
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


def caption_panel(settings: Settings, loaded: captioner.Captioner) -> tuple[Shown, captioner.Caption]:
    """Shown input; the photo beside its caption, concepts, beam hypotheses and downloads; then where the
    model looked for one word and for every word. Stops after the downloads when the caption has no words."""
    photo = photo_input(settings)
    cap = caption_or_stop(settings, photo)
    col_photo, col_text = st.columns([1, 1])
    with col_text:  # the caption first: it is on screen before the photo and its maps are drawn
        caption_summary(cap, settings.evidence, loaded.config.decode.length_penalty)
    shown = (settings.model_key, photo.digest, settings.decode)
    if st.session_state.get("captioned") != shown:  # a new caption, not a rerun of one on screen
        st.session_state["captioned"] = shown
        sleep(DRAW_PAUSE_S)
    with col_photo:
        st.image(photo.image, caption=photo_label(photo), width="stretch")
    with col_text:
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
