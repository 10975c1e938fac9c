"""Streamlit app: caption a photo and show where the model looked for each word.

    streamlit run app.py

Layout and widgets only; loading, captioning and drawing live in the captioner package.
The env var CAPTIONER_CHECKPOINT (optional) names the checkpoint selected when the app opens. The folders
whose model files the page offers are the operator's: `streamlit run app.py -- --checkpoints DIR [DIR ...]`
or CAPTIONER_CHECKPOINT_DIRS (default: runs/ under the working directory); a visitor never types a path.
"""
from __future__ import annotations

import hashlib
import html
import os
import sys
from functools import partial
from pathlib import Path

import streamlit as st

import captioner
from captioner.concepts.imagenet import imagenet_head_or_none
from captioner.ui import html as html_parts
from captioner.ui import checkpoints, texts, visualize, workbench
from captioner.images import file_extensions, format_names, load_image

try:  # click-to-pick a region; without it the row/column menus still pick one
    from streamlit_image_coordinates import streamlit_image_coordinates
except ImportError:  # pragma: no cover - optional component
    streamlit_image_coordinates = None

EXAMPLES_DIR = Path(captioner.__file__).resolve().parent / "assets" / "examples"
EXAMPLES = {"Cat": "cat.jpg", "Coffee": "coffee.jpg", "Astronaut": "astronaut.jpg"}
UPLOAD_TYPES = file_extensions()  # exactly what load_image reads (images.FORMATS), as its errors list them
GRID_COLUMNS = 4
GRID_SIDE = 320  # grid overlays are drawn on a copy of the photo at most this many pixels on a side
FIGURE_SIDE = 400  # the downloadable figure's panels likewise
DEFAULT_LABEL = "bundled default model"


# ----------------------------------------------------------------------------- cached resources

@st.cache_resource(show_spinner="Loading model ...", max_entries=4)
def get_model(path: str, mtime: float, dtype: str = "float32") -> captioner.Captioner:
    """One model per checkpoint file and precision per process (mtime in the key: a rewritten file
    is reloaded)."""
    return captioner.load(path, dtype=dtype)


@st.cache_resource(show_spinner=False, max_entries=16)
def get_features(path: str, mtime: float, dtype: str, digest: str, _image):
    """One photo's annotation vectors (1, P, D) under one model (keyed by the photo's digest): the encoder
    runs once per photo and model, so new decode settings, a typed sentence, another word or region,
    or a comparison only decode (Captioner.caption_features / explain_features). Never modified."""
    return get_model(path, mtime, dtype).features(_image)


@st.cache_data(show_spinner=False, max_entries=64)
def get_caption(path: str, mtime: float, dtype: str, digest: str, settings: tuple[tuple[str, object], ...],
                _image) -> captioner.Caption:
    """Caption of one decoded photo (keyed by its digest and the decode settings as (name, value) pairs),
    so moving the opacity or word sliders does not decode again."""
    feats = get_features(path, mtime, dtype, digest, _image)
    model = get_model(path, mtime, dtype)
    return model.note_photo_sizes(model.caption_features(feats, **dict(settings)), [_image.size])[0]


@st.cache_data(show_spinner=False, max_entries=64)
def get_explanation(path: str, mtime: float, dtype: str, digest: str, text: str, hard_context: str,
                    _image) -> captioner.Caption:
    """A typed sentence teacher-forced on one photo (Captioner.explain), cached per model, photo and text."""
    feats = get_features(path, mtime, dtype, digest, _image)  # (a small photo's note is shown once, by the caption)
    return get_model(path, mtime, dtype).explain_features(feats, text, hard_context=hard_context)


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


def shrink(image, side: int):
    """A copy of the photo, longer side at most `side`, same aspect ratio."""
    small = image.copy()
    small.thumbnail((side, side))
    return small


def figure_bytes(image, cap: captioner.Caption, opacity: float, smooth: float, mode: str = "bilinear") -> bytes:
    """The downloadable figure, drawn only when the button is clicked."""
    return visualize.figure_png(visualize.attention_figure(image, cap, opacity=opacity, smooth=smooth, mode=mode))


