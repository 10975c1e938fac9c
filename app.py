"""Streamlit app: caption a photo and show where the model looked for each word.

    streamlit run app.py

Layout and widgets only; loading, captioning and drawing live in the captioner package.
The env var CAPTIONER_CHECKPOINT (optional) names the checkpoint selected when the app opens. The folders
whose model files the page offers are the operator's: `streamlit run app.py -- --checkpoints DIR [DIR ...]`
or CAPTIONER_CHECKPOINT_DIRS (default: runs/ under the working directory); a visitor never types a path.

The page is main(): sidebar() (checkpoint, precision, decode settings and map view: a Settings), then
caption_panel() (the photo, its caption and attention maps), then, once its switch is on (workbench_on()),
workbench_panel() (explain a typed sentence, click a region) and compare_panel() (a second model, or this one at
other decode settings). A `captioner.Captioner` is called `loaded` here, so `.model` is always the torch module.
"""
from __future__ import annotations

import os
import sys

import streamlit as st

from captioner.ui import checkpoints
from captioner.ui.html import PAGE_STYLE
from captioner.ui.page_photo import caption_panel
from captioner.ui.page_sidebar import sidebar
from captioner.ui.page_state import leave_a_core
from captioner.ui.page_workbench import compare_panel, workbench_on, workbench_panel


def main() -> None:
    """The page, top to bottom (Streamlit runs this file again on every interaction)."""
    leave_a_core()  # for the browser that draws the page
    st.set_page_config(page_title="Show, Attend and Tell", page_icon=":frame_with_picture:", layout="wide")
    st.html(PAGE_STYLE)  # no blank band above the title
    st.title("Show, Attend and Tell")
    st.caption("Image captioning with soft attention: for every word, the lit part of the photo shows where "
               "the model was looking when it chose that word.")
    # the operator, not a visitor, decides which folders the page may load from (README: deploying the app)
    folders = tuple(checkpoints.operator_folders(sys.argv[1:], os.environ.get("CAPTIONER_CHECKPOINT_DIRS")))
    settings, loaded = sidebar(folders, os.environ.get("CAPTIONER_CHECKPOINT"))
    photo, cap = caption_panel(settings, loaded)
    if workbench_on():  # on demand: once drawn, a browser redraws it in every run, a new photo's too
        sentence, explained = workbench_panel(settings, loaded, photo, cap)
        compare_panel(settings, loaded, photo, cap, sentence, explained)


if __name__ == "__main__":  # `streamlit run` and AppTest run this file as __main__; an import only defines
    main()
