"""The app's sidebar: the checkpoint menu and precision, the decode widgets (starting at the model file's
stored settings, limits from config.DecodeConfig.LIMITS) and the map view."""
from __future__ import annotations

from pathlib import Path

import streamlit as st

import captioner
from ..model.vision import TorchvisionMismatch, torchvision_note
from . import texts, visualize
from .page_state import Decode, Settings, View, checkpoint_choices, get_model, has_head, model_info



def sidebar(folders: tuple[str, ...], selected: str | None = None) -> tuple[Settings, captioner.Captioner]:
    """The sidebar: checkpoint menu and precision, then (the model loaded) its decode settings, the map view
    and a line about the model. Stops with an error when there is no model or it cannot be loaded (a model whose
    encoder needs torchvision, where torch and torchvision do not work together: model/vision.py).
    folders: the operator's model folders; selected: a model file to open on (app.py reads both from the
    command line and the environment: the library never does)."""
    with st.sidebar:
        st.header("Model")
        choices = checkpoint_choices(folders, selected)
        if not choices:
            st.error("No model available: the bundled default model is missing and no *.safetensors file was "
                     "found in the folders this server allows. Train one (.venv/bin/captioner-train --config "
                     "configs/flickr8k_cpu.yaml), or start the app with `-- --checkpoints FOLDER`.")
            st.stop()
        label = st.selectbox("Checkpoint", list(choices))
        native = captioner.preferred_dtype() == "bfloat16"
        dtype = st.selectbox("Precision", list(captioner.api.DTYPES),
                             format_func=lambda d: texts.precision_label(d, native), help=texts.PRECISION_HELP)
    mtime, loaded = load_or_stop(label, choices[label], dtype)
    note = torchvision_note()  # a mismatched pair, harmless to this model: one line, and the page works on
    if note:
        st.warning(note[0].upper() + note[1:] + ".")
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
    except TorchvisionMismatch as e:  # only a file whose encoder is torchvision's (ResNet) needs it: one line
        st.error(str(e))
        st.stop()
    except Exception as e:  # noqa: BLE001 - e.g. a checkpoint from an incompatible version: say so, keep the app alive
        st.error(f"Cannot load the checkpoint '{label}': {type(e).__name__}: {e}")
        st.stop()


def decode_settings(loaded: captioner.Captioner) -> Decode:
    """The "Decoding" widgets, each starting at the model file's own setting."""
    stored = loaded.config.decode
    st.header("Decoding")
    low, high = (int(x) for x in stored.LIMITS["beam_size"])  # the limits every caller checks (config.py)
    beam_size = st.slider("Beam size", min_value=low, max_value=high, value=min(max(stored.beam_size, low), high),
                          help="1 = greedy decoding; larger beams search more captions. Starts at the model "
                               "file's own setting.")
    max_len = st.slider("Maximum caption length (words)", min_value=5, max_value=min(int(stored.LIMITS["max_len"][1]),
                                                                                     max(50, stored.max_len)),
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
    """The "Attention maps" widgets: opacity, outline, smoothing and rendering of every overlay on the page."""
    st.header("Attention maps")
    opacity = st.slider("Overlay opacity", min_value=0.0, max_value=1.0, value=1.0, step=0.05,
                        help="How strongly the photo is dimmed outside where each word looked (0: the bare photo).")
    outline = st.toggle("Outline where half of each word's attention is", value=True,
                        help="The smallest region of the photo that holds half the word's attention, lit and "
                             "outlined; the rest dimmed.")
    smooth = st.slider("Smoothing (grid cells)", min_value=0.0, max_value=2.0, value=0.0, step=0.1,
                       help="Gaussian blur of the upsampled attention map, in units of one attention cell.")
    mode = st.selectbox("Map rendering", list(visualize.MODES),
                        format_func=lambda m: {"bilinear": "smooth (bilinear)", "nearest": "cells (nearest)"}[m],
                        help="How the coarse attention grid is stretched over the photo: bilinear interpolation "
                             "between cell centres, or each cell as a flat block (the grid as computed). Neither "
                             "invents detail finer than one cell.")
    return View(opacity, smooth, mode, outline)