def word_label(cap: captioner.Caption, i: int) -> str:
    """'dog (β=0.82)', or just 'dog' when the caption carries no betas."""
    b = visualize.word_beta(cap, i)
    return cap.words[i] if b is None else f"{cap.words[i]} (β={b:.2f})"


def overlay_grid(image, cap: captioner.Caption, labels: list[str], view: tuple[float, float, str],
                 columns: int = GRID_COLUMNS) -> None:
    """One small overlay per word (the caption's "All words" and an explained sentence's alike), titled
    by `labels`; view = (opacity, smoothing, rendering mode) from the sidebar."""
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


def show_explanation(cap: captioner.Caption, image, view: tuple[float, float, str], columns: int = GRID_COLUMNS) -> None:
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
    overlay_grid(image, cap, explanation_labels(cap), view, columns)


def has_head(model: captioner.Captioner) -> bool:
    """Whether the model's encoder keeps the ImageNet head that evidence-aware decoding reads."""
    return imagenet_head_or_none(model.model) is not None


def settings_for(model: captioner.Captioner, overrides: tuple[tuple[str, object], ...]) -> tuple[tuple[str, object], ...]:
    """The page's decode settings as one model may use them: evidence off where its encoder has no head
    (a ResNet checkpoint beside the bundled model in a comparison)."""
    return tuple((k, v and has_head(model) if k == "evidence" else v) for k, v in overrides)


def short_error(e: Exception) -> str:
    return str(e).removeprefix("image: ")


# ----------------------------------------------------------------------------- page

st.set_page_config(page_title="Show, Attend and Tell", page_icon=":frame_with_picture:", layout="wide")
st.title("Show, Attend and Tell")
st.caption("Image captioning with soft attention: for every word, the heat map shows where in the photo "
           "the model was looking when it chose that word.")

# --- sidebar: model and decoding settings
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
    ckpt_path = choices[label]
    native = captioner.preferred_dtype() == "bfloat16"
    dtype = st.selectbox("Precision", list(captioner.api.DTYPES),
                         format_func=lambda d: texts.precision_label(d, native), help=texts.PRECISION_HELP)

try:
    mtime = Path(ckpt_path).stat().st_mtime
    model = get_model(ckpt_path, mtime, dtype)
except (captioner.CheckpointError, OSError) as e:
    st.error(f"Cannot load the checkpoint '{label}': {e}")
    st.stop()
except Exception as e:  # noqa: BLE001 - e.g. a checkpoint from an incompatible version: say so, keep the app alive
    st.error(f"Cannot load the checkpoint '{label}': {type(e).__name__}: {e}")
    st.stop()
