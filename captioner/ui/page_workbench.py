"""The app's attention workbench: explain a typed sentence, click a region, compare two models (or this one
at other decode settings). The logic is ui/workbench.py's; these functions lay out its widgets."""
from __future__ import annotations

import hashlib
import html
from pathlib import Path

import streamlit as st

import captioner
from . import html as html_parts
from . import workbench
from .page_state import (Settings, Shown, decode_for, explain_or_none, get_caption, get_explanation, get_model,
                         has_head, stored_decode)
from .page_views import show_explanation

try:  # click-to-pick a region; without it the row/column menus still pick one
    from streamlit_image_coordinates import streamlit_image_coordinates
except ImportError:  # pragma: no cover - optional component
    streamlit_image_coordinates = None



def workbench_on() -> bool:
    """The workbench's switch, at the foot of the caption's panels: off, the workbench and the comparison are not
    drawn. A browser redraws every element on the page in each run (a new photo's included), so on a small
    machine they delayed the next caption on screen (docs/performance.md, "The workbench on demand"). A switch
    turned on stays on for the next photos: its state is kept outside the widget's, which Streamlit forgets in any
    run that does not draw it (a bad upload stops the page above it)."""
    st.header("Attention workbench")
    on = st.toggle("Open the workbench: explain a typed sentence, click a region, compare two models",
                   value=st.session_state.get("workbench_wanted", False), key="workbench_on")
    st.session_state["workbench_wanted"] = on
    return on


def workbench_panel(settings: Settings, loaded: captioner.Captioner, photo: Shown, cap: captioner.Caption
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
    st.caption(f"Click the photo (or pick a row and column, numbered from 1 at the top left, as the words are) to "
               f"choose a cell of the {grid}x{grid} attention grid: the words of the sentence above are ranked by how much attention they paid to it (lift: times a "
               "uniform map's share).")
    follow_click(grid)
    col_cell, col_rank = st.columns([1, 1])
    with col_cell:
        pick_row, pick_col = st.columns(2)
        # the menus hold 0-based cells (the maps' indices) and show them from 1, as the word positions are shown
        row = pick_row.selectbox("Row", list(range(grid)), key="region_row", format_func=lambda i: str(i + 1))
        column = pick_col.selectbox("Column", list(range(grid)), key="region_col", format_func=lambda i: str(i + 1))
        marked = workbench.mark_cell(thumb, grid, row, column)
        said = f"cell row {row + 1}, column {column + 1} of {grid}"
        if streamlit_image_coordinates is not None:
            streamlit_image_coordinates(marked, key="region_click", width="stretch", cursor="crosshair")
            st.caption(said)
        else:
            st.image(marked, caption=said, width="stretch")
    with col_rank:
        if explained is not None:
            st.markdown(html_parts.cell_strip(explained, row, column), unsafe_allow_html=True)
            st.dataframe([{"word": r.word, "position": r.index + 1, "attention": round(r.attention, 4),
                           "lift": round(r.lift, 2)} for r in workbench.rank_words_at(explained, row, column)],
                         hide_index=True, width="stretch", key="region_ranking")
        else:
            st.info("The sentence has no words to rank.")


def compare_panel(settings: Settings, loaded: captioner.Captioner, photo: Shown, cap: captioner.Caption,
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


def compare_decode_settings(settings: Settings, loaded: captioner.Captioner, photo: Shown,
                            cap: captioner.Caption) -> None:
    """One model file: B is the same model at other decode settings, and the page says how to get a second
    model."""
    st.info("Only one model file is available, so B is this model at other decode settings. To compare two "
            "models, export a second model file (`.venv/bin/captioner-export RUN/best.safetensors "
            "DIR/other.safetensors`) and start the app with `.venv/bin/streamlit run app.py -- --checkpoints DIR`.")
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


def compare_models(settings: Settings, others: list[str], photo: Shown, cap: captioner.Caption, sentence: str,
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
