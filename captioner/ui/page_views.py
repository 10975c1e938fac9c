"""The app's views of one caption: the summary beside the photo (caption, gate, notes, concepts, hypotheses,
downloads), the large single-word view, the per-word grid and an explained sentence."""
from __future__ import annotations

import hashlib
import html
from functools import partial
from pathlib import Path

import streamlit as st

import captioner
from ..concepts.imagenet import THRESHOLD as CONCEPT_THRESHOLD
from ..concepts.words import CATEGORY_WORDS, match_words, word_table
from ..vocab import COLOUR_WORDS, FUNCTION_WORDS
from . import html as html_parts
from . import animate, texts, visualize, workbench
from .page_state import FIGURE_SIDE, GRID_COLUMNS, Shown, View, figure_bytes, shrink



def word_label(cap: captioner.Caption, i: int) -> str:
    """'dog p=0.61 (β=0.82)': the word, its probability and its gate (each left out when the caption carries
    none; the gate also where it is open for every word)."""
    p, b = visualize.word_prob(cap, i), visualize.shown_beta(cap, i)  # b None: the gate open, nothing to show
    return cap.words[i] + ("" if p is None else f" {visualize.prob_text(p)}") + ("" if b is None else f" (β={b:.2f})")


SCALE_CAPTION = ("Lit and outlined: the smallest part of the photo that holds half of the word's attention; "
                 "dimmed: the rest. On both sides brighter means more attention, relative to that word's own peak "
                 "(each map is scaled to its own maximum: compare where words looked, not how much).")


def scale_legend() -> None:
    """The overlays' scale (the figures' own, visualize.scale_png) with its words."""
    st.image(visualize.scale_png(), caption=SCALE_CAPTION, width=720)


def draw(image, alpha, view: View, beta: float | None = None):
    """One overlay as every view of the page draws it: visualize.overlay at the sidebar's view."""
    return visualize.overlay(image, alpha, view.opacity, view.smooth, beta=beta, mode=view.mode, outline=view.outline)


def overlay_grid(image, cap: captioner.Caption, labels: list[str], view: View, columns: int = GRID_COLUMNS) -> None:
    """One small overlay per word (the caption's "All words" and an explained sentence's alike), titled
    by `labels`, under the overlays' scale."""
    scale_legend()
    for start in range(0, len(cap.words), columns):
        for col, i in zip(st.columns(columns), range(start, min(start + columns, len(cap.words)))):
            with col:
                st.image(draw(image, cap.alphas[i], view, visualize.word_beta(cap, i)), caption=labels[i],
                         width="stretch")


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


def caption_summary(cap: captioner.Caption, evidence: bool, length_penalty: float) -> None:
    """What a person came for, first: the caption, how far to trust it, the photo's notes, what the encoder sees;
    the model's details (each word's β, the log-probability, the beam's hypotheses and why this one was chosen)
    folded below, for whoever inspects the model."""
    st.subheader(f"“{cap.text}”" if cap.words else "“” (empty caption)")
    sure_view(cap)
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
    with st.expander("How it chose (the beam's other captions, their scores, each word's gate)"):
        model_details(cap, length_penalty)


def model_details(cap: captioner.Caption, length_penalty: float) -> None:
    """Each word's β, the caption's log-probability, the beam's hypotheses and why this one was chosen."""
    line = html_parts.beta_line(cap)
    if line:
        st.markdown(line, unsafe_allow_html=True)
        st.caption("β: the gate that scales how much of the attended image reaches each word (Xu et al. 2015, "
                   "4.2.1). Faint words (low β) drew less on the photo than the others; their "
                   "overlays are drawn fainter in proportion.")
    elif visualize.gate_open(cap):
        st.caption(f"The gate β (Xu et al. 2015, 4.2.1: how much of the attended image reaches a word) is open for "
                   f"every word of this caption (β ≥ {visualize.GATE_OPEN}): each word saw the whole attended "
                   "context, so it is not shown per word (the JSON download lists it).")
    st.markdown(f"log-probability **{cap.log_prob:.2f}** over {len(cap.words)} words + end")
    if cap.alternatives:  # in full (a table, not a grid that cuts long captions), with the score that ranked them
        st.markdown("Beam hypotheses (rank 1 is the caption above)")
        st.table(workbench.hypothesis_rows(cap))
        st.caption(workbench.ranking_note(length_penalty, [cap.score] + [a.score for a in cap.alternatives]))
        why = workbench.choice_note(cap)
        if why:
            st.caption(why)


# an unsure caption's box, as loud as its level's doubt (Caption.level): probably wrong is an error box
LEVEL_ICONS = {"probably right": ":material/info:", "may be wrong": ":material/help:",
               "probably wrong": ":material/block:"}


def level_box(level: str):
    """The box an unsure caption's line goes in: st.info when probably right, st.warning when it may be wrong,
    st.error when it is probably wrong (docs/confidence.md)."""
    return {"probably right": st.info, "may be wrong": st.warning}.get(level, st.error)


def sure_view(cap: captioner.Caption) -> None:
    """How sure, under the caption: a quiet line when sure; when unsure the reason and the beam's other captions
    beside it (not folded away)."""
    line = texts.sure_line(cap.confidence, cap.level, cap.doubt)
    if cap.sure is not False:
        st.caption(line)
        return
    level_box(cap.level)(line, icon=LEVEL_ICONS[cap.level])
    if cap.different_alternatives:  # those that say something else, not five near-identical lines
        st.markdown("Other ways it could say it: " + " · ".join(f"“{a}”" for a in cap.different_alternatives))