with st.sidebar:
    st.header("Decoding")
    beam_size = st.slider("Beam size", min_value=1, max_value=10, value=min(max(model.config.decode.beam_size, 1), 10),
                          help="1 = greedy decoding; larger beams search more captions. Starts at the model "
                               "file's own setting.")
    stored = model.config.decode
    max_len = st.slider("Maximum caption length (words)", min_value=5, max_value=max(50, stored.max_len),
                        value=max(5, stored.max_len), help="Starts at the model file's own setting.")
    block_trigrams = st.checkbox("Never repeat a phrase (trigram blocking)", value=stored.block_trigrams,
                                 help="Starts at the model file's own setting.")
    block_bigrams = st.checkbox("Never repeat a word pair (bigram blocking)", value=stored.block_bigrams,
                                help="No bigram ending in a content word twice ('white and white'). Starts at the "
                                     "model file's own setting.")
    # evidence-aware decoding needs the encoder's ImageNet head: offered only for models that keep one
    evidence = has_head(model) and st.toggle(
        "Say only what the encoder sees (evidence-aware decoding)", value=stored.evidence,
        help=texts.evidence_help(stored))  # what it does with this file's stored floor, bonus and person floor
    decode_overrides = (("beam_size", beam_size), ("max_len", max_len), ("block_trigrams", block_trigrams),
                        ("block_bigrams", block_bigrams), ("evidence", evidence))
    st.header("Attention maps")
    opacity = st.slider("Overlay opacity", min_value=0.0, max_value=1.0, value=0.6, step=0.05)
    smooth = st.slider("Smoothing (grid cells)", min_value=0.0, max_value=2.0, value=0.0, step=0.1,
                       help="Gaussian blur of the upsampled attention map, in units of one attention cell.")
    mode = st.selectbox("Map rendering", list(visualize.MODES),
                        format_func=lambda m: {"bilinear": "smooth (bilinear)", "nearest": "cells (nearest)"}[m],
                        help="How the coarse attention grid is stretched over the photo: bilinear interpolation "
                             "between cell centres, or each cell as a flat block (the grid as computed). Neither "
                             "invents detail finer than one cell.")
    info = f"{model.config.model.encoder}, {model.grid_size}x{model.grid_size} attention grid, " \
           f"{len(model.vocab):,} words"
    val = model.metrics.get("val") if isinstance(model.metrics.get("val"), dict) else {}
    scores = [f"{k.replace('_', '-')} {val[k]:.3f}" for k in ("Bleu_4", "CIDEr") if isinstance(val.get(k), (int, float))]
    if scores:
        info += " | validation " + ", ".join(scores)
    st.caption(info)

# --- input: an upload, or one of the bundled example photos
col_upload, col_example = st.columns([3, 2])
with col_upload:
    uploaded = st.file_uploader(f"Upload a photo ({format_names(' or ')})", type=UPLOAD_TYPES)
with col_example:
    example = st.selectbox("... or pick an example photo", list(EXAMPLES), index=0,
                           disabled=uploaded is not None,
                           help="Used when no photo is uploaded.")

if uploaded is not None:
    name, data = uploaded.name, uploaded.getvalue()
else:
    name = EXAMPLES[example]
    data = (EXAMPLES_DIR / name).read_bytes()

try:
    image = load_image(data)
except captioner.ImageError as e:
    st.error(f"Cannot use **{name}**: {short_error(e)}. Please choose another photo.")
    st.stop()

with st.spinner("Captioning ..."):
    try:
        cap = get_caption(ckpt_path, mtime, dtype, hashlib.sha256(data).hexdigest(), decode_overrides, image)
    except captioner.ImageError as e:
        st.error(f"Cannot use **{name}**: {short_error(e)}")
        st.stop()
    except Exception as e:  # noqa: BLE001 - show the problem in the page, keep the app alive
        st.error(f"Captioning failed with this checkpoint: {type(e).__name__}: {e}")
        st.stop()

# --- caption and the other beam hypotheses
col_photo, col_text = st.columns([1, 1])
with col_photo:
    st.image(image, caption=f"{name} ({image.width}x{image.height})", width="stretch")
with col_text:
    st.subheader(f"“{cap.text}”" if cap.words else "“” (empty caption)")
    line = html_parts.beta_line(cap)
    if line:
        st.markdown(line, unsafe_allow_html=True)
        st.caption("β: the gate that scales how much of the attended image reaches each word (Xu et al. 2015, "
                   "4.2.1). Faint words (low β) were chosen mostly from the language model, not the photo; their "
                   "heat maps are drawn fainter in proportion.")
    st.markdown(f"log-probability **{cap.log_prob:.2f}** over {len(cap.words)} words + end")
    for note in cap.notes:  # e.g. a photo far smaller than the model's input
        st.info(note)
    if cap.concepts:
        st.markdown("What the encoder sees (its ImageNet classifier; person and scene words: the model's word "
                    "detectors)" if cap.detections else "What the encoder's ImageNet classifier sees")
        st.markdown(html_parts.concepts_html(cap.concepts), unsafe_allow_html=True)
    if cap.contradicted:
        st.warning("The classifier sees no sign of: " + ", ".join(f"**{cap.words[i]}**" for i in cap.contradicted)
                   + (". Switch on evidence-aware decoding to veto such words." if not evidence else "."))
    if cap.alternatives:  # in full (a table, not a grid that cuts long captions), with the score that ranked them
        st.markdown("Beam hypotheses (rank 1 is the caption above)")
        st.table(workbench.hypothesis_rows(cap))
        st.caption(workbench.ranking_note(model.config.decode.length_penalty))
    stem = Path(name).stem or "image"
    st.download_button("Download attention figure (PNG)", icon=":material/download:",
                       data=partial(figure_bytes, shrink(image, FIGURE_SIDE), cap, opacity, smooth, mode),
                       file_name=f"{stem}_attention.png", mime="image/png", on_click="ignore")
    st.download_button("Download caption and attention maps (JSON)", icon=":material/download:",
                       data=visualize.caption_json_bytes(cap, image_name=name),
                       file_name=f"{stem}_caption.json", mime="application/json", on_click="ignore")

if not cap.words:
    st.warning("The model ended the caption straight away, so there are no words to show attention for. "
               "Try beam size 1 or another checkpoint.")
    st.stop()

# --- one word, large
st.header("Where the model looked")
n = len(cap.words)
if n > 1:
    k = st.select_slider("Word", options=list(range(n)), value=0,
                         format_func=lambda i: f"{i + 1}. {cap.words[i]}")
else:
    k = 0
beta_k = visualize.word_beta(cap, k)
looked = visualize.overlay(image, cap.alphas[k], opacity, smooth, beta=beta_k, mode=mode)
looked_caption = (f"where “{cap.words[k]}” looked (word {k + 1} of {n}"
                  + ("" if beta_k is None else f", β={beta_k:.2f}") + ")")
if k in cap.concept_maps:  # the word names something the ImageNet classifier sees: its map beside the word's
    category, p, cmap = cap.concept_maps[k]
    seen, word_col = st.columns(2)
    what = "the clothes people wear" if category == "person" else f"a {category}"
    seen.image(visualize.overlay(image, cmap, opacity, smooth, mode=mode),
               caption=f"where the classifier sees {what} (P={p:.2f})", width="stretch")
    word_col.image(looked, caption=looked_caption, width="stretch")
    st.caption("Left: the encoder's ImageNet classifier applied to every region (a class activation map), i.e. "
               "where the photo's evidence for the category is. Right: where the decoder looked for the word.")
else:
    st.image(looked, caption=looked_caption, width=min(900, max(600, image.width)))

# --- every word
st.header("All words")
thumb = shrink(image, GRID_SIDE)
view = (opacity, smooth, mode)
overlay_grid(thumb, cap, [f"{i + 1}. {word_label(cap, i)}" for i in range(n)], view)

# ----------------------------------------------------------------------------- the attention workbench
digest = hashlib.sha256(data).hexdigest()
hard_context = model.config.decode.hard_context

st.header("Explain a sentence")
st.caption("Type any sentence about the photo: the model reads it word by word (teacher forcing) and shows where "
           "it looks for each word and how likely it finds it. Words below "
           f"p={workbench.LOW_PROB} are highlighted.")
# keyed by photo and caption: a new photo (or new decode settings) starts the box from its own caption
sentence = st.text_input("Sentence to explain", value=cap.text,
                         key=f"explain_text-{digest}-{hashlib.sha256(cap.text.encode()).hexdigest()[:12]}")
explained = explain_or_none(ckpt_path, mtime, dtype, digest, sentence, hard_context, image)  # None: no words
if explained is not None:
    show_explanation(explained, thumb, view)

st.header("Click a region")
G = model.grid_size
st.caption(f"Click the photo (or pick a row and column) to choose a cell of the {G}x{G} attention grid: the words "
           "of the sentence above are ranked by how much attention they paid to it (lift: times a uniform map's "
           "share).")