def downloads(photo: Shown, cap: captioner.Caption, view: View) -> None:
    """The attention figure and the caption as it is written (each drawn only when asked for) and the caption with
    its maps as JSON."""
    stem = Path(photo.name).stem or "image"
    st.download_button("Download attention figure (PNG)", icon=":material/download:",
                       data=partial(figure_bytes, shrink(photo.image, FIGURE_SIDE), cap, view),
                       file_name=f"{stem}_attention.png", mime="image/png", on_click="ignore")
    st.download_button("Download caption and attention maps (JSON)", icon=":material/download:",
                       data=visualize.caption_json_bytes(cap, image_name=photo.name),
                       file_name=f"{stem}_caption.json", mime="application/json", on_click="ignore")
    if cap.words:  # drawn when asked for (as long as all the overlays): the caption and its maps first
        if st.toggle("Play the caption as it is written (a frame per word)", value=False, key="play_caption"):
            maps_key = hashlib.sha256(cap.alphas.tobytes() + cap.text.encode()).hexdigest()  # its words and maps
            st.image(caption_gif(photo.digest, maps_key, cap, view.opacity, _image=photo.image),
                     caption=f"“{cap.text}”, word by word, with where each word looked")
        st.download_button("Download the caption as it is written (GIF)", icon=":material/download:",
                           data=partial(animate.caption_animation, photo.image, cap, opacity=view.opacity),
                           file_name=f"{stem}_caption.gif", mime="image/gif", on_click="ignore")


@st.cache_data(show_spinner=False, max_entries=32)
def caption_gif(digest: str, maps_key: str, _cap: captioner.Caption, opacity: float, _image) -> bytes:
    """The caption's animation (ui/animate.py), drawn once per photo, caption and opacity."""
    return animate.caption_animation(_image, _cap, opacity=opacity)


# words that describe the thing a caption names before naming it ("a small brown dog", "two young girls"): the
# big overlay skips them with the colours, to open on the thing itself
MODIFIERS = frozenset(
    "small large big little young old older elderly tall wet dry dark bright two three four five several many some "
    "other colorful colourful multicolored multi-colored striped empty smiling happy blond blonde shirtless long "
    "furry fluffy huge giant tiny pretty busy crowded snowy grassy sandy rocky muddy shaggy spotted curly".split())
NAMES = word_table(CATEGORY_WORDS)  # every word naming a COCO category or a person ("man", "player", "dog" ...)


def first_noun(words: list[str]) -> int:
    """The index the big overlay opens on: the first word that names a thing, not "a" nor the colour or size
    before it ("a brown dog" -> dog, "a black and white cat" -> cat, "two young girls" -> girls); a word before
    one that names a COCO category is that category's modifier ("a tennis player" -> player). The first word
    that is not a function word when nothing else qualifies."""
    named = {i for i, _ in match_words(words, NAMES)}
    for i, w in enumerate(words):
        if w in FUNCTION_WORDS or w in COLOUR_WORDS or w in MODIFIERS:
            continue
        return i + 1 if i + 1 in named and i not in named else i
    return next((i for i, w in enumerate(words) if w not in FUNCTION_WORDS), 0)


def word_view(image, cap: captioner.Caption, view: View) -> None:
    """One word's attention map, large; beside it the classifier's map when the word names what it sees."""
    st.header("Where the model looked")
    n = len(cap.words)
    if n > 1:
        k = st.select_slider("Show where this caption word looked", options=list(range(n)),
                             value=first_noun(cap.words), format_func=lambda i: f"{i + 1}. {cap.words[i]}")
    else:
        k = 0
    if k in cap.unsupported:  # the map of a word naming what is not there lights something else (a trunk for "man")
        st.warning(f"The encoder barely sees {cap.words[k]!r} in this photo: the region it lit may be something "
                   "else that the model took for it.")
    beta_k = visualize.word_beta(cap, k)
    looked = draw(image, cap.alphas[k], view, beta_k)
    p = visualize.word_prob(cap, k)
    looked_caption = (f"where “{cap.words[k]}” looked (word {k + 1} of {n}"
                      + ("" if p is None else f", {visualize.prob_text(p)}")
                      + ("" if visualize.shown_beta(cap, k) is None else f", β={beta_k:.2f}") + ")")
    if k in cap.concept_maps:  # the word names something the ImageNet classifier sees: its map beside the word's
        category, p, cmap = cap.concept_maps[k]
        seen, word_col = st.columns(2)
        what = "the clothes people wear" if category == "person" else f"a {category}"
        seen.image(draw(image, cmap, view),
                   caption=f"where the classifier sees {what} (P={p:.2f})", width="stretch")
        word_col.image(looked, caption=looked_caption, width="stretch")
        st.caption("Left: the encoder's ImageNet classifier applied to every region (a class activation map), "
                   "i.e. where the photo's evidence for the category is. Right: where the decoder looked for the "
                   "word.")
    else:
        st.image(looked, caption=looked_caption, width=min(900, max(600, image.width)))
    scale_legend()