click = st.session_state.get("region_click")
if click and click.get("unix_time") != st.session_state.get("region_click_seen"):  # a new click picks its cell
    st.session_state["region_click_seen"] = click.get("unix_time")
    st.session_state["region_row"], st.session_state["region_col"] = workbench.cell_of_point(
        click["x"], click["y"], click["width"], click["height"], G)
for key in ("region_row", "region_col"):  # start in the middle; a new grid size starts over
    if st.session_state.get(key) not in range(G):
        st.session_state[key] = G // 2
col_cell, col_rank = st.columns([1, 1])
with col_cell:
    pick_row, pick_col = st.columns(2)
    row = pick_row.selectbox("Row", list(range(G)), key="region_row")
    column = pick_col.selectbox("Column", list(range(G)), key="region_col")
    marked = workbench.mark_cell(thumb, G, row, column)
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

st.header("Compare two models")
others = [lb for lb in choices if lb != label]  # never the model on screen: that would compare it with itself
compare = st.checkbox("Compare with a second checkpoint" if others else "Compare with other decode settings",
                      value=False, key="compare_on")
if compare and not others:
    # one model file: B is the same model at other decode settings, and the page says how to get a second model
    st.info("Only one model file is available, so B is this model at other decode settings. To compare two "
            "models, export a second model file (`python scripts/export_model.py RUN/best.safetensors "
            "DIR/other.safetensors`) and start the app with `streamlit run app.py -- --checkpoints DIR`.")
    variants = workbench.same_model_variants(dict(decode_overrides), stored, has_head(model))
    settings_b = variants[st.selectbox("B: the same model with", list(variants), key="compare_variant")]
    try:
        cap_b = get_caption(ckpt_path, mtime, dtype, digest, tuple(settings_b.items()), image)
    except Exception as e:  # noqa: BLE001 - a message, not a crash
        st.error(f"Captioning failed with these settings: {type(e).__name__}: {e}")
        st.stop()
    for side, which, used, generated in zip(st.columns(2), "AB", (dict(decode_overrides), settings_b), (cap, cap_b)):
        with side:
            st.markdown(f"**{which}: {html.escape(label)}, {workbench.settings_line(used)}**")
            st.markdown(f"generated: *{html.escape(generated.text) or '(empty)'}* (log-prob {generated.log_prob:.2f})")
    if cap_b.text == cap.text:
        st.info("Both settings give the same caption for this photo.")
    st.caption("A typed sentence's word probabilities do not depend on decode settings (the model reads it word "
               "by word), so with one model only the generated captions differ; the per-word table needs two models.")
elif compare:
    label_b = st.selectbox("Second checkpoint (B)", others, key="compare_ckpt")
    path_b = choices[label_b]
    try:
        mtime_b = Path(path_b).stat().st_mtime
        model_b = get_model(path_b, mtime_b, dtype)
        cap_b = get_caption(path_b, mtime_b, dtype, digest, settings_for(model_b, decode_overrides), image)
        explained_b = None if explained is None else get_explanation(  # None: the sentence has no words
            path_b, mtime_b, dtype, digest, sentence, model_b.config.decode.hard_context, image)
    except Exception as e:  # noqa: BLE001 - a broken second checkpoint is a message, not a crash
        st.error(f"Cannot use the checkpoint '{label_b}': {type(e).__name__}: {e}")
        st.stop()
    st.markdown(f"The sentence “{html.escape(sentence)}” under both models:")
    for side, which, lb, generated, exp in zip(st.columns(2), "AB", (label, label_b), (cap, cap_b),
                                               (explained, explained_b)):
        with side:
            st.markdown(f"**{which}: {html.escape(lb)}**")
            st.markdown(f"generated: *{html.escape(generated.text) or '(empty)'}* ({generated.log_prob:.2f})")
            if exp is not None:
                show_explanation(exp, thumb, view, columns=2)
    if explained is not None:
        st.dataframe(workbench.compare_rows(explained, explained_b), hide_index=True, width="stretch",
                     key="compare_table")
